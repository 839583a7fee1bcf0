// CPU reference attention (fp64) and the same-precision emulation used for error budgets.
#include "hattn/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace hattn::ref {

namespace {

// e4m3 (OCP FP8, "fn"): sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities,
// S.1111.111 is NaN, so the largest value is 448. Subnormals are m x 2^-9.
constexpr float kE4m3Max = 448.f;

uint16_t e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint16_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= kE4m3Max) return sign | 0x7E;  // saturated, as cvt.rn.satfinite does
  if (a < 0x1p-6f) return sign | uint16_t(std::nearbyint(a * 0x1p9f));  // subnormal (8 -> the smallest normal)
  int e = 0;
  const float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  int exponent = e - 1 + 7, mantissa = int(std::nearbyint((2 * f - 1) * 8));  // nearest even
  if (mantissa == 8) mantissa = 0, ++exponent;
  const int code = exponent << 3 | mantissa;
  return sign | uint16_t(code > 0x7E ? 0x7E : code);
}

float e4m3_to_float(uint16_t bits) {
  const int exponent = bits >> 3 & 15, mantissa = bits & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  const float a = exponent == 0 ? std::ldexp(float(mantissa), -9) : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
  return bits & 0x80 ? -a : a;
}

}  // namespace

uint16_t float_to_bits(float x, DType dtype) {
  if (dtype == DType::e4m3) return e4m3_from_float(x);
  if (dtype == DType::fp16) {
    const _Float16 h = static_cast<_Float16>(x);  // IEEE round to nearest even
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
  }
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even on the 16 dropped bits
  return uint16_t(u >> 16);
}

float bits_to_float(uint16_t bits, DType dtype) {
  if (dtype == DType::e4m3) return e4m3_to_float(bits & 0xFF);
  if (dtype == DType::fp16) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  }
  const uint32_t u = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

namespace {

float round_to(float x, DType dtype) { return bits_to_float(float_to_bits(x, dtype), dtype); }

const float* row_ptr(const float* base, const Strides& s, int b, int t, int h) {
  return base + b * s.batch + int64_t(t) * s.seq + h * s.head;
}

}  // namespace

void visible_key_range(const HostProblem& p, int i, int* first, int* last) {
  const int64_t diagonal = int64_t(i) + (p.seqlen_k - p.seqlen_q);  // the key aligned with query i
  const int right = p.causal ? 0 : p.window_right;
  int64_t lo = p.window_left >= 0 ? diagonal - p.window_left : 0;
  int64_t hi = right >= 0 ? diagonal + right + 1 : p.seqlen_k;
  lo = std::clamp<int64_t>(lo, 0, p.seqlen_k);
  hi = std::clamp<int64_t>(hi, 0, p.seqlen_k);
  *first = int(lo);
  *last = int(std::max(lo, hi));
}

void attention_row_fp64(const HostProblem& p, int b, int h, int i, double* out, double* lse) {
  const int D = p.head_dim;
  const int hk = h / (p.heads_q / p.heads_kv);
  int first = 0, last = 0;
  visible_key_range(p, i, &first, &last);
  const int n = last - first;
  std::fill(out, out + D, 0.0);
  if (n == 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  const float* q = row_ptr(p.q, p.q_strides, b, i, h);
  std::vector<double> s(n);
  double m = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < n; ++j) {
    const float* k = row_ptr(p.k, p.k_strides, b, first + j, hk);
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += double(q[d]) * double(k[d]);
    s[j] = dot * double(p.scale);
    if (p.softcap > 0.f) s[j] = double(p.softcap) * std::tanh(s[j] / double(p.softcap));
    m = std::max(m, s[j]);
  }
  double sum = 0;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  for (int j = 0; j < n; ++j) {
    const float* v = row_ptr(p.v, p.v_strides, b, first + j, hk);
    const double w = s[j] / sum;
    for (int d = 0; d < D; ++d) out[d] += w * double(v[d]);
  }
  *lse = m + std::log(sum);
}

