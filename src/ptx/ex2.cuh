// ex2 and tanh: the hardware base-2 exponential and hyperbolic tangent (the MUFU unit).
//
// PTX ISA: Floating Point Instructions: ex2, tanh,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#floating-point-instructions-ex2
// https://docs.nvidia.com/cuda/parallel-thread-execution/#floating-point-instructions-tanh
//
// exp2f() without --use_fast_math compiles to the non-.ftz form, which ptxas wraps in three
// extra instructions (a compare and two multiplies) to produce subnormal results. A softmax
// weight below 2^-126 is zero after rounding to bf16/fp16 anyway, so the flush costs nothing.
#pragma once

namespace hattn::ptx {

// 2^x from MUFU.EX2: the same value exp2f() gives wherever the result is a normal float;
// subnormal inputs and results are flushed to zero; ex2(-inf) = +0.
__device__ __forceinline__ float ex2_approx_ftz_f32(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) from MUFU.TANH. The PTX ISA promises a relative error below 2^-11; on the H200 it
// stays below 1e-5 relative and 8e-6 absolute over [-12, 12] (tools/tanh_approx_profile.cu;
// tests/test_kernel_math.cu holds it to that).
__device__ __forceinline__ float tanh_approx_f32(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace hattn::ptx
