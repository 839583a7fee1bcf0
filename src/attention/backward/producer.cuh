// The producer: one thread of the producer warpgroup loads K and V once and each query block's
// Q and dO into a ring of kStages stages, running ahead of the consumers until a stage is not
// yet released (its consumed barrier).
#pragma once

#include <cuda.h>

#include "../../common/backward_common.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/tma.cuh"
#include "config.h"
#include "shared_storage.cuh"
#include "work.cuh"

namespace hattn::bwd {

// Issues the TMA copies of query block `m0` (Q and dO) into `stage`; m0 is a row of the tensors
// (a packed batch's sequence start included).
template <typename T, int D, bool kVarlen>
__device__ __forceinline__ void load_queries(SharedStorage<T, D, kVarlen>& smem, const CUtensorMap* q_map,
                                             const CUtensorMap* dout_map, int stage, int m0, int head, int batch) {
  ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], 2 * kBlockM<D> * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.q[stage][cb], q_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[stage][cb], dout_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
  }
}

// The producer thread's work for the CTA's keys from n0 (K/V head head_kv) and query head `head`.
template <typename T, int D, bool kVarlen>
__device__ __forceinline__ void produce(SharedStorage<T, D, kVarlen>& smem, const CUtensorMap& q_map,
                                        const CUtensorMap& k_map, const CUtensorMap& v_map, const CUtensorMap& dout_map,
                                        const Sequence& seq, const QueryBlocks<kBlockM<D>>& blocks, int n0, int head,
                                        int head_kv) {
  ptx::mbarrier_arrive_expect_tx(&smem.kv_full, 2 * kBlockN * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.k[cb], &k_map, cb * 64, seq.k_start + n0, head_kv, seq.batch_coord,
                                     &smem.kv_full);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, seq.k_start + n0, head_kv, seq.batch_coord,
                                     &smem.kv_full);
  }
  for (int step = 0; step < blocks.steps; ++step) {
    const int stage = step % kStages;
    // WAR: every consumer warp's dV and dK of the block kStages steps back (the last readers of
    // the stage) have completed.
    if (step >= kStages) ptx::mbarrier_wait(&smem.consumed[stage], (step / kStages - 1) % 2);
    load_queries(smem, &q_map, &dout_map, stage, seq.q_start + blocks.row(step), head, seq.batch_coord);
  }
}

}  // namespace hattn::bwd
