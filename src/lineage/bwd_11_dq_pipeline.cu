// Parent: bwd_10_dq_pass.
// Backward step 11: B10's dQ pass pipelined, at D = 256. B10's dq_kernel runs its 64 queries in
// lock step: both warpgroups compute S and dP for half of a key block each, meet at a barrier
// to share dS through shared memory, add dS K, wait for it, and meet again before the next
// block; its S and dP are m64n32 products that read more shared memory than the tensor cores
// need. Here dq_kernel takes 128 queries:
//   a producer warpgroup loads Q and dO once and streams K (two stages) and V (one) on
//   full/empty barriers, as the forward's final kernel does;
//   consumer warpgroup w owns 64 of the queries and all of D: S = Q_w K^T and dP = dO_w V^T
//   over the whole 64-key block (m64n64), dS in its registers as the A operand of
//   dQ_w += dS K (m64n256), so neither warpgroup ever waits for the other, and a block's dQ
//   runs on the tensor cores while the next block's S and dP are issued.
// dkdv_kernel is B10's. Dense batches only (the production backward runs variable-length ones
// at D = 256).
//
// dkdv_kernel's barriers (who arrives -> who waits):
//   kv_full          thread 0's expect_tx + TMA bytes -> all threads, once
//   qdo_full[s]      thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   __syncthreads    all threads -> thread 0, before it refills the stage the last block read;
//                    also: the last block's wgmmas (which read the P^T and dS^T tiles) have
//                    completed in both warpgroups before either writes the tiles again
//   named 1          all 256 threads: both halves of P^T and dS^T written (and fenced to the
//                    async proxy) before either warpgroup's dV or dK wgmma reads them
// dq_kernel's are listed at the kernel.
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
#include "ptx/setmaxnreg.cuh"
#include "ptx/smem.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_11_dq_pipeline";
constexpr int kD = 256;
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockN = 64;                    // keys per CTA (dkdv_kernel), per step (dq_kernel)
constexpr int kBlockM = 64;                    // query rows per step (dkdv_kernel), per TMA box of Q and dO
constexpr int kHalfM = kBlockM / kWarpgroups;  // the query columns of S^T a warpgroup computes
constexpr int kHalfD = kD / kWarpgroups;       // the columns of dK, dV and dQ a warpgroup owns
constexpr int kColBlocks = kD / 64;            // 64-element (128-byte) column blocks of a row
constexpr int kStages = 2;                     // dkdv_kernel's Q/dO blocks in flight
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

// dq_kernel: 128 queries a CTA, two consumer warpgroups of 64 each and a producer warpgroup.
constexpr int kDqBlockM = 128;                   // query rows per CTA
constexpr int kDqThreads = 128 * (1 + kWarpgroups);
constexpr int kKStages = 2;                      // K blocks in flight (K is read by S and by dQ)
constexpr int kProducerRegisters = 24;           // setmaxnreg budgets: 24 + 2 x 240 = 504 = 3 x 168,
constexpr int kConsumerRegisters = 240;          // the CTA's pool under __launch_bounds__(384, 1)
static_assert(kProducerRegisters + kWarpgroups * kConsumerRegisters <= (1 + kWarpgroups) * (65536 / kDqThreads / 8 * 8),
              "setmaxnreg budgets exceed the CTA's registers at launch");

// dq_kernel's shared memory: the CTA's 128 rows of Q and dO (loaded once), K of a block of 64
// keys in two stages and V in one (V is done with after dP, early in a step, so the next
// block's V has the rest of the step to land; two V stages would not fit).
template <typename T>
struct DqStorage {
  alignas(kAtomBytes) T q[kColBlocks][kDqBlockM * 64];
  alignas(kAtomBytes) T dout[kColBlocks][kDqBlockM * 64];
  alignas(kAtomBytes) T k[kKStages][kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kColBlocks][kBlockN * 64];
  uint64_t qdo_full;
  uint64_t k_full[kKStages];
  uint64_t k_empty[kKStages];
  uint64_t v_full;
  uint64_t v_empty;
};

template <typename T>
constexpr int dq_smem_bytes() {
  return int(sizeof(DqStorage<T>)) + kAtomBytes;  // + slack to align the base to 1024
}

