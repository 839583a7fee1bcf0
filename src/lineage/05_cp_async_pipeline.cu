// Lineage step 5: K/V tiles through a cp.async pipeline (FlashAttention-2 class).
// Parent: 04_swizzle.
//
// Kernel 5 focus (what changed from 04_swizzle):
//   1. Global -> shared copies use cp.async.cg (16 bytes per thread per instruction): the data
//      goes from L2 straight into shared memory, without passing through registers, and the
//      issuing thread does not wait for it.
//   2. K/V tiles live in a ring of kStages shared-memory stages. While the warps compute on
//      tile t, the copies of tile t + kStages - 1 are in flight; commit groups
//      (cp.async.commit_group / wait_group) track which tile has landed.
//   3. Out-of-range rows (the tail tile) are zero-filled by the copy itself: source size 0.
//   4. One barrier per tile instead of two: the barrier after waiting for tile t both
//      publishes tile t to all warps and proves that every warp is done with tile t - 1,
//      whose stage the prefetch issued right after it overwrites.
//   Q travels the same way (its own commit group, ahead of the first K/V tiles).
//
// Dataflow of one CTA; commit groups per thread, oldest first: Q, tile 0, ..., one per
// iteration (empty once the tiles run out, so that the wait counts stay in step):
//   prologue: issue Q; commit. Issue tiles 0 .. kStages-2 into stages 0 .. kStages-2; commit
//             each. wait_group<kStages-1> (Q has landed); barrier; Q -> registers (ldmatrix).
//   iteration t (stage t % kStages):
//   1. wait_group<kStages-2>: this thread's copies of tile t have landed.
//   2. barrier: all threads' copies of tile t are visible; every warp has left iteration t-1.
//   3. issue tile t + kStages - 1 into stage (t - 1) % kStages, freed by step 2; commit.
//   4. S = Q K^T, masks, online softmax, O += P V on stage t % kStages, exactly as in 04,
//      while the copies of step 3 run.
//   epilogue: as in 04.
// Timeline with kStages = 2 (Lt = copies of tile t in flight, Ct = compute on tile t):
//   copies:   L0 ------->| L1 ------->| L2 ------->| L3 ...
//   compute:  (wait L0)  | C0         | C1         | C2 ...
//   each L t+1 is issued at the start of C t and hides behind it.
//
// Why: in 04 every tile costs load latency + compute, and the tensor cores sit idle during the
// load (the latency of an L2/HBM round trip is comparable to one tile's MMA time).
// With the copy of the next tile in flight during this tile's MMAs, a tile costs about
// max(load, compute). cp.async also frees the registers 04 spent staging 16-byte loads.
// Expected effect: FlashAttention-2 territory on H200 for D = 64 and 128 at long sequences;
// measured in results/, see docs/guide/05_cp_async_pipeline.md.
// Known limits: still mma.sync, a fraction of Hopper's wgmma rate; every warp re-reads all of
// K and V from shared memory for only 16 or 32 query rows; address generation and the copies
// are issued by the same warps that compute (the TMA and warp specialization steps remove
// both).
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/cp_async.cuh"
#include "ptx/ex2.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"
#include "registry.h"

namespace hattn {
namespace {

constexpr const char* kName = "05_cp_async_pipeline";

// Tiling, per head dim. Tune here; everything else derives from these.
template <int D>
struct Config {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // m16 MMA tiles of query rows per warp. With two, every K or V fragment a warp loads from
  // shared memory feeds two MMAs instead of one: half the shared-memory bytes per MMA, at the
  // price of a second set of O and S accumulators. D = 256's O alone takes 128 registers per
  // m tile, so it keeps one.
  static constexpr int kMTiles = D <= 128 ? 2 : 1;
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static constexpr int kBlockM = kRowsPerWarp * kWarps;   // query rows per CTA
  // Keys per K/V tile. At D = 128 with two m tiles, 32 keys fit in 255 registers and 48 spill
  // about 60 bytes, yet 48 keys with 3 stages measured about 3.5% faster at S >= 2k: the
  // barrier, the row-max shuffles and the O rescale are paid per 48 keys instead of per 32,
  // and the few spilled values are L1 hits (the guide's chapter 05 has the measurements).
  static constexpr int kBlockN = D == 64 ? 64 : D == 128 ? 48 : 32;
  // K/V tiles in the shared-memory ring: 3 x 2 x 12 KiB at D = 128 still leaves room for
  // 2 CTAs per SM.
  static constexpr int kStages = D == 128 ? 3 : 2;
  // Q's A fragments take kMTiles * D / 4 registers per lane: kept for the whole K/V loop when
  // that is at most 32 (D = 64), otherwise re-read from shared memory with ldmatrix per tile.
  static constexpr bool kQInRegisters = kMTiles * D / 4 <= 32;

