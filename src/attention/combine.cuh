// The split-KV combine: the parts of a split item (split-KV's parts of a query block, or the
// parts of a cut tail item) each wrote their O, normalized by their own sum, and their LSE in
// fp32; one warp per row merges them, O = sum_s e^(lse_s - lse) O_s, lse = ln sum_s e^(lse_s).
#pragma once

#include <cmath>

#include "../common/fragment.cuh"
#include "../common/params.h"
#include "../ptx/griddepcontrol.cuh"
#include "hattn/hattn.h"
#include "work_list.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// Split-KV's second step: one warp combines the `parts` fp32 results of one row, O = sum_s
// e^(lse_s - lse) O_s with lse = ln sum_s e^(lse_s), and writes `out` (in T) and `lse` (when
// not null). Part s's LSE is lse_parts[s * stride], its O row o_parts + s * stride * D. A lane
// holds two parts' LSEs (kMaxSplits = 64) and D / 32 columns. The parts' rows are loaded
// kCombineBatch at a time before any is summed: one part per load round trip kept a decoding
// combine with 16 parts at D = 256 at 10.5 us on the H200 (results/evidence/decode_profile/).
constexpr int kCombineBatch = 8;
template <typename T, int D>
__device__ __forceinline__ void combine_row(const float* lse_parts, const float* o_parts, int64_t stride, int parts,
                                            T* out, float* lse) {
  static_assert(kMaxSplits <= 64, "a lane holds two parts' LSEs");
  constexpr int kPerLane = D / 32;  // 2, 4 or 8 columns
  const int lane = int(threadIdx.x) % 32;
  const float lse0 = lane < parts ? lse_parts[lane * stride] : -INFINITY;
  const float lse1 = lane + 32 < parts ? lse_parts[(lane + 32) * stride] : -INFINITY;
  float m = fmaxf(lse0, lse1);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  // No part saw a key: weights 0 (not NaN), output 0 and LSE -inf, as without splitting.
  const float w0 = m == -INFINITY ? 0.f : expf(lse0 - m), w1 = m == -INFINITY ? 0.f : expf(lse1 - m);
  float sum = w0 + w1;
#pragma unroll
  for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
  float acc[kPerLane] = {};
  for (int first = 0; first < parts; first += kCombineBatch) {
    float2 v[kCombineBatch][kPerLane / 2];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float* o = o_parts + (first + b) * stride * D + lane * kPerLane;
#pragma unroll
      for (int i = 0; i < kPerLane; i += 2)
        v[b][i / 2] = first + b < parts ? *reinterpret_cast<const float2*>(o + i) : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int part = first + b;
      const float w = part < parts ? __shfl_sync(0xffffffffu, part < 32 ? w0 : w1, part % 32) * inv_sum : 0.f;
      if (w == 0.f) continue;  // warp-uniform: a part without keys, or past the last, adds nothing
#pragma unroll
      for (int i = 0; i < kPerLane; i += 2) {
        acc[i] += w * v[b][i / 2].x;
        acc[i + 1] += w * v[b][i / 2].y;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; i += 2)
    *reinterpret_cast<uint32_t*>(out + lane * kPerLane + i) = frag::pack2<T>(acc[i], acc[i + 1]);
  if (lane == 0 && lse != nullptr) *lse = m == -INFINITY ? -INFINITY : m + logf(sum);
}

// Split-KV's combine: one warp per row of the partial layout [B][Hq][rows] (`rows_all` rows;
// B = 1 for a varlen batch), which is also the layout of lse.
template <typename T, int D>
__global__ void __launch_bounds__(128) combine_splits_kernel(const FeatureParams p, int64_t rows_all) {
  // The row's coordinates (64-bit divisions) do not depend on the attention kernel: worked
  // out while it still runs.
  const int64_t r = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (r >= rows_all) return;  // warp-uniform
  const bool packed = p.cu_seqlens_q != nullptr;
  const int rows = packed ? p.total_q : p.seqlen_q;
  const int row = int(r % rows);
  const int head = int(r / rows % p.heads_q), batch = int(r / rows / p.heads_q);  // batch 0 when packed
  T* out = static_cast<T*>(p.out) + int64_t(batch) * p.out_batch_stride + int64_t(row) * p.out_seq_stride +
           int64_t(head) * p.out_head_stride;
  // Launched as the attention kernel's programmatic dependent: its partials are complete and
  // visible only once this wait returns.
  ptx::griddepcontrol_wait();
  combine_row<T, D>(p.lse_partial + r, p.o_partial + r * D, rows_all, p.splits, out,
                    p.lse != nullptr ? p.lse + r : nullptr);
}

// The tail split's combine: one warp per row of the cut items' blocks, [tail item][row of the
// block], combining that row's parts (slots [tail item][part][row of the block]).
template <typename T, int D>
__global__ void __launch_bounds__(128) combine_tail_kernel(const FeatureParams p, const WorkList list, int block_m) {
  const int64_t r = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int tail = int(r / block_m), row_in_block = int(r % block_m);
  if (tail >= list.tail_items()) return;  // warp-uniform
  const WorkItem item = list.sched.item(list.tail_start + tail);
  const int row = item.m_block * block_m + row_in_block;
  if (row >= p.seqlen_q) return;
  const int64_t slot = int64_t(tail) * list.tail_parts * block_m + row_in_block;
  T* out = static_cast<T*>(p.out) + int64_t(item.batch) * p.out_batch_stride + int64_t(row) * p.out_seq_stride +
           int64_t(item.head_q) * p.out_head_stride;
  float* lse = p.lse != nullptr ? p.lse + (int64_t(item.batch) * p.heads_q + item.head_q) * p.seqlen_q + row : nullptr;
  combine_row<T, D>(p.lse_partial + slot, p.o_partial + slot * D, block_m, list.tail_parts, out, lse);
}
#endif

}  // namespace hattn::fwd