// dQ for 128 queries, over the keys they see, 64 at a time. Warpgroup w (0, 1) owns queries
// 64 w .. 64 w + 63 of the block and all of D:
//   S = Q_w K^T, dP = dO_w V^T   (m64n64, 16 k16 steps, A and B in shared memory)
//   dS = P (dP - delta), packed in registers as the A operand of
//   dQ_w += dS K                  (m64n256, 4 k16 steps, K read N-major)
// so no tile goes through shared memory and the warpgroups never wait for each other. A
// producer warpgroup loads Q and dO once and streams K and V; dQ(t) runs on the tensor cores
// while step t + 1 issues its S and dP.
// Barriers (who arrives -> who waits):
//   qdo_full        the producer's expect_tx + TMA bytes -> the consumers, once
//   k_full[s]       the same -> the consumers, per use of K stage s
//   v_full          the same -> the consumers, per step
//   v_empty         each consumer warp, once its dP has completed -> the producer, before the
//                   next block's V overwrites the stage (8 arrivals)
//   k_empty[s]      each consumer warp, once its dQ over the block has completed (seen at the
//                   next step's wait) -> the producer, before stage s takes the block after next
template <typename T>
__global__ void __launch_bounds__(kDqThreads, 1)
    dq_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
              const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
              const BaseBackwardParams p) {
  constexpr int kKTiles = kBlockN / 8;  // n8 column tiles of S and dP
  constexpr int kDTiles = kD / 8;       // n8 column tiles of dQ
  constexpr int kKSteps = kBlockN / 16;  // k16 steps of dQ += dS K
  extern __shared__ unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<DqStorage<T>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const AttentionParams& f = p.fwd;
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;  // -1: the producer
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int m0 = int(blockIdx.x) * kDqBlockM, head = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head / f.heads_per_kv;

  // The keys the block's queries see (both ends are monotone in the query): the same sweep for
  // both warpgroups; a key a query does not see gets dS = 0.
  int key_first, key_last, unused;
  visible_keys(f, m0, &key_first, &unused);
  visible_keys(f, min(m0 + kDqBlockM, f.seqlen_q) - 1, &unused, &key_last);
  const int n_begin = key_first / kBlockN * kBlockN;
  const int steps = key_last > n_begin ? (key_last - n_begin + kBlockN - 1) / kBlockN : 0;

  // This thread's rows of dQ (queries query0, query0 + 8; columns 8 nt + 2 t, + 1), scaled and
  // written once in the gradient's dtype: each row is this CTA's alone (4-byte stores: the
  // gradients' rows are 16-byte aligned, validate_backward_arguments).
  const int query0 = m0 + 64 * warpgroup + 16 * warp_in_wg + group;
  auto store_dq = [&](const float* dq) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = query0 + 8 * r;
      if (i >= f.seqlen_q) continue;
      T* row = static_cast<T*>(p.dq) + batch * p.dq_batch_stride + i * p.dq_seq_stride + head * p.dq_head_stride;
#pragma unroll
      for (int nt = 0; nt < kDTiles; ++nt)
        *reinterpret_cast<uint32_t*>(row + 8 * nt + 2 * tig) =
            frag::pack2<T>(f.scale * dq[nt * 4 + 2 * r], f.scale * dq[nt * 4 + 2 * r + 1]);
    }
  };
  if (steps == 0) {  // no key seen (CTA-uniform): dQ is 0
    if (warpgroup >= 0) {
      const float zeros[kDTiles * 4] = {};
      store_dq(zeros);
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

  constexpr uint32_t kKBlockBytes = kBlockN * kD * sizeof(T);  // one block of K (or V)
  if (warpgroup < 0) {
    // Producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads.
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::mbarrier_arrive_expect_tx(&smem.qdo_full, 2 * kDqBlockM * kD * sizeof(T));
#pragma unroll
      for (int half = 0; half < 2; ++half)  // the maps' boxes are 64 rows
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb) {
          ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb] + half * 64 * 64, &q_map, cb * 64, m0 + 64 * half, head, batch,
                                           &smem.qdo_full);
          ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[cb] + half * 64 * 64, &dout_map, cb * 64, m0 + 64 * half, head,
                                           batch, &smem.qdo_full);
        }
      for (int step = 0; step < steps; ++step) {
        const int n0 = n_begin + step * kBlockN, stage = step % kKStages;
        // WAR: both warpgroups' dQ over the block kKStages steps back has finished reading K.
        if (step >= kKStages) ptx::mbarrier_wait(&smem.k_empty[stage], (step / kKStages - 1) % 2);
        ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], kKBlockBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_g2s(smem.k[stage][cb], &k_map, cb * 64, n0, head_kv, batch, &smem.k_full[stage]);
        // WAR: both warpgroups' dP over the block before has finished reading V.
        if (step >= 1) ptx::mbarrier_wait(&smem.v_empty, (step - 1) % 2);
        ptx::mbarrier_arrive_expect_tx(&smem.v_full, kKBlockBytes);
