// ex2 and rcp: the hardware base-2 exponential and reciprocal (the MUFU unit).
//
// PTX ISA: Floating Point Instructions: ex2, rcp.approx,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#floating-point-instructions-ex2
// https://docs.nvidia.com/cuda/parallel-thread-execution/#floating-point-instructions-rcp
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

// 1/x from MUFU.RCP (within 1 ulp); subnormal inputs and results are flushed to zero;
// rcp(+-inf) = +-0.
__device__ __forceinline__ float rcp_approx_ftz_f32(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace hattn::ptx
