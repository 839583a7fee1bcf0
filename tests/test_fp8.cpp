// The FP8 forward: e4m3 q, k and v with per-(batch, K/V head) dequantization scales, bf16 out.
// CPU tests (the e4m3 conversions, validation, dispatch) always run; the GPU cases check the
// production forward against the fp64 reference on the dequantized inputs.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "fake_problem.h"
#include "device_copy.h"
#include "gpu_env.h"
#include "hattn/hattn.h"
#include "hattn/reference.h"
#include "common/exp2_fma.cuh"

namespace hattn {
namespace {

using testing::Device;

using ref::bits_to_float;
using ref::float_to_bits;

TEST(E4m3, KnownValues) {
  EXPECT_EQ(float_to_bits(1.0f, DType::e4m3), 0x38);
  EXPECT_EQ(float_to_bits(-2.0f, DType::e4m3), 0xC0);
  EXPECT_EQ(float_to_bits(448.0f, DType::e4m3), 0x7E);
  EXPECT_EQ(float_to_bits(1e6f, DType::e4m3), 0x7E);  // saturated, as cvt.rn.satfinite
  EXPECT_EQ(float_to_bits(-1e6f, DType::e4m3), 0xFE);
  EXPECT_EQ(float_to_bits(0x1p-9f, DType::e4m3), 0x01);  // the smallest subnormal
  EXPECT_EQ(float_to_bits(0x1p-11f, DType::e4m3), 0x00);  // below half of it
  EXPECT_EQ(float_to_bits(1.0625f, DType::e4m3), 0x38);  // a tie goes to the even mantissa
  EXPECT_EQ(float_to_bits(1.1875f, DType::e4m3), 0x3A);
  EXPECT_EQ(bits_to_float(0x7E, DType::e4m3), 448.0f);
  EXPECT_EQ(bits_to_float(0x08, DType::e4m3), 0x1p-6f);  // the smallest normal
  EXPECT_TRUE(std::isnan(bits_to_float(0x7F, DType::e4m3)));
  EXPECT_TRUE(std::isnan(bits_to_float(0xFF, DType::e4m3)));
  EXPECT_EQ(float_to_bits(std::numeric_limits<float>::quiet_NaN(), DType::e4m3) & 0x7F, 0x7F);
}

TEST(E4m3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    const float x = bits_to_float(uint16_t(code), DType::e4m3);
    EXPECT_EQ(float_to_bits(x, DType::e4m3), code == 0x80 ? 0x80 : code) << "code " << code << " = " << x;
  }
}

TEST(E4m3, RoundsToTheNearestCode) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-500.f, 500.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = i % 2 ? dist(rng) : dist(rng) / 4096;
    const float got = bits_to_float(float_to_bits(x, DType::e4m3), DType::e4m3);
    float best = std::numeric_limits<float>::infinity();  // distance to the nearest finite code
    for (int code = 0; code < 256; ++code)
      if ((code & 0x7F) != 0x7F) best = std::min(best, std::fabs(bits_to_float(uint16_t(code), DType::e4m3) - x));
    if (std::fabs(x) <= 448.f) EXPECT_EQ(std::fabs(got - x), best) << x;
  }
}

TEST(Exp2Fma, WithinItsBoundAndZeroBelowTheRange) {
  double worst = 0;
  for (int i = -1260000; i <= 1270000; i += 7) {  // x in [-126, 127]
    const float x = float(i) / 10000;
    worst = std::max(worst, std::fabs(double(exp2_fma(x)) / std::exp2(double(x)) - 1));
  }
  EXPECT_LT(worst, 2e-4);
  EXPECT_EQ(exp2_fma(-126.5f), 0.f);
  EXPECT_EQ(exp2_fma(-1000.f), 0.f);
  EXPECT_EQ(exp2_fma(-std::numeric_limits<float>::infinity()), 0.f);
  EXPECT_NEAR(exp2_fma(8.f), 256.f, 256 * 2e-4);  // the FP8 path's largest, 2^8 P at the row max
}

TEST(E4m3, OutputDtype) {
  EXPECT_EQ(output_dtype(DType::e4m3), DType::bf16);
  EXPECT_EQ(output_dtype(DType::fp16), DType::fp16);
  EXPECT_EQ(dtype_size(DType::e4m3), 1);
  EXPECT_STREQ(dtype_name(DType::e4m3), "e4m3");
}

using testing::fake_ptr;

// The validation tests' problem with e4m3 inputs and a q_descale (out stays bf16).
AttentionProblem fp8_problem() {
  AttentionProblem p = testing::valid_problem();
  p.dtype = DType::e4m3;
  p.q_descale = static_cast<const float*>(fake_ptr(5));
  return p;
}