#pragma unroll
        for (int cb = 0; cb < kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, n0, head_kv, batch, &smem.v_full);
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();

  // This thread's two queries: LSE (log2 units), delta and the keys they see (none past Sq).
  const int64_t row_base = (int64_t(batch) * f.heads_q + head) * f.seqlen_q;
  const float scale_log2 = f.scale * kLog2e;
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

  // S and dP: A = this warpgroup's 64 rows of Q or dO (K-major), B = K or V (K-major). dQ:
  // B = K read N-major (column blocks kBlockN * 128 bytes apart), A = dS from registers.
  constexpr uint32_t kQColBlockBytes = sizeof(smem.q[0]), kKColBlockBytes = sizeof(smem.k[0][0]);
  constexpr uint32_t kKStageBytes = sizeof(smem.k[0]);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0][0], 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0], 16, kAtomBytes);
  const uint64_t k_n_desc = ptx::make_smem_desc_sw128(smem.k[0][0], kBlockN * kSwizzleBytes, kAtomBytes);

  float dq[kDTiles * 4] = {};
  float s[kKTiles * 4], dp[kKTiles * 4];
  uint32_t ds_frag[kKSteps][4];  // dS as wgmma A fragments, one per 16 keys
  ptx::mbarrier_wait(&smem.qdo_full, 0);  // Q and dO have landed

  for (int step = 0; step < steps; ++step) {
    const int n0 = n_begin + step * kBlockN, stage = step % kKStages;
    const uint32_t stage_bytes = stage * kKStageBytes;
    ptx::mbarrier_wait(&smem.k_full[stage], (step / kKStages) % 2);  // this block's K has landed
#pragma unroll
    for (int i = 0; i < kKTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp were read and written by the step before: those accesses come first
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t q_bytes = kk / 4 * kQColBlockBytes + kk % 4 * 32;  // 16 columns of D
      const uint32_t k_bytes = kk / 4 * kKColBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                                   ptx::advance_smem_desc(k_desc, stage_bytes + k_bytes), kk > 0);
    }
    ptx::mbarrier_wait(&smem.v_full, step % 2);  // this block's V has landed
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t q_bytes = kk / 4 * kQColBlockBytes + kk % 4 * 32;
      const uint32_t v_bytes = kk / 4 * kKColBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(dp, ptx::advance_smem_desc(do_desc, q_bytes),
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
    // n0 + 8 nt + 2 t + e % 2.
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
      Status st = launch_per_key_block(dkdv_kernel<T>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, maps.q,
                                       maps.k, maps.v, dout_map, p);
      if (!st.ok()) return st;
      return launch_per_query_block(dq_kernel<T>, kDqBlockM, kDqThreads, kDqSmem, p.fwd, stream, kName, maps.q, maps.k,
                                    maps.v, dout_map, p);
    }
    // dK and dV are written by dkdv_kernel without GQA (else summed and converted); dQ always
    // by dq_kernel.
  }, /*dkdv_written_by_kernel=*/fwd.heads_q == fwd.heads_kv, /*dq_written_by_kernel=*/true);
}

}  // namespace

const BackwardKernel& backward_dq_pipeline() {
  static const BackwardKernel kernel{
      kName, "D = 256: the dQ pass warp-specialized, a producer streaming K and V, dS in registers", supports, launch};
  return kernel;
}

}  // namespace hattn
