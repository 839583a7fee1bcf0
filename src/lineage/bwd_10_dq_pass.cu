// Parent: bwd_09_split_d.
// Backward step 10: dQ in a pass of its own, at D = 256. In B09 a CTA's 64 keys add a whole
// dQ partial (64 queries x 256 columns, fp32) per query block by atomics, and those atomics
// take about 40% of its time: the L2 does one reduction a 32-byte sector, so only fewer bytes
// would help, and 64 keys is all a CTA can hold dK and dV for. Here the backward is two kernels:
//   dkdv_kernel: B09's loop without dQ (S^T, dP^T, P^T and dS^T; dV and dK), per 64 keys
//   dq_kernel:   per 64 queries, over the keys they see: S and dP again, dS, and dQ += dS K,
//                held in registers and written once in the gradient's dtype (no atomics, and
//                no fp32 sum to zero and convert)
// dq_kernel is dkdv_kernel's loop with queries and keys swapped: warpgroup w computes S and dP
// for 32 of the block's 64 keys with all of D, writes its columns of dS to shared memory, and
// both read all 64 as the A operand of dQ[:, cols w] += dS K[:, cols w]. The price is S and dP
// computed twice: 7 GEMMs where B09 has 5.
// Dense batches only (the production backward runs variable-length ones at D = 256).
//
// dkdv_kernel's barriers (who arrives -> who waits):
//   kv_full          thread 0's expect_tx + TMA bytes -> all threads, once
//   qdo_full[s]      thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   __syncthreads    all threads -> thread 0, before it refills the stage the last block read;
//                    also: the last block's wgmmas (which read the P^T and dS^T tiles) have
//                    completed in both warpgroups before either writes the tiles again
//   named 1          all 256 threads: both halves of P^T and dS^T written (and fenced to the
//                    async proxy) before either warpgroup's dV or dK wgmma reads them
// dq_kernel's are the same with K/V and Q/dO swapped (see there).
#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "backward.h"
#include "backward_common.cuh"
#include "fragment.cuh"
#include "ptx/ex2.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/named_barrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_10_dq_pass";
constexpr int kD = 256;
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockN = 64;                    // keys per CTA (dkdv_kernel), per step (dq_kernel)
constexpr int kBlockM = 64;                    // query rows per step (dkdv_kernel), per CTA (dq_kernel)
constexpr int kHalfM = kBlockM / kWarpgroups;  // the query columns of S^T a warpgroup computes
constexpr int kHalfD = kD / kWarpgroups;       // the columns of dK, dV and dQ a warpgroup owns
constexpr int kHalfN = kBlockN / kWarpgroups;  // dq_kernel: the key columns of S a warpgroup computes
constexpr int kColBlocks = kD / 64;            // 64-element (128-byte) column blocks of a row
constexpr int kStages = 2;                     // Q/dO (dkdv_kernel) or K/V (dq_kernel) blocks in flight
constexpr int kSwizzleBytes = 128;             // one row of a 64-column block
constexpr int kAtomBytes = 1024;               // 8 rows x 128 bytes: the swizzle pattern's period
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kTilesBarrier = 1;               // named barrier 1: both warpgroups' halves of the shared tiles written

// Every tile is [column blocks][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T>
struct SharedStorage {
  alignas(kAtomBytes) T k[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T q[kStages][kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T dout[kStages][kColBlocks][kBlockM * 64];
  // P^T and dS^T of the block: [key][query], 64 x 64, swizzled like a TMA box.
  alignas(kAtomBytes) T pt[kBlockN * kBlockM];
  alignas(kAtomBytes) T dst[kBlockN * kBlockM];
  float lse_log2[kStages][kBlockM];  // each block's LSE (log2 units) and delta, per query
  float delta[kStages][kBlockM];
  uint64_t kv_full;
  uint64_t qdo_full[kStages];
};

template <typename T>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T>)) + kAtomBytes;  // + slack to align the base to 1024
}

// Issues the TMA copies of query block `m0` (Q and dO) into `stage` (thread 0 only).
template <typename T>
__device__ __forceinline__ void load_queries(SharedStorage<T>& smem, const CUtensorMap* q_map,
                                             const CUtensorMap* dout_map, int stage, int m0, int head, int batch) {
  ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], 2 * kBlockM * kD * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.q[stage][cb], q_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[stage][cb], dout_map, cb * 64, m0, head, batch,
                                     &smem.qdo_full[stage]);
  }
}

