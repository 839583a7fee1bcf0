// Turns on a counter in global memory: the deterministic backward's order of the fp32 sums.
// A CTA waits until the counter reaches its turn, adds (TMA reductions), waits for its adds to
// complete, and passes the turn on. The counters start at 0 (zeroed by the host per call).
//
// PTX ISA: ld (.acquire), red (.release), fence.proxy.async, Memory Consistency Model,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#memory-consistency-model
#pragma once

#include "tma.cuh"

namespace hattn::ptx {

// Spins until *counter reaches turn; acquire at GPU scope, so the adds of the turns before are
// visible. The fence then orders this thread's later bulk reductions (async proxy) after it.
// The counter cannot pass a turn its holder has not passed on; if it did (a turn taken twice,
// a miscount), the wait ends there rather than spin forever, and the sums lose their order, not
// the kernel its end. (A __trap here made ptxas spill 2.4 KB in the consumers.)
__device__ __forceinline__ void wait_turn(const int* counter, int turn) {
  int value;
  while (true) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
    if (value >= turn) break;
    __nanosleep(32);
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Passes the turn on once this thread's bulk reductions have completed (cp.async.bulk.wait_group,
// not .read: the adds themselves, not only their reads of shared memory); the fence orders their
// writes (async proxy) before the release.
__device__ __forceinline__ void pass_turn(int* counter) {
  cp_async_bulk_wait_group<0>();
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

}  // namespace hattn::ptx