// Strides of the validation problem's q or out ([100, 8, 128]) with `pad` elements after each head.
Strides heads_padded_by(int pad) {
  Strides s;
  s.head = 128 + pad;
  s.seq = 8 * s.head;
  s.batch = 100 * s.seq;
  return s;
}

void expect_status(const Status& s, StatusCode code, const std::string& start) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(start), std::string::npos) << "message should mention '" << start << "': " << s.message();
}

TEST(Fp8Validation, ValidProblemPassesAndGoesToTheFinalKernel) {
  const AttentionProblem p = fp8_problem();
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  std::string name;
  ASSERT_TRUE(resolve_kernel(p, "auto", &name).ok());
  EXPECT_EQ(name, "fwd_sm90");
  expect_status(resolve_kernel(p, "15_three_consumers", &name), StatusCode::not_supported, "e4m3");
}

TEST(Fp8Validation, DescalesOnlyWithE4m3) {
  AttentionProblem p = fp8_problem();
  p.dtype = DType::bf16;
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "q_descale:");
  p = fp8_problem();
  p.v_descale = reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(fake_ptr(6)) + 2);
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "v_descale:");
}

TEST(Fp8Validation, StridesAreSixteenByteMultiplesOfBytes) {
  AttentionProblem p = fp8_problem();
  p.k_strides.seq = 2 * 128 + 8;  // 264 bytes: not a 16-byte multiple for e4m3
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "k: seq stride 264");
  p = fp8_problem();
  p.q_strides = heads_padded_by(16);  // fine for e4m3 (16 bytes), checked as e4m3 elements
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  p = fp8_problem();
  p.out_strides = heads_padded_by(8);  // out is bf16: 8 elements are 16 bytes
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
}

TEST(Fp8Dispatch, RefusesWhatTheFinalKernelDoesNotRunInFp8) {
  std::string name;
  AttentionProblem p = fp8_problem();
  p.window_left = 16;
  expect_status(resolve_kernel(p, "auto", &name), StatusCode::not_supported, "dense batches only");
  p = fp8_problem();
  p.seqlens_k = reinterpret_cast<const int32_t*>(fake_ptr(7));
  expect_status(resolve_kernel(p, "auto", &name), StatusCode::not_supported, "dense batches only");
  p = fp8_problem();
  p.seqlen_k = (1 << 30) + 1;
  p.k_strides = p.v_strides = contiguous_bshd(p.seqlen_k, p.heads_kv, p.head_dim);
  expect_status(resolve_kernel(p, "auto", &name), StatusCode::not_supported, "seqlen_k up to 2^30");
}

// The backward of `forward`, over fake gradient pointers.
BackwardProblem backward_of(const AttentionProblem& forward) {
  BackwardProblem b;
  b.forward = forward;
  b.forward.lse = const_cast<float*>(static_cast<const float*>(fake_ptr(8)));
  b.dout = fake_ptr(9);
  b.dout_strides = b.forward.q_strides;
  b.dq = const_cast<void*>(fake_ptr(10));
  b.dq_strides = b.forward.q_strides;
  b.dk = const_cast<void*>(fake_ptr(11));
  b.dk_strides = b.forward.k_strides;
  b.dv = const_cast<void*>(fake_ptr(12));
  b.dv_strides = b.forward.k_strides;
  return b;
}

TEST(Fp8Dispatch, BackwardRefusesE4m3) {
  std::string name;
  expect_status(resolve_backward_kernel(backward_of(fp8_problem()), "auto", &name), StatusCode::not_supported, "e4m3");
}

// An FP8 KV cache: e4m3 k and v with their descales beside bf16 q (kv_dtype).
AttentionProblem fp8_cache_problem() {
  AttentionProblem p = testing::valid_problem();
  p.kv_dtype = DType::e4m3;
  p.k_descale = static_cast<const float*>(fake_ptr(5));
  p.v_descale = static_cast<const float*>(fake_ptr(6));
  return p;
}

TEST(Fp8CacheValidation, ValidProblemPassesAndGoesToTheProductionForward) {
  AttentionProblem p = fp8_cache_problem();
  EXPECT_TRUE(p.has_fp8_cache());
  EXPECT_EQ(p.kv_type(), DType::e4m3);
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  std::string name;
  ASSERT_TRUE(resolve_kernel(p, "auto", &name).ok());
  EXPECT_EQ(name, "fwd_sm90");
  expect_status(resolve_kernel(p, "15_three_consumers", &name), StatusCode::not_supported, "e4m3 KV cache");
  p.dtype = DType::fp16;  // fp16 queries too
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  p.kv_dtype = DType::fp16;  // the same dtype as q's: a 16-bit cache, and descales are refused
  EXPECT_FALSE(p.has_fp8_cache());
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "k_descale:");
}

