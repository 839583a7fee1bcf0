// mla_decode() from C++: argument checks (CPU), what the schedule calls check, one batch of
// requests (an empty one, one shorter than a page, one over several shuffled pages) against an
// fp64 host loop with the schedule made in the call and made once beforehand, and the checking
// mode's broken promises (GPU). The Python suite (python/tests/test_mla.py) covers the shapes
// more widely.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "device_copy.h"
#include "gpu_env.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

using testing::Device;

constexpr int kQk = kMlaHeadDimQk, kV = kMlaHeadDimV;

template <typename T = void>
T* fake(uintptr_t address) {  // validation never dereferences pointers
  return reinterpret_cast<T*>(address);
}

// Two requests of one token and 16 heads over a cache of 8 pages of 64 rows.
MlaDecodeProblem valid_problem() {
  MlaDecodeProblem p;
  p.batch = 2;
  p.seqlen_q = 1;
  p.heads_q = 16;
  p.q = fake(0x10000);
  p.q_strides = contiguous_bshd(1, 16, kQk);
  p.kv_cache = fake(0x100000);
  p.num_pages = 8;
  p.page_size = 64;
  p.block_table = fake<const int32_t>(0x20000);
  p.max_pages_per_seq = 4;
  p.cache_seqlens = fake<const int32_t>(0x30000);
  p.out = fake(0x40000);
  p.out_strides = contiguous_bshd(1, 16, kV);
  return p;
}

void expect_invalid(const MlaDecodeProblem& p, const std::string& argument) {
  const Status s = validate_mla_arguments(p);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << "should start with '" << argument << ":': " << s.message();
  EXPECT_EQ(mla_decode(p).code(), StatusCode::invalid_argument);  // refused before the device is touched
  EXPECT_EQ(check_mla_promises(p).code(), StatusCode::invalid_argument);
}

TEST(MlaValidation, ValidProblemPasses) { EXPECT_TRUE(validate_mla_arguments(valid_problem()).ok()); }

TEST(MlaValidation, EachBadArgumentIsNamed) {
  auto p = valid_problem();
  p.dtype = DType::e4m3;
  expect_invalid(p, "dtype");
  p = valid_problem();
  p.heads_q = 0;
  expect_invalid(p, "heads_q");
  p = valid_problem();
  p.cache_seqlens = nullptr;
  expect_invalid(p, "cache_seqlens");
  p = valid_problem();
  p.q_strides.head = kQk + 1;
  expect_invalid(p, "q");
  p = valid_problem();
  p.page_size = 96;
  expect_invalid(p, "page_size");
  p = valid_problem();
  p.row_stride = 512;
  expect_invalid(p, "kv_cache");
  p = valid_problem();
  p.out = const_cast<void*>(p.q);
  expect_invalid(p, "out");
  p = valid_problem();
  p.softmax_scale = -1.f;
  expect_invalid(p, "softmax_scale");
}

// The schedule reads only the request count, the rows and the lengths: a problem with nothing
// else passes its checks (and then needs a GPU), and a missing length array is named.
TEST(MlaValidation, ScheduleChecksOnlyWhatItReads) {
  MlaDecodeProblem p;
  p.batch = 3;
  p.seqlen_q = 2;
  p.heads_q = 16;
  p.cache_seqlens = fake<const int32_t>(0x30000);
  size_t ints = 0;
  const Status s = mla_schedule_ints(p, &ints);
  if (testing::gpu_skip_reason().empty()) {
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_GT(ints, size_t(3));
  } else {
    EXPECT_NE(s.code(), StatusCode::invalid_argument) << s.to_string();
  }
  p.cache_seqlens = nullptr;
  EXPECT_EQ(mla_schedule_ints(p, &ints).code(), StatusCode::invalid_argument);
}

// --- GPU: against an fp64 host loop ------------------------------------------------------------

