// Lineage step 4: XOR-swizzled shared memory, bank-conflict-free ldmatrix.
// Parent: 03_mma_sync.
//
// Kernel 4 focus (what changed from 03_mma_sync): one function, tile_offset(). Every shared
// tile (Q, K, V, the O staging) keeps its rows of D elements but stores 16-byte chunk c of
// row r at chunk position c ^ (r % 8). Nothing else moves: the loads, ldmatrix lanes, MMAs and
// softmax are 03's; they only ask tile_offset() where an element lives.
//
// Why: shared memory serves a request in one wavefront only when its 16-byte pieces fall in
// distinct bank groups (32 banks x 4 bytes = 8 groups of 16 bytes per 128-byte line). A tile
// row is D * 2 = 128 .. 512 bytes, a multiple of 128, so in 03's plain layout the 8 rows one
// ldmatrix matrix reads at the same column all map to one bank group: an 8-way conflict on
// every ldmatrix, the instruction the inner loop issues most after mma. ldmatrix always reads
// 8 consecutive rows r0 .. r0+7 (r0 % 8 == 0) at one logical chunk c; after the swizzle they
// sit at chunks c ^ 0 .. c ^ 7, eight distinct bank groups: one wavefront per matrix. The
// 16-byte tile stores (8 consecutive chunks of one row per quarter warp) stay conflict-free,
// since XOR with a constant permutes a row's chunks within each aligned group of 8, and the
// epilogue's 4-byte fragment stores (8 rows x one chunk per instruction) become conflict-free
// too. Padding each row by 16 bytes would also remove the conflicts, at the cost of shared
// memory and of the dense layout that TMA and wgmma need later; their 128-byte swizzle is this
// same XOR pattern, so it is worth learning here.
//
// Dataflow: exactly 03's (see there); only where bytes sit in shared memory differs.
// Expected effect: ldmatrix wavefronts drop 8x (ncu: shared-memory bank conflicts of the
// LDSM instructions near zero); the kernel moves from shared-memory bound towards tensor-core
// bound. Measured in results/, see docs/guide/04_swizzle.md.
// Known limits: loads are still synchronous: every warp waits at the barrier for the K/V tile,
// then the load units idle while the tensor cores work (05_cp_async_pipeline overlaps them).
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/ex2.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"
#include "registry.h"

namespace hattn {
namespace {

constexpr const char* kName = "04_swizzle";

// Tiling, per head dim. Tune here; everything else derives from these.
template <int D>
struct Config {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  // m16 MMA tiles of query rows per warp. With two, every K or V fragment a warp loads from
  // shared memory feeds two MMAs instead of one: half the shared-memory bytes per MMA, at the
  // price of a second set of O and S accumulators. That fits in 255 registers only for D = 64
  // (D = 128 spills; D = 256's O alone takes 128 registers per m tile).
  static constexpr int kMTiles = D == 64 ? 2 : 1;
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static constexpr int kBlockM = kRowsPerWarp * kWarps;   // query rows per CTA
  static constexpr int kBlockN = D == 256 ? 32 : 64;      // keys per K/V tile
  // Q's A fragments take kMTiles * D / 4 registers per lane: kept for the whole K/V loop when
  // that is at most 32 (D = 64), otherwise re-read from shared memory with ldmatrix per tile.
  static constexpr bool kQInRegisters = kMTiles * D / 4 <= 32;

