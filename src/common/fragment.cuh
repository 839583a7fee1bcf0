// Register-fragment helpers shared by the tensor-core kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

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

// Two floats as an fp16 pair, `lo` in the low half, nearest even, saturated to +-65504 (NaN
// stays NaN): cvt.rn.satfinite.f16x2.f32.
__device__ __forceinline__ uint32_t pack2_half_satfinite(float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
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

// Two e4m3 codes (the low byte the low element) as an fp16 pair, exactly: every e4m3 value is
// a normal fp16 (cvt.rn.f16x2.e4m3x2, sm_89 on). NaN codes stay NaN.
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint16_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  return uint32_t(h.x) | uint32_t(h.y) << 16;
}

}  // namespace hattn::frag
