// Lineage step 6: tiles arrive by TMA (bulk tensor copies) and complete on mbarriers.
// Parent: 05_cp_async_pipeline.
//
// Kernel 6 focus (what changed from 05_cp_async_pipeline):
//   1. One thread issues cp.async.bulk.tensor copies: each copies a whole box of 64 columns x
//      rows of a tile, with the address arithmetic, bounds checks and zero fill of rows past
//      Sq / Sk done by the copy engine. 05 had every thread issue 16-byte cp.asyncs.
//   2. The host describes each tensor once with a tensor map (cuTensorMapEncodeTiled,
//      src/tensor_map.cpp): BSHD dims and strides, box size, 128-byte swizzle. Kernels take the
//      maps as __grid_constant__ parameters.
//   3. Completion is tracked by mbarriers: the issuing thread announces the tile's bytes
//      (expect_tx) and the copies count them down; consumers wait on the barrier's phase
//      parity. No commit groups, and no barrier needed to publish a tile.
//   4. Shared tiles take the copy engine's layout: [D / 64][rows][64] with the 16-byte chunks
//      of each 128-byte row XOR-swizzled by row % 8, the same conflict-free pattern as 04,
//      now produced by the hardware; tiles start on 1024-byte boundaries (the pattern's period).
//
// Dataflow of one CTA:
//   0. thread 0: Q on q_full; K/V tiles 0 .. kStages-1 on k_full/v_full of their stage.
//      All threads wait q_full; Q -> registers (ldmatrix) where they fit (see Config).
//   for each K/V tile (stage = tile % kStages, parity = (tile / kStages) % 2):
//   1. wait k_full[stage]; S = Q K^T; masks; online softmax (as in 05).
//   2. wait v_full[stage]; O += P V.
//   3. __syncthreads: every warp is done with the stage; thread 0 refills it with tile + kStages.
//   epilogue: as in 05.
//
// Barriers (who arrives -> who waits):
//   q_full          thread 0's expect_tx + TMA bytes -> all threads, once
//   k_full[s]       thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   v_full[s]       thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   __syncthreads   all threads -> thread 0, before it overwrites a stage (WAR on K/V)
//
// Why: the copy engine generates addresses and moves whole tiles while the warps' issue slots
// go to the MMAs; and this is the loading machinery that wgmma (step 7) needs anyway, since
// wgmma reads its shared-memory operands in exactly this swizzled layout.
// Expected effect: modest over 05 (the compute is still mma.sync); measured in results/, see
// docs/guide/06_tma_mbarrier.md.
// Known limits: mma.sync; every thread waits at the end of each tile; K and V wait for the
// whole tile of their stage to be released.
#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/ex2.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "registry.h"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "06_tma_mbarrier";

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
  static constexpr int kStages = 2;                       // K/V tiles in the shared-memory ring
  static constexpr int kColBlocks = D / 64;               // 64-column (128-byte) boxes per tile row
  // Q's A fragments take kMTiles * D / 4 registers per lane: kept for the whole K/V loop when
  // that is at most 32 (D = 64), otherwise re-read from shared memory with ldmatrix per tile.
  static constexpr bool kQInRegisters = kMTiles * D / 4 <= 32;

  static_assert(D % 16 == 0, "ldmatrix_x4 covers 16 columns of D at a time");
  static_assert(kBlockN % 16 == 0, "P V consumes keys 16 at a time (the k of m16n8k16)");
  static_assert(kMTiles >= 1, "a warp owns at least one m16 tile of query rows");
  static_assert(kStages >= 2, "a pipeline needs one stage to compute on and one to load into");
  static_assert(D % 64 == 0, "tiles are stored as 64-column boxes, the width of the 128-byte swizzle");
};

constexpr int kChunkElems = 8;  // one 16-byte chunk holds 8 bf16/fp16 elements
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kAtomBytes = 1024;  // 8 rows x 128 bytes: the 128-byte swizzle's period

// Tiles are [D / 64][rows][64], one TMA box per 64-column block, each starting on a
// 1024-byte boundary so that the copy engine's swizzle lines up with tile_offset below.
template <typename T, int D>
struct SharedStorage {
  using Cfg = Config<D>;
  alignas(kAtomBytes) T q[Cfg::kBlockM * D];                 // [D/64][kBlockM][64]; the epilogue stages O here
  alignas(kAtomBytes) T k[Cfg::kStages][Cfg::kBlockN * D];   // kStages x [D/64][kBlockN][64]
  alignas(kAtomBytes) T v[Cfg::kStages][Cfg::kBlockN * D];   // kStages x [D/64][kBlockN][64]
  uint64_t q_full;
  uint64_t k_full[Cfg::kStages];
  uint64_t v_full[Cfg::kStages];
};
static_assert(sizeof(SharedStorage<__nv_bfloat16, 256>) + kAtomBytes <= 227 * 1024,
              "shared memory per CTA exceeds sm_90's 227 KB");