// This thread's dK and dV rows (keys key0 and key0 + 8; columns c0 + 8 dt + 2 t, + 1), scaled
// dK: into the fp32 sums of the K/V head with atomics, or, when run_backward made none (no GQA:
// this CTA alone computes these rows), written once in T.
template <typename T>
__device__ __forceinline__ void store_dk_dv(const BaseBackwardParams& p, int batch, int head_kv, int key0, int c0, int tig,
                                            const float* dk, const float* dv) {
  constexpr int kDTiles = kHalfD / 8;
  const AttentionParams& f = p.fwd;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= f.seqlen_k) continue;
    if (p.dk_accum == nullptr) {
      // 4-byte stores: the gradients' rows are 16-byte aligned (validate_backward_arguments).
      T* dk_row = static_cast<T*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_seq_stride + head_kv * p.dk_head_stride;
      T* dv_row = static_cast<T*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_seq_stride + head_kv * p.dv_head_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dk_row + c0 + 8 * dt + 2 * tig) =
            frag::pack2<T>(f.scale * dk[dt * 4 + 2 * r], f.scale * dk[dt * 4 + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dv_row + c0 + 8 * dt + 2 * tig) =
            frag::pack2<T>(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]);
      }
    } else {
      const int64_t at = ((int64_t(batch) * f.seqlen_k + key) * f.heads_kv + head_kv) * kD + c0 + 2 * tig;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        atomicAdd(reinterpret_cast<float2*>(p.dk_accum + at + 8 * dt),
                  make_float2(f.scale * dk[dt * 4 + 2 * r], f.scale * dk[dt * 4 + 2 * r + 1]));
        atomicAdd(reinterpret_cast<float2*>(p.dv_accum + at + 8 * dt), make_float2(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]));
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
                const BaseBackwardParams p) {
  constexpr int kQTiles = kHalfM / 8;  // n8 column tiles of this warpgroup's S^T and dP^T
  constexpr int kDTiles = kHalfD / 8;  // n8 column tiles of its dK and dV
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  auto& smem = *reinterpret_cast<SharedStorage<T>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const AttentionParams& f = p.fwd;
  // Through a shuffle, so that the compiler knows it is warp-uniform (as in B03-B08).
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int n0 = int(blockIdx.x) * kBlockN, head = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head / f.heads_per_kv;
  const int key0 = n0 + 16 * warp_in_wg + group;  // this thread's keys (rows of S^T, dK, dV): key0, key0 + 8
  const int q_col0 = kHalfM * warpgroup;          // this warpgroup's query columns of S^T
  const int c0 = kHalfD * warpgroup;              // its columns of dK and dV
  const float scale_log2 = f.scale * kLog2e;

  int q_first, q_last;
  queries_seeing(f, n0, n0 + kBlockN, &q_first, &q_last);
  const int m_begin = q_first / kBlockM * kBlockM;
  const int steps = q_last > m_begin ? (q_last - m_begin + kBlockM - 1) / kBlockM : 0;  // none: no query sees the keys

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::mbarrier_init(&smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&smem.qdo_full[s], 1);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized
  if (steps == 0) {  // no query sees these keys: their dK and dV are 0
    if (p.dk_accum == nullptr) {  // no zeroed sums here: write the zeros
      const float zeros[kDTiles * 4] = {};
      store_dk_dv<T>(p, batch, head_kv, key0, c0, tig, zeros, zeros);
    }
    return;
  }

  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&smem.kv_full, 2 * kBlockN * kD * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < kColBlocks; ++cb) {
      ptx::cp_async_bulk_tensor_4d_g2s(smem.k[cb], &k_map, cb * 64, n0, head_kv, batch,
                                       &smem.kv_full);
      ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, n0, head_kv, batch,
                                       &smem.kv_full);
    }
    load_queries<T>(smem, &q_map, &dout_map, 0, m_begin, head, batch);
  }

  // A block's LSE and delta go to shared memory a step ahead: threads 0-63 fetch LSE, 64-127
  // delta (0 past Sq), as in B08, into a register first (fetch_row_stat), stored once S^T and
  // dP^T are done (store_row_stat).
  const int64_t row_base = (int64_t(batch) * f.heads_q + head) * f.seqlen_q;
  auto fetch_row_stat = [&](int m0) -> float {
    const int t = int(threadIdx.x) % kBlockM, i = m0 + t;
    if (i >= f.seqlen_q) return 0.f;
    if (threadIdx.x < kBlockM) return f.lse[row_base + i] * kLog2e;
    if (threadIdx.x < 2 * kBlockM) return p.delta[row_base + i];
    return 0.f;
  };
  auto store_row_stat = [&](int stage, float v) {
    const int t = int(threadIdx.x) % kBlockM;
    if (threadIdx.x < kBlockM)
      smem.lse_log2[stage][t] = v;
    else if (threadIdx.x < 2 * kBlockM)
      smem.delta[stage][t] = v;
  };
  store_row_stat(0, fetch_row_stat(m_begin));

  // Descriptors built once; a k16 step adds a byte offset (advance_smem_desc, as in B08).
  constexpr uint32_t kKBlockBytes = kBlockN * 64 * sizeof(T);  // one 64-column block of K or V
  constexpr uint32_t kQBlockBytes = kBlockM * 64 * sizeof(T);  // one of Q or dO
  constexpr uint32_t kQStageBytes = kColBlocks * kQBlockBytes;
  // S^T and dP^T: A = K or V (64 keys, K-major), B = this warpgroup's 32 rows of Q or dO
  // (K-major; 32 rows = 4096 bytes down the tile, a whole number of swizzle atoms).
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0], 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0], 16, kAtomBytes);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0][0] + q_col0 * 64, 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0][0] + q_col0 * 64, 16, kAtomBytes);
  // dV and dK: A = P^T or dS^T (64 keys x 64 queries, K-major), B = this warpgroup's 128
  // columns of dO or Q, read N-major (column blocks kBlockM * 128 bytes apart).
  const uint64_t pt_desc = ptx::make_smem_desc_sw128(smem.pt, 16, kAtomBytes);
  const uint64_t dst_desc = ptx::make_smem_desc_sw128(smem.dst, 16, kAtomBytes);
  const uint64_t do_n_desc = ptx::make_smem_desc_sw128(smem.dout[0][c0 / 64], kBlockM * kSwizzleBytes, kAtomBytes);
  const uint64_t q_n_desc = ptx::make_smem_desc_sw128(smem.q[0][c0 / 64], kBlockM * kSwizzleBytes, kAtomBytes);
  // stmatrix addresses of this lane in the P^T and dS^T tiles (see the store below).
  const int tile_row = 16 * warp_in_wg + lane % 8 + 8 * (lane / 8 % 2);
  const uint32_t tile_lane = uint32_t(tile_row * kSwizzleBytes + ((lane / 16 ^ lane % 8) << 4));
  const uint32_t pt_base = ptx::cvta_to_shared_u32(smem.pt), dst_base = ptx::cvta_to_shared_u32(smem.dst);

  float dk[kDTiles * 4] = {}, dv[kDTiles * 4] = {};
  ptx::mbarrier_wait(&smem.kv_full, 0);  // K and V have landed

  for (int step = 0; step < steps; ++step) {
    const int m0 = m_begin + step * kBlockM, stage = step % kStages;
    // WAR: every thread is done with the block before (its wgmmas completed, its reads of the
    // LSE and delta done), so that block's stage and the P^T and dS^T tiles may be reused.
    // RAW: this block's LSE and delta, written a step ago, are visible.
    __syncthreads();
    const bool more = step + 1 < steps;
    float next_stat = 0.f;
    if (more) {
      if (threadIdx.x == 0)
        load_queries<T>(smem, &q_map, &dout_map, (step + 1) % kStages, m0 + kBlockM, head,
                        batch);
      next_stat = fetch_row_stat(m0 + kBlockM);  // lands while S^T and dP^T run
    }

    // S^T and dP^T for this warpgroup's 32 queries: per 16 columns of D one wgmma each.
    float s[kQTiles * 4], dp[kQTiles * 4];
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) % 2);  // this block's Q and dO have landed
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp reuse registers of the step before: those accesses come first
    const uint32_t stage_bytes = stage * kQStageBytes;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      // 16 columns of D: column block kk / 4, 32 bytes along its rows.
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, q_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kHalfM>::template ss<0>(s, ptx::advance_smem_desc(k_desc, kv_bytes),
                                                  ptx::advance_smem_desc(q_desc, stage_bytes + q_bytes), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, do_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kHalfM>::template ss<0>(dp, ptx::advance_smem_desc(v_desc, kv_bytes),
                                                  ptx::advance_smem_desc(do_desc, stage_bytes + do_bytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();  // S^T and dP^T are in registers
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    if (more) store_row_stat((step + 1) % kStages, next_stat);

    // P^T and dS^T. Accumulator element e of n8 tile nt is key key0 + 8 (e / 2), query
    // m0 + q_col0 + 8 nt + 2 t + e % 2. Masked where this warpgroup's part of the tile is not
    // wholly visible (visible_keys is monotone in the query).
    int first_lo, last_lo, first_hi, last_hi;
    visible_keys(f, m0 + q_col0, &first_lo, &last_lo);
    visible_keys(f, m0 + q_col0 + kHalfM - 1, &first_hi, &last_hi);
    const bool need_mask = m0 + q_col0 + kHalfM > f.seqlen_q || n0 + kBlockN > f.seqlen_k || last_lo < n0 + kBlockN ||
                           first_hi > n0;
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
      const int col = q_col0 + 8 * nt + 2 * tig;  // of the block; this and col + 1
      const float2 lse = *reinterpret_cast<const float2*>(&smem.lse_log2[stage][col]);
      const float2 delta = *reinterpret_cast<const float2*>(&smem.delta[stage][col]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bool visible = true;
        if (need_mask) {
          const int i = m0 + col + e % 2, j = key0 + 8 * (e / 2);
          int first = 0, last = 0;
          if (i < f.seqlen_q) visible_keys(f, i, &first, &last);
          visible = j >= first && j < last;
        }
        // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
        const float pv =
            visible ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -(e % 2 ? lse.y : lse.x))) : 0.f;
        s[nt * 4 + e] = pv;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x));
      }
    }

    // This warpgroup's 32 columns of P^T and dS^T into the shared tiles: row = key, column =
    // query, in TMA's 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)). Per 16
    // queries one stmatrix of the packed fragment's four 8x8 matrices (register i: keys
    // g + 8 (i % 2), queries 8 (2 kk + i / 2) + 2 t of the warpgroup's); lane l gives row l % 8
    // of matrix l / 8. Its chunk (4 w + 2 kk + l / 16) ^ (l % 8) is the lane's kk = 0, w = 0
    // address XOR (4 w + 2 kk) * 16 bytes (the tiles start on 1024-byte boundaries).
