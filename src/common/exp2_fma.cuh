// 2^x on the FMA pipe: a stand-in for MUFU.EX2 (ptx/ex2.cuh) where the special-function unit,
// not the tensor cores, bounds the softmax (the FP8 forward: its GEMMs take half of bf16's time,
// its exponentials as long as before). Host and device, so that a CPU test checks it.
//
// x = j + f with j the nearest integer (x + 1.5 * 2^23 leaves j in the low mantissa bits, a
// two's-complement integer that a shift moves into the exponent field) and f in [-1/2, 1/2];
// 2^f by a cubic (Chebyshev nodes, relative error below 1e-4, under e4m3's and bf16's rounding
// of P); then 2^j added to the exponent. Three FADD, three FFMA, a shift, an add and a select.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace hattn {

// 2^x for x <= 127 within a relative 1e-4; exactly 0 below -126 (and for -inf), as the softmax
// needs for masked scores (ex2.approx.ftz flushes there too). NaN in, 0 out: callers never pass it.
__host__ __device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound is an integer, j, in the low bits
  const float t = x + kRound;
  const float f = x - (t - kRound);  // in [-1/2, 1/2]
  const float p = fmaf(fmaf(fmaf(0.05583828315f, f, 0.24263948202f), f, 0.69313675165f), f, 0.99992454052f);
  const float y = std::bit_cast<float>(std::bit_cast<int32_t>(p) + int32_t(std::bit_cast<uint32_t>(t) << 23));
  return x >= -126.f ? y : 0.f;
}

}  // namespace hattn