// Element offset of (row, col) in a [D / 64][kRows][64] tile written by TMA with the 128-byte
// swizzle: within a 64-column block, chunk c of row r is stored at chunk c ^ (r % 8).
template <int kRows>
__device__ __forceinline__ int tile_offset(int row, int col) {
  return col / 64 * kRows * 64 + row * 64 + ((col % 64 / kChunkElems) ^ (row % 8)) * kChunkElems + col % kChunkElems;
}

// Shared address of element (r + row, c + col) of the tile at shared address `tile`, where
// `lane_off` is the byte offset of this lane's own element (r, c), c < 16, and row % 8 == 0,
// col % 16 == 0 are compile-time offsets, as in 05: the swizzled chunk of the sum is the
// lane's swizzled chunk XOR (col / 8) % 8; whole 64-column blocks are kRows * 128 bytes apart.
template <typename T, int kRows>
__device__ __forceinline__ uint32_t tile_addr(uint32_t tile, uint32_t lane_off, int row, int col) {
  static_assert(sizeof(T) * kChunkElems == 16, "chunks are 16 bytes");
  return tile + (lane_off ^ (col / kChunkElems % 8 * 16)) + sizeof(T) * (row * 64 + col / 64 * kRows * 64);
}

// Issues the TMA copies of one K/V tile into `stage` (thread 0 only): one box of 64 columns
// x kBlockN rows per column block; rows past Sk arrive as zeros (a zero K row adds a score
// that the mask replaces, a zero V row keeps 0 * V finite).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(SharedStorage<T, D>& smem, const CUtensorMap* k_map,
                                             const CUtensorMap* v_map, int tile, int head_kv, int batch) {
  using Cfg = Config<D>;
  constexpr uint32_t kTileBytes = Cfg::kBlockN * D * sizeof(T);
  const int stage = tile % Cfg::kStages;
  ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], kTileBytes);
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(smem.k[stage] + cb * Cfg::kBlockN * 64, k_map, cb * 64, tile * Cfg::kBlockN,
                                     head_kv, batch, &smem.k_full[stage]);
  ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], kTileBytes);
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(smem.v[stage] + cb * Cfg::kBlockN * 64, v_map, cb * 64, tile * Cfg::kBlockN,
                                     head_kv, batch, &smem.v_full[stage]);
}

template <typename T, int D>
__global__ void __launch_bounds__(Config<D>::kThreads)
    tma_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
               const __grid_constant__ CUtensorMap v_map, const AttentionParams p) {
  using Cfg = Config<D>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kMTiles = Cfg::kMTiles;  // m16 tiles of query rows per warp
  constexpr int kDTiles = D / 8;        // n8 tiles of O across D
  constexpr int kNTiles = kBlockN / 8;  // n8 tiles of S across the keys of a tile

  extern __shared__ unsigned char smem_raw[];
  // Dynamic shared memory only promises 16-byte alignment; the swizzle needs 1024.
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes);

  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // mma fragment coordinates g and t (ptx/mma.cuh)
  const int m_block = int(blockIdx.x) * kBlockM;
  const int head_q = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head_q / p.heads_per_kv;

  // Row 0 of this (batch, head) of the output; rows are out_seq_stride elements apart.
  T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride + head_q * p.out_head_stride;        // [Sq, D]

  // Keys this CTA reads: all of them, or with the causal mask those up to the diagonal of its
  // last row (tiles entirely above the diagonal are skipped). 0 when no row sees any key.
  int n_end = p.seqlen_k;
  if (p.causal) n_end = max(0, min(n_end, min(m_block + kBlockM, p.seqlen_q) + p.causal_offset));
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::mbarrier_init(&smem.q_full, 1);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.v_full[s], 1);
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  // Prologue: Q, then the first kStages K/V tiles.
  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&smem.q_full, kBlockM * D * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
      ptx::cp_async_bulk_tensor_4d_g2s(smem.q + cb * kBlockM * 64, &q_map, cb * 64, m_block, head_q, batch,
                                       &smem.q_full);
    for (int tile = 0; tile < min(Cfg::kStages, n_tiles); ++tile)
      load_kv_tile<T, D>(smem, &k_map, &v_map, tile, head_kv, batch);
  }
  ptx::mbarrier_wait(&smem.q_full, 0);  // RAW: the Q tile has landed before any warp's ldmatrix reads it

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
  const uint32_t q_lane = sizeof(T) * tile_offset<kBlockM>(warp_row + a_row, a_col);
  const uint32_t k_lane = sizeof(T) * tile_offset<kBlockN>(k_row, k_col);
  const uint32_t v_lane = sizeof(T) * tile_offset<kBlockN>(v_row, v_col);

  // A fragments of Q, per m tile and 16 columns of D (when they stay in registers).
  constexpr int kQFragTiles = Cfg::kQInRegisters ? kMTiles : 1, kQFragSteps = Cfg::kQInRegisters ? D / 16 : 1;
  uint32_t q_frag[kQFragTiles][kQFragSteps][4];
  if constexpr (Cfg::kQInRegisters) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd)
        ptx::ldmatrix_x4(q_frag[mt][kd], tile_addr<T, kBlockM>(q_smem, q_lane, mt * 16, kd * 16));
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
    const uint32_t parity = (tile / Cfg::kStages) % 2;
    const uint32_t k_stage = k_smem + stage * uint32_t(sizeof(smem.k[0]));
    const uint32_t v_stage = v_smem + stage * uint32_t(sizeof(smem.v[0]));

    // S = Q K^T for this warp's rows and the tile's kBlockN keys. Each K fragment pair feeds
    // the MMAs of every m tile.
    ptx::mbarrier_wait(&smem.k_full[stage], parity);  // RAW: this tile's K has landed
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
          ptx::ldmatrix_x4(a[mt], tile_addr<T, kBlockM>(q_smem, q_lane, mt * 16, kd * 16));
        }
      }
