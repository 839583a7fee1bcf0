// append_kv(): argument checks (CPU), and the writes into dense and paged caches with and
// without rotary embedding against a host loop (GPU).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_copy.h"
#include "gpu_env.h"
#include "hattn/hattn.h"
#include "hattn/reference.h"

namespace hattn {
namespace {

using testing::Device;

// A fake device address: validation never dereferences pointers.
template <typename T = void>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Dense, batch 2, 3 new rows of 2 K/V heads at D = 64 into a 40-row cache, with rotary and q.
KvAppendProblem valid_append() {
  KvAppendProblem p;
  p.batch = 2;
  p.seqlen_new = 3;
  p.heads_kv = 2;
  p.head_dim = 64;
  p.k_new = fake(0x1000);
  p.v_new = fake(0x2000);
  p.k_new_strides = p.v_new_strides = contiguous_bshd(3, 2, 64);
  p.k_cache = fake(0x3000);
  p.v_cache = fake(0x4000);
  p.k_cache_strides = p.v_cache_strides = contiguous_bshd(40, 2, 64);
  p.cache_seqlen = 40;
  p.seqlens = fake<const int32_t>(0x5000);
  p.seqlens_out = fake<int32_t>(0x6000);
  p.rotary_cos = fake(0x7000);
  p.rotary_sin = fake(0x8000);
  p.rotary_dim = 32;
  p.rotary_seqlen = 40;
  p.q = fake(0x9000);
  p.q_rotated = fake(0xa000);
  p.q_strides = p.q_rotated_strides = contiguous_bshd(1, 4, 64);
  p.seqlen_q = 1;
  p.heads_q = 4;
  return p;
}

void expect_invalid(const KvAppendProblem& p, const std::string& argument) {
  const Status s = validate_append_kv_arguments(p);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << "should start with '" << argument << ":': " << s.message();
  EXPECT_EQ(append_kv(p).code(), StatusCode::invalid_argument);  // refused before the device is touched
}

TEST(AppendKvValidation, ValidProblemPasses) { EXPECT_TRUE(validate_append_kv_arguments(valid_append()).ok()); }

TEST(AppendKvValidation, EachBadArgumentIsNamed) {
  auto p = valid_append();
  p.dtype = DType::e4m3;
  expect_invalid(p, "dtype");
  p = valid_append();
  p.cache_dtype = DType::fp16;  // beside bf16 new rows: only bf16 or e4m3
  expect_invalid(p, "cache_dtype");
  p = valid_append();
  p.k_descale = fake<const float>(0xb000);  // descales without an e4m3 cache
  expect_invalid(p, "k_descale");
  p = valid_append();
  p.cache_dtype = DType::e4m3;
  p.v_descale = fake<const float>(0xb002);
  expect_invalid(p, "v_descale");  // misaligned
  p.v_descale = fake<const float>(0xb004);
  EXPECT_TRUE(validate_append_kv_arguments(p).ok());
  p = valid_append();
  p.batch = 0;
  expect_invalid(p, "batch");
  p = valid_append();
  p.head_dim = 96;
  expect_invalid(p, "head_dim");
  p = valid_append();
  p.seqlens = nullptr;
  expect_invalid(p, "seqlens");
  p = valid_append();
  p.seqlens_out = const_cast<int32_t*>(p.seqlens);
  expect_invalid(p, "seqlens_out");
  p = valid_append();
  p.k_new = nullptr;
  expect_invalid(p, "k_new");
  p = valid_append();
  p.v_cache_strides.seq = 0;
  expect_invalid(p, "v_cache");
  p = valid_append();
  p.rotary_sin = nullptr;
  expect_invalid(p, "rotary_sin");
  p = valid_append();
  p.rotary_dim = 66;
  expect_invalid(p, "rotary_dim");
  p = valid_append();
  p.rotary_seqlen = 39;  // shorter than the cache
  expect_invalid(p, "rotary_seqlen");
  p = valid_append();
  p.q_rotated = const_cast<void*>(p.q);
  expect_invalid(p, "q_rotated");
  p = valid_append();
  p.rotary_cos = p.rotary_sin = nullptr;  // q without rotary
  expect_invalid(p, "q");
  p = valid_append();
  p.block_table = fake<const int32_t>(0xb000);
  p.max_pages_per_seq = 2;  // num_pages and page_size left 0
  expect_invalid(p, "block_table");
  p = valid_append();
  p.kv_batch_idx = fake<const int32_t>(0xc000);
  p.kv_batch = 0;
  expect_invalid(p, "kv_batch");
  p.kv_batch = 3;
  p.k_cache_strides.batch = 0;  // three entries need a batch stride
  expect_invalid(p, "k_cache");
  p.k_cache_strides.batch = p.v_cache_strides.batch;
  EXPECT_TRUE(validate_append_kv_arguments(p).ok()) << validate_append_kv_arguments(p).to_string();
  p.kv_batch_idx = fake<const int32_t>(0xc002);
  expect_invalid(p, "kv_batch_idx");
  p = valid_append();
  p.kv_batch = 3;  // without kv_batch_idx
  expect_invalid(p, "kv_batch");
}

TEST(AppendKvValidation, NothingNewNeedsNoRows) {
  auto p = valid_append();
  p.seqlen_new = 0;
  p.k_new = p.v_new = nullptr;
  EXPECT_TRUE(validate_append_kv_arguments(p).ok());
}

// --- GPU: against a host loop ------------------------------------------------------------------

std::vector<__nv_bfloat16> random_bf16(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> out(count);
  for (auto& x : out) x = __float2bfloat16(normal(rng));
  return out;
}

// (first, second) features of pair `pair` and whether it rotates, as the kernel pairs them.
void pair_features(int pair, int rotary_dim, bool interleaved, int* first, int* second, bool* rotates) {
  const int half = rotary_dim / 2;
  *rotates = pair < half;
  *first = !*rotates || interleaved ? 2 * pair : pair;
  *second = !*rotates || interleaved ? 2 * pair + 1 : pair + half;
}

// A D-feature row rotated at `position` in double, rounded to bf16.
void rotate_row(const __nv_bfloat16* in, __nv_bfloat16* out, int head_dim, int rotary_dim, bool interleaved,
                const std::vector<__nv_bfloat16>& cos, const std::vector<__nv_bfloat16>& sin, int64_t position) {
  for (int pair = 0; pair < head_dim / 2; ++pair) {
    int a, b;
    bool rotates;
    pair_features(pair, rotary_dim, interleaved, &a, &b, &rotates);
    const double x = __bfloat162float(in[a]), y = __bfloat162float(in[b]);
    if (!rotates) {
      out[a] = in[a];
      out[b] = in[b];
      continue;
    }
    const double c = __bfloat162float(cos[position * (rotary_dim / 2) + pair]);
    const double s = __bfloat162float(sin[position * (rotary_dim / 2) + pair]);
    out[a] = __float2bfloat16(float(x * c - y * s));
    out[b] = __float2bfloat16(float(x * s + y * c));
  }
}

// Equal (exact), or within one bf16 rounding of the fp64 result (rotated values).
void expect_close(const std::vector<__nv_bfloat16>& got, const std::vector<__nv_bfloat16>& want, const char* what,
                  bool exact = false) {
  ASSERT_EQ(got.size(), want.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = __bfloat162float(got[i]), w = __bfloat162float(want[i]);
    const float tolerance = exact ? 0.f : std::ldexp(std::fabs(w), -7) + 1e-6f;
    if (!(std::fabs(g - w) <= tolerance) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0) << what;
}

// An append of `seqlen_new` contiguous rows per sequence into caches of `cache_rows` rows per
// batch entry or page, contiguous; the caller adds the rest (lengths, pages, rotary...).
KvAppendProblem append_of(int batch, int seqlen_new, int heads_kv, int head_dim, const void* k_new, const void* v_new,
                          void* k_cache, void* v_cache, int cache_rows) {
  KvAppendProblem p;
  p.batch = batch;
  p.seqlen_new = seqlen_new;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.k_new = k_new;
  p.v_new = v_new;
  p.k_new_strides = p.v_new_strides = contiguous_bshd(seqlen_new, heads_kv, head_dim);
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.k_cache_strides = p.v_cache_strides = contiguous_bshd(cache_rows, heads_kv, head_dim);
  return p;
}

struct AppendCase {
  bool paged;
  int rotary_dim;  // 0: no rotary
  bool interleaved;
  bool q_per_row;
  bool entries = false;  // kv_batch_idx: sequence b writes into entry (3 b + 1) % (batch + 1)
};

class AppendKvGpu : public ::testing::TestWithParam<AppendCase> {};

TEST_P(AppendKvGpu, MatchesHostLoop) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const AppendCase c = GetParam();
  constexpr int kDim = 128, kHeadsKv = 2, kHeadsQ = 4, kNew = 3, kSeqlenQ = 2, kPageSize = 128, kPagesPerSeq = 3;
  constexpr int kCapacity = kPageSize * kPagesPerSeq;
  const std::vector<int32_t> starts = {0, 5, 127, 382, 384, 600, -4};  // across a page, at and past the end
  const int batch = int(starts.size());
  const int num_pages = batch * kPagesPerSeq;
  std::mt19937 rng(7);

  const int entries = c.entries ? batch + 1 : batch;
  std::vector<int32_t> entry_of(batch);
  for (int b = 0; b < batch; ++b) entry_of[b] = c.entries ? (3 * b + 1) % entries : b;
  const int cache_batch = c.paged ? num_pages : entries, cache_rows = c.paged ? kPageSize : kCapacity;
  const size_t cache_elems = size_t(cache_batch) * cache_rows * kHeadsKv * kDim;
  const size_t new_elems = size_t(batch) * kNew * kHeadsKv * kDim;
  const size_t q_elems = size_t(batch) * kSeqlenQ * kHeadsQ * kDim;
  const auto k_cache0 = random_bf16(cache_elems, rng), v_cache0 = random_bf16(cache_elems, rng);
  const auto k_new = random_bf16(new_elems, rng), v_new = random_bf16(new_elems, rng), q = random_bf16(q_elems, rng);
  // Sequence b's pages: a shuffled slice of its own, in row entry_of[b]; a spare row (with
  // entries) repeats the first slice, and no sequence writes through it.
  std::vector<int32_t> pages(num_pages), table(size_t(entries) * kPagesPerSeq);
  for (int i = 0; i < num_pages; ++i) pages[i] = i;
  std::shuffle(pages.begin(), pages.end(), rng);
  for (size_t i = 0; i < table.size(); ++i) table[i] = pages[i % kPagesPerSeq];
  for (int b = 0; b < batch; ++b)
    std::copy_n(pages.begin() + int64_t(b) * kPagesPerSeq, kPagesPerSeq,
                table.begin() + int64_t(entry_of[b]) * kPagesPerSeq);
  const int rotary_dim = std::max(c.rotary_dim, 2);
  const auto cos = random_bf16(size_t(kCapacity) * rotary_dim / 2, rng), sin = random_bf16(cos.size(), rng);

  Device<__nv_bfloat16> d_k_cache(k_cache0), d_v_cache(v_cache0), d_k_new(k_new), d_v_new(v_new), d_q(q),
      d_q_rotated{std::vector<__nv_bfloat16>(q_elems)}, d_cos(cos), d_sin(sin);
  Device<int32_t> d_seqlens(starts), d_seqlens_out{std::vector<int32_t>(batch)}, d_table(table), d_entries(entry_of);

  KvAppendProblem p =
      append_of(batch, kNew, kHeadsKv, kDim, d_k_new.ptr, d_v_new.ptr, d_k_cache.ptr, d_v_cache.ptr, cache_rows);
  if (c.paged) {
    p.block_table = d_table.ptr;
    p.max_pages_per_seq = kPagesPerSeq;
    p.num_pages = num_pages;
    p.page_size = kPageSize;
  } else {
    p.cache_seqlen = kCapacity;
  }
  p.seqlens = d_seqlens.ptr;
  p.seqlens_out = d_seqlens_out.ptr;
  if (c.entries) {
    p.kv_batch_idx = d_entries.ptr;
    p.kv_batch = entries;
  }
  if (c.rotary_dim > 0) {
    p.rotary_cos = d_cos.ptr;
    p.rotary_sin = d_sin.ptr;
    p.rotary_dim = c.rotary_dim;
    p.rotary_seqlen = kCapacity;
    p.rotary_interleaved = c.interleaved;
    p.q = d_q.ptr;
    p.q_rotated = d_q_rotated.ptr;
    p.q_strides = p.q_rotated_strides = contiguous_bshd(kSeqlenQ, kHeadsQ, kDim);
    p.seqlen_q = kSeqlenQ;
    p.heads_q = kHeadsQ;
    p.q_positions_per_row = c.q_per_row;
  }
  const Status s = append_kv(p);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The host loop: every new row whose key fits, at its page or row.
  auto want_k = k_cache0, want_v = v_cache0;
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < kNew; ++i) {
      const int64_t key = std::max(starts[b], 0) + i;
      if (key >= kCapacity) continue;
      const int64_t cache_b = c.paged ? table[size_t(entry_of[b]) * kPagesPerSeq + key / kPageSize] : entry_of[b];
      const int64_t cache_row = c.paged ? key % kPageSize : key;
      for (int h = 0; h < kHeadsKv; ++h) {
        const size_t dst = ((cache_b * cache_rows + cache_row) * kHeadsKv + h) * kDim;
        const size_t src = ((size_t(b) * kNew + i) * kHeadsKv + h) * kDim;
        std::copy_n(v_new.begin() + src, kDim, want_v.begin() + dst);
        if (c.rotary_dim > 0)
          rotate_row(&k_new[src], &want_k[dst], kDim, c.rotary_dim, c.interleaved, cos, sin, key);
        else
          std::copy_n(k_new.begin() + src, kDim, want_k.begin() + dst);
      }
    }
  expect_close(d_k_cache.read(cache_elems), want_k, "k_cache");
  expect_close(d_v_cache.read(cache_elems), want_v, "v_cache", /*exact=*/true);
  const auto seqlens_out = d_seqlens_out.read(batch);
  for (int b = 0; b < batch; ++b) EXPECT_EQ(seqlens_out[b], std::max(starts[b], 0) + kNew) << "b=" << b;
  if (c.rotary_dim > 0) {
    std::vector<__nv_bfloat16> want_q(q_elems);
    for (int b = 0; b < batch; ++b)
      for (int i = 0; i < kSeqlenQ; ++i) {
        const int64_t position = std::min<int64_t>(std::max(starts[b], 0) + (c.q_per_row ? i : 0), kCapacity - 1);
        for (int h = 0; h < kHeadsQ; ++h) {
          const size_t at = ((size_t(b) * kSeqlenQ + i) * kHeadsQ + h) * kDim;
          rotate_row(&q[at], &want_q[at], kDim, c.rotary_dim, c.interleaved, cos, sin, position);
        }
      }
    expect_close(d_q_rotated.read(q_elems), want_q, "q_rotated");
  }
}

// An e4m3 cache: each new value (K rotated first) lands as the code of value / descale of its
// sequence (not its cache entry) and K/V head; a zero descale writes zeros.
TEST(AppendKvE4m3, WritesTheCodesOfValueOverDescale) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  constexpr int kDim = 128, kHeadsKv = 2, kNew = 2, kCapacity = 256, kRotaryDim = 64;
  const std::vector<int32_t> starts = {0, 100, 255};  // the last sequence's second row is past the cache
  const int batch = int(starts.size()), entries = batch + 1;
  const std::vector<int32_t> entry_of = {2, 0, 3};
  std::mt19937 rng(11);
  const size_t cache_elems = size_t(entries) * kCapacity * kHeadsKv * kDim;
  const size_t new_elems = size_t(batch) * kNew * kHeadsKv * kDim;
  const auto k_new = random_bf16(new_elems, rng), v_new = random_bf16(new_elems, rng);
  const auto cos = random_bf16(size_t(kCapacity) * kRotaryDim / 2, rng), sin = random_bf16(cos.size(), rng);
  std::uniform_real_distribution<float> scale_dist(0.25f, 2.f);
  std::vector<float> k_descale(size_t(batch) * kHeadsKv), v_descale(k_descale.size());
  for (float& x : k_descale) x = scale_dist(rng);
  for (float& x : v_descale) x = scale_dist(rng);
  v_descale[1] = 0.f;  // sequence 0, head 1: zeros
  const std::vector<uint8_t> cache0(cache_elems, 0x7F);  // NaN codes wherever nothing is written