#pragma unroll
    for (int kk = 0; kk < kHalfM / 16; ++kk) {
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
    ptx::fence_proxy_async_shared_cta();  // the tiles' stores, before the wgmmas (async proxy) read them
    ptx::bar_sync(kTilesBarrier, kThreads);  // both warpgroups' halves are in the tiles

    // dV += P^T dO and dK += dS^T Q over the block's 64 queries, 16 at a time, from shared
    // memory. No dQ here: dq_kernel computes it.
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
    ptx::wgmma_fence();  // the accumulators' registers, before the wgmmas below use them
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      ptx::WgmmaM64K16<T, kHalfD>::template ss<1>(dv, ptx::advance_smem_desc(pt_desc, kk * 32),
                                                  ptx::advance_smem_desc(do_n_desc, stage_bytes + kk * 16 * kSwizzleBytes),
                                                  1);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      ptx::WgmmaM64K16<T, kHalfD>::template ss<1>(dk, ptx::advance_smem_desc(dst_desc, kk * 32),
                                                  ptx::advance_smem_desc(q_n_desc, stage_bytes + kk * 16 * kSwizzleBytes),
                                                  1);
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();  // dV and dK done: the tiles may be rewritten after the next barrier
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
  }

  // This warpgroup's columns of dK and dV: written once, or into the sums of its K/V head.
  store_dk_dv<T>(p, batch, head_kv, key0, c0, tig, dk, dv);
}

