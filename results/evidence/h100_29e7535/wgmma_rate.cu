// How fast the tensor cores take MLA's products, alone and side by side, on every SM at once
// (one CTA per SM, 227 KB of shared memory each): S-like chains of m64n64k16 with A and B from
// shared memory (36 k-steps over nine 64-column boxes, as MLA's S = Q K^T), the same at n128,
// and PV-like m64n256k16 with A from registers or from shared memory (V read N-major).
// nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Isrc -Isrc/common -o wgmma_rate wgmma_rate.cu
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "ptx/wgmma.cuh"
#include "ptx/smem.cuh"

using namespace hattn;
using T = __nv_bfloat16;
constexpr int kSmem = 220 * 1024;

enum Mode : int { kNone = 0, kS64 = 1, kS128 = 2, kPvRs = 3, kPvSs = 4 };

__device__ __forceinline__ uint64_t opaque(uint64_t d) { asm volatile("" : "+l"(d)); return d; }

template <int mode>
__device__ __forceinline__ long long run(unsigned char* smem, int reps, float* sink) {
  // Q-like A: 72 KB at 0 (nine 8 KB boxes of 64 rows); B: from 72 KB on.
  const uint64_t a0 = ptx::make_smem_desc_sw128(smem, 16, 1024);
  const uint64_t b0 = ptx::make_smem_desc_sw128(smem + 73728, 16, 1024);
  const uint64_t v0 = ptx::make_smem_desc_sw128(smem + 73728, 8192, 1024);  // N-major, boxes 8 KB apart
  long long t0 = clock64();
  if constexpr (mode == kS64 || mode == kS128) {
    constexpr int N = mode == kS64 ? 64 : 128;
    constexpr int kBox = N * 128;  // B's box: N rows x 128 bytes
    float acc[N / 2];
    for (int r = 0; r < reps; ++r) {
      const uint64_t a = opaque(a0), b = opaque(b0);
      ptx::wgmma_fence();
#pragma unroll
      for (int box = 0; box < 9; ++box)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          ptx::WgmmaM64K16<T, N>::template ss<0>(acc, ptx::advance_smem_desc(a, box * 8192 + k * 32),
                                                  ptx::advance_smem_desc(b, box * kBox + k * 32), box > 0 || k > 0);
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[i]);
    }
    float s = 0;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s += acc[i];
    if (s == 12345.f) *sink = s;
  } else if constexpr (mode == kPvRs || mode == kPvSs) {
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t frag[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) frag[kk][i] = 0x3c003c00u ^ (threadIdx.x * (kk + i));
    for (int r = 0; r < reps; ++r) {
      const uint64_t v = opaque(v0), a = opaque(a0);
      ptx::wgmma_fence();
#pragma unroll
      for (int t = 0; t < 4; ++t)  // four 64-key tiles' worth: 16 k-steps
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          if constexpr (mode == kPvRs)
            ptx::WgmmaM64K16<T, 256>::template rs<1>(acc, frag[kk], ptx::advance_smem_desc(v, (t % 2) * 73728 / 2 + kk * 2048), 1);
          else
            ptx::WgmmaM64K16<T, 256>::template ss<1>(acc, ptx::advance_smem_desc(a, kk * 32),
                                                      ptx::advance_smem_desc(v, (t % 2) * 73728 / 2 + kk * 2048), 1);
        }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) ptx::fence_operand(acc[i]);
    }
    float s = 0;
#pragma unroll
    for (int i = 0; i < 128; ++i) s += acc[i];
    if (s == 12345.f) *sink = s;
  }
  return clock64() - t0;
}

template <int mode0, int mode1>
__global__ void __launch_bounds__(256, 1) rate_kernel(int reps, float* sink, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  for (int i = threadIdx.x; i < 200 * 1024 / 16; i += 256) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x3c003c00u, i, 0x3c003c00u, 0);
  __syncthreads();
  const int wg = threadIdx.x / 128;
  long long c = 0;
  if (wg == 0) c = run<mode0>(smem, reps, sink);
  else c = run<mode1>(smem, reps, sink);
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + wg] = c;
}

double flops_of(int mode, int reps) {
  switch (mode) {
    case kS64: return 2.0 * 64 * 64 * 16 * 36 * reps;
    case kS128: return 2.0 * 64 * 128 * 16 * 36 * reps;
    case kPvRs: case kPvSs: return 2.0 * 64 * 256 * 16 * 16 * reps;
  }
  return 0;
}
const char* name_of(int mode) {
  switch (mode) { case kS64: return "S n64 ss"; case kS128: return "S n128 ss"; case kPvRs: return "PV n256 rs"; case kPvSs: return "PV n256 ss"; }
  return "-";
}

template <int m0, int m1>
void measure(int sms, float* sink, long long* cycles, int reps0, int reps1) {
  auto k = rate_kernel<m0, m1>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  k<<<sms, 256, kSmem>>>(2, sink, cycles);  // warm
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  // reps: wg 0 runs reps0, wg 1 reps1 (a kernel template can't take two; both use reps0 scaled below)
  cudaEventRecord(a);
  k<<<sms, 256, kSmem>>>(reps0, sink, cycles);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0; cudaEventElapsedTime(&ms, a, b);
  static long long host[2 * 1024];
  cudaMemcpy(host, cycles, sizeof(long long) * 2 * sms, cudaMemcpyDeviceToHost);
  double c0 = 0, c1 = 0;
  for (int i = 0; i < sms; ++i) { c0 += host[2 * i]; c1 += host[2 * i + 1]; }
  c0 /= sms; c1 /= sms;
  const double f = (flops_of(m0, reps0) + flops_of(m1, reps0)) * sms;
  const double per_clk = (flops_of(m0, reps0) + flops_of(m1, reps0)) / (c0 > c1 ? c0 : c1);
  printf("%-12s + %-12s  %7.1f TFLOP/s  %6.0f FLOP/clk/SM (%.0f%% of 4096)  clock ~%.0f MHz  wg cycles %.0f / %.0f\n",
         name_of(m0), name_of(m1), f / ms / 1e9, per_clk, 100 * per_clk / 4096, (c0 > c1 ? c0 : c1) / (ms * 1e3), c0, c1);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
}

int main() {
  int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink; long long* cycles;
  cudaMalloc(&sink, 4); cudaMalloc(&cycles, sizeof(long long) * 2 * sms);
  const int reps = 4000;
  measure<kS64, kNone>(sms, sink, cycles, reps, reps);
  measure<kS64, kS64>(sms, sink, cycles, reps, reps);
  measure<kS128, kNone>(sms, sink, cycles, reps / 2, reps / 2);
  measure<kS128, kS128>(sms, sink, cycles, reps / 2, reps / 2);
  measure<kPvRs, kNone>(sms, sink, cycles, reps, reps);
  measure<kPvRs, kPvRs>(sms, sink, cycles, reps, reps);
  measure<kPvSs, kNone>(sms, sink, cycles, reps, reps);
  measure<kPvSs, kPvSs>(sms, sink, cycles, reps, reps);
  measure<kS64, kPvRs>(sms, sink, cycles, reps, reps);
  measure<kS64, kPvSs>(sms, sink, cycles, reps, reps);
  return 0;
}