void attention_row_lowp(const HostProblem& p, DType dtype, int b, int h, int i, float* out, float* lse) {
  const int D = p.head_dim;
  const int hk = h / (p.heads_q / p.heads_kv);
  int first = 0, last = 0;
  visible_key_range(p, i, &first, &last);
  const int n = last - first;
  std::fill(out, out + D, 0.f);
  if (n == 0) {
    *lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const float* q = row_ptr(p.q, p.q_strides, b, i, h);
  std::vector<float> s(n);
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) {
    const float* k = row_ptr(p.k, p.k_strides, b, first + j, hk);
    float dot = 0;
    for (int d = 0; d < D; ++d) dot += q[d] * k[d];
    s[j] = dot * p.scale;
    if (p.softcap > 0.f) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
    m = std::max(m, s[j]);
  }
  float sum = 0;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  std::vector<float> acc(D, 0.f);
  for (int j = 0; j < n; ++j) {
    const float* v = row_ptr(p.v, p.v_strides, b, first + j, hk);
    // P enters the PV product in the input precision; e4m3 as 2^8 P, the final kernel's scaling
    // (it keeps weights down to 2^-14 out of e4m3's subnormals).
    const float pj = dtype == DType::e4m3 ? round_to(s[j] * 256.f, dtype) / 256.f : round_to(s[j], dtype);
    for (int d = 0; d < D; ++d) acc[d] += pj * v[d];
  }
  for (int d = 0; d < D; ++d) out[d] = round_to(acc[d] / sum, output_dtype(dtype));
  *lse = m + std::log(sum);
}

namespace {

// The largest of `of_row(row)` over every batch entry, row and head of a [B, rows, heads, D]
// tensor.
template <typename F>
double largest_over_rows(const HostProblem& p, const float* base, const Strides& st, int rows, int heads, F of_row) {
  double largest = 0;
  for (int b = 0; b < p.batch; ++b)
    for (int i = 0; i < rows; ++i)
      for (int h = 0; h < heads; ++h) largest = std::max(largest, of_row(row_ptr(base, st, b, i, h)));
  return largest;
}

}  // namespace

double fp8_score_error(const HostProblem& p) {
  auto squared_norm = [&](const float* x) {
    double sum = 0;
    for (int d = 0; d < p.head_dim; ++d) sum += double(x[d]) * x[d];
    return sum;
  };
  const int k32_steps = (p.head_dim + 31) / 32;
  return 0x1p-13 * k32_steps * p.scale *
         std::sqrt(largest_over_rows(p, p.q, p.q_strides, p.seqlen_q, p.heads_q, squared_norm)) *
         std::sqrt(largest_over_rows(p, p.k, p.k_strides, p.seqlen_k, p.heads_kv, squared_norm));
}

double fp8_pv_sum_error(const HostProblem& p) {
  auto largest_magnitude = [&](const float* x) {
    double largest = 0;
    for (int d = 0; d < p.head_dim; ++d) largest = std::max(largest, std::abs(double(x[d])));
    return largest;
  };
  return 0x1p-14 * ((p.seqlen_k + 31) / 32) *
         largest_over_rows(p, p.v, p.v_strides, p.seqlen_k, p.heads_kv, largest_magnitude);
}

void attention_fp64(const HostProblem& p, std::vector<double>* out, std::vector<double>* lse) {
  const int D = p.head_dim;
  out->assign(size_t(p.batch) * p.seqlen_q * p.heads_q * D, 0.0);
  lse->assign(size_t(p.batch) * p.heads_q * p.seqlen_q, 0.0);
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.heads_q; ++h)
      for (int i = 0; i < p.seqlen_q; ++i)
        attention_row_fp64(p, b, h, i, out->data() + ((size_t(b) * p.seqlen_q + i) * p.heads_q + h) * D,
                           lse->data() + (size_t(b) * p.heads_q + h) * p.seqlen_q + i);
}

