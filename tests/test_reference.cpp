// CPU tests of the fp64 reference on cases small enough to check by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "hattn/reference.h"

namespace hattn::ref {
namespace {

constexpr int D = 64;

// Dense [B, S, H, D] host tensors for hand-built cases.
struct Tensors {
  int B, Sq, Sk, Hq, Hkv;
  std::vector<float> q, k, v;
  Tensors(int b, int sq, int sk, int hq, int hkv)
      : B(b), Sq(sq), Sk(sk), Hq(hq), Hkv(hkv),
        q(size_t(b) * sq * hq * D, 0.f), k(size_t(b) * sk * hkv * D, 0.f), v(size_t(b) * sk * hkv * D, 0.f) {}
  float* q_row(int b, int i, int h) { return &q[((size_t(b) * Sq + i) * Hq + h) * D]; }
  float* k_row(int b, int j, int h) { return &k[((size_t(b) * Sk + j) * Hkv + h) * D]; }
  float* v_row(int b, int j, int h) { return &v[((size_t(b) * Sk + j) * Hkv + h) * D]; }
  HostProblem problem(float scale, bool causal) const {
    HostProblem p;
    p.batch = B;
    p.seqlen_q = Sq;
    p.seqlen_k = Sk;
    p.heads_q = Hq;
    p.heads_kv = Hkv;
    p.head_dim = D;
    p.q = q.data();
    p.q_strides = contiguous_bshd(Sq, Hq, D);
    p.k = k.data();
    p.k_strides = contiguous_bshd(Sk, Hkv, D);
    p.v = v.data();
    p.v_strides = contiguous_bshd(Sk, Hkv, D);
    p.scale = scale;
    p.causal = causal;
    return p;
  }
};

TEST(Reference, TwoKeysWithKnownWeights) {
  // Scores 0 and log(3): weights 1/4 and 3/4; values 1 and 5 give 1/4 + 15/4 = 4.
  Tensors t(1, 1, 2, 1, 1);
  t.q_row(0, 0, 0)[0] = 1.f;
  t.k_row(0, 1, 0)[0] = std::log(3.f);
  for (int d = 0; d < D; ++d) {
    t.v_row(0, 0, 0)[d] = 1.f;
    t.v_row(0, 1, 0)[d] = 5.f;
  }
  std::vector<double> out(D);
  double lse;
  attention_row_fp64(t.problem(1.f, false), 0, 0, 0, out.data(), &lse);
  for (int d = 0; d < D; ++d) EXPECT_NEAR(out[d], 4.0, 1e-6);
  EXPECT_NEAR(lse, std::log(4.0), 1e-6);
}

TEST(Reference, ScaleMultipliesScores) {
  // With scale 2 the scores are 0 and 2 log(3): weights 1/10 and 9/10.
  Tensors t(1, 1, 2, 1, 1);
  t.q_row(0, 0, 0)[0] = 1.f;
  t.k_row(0, 1, 0)[0] = std::log(3.f);
  for (int d = 0; d < D; ++d) t.v_row(0, 1, 0)[d] = 10.f;
  std::vector<double> out(D);
  double lse;
  attention_row_fp64(t.problem(2.f, false), 0, 0, 0, out.data(), &lse);
  EXPECT_NEAR(out[0], 9.0, 1e-5);
  EXPECT_NEAR(lse, std::log(10.0), 1e-5);
}

TEST(Reference, CausalBottomRightWithMoreKeysThanQueries) {
  // Sq = 2, Sk = 4: query 0 sees keys 0..2, query 1 sees keys 0..3. Equal scores, v_j = j.
  Tensors t(1, 2, 4, 1, 1);
  for (int j = 0; j < 4; ++j)
    for (int d = 0; d < D; ++d) t.v_row(0, j, 0)[d] = float(j);
  const HostProblem p = t.problem(1.f, true);
  std::vector<double> out(D);
  double lse;
  attention_row_fp64(p, 0, 0, 0, out.data(), &lse);
  EXPECT_NEAR(out[0], 1.0, 1e-12);  // mean of 0, 1, 2
  EXPECT_NEAR(lse, std::log(3.0), 1e-12);
  attention_row_fp64(p, 0, 0, 1, out.data(), &lse);
  EXPECT_NEAR(out[0], 1.5, 1e-12);  // mean of 0..3
  EXPECT_NEAR(lse, std::log(4.0), 1e-12);
}

TEST(Reference, FullyMaskedRowIsZeroWithMinusInfLse) {
  // Sq = 3, Sk = 1, causal: queries 0 and 1 see no key; query 2 sees key 0.
  Tensors t(1, 3, 1, 1, 1);
  t.q_row(0, 2, 0)[0] = 2.f;
  t.k_row(0, 0, 0)[0] = 1.5f;
  for (int d = 0; d < D; ++d) t.v_row(0, 0, 0)[d] = 7.f;
  const HostProblem p = t.problem(1.f, true);
  std::vector<double> out(D, 123.0);
  double lse;
  for (int i : {0, 1}) {
    attention_row_fp64(p, 0, 0, i, out.data(), &lse);
    EXPECT_EQ(lse, -std::numeric_limits<double>::infinity());
    for (int d = 0; d < D; ++d) EXPECT_EQ(out[d], 0.0);
    float lowp[D], lowp_lse;
    attention_row_lowp(p, DType::bf16, 0, 0, i, lowp, &lowp_lse);
    EXPECT_EQ(lowp_lse, -std::numeric_limits<float>::infinity());
    EXPECT_EQ(lowp[0], 0.f);
  }
  attention_row_fp64(p, 0, 0, 2, out.data(), &lse);
  EXPECT_NEAR(out[5], 7.0, 1e-12);
  EXPECT_NEAR(lse, 3.0, 1e-12);  // a single key: LSE is its score
}

// The window's edges, bottom-right aligned like the causal mask: query i's diagonal is key
// i + Sk - Sq; causal sets the right edge at 0.
TEST(Reference, SlidingWindowKeyRanges) {
  HostProblem p;
  p.seqlen_q = 4;
  p.seqlen_k = 10;  // diagonal of query i: key i + 6
  auto range = [&](int i) {
    int first = -1, last = -1;
    visible_key_range(p, i, &first, &last);
    return std::pair<int, int>(first, last);
  };
  EXPECT_EQ(range(0), std::make_pair(0, 10));  // no window, no mask
  p.window_left = 2;
  p.window_right = 1;
  EXPECT_EQ(range(0), std::make_pair(4, 8));   // keys 4..7
  EXPECT_EQ(range(3), std::make_pair(7, 10));  // keys 7..9: the right edge is cut at Sk
  p.causal = true;                             // causal: the right edge at the diagonal
  p.window_right = -1;
  EXPECT_EQ(range(1), std::make_pair(5, 8));
  p.causal = false;
  p.window_left = -1;
  p.window_right = 0;
  EXPECT_EQ(range(2), std::make_pair(0, 9));   // right edge only: causal
  p.seqlen_q = 12;                             // Sq > Sk: query i's diagonal is key i - 2
  p.window_left = 0;
  EXPECT_EQ(range(0).second - range(0).first, 0);  // sees nothing
  EXPECT_EQ(range(5), std::make_pair(3, 4));       // only its diagonal
}

// A windowed row is the full softmax over the keys inside the window.
TEST(Reference, WindowedRowIsAttentionOverItsKeys) {
  const int D = 64, Sq = 5, Sk = 9;
  std::vector<float> q(Sq * D), k(Sk * D), v(Sk * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37 * i);
  for (size_t i = 0; i < k.size(); ++i) k[i] = std::cos(0.11 * i), v[i] = std::sin(0.23 * i + 1);
  HostProblem p;
  p.batch = 1, p.seqlen_q = Sq, p.seqlen_k = Sk, p.heads_q = 1, p.heads_kv = 1, p.head_dim = D;
  p.q = q.data(), p.k = k.data(), p.v = v.data();
  p.q_strides = p.k_strides = p.v_strides = {int64_t(D), D, D};
  p.scale = 0.125f;
  p.window_left = 1;
  p.window_right = 2;
  const int i = 2;  // diagonal key 6: keys 5..8
  std::vector<double> out(D);
  double lse = 0;
  attention_row_fp64(p, 0, 0, i, out.data(), &lse);
  // The same row over keys 5..8 alone, without a window.
  HostProblem slice = p;
  slice.seqlen_k = 4;
  slice.seqlen_q = 1;
  slice.k = k.data() + 5 * D;
  slice.v = v.data() + 5 * D;
  slice.q = q.data() + i * D;
  slice.window_left = slice.window_right = -1;
  std::vector<double> expect(D);
  double expect_lse = 0;
  attention_row_fp64(slice, 0, 0, 0, expect.data(), &expect_lse);
  for (int d = 0; d < D; ++d) EXPECT_NEAR(out[d], expect[d], 1e-12);
  EXPECT_NEAR(lse, expect_lse, 1e-12);
}

TEST(Reference, GroupedQueryHeadsShareKvHeads) {
  // Hq = 4, Hkv = 2: query heads 0, 1 read kv head 0; heads 2, 3 read kv head 1.
  Tensors t(2, 1, 3, 4, 2);
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < 3; ++j)
      for (int d = 0; d < D; ++d) {
        t.v_row(b, j, 0)[d] = 1.f + b;
        t.v_row(b, j, 1)[d] = 10.f + b;
      }
  const HostProblem p = t.problem(1.f, false);
  std::vector<double> out, lse;
  attention_fp64(p, &out, &lse);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h) {
      const double expected = (h < 2 ? 1.0 : 10.0) + b;
      EXPECT_NEAR(out[((size_t(b) * 1 + 0) * 4 + h) * D + 3], expected, 1e-12) << "b=" << b << " h=" << h;
      EXPECT_NEAR(lse[size_t(b) * 4 + h], std::log(3.0), 1e-12);
    }
}

