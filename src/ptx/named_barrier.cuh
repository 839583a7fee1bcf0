// bar.sync / bar.arrive on a named barrier: synchronizes a subset of a block's warps.
//
// PTX ISA: Parallel Synchronization and Communication Instructions: bar, barrier,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#parallel-synchronization-and-communication-instructions-bar
// Barrier 0 is __syncthreads(); kernels name the others in an enum.
#pragma once

namespace hattn::ptx {

// Waits until `threads` threads (a multiple of 32) have arrived at barrier `id`.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at barrier `id` without waiting.
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace hattn::ptx
