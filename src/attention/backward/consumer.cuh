// The consumers: two warpgroups of 64 keys each. Per query block (a step, kBlockM queries):
// S^T = K Q^T and dP^T = V dO^T, P^T and dS^T (scores.cuh), dV += P^T dO and dK += dS^T Q,
// dS^T into shared memory, and the block's dQ = dS K over both warpgroups' keys (each
// warpgroup half of D's columns, or with 128-query blocks half of the rows), issued at the top
// of the next step and stored into a buffer while that step's S^T runs, which the warpgroup's
// writer warp adds into the fp32 dQ sum (dq_writer.cuh). After the last block, dK and dV leave
// (epilogue.cuh).
//
// Barriers (who arrives -> who waits):
//   kv_full          the producer's expect_tx + TMA bytes -> the consumers, once
//   qdo_full[s]      the producer's expect_tx + TMA bytes -> the consumers, per use of stage s
//   consumed[s]      each consumer warp, once its dV and dK of the block in stage s have
//                    completed (8 arrivals) -> the producer, before it refills stage s
//   named 1          the 256 consumer threads: both dS^T tiles written (and fenced to the async
//                    proxy) before either warpgroup's dQ wgmma reads them; every dQ wgmma of two
//                    blocks ago has read the dS^T parity a warpgroup writes next; the next
//                    block's LSE and delta stored before they are read, and the stage's last
//                    reads before its next stores. Once before the first block too (its stats).
//                    Varlen: also after the consumers zero rows of K (before the first
//                    block) or of a block's Q and dO, before any wgmma reads them. Once after
//                    the last block (the epilogues): every wgmma of both warpgroups has
//                    completed before they write dK and dV over K and V (the sums: and over
//                    Q and dO).
//   named 2 + wg     the warpgroup's 128 threads, at the end: its dK and dV rows written (and
//                    fenced) before its issuing thread stores them by TMA (epilogue.cuh)
//   named 4-11       dQ's hand-off to the warpgroup's writer warp (dq_writer.cuh): the share
//                    stored and fenced (the consumers arrive without waiting), and the buffer
//                    read by the writer's reduction before the consumers store into it again
// Bulk-group waits (cp.async.bulk.wait_group.read, the issuing thread of each warpgroup): at
// the end, before the CTA exits (shared memory ends with the CTA), the dK and dV stores.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "../../common/backward_common.cuh"
#include "../../common/fragment.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/named_barrier.cuh"
#include "../../ptx/smem.cuh"
#include "../../ptx/stmatrix.cuh"
#include "../../ptx/tma.cuh"
#include "../../ptx/wgmma.cuh"
#include "config.h"
#include "epilogue.cuh"
#include "scores.cuh"
#include "shared_storage.cuh"
#include "work.cuh"

