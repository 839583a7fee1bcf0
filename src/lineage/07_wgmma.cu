// Lineage step 7: both products on Hopper's warpgroup MMA (wgmma.mma_async).
// Parent: 06_tma_mbarrier.
//
// Kernel 7 focus (what changed from 06_tma_mbarrier):
//   1. A warpgroup (4 warps, 128 threads) owns 64 query rows and issues wgmma.mma_async
//      m64nNk16: one instruction multiplies its 64 x 16 slice of Q by a 16 x N slice of K^T,
//      where mma.sync needed 4 x N/8 instructions for the same work. Two warpgroups make a
//      128-row CTA.
//   2. S = Q K^T reads both operands straight from the 128B-swizzled shared tiles that TMA
//      wrote, through 64-bit matrix descriptors: no ldmatrix, no operand registers.
//   3. O += P V takes P from registers (the S accumulators, rounded and packed in place: the
//      wgmma accumulator layout of two n8 column tiles is the A-fragment layout of one k16
//      step) and V from shared memory, read N-major (V is stored [key][d], the B operand wants
//      [d][key]: the instruction's imm-trans-b operand, rs<1>, does it).
//   4. The fence / commit / wait discipline: wgmma_fence() before wgmmas that read registers
//      written by ordinary instructions, commit after issuing, wait_group<0> before reading the
//      accumulators.
//   5. The softmax keeps the scores raw: the row max is taken on S itself and the scale goes
//      into the exponent, 2^(c s - c m) with c = scale log2(e), one FFMA per score where 06
//      spent an FMUL and an FADD. It needs scale > 0; supports() refuses others.
//
// Dataflow of one CTA (query rows m_block .. m_block + 127 of one (batch, head)):
//   0. thread 0: Q (one TMA box per 64 columns) on q_full; K/V tiles 0 .. kStages-1 on
//      k_full/v_full of their stage.
//   for each K/V tile (stage = tile % kStages, parity = (tile / kStages) % 2):
//   1. wait k_full[stage]; S = Q K^T (D/16 wgmmas, one commit); wait_group<0>.
//   2. mask, online softmax in registers (raw max, ex2 of one FFMA), rescale O, pack P.
//   3. wait v_full[stage]; O += P V (kBlockN/16 wgmmas); wait_group<0>.
//   4. __syncthreads: both warpgroups are done with the stage; thread 0 refills it with tile
//      + kStages. (A dedicated producer that never waits on the consumers is step 8.)
//   epilogue: O / l stored from registers; LSE = scale m + ln l.
//
// Barriers (who arrives -> who waits):
//   q_full          thread 0's expect_tx + TMA bytes -> all 256 threads, once
//   k_full[s]       thread 0's expect_tx + TMA bytes -> all 256 threads, per use of stage s
//   v_full[s]       thread 0's expect_tx + TMA bytes -> all 256 threads, per use of stage s
//   __syncthreads   all threads -> thread 0, before it overwrites a stage (WAR on K/V)
//
// Why: wgmma is the only way to the full Hopper tensor-core rate; mma.sync tops out well
// below it. Expected effect: several times 06; measured in results/, see docs/guide.
// Known limits: every thread waits at the end of each tile for the refill decision, and the
// softmax of a tile cannot overlap any GEMM (steps 8-10 remove these).
#include <cuda.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/ex2.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "registry.h"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "07_wgmma";

template <int D>
struct Config {
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kBlockM = 64 * kWarpgroups;     // query rows per CTA: 64 per warpgroup
  static constexpr int kBlockN = D == 256 ? 64 : 128;  // keys per K/V tile (the N of S = Q K^T)
  static constexpr int kStages = 2;                    // K/V tiles in flight
  static constexpr int kColBlocks = D / 64;            // 64-element (128-byte) column blocks of a row

  static_assert(D % 64 == 0, "tiles are stored as 64-column blocks, the width of a 128-byte swizzle atom");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "S = Q K^T is one m64nNk16 per 16 columns of D");
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kSwizzleBytes = 128;  // one row of a 64-column block
constexpr int kAtomBytes = 1024;    // 8 rows x 128 bytes: the swizzle pattern's period