#pragma unroll
      for (int j = 0; j < kNTiles / 2; ++j) {
        uint32_t b[4];
        ptx::ldmatrix_x4(b, tile_addr<T, kBlockN>(k_stage, k_lane, j * 16, kd * 16));
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
    ptx::mbarrier_wait(&smem.v_full[stage], parity);  // RAW: this tile's V has landed
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
        ptx::ldmatrix_x4_trans(b, tile_addr<T, kBlockN>(v_stage, v_lane, kk * 16, j * 16));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          ptx::mma_m16n8k16<T>(o_acc[mt][2 * j], a[mt], b[0], b[1]);
          ptx::mma_m16n8k16<T>(o_acc[mt][2 * j + 1], a[mt], b[2], b[3]);
        }
      }
    }

    __syncthreads();  // WAR: every warp has finished its ldmatrix reads of this stage's K and V
    if (threadIdx.x == 0 && tile + Cfg::kStages < n_tiles)
      load_kv_tile<T, D>(smem, &k_map, &v_map, tile + Cfg::kStages, head_kv, batch);
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
      *reinterpret_cast<uint32_t*>(smem.q + tile_offset<kBlockM>(row, col)) =
          frag::pack2<T>(o_acc[mt][dt][0] * inv_sum[mt][0], o_acc[mt][dt][1] * inv_sum[mt][0]);
      *reinterpret_cast<uint32_t*>(smem.q + tile_offset<kBlockM>(row + 8, col)) =
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
          *reinterpret_cast<const uint4*>(smem.q + tile_offset<kBlockM>(warp_row + r, col));
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
  constexpr int kSmemBytes = int(sizeof(SharedStorage<T, D>)) + kAtomBytes;  // + slack to align the base
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(problem, Cfg::kBlockM, Cfg::kBlockN, kName, &maps);
  if (!s.ok()) return s;
  const auto kernel = tma_kernel<T, D>;
  if constexpr (kSmemBytes > 48 * 1024) {  // above 48 KB a kernel must opt in to dynamic shared memory
    s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                    std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!s.ok()) return s;
  }
  const dim3 grid(unsigned((problem.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM), unsigned(problem.heads_q),
                  unsigned(problem.batch));
  kernel<<<grid, Cfg::kThreads, kSmemBytes, stream>>>(maps.q, maps.k, maps.v, make_params(problem));
  return launch_status(kName);
}

// The whole contract: any Sq, Sk >= 1, D 64/128/256, bf16/fp16, GQA, causal, strides.
Status supports(const AttentionProblem&) { return Status::Ok(); }

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  return dispatch_dtype_headdim(problem,
                                [&]<typename T, int D>() -> Status { return launch_typed<T, D>(problem, stream); });
}

}  // namespace

const KernelEntry& kernel_06_tma_mbarrier() {
  static const KernelEntry entry{
      kName, "TMA bulk tensor copies into 128B-swizzled tiles, completing on mbarriers (mma.sync compute)",
      supports, launch};
  return entry;
}

}  // namespace hattn