// dq_kernel's shared memory: the CTA's 64 rows of Q and dO (loaded once), K and V of a block of
// 64 keys in two stages, and the block's dS ([query][key], swizzled like a TMA box).
template <typename T>
struct DqStorage {
  alignas(kAtomBytes) T q[kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T dout[kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T k[kStages][kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kStages][kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T ds[kBlockM * kBlockN];
  uint64_t qdo_full;
  uint64_t kv_full[kStages];
};

template <typename T>
constexpr int dq_smem_bytes() {
  return int(sizeof(DqStorage<T>)) + kAtomBytes;  // + slack to align the base to 1024
}

// Issues the TMA copies of key block `n0` (K and V) into `stage` (thread 0 only).
template <typename T>
__device__ __forceinline__ void load_keys(DqStorage<T>& smem, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                          int stage, int n0, int head_kv, int batch) {
  ptx::mbarrier_arrive_expect_tx(&smem.kv_full[stage], 2 * kBlockN * kD * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.k[stage][cb], k_map, cb * 64, n0, head_kv, batch, &smem.kv_full[stage]);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.v[stage][cb], v_map, cb * 64, n0, head_kv, batch, &smem.kv_full[stage]);
  }
}

// dQ for 64 queries, over the keys they see, 64 at a time: dkdv_kernel's loop with the roles of
// queries and keys swapped. Warpgroup w computes S and dP for keys 32 w .. 32 w + 31 of each
// block with the whole of D, writes its columns of dS to shared memory, and after named barrier
// 1 adds dS K[:, cols w] over all 64 keys into dQ[:, cols w], which stays in its registers.
//   S[:, half w] = Q K[half w]^T, dP[:, half w] = dO V[half w]^T   (m64n32, 16 k16 steps)
//   dQ[:, cols w] += dS K[:, cols w]   (m64n128, A and B in smem)
// Barriers: qdo_full (once) and kv_full[s] (per use of stage s): thread 0's expect_tx + TMA
// bytes -> all threads; __syncthreads: all threads are done with the block before (its
// wgmmas completed) before thread 0 refills that stage or anyone rewrites the dS tile;
// named 1: both halves of dS written and fenced before either warpgroup's dQ wgmmas.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    dq_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
              const BaseBackwardParams p) {
  constexpr int kKTiles = kHalfN / 8;  // n8 column tiles of this warpgroup's S and dP
  constexpr int kDTiles = kHalfD / 8;  // n8 column tiles of its dQ
  extern __shared__ unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<DqStorage<T>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const AttentionParams& f = p.fwd;
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int m0 = int(blockIdx.x) * kBlockM, head = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head / f.heads_per_kv;
  const int query0 = m0 + 16 * warp_in_wg + group;  // this thread's queries (rows of S and dQ): query0, query0 + 8
  const int key_col0 = kHalfN * warpgroup;          // this warpgroup's key columns of S and dP
  const int c0 = kHalfD * warpgroup;                // its columns of dQ
  const float scale_log2 = f.scale * kLog2e;

  // This thread's rows of dQ (queries query0, query0 + 8; columns c0 + 8 nt + 2 t, + 1), scaled,
  // written once in the gradient's dtype: each row is this CTA's alone, so no atomics (4-byte
  // stores: the gradients' rows are 16-byte aligned, validate_backward_arguments).
  auto store_dq = [&](const float* dq) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = query0 + 8 * r;
      if (i >= f.seqlen_q) continue;
      T* row = static_cast<T*>(p.dq) + batch * p.dq_batch_stride + i * p.dq_seq_stride + head * p.dq_head_stride;
#pragma unroll
      for (int nt = 0; nt < kDTiles; ++nt)
        *reinterpret_cast<uint32_t*>(row + c0 + 8 * nt + 2 * tig) =
            frag::pack2<T>(f.scale * dq[nt * 4 + 2 * r], f.scale * dq[nt * 4 + 2 * r + 1]);
    }
  };

  // The keys the block's queries see (both ends are monotone in the query).
  int key_first, key_last, unused;
  visible_keys(f, m0, &key_first, &unused);
  visible_keys(f, min(m0 + kBlockM, f.seqlen_q) - 1, &unused, &key_last);
  const int n_begin = key_first / kBlockN * kBlockN;
  const int steps = key_last > n_begin ? (key_last - n_begin + kBlockN - 1) / kBlockN : 0;
  if (steps == 0) {  // no key seen: dQ is 0
    const float zeros[kDTiles * 4] = {};
    store_dq(zeros);
    return;
  }

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::mbarrier_init(&smem.qdo_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&smem.kv_full[s], 1);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&smem.qdo_full, 2 * kBlockM * kD * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < kColBlocks; ++cb) {
      ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb], &q_map, cb * 64, m0, head, batch,
                                       &smem.qdo_full);
      ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[cb], &dout_map, cb * 64, m0, head, batch,
                                       &smem.qdo_full);
    }
    load_keys<T>(smem, &k_map, &v_map, 0, n_begin, head_kv, batch);
  }

  // This thread's two queries: LSE (log2 units), delta and the keys they see (none past Sq).
  const int64_t row_base = (int64_t(batch) * f.heads_q + head) * f.seqlen_q;
  float lse_log2[2], delta[2];
  int first[2], last[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = query0 + 8 * r;
    lse_log2[r] = 0.f, delta[r] = 0.f, first[r] = 0, last[r] = 0;
    if (i < f.seqlen_q) {
      lse_log2[r] = f.lse[row_base + i] * kLog2e;
      delta[r] = p.delta[row_base + i];
      visible_keys(f, i, &first[r], &last[r]);
    }
  }

  constexpr uint32_t kBlockBytes = 64 * 64 * sizeof(T);  // one 64-column block of a 64-row tile
  constexpr uint32_t kKVStageBytes = kColBlocks * kBlockBytes;
  // S and dP: A = Q or dO (64 queries, K-major), B = this warpgroup's 32 rows of K or V
  // (K-major; 32 rows = 4096 bytes down the tile, a whole number of swizzle atoms).
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0], 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0], 16, kAtomBytes);
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0][0] + key_col0 * 64, 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0][0] + key_col0 * 64, 16, kAtomBytes);
  // dQ: A = dS (64 queries x 64 keys, K-major), B = this warpgroup's 128 columns of K, read
  // N-major (column blocks kBlockN * 128 bytes apart).
  const uint64_t ds_desc = ptx::make_smem_desc_sw128(smem.ds, 16, kAtomBytes);
  const uint64_t k_n_desc = ptx::make_smem_desc_sw128(smem.k[0][c0 / 64], kBlockN * kSwizzleBytes, kAtomBytes);
  // stmatrix address of this lane in the dS tile, as dkdv_kernel's for P^T and dS^T.
  const int tile_row = 16 * warp_in_wg + lane % 8 + 8 * (lane / 8 % 2);
  const uint32_t tile_lane = uint32_t(tile_row * kSwizzleBytes + ((lane / 16 ^ lane % 8) << 4));
  const uint32_t ds_base = ptx::cvta_to_shared_u32(smem.ds);

  float dq[kDTiles * 4] = {};
  ptx::mbarrier_wait(&smem.qdo_full, 0);  // Q and dO have landed

  for (int step = 0; step < steps; ++step) {
    const int n0 = n_begin + step * kBlockN, stage = step % kStages;
    // WAR: every thread is done with the block before (its wgmmas completed), so that block's
    // stage and the dS tile may be reused.
    __syncthreads();
    if (step + 1 < steps && threadIdx.x == 0)
      load_keys<T>(smem, &k_map, &v_map, (step + 1) % kStages, n0 + kBlockN, head_kv, batch);

    // S and dP for this warpgroup's 32 keys: per 16 columns of D one wgmma each.
    float s[kKTiles * 4], dp[kKTiles * 4];
    ptx::mbarrier_wait(&smem.kv_full[stage], (step / kStages) % 2);  // this block's K and V have landed
#pragma unroll
    for (int i = 0; i < kKTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp reuse registers of the step before: those accesses come first
    const uint32_t stage_bytes = stage * kKVStageBytes;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t col_bytes = kk / 4 * kBlockBytes + kk % 4 * 32;  // 16 columns of D
      ptx::WgmmaM64K16<T, kHalfN>::template ss<0>(s, ptx::advance_smem_desc(q_desc, col_bytes),
                                                  ptx::advance_smem_desc(k_desc, stage_bytes + col_bytes), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t col_bytes = kk / 4 * kBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kHalfN>::template ss<0>(dp, ptx::advance_smem_desc(do_desc, col_bytes),
                                                  ptx::advance_smem_desc(v_desc, stage_bytes + col_bytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();  // S and dP are in registers
#pragma unroll
    for (int i = 0; i < kKTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);

    // dS = P (dP - delta). Accumulator element e of n8 tile nt is query query0 + 8 (e / 2), key
    // n0 + key_col0 + 8 nt + 2 t + e % 2.
#pragma unroll
    for (int nt = 0; nt < kKTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2, j = n0 + key_col0 + 8 * nt + 2 * tig + e % 2;
        // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
        const float pv = j >= first[r] && j < last[r]
                             ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -lse_log2[r]))
                             : 0.f;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - delta[r]);
      }
    }

    // This warpgroup's 32 columns of dS into the shared tile (row = query, column = key), by
    // stmatrix as dkdv_kernel stores P^T and dS^T.
#pragma unroll
    for (int kk = 0; kk < kHalfN / 16; ++kk) {
      uint32_t ds_frag[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) ds_frag[r] = frag::pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      ptx::stmatrix_x4(ds_base + (tile_lane ^ uint32_t((key_col0 / 8 + 2 * kk) << 4)), ds_frag);
    }
    ptx::fence_proxy_async_shared_cta();  // the tile's stores, before the wgmmas (async proxy) read it
    ptx::bar_sync(kTilesBarrier, kThreads);  // both warpgroups' halves are in the tile

    // dQ += dS K over the block's 64 keys, 16 at a time.
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dq[i]);
    ptx::wgmma_fence();  // the accumulators' registers, before the wgmmas below use them
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      ptx::WgmmaM64K16<T, kHalfD>::template ss<1>(dq, ptx::advance_smem_desc(ds_desc, kk * 32),
                                                  ptx::advance_smem_desc(k_n_desc, stage_bytes + kk * 16 * kSwizzleBytes),
                                                  1);
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();  // dQ's wgmmas done: the stage and the tile may be reused
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dq[i]);
  }

  store_dq(dq);
}