TEST(MlaGpu, MatchesHostLoop) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  constexpr int kHeads = 16, kTokens = 2, kPage = 64;
  const std::vector<int32_t> lens = {0, 37, 700};  // empty, within a page, 11 pages
  const int batch = int(lens.size()), pages_per_seq = 11, num_pages = batch * pages_per_seq + 2;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;

  // Pages shuffled through the cache; rows no request uses hold NaN, which must not reach out.
  std::vector<int32_t> order(num_pages), table(size_t(batch) * pages_per_seq);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i = 0; i < table.size(); ++i) table[i] = order[i];
  std::vector<__nv_bfloat16> cache(size_t(num_pages) * kPage * kQk, __float2bfloat16(NAN));
  auto row_of = [&](int b, int j) { return (size_t(table[size_t(b) * pages_per_seq + j / kPage]) * kPage + j % kPage) * kQk; };
  for (int b = 0; b < batch; ++b)
    for (int j = 0; j < lens[b]; ++j)
      for (int f = 0; f < kQk; ++f) cache[row_of(b, j) + f] = __float2bfloat16(normal(rng));
  std::vector<__nv_bfloat16> q(size_t(batch) * kTokens * kHeads * kQk);
  for (auto& x : q) x = __float2bfloat16(normal(rng));
  const size_t out_elems = size_t(batch) * kTokens * kHeads * kV, lse_elems = size_t(batch) * kHeads * kTokens;

  Device<__nv_bfloat16> d_q(q), d_cache(cache), d_out{std::vector<__nv_bfloat16>(out_elems)};
  Device<int32_t> d_table(table), d_lens(lens);
  Device<float> d_lse{std::vector<float>(lse_elems)};
  MlaDecodeProblem p;
  p.batch = batch;
  p.seqlen_q = kTokens;
  p.heads_q = kHeads;
  p.q = d_q.ptr;
  p.q_strides = contiguous_bshd(kTokens, kHeads, kQk);
  p.kv_cache = d_cache.ptr;
  p.num_pages = num_pages;
  p.page_size = kPage;
  p.block_table = d_table.ptr;
  p.max_pages_per_seq = pages_per_seq;
  p.cache_seqlens = d_lens.ptr;
  p.out = d_out.ptr;
  p.out_strides = contiguous_bshd(kTokens, kHeads, kV);
  p.lse = d_lse.ptr;
  p.causal = true;

  // The host loop: token s of request b sees keys j <= len - kTokens + s.
  const double scale = 1.0 / std::sqrt(double(kQk));
  std::vector<double> want(out_elems, 0.0), want_lse(lse_elems, -INFINITY);
  double largest = 0;
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < kTokens; ++s)
      for (int h = 0; h < kHeads; ++h) {
        const int visible = std::max(0, lens[b] - kTokens + s + 1);
        if (visible == 0) continue;
        const __nv_bfloat16* qr = &q[((size_t(b) * kTokens + s) * kHeads + h) * kQk];
        std::vector<double> score(visible);
        double max_score = -INFINITY, sum = 0;
        for (int j = 0; j < visible; ++j) {
          double dot = 0;
          for (int f = 0; f < kQk; ++f) dot += double(__bfloat162float(qr[f])) * __bfloat162float(cache[row_of(b, j) + f]);
          score[j] = dot * scale;
          max_score = std::max(max_score, score[j]);
        }
        for (double& x : score) sum += (x = std::exp(x - max_score));
        double* o = &want[((size_t(b) * kTokens + s) * kHeads + h) * kV];
        for (int j = 0; j < visible; ++j)
          for (int f = 0; f < kV; ++f) o[f] += score[j] / sum * __bfloat162float(cache[row_of(b, j) + f]);
        for (int f = 0; f < kV; ++f) largest = std::max(largest, std::fabs(o[f]));
        want_lse[(size_t(b) * kHeads + h) * kTokens + s] = max_score + std::log(sum);
      }

  // Once with the schedule made in the call, once with one made beforehand (as a decoding step
  // makes it for all its layers): both must match the host loop.
  size_t ints = 0;
  ASSERT_TRUE(mla_schedule_ints(p, &ints).ok());
  Device<int32_t> d_schedule{std::vector<int32_t>(ints)};
  for (const bool given : {false, true}) {
    SCOPED_TRACE(given ? "schedule given" : "schedule made in the call");
    if (given) {
      ASSERT_TRUE(mla_schedule(p, d_schedule.ptr).ok());
      p.schedule = d_schedule.ptr;
    }
    const Status s = mla_decode(p);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = d_out.read(out_elems);
    const auto got_lse = d_lse.read(lse_elems);
    int bad = 0;
    const double tolerance = std::ldexp(largest, -6);  // a few bf16 roundings of the largest output
    for (size_t i = 0; i < out_elems; ++i) {
      const double g = __bfloat162float(got[i]);
      if (!(std::fabs(g - want[i]) <= tolerance) && ++bad <= 5)
        ADD_FAILURE() << "out[" << i << "]: got " << g << ", want " << want[i];
    }
    for (size_t i = 0; i < lse_elems; ++i) {
      const double g = got_lse[i];
      const bool ok = std::isinf(want_lse[i]) ? std::isinf(g) && g < 0 : std::fabs(g - want_lse[i]) <= 1e-2;
      if (!ok && ++bad <= 10) ADD_FAILURE() << "lse[" << i << "]: got " << g << ", want " << want_lse[i];
    }
    EXPECT_EQ(bad, 0);
  }
}

// The checking mode: a length past a request's pages and a page outside the cache, each named;
// pages no request reads may hold anything.
TEST(MlaGpu, CheckingModeNamesBrokenPromises) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  MlaDecodeProblem p = valid_problem();  // its fake tensors replaced by real ones
  std::vector<__nv_bfloat16> zeros(size_t(8) * 64 * kQk), q(size_t(2) * 16 * kQk), out(size_t(2) * 16 * kV);
  Device<__nv_bfloat16> d_cache(zeros), d_q(q), d_out(out);
  p.kv_cache = d_cache.ptr;
  p.q = d_q.ptr;
  p.out = d_out.ptr;
  struct Case {
    std::vector<int32_t> lens, table;  // table: 2 x 4
    const char* argument;              // empty: the promises are kept
  };
  const std::vector<Case> cases = {
      {{100, 0}, {3, 5, -1, -1, -1, -1, -1, -1}, ""},  // request 1 reads no page
      {{257, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, "cache_seqlens: entry 0 is 257"},
      {{-1, 0}, {0, 1, 2, 3, 4, 5, 6, 7}, "cache_seqlens: entry 0 is -1"},
      {{100, 10}, {3, 8, 0, 0, 1, 1, 1, 1}, "block_table: entry (0, 1) is 8"},
      {{100, 10}, {3, 5, 0, 0, -2, 1, 1, 1}, "block_table: entry (1, 0) is -2"},
  };
  for (const Case& c : cases) {
    Device<int32_t> d_lens(c.lens), d_table(c.table);
    p.cache_seqlens = d_lens.ptr;
    p.block_table = d_table.ptr;
    const Status s = check_mla_promises(p);
    if (std::string(c.argument).empty()) {
      EXPECT_TRUE(s.ok()) << s.to_string();
      p.check = true;
      EXPECT_TRUE(mla_decode(p).ok());  // and the launch with the checks on
      p.check.reset();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    } else {
      EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
      EXPECT_EQ(s.message().rfind(c.argument, 0), 0u) << s.message();
      p.check = true;
      EXPECT_EQ(mla_decode(p).code(), StatusCode::invalid_argument);  // refused before the launch
      p.check.reset();
    }
  }
}

}  // namespace
}  // namespace hattn