  Device<uint8_t> d_k_cache(cache0), d_v_cache(cache0);
  Device<__nv_bfloat16> d_k_new(k_new), d_v_new(v_new), d_cos(cos), d_sin(sin);
  Device<int32_t> d_seqlens(starts), d_entries(entry_of);
  Device<float> d_k_descale(k_descale), d_v_descale(v_descale);
  KvAppendProblem p =
      append_of(batch, kNew, kHeadsKv, kDim, d_k_new.ptr, d_v_new.ptr, d_k_cache.ptr, d_v_cache.ptr, kCapacity);
  p.cache_seqlen = kCapacity;
  p.seqlens = d_seqlens.ptr;
  p.kv_batch_idx = d_entries.ptr;
  p.kv_batch = entries;
  p.rotary_cos = d_cos.ptr;
  p.rotary_sin = d_sin.ptr;
  p.rotary_dim = kRotaryDim;
  p.rotary_seqlen = kCapacity;
  p.cache_dtype = DType::e4m3;
  p.k_descale = d_k_descale.ptr;
  p.v_descale = d_v_descale.ptr;
  const Status s = append_kv(p);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto got_k = d_k_cache.read(cache_elems), got_v = d_v_cache.read(cache_elems);
  std::vector<char> written(cache_elems, 0);
  int bad = 0;
  // A code must decode to within half an e4m3 step (2^-4 relative, 2^-10 among subnormals) of
  // value / descale, give or take the host's bf16 rounding of rotated keys (2^-8; the kernel
  // quantizes the fp32 rotation) and the kernel's fp32 quotient (rounded once more to the code,
  // a value near a tie may land on either side).
  auto expect_code = [&](uint8_t code, double value, float descale, const char* what, size_t at) {
    const double want = descale > 0.f ? value / descale : 0.0;
    const double got = ref::bits_to_float(code, DType::e4m3);
    const double tolerance = std::ldexp(std::fabs(want), -4) + std::ldexp(std::fabs(want), -8) + std::ldexp(1.0, -10);
    if (!(std::fabs(got - want) <= tolerance) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << at << "]: code " << int(code) << " = " << got << ", want " << want;
  };
  for (int b = 0; b < batch; ++b)
    for (int i = 0; i < kNew; ++i) {
      const int64_t key = starts[b] + i;
      if (key >= kCapacity) continue;
      for (int h = 0; h < kHeadsKv; ++h) {
        const size_t dst = ((size_t(entry_of[b]) * kCapacity + key) * kHeadsKv + h) * kDim;
        const size_t src = ((size_t(b) * kNew + i) * kHeadsKv + h) * kDim;
        std::vector<__nv_bfloat16> rotated(kDim);
        rotate_row(&k_new[src], rotated.data(), kDim, kRotaryDim, true, cos, sin, key);
        const size_t scale_at = size_t(b) * kHeadsKv + h;
        for (int d = 0; d < kDim; ++d) {
          written[dst + d] = 1;
          expect_code(got_k[dst + d], __bfloat162float(rotated[d]), k_descale[scale_at], "k_cache", dst + d);
          expect_code(got_v[dst + d], __bfloat162float(v_new[src + d]), v_descale[scale_at], "v_cache", dst + d);
        }
      }
    }
  for (size_t e = 0; e < cache_elems; ++e)
    if (!written[e] && (got_k[e] != 0x7F || got_v[e] != 0x7F) && ++bad <= 5) ADD_FAILURE() << "wrote at " << e;
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AppendKvGpu,
    ::testing::Values(AppendCase{false, 0, true, false}, AppendCase{true, 0, true, false},
                      AppendCase{false, 128, true, true}, AppendCase{true, 64, false, false},
                      AppendCase{false, 32, false, true}, AppendCase{true, 128, true, false},
                      AppendCase{false, 0, true, false, true}, AppendCase{true, 64, true, true, true}),
    [](const ::testing::TestParamInfo<AppendCase>& info) {
      const AppendCase& c = info.param;
      std::string name = std::string(c.paged ? "Paged" : "Dense") + (c.entries ? "Entries" : "");
      if (c.rotary_dim == 0) return name + "NoRotary";
      return name + "Rotary" + std::to_string(c.rotary_dim) + (c.interleaved ? "GptJ" : "GptNeox") +
             (c.q_per_row ? "QPerRow" : "QAtStart");
    });

}  // namespace
}  // namespace hattn