// Refuses what the kernel cannot run, so that "auto" passes it on to an older kernel.
Status supports(const BackwardProblem& problem) {
  const AttentionProblem& p = problem.forward;
  if (p.head_dim != kD)
    return {StatusCode::not_supported,
            std::string(kName) + ": head_dim " + std::to_string(p.head_dim) +
                " is not supported (D = 256 only; bwd_08_dq_overlap runs D = 64 and 128)"};
  return Status::Ok();  // windows, varlen and KV caches: refused centrally (api.cpp)
}

Status launch(const BackwardProblem& problem, cudaStream_t stream) {
  const AttentionProblem& fwd = problem.forward;
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(fwd, kBlockM, kBlockN, kName, &maps);
  CUtensorMap dout_map;
  if (s.ok())
    s = make_bshd_tensor_map(&dout_map, problem.dout, fwd.dtype, fwd.tensor_batch(), fwd.tensor_rows_q(), fwd.heads_q,
                             fwd.head_dim, problem.dout_strides, kBlockM, 64);
  if (!s.ok()) return {s.code(), std::string(kName) + ": " + s.message()};
  return run_backward<AttentionParams>(problem, stream, kName, [&]<typename T, int D>(const BaseBackwardParams& p) -> Status {
    if constexpr (D != kD) {
      return {StatusCode::not_supported, std::string(kName) + ": head_dim != 256"};  // refused by supports()
    } else {
      constexpr int kSmem = smem_bytes<T>(), kDqSmem = dq_smem_bytes<T>();
      static_assert(kSmem <= 227 * 1024 && kDqSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
      Status st = launch_per_key_block(dkdv_kernel<T>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, maps.q, maps.k,
                                       maps.v, dout_map, p);
      if (!st.ok()) return st;
      return launch_per_query_block(dq_kernel<T>, kBlockM, kThreads, kDqSmem, p.fwd, stream, kName, maps.q, maps.k,
                                    maps.v, dout_map, p);
    }
    // dK and dV are written by dkdv_kernel without GQA (else summed and converted); dQ always
    // by dq_kernel.
  }, /*dkdv_written_by_kernel=*/fwd.heads_q == fwd.heads_kv, /*dq_written_by_kernel=*/true);
}

}  // namespace

const BackwardKernel& backward_dq_pass() {
  static const BackwardKernel kernel{
      kName, "D = 256: B09 without dQ, and dQ in a pass of its own (no atomics)",
      supports, launch, Features{.deterministic = Features::Deterministic::without_gqa}};
  return kernel;
}

}  // namespace hattn