TEST(Fp8CacheValidation, KvDtypeIsQsOrAnE4m3CacheBesideSixteenBitQ) {
  AttentionProblem p = fp8_cache_problem();
  p.kv_dtype = DType::fp16;  // beside bf16 q
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "kv_dtype:");
  p.kv_dtype = static_cast<DType>(7);
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "kv_dtype: must be");
  p = fp8_problem();  // e4m3 q with a bf16 cache
  p.kv_dtype = DType::bf16;
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "kv_dtype:");
  p.kv_dtype = DType::e4m3;  // e4m3 throughout: plain FP8 inputs
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  EXPECT_FALSE(p.has_fp8_cache());
}

TEST(Fp8CacheValidation, QDescaleIsRefusedAndStridesAreBytesOfTheCache) {
  AttentionProblem p = fp8_cache_problem();
  p.q_descale = static_cast<const float*>(fake_ptr(7));
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "q_descale: q is bf16");
  p = fp8_cache_problem();
  p.k_strides.seq = 2 * 128 + 8;  // 264 one-byte codes: not a 16-byte multiple
  expect_status(validate_arguments(p), StatusCode::invalid_argument, "k: seq stride 264");
  p = fp8_cache_problem();
  p.q_strides = heads_padded_by(8);  // q stays bf16: 8 elements are 16 bytes
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
}

TEST(Fp8CacheDispatch, RefusesAWindowAndTheBackward) {
  std::string name;
  AttentionProblem p = fp8_cache_problem();
  p.window_left = 16;
  expect_status(resolve_kernel(p, "fwd_sm90", &name), StatusCode::not_supported, "without a sliding window");
  expect_status(resolve_backward_kernel(backward_of(fp8_cache_problem()), "auto", &name), StatusCode::not_supported,
                "FP8 KV cache");
}

// --- GPU -------------------------------------------------------------------------------------

struct Fp8Case {
  int head_dim;
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
  bool causal;
  bool descales;   // random per-(batch, K/V head) scales, else none (1)
  bool padded;     // every stride padded
  bool with_lse;
  bool zero_q_descale = false;  // batch 0, K/V head 0's q_descale is 0: its rows weigh every key they see alike
};

std::string describe(const Fp8Case& c) {
  return "D=" + std::to_string(c.head_dim) + " B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seqlen_q) +
         " Sk=" + std::to_string(c.seqlen_k) + " Hq=" + std::to_string(c.heads_q) +
         " Hkv=" + std::to_string(c.heads_kv) + (c.causal ? " causal" : " full") +
         (c.descales ? " descales" : "") + (c.padded ? " padded" : "") + (c.with_lse ? " lse" : "") +
         (c.zero_q_descale ? " zero-q_descale" : "");
}

// gtest prints a case by this (not as bytes) in its names and failures.
void PrintTo(const Fp8Case& c, std::ostream* os) { *os << describe(c); }

class Fp8Test : public ::testing::TestWithParam<Fp8Case> {};

// Strides of a [B, S, H, D] tensor, padded (32 elements a row, a head, a position) or not.
Strides bshd(int seqlen, int heads, int head_dim, bool padded) {
  if (!padded) return contiguous_bshd(seqlen, heads, head_dim);
  Strides s;
  s.head = head_dim + 32;
  s.seq = int64_t(heads) * s.head + 32;
  s.batch = int64_t(seqlen) * s.seq + 32;
  return s;
}

