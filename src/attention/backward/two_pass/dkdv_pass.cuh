// The D = 256 backward's first pass: dK and dV of 64 keys, over the query blocks that see them,
// 64 queries a step (config.h says who computes what). A producer thread loads K and V once and
// each block's Q and dO into a ring of two stages; the consumers issue a block's dV and dK and
// leave them running while the next block's S^T and dP^T are issued behind them, so the tensor
// cores go from one product to the next.
//
// A variable-length batch: the maps are over the packed rows, so a Q/dO box that runs past its
// sequence loads the next sequence's rows, which the consumers zero before dV += P^T dO and
// dK += dS^T Q would meet them as 0 * x (x may be NaN). Keys past the sequence only give rows
// of dK and dV that are not stored.
//
// Barriers (who arrives -> who waits):
//   kv_full          the producer's expect_tx + TMA bytes -> the consumers, once
//   qdo_full[s]      the producer's expect_tx + TMA bytes -> the consumers, per use of stage s
//   consumed[s]      each consumer warp, once its dV and dK of the block in stage s have
//                    completed (8 arrivals) -> the producer, before it refills stage s; and
//                    the consumers, before they rewrite the P^T and dS^T tiles that dV and dK read
//   named 1          the 256 consumer threads: both halves of P^T and dS^T written (and fenced
//                    to the async proxy) before either warpgroup's dV or dK reads them; varlen,
//                    also: a block's rows past the sequence zeroed (and fenced) before S^T
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
#include "../../../ptx/stmatrix.cuh"
#include "../../../ptx/tma.cuh"
#include "../../../ptx/wgmma.cuh"
#include "../work.cuh"
#include "config.h"

namespace hattn::bwd::two_pass {

// This thread's dK and dV rows (keys key0 and key0 + 8 of the sequence; columns c0 + 8 dt +
// 2 t, + 1), dK scaled: written once in T where run_backward made no sums (no GQA: this CTA
// alone computes these rows), else added into the fp32 sums at head sum_head: the K/V head's,
// or the deterministic backward's rows of the query head, which only this CTA adds to (once,
// into zeros, so exactly; the conversion adds a group's rows in head order).
template <typename T, bool kVarlen>
__device__ __forceinline__ void store_dk_dv(const BackwardParams& p, const Sequence& seq, int head_kv, int sum_head,
                                            int key0, int c0, int tig, const float* dk, const float* dv) {
  constexpr int kDTiles = kHalfD / 8;
  const FeatureParams& f = p.fwd;
  const float grad_scale = score_grad_scale(f);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= seqlen_k_of<kVarlen>(f, seq)) continue;
    if (p.dk_accum == nullptr) {
      // 4-byte stores: the gradients' rows are 16-byte aligned (validate_backward_arguments).
      const int64_t row = int64_t(seq.k_start) + key;  // a packed batch's row; a dense batch's k_start is 0
      T* dk_row = static_cast<T*>(p.dk) + seq.batch_coord * p.dk_batch_stride + row * p.dk_seq_stride +
                  head_kv * p.dk_head_stride;
      T* dv_row = static_cast<T*>(p.dv) + seq.batch_coord * p.dv_batch_stride + row * p.dv_seq_stride +
                  head_kv * p.dv_head_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dk_row + c0 + 8 * dt + 2 * tig) =
            frag::pack2<T>(grad_scale * dk[dt * 4 + 2 * r], grad_scale * dk[dt * 4 + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dv_row + c0 + 8 * dt + 2 * tig) =
            frag::pack2<T>(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]);
      }
    } else {
      const int64_t at = (key_row<kVarlen>(f, seq, key) * p.dkdv_sum_heads + sum_head) * kD + c0 + 2 * tig;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        atomicAdd(reinterpret_cast<float2*>(p.dk_accum + at + 8 * dt),
                  make_float2(grad_scale * dk[dt * 4 + 2 * r], grad_scale * dk[dt * 4 + 2 * r + 1]));
        atomicAdd(reinterpret_cast<float2*>(p.dv_accum + at + 8 * dt), make_float2(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]));
      }
    }
  }
}

