// tanh.approx.f32 (MUFU.TANH) against fp64 tanh: the largest absolute and relative error per
// band of |x| over [-12, 12], on the GPU it runs on. Softcapping relies on it (ptx/ex2.cuh).
//
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc tools/tanh_approx_profile.cu -o tanh_approx_profile
//   ./tanh_approx_profile     # on the H200: results/evidence/softcap/tanh_approx/tanh_profile.txt
#include <cmath>
#include <cstdio>

#include "ptx/ex2.cuh"

__global__ void tanh_approx_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = hattn::ptx::tanh_approx_f32(x[i]);
}

int main() {
  const int n = 1 << 24;  // 2^24 points, 1.4e-6 apart
  float *x = nullptr, *y = nullptr;
  if (cudaMallocManaged(&x, n * sizeof(float)) != cudaSuccess ||
      cudaMallocManaged(&y, n * sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "tanh_approx_profile: no GPU memory (is there a GPU?)\n");
    return 1;
  }
  for (int i = 0; i < n; ++i) x[i] = -12.f + 24.f * (float(i) / n);
  tanh_approx_kernel<<<n / 256, 256>>>(x, y, n);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "tanh_approx_profile: the kernel failed (an sm_90a GPU is needed)\n");
    return 1;
  }
  const float edges[] = {0, 0.01f, 0.1f, 0.5f, 1, 2, 4, 8, 12.1f};
  for (int b = 0; b < 8; ++b) {
    double worst_abs = 0, worst_rel = 0;
    for (int i = 0; i < n; ++i) {
      const float a = std::fabs(x[i]);
      if (a < edges[b] || a >= edges[b + 1] || x[i] == 0) continue;
      const double exact = std::tanh(double(x[i])), err = std::fabs(double(y[i]) - exact);
      worst_abs = std::fmax(worst_abs, err);
      worst_rel = std::fmax(worst_rel, err / std::fabs(exact));
    }
    std::printf("|x| in [%g, %g): max abs %.3g, max rel %.3g (2^%.1f)\n", edges[b], edges[b + 1], worst_abs,
                worst_rel, std::log2(worst_rel));
  }
  return 0;
}