TEST(Reference, LowPrecisionEmulationIsCloseButNotExact) {
  Tensors t(1, 1, 50, 1, 1);
  uint32_t state = 12345;
  for (auto* vec : {&t.q, &t.k, &t.v})
    for (float& x : *vec) {
      state = state * 1664525u + 1013904223u;
      x = bits_to_float(float_to_bits(float(state >> 8) / float(1 << 24) - 0.3f, DType::bf16), DType::bf16);
    }
  const HostProblem p = t.problem(0.125f, false);
  std::vector<double> exact(D);
  double lse;
  float lowp[D], lowp_lse;
  attention_row_fp64(p, 0, 0, 0, exact.data(), &lse);
  attention_row_lowp(p, DType::bf16, 0, 0, 0, lowp, &lowp_lse);
  double max_err = 0;
  for (int d = 0; d < D; ++d) max_err = std::max(max_err, std::abs(lowp[d] - exact[d]));
  EXPECT_GT(max_err, 0.0);    // bf16 rounding of P and of the output shows up
  EXPECT_LT(max_err, 1e-2);   // but stays at bf16 rounding level
  EXPECT_NEAR(lowp_lse, lse, 1e-4);
}

// The fp64 backward against central differences of L = sum(dout * out) through the fp64
// forward, for every element of q, k and v: GQA (two query heads per K/V head), a causal mask
// with Sq > Sk (the first rows see no key: no gradient), a window, and softcapping (a cap of
// 0.5 on scores of about that size: tanh well off its linear part).
// ceil(D / 32) 2^-13 scale times the largest row norms of q and k, over every batch entry, row
// and head (D = 64: two k32 steps).
TEST(Reference, Fp8ScoreErrorTakesTheLargestRowNorms) {
  Tensors t(2, 3, 4, 2, 1);
  t.q_row(0, 0, 0)[0] = 3.f;  // norm 3
  t.q_row(1, 2, 1)[5] = 4.f;  // norm 5, the largest of q
  t.q_row(1, 2, 1)[9] = -3.f;
  t.k_row(1, 3, 0)[1] = 2.f;  // norm 2, the only one of k
  EXPECT_DOUBLE_EQ(fp8_score_error(t.problem(0.5f, false)), 2 * 0x1p-13 * 0.5 * 5 * 2);
}