// Every tile is [kColBlocks][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D>
struct SharedStorage {
  using Cfg = Config<D>;
  alignas(kAtomBytes) T q[Cfg::kColBlocks][Cfg::kBlockM * 64];
  alignas(kAtomBytes) T k[Cfg::kStages][Cfg::kColBlocks][Cfg::kBlockN * 64];
  alignas(kAtomBytes) T v[Cfg::kStages][Cfg::kColBlocks][Cfg::kBlockN * 64];
  uint64_t q_full;
  uint64_t k_full[Cfg::kStages];
  uint64_t v_full[Cfg::kStages];
};

template <typename T, int D>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D>)) + kAtomBytes;  // + slack to align the base to 1024
}

// Issues the TMA copies of one K/V tile into `stage` (thread 0 only).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(SharedStorage<T, D>& smem, const CUtensorMap* k_map,
                                             const CUtensorMap* v_map, int tile, int head_kv, int batch) {
  using Cfg = Config<D>;
  constexpr uint32_t kTileBytes = Cfg::kBlockN * D * sizeof(T);
  const int stage = tile % Cfg::kStages;
  ptx::mbarrier_arrive_expect_tx(&smem.k_full[stage], kTileBytes);
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(smem.k[stage][cb], k_map, cb * 64, tile * Cfg::kBlockN, head_kv, batch,
                                     &smem.k_full[stage]);
  ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], kTileBytes);
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(smem.v[stage][cb], v_map, cb * 64, tile * Cfg::kBlockN, head_kv, batch,
                                     &smem.v_full[stage]);
}

template <typename T, int D>
__global__ void __launch_bounds__(Config<D>::kThreads, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                 const __grid_constant__ CUtensorMap v_map, const AttentionParams p) {
  using Cfg = Config<D>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8;  // n8 column tiles of S in the accumulator
  constexpr int kDTiles = D / 8;        // n8 column tiles of O

  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes);

  const int warpgroup = int(threadIdx.x) / 128;
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int m_block = int(blockIdx.x) * kBlockM;
  const int head_q = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head_q / p.heads_per_kv;

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

  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&smem.q_full, kBlockM * D * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
      ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb], &q_map, cb * 64, m_block, head_q, batch, &smem.q_full);
    for (int tile = 0; tile < min(Cfg::kStages, n_tiles); ++tile)
      load_kv_tile<T, D>(smem, &k_map, &v_map, tile, head_kv, batch);
  }

  // This thread's rows: row0 (accumulator elements 0, 1 of each n8 tile) and row0 + 8 (2, 3).
  const int warp_row = warpgroup * 64 + warp_in_wg * 16;  // first row of this warp inside the CTA tile
  const int row0 = m_block + warp_row + group;
  float o[kDTiles * 4] = {};  // O: n8 tile dt holds columns 8 dt + 2 t + {0, 1}
  float s[kNTiles * 4];       // S / P of the current tile
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of the raw scores s
  float row_sum[2] = {0.f, 0.f};              // running sum of 2^(c s - c max) over this thread's columns
  const float scale_log2 = p.scale * kLog2e;

  ptx::mbarrier_wait(&smem.q_full, 0);  // Q has landed (also before exit: no copy outlives the CTA)

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile % Cfg::kStages;
    const uint32_t parity = (tile / Cfg::kStages) % 2;
    const int n_start = tile * kBlockN;

    // S = Q K^T: per 16 columns of D one wgmma; K-major operands advance 32 bytes inside the
    // 128-byte swizzled row, then jump to the next 64-column block.
    ptx::mbarrier_wait(&smem.k_full[stage], parity);