  static_assert(D % 16 == 0, "ldmatrix_x4 covers 16 columns of D at a time");
  static_assert(kBlockN % 16 == 0, "P V consumes keys 16 at a time (the k of m16n8k16)");
  static_assert(kMTiles >= 1, "a warp owns at least one m16 tile of query rows");
  static_assert(kStages >= 2, "a pipeline needs one stage to compute on and one to load into");
  static_assert((kBlockM * D / 8) % kThreads == 0 && (kBlockN * D / 8) % kThreads == 0,
                "tile loads give every thread the same number of 16-byte chunks");
};

constexpr int kChunkElems = 8;  // one 16-byte chunk holds 8 bf16/fp16 elements
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int D>
struct SharedStorage {
  alignas(128) T q[Config<D>::kBlockM * D];  // [kBlockM, D]; the epilogue stages O here
  alignas(128) T k[Config<D>::kStages][Config<D>::kBlockN * D];  // kStages x [kBlockN, D]
  alignas(128) T v[Config<D>::kStages][Config<D>::kBlockN * D];  // kStages x [kBlockN, D]
};
static_assert(sizeof(SharedStorage<__nv_bfloat16, 256>) <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");

// Element offset of (row, col) in a [rows, D] shared tile whose 16-byte chunks are
// XOR-swizzled: chunk c of row r is stored at chunk c ^ (r % 8). Rows stay where they were; the
// 8 chunks of each aligned group of 8 are permuted differently in each of 8 consecutive rows.
template <int D>
__device__ __forceinline__ int tile_offset(int row, int col) {
  static_assert(D / kChunkElems >= 8, "the swizzle permutes chunks in groups of 8: D >= 64");
  return row * D + ((col / kChunkElems) ^ (row % 8)) * kChunkElems + col % kChunkElems;
}

// Shared address of element (r + row, c + col) of the tile at shared address `tile`, where
// `lane_off` is the byte offset of this lane's own element (r, c) (its ldmatrix row pointer)
// and row % 8 == 0, col % 16 == 0 are compile-time offsets in the unrolled loops. Adding a
// multiple of 8 rows keeps r % 8, so the lane's swizzle carries over. The lane's chunk c / 8
// is 0 or 1 and the added chunk col / 8 is even: their low 3 bits are disjoint, so the
// swizzled chunk of the sum is the lane's swizzled chunk XOR (col / 8) % 8, plus the aligned
// rest. In a byte offset the chunk within a 128-byte row segment is bits 4..6: one XOR with a
// constant, rather than the compiler keeping a separately computed address for every
// (row, col) of the unrolled loops.
template <typename T, int D>
__device__ __forceinline__ uint32_t tile_addr(uint32_t tile, uint32_t lane_off, int row, int col) {
  static_assert(sizeof(T) * kChunkElems == 16, "chunks are 16 bytes");
  return tile + (lane_off ^ (col / kChunkElems % 8 * 16)) + sizeof(T) * (row * D + col / 64 * 64);
}

// Issues cp.async copies of rows [row0, row0 + kRows) of a [n_rows, D] matrix whose rows are
// `stride` elements apart into a shared tile, 16 bytes per thread per step; consecutive
// threads take consecutive chunks of a row (coalesced), and each thread keeps one column,
// stepping down kRowsPerStep rows at a time. Rows at or past n_rows read nothing and are
// zero-filled (source size 0): a zero K row adds a score that the mask replaces, and a zero V
// row keeps 0 * V finite (stale shared memory could hold Inf or NaN bit patterns). The caller
// commits and waits.
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_tile_async(T* tile /* [kRows, D] */, const T* src /* [n_rows, D] */,
                                                int64_t stride, int row0, int n_rows) {
  constexpr int kChunksPerRow = D / kChunkElems;
  constexpr int kRowsPerStep = kThreads / kChunksPerRow;
  constexpr int kSteps = kRows / kRowsPerStep;
  static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowsPerStep == 0,
                "whole rows per step, whole steps per tile");
  const int row = int(threadIdx.x) / kChunksPerRow, col = int(threadIdx.x) % kChunksPerRow * kChunkElems;
  const int rows_left = n_rows - row0 - row;  // rows from this thread's first one to the end of the matrix
  const T* from = src + int64_t(row0 + row) * stride + col;  // handed to the copy only while in range
  // When a step moves a multiple of 8 rows, row % 8 and so the swizzle stay the same: one
  // address plus a constant per step (else the compiler may keep one address per step).
  const uint32_t dst = ptx::cvta_to_shared_u32(tile + tile_offset<D>(row, col));
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const bool in_bounds = i * kRowsPerStep < rows_left;
    const uint32_t to = kRowsPerStep % 8 == 0
                            ? dst + uint32_t(sizeof(T) * i * kRowsPerStep * D)
                            : ptx::cvta_to_shared_u32(tile + tile_offset<D>(row + i * kRowsPerStep, col));
    // A zero-filled row still names a source address: row 0, which always exists.
    ptx::cp_async_cg_shared_global_16(to, in_bounds ? from : src, in_bounds);
    from += kRowsPerStep * stride;
  }
}

// The register cap is 255 either way; with the minimum of 1 CTA per SM stated, ptxas spills
// less at D = 128 (60 bytes instead of 80), as measured with -Xptxas -v. Two CTAs still fit.
template <typename T, int D>
__global__ void __launch_bounds__(Config<D>::kThreads, 1) cp_async_kernel(const AttentionParams p) {
  using Cfg = Config<D>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kThreads = Cfg::kThreads;
  constexpr int kMTiles = Cfg::kMTiles;  // m16 tiles of query rows per warp
  constexpr int kDTiles = D / 8;        // n8 tiles of O across D
  constexpr int kNTiles = kBlockN / 8;  // n8 tiles of S across the keys of a tile

  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(smem_raw);

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // mma fragment coordinates g and t (ptx/mma.cuh)
  const int m_block = int(blockIdx.x) * kBlockM;
  const int head_q = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head_q / p.heads_per_kv;

  // Row 0 of this (batch, head) in each tensor; rows are *_seq_stride elements apart.
  const T* q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head_q * p.q_head_stride;    // [Sq, D]
  const T* k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;   // [Sk, D]
  const T* v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;   // [Sk, D]
  T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride + head_q * p.out_head_stride;        // [Sq, D]

  // Keys this CTA reads: all of them, or with the causal mask those up to the diagonal of its
  // last row (tiles entirely above the diagonal are skipped). 0 when no row sees any key.
  int n_end = p.seqlen_k;
  if (p.causal) n_end = max(0, min(n_end, min(m_block + kBlockM, p.seqlen_q) + p.causal_offset));
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;

  // K/V tile `tile` into ring stage `stage`, as one commit group with the caller's commit.
  auto load_kv_async = [&](int tile, int stage) {
    load_tile_async<T, D, kBlockN, kThreads>(smem.k[stage], k, p.k_seq_stride, tile * kBlockN, p.seqlen_k);
    load_tile_async<T, D, kBlockN, kThreads>(smem.v[stage], v, p.v_seq_stride, tile * kBlockN, p.seqlen_k);
  };

  // Prologue: Q, then the first kStages - 1 K/V tiles, one commit group each. Groups are
  // committed even when empty (fewer tiles than stages) so that the counts below hold.
  load_tile_async<T, D, kBlockM, kThreads>(smem.q, q, p.q_seq_stride, m_block, p.seqlen_q);
  ptx::cp_async_commit_group();
#pragma unroll
  for (int stage = 0; stage < Cfg::kStages - 1; ++stage) {
    if (stage < n_tiles) load_kv_async(stage, stage);
    ptx::cp_async_commit_group();
  }
  ptx::cp_async_wait_group<Cfg::kStages - 1>();  // this thread's Q copies have landed (K/V may be in flight)
  __syncthreads();  // RAW: every thread's part of the Q tile is visible before any warp's ldmatrix reads it

  const uint32_t q_smem = ptx::cvta_to_shared_u32(smem.q);
  const uint32_t k_smem = ptx::cvta_to_shared_u32(smem.k[0]);  // stage s at + s * sizeof(smem.k[0])
  const uint32_t v_smem = ptx::cvta_to_shared_u32(smem.v[0]);
  const int warp_row = warp * Cfg::kRowsPerWarp;  // this warp's first row inside the Q tile

  // Which row and column each lane points ldmatrix_x4 at (lanes 8i .. 8i+7: the 8 rows of
  // matrix i; see ptx/ldmatrix.cuh), relative to the 16x16 block being loaded.
  //   A from Q [row][d]:      matrices (rows 0-7, d 0-7) (rows 8-15, d 0-7) (rows 0-7, d 8-15)
  //                           (rows 8-15, d 8-15) = a[0], a[1], a[2], a[3]
  const int a_row = lane % 16, a_col = lane / 16 * 8;
  //   B from K [key][d]:      matrices (keys 0-7, d 0-7) (keys 0-7, d 8-15) (keys 8-15, d 0-7)
  //                           (keys 8-15, d 8-15) = b0, b1 of key tile 2j, b0, b1 of key tile 2j+1
  const int k_row = lane % 8 + lane / 16 * 8, k_col = lane / 8 % 2 * 8;
  //   B from V [key][d], .trans: matrices (keys 0-7, d 0-7) (keys 8-15, d 0-7) (keys 0-7, d 8-15)
  //                           (keys 8-15, d 8-15) = b0, b1 of d tile 2j, b0, b1 of d tile 2j+1
  const int v_row = lane % 16, v_col = lane / 16 * 8;

  // Byte offsets of this lane's ldmatrix row pointers inside the three tiles (Q: m tile 0).
  const uint32_t q_lane = sizeof(T) * tile_offset<D>(warp_row + a_row, a_col);
  const uint32_t k_lane = sizeof(T) * tile_offset<D>(k_row, k_col);
  const uint32_t v_lane = sizeof(T) * tile_offset<D>(v_row, v_col);

  // A fragments of Q, per m tile and 16 columns of D (when they stay in registers).
  constexpr int kQFragTiles = Cfg::kQInRegisters ? kMTiles : 1, kQFragSteps = Cfg::kQInRegisters ? D / 16 : 1;
  uint32_t q_frag[kQFragTiles][kQFragSteps][4];
  if constexpr (Cfg::kQInRegisters) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd)
        ptx::ldmatrix_x4(q_frag[mt][kd], tile_addr<T, D>(q_smem, q_lane, mt * 16, kd * 16));
  }

  // This lane's rows: row0 + 16 mt + 8 r for m tile mt and fragment half r (elements 2r, 2r+1).
  const int row0 = m_block + warp_row + group;
  float o_acc[kMTiles][kDTiles][4] = {};  // O, d tile dt: columns dt * 8 + 2 tig + {0, 1}
  float row_max[kMTiles][2];              // running max of x, in log2 units
  float row_sum[kMTiles][2];              // running sum of 2^(x - max) over this lane's columns
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[mt][r] = -INFINITY, row_sum[mt][r] = 0.f;
  const float scale_log2 = p.scale * kLog2e;  // x = s * scale * log2(e): e^(scale s) = 2^x

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int n_start = tile * kBlockN;
    const int stage = tile % Cfg::kStages;
    ptx::cp_async_wait_group<Cfg::kStages - 2>();  // this thread's copies of this tile have landed
    // RAW: every thread's copies of this tile are visible to all warps. WAR: every warp has
    // finished its ldmatrix reads of the previous tile, whose stage the prefetch below refills.
    __syncthreads();
    const int prefetch = tile + Cfg::kStages - 1;  // into the stage of tile - 1
    if (prefetch < n_tiles) load_kv_async(prefetch, prefetch % Cfg::kStages);
    ptx::cp_async_commit_group();  // possibly empty: one group per iteration keeps wait_group's count right
    const uint32_t k_stage = k_smem + stage * uint32_t(sizeof(smem.k[0]));
    const uint32_t v_stage = v_smem + stage * uint32_t(sizeof(smem.v[0]));

    // S = Q K^T for this warp's rows and the tile's kBlockN keys. Each K fragment pair feeds
    // the MMAs of every m tile.
    float s[kMTiles][kNTiles][4] = {};
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (Cfg::kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][kd][i];
        } else {
          ptx::ldmatrix_x4(a[mt], tile_addr<T, D>(q_smem, q_lane, mt * 16, kd * 16));
        }
      }