// 2^-14 per k32 step of the keys (ceil(Sk / 32)) times the largest |v| over the whole tensor.
TEST(Reference, Fp8PvSumErrorCountsTheStepsAndTheLargestValue) {
  Tensors t(2, 3, 40, 2, 1);
  t.v_row(1, 33, 0)[7] = -6.f;
  t.v_row(0, 2, 0)[1] = 4.f;
  EXPECT_DOUBLE_EQ(fp8_pv_sum_error(t.problem(0.5f, false)), 0x1p-14 * 2 * 6);
}

TEST(Reference, BackwardMatchesFiniteDifferences) {
  Tensors t(1, 6, 4, 4, 2);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto* x : {&t.q, &t.k, &t.v})
    for (float& e : *x) e = normal(rng);
  std::vector<float> dout(t.q.size());
  for (float& e : dout) e = normal(rng);
  for (const auto& [window_left, softcap] : {std::pair{-1, 0.f}, std::pair{1, 0.f}, std::pair{-1, 0.5f}}) {
    SCOPED_TRACE("window_left=" + std::to_string(window_left) + " softcap=" + std::to_string(softcap));
    HostProblem p = t.problem(0.2f, true);
    p.window_left = window_left;
    p.softcap = softcap;
    auto loss = [&] {
      std::vector<double> out, lse;
      attention_fp64(p, &out, &lse);
      double l = 0;
      for (size_t e = 0; e < out.size(); ++e) l += double(dout[e]) * out[e];
      return l;
    };
    std::vector<double> dq, dk, dv;
    attention_backward_fp64(p, dout.data(), p.q_strides, &dq, &dk, &dv);
    const std::pair<std::vector<float>*, const std::vector<double>*> inputs[] = {{&t.q, &dq}, {&t.k, &dk}, {&t.v, &dv}};
    for (const auto& [x, grad] : inputs) {
      ASSERT_EQ(x->size(), grad->size());
      double worst = 0, largest = 0;
      for (size_t e = 0; e < x->size(); ++e) {
        const float saved = (*x)[e];
        const float up = saved + 1e-2f, down = saved - 1e-2f;  // the steps as stored in float
        (*x)[e] = up;
        const double l_up = loss();
        (*x)[e] = down;
        const double l_down = loss();
        (*x)[e] = saved;
        const double numeric = (l_up - l_down) / (double(up) - double(down));
        worst = std::max(worst, std::abs(numeric - (*grad)[e]));
        largest = std::max(largest, std::abs((*grad)[e]));
      }
      EXPECT_GT(largest, 0.1);
      EXPECT_LT(worst, 2e-4 * largest);
    }
    // One row of dq alone, as the benchmark checks a sample, is the full backward's row.
    std::vector<double> row(D);
    for (int h = 0; h < t.Hq; ++h)
      for (int i = 0; i < t.Sq; ++i) {
        attention_backward_dq_row_fp64(p, dout.data(), p.q_strides, 0, h, i, row.data());
        for (int d = 0; d < D; ++d) EXPECT_DOUBLE_EQ(row[d], dq[(size_t(i) * t.Hq + h) * D + d]);
      }
    // Query rows 0 and 1 see no key (causal, Sq = 6 > Sk = 4): their gradient is exactly 0.
    for (int h = 0; h < t.Hq; ++h)
      for (int d = 0; d < D; ++d) EXPECT_EQ(dq[(size_t(1) * t.Hq + h) * D + d], 0.0);
  }
}

TEST(Conversions, RoundToNearestEven) {
  EXPECT_EQ(float_to_bits(1.0f, DType::bf16), 0x3F80);
  EXPECT_EQ(float_to_bits(1.0f, DType::fp16), 0x3C00);
  EXPECT_EQ(bits_to_float(0xC000, DType::bf16), -2.0f);
  EXPECT_EQ(bits_to_float(0x3555, DType::fp16), 0.333251953125f);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1).
  EXPECT_EQ(float_to_bits(1.0f + 0x1.0p-8f, DType::bf16), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go to even (1 + 2^-6).
  EXPECT_EQ(float_to_bits(1.0f + 3 * 0x1.0p-8f, DType::bf16), 0x3F82);
  EXPECT_TRUE(std::isnan(bits_to_float(0xFFFF, DType::bf16)));
  EXPECT_TRUE(std::isnan(bits_to_float(0xFFFF, DType::fp16)));
}

}  // namespace
}  // namespace hattn::ref