  static_assert(D % 16 == 0, "ldmatrix_x4 covers 16 columns of D at a time");
  static_assert(kBlockN % 16 == 0, "P V consumes keys 16 at a time (the k of m16n8k16)");
  static_assert(kMTiles >= 1, "a warp owns at least one m16 tile of query rows");
  static_assert((kBlockM * D / 8) % kThreads == 0 && (kBlockN * D / 8) % kThreads == 0,
                "tile loads give every thread the same number of 16-byte chunks");
};

constexpr int kChunkElems = 8;  // one 16-byte chunk holds 8 bf16/fp16 elements
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T, int D>
struct SharedStorage {
  alignas(128) T q[Config<D>::kBlockM * D];  // [kBlockM, D]; the epilogue stages O here
  alignas(128) T k[Config<D>::kBlockN * D];  // [kBlockN, D]
  alignas(128) T v[Config<D>::kBlockN * D];  // [kBlockN, D]
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

// Copies rows [row0, row0 + kRows) of a [n_rows, D] matrix whose rows are `stride` elements
// apart into a shared tile, 16 bytes per thread per step; consecutive threads take consecutive
// chunks of a row (coalesced), and each thread keeps one column, stepping down kRowsPerStep
// rows at a time. Rows at or past n_rows are zero-filled: a zero K row adds a score that the
// mask replaces, and a zero V row keeps 0 * V finite (stale shared memory could hold Inf or
// NaN bit patterns).
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void load_tile(T* tile /* [kRows, D] */, const T* src /* [n_rows, D] */, int64_t stride,
                                          int row0, int n_rows) {
  constexpr int kChunksPerRow = D / kChunkElems;
  constexpr int kRowsPerStep = kThreads / kChunksPerRow;
  constexpr int kSteps = kRows / kRowsPerStep;
  static_assert(kThreads % kChunksPerRow == 0 && kRows % kRowsPerStep == 0,
                "whole rows per step, whole steps per tile");
  const int row = int(threadIdx.x) / kChunksPerRow, col = int(threadIdx.x) % kChunksPerRow * kChunkElems;
  const int rows_left = n_rows - row0 - row;  // rows from this thread's first one to the end of the matrix
  const T* from = src + int64_t(row0 + row) * stride + col;  // dereferenced only while in range
  uint4 chunk[kSteps];
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {  // all loads first, so that they are in flight together
    chunk[i] = make_uint4(0u, 0u, 0u, 0u);
    if (i * kRowsPerStep < rows_left) chunk[i] = *reinterpret_cast<const uint4*>(from);
    from += kRowsPerStep * stride;
  }
#pragma unroll
  for (int i = 0; i < kSteps; ++i)
    *reinterpret_cast<uint4*>(tile + tile_offset<D>(row + i * kRowsPerStep, col)) = chunk[i];
}

template <typename T, int D>
__global__ void __launch_bounds__(Config<D>::kThreads) swizzle_kernel(const AttentionParams p) {
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

  load_tile<T, D, kBlockM, kThreads>(smem.q, q, p.q_seq_stride, m_block, p.seqlen_q);
  __syncthreads();  // RAW: the whole Q tile is in shared memory before any warp's ldmatrix reads it

  const uint32_t q_smem = ptx::cvta_to_shared_u32(smem.q);
  const uint32_t k_smem = ptx::cvta_to_shared_u32(smem.k);
  const uint32_t v_smem = ptx::cvta_to_shared_u32(smem.v);
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
    __syncthreads();  // WAR: every warp has finished its ldmatrix reads of the previous K/V tile
    load_tile<T, D, kBlockN, kThreads>(smem.k, k, p.k_seq_stride, n_start, p.seqlen_k);
    load_tile<T, D, kBlockN, kThreads>(smem.v, v, p.v_seq_stride, n_start, p.seqlen_k);
    __syncthreads();  // RAW: the K/V tile is complete before any warp's ldmatrix reads it

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
        ptx::ldmatrix_x4(b, tile_addr<T, D>(k_smem, k_lane, j * 16, kd * 16));
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
        ptx::ldmatrix_x4_trans(b, tile_addr<T, D>(v_smem, v_lane, kk * 16, j * 16));
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
  const auto kernel = swizzle_kernel<T, D>;
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

const KernelEntry& kernel_04_swizzle() {
  static const KernelEntry entry{
      kName, "XOR-swizzled shared tiles (16-byte chunk ^ row % 8): bank-conflict-free ldmatrix and stores",
      supports, launch};
  return entry;
}

}  // namespace hattn
