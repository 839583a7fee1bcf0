// Lineage step 1: naive three-pass attention.
//
// What: the textbook algorithm, one kernel per line of the formula:
//   1. scores:  S[i, j] = scale * q_i . k_j   (or -inf where masked), fp32, written to memory
//   2. softmax: P[i, :] = exp(S[i, :] - max) / sum, in place; LSE = max + log(sum)
//   3. output:  O[i, :] = sum_j P[i, j] v_j
// Why: it is obviously right, and it shows what every later step removes: S and P make a
// round trip through device memory (Sq * Sk * 4 bytes per head, twice written and twice
// read), and every thread re-reads its q and k rows from global memory.
// Effect: far from the tensor cores; see results/ and docs/guide/01_naive.md.
// Limits: the S buffer for one head must fit in kMaxScoreBytes; heads are processed in chunks
// whose S buffers together stay under kChunkBytes (allocated stream-ordered per call).
#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "params.h"
#include "registry.h"
#include "scratch.h"

namespace hattn {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = int64_t(1) << 30;       // S workspace per launch chunk
constexpr int64_t kMaxScoreBytes = int64_t(4) << 30;    // S of one head; larger is refused
constexpr int kMaxGridY = 65535;

struct HeadIndex {
  int batch, head_q, head_kv;
};

__device__ __forceinline__ HeadIndex head_index(const AttentionParams& p, int flat) {
  HeadIndex h;
  h.batch = flat / p.heads_q;
  h.head_q = flat % p.heads_q;
  h.head_kv = h.head_q / p.heads_per_kv;
  return h;
}

// Pass 1. One thread per score; blockIdx.y picks the (batch, head) within the chunk.
template <typename T, int D>
__global__ void scores_kernel(AttentionParams p, int first_head, float* scores /* [chunk, Sq, Sk] */) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.seqlen_q) * p.seqlen_k) return;
  const int i = int(idx / p.seqlen_k);
  const int j = int(idx % p.seqlen_k);
  const HeadIndex h = head_index(p, first_head + blockIdx.y);
  float* s = scores + int64_t(blockIdx.y) * p.seqlen_q * p.seqlen_k;

  if (p.causal && j > i + p.causal_offset) {
    s[idx] = -INFINITY;
    return;
  }
  const T* q = static_cast<const T*>(p.q) + h.batch * p.q_batch_stride + i * p.q_seq_stride + h.head_q * p.q_head_stride;
  const T* k = static_cast<const T*>(p.k) + h.batch * p.k_batch_stride + j * p.k_seq_stride + h.head_kv * p.k_head_stride;
  float dot = 0.f;
#pragma unroll 8
  for (int d = 0; d < D; ++d) dot += to_float(q[d]) * to_float(k[d]);
  s[idx] = dot * p.scale;
}

// Block-wide reduction; `op` is max or sum. All threads get the result.
template <typename Op>
__device__ float block_reduce(float x, Op op, float* scratch /* [kThreads / 32] */) {
  for (int offset = 16; offset > 0; offset /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();  // all warp partials are written
  x = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) x = op(x, scratch[w]);
  return x;
}

// Pass 2. One block per query row: P = softmax(S) in place, and the row's LSE.
__global__ void softmax_kernel(AttentionParams p, int first_head, float* scores) {
  __shared__ float scratch[kThreads / 32];
  const int i = blockIdx.x;
  float* row = scores + (int64_t(blockIdx.y) * p.seqlen_q + i) * p.seqlen_k;

  float row_max = -INFINITY;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kThreads) row_max = fmaxf(row_max, row[j]);
  row_max = block_reduce(row_max, [](float a, float b) { return fmaxf(a, b); }, scratch);

  // A fully masked row has max -inf: its P is all zero and its LSE -inf.
  const bool empty = row_max == -INFINITY;
  float row_sum = 0.f;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kThreads) {
    const float e = empty ? 0.f : expf(row[j] - row_max);
    row[j] = e;
    row_sum += e;
  }
  row_sum = block_reduce(row_sum, [](float a, float b) { return a + b; }, scratch);
  const float inv_sum = empty ? 0.f : 1.f / row_sum;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kThreads) row[j] *= inv_sum;

  if (p.lse != nullptr && threadIdx.x == 0) {
    const int flat = first_head + blockIdx.y;  // = batch * Hq + head_q, the LSE's [B, Hq] index
    p.lse[int64_t(flat) * p.seqlen_q + i] = empty ? -INFINITY : row_max + logf(row_sum);
  }
}

