// The D = 256 backward's second pass: dQ of 128 queries, over the keys they see, 64 at a time.
// Warpgroup w (0, 1) owns queries 64 w .. 64 w + 63 of the block and all of D:
//   S = Q_w K^T, dP = dO_w V^T   (m64n64, 16 k16 steps, A and B in shared memory)
//   dS = P (dP - delta), packed in registers as the A operand of
//   dQ_w += dS K                  (m64n256, 4 k16 steps, K read N-major)
// so no tile goes through shared memory and the warpgroups never wait for each other. A
// producer thread loads Q and dO once and streams K and V; dQ(t) runs on the tensor cores while
// step t + 1 issues its S and dP. Each query row is this CTA's alone: dQ is written once. The
// pass reads nothing the dK/dV pass writes, so it is launched as that pass's programmatic
// dependent (backward.cu): its CTAs take SMs as the dK/dV pass's last wave frees them (2-5%
// of the backward's time on an H100 at 512-2k tokens, results/evidence/two_pass_d256/).
//
// A variable-length batch: a K/V box that runs past its sequence loads the next sequence's
// rows, which the consumers zero before dQ += dS K and dP = dO V^T would meet them as 0 * x
// (x may be NaN). Queries past the sequence only give rows of dQ that are not stored.
//
// Barriers (who arrives -> who waits):
//   qdo_full        the producer's expect_tx + TMA bytes -> the consumers, once
//   k_full[s]       the same -> the consumers, per use of K stage s
//   v_full          the same -> the consumers, per step
//   v_empty         each consumer warp, once its dP has completed -> the producer, before the
//                   next block's V overwrites the stage (8 arrivals)
//   k_empty[s]      each consumer warp, once its dQ over the block has completed (seen at the
//                   next step's wait) -> the producer, before stage s takes the block after next
//   named 1         varlen, the 256 consumer threads: a block's K and V rows past the sequence
//                   zeroed (and fenced) before either warpgroup's S or dP reads them
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../../../common/backward_common.cuh"
#include "../../../common/fragment.cuh"
#include "../../../ptx/ex2.cuh"
#include "../../../ptx/griddepcontrol.cuh"
#include "../../../ptx/mbarrier.cuh"
#include "../../../ptx/named_barrier.cuh"
#include "../../../ptx/setmaxnreg.cuh"
#include "../../../ptx/smem.cuh"
#include "../../../ptx/tma.cuh"
#include "../../../ptx/wgmma.cuh"
#include "../work.cuh"
#include "config.h"

namespace hattn::bwd::two_pass {

// This thread's rows of dQ (queries query0, query0 + 8 of the sequence; columns 8 nt + 2 t,
// + 1), scaled and written once in the gradient's dtype (4-byte stores: the gradients' rows are
// 16-byte aligned, validate_backward_arguments).
template <typename T, bool kVarlen>
__device__ __forceinline__ void store_dq(const BackwardParams& p, const Sequence& seq, int head, int query0, int tig,
                                         float grad_scale, const float* dq) {
  constexpr int kDTiles = kD / 8;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = query0 + 8 * r;
    if (i >= seqlen_q_of<kVarlen>(p.fwd, seq)) continue;
    const int64_t row = int64_t(seq.q_start) + i;  // a packed batch's row; a dense batch's q_start is 0
    T* out = static_cast<T*>(p.dq) + seq.batch_coord * p.dq_batch_stride + row * p.dq_seq_stride +
             head * p.dq_head_stride;
#pragma unroll
    for (int nt = 0; nt < kDTiles; ++nt)
      *reinterpret_cast<uint32_t*>(out + 8 * nt + 2 * tig) =
          frag::pack2<T>(grad_scale * dq[nt * 4 + 2 * r], grad_scale * dq[nt * 4 + 2 * r + 1]);
  }
}

