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
// A CTA per (request, row); its warps take 128 of the 512 columns each, a float4 a lane. One
// request of a long cache has about one part per SM (132 on an H200), so the parts' rows are
// loaded kCombineBatch at a time before any is summed: with one part per load round trip, a
// request's combine took longer than its attention kernel.
constexpr int kCombineWarps = kDimV / 128;
constexpr int kCombineBatch = 16;

template <typename T>
__global__ void __launch_bounds__(32 * kCombineWarps) combine_kernel(const __grid_constant__ Params p) {
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int b = int(blockIdx.x / unsigned(p.rows)), row = int(blockIdx.x % unsigned(p.rows));
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

  const int col = warp * 128 + lane * 4;
  const float* o_parts = p.o_partial + (int64_t(first) * p.rows + row) * kDimV + col;
  const int64_t part_stride = int64_t(p.rows) * kDimV;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i0 = 0; i0 < parts; i0 += kCombineBatch) {
    float part_lse[kCombineBatch];
    float4 v[kCombineBatch];
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      const bool in = i0 + j < parts;
      part_lse[j] = in ? lse_parts[int64_t(i0 + j) * p.rows] : -INFINITY;
      v[j] = in ? *reinterpret_cast<const float4*>(o_parts + (i0 + j) * part_stride) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kCombineBatch; ++j) {
      if (part_lse[j] == -INFINITY) continue;  // warp-uniform: no keys, or past the last part
      const float w = __expf(part_lse[j] - lse);
      acc.x += w * v[j].x, acc.y += w * v[j].y, acc.z += w * v[j].z, acc.w += w * v[j].w;
    }
  }
  const int s_idx = row / p.heads_q, h = row % p.heads_q;
  T* dst = static_cast<T*>(p.out) + b * p.o_batch + s_idx * p.o_seq + h * p.o_head + col;
  *reinterpret_cast<uint32_t*>(dst) = frag::pack2<T>(acc.x, acc.y);
  *reinterpret_cast<uint32_t*>(dst + 2) = frag::pack2<T>(acc.z, acc.w);
  if (warp == 0 && lane == 0 && p.lse != nullptr) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + s_idx] = lse;
}
#endif

}  // namespace hattn::mla
