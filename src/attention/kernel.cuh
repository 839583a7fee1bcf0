// The production forward's kernel: a persistent, warp-specialized CTA per SM. This file is the
// role dispatch; the roles live beside it:
//   producer.cuh   the producer warpgroup: one thread loads Q and the K/V ring with TMA
//   scheduler.cuh  a varlen batch's sorted list: the thread that takes positions from a counter
//   consumer.cuh   the consumer warpgroups: S = Q K^T, the softmax, O += P V, in turns
//   softmax.cuh    the online softmax (running max and sum, exp2 with the folded scale)
//   mask.cuh       the causal mask, the sliding window, the sequence's keys, softcapping
//   epilogue.cuh   O and the LSE to global memory (or a split item's fp32 parts)
//   work_list.cuh  the work list: the order of items, the tail split, split-KV's parts
//   combine.cuh    the second kernel that merges a split item's parts
//   kv_dequant.cuh an FP8 KV cache: the producer warpgroup's other warps widen its tiles
//   plan.h         the host's decisions; forward.cu the launch
#pragma once

#include <cuda.h>

#include "../common/params.h"
#include "../ptx/griddepcontrol.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/setmaxnreg.cuh"
#include "../ptx/smem.cuh"
#include "../ptx/tma.cuh"
#include "consumer.cuh"
#include "kv_dequant.cuh"
#include "producer.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"
#include "work_list.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// Template flags, so that problems without the features keep the plain tile loop (the causal
// mask or none, with no window or sequence arithmetic):
//   kRuntimeBounds: each item reads its sequence's bounds at run time: a variable-length
//            batch, keys in use (seqlens_k), left padding, cache entries, a paged cache,
//            split-KV parts, GQA packing. These kernels also run softcapping.
//   kWindow: a sliding window, whose edges bound the sweeps and masks. Its kernels also take
//            run-time bounds (kWindow implies kRuntimeBounds), so three of the four
//            combinations are compiled.
//   kFp8Kv:  k and v are an e4m3 cache beside T queries (run-time bounds kernels, no window).
//   kDynamicList: a variable-length batch's sorted list, each CTA taking its next item from a
//            counter as it finishes one (run-time bounds kernels, no window, two consumers).
template <typename T, int D, bool kWide, int kNumConsumers, bool kRuntimeBounds, bool kWindow, bool kFp8Kv = false,
          bool kDynamicList = false>