// The dQ pass's kernel: a CTA per 128 queries of one query head (blockIdx.x: the query block,
// y: the head, z: the batch entry or sequence; a causal grid in work.cuh's order). One thread
// of the producer warpgroup loads Q and dO once and streams K and V; the consumers run the loop
// described at the top.
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 1)
    dq_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
              const BackwardParams p) {
  constexpr int kKTiles = kDqKeys / 8;   // n8 column tiles of S and dP
  constexpr int kDTiles = kD / 8;        // n8 column tiles of dQ
  constexpr int kKSteps = kDqKeys / 16;  // k16 steps of dQ += dS K
  extern __shared__ unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<DqStorage<T>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const FeatureParams& f = p.fwd;
  // Launched as a programmatic dependent of the dK/dV pass, this grid may run beside it. One
  // thread of the last CTA launched waits for that pass, so that this grid completes after it
  // and the kernels behind this one in the stream (the conversions of the dK and dV sums) see
  // its writes. A no-op otherwise.
  if (threadIdx.x == 0 && blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1)
    ptx::griddepcontrol_wait();
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;  // -1: the producer
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  // A causal grid launches its heaviest query blocks (the last) first, by groups of heads (work.cuh).
  const CtaCoordinates cta = cta_coordinates<kVarlen, kDqQueries>(f, /*deterministic=*/false, /*heaviest_last=*/true);
  const int m0 = cta.block * kDqQueries, head = cta.head, batch = cta.batch;
  const int head_kv = head / f.heads_per_kv;
  const Sequence seq = sequence_at<kVarlen>(f, batch);  // dense: {Sq, Sk, 0, 0, batch, batch}, no reads
  if (kVarlen && m0 >= seq.seqlen_q) return;  // past the sequence's queries (the grid is planned by the longest)
  const int seqlen_q = seqlen_q_of<kVarlen>(f, seq);

  // The keys the block's queries see (both ends are monotone in the query): the same sweep for
  // both warpgroups; a key a query does not see gets dS = 0.
  int key_first, key_last, unused;
  visible_keys<kVarlen>(f, seq, m0, &key_first, &unused);
  visible_keys<kVarlen>(f, seq, min(m0 + kDqQueries, seqlen_q) - 1, &unused, &key_last);
  const int n_begin = key_first / kDqKeys * kDqKeys;
  const int steps = key_last > n_begin ? (key_last - n_begin + kDqKeys - 1) / kDqKeys : 0;

  const int query0 = m0 + 64 * warpgroup + 16 * warp_in_wg + group;  // this thread's queries: query0, query0 + 8
  const float grad_scale = score_grad_scale(f);
  if (steps == 0) {  // no key seen (CTA-uniform): dQ is 0
    if (warpgroup >= 0) {
      const float zeros[kDTiles * 4] = {};
      store_dq<T, kVarlen>(p, seq, head, query0, tig, grad_scale, zeros);
    }
    return;
  }

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::mbarrier_init(&smem.qdo_full, 1);
#pragma unroll
    for (int s = 0; s < kKStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.k_empty[s], kWarpgroups * 4);  // one arrival per consumer warp
    }
    ptx::mbarrier_init(&smem.v_full, 1);
    ptx::mbarrier_init(&smem.v_empty, kWarpgroups * 4);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  constexpr uint32_t kKBlockBytes = kDqKeys * kD * sizeof(T);  // one block of K (or V)
  if (warpgroup < 0) {
    // The producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads
    // Q and dO once (tensor rows from the sequence's start) and K and V of each step's keys.
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::mbarrier_arrive_expect_tx(&smem.qdo_full, 2 * kDqQueries * kD * sizeof(T));
#pragma unroll
      for (int half = 0; half < 2; ++half)  // the maps' boxes are 64 rows
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb) {
          const int row = seq.q_start + m0 + 64 * half;
          ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb] + half * 64 * 64, &q_map, cb * 64, row, head, seq.batch_coord,
                                           &smem.qdo_full);
          ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[cb] + half * 64 * 64, &dout_map, cb * 64, row, head,
                                           seq.batch_coord, &smem.qdo_full);
        }
      for (int step = 0; step < steps; ++step) {
        const int n0 = seq.k_start + n_begin + step * kDqKeys, stage = step % kKStages;
        // WAR: both warpgroups' dQ over the block kKStages steps back has finished reading K.
        if (step >= kKStages) ptx::mbarrier_wait(&smem.k_empty[stage], (step / kKStages - 1) % 2);
        ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], kKBlockBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_g2s(smem.k[stage][cb], &k_map, cb * 64, n0, head_kv, seq.batch_coord,
                                           &smem.k_full[stage]);
        // WAR: both warpgroups' dP over the block before has finished reading V.
        if (step >= 1) ptx::mbarrier_wait(&smem.v_empty, (step - 1) % 2);
        ptx::mbarrier_arrive_expect_tx(&smem.v_full, kKBlockBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, n0, head_kv, seq.batch_coord, &smem.v_full);
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();

  // A consumer thread: its two queries' LSE (log2 units), delta and the keys they see (none
  // past the sequence).
  const int64_t row_base = stats_row0<kVarlen>(f, seq, head);
  const float scale_log2 = f.scale * kLog2e;
  float lse_log2[2], delta[2];
  int first[2], last[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = query0 + 8 * r;
    lse_log2[r] = 0.f, delta[r] = 0.f, first[r] = 0, last[r] = 0;
    if (i < seqlen_q) {
      lse_log2[r] = f.lse[row_base + i] * kLog2e;
      delta[r] = p.delta[row_base + i];
      visible_keys<kVarlen>(f, seq, i, &first[r], &last[r]);
    }
  }

  // S and dP: A = this warpgroup's 64 rows of Q or dO (K-major), B = K or V (K-major). dQ:
  // B = K read N-major (column blocks kDqKeys * 128 bytes apart), A = dS from registers.
  constexpr uint32_t kQColBlockBytes = sizeof(smem.q[0]), kKColBlockBytes = sizeof(smem.k[0][0]);
  constexpr uint32_t kKStageBytes = sizeof(smem.k[0]);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0][0], 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0], 16, kAtomBytes);
  const uint64_t k_n_desc = ptx::make_smem_desc_sw128(smem.k[0][0], kDqKeys * kSwizzleBytes, kAtomBytes);

  float dq[kDTiles * 4] = {};
  float s[kKTiles * 4], dp[kKTiles * 4];
  uint32_t ds_frag[kKSteps][4];  // dS as wgmma A fragments, one per 16 keys
  ptx::mbarrier_wait(&smem.qdo_full, 0);  // Q and dO have landed
  for (int step = 0; step < steps; ++step) {
    const int n0 = n_begin + step * kDqKeys, stage = step % kKStages;
    const uint32_t stage_bytes = stage * kKStageBytes;
    ptx::mbarrier_wait(&smem.k_full[stage], (step / kKStages) % 2);  // this block's K has landed
    if constexpr (kVarlen) {
      if (n0 + kDqKeys > seq.seqlen_k) {  // CTA-uniform: the boxes ran into the next sequence's rows
        ptx::mbarrier_wait(&smem.v_full, step % 2);  // V has landed too: both are zeroed before any product
        const int consumer_thread = int(threadIdx.x) - 128;
        zero_tile_rows<T, kD, kDqKeys, kConsumerThreads>(smem.k[stage][0], seq.seqlen_k - n0, consumer_thread);
        zero_tile_rows<T, kD, kDqKeys, kConsumerThreads>(smem.v[0], seq.seqlen_k - n0, consumer_thread);
        ptx::fence_proxy_async_shared_cta();            // the zeros, before the wgmmas (async proxy) read the tiles
        ptx::bar_sync(kZeroBarrier, kConsumerThreads);  // both warpgroups' zeros, before either's wgmmas
      }
    }
#pragma unroll
    for (int i = 0; i < kKTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp were read and written by the step before: those accesses come first
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t q_bytes = kk / 4 * kQColBlockBytes + kk % 4 * 32;  // 16 columns of D
      const uint32_t k_bytes = kk / 4 * kKColBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kDqKeys>::template ss<0>(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                                   ptx::advance_smem_desc(k_desc, stage_bytes + k_bytes), kk > 0);
    }
    // This block's V has landed (waited for above already when varlen zeroed it: a completed
    // phase's wait returns at once).
    ptx::mbarrier_wait(&smem.v_full, step % 2);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t q_bytes = kk / 4 * kQColBlockBytes + kk % 4 * 32;
      const uint32_t v_bytes = kk / 4 * kKColBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kDqKeys>::template ss<0>(dp, ptx::advance_smem_desc(do_desc, q_bytes),
                                                   ptx::advance_smem_desc(v_desc, v_bytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();  // S and dP are in registers, and the block before's dQ is done
#pragma unroll
    for (int i = 0; i < kKTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dq[i]);
    if (lane == 0) {
      ptx::mbarrier_arrive(&smem.v_empty);  // dP has read V
      if (step > 0) ptx::mbarrier_arrive(&smem.k_empty[(step - 1) % kKStages]);  // dQ has read the block before's K
    }

    // dS = P (dP - delta). Accumulator element e of n8 tile nt is query query0 + 8 (e / 2), key
    // n0 + 8 nt + 2 t + e % 2. Softcapping first (softcap_score_and_dp).
    if (f.softcap_scale > 0.f) {
#pragma unroll
      for (int i = 0; i < kKTiles * 4; ++i) softcap_score_and_dp(&s[i], &dp[i], delta[i % 4 / 2], f.softcap_scale);
    }
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, j = n0 + 8 * nt + 2 * tig + e % 2;
        // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
        const float pv = j >= first[r] && j < last[r]
                             ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -lse_log2[r]))
                             : 0.f;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - delta[r]);
      }
    }
    // dS as A fragments, one per 16 keys: n8 tiles 2 kk and 2 kk + 1, rows g and g + 8.
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      ds_frag[kk][0] = frag::pack2<T>(dp[8 * kk + 0], dp[8 * kk + 1]);
      ds_frag[kk][1] = frag::pack2<T>(dp[8 * kk + 2], dp[8 * kk + 3]);
      ds_frag[kk][2] = frag::pack2<T>(dp[8 * kk + 4], dp[8 * kk + 5]);
      ds_frag[kk][3] = frag::pack2<T>(dp[8 * kk + 6], dp[8 * kk + 7]);
    }

    // dQ += dS K over the block's 64 keys, 16 at a time; waited for at the next step's wait.
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::fence_operand(ds_frag[kk][i]);
    ptx::wgmma_fence();  // dS's registers were written above
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      ptx::WgmmaM64K16<T, kD>::template rs<1>(dq, ds_frag[kk],
                                              ptx::advance_smem_desc(k_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
    ptx::wgmma_commit_group();
  }
  ptx::wgmma_wait_group<0>();  // the last block's dQ
#pragma unroll
  for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dq[i]);
  store_dq<T, kVarlen>(p, seq, head, query0, tig, grad_scale, dq);
}

}  // namespace hattn::bwd::two_pass