// Pass 3. One block per query row, one thread per output column d.
template <typename T, int D>
__global__ void output_kernel(AttentionParams p, int first_head, const float* probs) {
  const int i = blockIdx.x;
  const int d = threadIdx.x;
  const HeadIndex h = head_index(p, first_head + blockIdx.y);
  const float* prow = probs + (int64_t(blockIdx.y) * p.seqlen_q + i) * p.seqlen_k;
  const T* v = static_cast<const T*>(p.v) + h.batch * p.v_batch_stride + h.head_kv * p.v_head_stride + d;
  float acc = 0.f;
  for (int j = 0; j < p.seqlen_k; ++j) acc += prow[j] * to_float(v[int64_t(j) * p.v_seq_stride]);
  T* o = static_cast<T*>(p.out) + h.batch * p.out_batch_stride + i * p.out_seq_stride + h.head_q * p.out_head_stride;
  o[d] = from_float<T>(acc);
}

int64_t score_bytes_per_head(const AttentionProblem& problem) {
  return int64_t(problem.seqlen_q) * problem.seqlen_k * int64_t(sizeof(float));
}

Status supports(const AttentionProblem& problem) {
  if (score_bytes_per_head(problem) > kMaxScoreBytes)
    return {StatusCode::not_supported, "the S matrix of one head (seqlen_q * seqlen_k * 4 bytes) exceeds 4 GiB"};
  return Status::Ok();
}

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  const AttentionParams params = make_params(problem);
  const int total_heads = problem.batch * problem.heads_q;
  int64_t heads_per_chunk = std::min<int64_t>(kChunkBytes / score_bytes_per_head(problem), kMaxGridY);
  const int chunk = int(std::clamp<int64_t>(heads_per_chunk, 1, total_heads));

  // S for `chunk` heads at a time, from the problem's scratch allocator (default: the stream's pool).
  const size_t bytes = size_t(chunk) * score_bytes_per_head(problem);
  void* taken = nullptr;
  Status s = take_scratch(problem.allocator, bytes, stream, "01_naive: the S workspace", &taken);
  if (!s.ok()) return s;
  float* scores = static_cast<float*>(taken);

  s = dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {
    for (int first = 0; first < total_heads; first += chunk) {
      const int heads = std::min(chunk, total_heads - first);
      const int64_t n_scores = int64_t(problem.seqlen_q) * problem.seqlen_k;
      const dim3 score_grid(unsigned((n_scores + kThreads - 1) / kThreads), heads);
      scores_kernel<T, D><<<score_grid, kThreads, 0, stream>>>(params, first, scores);
      softmax_kernel<<<dim3(problem.seqlen_q, heads), kThreads, 0, stream>>>(params, first, scores);
      output_kernel<T, D><<<dim3(problem.seqlen_q, heads), D, 0, stream>>>(params, first, scores);
      Status ls = launch_status("01_naive");
      if (!ls.ok()) return ls;
    }
    return Status::Ok();
  });
  // Stream-ordered: the buffer is reused only after the passes above have run.
  Status fs = give_back_scratch(problem.allocator, taken, bytes, stream, "01_naive", "the S workspace");
  return s.ok() ? fs : s;
}

}  // namespace

const KernelEntry& kernel_01_naive() {
  static const KernelEntry entry{"01_naive", "three passes: S = QK^T to memory, row softmax, O = PV", supports,
                                 launch};
  return entry;
}

}  // namespace hattn
