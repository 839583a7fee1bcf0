// cp.async: asynchronous global -> shared copies (sm_80 and later) that bypass the registers,
// tracked per thread in commit groups.
//
// PTX ISA: Data Movement and Conversion Instructions: cp.async, cp.async.commit_group,
// cp.async.wait_group,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cp-async
//
// Completion is per thread: after wait_group a thread sees its own copies; other threads see
// them only after a barrier (__syncthreads) that follows the wait.
#pragma once

#include <cstdint>

namespace hattn::ptx {

// Copies 16 bytes from global to shared, caching in L2 only (.cg). When `in_bounds` is false
// the source size is 0: nothing is read and the 16 destination bytes are zero-filled; the
// source address must still be a valid global address (pass any in-bounds row).
// "memory": writes shared memory behind the compiler's back.
__device__ __forceinline__ void cp_async_cg_shared_global_16(uint32_t smem_addr, const void* gmem, bool in_bounds) {
  const uint32_t src_size = in_bounds ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :
               : "r"(smem_addr), "l"(__cvta_generic_to_global(gmem)), "r"(src_size)
               : "memory");
}

// Closes the group of this thread's cp.async operations issued since the last commit.
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a non-negative immediate");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace hattn::ptx
