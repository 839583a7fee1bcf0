// mbarrier: shared-memory barriers that count arrivals and transaction bytes.
//
// PTX ISA: Parallel Synchronization and Communication Instructions: mbarrier,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#parallel-synchronization-and-communication-instructions-mbarrier
//
// A barrier completes a phase when its pending arrival count reaches zero and every byte
// announced with expect_tx has landed (TMA copies "complete_tx" on it). Waiters name the
// phase they wait for by its parity (0, 1, 0, ...), so a ring of stages tracks one bit each.
#pragma once

#include <cstdint>

#include "ptx/smem.cuh"

namespace hattn::ptx {

// mbarrier.init: `arrivals` arrive() calls complete each phase.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cvta_to_shared_u32(bar)), "r"(arrivals) : "memory");
}

// fence.mbarrier_init: makes initialized barriers visible to the async proxy (TMA) and to
// other threads before anyone arrives on or waits for them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// mbarrier.arrive.expect_tx: one arrival, and `bytes` more transaction bytes this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(cvta_to_shared_u32(bar)), "r"(bytes)
               : "memory");
}

// mbarrier.arrive: one arrival (release semantics: this thread's prior writes are visible
// to threads that then observe the phase complete).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(cvta_to_shared_u32(bar)) : "memory");
}

// mbarrier.arrive with a count: `count` arrivals at once (a warp that stands in for others).
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(cvta_to_shared_u32(bar)), "r"(count) : "memory");
}

// mbarrier.try_wait.parity in a loop: returns once the phase with `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(cvta_to_shared_u32(bar)),
      "r"(parity)
      : "memory");
}

}  // namespace hattn::ptx