#pragma unroll
    for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* q_tile = smem.q[kk / 4] + warpgroup * 64 * 64 + kk % 4 * 16;
      const T* k_tile = smem.k[stage][kk / 4] + kk % 4 * 16;
      ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(s, ptx::make_smem_desc_sw128(q_tile, 16, kAtomBytes),
                                                   ptx::make_smem_desc_sw128(k_tile, 16, kAtomBytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);

    // Masked entries to -inf (only tiles crossing Sk or the diagonal).
    const bool need_mask = n_start + kBlockN > p.seqlen_k ||
                           (p.causal && n_start + kBlockN - 1 > m_block + warp_row + p.causal_offset);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = n_start + nt * 8 + 2 * tig + e % 2;
          const int row = row0 + e / 2 * 8;
          if (col >= p.seqlen_k || (p.causal && col > row + p.causal_offset)) s[nt * 4 + e] = -INFINITY;
        }
    }

    // Online softmax: a row lives in the 4 threads of a quad.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      // c = scale_log2 > 0 (supports()), so max(c s) = c max(s): the max is taken on raw scores
      // and c goes into the exponent, one FFMA per score. A row with no visible key yet
      // subtracts 0: weights 0, not NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      alpha[r] = ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          s[nt * 4 + e] = ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -m_scaled));
          sum += s[nt * 4 + e];
        }
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o[dt * 4 + 0] *= alpha[0];
      o[dt * 4 + 1] *= alpha[0];
      o[dt * 4 + 2] *= alpha[1];
      o[dt * 4 + 3] *= alpha[1];
    }

    // P as wgmma A fragments, one per 16 keys: S tiles 2kk and 2kk+1, rows g and g+8.
    uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = frag::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      p_frag[kk][1] = frag::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      p_frag[kk][2] = frag::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      p_frag[kk][3] = frag::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }

    // O += P V: per 16 keys one wgmma with N = D. V is read N-major: 16 keys = 2048 bytes
    // down the tile; the 64-column blocks are kBlockN * 128 bytes apart (LBO).
    ptx::mbarrier_wait(&smem.v_full[stage], parity);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
    ptx::wgmma_fence();  // the rescaled O and the packed P are written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const T* v_tile = smem.v[stage][0] + kk * 16 * 64;
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          o, p_frag[kk], ptx::make_smem_desc_sw128(v_tile, kBlockN * kSwizzleBytes, kAtomBytes), 1);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)  // P was read by the wgmmas until the wait above
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::fence_operand(p_frag[kk][i]);

    __syncthreads();  // WAR: both warpgroups' wgmmas have finished reading this stage's K and V
    if (threadIdx.x == 0 && tile + Cfg::kStages < n_tiles)
      load_kv_tile<T, D>(smem, &k_map, &v_map, tile + Cfg::kStages, head_kv, batch);
  }

  // Epilogue: finish the row sums across the quad; rows that saw no key output 0, LSE -inf.
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    inv_sum[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
  }
  T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride + head_q * p.out_head_stride;  // [Sq, D]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + r * 8;
    if (row >= p.seqlen_q) continue;
    T* out_row = out + row * p.out_seq_stride;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
      *reinterpret_cast<uint32_t*>(out_row + dt * 8 + 2 * tig) =
          frag::pack2<T>(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
    if (p.lse != nullptr && tig == 0)
      p.lse[(int64_t(batch) * p.heads_q + head_q) * p.seqlen_q + row] =
          row_sum[r] > 0.f ? row_max[r] * p.scale + logf(row_sum[r]) : -INFINITY;
  }
}

template <typename T, int D>
Status launch_typed(const AttentionProblem& problem, cudaStream_t stream) {
  using Cfg = Config<D>;
  constexpr int kSmem = smem_bytes<T, D>();
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(problem, Cfg::kBlockM, Cfg::kBlockN, kName, &maps);
  if (!s.ok()) return s;
  const auto kernel = wgmma_kernel<T, D>;
  s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                  std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  const dim3 grid(unsigned((problem.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM), unsigned(problem.heads_q),
                  unsigned(problem.batch));
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(maps.q, maps.k, maps.v, make_params(problem));
  return launch_status(kName);
}

Status supports(const AttentionProblem& problem) { return require_positive_scale(problem, kName); }

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  return dispatch_dtype_headdim(problem,
                                [&]<typename T, int D>() -> Status { return launch_typed<T, D>(problem, stream); });
}

}  // namespace

const KernelEntry& kernel_07_wgmma() {
  static const KernelEntry entry{kName, "warpgroup MMA: S = QK^T from shared memory, O += PV with P from registers; the scale folded into exp2",
                                 supports, launch};
  return entry;
}

}  // namespace hattn
