// Register-fragment helpers shared by the tensor-core kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace hattn::frag {

// Two floats rounded to T and packed in one 32-bit register, `lo` in the low half (the lower
// column of an mma/wgmma A fragment).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return reinterpret_cast<const uint32_t&>(h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return reinterpret_cast<const uint32_t&>(h);
}

// The two elements of a packed pair, `lo` (the low half) in .x.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t pair);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t pair) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(pair));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t pair) {
  return __half22float2(reinterpret_cast<const __half2&>(pair));
}

// Four floats rounded to e4m3 (nearest even, saturated to +-448) and packed in one 32-bit
// register, x0 in the lowest byte: cvt.rn.satfinite.e4m3x2.f32 (sm_89 on) per pair.
__device__ __forceinline__ uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// Two e4m3 codes (the low byte the low element) as a T pair, exactly: every e4m3 value is a
// normal fp16 (cvt.rn.f16x2.e4m3x2, sm_89 on), and every fp16 one with 3 mantissa bits a bf16.
// NaN codes stay NaN.
template <typename T>
__device__ __forceinline__ uint32_t e4m3x2_to(uint16_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return uint32_t(h.x) | uint32_t(h.y) << 16;
  } else {
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(__half2(h)));
    return reinterpret_cast<const uint32_t&>(b);
  }
}

// Four e4m3 codes (code i in byte i) as four T, two to a register (code 0 in the low half of
// .x), in integer and 16-bit multiply instructions only, off the conversion pipe that
// e4m3x2_to's cvt uses. Each code's bits sit in a 16-bit half (byte_perm) as T's sign, low
// exponent bits and top mantissa bits: an e4m3 value with its exponent biased by T's bias, a
// power of two off, which one multiply puts right (2^8 for fp16, 2^120 for bf16; exact, and
// e4m3's subnormals land on T's subnormals, which the multiply keeps). NaN codes (0x7F, 0xFF)
// come out as +-480, one step past e4m3's largest finite value.
template <bool kHalf>  // fp16, else bf16
struct E4m3Widening {
  // Bits 14..8 of a half hold the code's exponent and mantissa, bit 15 its sign: shifted right by
  // 1 they are fp16's exponent (bits 14..10, top bit 0) and mantissa's top 3 bits; by 4, bf16's.
  static constexpr int kShift = kHalf ? 1 : 4;
  static constexpr uint32_t kMagnitude = kHalf ? 0x3F803F80u : 0x07F007F0u;
  static constexpr uint32_t kScale = kHalf ? 0x5C005C00u : 0x7B807B80u;  // 2^8 in fp16, 2^120 in bf16, twice
  // Two codes at bits 15..8 and 31..24 as the two 16-bit values the multiply by kScale widens.
  __host__ __device__ static constexpr uint32_t bits(uint32_t placed) {
    return ((placed >> kShift) & kMagnitude) | (placed & 0x80008000u);
  }
};

template <typename T>
__device__ __forceinline__ uint2 widen4_e4m3(uint32_t codes) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  using W = E4m3Widening<kHalf>;
  const uint32_t scale = W::kScale;
  auto widen2 = [&](uint32_t placed) {
    const uint32_t bits = W::bits(placed);
    if constexpr (kHalf) {
      const __half2 v = __hmul2(reinterpret_cast<const __half2&>(bits), reinterpret_cast<const __half2&>(scale));
      return reinterpret_cast<const uint32_t&>(v);
    } else {
      const __nv_bfloat162 v =
          __hmul2(reinterpret_cast<const __nv_bfloat162&>(bits), reinterpret_cast<const __nv_bfloat162&>(scale));
      return reinterpret_cast<const uint32_t&>(v);
    }
  };
  return make_uint2(widen2(__byte_perm(codes, 0u, 0x1404)),   // codes 0, 1
                    widen2(__byte_perm(codes, 0u, 0x3424)));  // codes 2, 3
}

}  // namespace hattn::frag
