// MLA decoding's second kernel: the rows of split requests, merged from their parts' partial
// results (each part's O normalized by its own sum, and its LSE): O = sum_i e^(lse_i - lse) O_i
// with lse = log sum_i e^(lse_i). A request with one part was written by the attention kernel.
#pragma once

#include <cmath>

#include "../common/common.cuh"
#include "../ptx/griddepcontrol.cuh"
#include "kernel.cuh"

namespace hattn::mla {

#ifdef __CUDACC__
// CTAs of four warps. A warp merges kWarpColumns of a row's 512 columns: all of them (narrow,
// four rows a CTA), or 128 (wide, a CTA per row) when the rows are too few to fill the GPU
// otherwise. One request of a long cache has about a part per SM, so each lane loads 8 float4
// (8 parts of 128 columns, or 2 of 512) before it sums any: one part per load round trip, the
// combine of a single request took longer than its attention kernel.
constexpr int kCombineWarps = 4;
constexpr int kCombineFloat4s = 8;  // float4 loads in flight per lane

template <typename T, int kWarpColumns>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ Params p) {
  constexpr int kWarpsPerRow = kDimV / kWarpColumns;
  constexpr int kLaneFloat4s = kWarpColumns / 128;             // float4s of a lane in one part's row
  constexpr int kBatch = kCombineFloat4s / kLaneFloat4s;       // parts loaded per round trip
  const int lane = int(threadIdx.x) % 32;
  const int64_t warp = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  const int64_t index = warp / kWarpsPerRow;                   // (request, row)
  if (index >= int64_t(p.batch) * p.rows) return;              // warp-uniform
  const int b = int(index / p.rows), row = int(index % p.rows);
  const int col = int(warp % kWarpsPerRow) * kWarpColumns + lane * 4;  // then + 128 per float4
  // Launched as the attention kernel's programmatic dependent: the partial results (and
  // anything else this reads) are complete and visible only once this wait returns.
  ptx::griddepcontrol_wait();
  const int32_t* split_begin = p.schedule + int64_t(p.parts) * kRunInts;
  const int first = split_begin[b], parts = split_begin[b + 1] - first;
  if (parts <= 1) return;
  const float* lse_parts = p.lse_partial + int64_t(first) * p.rows + row;  // part i at i * rows

  // The row's LSE in one pass: each lane a running max and sum over its parts, then the lanes'
  // pairs merged. A part that saw no key has LSE -inf and weight 0; so has every part of a row
  // that saw none, whose output is 0 and LSE -inf, as without splitting.
  float m = -INFINITY, sum = 0.f;
  for (int i = lane; i < parts; i += 32) {
    const float l = lse_parts[int64_t(i) * p.rows];
    if (l == -INFINITY) continue;
    const float m_new = fmaxf(m, l);
    sum = sum * __expf(m - m_new) + __expf(l - m_new);
    m = m_new;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float m_other = __shfl_xor_sync(0xffffffffu, m, o), sum_other = __shfl_xor_sync(0xffffffffu, sum, o);
    const float m_new = fmaxf(m, m_other);
    if (m_new != -INFINITY) sum = sum * __expf(m - m_new) + sum_other * __expf(m_other - m_new);
    m = m_new;
  }
  const float lse = m == -INFINITY ? -INFINITY : m + __logf(sum);

  const float* o_parts = p.o_partial + (int64_t(first) * p.rows + row) * kDimV + col;
  const int64_t part_stride = int64_t(p.rows) * kDimV;
  float4 acc[kLaneFloat4s];
#pragma unroll
  for (int j = 0; j < kLaneFloat4s; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i0 = 0; i0 < parts; i0 += kBatch) {
    float part_lse[kBatch];
    float4 v[kBatch][kLaneFloat4s];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const bool in = i0 + i < parts;
      part_lse[i] = in ? lse_parts[int64_t(i0 + i) * p.rows] : -INFINITY;
#pragma unroll
      for (int j = 0; j < kLaneFloat4s; ++j)
        v[i][j] = in ? *reinterpret_cast<const float4*>(o_parts + (i0 + i) * part_stride + 128 * j)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (part_lse[i] == -INFINITY) continue;  // warp-uniform: no keys, or past the last part
      const float w = __expf(part_lse[i] - lse);
#pragma unroll
      for (int j = 0; j < kLaneFloat4s; ++j)
        acc[j].x += w * v[i][j].x, acc[j].y += w * v[i][j].y, acc[j].z += w * v[i][j].z, acc[j].w += w * v[i][j].w;
    }
  }
  const int s_idx = row / p.heads_q, h = row % p.heads_q;
  T* dst = static_cast<T*>(p.out) + b * p.o_batch + s_idx * p.o_seq + h * p.o_head + col;
#pragma unroll
  for (int j = 0; j < kLaneFloat4s; ++j) {
    *reinterpret_cast<uint32_t*>(dst + 128 * j) = frag::pack2<T>(acc[j].x, acc[j].y);
    *reinterpret_cast<uint32_t*>(dst + 128 * j + 2) = frag::pack2<T>(acc[j].z, acc[j].w);
  }
  if (col == 0 && p.lse != nullptr) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + s_idx] = lse;
}
#endif

}  // namespace hattn::mla
