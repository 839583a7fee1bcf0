// The production backward's kernel: a CTA per 128 keys of one query head (blockIdx.x: the key
// block, y: the head, z: the batch entry or sequence; a causal grid launches in another order,
// work.cuh's cta_coordinates). It sets up shared memory and the barriers, then splits by role:
// a producer warpgroup (producer.cuh; its warps 1 and 2 the dQ writers, dq_writer.cuh) and two
// consumer warpgroups (consumer.cuh).
#pragma once

#include <cuda.h>

#include "../../common/backward_common.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/setmaxnreg.cuh"
#include "../../ptx/smem.cuh"
#include "../../ptx/tma.cuh"
#include "config.h"
#include "consumer.cuh"
#include "dq_writer.cuh"
#include "epilogue.cuh"
#include "producer.cuh"
#include "shared_storage.cuh"
#include "work.cuh"

namespace hattn::bwd {

// dq_map is over the fp32 dQ sum's tiles (make_fp32_tiles_tensor_map); dk_map and dv_map over dK
// and dV where the kernel writes them (a dense batch without GQA: p.dk_accum is null), else over
// their fp32 sums.
template <typename T, int D, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
                    const __grid_constant__ CUtensorMap dq_map, const __grid_constant__ CUtensorMap dk_map,
                    const __grid_constant__ CUtensorMap dv_map, const BackwardParams p) {
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes). An
  // offset added to smem_raw keeps the pointer in the shared window.
  auto& smem = *reinterpret_cast<SharedStorage<T, D, kVarlen>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const FeatureParams& f = p.fwd;
  // Through a shuffle, so that the compiler knows it is warp-uniform and keeps the wgmma
  // descriptors built from it in uniform registers (with plain threadIdx.x / 128, ptxas spilled).
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;  // -1: the producer
  // The deterministic backward takes the key blocks from the last: a query block's adders then
  // take their turns from its last key block down (work.cuh's dq_turn), each waiting only on
  // CTAs launched before it. A causal one takes them heaviest first (work.cuh).
  const CtaCoordinates cta = cta_coordinates<kVarlen, kBlockN>(f, /*deterministic=*/p.dq_turns != nullptr);
  const int n0 = cta.block * kBlockN, head = cta.head, batch = cta.batch;
  const int head_kv = head / f.heads_per_kv;
  const Sequence seq = sequence_at<kVarlen>(f, batch);  // dense: {Sq, Sk, 0, 0, batch, batch}, no reads
  const QueryBlocks<kBlockM<D>> blocks =
      query_blocks<kBlockM<D>, kVarlen>(f, seq, n0, /*in_order=*/p.dq_turns != nullptr);

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::mbarrier_init(&smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.qdo_full[s], 1);
      ptx::mbarrier_init(&smem.consumed[s], kWarpgroups * 4);  // one arrival per consumer warp
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
    // Varlen at D = 64: the consumers read the sequence from shared memory, after the
    // __syncthreads below.
    if constexpr (SharedStorage<T, D, kVarlen>::kStoresSequence) smem.seq.value = seq;
  }
  __syncthreads();                                  // no thread waits on a barrier before it is initialized
  if (blocks.steps == 0) {                          // CTA-uniform: no query sees these keys, their dK and dV are 0
    if (warpgroup >= 0 && p.dk_accum == nullptr) {  // no zeroed sums here: write the zeros
      const int lane = int(threadIdx.x) % 32;
      const int key0 = n0 + 64 * warpgroup + 16 * (int(threadIdx.x) % 128 / 32) + lane / 4;
      store_dk_dv_rows<T, D>(p, seq, head_kv, key0, lane % 4);
    }
    return;
  }

  if (warpgroup < 0) {
    // Every warp of the producer warpgroup must execute setmaxnreg; one thread then loads, and
    // two warps write dQ.
    ptx::setmaxnreg_dec<kProducerRegisters>();
    const int warp = int(threadIdx.x) / 32;
    if (threadIdx.x == 0) {
      produce(smem, q_map, k_map, v_map, dout_map, seq, blocks, n0, head, head_kv);
    } else if (warp >= kDqWriterWarp0 && warp < kDqWriterWarp0 + kWarpgroups) {
      write_dq(smem, dq_map, p, seq, blocks, warp - kDqWriterWarp0, n0, head, batch);
    }
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();
  consume(smem, dk_map, dv_map, p, smem.seq.read(seq), blocks, warpgroup, n0, head, head_kv, batch);
}

}  // namespace hattn::bwd
