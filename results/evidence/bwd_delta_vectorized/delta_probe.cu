// Untracked probe (deleted after): delta-kernel variants' bandwidth on the H200.
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
constexpr int B = 16, S = 1024, H = 16;
__device__ __forceinline__ float dot8(int4 a, int4 b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) { float2 u = __bfloat1622float2(x[w]), v = __bfloat1622float2(y[w]); s = fmaf(u.x, v.x, fmaf(u.y, v.y, s)); }
  return s;
}
// rows contiguous (dense BSHD), row r = (b*S+i)*H+h; delta index (b*H+h)*S+i
template <int D, int T, int P, bool kZero>
__global__ void __launch_bounds__(T) blocked(const int4* o, const int4* d_o, float* delta, float4* zero, int64_t rows) {
  constexpr int L = D / 8, R = T / L;
  const int64_t r0 = int64_t(blockIdx.x) * R * P + threadIdx.x / L;
  const int d = threadIdx.x % L;
  int4 a[P], b[P];
#pragma unroll
  for (int p = 0; p < P; ++p) { int64_t r = r0 + p * R; a[p] = b[p] = make_int4(0,0,0,0); if (r < rows) { a[p] = o[r * L + d]; b[p] = d_o[r * L + d]; } }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    int64_t r = r0 + p * R;
    if (kZero && r < rows) { zero[(r * L + d) * 2] = make_float4(0,0,0,0); zero[(r * L + d) * 2 + 1] = make_float4(0,0,0,0); }
    float s = dot8(a[p], b[p]);
#pragma unroll
    for (int x = L / 2; x > 0; x /= 2) s += __shfl_xor_sync(~0u, s, x);
    if (d == 0 && r < rows) { int h = int(r % H), i = int(r / H % S), bb = int(r / H / S); delta[(int64_t(bb) * H + h) * S + i] = s; }
  }
}
template <int D, int T, int P, bool kZero>
__global__ void __launch_bounds__(T) strided(const int4* o, const int4* d_o, float* delta, float4* zero, int64_t rows) {
  constexpr int L = D / 8, R = T / L;
  const int d = threadIdx.x % L;
  for (int64_t base = int64_t(blockIdx.x) * R * P; base < rows; base += int64_t(gridDim.x) * R * P) {
    const int64_t r0 = base + threadIdx.x / L;
    int4 a[P], b[P];
#pragma unroll
    for (int p = 0; p < P; ++p) { int64_t r = r0 + p * R; a[p] = b[p] = make_int4(0,0,0,0); if (r < rows) { a[p] = o[r * L + d]; b[p] = d_o[r * L + d]; } }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      int64_t r = r0 + p * R;
      if (kZero && r < rows) { zero[(r * L + d) * 2] = make_float4(0,0,0,0); zero[(r * L + d) * 2 + 1] = make_float4(0,0,0,0); }
      float s = dot8(a[p], b[p]);
#pragma unroll
      for (int x = L / 2; x > 0; x /= 2) s += __shfl_xor_sync(~0u, s, x);
      if (d == 0 && r < rows) { int h = int(r % H), i = int(r / H % S), bb = int(r / H / S); delta[(int64_t(bb) * H + h) * S + i] = s; }
    }
  }
}
template <typename F>
float timeit(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; ++i) f();
  cudaEventRecord(a); for (int i = 0; i < 50; ++i) f(); cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b); return ms * 1000.f / 50;
}
template <int D>
int run() {
  const int64_t rows = int64_t(B) * S * H * (128 / D) ;  // H*D constant = 2048 at H=16 for D=128
  const size_t bytes = size_t(rows) * D * 2;
  int4 *o, *d_o; float *delta; float4* zero;
  CK(cudaMalloc(&o, bytes)); CK(cudaMalloc(&d_o, bytes)); CK(cudaMalloc(&delta, rows * 4)); CK(cudaMalloc(&zero, rows * D * 4));
  cudaMemset(o, 0, bytes); cudaMemset(d_o, 0, bytes);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  auto gb = [&](float us, bool z) { return (2.0 * bytes + (z ? rows * D * 4.0 : 0)) / us / 1e3; };
#define BL(T, P, Z) { constexpr int R = T / (D / 8) * P; float us = timeit([&] { blocked<D, T, P, Z><<<unsigned((rows + R - 1) / R), T>>>(o, d_o, delta, zero, rows); }); printf("D%d blocked  T=%d P=%d zero=%d: %6.1f us %6.0f GB/s\n", D, T, P, Z, us, gb(us, Z)); }
#define ST(T, P, Z, K) { float us = timeit([&] { strided<D, T, P, Z><<<sms * K, T>>>(o, d_o, delta, zero, rows); }); printf("D%d strided T=%d P=%d zero=%d grid=%dxSM: %6.1f us %6.0f GB/s\n", D, T, P, Z, K, us, gb(us, Z)); }
  BL(256, 4, false) BL(256, 2, false) BL(256, 8, false) BL(128, 4, false) BL(512, 4, false)
  ST(256, 4, false, 4) ST(256, 4, false, 8) ST(256, 2, false, 8) ST(512, 4, false, 4)
  BL(256, 4, true) ST(256, 4, true, 8)
  { float us = timeit([&] { cudaMemsetAsync(zero, 0, rows * D * 4); }); printf("D%d memset of the dQ sum: %6.1f us %6.0f GB/s\n", D, us, rows * D * 4.0 / us / 1e3); }
  cudaFree(o); cudaFree(d_o); cudaFree(delta); cudaFree(zero);
  return 0;
}
int main() { return run<64>() | run<128>() | run<256>(); }