__global__ void __launch_bounds__(Config<D, kWide, kNumConsumers>::kThreads, 1)
    forward_kernel(const __grid_constant__ CUtensorMap q_map,  // Q [B, Sq, Hq, D], boxes of 64 rows
                   const __grid_constant__ CUtensorMap k_map,  // K [B, Sk, Hkv, D], boxes of kBlockN keys (kFp8Kv: e4m3)
                   const __grid_constant__ CUtensorMap v_map,  // V (FP8: V^T [B][Hkv][D][keys])
                   const __grid_constant__ CUtensorMap o_map,  // O [B, Sq, Hq, D] (when stored by TMA)
                   const __grid_constant__ FeatureParams p, const __grid_constant__ WorkList sched) {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers, kFp8Kv, kDynamicList>;
  static_assert(!kIsFp8<T> || !kRuntimeBounds, "the FP8 forward runs dense batches");
  static_assert(!kFp8Kv || (kRuntimeBounds && !kWindow), "an FP8 KV cache runs in the run-time bounds kernels without a window");
  static_assert(kRuntimeBounds || !kWindow, "the windowed kernels also take run-time bounds");
  static_assert(!kDynamicList || (kRuntimeBounds && !kWindow), "a sorted list runs in the run-time bounds kernels");

  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  // At D <= 128 the offset is added to smem_raw itself: the compiler then still knows the
  // pointer is in shared memory, stores the O staging tile with STS instead of generic ST, and
  // spills less at D = 64 with three consumers (1-3% faster there; results/evidence/
  // smem_base_ab/). D = 256 has no generic access either way and measured 0.4-0.9% slower with
  // it, so it keeps the rounded integer.
  unsigned char* smem_base;
  if constexpr (D <= 128) {
    // The padding made opaque: computed once here, where ptxas otherwise rebuilt it from the
    // block's shared window at every item's epilogue (S2UR and four more instructions).
    uint32_t pad = (kAtomBytes - ptx::cvta_to_shared_u32(smem_raw) % kAtomBytes) % kAtomBytes;
    ptx::fence_operand(pad);
    smem_base = smem_raw + pad;
  } else
    smem_base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) /
                                                 kAtomBytes * kAtomBytes);
  auto& smem = *reinterpret_cast<StorageOf<T, Cfg>*>(smem_base);

  // The consumer index; -1 is the producer. Read from lane 0 so that the compiler knows it is
  // the same in the whole warp and keeps what derives from it (Q's descriptor) in uniform
  // registers.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  // GQA packing: a row is query position row >> pack_shift of query head (item head <<
  // pack_shift) + row % 2^pack_shift (Mask::shift()).
  const ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow> items{
      p, sched, {p, kRuntimeBounds && !kWindow ? p.pack_shift : 0}};

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    if constexpr (Cfg::kStoreByTma) ptx::prefetch_tensormap(&o_map);
#pragma unroll
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      ptx::mbarrier_init(&smem.q_full[c], 1);
      ptx::mbarrier_init(&smem.q_empty[c], 4);  // one arrival per warp of consumer c
    }
    // An FP8 KV cache's tiles are handed on by the dequantizing warps and consumer 1's four
    // warps (or by warp 0 for them, on items where consumer 1 has rows).
    constexpr uint32_t wideners = kDequantWarps + (kFp8Kv ? kHelperWarps : 0);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      // The producer's TMA completes a full barrier; with an FP8 KV cache each widening warp's arrival.
      ptx::mbarrier_init(&smem.k_full[s], kFp8Kv ? wideners : 1);
      ptx::mbarrier_init(&smem.v_full[s], kFp8Kv ? wideners : 1);
      ptx::mbarrier_init(&smem.k_empty[s], Cfg::kConsumers * 4);  // one arrival per consumer warp
      ptx::mbarrier_init(&smem.v_empty[s], Cfg::kConsumers * 4);
    }
    ptx::mbarrier_init(&smem.v_landed, 1);
    if constexpr (kDynamicList) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        ptx::mbarrier_init(&smem.item_full[i], 1);                           // the scheduler's write
        ptx::mbarrier_init(&smem.item_empty[i], 1 + Cfg::kConsumers * 128);  // the producer, each consumer thread
      }
    }
    if constexpr (kFp8Kv) {
#pragma unroll
      for (int s = 0; s < Cfg::kStagingStages; ++s) {
        ptx::mbarrier_init(&smem.k8_full[s], 1);
        ptx::mbarrier_init(&smem.v8_full[s], 1);
        ptx::mbarrier_init(&smem.k8_empty[s], wideners);
        ptx::mbarrier_init(&smem.v8_empty[s], wideners);
      }
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
    // Split-KV: the combine kernel may launch now (one thread issues it for the CTA). Its CTAs
    // take the SMs this grid leaves free and wait there for this grid to finish, so its launch
    // no longer follows the last CTA's exit.
    if constexpr (kRuntimeBounds) {
      if (p.splits > 1) ptx::griddepcontrol_launch_dependents();
    }
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  if (warpgroup < 0) {
    // Producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads.
    ptx::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0)
      produce<T, D, Cfg, kRuntimeBounds, kWindow>(smem, q_map, k_map, v_map, p, sched, items);
    else if (kDynamicList && threadIdx.x == 32)
      hand_out_positions<T, Cfg>(smem, sched, p);  // a list taken from its counter
    if constexpr (kFp8Kv) {
      if (warp_in_wg > 0) dequantize<T, D, Cfg, kRuntimeBounds, kWindow>(smem, p, sched, items, int(threadIdx.x) - 32);
    }
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegisters>();
  const ConsumerThread thread{warpgroup, warp_in_wg, lane, lane / 4, lane % 4, warpgroup * 64 + warp_in_wg * 16};
  consume<T, D, Cfg, kRuntimeBounds, kWindow>(smem, o_map, p, sched, items, thread);
}
#endif

}  // namespace hattn::fwd