// Issues the TMA copies of a step's Q and dO (tensor row m0: a packed batch's sequence start
// included) into `stage` (one producer thread).
template <typename T>
__device__ __forceinline__ void load_queries(DkdvStorage<T>& smem, const CUtensorMap* q_map,
                                             const CUtensorMap* dout_map, int stage, int m0, int head, int batch) {
  ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], 2 * kDkdvQueries * kD * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.q[stage][cb], q_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[stage][cb], dout_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
  }
}

// The dK/dV pass's kernel: a CTA per 64 keys of one query head (blockIdx.x: the key block, y:
// the head, z: the batch entry or sequence; a causal grid in work.cuh's order). One thread of
// the producer warpgroup loads K and V once and each step's Q and dO into the ring; the
// consumers run the loop described at the top.
template <typename T, bool kVarlen>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
                const BackwardParams p) {
  constexpr int kQTiles = kHalfQueries / 8;  // n8 column tiles of this warpgroup's S^T and dP^T
  constexpr int kDTiles = kHalfD / 8;        // n8 column tiles of its dK and dV
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  auto& smem = *reinterpret_cast<DkdvStorage<T>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const FeatureParams& f = p.fwd;
  // The dQ pass reads nothing this pass writes: it may take SMs as this grid's last CTAs free
  // them (a no-op unless it is launched as a programmatic dependent).
  ptx::griddepcontrol_launch_dependents();
  // Through a shuffle, so that the compiler knows it is warp-uniform.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;  // -1: the producer
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  // A causal grid launches its heaviest key blocks first, by groups of heads (work.cuh).
  const CtaCoordinates cta = cta_coordinates<kVarlen, kDkdvKeys>(f, /*deterministic=*/false);
  const int n0 = cta.block * kDkdvKeys, head = cta.head, batch = cta.batch;
  const int head_kv = head / f.heads_per_kv;
  const int sum_head = p.dkdv_sum_heads == f.heads_kv ? head_kv : head;  // the row of the dK and dV sums
  const Sequence seq = sequence_at<kVarlen>(f, batch);  // dense: {Sq, Sk, 0, 0, batch, batch}, no reads
  const int key0 = n0 + 16 * warp_in_wg + group;  // this thread's keys (rows of S^T, dK, dV): key0, key0 + 8
  const int q_col0 = kHalfQueries * warpgroup;    // this warpgroup's query columns of S^T
  const int c0 = kHalfD * warpgroup;              // its columns of dK and dV

  int q_first, q_last;
  queries_seeing<kVarlen>(f, seq, n0, n0 + kDkdvKeys, &q_first, &q_last);
  const int m_begin = q_first / kDkdvQueries * kDkdvQueries;
  // None when no query sees the keys, or (varlen) they start past the sequence's.
  const int steps = (!kVarlen || n0 < seq.seqlen_k) && q_last > m_begin
                        ? (q_last - m_begin + kDkdvQueries - 1) / kDkdvQueries
                        : 0;
  if (steps == 0) {  // CTA-uniform: dK and dV are 0
    if (warpgroup >= 0 && p.dk_accum == nullptr) {  // no zeroed sums here: write the zeros
      const float zeros[kDTiles * 4] = {};
      store_dk_dv<T, kVarlen>(p, seq, head_kv, head_kv, key0, c0, tig, zeros, zeros);
    }
    return;
  }

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::mbarrier_init(&smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < kQdoStages; ++s) {
      ptx::mbarrier_init(&smem.qdo_full[s], 1);
      ptx::mbarrier_init(&smem.consumed[s], kWarpgroups * 4);  // one arrival per consumer warp
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  if (warpgroup < 0) {
    // The producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads.
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::mbarrier_arrive_expect_tx(&smem.kv_full, 2 * kDkdvKeys * kD * sizeof(T));
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb) {
        ptx::cp_async_bulk_tensor_4d_g2s(smem.k[cb], &k_map, cb * 64, seq.k_start + n0, head_kv, seq.batch_coord,
                                         &smem.kv_full);
        ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, seq.k_start + n0, head_kv, seq.batch_coord,
                                         &smem.kv_full);
      }
      for (int step = 0; step < steps; ++step) {
        const int stage = step % kQdoStages;
        // WAR: both consumer warpgroups' dV and dK of the block kQdoStages steps back (the last
        // readers of the stage) have completed.
        if (step >= kQdoStages) ptx::mbarrier_wait(&smem.consumed[stage], (step / kQdoStages - 1) % 2);
        load_queries<T>(smem, &q_map, &dout_map, stage, seq.q_start + m_begin + step * kDkdvQueries, head,
                        seq.batch_coord);
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();

  // The consumers.
  const int seqlen_q = seqlen_q_of<kVarlen>(f, seq), seqlen_k = seqlen_k_of<kVarlen>(f, seq);
  const float scale_log2 = f.scale * kLog2e;
  const int64_t row_base = stats_row0<kVarlen>(f, seq, head);
  // Descriptors built once; a k16 step adds a byte offset (advance_smem_desc).
  constexpr uint32_t kKBlockBytes = kDkdvKeys * 64 * sizeof(T);     // one 64-column block of K or V
  constexpr uint32_t kQBlockBytes = kDkdvQueries * 64 * sizeof(T);  // one of Q or dO
  constexpr uint32_t kQStageBytes = kColBlocks * kQBlockBytes;
  // S^T and dP^T: A = K or V (64 keys, K-major), B = this warpgroup's 32 rows of Q or dO
  // (K-major; 32 rows = 4096 bytes down the tile, a whole number of swizzle atoms).
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0], 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0], 16, kAtomBytes);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0][0] + q_col0 * 64, 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0][0] + q_col0 * 64, 16, kAtomBytes);
  // dV and dK: A = P^T or dS^T (64 keys x 64 queries, K-major), B = this warpgroup's 128
  // columns of dO or Q, read N-major (column blocks kDkdvQueries * 128 bytes apart).
  const uint64_t pt_desc = ptx::make_smem_desc_sw128(smem.pt, 16, kAtomBytes);
  const uint64_t dst_desc = ptx::make_smem_desc_sw128(smem.dst, 16, kAtomBytes);
  const uint64_t do_n_desc = ptx::make_smem_desc_sw128(smem.dout[0][c0 / 64], kDkdvQueries * kSwizzleBytes, kAtomBytes);
  const uint64_t q_n_desc = ptx::make_smem_desc_sw128(smem.q[0][c0 / 64], kDkdvQueries * kSwizzleBytes, kAtomBytes);
  // stmatrix addresses of this lane in the P^T and dS^T tiles (see the store below).
  const int tile_row = 16 * warp_in_wg + lane % 8 + 8 * (lane / 8 % 2);
  const uint32_t tile_lane = uint32_t(tile_row * kSwizzleBytes + ((lane / 16 ^ lane % 8) << 4));
  const uint32_t pt_base = ptx::cvta_to_shared_u32(smem.pt), dst_base = ptx::cvta_to_shared_u32(smem.dst);

  float dk[kDTiles * 4] = {}, dv[kDTiles * 4] = {};
  float s[kQTiles * 4], dp[kQTiles * 4];
  float lse_log2[kQTiles * 2], delta[kQTiles * 2];  // of this thread's queries (0 past the sequence: those P are masked)
  ptx::mbarrier_wait(&smem.kv_full, 0);  // K and V have landed

  // Iteration `step` issues the block before's dV and dK and this block's S^T and dP^T, one
  // behind the other on the tensor cores, waits for both, and turns S^T and dP^T into P^T and
  // dS^T in the shared tiles; a last iteration only issues and waits for the last dV and dK.
  for (int step = 0; step <= steps; ++step) {
    const int m0 = m_begin + step * kDkdvQueries, stage = step % kQdoStages;
    const int before = (step + kQdoStages - 1) % kQdoStages;
    if (step > 0) {
      // dV += P^T dO and dK += dS^T Q over the block before's 64 queries, 16 at a time, from
      // shared memory; left running.
      const uint32_t stage_bytes = before * kQStageBytes;
      ptx::wgmma_fence();  // the accumulators' registers, before the wgmmas below use them
#pragma unroll
      for (int kk = 0; kk < kDkdvQueries / 16; ++kk)
        ptx::WgmmaM64K16<T, kHalfD>::template ss<1>(
            dv, ptx::advance_smem_desc(pt_desc, kk * 32),
            ptx::advance_smem_desc(do_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
#pragma unroll
      for (int kk = 0; kk < kDkdvQueries / 16; ++kk)
        ptx::WgmmaM64K16<T, kHalfD>::template ss<1>(
            dk, ptx::advance_smem_desc(dst_desc, kk * 32),
            ptx::advance_smem_desc(q_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
      ptx::wgmma_commit_group();
    }
    if (step < steps) {
      // S^T and dP^T for this warpgroup's 32 queries: per 16 columns of D one wgmma each. (No
      // register fences between these and the dV and dK in flight: an instruction that defines
      // s or dp there makes ptxas serialize the wgmmas; they were fenced after their last use.)
      ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kQdoStages) % 2);  // Q and dO have landed
      if constexpr (kVarlen) {
        if (m0 + kDkdvQueries > seqlen_q) {  // CTA-uniform: the boxes ran into the next sequence's rows
          const int consumer_thread = int(threadIdx.x) - 128;
          zero_tile_rows<T, kD, kDkdvQueries, kConsumerThreads>(smem.q[stage][0], seqlen_q - m0, consumer_thread);
          zero_tile_rows<T, kD, kDkdvQueries, kConsumerThreads>(smem.dout[stage][0], seqlen_q - m0, consumer_thread);
          ptx::fence_proxy_async_shared_cta();             // the zeros, before the wgmmas (async proxy) read the tiles
          ptx::bar_sync(kTilesBarrier, kConsumerThreads);  // both warpgroups' zeros, before either's wgmmas
        }
      }
      ptx::wgmma_fence();  // s and dp were read and written by the step before: those accesses come first
      const uint32_t stage_bytes = stage * kQStageBytes;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        // 16 columns of D: column block kk / 4, 32 bytes along its rows.
        const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, q_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
        ptx::WgmmaM64K16<T, kHalfQueries>::template ss<0>(s, ptx::advance_smem_desc(k_desc, kv_bytes),
                                                          ptx::advance_smem_desc(q_desc, stage_bytes + q_bytes), kk > 0);
      }
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, do_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
        ptx::WgmmaM64K16<T, kHalfQueries>::template ss<0>(dp, ptx::advance_smem_desc(v_desc, kv_bytes),
                                                          ptx::advance_smem_desc(do_desc, stage_bytes + do_bytes), kk > 0);
      }
      ptx::wgmma_commit_group();
      // This thread's queries' LSE (log2 units) and delta: element e of n8 tile nt is query
      // m0 + q_col0 + 8 nt + 2 t + e % 2. Loaded while the products run.
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = m0 + q_col0 + 8 * nt + 2 * tig + h;
          lse_log2[nt * 2 + h] = i < seqlen_q ? f.lse[row_base + i] * kLog2e : 0.f;
          delta[nt * 2 + h] = i < seqlen_q ? p.delta[row_base + i] : 0.f;
        }
      if (step > 0) {
        // The block before's dV and dK (the older group) are done: release its stage and the
        // tiles now, so that the producer's next copy starts while S^T and dP^T still run.
        ptx::wgmma_wait_group<1>();
        if (lane == 0) ptx::mbarrier_arrive(&smem.consumed[before]);
      }
    }
    ptx::wgmma_wait_group<0>();  // S^T and dP^T are in registers (at the end: the last dV and dK)
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
    if (step == steps) break;

    // P^T and dS^T. Accumulator element e of n8 tile nt is key key0 + 8 (e / 2), query
    // m0 + q_col0 + 8 nt + 2 t + e % 2. Masked where this warpgroup's part of the tile is not
    // wholly visible (visible_keys is monotone in the query).
    int first_lo, last_lo, first_hi, last_hi;
    visible_keys<kVarlen>(f, seq, m0 + q_col0, &first_lo, &last_lo);
    visible_keys<kVarlen>(f, seq, m0 + q_col0 + kHalfQueries - 1, &first_hi, &last_hi);
    const bool need_mask = m0 + q_col0 + kHalfQueries > seqlen_q || n0 + kDkdvKeys > seqlen_k ||
                           last_lo < n0 + kDkdvKeys || first_hi > n0;
    if (f.softcap_scale > 0.f) {  // s -> t and dP for the capped dS (softcap_score_and_dp)
#pragma unroll
      for (int i = 0; i < kQTiles * 4; ++i)
        softcap_score_and_dp(&s[i], &dp[i], delta[i / 4 * 2 + i % 2], f.softcap_scale);
    }
    // Masked: each of the thread's two keys is seen by one run of queries (the masks are
    // monotone), as bounds on the element's query offset 8 nt + e % 2 from m0 + q_col0 + 2 t, a
    // constant, so two compares an element (per element from visible_keys, a masked step issued
    // about three times the instructions of an unmasked one in the D <= 128 kernel).
    KeyViewers rows = {};
    if (need_mask) rows = offset_viewers(viewers_of<kVarlen>(f, seq, key0), m0 + q_col0 + 2 * tig);
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 8 * nt + e % 2;
        const bool visible = !need_mask || (row >= rows.first[e / 2] && row < rows.last[e / 2]);
        // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
        const float pv =
            visible ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -lse_log2[nt * 2 + e % 2])) : 0.f;
        s[nt * 4 + e] = pv;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - delta[nt * 2 + e % 2]);
      }
    }

    // WAR on the tiles: both warpgroups' dV and dK of the block before have read them.
    if (step > 0) ptx::mbarrier_wait(&smem.consumed[before], ((step - 1) / kQdoStages) % 2);
    // This warpgroup's 32 columns of P^T and dS^T into the shared tiles: row = key, column =
    // query, in TMA's 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)). Per 16
    // queries one stmatrix of the packed fragment's four 8x8 matrices (register i: keys
    // g + 8 (i % 2), queries 8 (2 kk + i / 2) + 2 t of the warpgroup's); lane l gives row l % 8
    // of matrix l / 8. Its chunk (4 w + 2 kk + l / 16) ^ (l % 8) is the lane's kk = 0, w = 0
    // address XOR (4 w + 2 kk) * 16 bytes (the tiles start on 1024-byte boundaries).
#pragma unroll
    for (int kk = 0; kk < kHalfQueries / 16; ++kk) {
      uint32_t p_frag[4], ds_frag[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p_frag[r] = frag::pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        ds_frag[r] = frag::pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      }
      const uint32_t offset = tile_lane ^ uint32_t((q_col0 / 8 + 2 * kk) << 4);
      ptx::stmatrix_x4(pt_base + offset, p_frag);
      ptx::stmatrix_x4(dst_base + offset, ds_frag);
    }
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::fence_proxy_async_shared_cta();             // the tiles' stores, before the wgmmas (async proxy) read them
    ptx::bar_sync(kTilesBarrier, kConsumerThreads);  // both warpgroups' halves are in the tiles
  }

  // This warpgroup's columns of dK and dV: written once, or into the sums (of its K/V head, or
  // the deterministic backward's rows of its query head).
  store_dk_dv<T, kVarlen>(p, seq, head_kv, sum_head, key0, c0, tig, dk, dv);
}

}  // namespace hattn::bwd::two_pass
