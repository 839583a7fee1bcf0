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
constexpr int kCombineRowsPerBlock = 4;  // a warp per (request, row)

template <typename T>
__global__ void __launch_bounds__(32 * kCombineRowsPerBlock)
    combine_kernel(const __grid_constant__ Params p) {
  // Launched as the attention kernel's programmatic dependent: the partial results (and
  // anything else this reads) are complete and visible only once this wait returns.
  ptx::griddepcontrol_wait();
  const int lane = int(threadIdx.x) % 32;
  const int64_t index = int64_t(blockIdx.x) * kCombineRowsPerBlock + threadIdx.x / 32;
  if (index >= int64_t(p.batch) * p.rows) return;
  const int b = int(index / p.rows), row = int(index % p.rows);
  const int32_t* split_begin = p.schedule + int64_t(p.parts) * kRunInts;
  const int first = split_begin[b], parts = split_begin[b + 1] - first;
  if (parts <= 1) return;

  float max_lse = -INFINITY;
  for (int i = lane; i < parts; i += 32) max_lse = fmaxf(max_lse, p.lse_partial[int64_t(first + i) * p.rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, o));
  float sum = 0.f;
  if (max_lse != -INFINITY)
    for (int i = lane; i < parts; i += 32) sum += __expf(p.lse_partial[int64_t(first + i) * p.rows + row] - max_lse);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + __logf(sum);

  // Each lane merges 16 of the 512 columns: four float4 per part.
  float acc[16] = {};
  for (int i = 0; i < parts; ++i) {
    const int64_t slot_row = int64_t(first + i) * p.rows + row;
    const float part_lse = p.lse_partial[slot_row];
    if (part_lse == -INFINITY) continue;  // a part that saw no key (or the whole row saw none)
    const float weight = __expf(part_lse - lse);
    const float4* src = reinterpret_cast<const float4*>(p.o_partial + slot_row * kDimV) + lane;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = src[32 * j];
      acc[4 * j + 0] += weight * v.x, acc[4 * j + 1] += weight * v.y;
      acc[4 * j + 2] += weight * v.z, acc[4 * j + 3] += weight * v.w;
    }
  }
  const int s_idx = row / p.heads_q, h = row % p.heads_q;
  T* dst = static_cast<T*>(p.out) + b * p.o_batch + s_idx * p.o_seq + h * p.o_head;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2)
      *reinterpret_cast<uint32_t*>(dst + 4 * (lane + 32 * j) + e) = frag::pack2<T>(acc[4 * j + e], acc[4 * j + e + 1]);
  if (lane == 0 && p.lse != nullptr) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + s_idx] = lse;
}
#endif

}  // namespace hattn::mla