#pragma unroll
      for (int j = 0; j < kNTiles / 2; ++j) {
        uint32_t b[4];
        ptx::ldmatrix_x4(b, tile_addr<T, D>(k_stage, k_lane, j * 16, kd * 16));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          ptx::mma_m16n8k16<T>(s[mt][2 * j], a[mt], b[0], b[1]);
          ptx::mma_m16n8k16<T>(s[mt][2 * j + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Scores to log2 units; masked entries to -inf. Only the tile that crosses Sk and the
    // tiles that cross this warp's part of the causal diagonal need the mask.
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= scale_log2;
    const bool need_mask = n_start + kBlockN > p.seqlen_k ||
                           (p.causal && n_start + kBlockN - 1 > m_block + warp_row + p.causal_offset);
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n_start + nt * 8 + 2 * tig + e % 2;
            const int row = row0 + mt * 16 + e / 2 * 8;
            if (col >= p.seqlen_k || (p.causal && col > row + p.causal_offset)) s[mt][nt][e] = -INFINITY;
          }
    }

    // Online softmax on the registers: each row lives in one quad (4 lanes, same group).
    float alpha[kMTiles][2];  // 2^(m_old - m_new): rescales what was accumulated so far
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = row_max[mt][r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // A row that has seen no key yet still has max -inf; subtracting 0 instead keeps
        // 2^(-inf - (-inf)) from making a NaN: its weights and alpha are then simply 0.
        const float m_safe = m == -INFINITY ? 0.f : m;
        alpha[mt][r] = ptx::ex2_approx_ftz_f32(row_max[mt][r] - m_safe);
        row_max[mt][r] = m;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mt][nt][e] = ptx::ex2_approx_ftz_f32(s[mt][nt][e] - m_safe);
            sum += s[mt][nt][e];
          }
        row_sum[mt][r] = row_sum[mt][r] * alpha[mt][r] + sum;
      }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o_acc[mt][dt][0] *= alpha[mt][0];
        o_acc[mt][dt][1] *= alpha[mt][0];
        o_acc[mt][dt][2] *= alpha[mt][1];
        o_acc[mt][dt][3] *= alpha[mt][1];
      }

    // O += P V, 16 keys per step. The A fragment of P[16 rows, keys 16 kk .. 16 kk + 15] is
    // the accumulators of S tiles 2 kk (keys + 0..7) and 2 kk + 1 (keys + 8..15):
    //   a[0] = P[g][2t, 2t+1]   = s[2kk][0, 1]       a[1] = P[g+8][2t, 2t+1]   = s[2kk][2, 3]
    //   a[2] = P[g][2t+8, 2t+9] = s[2kk+1][0, 1]     a[3] = P[g+8][2t+8, 2t+9] = s[2kk+1][2, 3]
    // Each V fragment pair feeds the MMAs of every m tile.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = frag::pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = frag::pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = frag::pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = frag::pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int j = 0; j < kDTiles / 2; ++j) {
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, tile_addr<T, D>(v_stage, v_lane, kk * 16, j * 16));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          ptx::mma_m16n8k16<T>(o_acc[mt][2 * j], a[mt], b[0], b[1]);
          ptx::mma_m16n8k16<T>(o_acc[mt][2 * j + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue. Finish the row sums across the quad; a row that saw no key has sum 0 and gets
  // output 0 and LSE -inf.
  float inv_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[mt][r] += __shfl_xor_sync(0xffffffffu, row_sum[mt][r], 1);
      row_sum[mt][r] += __shfl_xor_sync(0xffffffffu, row_sum[mt][r], 2);
      inv_sum[mt][r] = row_sum[mt][r] > 0.f ? 1.f / row_sum[mt][r] : 0.f;
    }

  // Stage the warp's block of O in its own rows of the Q tile (no other warp reads them),
  // then store whole 16-byte chunks, coalesced, skipping rows past Sq.
  __syncwarp();  // WAR: all lanes' ldmatrix reads of these Q rows are done before they are overwritten
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int row = warp_row + mt * 16 + group, col = dt * 8 + 2 * tig;
      *reinterpret_cast<uint32_t*>(smem.q + tile_offset<D>(row, col)) =
          frag::pack2<T>(o_acc[mt][dt][0] * inv_sum[mt][0], o_acc[mt][dt][1] * inv_sum[mt][0]);
      *reinterpret_cast<uint32_t*>(smem.q + tile_offset<D>(row + 8, col)) =
          frag::pack2<T>(o_acc[mt][dt][2] * inv_sum[mt][1], o_acc[mt][dt][3] * inv_sum[mt][1]);
    }
  __syncwarp();  // RAW: the warp's whole block is in shared memory before lanes read chunks others wrote
  constexpr int kChunksPerRow = D / kChunkElems;