TEST_P(Fp8Test, MatchesFp64Reference) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const Fp8Case c = GetParam();
  const int D = c.head_dim;
  const Strides qs = bshd(c.seqlen_q, c.heads_q, D, c.padded), ks = bshd(c.seqlen_k, c.heads_kv, D, c.padded);
  const Strides os = bshd(c.seqlen_q, c.heads_q, D, c.padded);
  const size_t q_elems = size_t(c.batch) * qs.batch, kv_elems = size_t(c.batch) * ks.batch;
  const size_t out_elems = size_t(c.batch) * os.batch;
  std::mt19937 rng(uint32_t(c.seqlen_q * 131 + c.seqlen_k));
  std::normal_distribution<float> normal(0.3f, 1.f);
  std::uniform_real_distribution<float> scale_dist(0.25f, 2.f);
  // Codes on the GPU (NaN codes in the padding: nothing may read it); code values times the
  // descale of their (batch, K/V head) on the host.
  std::vector<uint8_t> q(q_elems, 0x7F), k(kv_elems, 0x7F), v(kv_elems, 0x7F);
  std::vector<float> q_host(q_elems), k_host(kv_elems), v_host(kv_elems);
  std::vector<float> descale[3];
  for (auto& d : descale) {
    d.resize(size_t(c.batch) * c.heads_kv);
    for (float& x : d) x = c.descales ? scale_dist(rng) : 1.f;
  }
  if (c.zero_q_descale) descale[0][0] = 0.f;
  const int group = c.heads_q / c.heads_kv;
  auto fill = [&](std::vector<uint8_t>* codes, std::vector<float>* host, const Strides& s, int seqlen, int heads,
                  const std::vector<float>& scales, int head_div, float spread) {  // values: spread x N(0.3, 1)
    for (int b = 0; b < c.batch; ++b)
      for (int i = 0; i < seqlen; ++i)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < D; ++d) {
            const size_t at = size_t(b * s.batch + int64_t(i) * s.seq + h * s.head + d);
            const uint16_t code = float_to_bits(normal(rng) * spread, DType::e4m3);
            (*codes)[at] = uint8_t(code);
            (*host)[at] = bits_to_float(code, DType::e4m3) * scales[size_t(b) * c.heads_kv + h / head_div];
          }
  };
  fill(&q, &q_host, qs, c.seqlen_q, c.heads_q, descale[0], group, 1.f);
  fill(&k, &k_host, ks, c.seqlen_k, c.heads_kv, descale[1], 1, 1.f);
  fill(&v, &v_host, ks, c.seqlen_k, c.heads_kv, descale[2], 1, 4.f);

  Device<uint8_t> q_dev(q), k_dev(k), v_dev(v);
  Device<uint16_t> out_dev(std::vector<uint16_t>(out_elems, 0xFFFF));  // NaN: unwritten rows fail
  Device<float> lse_dev(std::vector<float>(size_t(c.batch) * c.heads_q * c.seqlen_q, NAN));
  Device<float> qd(descale[0]), kd(descale[1]), vd(descale[2]);
  ASSERT_TRUE(q_dev.ptr && k_dev.ptr && v_dev.ptr && out_dev.ptr && lse_dev.ptr && qd.ptr && kd.ptr && vd.ptr);

  AttentionProblem p;
  p.dtype = DType::e4m3;
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = D;
  p.q = q_dev.ptr;
  p.q_strides = qs;
  p.k = k_dev.ptr;
  p.k_strides = ks;
  p.v = v_dev.ptr;
  p.v_strides = ks;
  p.out = out_dev.ptr;
  p.out_strides = os;
  p.lse = c.with_lse ? lse_dev.ptr : nullptr;
  p.causal = c.causal;
  if (c.descales) {
    p.q_descale = qd.ptr;
    p.k_descale = kd.ptr;
    p.v_descale = vd.ptr;
  }
  Status s = forward(p);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(out_elems);
  std::vector<float> lse(size_t(c.batch) * c.heads_q * c.seqlen_q);
  cudaMemcpy(out.data(), out_dev.ptr, out.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(lse.data(), lse_dev.ptr, lse.size() * 4, cudaMemcpyDeviceToHost);

  ref::HostProblem host;
  host.batch = c.batch;
  host.seqlen_q = c.seqlen_q;
  host.seqlen_k = c.seqlen_k;
  host.heads_q = c.heads_q;
  host.heads_kv = c.heads_kv;
  host.head_dim = D;
  host.q = q_host.data();
  host.q_strides = qs;
  host.k = k_host.data();
  host.k_strides = ks;
  host.v = v_host.data();
  host.v_strides = ks;
  host.scale = 1.f / std::sqrt(float(D));
  host.causal = c.causal;
  // Every output element (padding untouched) against fp64; the budget is twice the error of a
  // plain implementation that rounds P to e4m3 (fp32 scores and sums) and out to bf16.
  double max_err = 0, lowp_err = 0, lse_err = 0, lowp_lse_err = 0;
  int64_t nan_out = 0, lse_mismatch = 0, touched_padding = 0;
  std::vector<char> is_out(out_elems, 0);
  std::vector<double> ref_out(D);
  std::vector<float> lowp_out(D);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.heads_q; ++h)
      for (int i = 0; i < c.seqlen_q; ++i) {
        double ref_lse;
        float lowp_lse;
        ref::attention_row_fp64(host, b, h, i, ref_out.data(), &ref_lse);
        ref::attention_row_lowp(host, DType::e4m3, b, h, i, lowp_out.data(), &lowp_lse);
        const size_t base = size_t(b * os.batch + int64_t(i) * os.seq + h * os.head);
        for (int d = 0; d < D; ++d) {
          is_out[base + d] = 1;
          const double got = bits_to_float(out[base + d], DType::bf16);
          if (!std::isfinite(got)) ++nan_out;
          else max_err = std::max(max_err, std::fabs(got - ref_out[d]));
          lowp_err = std::max(lowp_err, std::fabs(double(lowp_out[d]) - ref_out[d]));
        }
        if (!c.with_lse) continue;
        const double got = lse[(size_t(b) * c.heads_q + h) * c.seqlen_q + i];
        if (std::isinf(ref_lse)) {
          if (!(std::isinf(got) && got < 0)) ++lse_mismatch;
        } else if (!std::isfinite(got)) {
          ++lse_mismatch;
        } else {
          lse_err = std::max(lse_err, std::fabs(got - ref_lse));
          lowp_lse_err = std::max(lowp_lse_err, std::fabs(double(lowp_lse) - ref_lse));
        }
      }
  for (size_t e = 0; e < out_elems; ++e)
    if (!is_out[e] && out[e] != 0xFFFF) ++touched_padding;
  // The emulation sums the scores in fp32, the FP8 wgmma with about 14 bits: that term goes into
  // the LSE's budget (the output's budget already covers it: P's rounding to e4m3 dominates).
  const double fp8_score_error = ref::fp8_score_error(host);
  // At D = 256 P V adds into O inside the tensor cores (Config::kPvIntoO).
  const double pv_sum_error = c.head_dim == 256 ? ref::fp8_pv_sum_error(host) : 0.0;
  const double budget = 2 * lowp_err + 1e-3 + pv_sum_error, lse_budget = 2 * lowp_lse_err + 2e-4 + fp8_score_error;
  EXPECT_EQ(nan_out, 0) << describe(c);
  EXPECT_EQ(lse_mismatch, 0) << describe(c);
  EXPECT_EQ(touched_padding, 0) << describe(c);
  EXPECT_LE(max_err, budget) << describe(c) << " (lowp error " << lowp_err << ")";
  EXPECT_LE(lse_err, lse_budget) << describe(c);
  std::printf("[ fp8 ] %s: max_err %.5f budget %.5f (lowp %.5f), lse_err %.2e budget %.2e\n", describe(c).c_str(),
              max_err, budget, lowp_err, lse_err, lse_budget);
}