namespace hattn::bwd {

// The work of a consumer thread of warpgroup `warpgroup` (0 or 1) on the CTA's keys from n0.
template <typename T, int D, bool kVarlen>
__device__ __forceinline__ void consume(SharedStorage<T, D, kVarlen>& smem, const CUtensorMap& dk_map,
                                        const CUtensorMap& dv_map, const BackwardParams& p, const Sequence& seq,
                                        const QueryBlocks<kBlockM<D>>& blocks, int warpgroup, int n0, int head,
                                        int head_kv, int batch) {
  using Storage = SharedStorage<T, D, kVarlen>;
  constexpr int kRows = Storage::kRows;  // query rows of a block: 64, or 128 at D = 64
  constexpr int kDTiles = D / 8;         // n8 column tiles of dK and dV
  constexpr int kQTiles = kRows / 8;     // n8 column tiles of S^T and dP^T
  const FeatureParams& f = p.fwd;
  const int consumer_thread = int(threadIdx.x) - 128;  // 0-255 in the consumer warpgroups
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;       // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int n_wg = n0 + 64 * warpgroup;             // this warpgroup's first key
  const int key0 = n_wg + 16 * warp_in_wg + group;  // this thread's keys: key0 and key0 + 8
  const float scale_log2 = f.scale * kLog2e;        // with softcapping, the softcap (as in the forward)
  const float grad_scale = score_grad_scale(f);
  const int steps = blocks.steps;
  auto block_row = [&](int step) { return blocks.row(step); };

  // A block's LSE and delta go to shared memory a step ahead (64 threads each): in registers,
  // 16 of each a thread made ptxas spill at D = 128 (B08).
  const int64_t row_base = stats_row0<kVarlen>(f, seq, head);
  const int seqlen_q = seqlen_q_of<kVarlen>(f, seq);
  // Consumer threads 0 .. kRows - 1 fetch LSE, the next kRows delta (0 past Sq), and store it
  // in the block's stage (B08's split of the loads into a fetch and a store).
  auto fetch_row_stat = [&](int m0) -> float {
    const int t = consumer_thread % kRows, i = m0 + t;
    if (consumer_thread < kRows) return i < seqlen_q ? f.lse[row_base + i] * kLog2e : 0.f;
    if (consumer_thread < 2 * kRows) return i < seqlen_q ? p.delta[row_base + i] : 0.f;
    return 0.f;
  };
  auto store_row_stat = [&](int stage, float value) {
    const int t = consumer_thread % kRows;
    if (consumer_thread < kRows)
      smem.lse_log2[stage][t] = value;
    else if (consumer_thread < 2 * kRows)
      smem.delta[stage][t] = value;
  };
  store_row_stat(0, fetch_row_stat(block_row(0)));
  // With 128-query blocks: the queries that see this thread's keys (scores.cuh).
  const KeyViewers viewers = Storage::kViewerMasks ? viewers_of<kVarlen>(f, seq, key0) : KeyViewers{};
  if constexpr (kVarlen) {
    if (n0 + kBlockN > seq.seqlen_k) {  // CTA-uniform: K's box ran into the next sequence's keys
      ptx::mbarrier_wait(&smem.kv_full, 0);
      zero_tile_rows<T, D, kBlockN, kConsumerThreads>(smem.k[0], seq.seqlen_k - n0, consumer_thread);
      ptx::fence_proxy_async_shared_cta();  // the zeros, before the wgmmas (async proxy) read K
    }
  }
  // RAW: the first block's LSE and delta (varlen: K's zeroed rows) are stored before any
  // consumer reads them.
  ptx::bar_sync(kDsBarrier, kConsumerThreads);

  float dk[kDTiles * 4] = {}, dv[kDTiles * 4] = {};
  // This warpgroup's share of a block's dQ: rows r0 .. r0 + 63, columns c0 .. c0 + kCols - 1 (by
  // columns: D / 2 of all 64 rows; by rows: all of D). Its wgmma is issued at the top of the
  // next step, and it leaves during that step.
  constexpr bool kDqByRows = Storage::kDqByRows;
  constexpr int kCols = Storage::kDqCols;
  const int c0 = kDqByRows ? 0 : warpgroup * kCols, r0 = kDqByRows ? 64 * warpgroup : 0;
  float dq[kCols / 2];
  // The scaled share into its block's buffer, for the writer warp (after waiting for the wgmma),
  // in accumulator order: n8 tile nt's four floats (rows g and g + 8, columns 2 t and 2 t + 1)
  // at float (nt * 128 + t) * 4, t the thread's place in its warpgroup, so 16-byte stores with a
  // warp's 512 bytes consecutive (backward_common.cuh's dq tiles). A packed batch's rows past its
  // sequence land in the sequence's own padding of the sum, which no one reads.
  const uint32_t dq_thread = uint32_t(threadIdx.x) % 128 * 4;  // the thread's first float in a tile
  auto store_dq = [&](int step) {
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) ptx::fence_operand(dq[i]);
    const int buffer = step % Storage::kDqBuffers;
    // Re-read each step, so that the compiler keeps one offset live across the loop.
    uint32_t thread_offset = dq_thread;
    ptx::fence_operand(thread_offset);
    float* tile = smem.dq[buffer][warpgroup] + thread_offset;
    // WAR: the writer's reduction of this buffer's last block has read it (dq_writer.cuh).
    if (step >= Storage::kDqBuffers) ptx::bar_sync(kDqEmptyBarrier + 2 * buffer + warpgroup, kDqHandOffThreads);
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt)
      *reinterpret_cast<float4*>(tile + nt * 128 * 4) =
          make_float4(grad_scale * dq[4 * nt], grad_scale * dq[4 * nt + 1], grad_scale * dq[4 * nt + 2],
                      grad_scale * dq[4 * nt + 3]);
    ptx::fence_proxy_async_shared_cta();  // the stores above, before the writer's reduction (async proxy) reads them
    ptx::bar_arrive(kDqFullBarrier + 2 * buffer + warpgroup, kDqHandOffThreads);  // to the writer, without waiting
  };
  // Every wgmma operand's descriptor is built once here; a k16 step adds a byte offset
  // (advance_smem_desc). Built per step from their addresses, the S^T and dP^T operands'
  // descriptors were kept in registers across the loop, and at D = 128 they spilled.
  constexpr uint32_t kKBlockBytes = kBlockN * 64 * sizeof(T);  // one 64-column block of K or V
  constexpr uint32_t kQBlockBytes = kRows * 64 * sizeof(T);  // one of Q or dO
  constexpr uint32_t kQStageBytes = D / 64 * kQBlockBytes;
  constexpr uint32_t kDsBytes = 64 * kRows * sizeof(T);  // one warpgroup's dS^T tile
  // K-major (S^T = K Q^T, dP^T = V dO^T): this warpgroup's 64 keys of K and V; Q and dO of stage 0.
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0][0], 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0][0], 16, kAtomBytes);
  // N-major B operands (dK += dS^T Q, dV += P^T dO): column blocks kRows * 128 bytes apart.
  const uint64_t q_n_desc = ptx::make_smem_desc_sw128(smem.q[0][0], kRows * kSwizzleBytes, kAtomBytes);
  const uint64_t do_n_desc = ptx::make_smem_desc_sw128(smem.dout[0][0], kRows * kSwizzleBytes, kAtomBytes);
  // dQ = dS K: dS^T read M-major (parity 0; by rows, this warpgroup's 64 queries), and K's
  // columns c0 .. c0 + kCols - 1 read N-major.
  const uint64_t ds_desc = ptx::make_smem_desc_sw128(smem.ds[0][0] + r0 * 64, 64 * kSwizzleBytes, kAtomBytes);
  const uint64_t k_dq_desc = ptx::make_smem_desc_sw128(smem.k[c0 / 64] + c0 % 64, kBlockN * kSwizzleBytes, kAtomBytes);

  // dQ[r0 : r0 + 64, c0 : c0 + kCols] = dS K[:, c0 : c0 + kCols] of block `step` over all 128
  // keys, 16 at a time: A is the dS^T tile of the warpgroup that owns those keys, read M-major
  // (16 keys = 2048 bytes down; by rows, from query block r0 / 64 of it); B is K read N-major,
  // kCols columns from column c0 (by columns at D = 64: from the middle of the 128-byte swizzled
  // rows, 64 bytes in, the same swizzle). Issued at the top of the next step (or after the
  // loop), where both warpgroups' dS^T tiles of the block are written.
  auto issue_dq = [&](int step) {
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) ptx::fence_operand(dq[i]);
    ptx::wgmma_fence();  // likewise for dq's registers
    const uint64_t ds_parity_desc = ptx::advance_smem_desc(ds_desc, step % 2 * kWarpgroups * kDsBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      // 16 keys: dS^T tile kk / 4 (the warpgroup owning them), 16 rows = 2048 bytes down it.
      const uint32_t ds_bytes = kk / 4 * kDsBytes + kk % 4 * 16 * kSwizzleBytes;
      ptx::WgmmaM64K16<T, kCols>::template ss<1, 1>(dq, ptx::advance_smem_desc(ds_parity_desc, ds_bytes),
                                                    ptx::advance_smem_desc(k_dq_desc, kk * 16 * kSwizzleBytes), kk > 0);
    }
    ptx::wgmma_commit_group();
  };
  ptx::mbarrier_wait(&smem.kv_full, 0);  // K and V have landed

  // One step. The first has no block before it: a compile-time flag, so that ptxas sees every
  // dQ wgmma waited for on every path (with a run-time one it serializes all wgmmas, C7514).
  auto run_step = [&](int step, auto has_last) {
    constexpr bool kHasLast = decltype(has_last)::value;
    const int m0 = block_row(step), stage = step % kStages;
    // The last block's dQ goes to the tensor cores first: it needs no barrier (its dS^T tiles
    // were written before named barrier 1 of the last step).
    if constexpr (kHasLast) issue_dq(step - 1);
    // The next block's LSE and delta, into the other stage: its last reads (the block before's)
    // were before named barrier 1 of the last step, and this block's reads of them come after
    // named barrier 1 of this step.
    if (step + 1 < steps)
      store_row_stat((step + 1) % kStages, fetch_row_stat(block_row(step + 1)));

    // S^T = K Q^T and dP^T = V dO^T: per 16 columns of D one wgmma each, K-major operands.
    float s[kQTiles * 4], dp[kQTiles * 4];
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) % 2);  // this block's Q and dO have landed
    if constexpr (kVarlen) {
      if (m0 + kRows > seq.seqlen_q) {  // CTA-uniform: the boxes ran into the next sequence's rows
        zero_tile_rows<T, D, kRows, kConsumerThreads>(smem.q[stage][0], seq.seqlen_q - m0, consumer_thread);
        zero_tile_rows<T, D, kRows, kConsumerThreads>(smem.dout[stage][0], seq.seqlen_q - m0, consumer_thread);
        ptx::fence_proxy_async_shared_cta();          // the zeros, before the wgmmas (async proxy) read the tiles
        ptx::bar_sync(kDsBarrier, kConsumerThreads);  // every consumer's zeros, before either warpgroup's wgmmas
      }
    }
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp reuse registers of the step before: those accesses come first
    const uint32_t stage_bytes = stage * kQStageBytes;
    // K's and V's descriptors re-read each step: otherwise the compiler keeps all D / 16 of
    // each that it makes from them live across the loop (at D = 128 it spilled them).
    uint64_t k_step_desc = k_desc, v_step_desc = v_desc;
    ptx::fence_operand(k_step_desc), ptx::fence_operand(v_step_desc);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // 16 columns of D: column block kk / 4, 32 bytes along its rows.
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, q_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kRows>::template ss<0>(s, ptx::advance_smem_desc(k_step_desc, kv_bytes),
                                                   ptx::advance_smem_desc(q_desc, stage_bytes + q_bytes), kk > 0);
    }
    // At D = 128, S^T alone goes behind the last block's dQ: with dP^T in flight too, dQ's
    // accumulators, dK, dV, S^T and dP^T would be 224 registers a thread (and at D = 64 with
    // 128-query blocks). At D = 64 with 64 (144) both go, and dQ is sent out while both run.
    constexpr bool kDpBehindDq = D == 64 && kRows == 64;
    if constexpr (kHasLast && !kDpBehindDq) {
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();  // the last block's dQ is in registers; S^T may still run
      store_dq(step - 1);
      ptx::wgmma_fence();  // dp's registers, before the wgmmas below write them
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, do_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kRows>::template ss<0>(dp, ptx::advance_smem_desc(v_step_desc, kv_bytes),
                                                   ptx::advance_smem_desc(do_desc, stage_bytes + do_bytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    if constexpr (kHasLast && kDpBehindDq) {
      ptx::wgmma_wait_group<1>();  // the last block's dQ is in registers; S^T and dP^T may still run
      store_dq(step - 1);
    }
    ptx::wgmma_wait_group<0>();  // S^T and dP^T are in registers
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);

    probabilities_and_score_grads(s, dp, smem, stage, f, seq, m0, n_wg, key0, viewers, tig, scale_log2);

    // P^T and dS^T as wgmma A fragments, one per 16 queries (n8 tiles 2kk and 2kk + 1).
    uint32_t p_frag[kRows / 16][4], ds_frag[kRows / 16][4];
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p_frag[kk][r] = frag::pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        ds_frag[kk][r] = frag::pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      }

    // dS^T into shared memory: per 64 queries a block of 64 rows of 128 bytes, row = key,
    // column = query, in TMA's 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)).
    // Per 16 queries one stmatrix of the packed fragment's four 8x8 matrices (register i: keys
    // g + 8 (i % 2), queries 8 (2 kk + i / 2) + 2 t); lane l gives row l % 8 of matrix l / 8.
    // The blocks start on 1024-byte boundaries, so the swizzled chunk (2 (kk % 4) + l / 16) ^
    // (l % 8) is the lane's kk = 0 address XOR 32 (kk % 4) bytes, plus kk / 4 blocks: one address
    // a lane (16 store addresses spilled at D = 128).
    // Before the wgmmas below are issued: the PTX ISA allows no access to the A registers of a
    // wgmma in flight.
    const int ds_row = 16 * warp_in_wg + lane % 8 + 8 * (lane / 8 % 2);
    const uint32_t ds_lane =
        ptx::cvta_to_shared_u32(smem.ds[step % 2][warpgroup]) + ds_row * kSwizzleBytes + ((lane / 16 ^ lane % 8) << 4);
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk)
      ptx::stmatrix_x4((ds_lane ^ (kk % 4 << 5)) + kk / 4 * 64 * kSwizzleBytes, ds_frag[kk]);
    ptx::fence_proxy_async_shared_cta();  // the writes above, before the dQ wgmma (async proxy) reads them

    // dV += P^T dO and dK += dS^T Q: per 16 queries one wgmma with N = D; dO and Q are read
    // N-major (16 queries = 2048 bytes down the tile; column blocks kRows * 128 bytes apart).
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
    ptx::wgmma_fence();  // the packed fragments are written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk)
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dv, p_frag[kk], ptx::advance_smem_desc(do_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk)
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dk, ds_frag[kk], ptx::advance_smem_desc(q_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
    ptx::wgmma_commit_group();

    ptx::bar_sync(kDsBarrier, kConsumerThreads);  // both warpgroups have stored and fenced their dS^T tiles
    ptx::wgmma_wait_group<0>();                   // dV, dK done: the fragments' registers are free
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
#pragma unroll
    for (int kk = 0; kk < kRows / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) ptx::fence_operand(p_frag[kk][r]), ptx::fence_operand(ds_frag[kk][r]);
    // This warp's last reads of the stage (S^T, dP^T, dV and dK) have completed: the producer
    // may refill it.
    if (lane == 0) ptx::mbarrier_arrive(&smem.consumed[stage]);
  };
  run_step(0, std::false_type{});
  for (int step = 1; step < steps; ++step) run_step(step, std::true_type{});
  issue_dq(steps - 1);
  ptx::wgmma_wait_group<0>();  // the last block's dQ
  store_dq(steps - 1);
  if (p.dk_accum == nullptr)
    store_dk_dv(smem, dk, dv, dk_map, dv_map, p, seq, warpgroup, n_wg, head_kv, key0, grad_scale);
  else
    add_dk_dv(smem, dk, dv, dk_map, dv_map, p, seq, warpgroup, n_wg, head, head_kv, batch, key0, grad_scale);
}

}  // namespace hattn::bwd