#pragma unroll
  for (int step = 0; step < Cfg::kRowsPerWarp * kChunksPerRow / 32; ++step) {
    const int idx = step * 32 + lane;
    const int r = idx / kChunksPerRow, col = idx % kChunksPerRow * kChunkElems;
    const int row = m_block + warp_row + r;
    if (row < p.seqlen_q)
      *reinterpret_cast<uint4*>(out + row * p.out_seq_stride + col) =
          *reinterpret_cast<const uint4*>(smem.q + tile_offset<D>(warp_row + r, col));
  }

  // LSE = ln(sum_j e^(scale s_j)) = ln(2^max * sum) = max ln 2 + ln sum, written by one lane per quad.
  if (p.lse != nullptr && tig == 0) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + mt * 16 + r * 8;
        if (row < p.seqlen_q)
          p.lse[(int64_t(batch) * p.heads_q + head_q) * p.seqlen_q + row] =
              row_sum[mt][r] > 0.f ? row_max[mt][r] * kLn2 + logf(row_sum[mt][r]) : -INFINITY;
      }
  }
}

template <typename T, int D>
Status launch_typed(const AttentionProblem& problem, cudaStream_t stream) {
  using Cfg = Config<D>;
  constexpr int kSmemBytes = int(sizeof(SharedStorage<T, D>));
  const auto kernel = cp_async_kernel<T, D>;
  if constexpr (kSmemBytes > 48 * 1024) {  // above 48 KB a kernel must opt in to dynamic shared memory
    const Status s = cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
        std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!s.ok()) return s;
  }
  const dim3 grid(unsigned((problem.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM), unsigned(problem.heads_q),
                  unsigned(problem.batch));
  kernel<<<grid, Cfg::kThreads, kSmemBytes, stream>>>(make_params(problem));
  return launch_status(kName);
}

// The whole contract: any Sq, Sk >= 1, D 64/128/256, bf16/fp16, GQA, causal, strides.
Status supports(const AttentionProblem&) { return Status::Ok(); }

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  return dispatch_dtype_headdim(problem,
                                [&]<typename T, int D>() -> Status { return launch_typed<T, D>(problem, stream); });
}

}  // namespace

const KernelEntry& kernel_05_cp_async_pipeline() {
  static const KernelEntry entry{
      kName, "cp.async K/V copies into a multi-stage shared-memory ring, overlapped with the MMAs (FA2 class)",
      supports, launch};
  return entry;
}

}  // namespace hattn
