// The online softmax of one consumer warpgroup's rows: the running max and sum per row, the
// exponentials with the scale folded into exp2, the vote that skips O's rescale, and the
// row's normalizer and log-sum-exp at an item's end.
#pragma once

#include <cmath>

#include "../common/exp2_fma.cuh"
#include "../ptx/ex2.cuh"
#include "config.h"

namespace hattn::fwd {

#ifdef __CUDACC__
// A thread holds two rows (the accumulator's g and g + 8) of kNTiles n8 tiles each; a row
// lives in the 4 threads of a quad. kFp8 keeps P as 2^8 P (kFp8PLog2).
template <int kNTiles, int kFmaExp2Tiles, bool kFp8>
struct OnlineSoftmax {
  float row_max[2];  // running max of the raw scores s
  float row_sum[2];  // running sum of 2^(x - max) over this thread's columns
  float alpha[2];    // the previous tile's rescale factor, not yet applied to O
  int rescale;       // some alpha of this warp is not 1: O *= alpha is needed (the warp's vote)

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[r] = -INFINITY, row_sum[r] = 0.f, alpha[r] = 1.f;
    rescale = 0;
  }

  // Scores to weights, on raw scores: the max commutes with the positive scale, which is
  // folded into the exponent, 2^(s c - m c) with c = scale log2(e) = scale_log2, one FFMA.
  // alpha is applied to O just before the next PV is issued, and only if it is not 1.
  __device__ __forceinline__ void update(float (&s)[kNTiles * 4], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      // A row with no visible key yet subtracts 0, not -inf: weights 0, not NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      const float p_offset = kFp8 ? m_scaled - kFp8PLog2 : m_scaled;  // FP8: 2^8 P
      // Exactly 1 when the max is unchanged (the compiler may fuse the exponent into an FFMA,
      // which would leave a rounding error instead of 0), so that the rescale can be skipped.
      alpha[r] = m == row_max[r] ? 1.f : ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float x = fmaf(s[nt * 4 + e], scale_log2, -p_offset);
          s[nt * 4 + e] = nt % 4 < kFmaExp2Tiles ? exp2_fma(x) : ptx::ex2_approx_ftz_f32(x);
          sum += s[nt * 4 + e];
        }
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
    rescale = __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);
  }

  // At the item's end: the row sums across the quad, and 1 / sum (0 for a row that saw no
  // key, whose O is then 0). A row that saw a key has row_sum >= 1 (its max adds 2^0), so the
  // hardware reciprocal (__fdividef, MUFU; a few ulp) replaces the IEEE division, whose range
  // checks lengthen the serial chain at each item's end.
  __device__ __forceinline__ void finish(float (&inv_sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      inv_sum[r] = row_sum[r] > 0.f ? __fdividef(1.f, row_sum[r]) : 0.f;
    }
  }

  // LSE = ln(sum_j e^(scale s_j)) = scale max + ln(sum), max in raw units (after finish());
  // -inf for a row that saw no key. __logf (MUFU) is within 4e-7 near 1, where sums start.
  __device__ __forceinline__ float lse(int r, float scale) const {
    return row_sum[r] > 0.f ? row_max[r] * scale + __logf(row_sum[r]) : -INFINITY;
  }
};
#endif

}  // namespace hattn::fwd
