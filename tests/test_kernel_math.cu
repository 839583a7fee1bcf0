// The kernels' special-function helpers on the GPU against fp64: tanh.approx.f32 (softcapping)
// is held to the error measured on the H200, far inside the PTX ISA's promise of 2^-11, so that
// a GPU whose MUFU.TANH errs more fails here instead of moving softcapped scores unseen. And the
// FP8 KV cache's widening of e4m3 codes, code by code and tile by tile.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../tools/harness.h"
#include "gpu_env.h"
#include "attention/kv_dequant.cuh"
#include "common/fragment.cuh"
#include "hattn/reference.h"
#include "ptx/ex2.cuh"
#include "ptx/smem.cuh"

namespace hattn {
namespace {

__global__ void tanh_approx_kernel(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = ptx::tanh_approx_f32(x[i]);
}

TEST(TanhApprox, WithinTheH200sErrorOnTheGpu) {
  if (const std::string why = testing::gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  std::vector<float> x;
  for (int i = -(1 << 21); i <= (1 << 21); ++i) x.push_back(float(i) * (12.f / (1 << 21)));  // [-12, 12]
  for (float v : {20.f, 1e4f, 3e38f, std::numeric_limits<float>::infinity()}) {
    x.push_back(v);
    x.push_back(-v);
  }
  const int n = int(x.size());
  harness::DeviceBuffer dx, dy;  // freed on every path, an early ASSERT's included
  ASSERT_TRUE(dx.allocate(n * sizeof(float)).ok());
  ASSERT_TRUE(dy.allocate(n * sizeof(float)).ok());
  ASSERT_EQ(cudaMemcpy(dx.get(), x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  tanh_approx_kernel<<<(n + 255) / 256, 256>>>(static_cast<const float*>(dx.get()), static_cast<float*>(dy.get()), n);
  std::vector<float> y(n);
  ASSERT_EQ(cudaMemcpy(y.data(), dy.get(), n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  double worst_abs = 0, worst_rel = 0;
  for (int i = 0; i < n; ++i) {
    const double exact = std::tanh(double(x[i]));
    const double err = std::fabs(double(y[i]) - exact);
    ASSERT_FALSE(std::isnan(y[i])) << "tanh.approx(" << x[i] << ") is NaN";
    worst_abs = std::max(worst_abs, err);
    if (exact != 0) worst_rel = std::max(worst_rel, err / std::fabs(exact));
  }
  EXPECT_LT(worst_abs, 1e-5);  // measured: 7.9e-6 (results/evidence/softcap/tanh_approx/)
  EXPECT_LT(worst_rel, 1.2e-5);  // measured: 9.9e-6
}

// e4m3 codes widened to fp16 as the FP8 KV cache does (kv_dequant.cuh): `words` holds 4 codes
// each; out gets their fp16 values, 2 per register.
__global__ void widen_e4m3_kernel(const uint32_t* words, uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint4 wide = fwd::widen8(make_uint2(words[i], 0u));
  out[2 * i + 0] = wide.x;
  out[2 * i + 1] = wide.y;
}

// Every e4m3 code, widened on the GPU to fp16, is its exact value (-0 too; NaN codes NaN);
// subnormal codes included.
TEST(WidenE4m3, EveryCodeExactlyOnTheGpu) {
  if (const std::string why = testing::gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  std::vector<uint32_t> words(64);
  for (int i = 0; i < 64; ++i) words[i] = uint32_t(4 * i) | uint32_t(4 * i + 1) << 8 | uint32_t(4 * i + 2) << 16 | uint32_t(4 * i + 3) << 24;
  harness::DeviceBuffer d_words, d_out;
  ASSERT_TRUE(d_words.allocate(words.size() * 4).ok());
  ASSERT_TRUE(d_out.allocate(words.size() * 8).ok());
  ASSERT_EQ(cudaMemcpy(d_words.get(), words.data(), words.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  widen_e4m3_kernel<<<1, 64>>>(static_cast<const uint32_t*>(d_words.get()), static_cast<uint32_t*>(d_out.get()), 64);
  std::vector<uint32_t> got(words.size() * 2);
  ASSERT_EQ(cudaMemcpy(got.data(), d_out.get(), got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int code = 0; code < 256; ++code) {
    const int word = code / 4, k = code % 4;  // code k of its word: register k / 2, half k % 2
    const float wide = ref::bits_to_float(uint16_t(got[2 * word + k / 2] >> (16 * (k % 2))), DType::fp16);
    const float want = ref::bits_to_float(uint16_t(code), DType::e4m3);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(wide)) << "code " << code;
      continue;
    }
    EXPECT_EQ(wide, want) << "code " << code;
    EXPECT_EQ(std::signbit(wide), std::signbit(want)) << "code " << code;  // -0 too
  }
}

// One staging tile of `codes` widened as the FP8 KV cache does (kv_dequant.cuh) by kThreads
// threads (the widening warps' 96, or 224 with consumer 1's four warps), into an
// fp16 tile first filled with 0xFFFF (NaN), which `out` receives.
template <typename Cfg, int kThreads>
__global__ void widen_tile_kernel(const uint8_t* codes, uint16_t* out, int valid) {
  constexpr int kCodes = Cfg::kBlockN * Cfg::kHeadDim;  // a multiple of 1024
  extern __shared__ unsigned char smem_raw[];
  unsigned char* staged = ptx::align_shared<1024>(smem_raw);
  auto* wide = reinterpret_cast<uint16_t*>(staged + kCodes);
  for (int i = threadIdx.x; i < kCodes; i += blockDim.x) {
    staged[i] = codes[i];
    wide[i] = 0xFFFF;
  }
  __syncthreads();  // the tiles written, before the widening reads and overwrites them
  fwd::dequantize_tile<Cfg, kThreads>(ptx::cvta_to_shared_u32(staged), ptx::cvta_to_shared_u32(wide), valid,
                                         int(threadIdx.x));
  __syncthreads();  // the widening done, before the copy out
  for (int i = threadIdx.x; i < kCodes; i += blockDim.x) out[i] = wide[i];
}

template <int D, int kThreads>
void check_widened_tile() {
  using Cfg = fwd::ConfigOf<__half, D, false, 2, true>;
  constexpr int kRows = Cfg::kBlockN, kCodes = kRows * D;
  std::mt19937 rng(D);
  std::vector<uint8_t> codes(kCodes);
  for (uint8_t& c : codes) c = uint8_t(rng());  // every code, NaN ones too
  harness::DeviceBuffer d_codes, d_out;
  ASSERT_TRUE(d_codes.allocate(kCodes).ok());
  ASSERT_TRUE(d_out.allocate(kCodes * 2).ok());
  ASSERT_EQ(cudaMemcpy(d_codes.get(), codes.data(), kCodes, cudaMemcpyHostToDevice), cudaSuccess);
  const int smem = 3 * kCodes + 1024;
  const auto kernel = widen_tile_kernel<Cfg, kThreads>;
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), cudaSuccess);
  for (const int valid : {kRows, kRows - 37, 1, 0, -5}) {  // whole, part, one key, none (and a negative count)
    kernel<<<1, kThreads, smem>>>(static_cast<const uint8_t*>(d_codes.get()), static_cast<uint16_t*>(d_out.get()),
                                   valid);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> tile(kCodes);
    ASSERT_EQ(cudaMemcpy(tile.data(), d_out.get(), kCodes * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    int wrong = 0;
    for (int row = 0; row < kRows; ++row) {
      for (int col = 0; col < D; ++col) {
        // TMA's 128-byte swizzle of [D / 64][kRows][64]: 8-column chunk j of a row at j ^ row % 8.
        const int at = (col / 64) * kRows * 64 + row * 64 + ((col % 64 / 8) ^ (row % 8)) * 8 + col % 8;
        const float want = row < valid ? ref::bits_to_float(codes[row * D + col], DType::e4m3) : 0.f;
        const float got = ref::bits_to_float(tile[at], DType::fp16);
        const bool same = std::isnan(want) ? std::isnan(got) : got == want && std::signbit(got) == std::signbit(want);
        if (!same && ++wrong <= 5)
          ADD_FAILURE() << "D " << D << " threads " << kThreads << " valid " << valid << ": row "
                        << row << " col " << col << " got " << got << ", want " << want;
      }
    }
    EXPECT_EQ(wrong, 0) << "D " << D << " threads " << kThreads << " valid " << valid;
  }
}

// The widening writes the 16-bit tile TMA would have: every code exactly at its swizzled place,
// the rows past `valid` zero, nothing left unwritten; by the widening warps alone and with
// consumer 1's (224 threads).
TEST(WidenE4m3, TileAsTmaWouldOnTheGpu) {
  if (const std::string why = testing::gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  constexpr int kAlone = fwd::kDequantWarps * 32, kHelped = (fwd::kDequantWarps + fwd::kHelperWarps) * 32;
  check_widened_tile<64, kAlone>();
  check_widened_tile<128, kAlone>();
  check_widened_tile<256, kAlone>();
  check_widened_tile<64, kHelped>();
  check_widened_tile<128, kHelped>();
  check_widened_tile<256, kHelped>();
}

}  // namespace
}  // namespace hattn
