#include "harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

namespace hattn::harness {

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::contiguous: return "contiguous";
    case Layout::padded: return "padded";
    case Layout::packed_qkv: return "packed_qkv";
  }
  return "?";
}

std::string describe(const Shape& s) {
  std::ostringstream os;
  os << "B=" << s.batch << " Sq=" << s.seqlen_q << " Sk=" << s.seqlen_k << " Hq=" << s.heads_q
     << " Hkv=" << s.heads_kv << " D=" << s.head_dim << (s.causal ? " causal" : " full") << " "
     << dtype_name(s.dtype) << " " << layout_name(s.layout) << (s.with_lse ? " lse" : "");
  if (s.scale) os << " scale=" << *s.scale;
  if (s.window_left >= 0 || s.window_right >= 0) os << " window=(" << s.window_left << "," << s.window_right << ")";
  return os.str();
}

double forward_flops(const Shape& s) {
  const double per_entry = 4.0 * s.batch * s.heads_q * s.head_dim;
  const bool window = s.window_left >= 0 || s.window_right >= 0;
  if (!s.causal && !window) return per_entry * double(s.seqlen_q) * s.seqlen_k;
  if (s.seqlen_q == s.seqlen_k && !window) return per_entry * double(s.seqlen_q) * s.seqlen_k / 2;
  ref::HostProblem h;
  h.seqlen_q = s.seqlen_q;
  h.seqlen_k = s.seqlen_k;
  h.causal = s.causal;
  h.window_left = s.window_left;
  h.window_right = s.window_right;
  double visible = 0;
  for (int i = 0; i < s.seqlen_q; ++i) {
    int first = 0, last = 0;
    ref::visible_key_range(h, i, &first, &last);
    visible += last - first;
  }
  return per_entry * visible;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  std::swap(ptr_, o.ptr_);
  std::swap(bytes_, o.bytes_);
  return *this;
}
Status DeviceBuffer::allocate(size_t bytes) {
  if (ptr_) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  cudaError_t err = cudaMalloc(&ptr_, std::max<size_t>(bytes, 16));
  if (err != cudaSuccess) {
    cudaGetLastError();
    ptr_ = nullptr;
    return {StatusCode::cuda_error, "cudaMalloc(" + std::to_string(bytes) + "): " + cudaGetErrorString(err)};
  }
  bytes_ = bytes;
  return Status::Ok();
}

namespace {

Status cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return {StatusCode::cuda_error, std::string(what) + ": " + cudaGetErrorString(err)};
}

// Runs body(begin, end) over [0, n) on a few threads, or on this one when n < serial_below:
// input generation for the benchmark's large shapes, and the reference check of large
// outputs, would otherwise dominate the run time.
template <typename F>
void parallel_for(size_t n, F body, size_t serial_below = size_t(1) << 20) {
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  if (n < serial_below || threads == 1) return body(size_t(0), n);
  std::vector<std::thread> pool;
  const size_t step = (n + threads - 1) / threads;
  for (size_t t = 0; t < threads; ++t) {
    const size_t begin = t * step, end = std::min(n, begin + step);
    if (begin < end) pool.emplace_back(body, begin, end);
  }
  for (auto& th : pool) th.join();
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct TensorPlacement {
  size_t offset;  // elements from the start of the allocation
  Strides strides;
};

// Strides with every dimension padded by 8 elements (16 bytes), so a kernel that assumes a
// dense layout reads or writes the wrong elements.
Strides padded_strides(int seqlen, int heads, int head_dim) {
  Strides s;
  s.head = head_dim + 8;
  s.seq = heads * s.head + 8;
  s.batch = seqlen * s.seq + 8;
  return s;
}

size_t extent(const Strides& s, int batch, int seqlen, int heads, int head_dim) {
  return size_t((batch - 1) * s.batch + int64_t(seqlen - 1) * s.seq + (heads - 1) * s.head + head_dim);
}

size_t round_up8(size_t x) { return (x + 7) / 8 * 8; }

}  // namespace

