// Lineage step 2: fused attention with an online softmax, on CUDA cores.
// Parent: 01_naive.
//
// What changed from 01_naive: one kernel, one pass over K and V. A block owns kBlockM query
// rows and walks the keys in tiles of kBlockN, staged through shared memory. Each row keeps a
// running max m, a running sum l and an unnormalized output o; a new tile with scores s
// updates them as
//     m' = max(m, max_j s_j)
//     l' = l * exp(m - m') + sum_j exp(s_j - m')
//     o' = o * exp(m - m') + sum_j exp(s_j - m') v_j
// and the row ends with O = o / l, LSE = m + log(l).
// Why: S and P never touch device memory (01 wrote and read them twice), and each K/V tile
// loaded once serves kBlockM query rows instead of one.
// Effect: see results/ and docs/guide/02_fused_online_softmax.md. Still fp32 FMAs on CUDA
// cores, far below the tensor cores; the next step moves both products onto mma.sync.
// Limits: none beyond the contract; smem is ~100 KB at D=256.
//
// Work split: 4 warps, 8 query rows each. In S = QK^T lane j computes the scores of key j
// for the warp's 8 rows; in O += PV lane j owns output columns j, j+32, j+64, ...
#include <cmath>

#include "common.cuh"
#include "params.h"
#include "registry.h"

namespace hattn {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 8;
constexpr int kBlockM = kWarps * kRowsPerWarp;  // query rows per block
constexpr int kBlockN = 32;                     // keys per tile: one per lane

template <int D>
struct SharedStorage {
  float q[kBlockM][D];
  float k[kBlockN][D + 1];  // +1 float: lane j reads row j, so rows must start in different banks
  float v[kBlockN][D];
  float p[kWarps][kRowsPerWarp][kBlockN];
};

// Copies rows [row0, row0 + kRows) of a [S, D] slice into smem as float; rows past `rows` are 0.
template <typename T, int D, int kRows, int kPitch>
__device__ void load_tile(float (*dst)[kPitch], const T* src, int64_t row_stride, int row0, int rows) {
  constexpr int kVec = 8;  // 16-byte loads of 8 elements
  for (int idx = threadIdx.x; idx < kRows * D / kVec; idx += kThreads) {
    const int r = idx / (D / kVec);
    const int c = (idx % (D / kVec)) * kVec;
    alignas(16) T vals[kVec];
    if (row0 + r < rows) {
      *reinterpret_cast<uint4*>(vals) = *reinterpret_cast<const uint4*>(src + (row0 + r) * row_stride + c);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) vals[e] = from_float<T>(0.f);
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) dst[r][c + e] = to_float(vals[e]);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) fused_attention_kernel(AttentionParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<D>*>(smem_raw);
  constexpr int kColsPerLane = D / 32;

  const int m0 = blockIdx.x * kBlockM;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_kv = head / p.heads_per_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* q = static_cast<const T*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;

  load_tile<T, D, kBlockM, D>(smem.q, q, p.q_seq_stride, m0, p.seqlen_q);

  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], o[kRowsPerWarp][kColsPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) o[r][c] = 0.f;
  }

  // Under the causal mask the block's last row sees keys up to m0 + kBlockM - 1 + offset.
  const int n_end = p.causal ? min(p.seqlen_k, m0 + kBlockM + p.causal_offset) : p.seqlen_k;
  for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
    __syncthreads();  // every warp is done reading the previous K/V tile before it is overwritten
    load_tile<T, D, kBlockN, D + 1>(smem.k, k, p.k_seq_stride, n0, p.seqlen_k);
    load_tile<T, D, kBlockN, D>(smem.v, v, p.v_seq_stride, n0, p.seqlen_k);
    __syncthreads();  // the K/V tile (and, on the first trip, the Q tile) is visible to all warps

    // S = scale * Q K^T for this warp's rows and key n0 + lane.
    float s[kRowsPerWarp] = {};
    for (int d = 0; d < D; ++d) {
      const float kd = smem.k[lane][d];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) s[r] += smem.q[warp * kRowsPerWarp + r][d] * kd;
    }

    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = m0 + warp * kRowsPerWarp + r;
      const bool masked = key >= p.seqlen_k || (p.causal && key > row + p.causal_offset);
      s[r] = masked ? -INFINITY : s[r] * p.scale;

      float tile_max = s[r];
      for (int off = 16; off > 0; off /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float new_max = fmaxf(row_max[r], tile_max);
      // While a row has seen only masked keys its max is -inf; exp(-inf - -inf) would be NaN.
      const float prob = new_max == -INFINITY ? 0.f : expf(s[r] - new_max);
      const float rescale = new_max == -INFINITY ? 1.f : expf(row_max[r] - new_max);
      float tile_sum = prob;
      for (int off = 16; off > 0; off /= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, off);
      row_max[r] = new_max;
      row_sum[r] = row_sum[r] * rescale + tile_sum;
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) o[r][c] *= rescale;
      smem.p[warp][r][lane] = prob;
    }
    __syncwarp();  // the warp's P rows are visible to all its lanes

    // O += P V: lane owns columns lane + 32 c.
    for (int j = 0; j < kBlockN; ++j) {
      float vj[kColsPerLane];
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) vj[c] = smem.v[j][lane + 32 * c];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float pr = smem.p[warp][r][j];
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) o[r][c] += pr * vj[c];
      }
    }
    __syncwarp();  // reads of smem.p finish before the next tile overwrites it
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = m0 + warp * kRowsPerWarp + r;
    if (row >= p.seqlen_q) continue;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;  // a fully masked row outputs 0
    T* out = static_cast<T*>(p.out) + batch * p.out_batch_stride + row * p.out_seq_stride + head * p.out_head_stride;
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) out[lane + 32 * c] = from_float<T>(o[r][c] * inv);
    if (p.lse != nullptr && lane == 0)
      p.lse[(int64_t(batch) * p.heads_q + head) * p.seqlen_q + row] =
          row_sum[r] > 0.f ? row_max[r] + logf(row_sum[r]) : -INFINITY;
  }
}

Status supports(const AttentionProblem&) { return Status::Ok(); }

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  const AttentionParams params = make_params(problem);
  return dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {
    constexpr int kSmemBytes = sizeof(SharedStorage<D>);
    static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the 227 KB an sm_90 block may use");
    auto kernel = fused_attention_kernel<T, D>;
    Status s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                           "02_fused_online_softmax: raising the shared-memory limit");
    if (!s.ok()) return s;
    const dim3 grid((problem.seqlen_q + kBlockM - 1) / kBlockM, problem.heads_q, problem.batch);
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(params);
    return launch_status("02_fused_online_softmax");
  });
}

}  // namespace

const KernelEntry& kernel_02_fused_online_softmax() {
  static const KernelEntry entry{"02_fused_online_softmax",
                                 "one pass with running max and sum; K/V tiles through shared memory; CUDA cores",
                                 supports, launch};
  return entry;
}

}  // namespace hattn