namespace {

// Row i's part of the backward: the keys it sees, [first, first + prob.size()), their
// probabilities and dS = P * (dO V^T - rowsum(dO * O)) * scale (the gradient of the raw score
// q.k; with softcapping times 1 - tanh^2, the cap's slope). Empty when the row sees no key.
void backward_row_fp64(const HostProblem& p, const float* dout, const Strides& dout_strides, int b, int h, int i,
                       int* first, std::vector<double>* prob, std::vector<double>* ds) {
  const int D = p.head_dim;
  const int hk = h / (p.heads_q / p.heads_kv);
  int last = 0;
  visible_key_range(p, i, first, &last);
  const int n = last - *first;
  prob->assign(n, 0.0);
  ds->assign(n, 0.0);
  if (n == 0) return;  // out is 0 whatever the inputs: no gradient
  std::vector<double> out(D);
  double lse = 0;
  attention_row_fp64(p, b, h, i, out.data(), &lse);
  const float* q = row_ptr(p.q, p.q_strides, b, i, h);
  const float* d_o = row_ptr(dout, dout_strides, b, i, h);
  double delta = 0;  // rowsum(dO * O)
  for (int d = 0; d < D; ++d) delta += double(d_o[d]) * out[d];
  for (int j = 0; j < n; ++j) {
    const float* k = row_ptr(p.k, p.k_strides, b, *first + j, hk);
    const float* v = row_ptr(p.v, p.v_strides, b, *first + j, hk);
    double dot = 0, dp = 0;
    for (int d = 0; d < D; ++d) {
      dot += double(q[d]) * double(k[d]);
      dp += double(d_o[d]) * double(v[d]);
    }
    double score = dot * double(p.scale), slope = double(p.scale);  // the score and d score / d(q.k)
    if (p.softcap > 0.f) {
      const double t = std::tanh(score / double(p.softcap));
      score = double(p.softcap) * t;
      slope *= 1 - t * t;
    }
    (*prob)[j] = std::exp(score - lse);
    (*ds)[j] = (*prob)[j] * (dp - delta) * slope;
  }
}

}  // namespace

void attention_backward_dq_row_fp64(const HostProblem& p, const float* dout, const Strides& dout_strides, int b, int h,
                                    int i, double* dq) {
  const int hk = h / (p.heads_q / p.heads_kv);
  int first = 0;
  std::vector<double> prob, ds;
  backward_row_fp64(p, dout, dout_strides, b, h, i, &first, &prob, &ds);
  std::fill(dq, dq + p.head_dim, 0.0);
  for (size_t j = 0; j < ds.size(); ++j) {
    const float* k = row_ptr(p.k, p.k_strides, b, first + int(j), hk);
    for (int d = 0; d < p.head_dim; ++d) dq[d] += ds[j] * double(k[d]);
  }
}

void attention_backward_fp64(const HostProblem& p, const float* dout, const Strides& dout_strides,
                             std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) {
  const int D = p.head_dim;
  dq->assign(size_t(p.batch) * p.seqlen_q * p.heads_q * D, 0.0);
  dk->assign(size_t(p.batch) * p.seqlen_k * p.heads_kv * D, 0.0);
  dv->assign(dk->size(), 0.0);
  std::vector<double> prob, ds;
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.heads_q; ++h) {
      const int hk = h / (p.heads_q / p.heads_kv);
      for (int i = 0; i < p.seqlen_q; ++i) {
        int first = 0;
        backward_row_fp64(p, dout, dout_strides, b, h, i, &first, &prob, &ds);
        const float* q = row_ptr(p.q, p.q_strides, b, i, h);
        const float* d_o = row_ptr(dout, dout_strides, b, i, h);
        double* dq_row = dq->data() + ((size_t(b) * p.seqlen_q + i) * p.heads_q + h) * D;
        for (size_t j = 0; j < ds.size(); ++j) {
          const int key = first + int(j);
          const float* k = row_ptr(p.k, p.k_strides, b, key, hk);
          double* dk_row = dk->data() + ((size_t(b) * p.seqlen_k + key) * p.heads_kv + hk) * D;
          double* dv_row = dv->data() + ((size_t(b) * p.seqlen_k + key) * p.heads_kv + hk) * D;
          for (int d = 0; d < D; ++d) {
            dq_row[d] += ds[j] * double(k[d]);
            dk_row[d] += ds[j] * double(q[d]);
            dv_row[d] += prob[j] * double(d_o[d]);
          }
        }
      }
    }
}

}  // namespace hattn::ref