Status make_workload(const Shape& shape, uint64_t seed, Workload* w) {
  const int B = shape.batch, Sq = shape.seqlen_q, Sk = shape.seqlen_k, Hq = shape.heads_q, Hkv = shape.heads_kv,
            D = shape.head_dim;
  w->shape = shape;
  TensorPlacement q, k, v, out;
  switch (shape.layout) {
    case Layout::contiguous:
    case Layout::padded: {
      const bool pad = shape.layout == Layout::padded;
      q.strides = pad ? padded_strides(Sq, Hq, D) : contiguous_bshd(Sq, Hq, D);
      k.strides = pad ? padded_strides(Sk, Hkv, D) : contiguous_bshd(Sk, Hkv, D);
      v.strides = k.strides;
      out.strides = pad ? padded_strides(Sq, Hq, D) : contiguous_bshd(Sq, Hq, D);
      q.offset = 0;
      k.offset = round_up8(q.offset + extent(q.strides, B, Sq, Hq, D));
      v.offset = round_up8(k.offset + extent(k.strides, B, Sk, Hkv, D));
      w->inputs.elements = v.offset + extent(v.strides, B, Sk, Hkv, D);
      break;
    }
    case Layout::packed_qkv: {
      if (Sq != Sk || Hq != Hkv)
        return {StatusCode::invalid_argument, "layout: packed_qkv needs seqlen_q == seqlen_k and heads_q == heads_kv"};
      Strides s;
      s.head = D;
      s.seq = int64_t(3) * Hq * D;
      s.batch = Sq * s.seq;
      q = {0, s};
      k = {size_t(Hq) * D, s};
      v = {size_t(2) * Hq * D, s};
      out.strides = contiguous_bshd(Sq, Hq, D);
      w->inputs.elements = size_t(B) * s.batch;
      break;
    }
  }
  out.offset = 0;
  w->output.elements = extent(out.strides, B, Sq, Hq, D);

  // Host images: uniform values with unit variance around a non-zero mean, rounded to dtype.
  std::vector<uint16_t> bits(w->inputs.elements);
  w->inputs.host.resize(w->inputs.elements);
  const double half_width = std::sqrt(3.0);  // uniform on [-sqrt(3), sqrt(3)] has variance 1
  const float mean = 0.3f;
  parallel_for(bits.size(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const double u = double(splitmix64(seed * 0x2545f4914f6cdd1dull + i) >> 11) * 0x1.0p-53;
      const float x = mean + float((2 * u - 1) * half_width);
      bits[i] = ref::float_to_bits(x, shape.dtype);
      w->inputs.host[i] = ref::bits_to_float(bits[i], shape.dtype);
    }
  });
  Status s = w->inputs.device.allocate(bits.size() * 2);
  if (!s.ok()) return s;
  if (!(s = cuda_check(cudaMemcpy(w->inputs.device.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
                       "uploading inputs"))
           .ok())
    return s;
  if (!(s = w->output.device.allocate(w->output.elements * 2)).ok()) return s;
  if (!(s = w->lse.allocate(size_t(B) * Hq * Sq * sizeof(float))).ok()) return s;

  w->is_output_element.assign(w->output.elements, 0);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < Sq; ++i)
      for (int h = 0; h < Hq; ++h) {
        const size_t base = size_t(b * out.strides.batch + int64_t(i) * out.strides.seq + h * out.strides.head);
        std::fill_n(w->is_output_element.begin() + base, D, 1);
      }

  auto* dev = static_cast<uint16_t*>(w->inputs.device.get());
  AttentionProblem& p = w->problem;
  p = AttentionProblem{};
  p.dtype = shape.dtype;
  p.batch = B;
  p.seqlen_q = Sq;
  p.seqlen_k = Sk;
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.head_dim = D;
  p.q = dev + q.offset;
  p.q_strides = q.strides;
  p.k = dev + k.offset;
  p.k_strides = k.strides;
  p.v = dev + v.offset;
  p.v_strides = v.strides;
  p.out = static_cast<uint16_t*>(w->output.device.get()) + out.offset;
  p.out_strides = out.strides;
  p.lse = shape.with_lse ? static_cast<float*>(w->lse.get()) : nullptr;
  p.causal = shape.causal;
  p.window_left = shape.window_left;
  p.window_right = shape.window_right;
  p.softmax_scale = shape.scale;

  ref::HostProblem& h = w->host;
  h.batch = B;
  h.seqlen_q = Sq;
  h.seqlen_k = Sk;
  h.heads_q = Hq;
  h.heads_kv = Hkv;
  h.head_dim = D;
  h.q = w->inputs.host.data() + q.offset;
  h.q_strides = q.strides;
  h.k = w->inputs.host.data() + k.offset;
  h.k_strides = k.strides;
  h.v = w->inputs.host.data() + v.offset;
  h.v_strides = v.strides;
  h.scale = p.scale();
  h.causal = shape.causal;
  h.window_left = shape.window_left;
  h.window_right = shape.window_right;
  return Status::Ok();
}

