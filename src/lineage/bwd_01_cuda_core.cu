// Backward step 1: the gradients of attention on CUDA cores, a correct baseline.
//
// FlashAttention's backward without its tiling of the queries: P is recomputed from Q, K and
// the forward's LSE, never stored. Three kernels (delta and convert in backward_common.cuh):
//   1. delta: D/8 lanes per query row, delta_i = rowsum(dO_i * O_i).
//   2. main: one CTA per (32-key block, query head, batch). Its keys' K and V rows, and their
//      dK and dV sums, stay in shared memory while its warps walk the query rows that see any
//      of them. Lane j owns key j: for row i,
//          p_ij = exp(scale q_i.k_j - lse_i),  dp_ij = dO_i.v_j,  ds_ij = p_ij (dp_ij - delta_i)
//          dV_j += p_ij dO_i,  dK_j += scale ds_ij q_i,  dQ_i += scale sum_j ds_ij k_j
//      dQ_i goes to an fp32 buffer by atomicAdd (other key blocks add to the same row); at the
//      end the CTA adds its dK and dV to fp32 buffers per K/V head (a GQA group's heads add up).
//   3. convert: the fp32 sums to dq, dk and dv in the input dtype, at their strides.
// Dense batches only (the production backward runs variable-length ones).
// fp32 arithmetic throughout; the atomic sums make the result nondeterministic in its last
// bits. Slow by design: the tensor-core steps come next.
#include <cmath>
#include <string>

#include "backward.h"
#include "backward_common.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_01_cuda_core";
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 32;  // keys per CTA: one per lane

template <int D>
struct SharedStorage {
  float k[kBlockN][D + 1];  // +1: lane j reads row j, so the rows start in different banks
  float v[kBlockN][D + 1];
  float dk[kBlockN][D];
  float dv[kBlockN][D];
  float q[kWarps][D];   // each warp's current query row
  float dout[kWarps][D];
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) main_kernel(BaseBackwardParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<D>*>(smem_raw);
  const AttentionParams& f = p.fwd;
  const int n0 = blockIdx.x * kBlockN, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / f.heads_per_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kColsPerLane = D / 32;

  const T* k = static_cast<const T*>(f.k) + b * f.k_batch_stride + hk * f.k_head_stride;
  const T* v = static_cast<const T*>(f.v) + b * f.v_batch_stride + hk * f.v_head_stride;
  for (int e = threadIdx.x; e < kBlockN * D; e += kThreads) {
    const int r = e / D, c = e % D;
    const bool inside = n0 + r < f.seqlen_k;
    smem.k[r][c] = inside ? to_float(k[int64_t(n0 + r) * f.k_seq_stride + c]) : 0.f;
    smem.v[r][c] = inside ? to_float(v[int64_t(n0 + r) * f.v_seq_stride + c]) : 0.f;
    smem.dk[r][c] = 0.f;
    smem.dv[r][c] = 0.f;
  }
  __syncthreads();  // K, V and the zeroed sums are in place before any warp reads or adds

  const int key = n0 + lane;
  for (int i = warp; i < f.seqlen_q; i += kWarps) {
    int first = 0, last = 0;
    visible_keys(f, i, &first, &last);
    if (last <= n0 || first >= n0 + kBlockN) continue;  // warp-uniform: no key of this block
    const T* q = static_cast<const T*>(f.q) + b * f.q_batch_stride + int64_t(i) * f.q_seq_stride + h * f.q_head_stride;
    const T* d_o = static_cast<const T*>(p.dout) + b * p.dout_batch_stride + int64_t(i) * p.dout_seq_stride +
                   h * p.dout_head_stride;
    for (int d = lane; d < D; d += 32) {
      smem.q[warp][d] = to_float(q[d]);
      smem.dout[warp][d] = to_float(d_o[d]);
    }
    __syncwarp();  // the row is in place before the lanes read all of it
    const int64_t row = (int64_t(b) * f.heads_q + h) * f.seqlen_q + i;
    const float lse = f.lse[row], delta = p.delta[row];
    float s = 0.f, dp = 0.f;
    for (int d = 0; d < D; ++d) {
      s += smem.q[warp][d] * smem.k[lane][d];
      dp += smem.dout[warp][d] * smem.v[lane][d];
    }
    const bool visible = key >= first && key < last;
    const float prob = visible ? expf(s * f.scale - lse) : 0.f;
    const float ds = prob * (dp - delta) * f.scale;  // dL/d(q.k) for this key
    if (visible) {
      for (int d = 0; d < D; ++d) {  // other warps add to the same key rows
        atomicAdd(&smem.dv[lane][d], prob * smem.dout[warp][d]);
        atomicAdd(&smem.dk[lane][d], ds * smem.q[warp][d]);
      }
    }
    float dq[kColsPerLane] = {};
    for (int j = 0; j < kBlockN; ++j) {
      const float ds_j = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) dq[c] += ds_j * smem.k[j][lane + 32 * c];
    }
    float* dq_row = p.dq_accum + ((int64_t(b) * f.seqlen_q + i) * f.heads_q + h) * D;
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) atomicAdd(dq_row + lane + 32 * c, dq[c]);
    __syncwarp();  // every lane has read the row before the next one overwrites it
  }
  __syncthreads();  // all warps' additions to dK and dV are done

  for (int e = threadIdx.x; e < kBlockN * D; e += kThreads) {
    const int r = e / D, c = e % D;
    if (n0 + r >= f.seqlen_k) continue;
    const int64_t at = ((int64_t(b) * f.seqlen_k + n0 + r) * f.heads_kv + hk) * D + c;
    atomicAdd(p.dk_accum + at, smem.dk[r][c]);
    atomicAdd(p.dv_accum + at, smem.dv[r][c]);
  }
}

Status supports(const BackwardProblem& problem) {
  return Status::Ok();  // windows, varlen and KV caches: refused centrally (api.cpp)
}

Status launch(const BackwardProblem& problem, cudaStream_t stream) {
  return run_backward<AttentionParams>(problem, stream, kName, [&]<typename T, int D>(const BaseBackwardParams& p) -> Status {
    constexpr int kSmem = int(sizeof(SharedStorage<D>));
    return launch_per_key_block(main_kernel<T, D>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, p);
  });
}

}  // namespace

const BackwardKernel& backward_cuda_core() {
  static const BackwardKernel kernel{
      kName, "FlashAttention's backward on CUDA cores: P recomputed from the LSE, a query row at a time, fp32 sums",
      supports, launch};
  return kernel;
}

}  // namespace hattn