INSTANTIATE_TEST_SUITE_P(
    FinalKernel, Fp8Test,
    ::testing::Values(Fp8Case{128, 1, 128, 128, 2, 2, false, false, false, true},     // one tile, no scales
                      Fp8Case{128, 2, 200, 333, 4, 2, false, true, false, true},      // tails, GQA, descales
                      Fp8Case{128, 1, 300, 257, 4, 4, true, true, true, true},        // Sq > Sk causal, padded
                      Fp8Case{128, 2, 1000, 1000, 8, 1, true, true, false, false},    // MQA, causal, no lse
                      Fp8Case{128, 1, 77, 1500, 2, 2, false, true, true, true},       // Sq < Sk, long sweep, padded
                      Fp8Case{128, 3, 513, 640, 6, 3, true, false, false, true},      // causal Sq < Sk, odd heads
                      Fp8Case{128, 1, 100, 16384, 2, 2, false, true, false, true},    // 128 tiles summed into O
                      Fp8Case{64, 1, 128, 128, 2, 2, false, false, false, true},      // D = 64: 64-byte swizzle
                      Fp8Case{64, 2, 200, 333, 4, 2, true, true, true, true},         // tails, GQA, causal, padded
                      Fp8Case{64, 1, 300, 257, 4, 4, true, true, false, true},        // Sq > Sk causal
                      Fp8Case{64, 1, 100, 8192, 2, 2, false, true, false, true},      // 64 tiles summed into O
                      Fp8Case{128, 2, 200, 333, 4, 2, true, true, false, true, true},  // a zero descale, masked keys
                      Fp8Case{64, 1, 300, 257, 4, 4, true, true, true, true, true},
                      Fp8Case{256, 1, 128, 128, 2, 2, false, false, false, true},  // D = 256: P V summed in O
                      Fp8Case{256, 2, 200, 333, 4, 2, true, true, true, true},     // tails, GQA, causal, padded
                      Fp8Case{256, 1, 300, 257, 4, 4, true, true, false, true},    // Sq > Sk causal
                      Fp8Case{256, 1, 100, 8192, 2, 2, false, true, false, true},  // 64 tiles summed in O
                      Fp8Case{256, 1, 300, 257, 4, 4, true, true, false, true, true}));

}  // namespace
}  // namespace hattn