Status poison_outputs(Workload* w) {
  // 0xFF bytes: 0xFFFF is NaN in bf16 and fp16, 0xFFFFFFFF is NaN in fp32.
  Status s = cuda_check(cudaMemset(w->output.device.get(), 0xFF, w->output.device.bytes()), "poisoning out");
  if (!s.ok()) return s;
  return cuda_check(cudaMemset(w->lse.get(), 0xFF, w->lse.bytes()), "poisoning lse");
}

std::vector<RowId> all_rows(const Shape& s) {
  std::vector<RowId> rows;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < s.seqlen_q; ++i) rows.push_back({b, h, i});
  return rows;
}

std::vector<RowId> sample_rows(const Shape& s, int count, uint64_t seed) {
  std::vector<RowId> rows;
  std::mt19937_64 rng(seed);
  const int heads_last = s.heads_q - 1, batch_last = s.batch - 1;
  const int edge[] = {0, 1, s.seqlen_q - 1, s.seqlen_q - 2, s.seqlen_q / 2};
  for (int i : edge)
    if (i >= 0) {
      rows.push_back({0, 0, i});
      rows.push_back({batch_last, heads_last, i});
    }
  while (int(rows.size()) < count) {
    const int b = std::uniform_int_distribution<int>(0, batch_last)(rng);
    const int h = std::uniform_int_distribution<int>(0, heads_last)(rng);
    const int i = std::uniform_int_distribution<int>(0, s.seqlen_q - 1)(rng);
    rows.push_back({b, h, i});
  }
  return rows;
}

std::string CheckResult::summary() const {
  std::ostringstream os;
  os << (passed ? "PASS" : "FAIL") << " rows=" << rows_checked << " max_err=" << max_err << " budget=" << budget
     << " lse_err=" << lse_max_err << " lse_budget=" << lse_budget << " nan=" << nan_outputs
     << " touched_gaps=" << touched_gaps << " lse_mismatch=" << lse_mismatches;
  return os.str();
}

