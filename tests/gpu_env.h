// Whether this machine can run the kernels, and why not.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace hattn::testing {

// Empty when a Hopper (sm_90) GPU is present; otherwise the reason GPU tests skip.
inline std::string gpu_skip_reason() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return std::string("no CUDA GPU on this machine (") + (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") +
           "); GPU tests run on the H200 via scripts/gpu_run.sh";
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  if (major != 9 || minor != 0)
    return "GPU is sm_" + std::to_string(major) + std::to_string(minor) + ", the kernels need Hopper sm_90a";
  return {};
}

}  // namespace hattn::testing
