// Small helpers shared by the lineage kernels: element types, conversions, launch checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "hattn/hattn.h"

namespace hattn {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// Status of the last launch on this thread.
inline Status launch_status(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return {StatusCode::cuda_error, std::string(kernel) + ": launch failed: " + cudaGetErrorString(err)};
}

// Kernels from 07 on take the running max on raw scores and fold the scale into the exponent,
// which needs scale > 0 (max(c s) = c max(s) only for c > 0; with c = 0 a masked score gives
// -inf * 0 = NaN). "auto" then falls back to 06, which scales before the max.
inline Status require_positive_scale(const AttentionProblem& problem, const char* kernel) {
  if (problem.scale() > 0.f) return Status::Ok();
  return {StatusCode::not_supported, std::string(kernel) + ": softmax_scale must be > 0 (the running max is taken "
                                     "on unscaled scores); got " + std::to_string(problem.scale())};
}

inline Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return {StatusCode::cuda_error, what + ": " + cudaGetErrorString(err)};
}

// Launches `kernel` as a programmatic dependent of the kernel ahead of it on `stream`: that one
// lets it start while it still runs (griddepcontrol.launch_dependents), and `kernel` waits for
// it (griddepcontrol.wait) before it reads what that one writes. `what` names the launch in
// errors. With `smem` bytes of dynamic shared memory (launch_dependent_with_smem), the kernel's
// limit is raised to that first.
template <typename... Params, typename... Args>
Status launch_dependent_with_smem(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                                  const std::string& what, Args&&... args) {
  if (smem > 0) {
    Status st = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                            what + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!st.ok()) return st;
  }
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = size_t(smem);
  config.stream = stream;
  config.attrs = &dependent;
  config.numAttrs = 1;
  // cudaLaunchKernelEx returns the launch's own error (cuda_status then clears it).
  return cuda_status(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}
template <typename... Params, typename... Args>
Status launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                        const std::string& what, Args&&... args) {
  return launch_dependent_with_smem(kernel, grid, block, 0, stream, what, std::forward<Args>(args)...);
}

// Calls f.template operator()<T, D>() with the element type and head dim of `problem`:
// the one place where each kernel's template instantiations are spelled out.
template <typename F>
Status dispatch_dtype_headdim(const AttentionProblem& problem, F&& f) {
  auto by_dim = [&](auto type_tag) -> Status {
    using T = decltype(type_tag);
    switch (problem.head_dim) {
      case 64: return f.template operator()<T, 64>();
      case 128: return f.template operator()<T, 128>();
      case 256: return f.template operator()<T, 256>();
    }
    return {StatusCode::not_supported, "head_dim " + std::to_string(problem.head_dim)};
  };
  if (problem.dtype == DType::e4m3)  // only the final kernel has e4m3, outside this dispatch
    return {StatusCode::not_supported, "dtype e4m3: not in this kernel's instantiations"};
  return problem.dtype == DType::bf16 ? by_dim(__nv_bfloat16{}) : by_dim(__half{});
}

}  // namespace hattn