CheckResult check_outputs(const Workload& w, const std::vector<RowId>& rows) {
  CheckResult r;
  const Shape& s = w.shape;
  const int D = s.head_dim;
  std::vector<uint16_t> out_bits(w.output.elements);
  std::vector<float> lse(size_t(s.batch) * s.heads_q * s.seqlen_q);
  if (cudaMemcpy(out_bits.data(), w.output.device.get(), out_bits.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(lse.data(), w.lse.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    r.passed = false;
    r.nan_outputs = -1;
    return r;
  }
  for (size_t i = 0; i < out_bits.size(); ++i) {
    if (w.is_output_element[i]) {
      if (!std::isfinite(ref::bits_to_float(out_bits[i], s.dtype))) ++r.nan_outputs;
    } else if (out_bits[i] != 0xFFFF) {
      ++r.touched_gaps;
    }
  }

  const DType dtype = s.dtype;
  // Below the rounding step of either dtype near 1: slack for outputs near zero.
  const double atol = dtype == DType::bf16 ? 1e-3 : 2e-4;
  const double lse_atol = 2e-4;
  // Rows are independent: each chunk of rows keeps its own maxima and merges them at the end.
  struct Partial {
    double max_err = 0, lowp_err = 0, lse_max_err = 0, lowp_lse_err = 0;
    int lse_mismatches = 0;
  };
  const Strides& os = w.problem.out_strides;
  auto check_rows = [&](size_t begin, size_t end, Partial* part) {
    std::vector<double> ref_out(D);
    std::vector<float> lowp_out(D);
    for (size_t n = begin; n < end; ++n) {
      const RowId& row = rows[n];
      double ref_lse;
      float lowp_lse;
      ref::attention_row_fp64(w.host, row.b, row.h, row.i, ref_out.data(), &ref_lse);
      ref::attention_row_lowp(w.host, dtype, row.b, row.h, row.i, lowp_out.data(), &lowp_lse);
      const size_t base = size_t(row.b * os.batch + int64_t(row.i) * os.seq + row.h * os.head);
      for (int d = 0; d < D; ++d) {
        const double got = ref::bits_to_float(out_bits[base + d], dtype);
        if (std::isfinite(got)) part->max_err = std::max(part->max_err, std::abs(got - ref_out[d]));
        part->lowp_err = std::max(part->lowp_err, std::abs(double(lowp_out[d]) - ref_out[d]));
      }
      if (s.with_lse) {
        const double got = lse[(size_t(row.b) * s.heads_q + row.h) * s.seqlen_q + row.i];
        if (std::isinf(ref_lse)) {
          if (!(std::isinf(got) && got < 0)) ++part->lse_mismatches;
        } else if (!std::isfinite(got)) {
          ++part->lse_mismatches;
        } else {
          part->lse_max_err = std::max(part->lse_max_err, std::abs(got - ref_lse));
          part->lowp_lse_err = std::max(part->lowp_lse_err, std::abs(double(lowp_lse) - ref_lse));
        }
      }
    }
  };
  Partial total;
  std::mutex merge;
  // Checks under about 4M multiply-adds of reference work stay on this thread.
  const size_t work_per_row = size_t(s.seqlen_k) * size_t(D);
  const size_t serial_below_rows = ((size_t(1) << 22) + work_per_row - 1) / work_per_row;
  parallel_for(
      rows.size(),
      [&](size_t begin, size_t end) {
        Partial part;
        check_rows(begin, end, &part);
        const std::lock_guard<std::mutex> lock(merge);
        total.max_err = std::max(total.max_err, part.max_err);
        total.lowp_err = std::max(total.lowp_err, part.lowp_err);
        total.lse_max_err = std::max(total.lse_max_err, part.lse_max_err);
        total.lowp_lse_err = std::max(total.lowp_lse_err, part.lowp_lse_err);
        total.lse_mismatches += part.lse_mismatches;
      },
      serial_below_rows);
  r.max_err = total.max_err;
  r.lse_max_err = total.lse_max_err;
  r.lse_mismatches = total.lse_mismatches;
  const double lowp_err = total.lowp_err, lowp_lse_err = total.lowp_lse_err;
  r.rows_checked = int(rows.size());
  r.budget = 2 * lowp_err + atol;
  r.lse_budget = 2 * lowp_lse_err + lse_atol;
  r.passed = r.nan_outputs == 0 && r.touched_gaps == 0 && r.lse_mismatches == 0 && r.max_err <= r.budget &&
             r.lse_max_err <= r.lse_budget;
  return r;
}

}  // namespace hattn::harness
