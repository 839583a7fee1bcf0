#include "harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

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
  if (s.softcap > 0.f) os << " softcap=" << s.softcap;
  if (s.window_left >= 0 || s.window_right >= 0) os << " window=(" << s.window_left << "," << s.window_right << ")";
  if (s.num_splits != 0) os << " num_splits=" << s.num_splits;
  if (s.pack_gqa.has_value()) os << " pack_gqa=" << (*s.pack_gqa ? "on" : "off");
  if (s.page_size > 0) os << " page_size=" << s.page_size;
  if (s.kv_batch_idx) os << " kv_batch_idx";
  if (s.fp8_cache) os << " e4m3-cache";
  if (!s.leftpad_k.empty()) {
    os << " leftpad_k=";
    for (size_t b = 0; b < s.leftpad_k.size() && b < 8; ++b) os << (b ? "," : "") << s.leftpad_k[b];
  }
  if (!s.seqlens_k_used.empty()) {
    os << " seqlens_k=";
    for (size_t b = 0; b < s.seqlens_k_used.size() && b < 8; ++b) os << (b ? "," : "") << s.seqlens_k_used[b];
  }
  if (s.varlen()) {
    os << " varlen q/k=";
    for (size_t b = 0; b < s.seqlens_q.size(); ++b) {
      if (b == 6 && s.seqlens_q.size() > 8) {
        os << "... (" << s.seqlens_q.size() << " sequences)";
        break;
      }
      os << (b ? "," : "") << s.seqlens_q[b] << "/" << s.seqlens_k[b];
    }
  }
  return os.str();
}

void set_varlen(Shape* s, std::vector<int> seqlens_q, std::vector<int> seqlens_k) {
  s->batch = int(seqlens_q.size());
  s->seqlen_q = std::max(1, *std::max_element(seqlens_q.begin(), seqlens_q.end()));
  s->seqlen_k = std::max(1, *std::max_element(seqlens_k.begin(), seqlens_k.end()));
  s->seqlens_q = std::move(seqlens_q);
  s->seqlens_k = std::move(seqlens_k);
}

namespace {

// Sequence b's queries and the keys it uses: its varlen lengths or the shape's, the keys capped
// by seqlens_k_used, less its left padding.
std::pair<int, int> sequence_lengths(const Shape& s, int b) {
  const int queries = s.varlen() ? s.seqlens_q[b] : s.seqlen_q;
  int keys = s.varlen() ? s.seqlens_k[b] : s.seqlen_k;
  if (!s.seqlens_k_used.empty()) keys = std::min(keys, std::max(0, s.seqlens_k_used[b]));
  if (!s.leftpad_k.empty()) keys -= std::clamp(s.leftpad_k[b], 0, keys);
  return {queries, keys};
}

}  // namespace

double forward_flops(const Shape& s) {
  if (s.varlen() || !s.seqlens_k_used.empty() || !s.leftpad_k.empty()) {  // the sum over the sequences
    double flops = 0;
    for (int b = 0; b < s.batch; ++b) {
      Shape one = s;
      one.seqlens_q.clear();
      one.seqlens_k.clear();
      one.seqlens_k_used.clear();
      one.leftpad_k.clear();
      one.batch = 1;
      std::tie(one.seqlen_q, one.seqlen_k) = sequence_lengths(s, b);
      flops += forward_flops(one);
    }
    return flops;
  }
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

double forward_bytes(const Shape& s) {
  double rows_q = 0, rows_k = 0;  // query rows and key rows in use, over the batch
  for (int b = 0; b < s.batch; ++b) {
    const auto [queries, keys] = sequence_lengths(s, b);
    rows_q += queries;
    rows_k += keys;
  }
  // bf16 and fp16: 2 bytes; e4m3 inputs (an FP8 cache's k and v, the FP8 forward's q too) 1; out 2.
  const bool fp8 = s.dtype == DType::e4m3;
  const double q_element = fp8 ? 1.0 : 2.0, kv_element = fp8 || s.fp8_cache ? 1.0 : 2.0;
  return s.head_dim * ((q_element + 2.0) * rows_q * s.heads_q + kv_element * 2.0 * rows_k * s.heads_kv);
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
// Strides padded by `pad` elements: 8 (16 bytes of a 16-bit tensor), or 16 for e4m3.
Strides padded_strides(int seqlen, int heads, int head_dim, int pad = 8) {
  Strides s;
  s.head = head_dim + pad;
  s.seq = heads * s.head + pad;
  s.batch = seqlen * s.seq + pad;
  return s;
}

size_t extent(const Strides& s, int batch, int seqlen, int heads, int head_dim) {
  return size_t((batch - 1) * s.batch + int64_t(seqlen - 1) * s.seq + (heads - 1) * s.head + head_dim);
}

size_t round_up16(size_t x) { return (x + 15) / 16 * 16; }

}  // namespace

Status make_workload(const Shape& shape, uint64_t seed, Workload* w) {
  // A variable-length batch's tensors are one packed sequence of total rows: B = 1 below.
  w->cu_q.assign(1, 0);
  w->cu_k.assign(1, 0);
  if (shape.varlen()) {
    if (shape.seqlens_k.size() != shape.seqlens_q.size() || shape.layout == Layout::packed_qkv)
      return {StatusCode::invalid_argument, "varlen: needs as many key as query lengths, and no packed_qkv layout"};
    for (size_t b = 0; b < shape.seqlens_q.size(); ++b) {
      w->cu_q.push_back(w->cu_q.back() + shape.seqlens_q[b]);
      w->cu_k.push_back(w->cu_k.back() + shape.seqlens_k[b]);
    }
  }
  const bool varlen = shape.varlen();
  const int B = varlen ? 1 : shape.batch, Sq = varlen ? w->cu_q.back() : shape.seqlen_q,
            Sk = varlen ? w->cu_k.back() : shape.seqlen_k, Hq = shape.heads_q, Hkv = shape.heads_kv,
            D = shape.head_dim;
  w->shape = shape;
  const bool fp8 = shape.dtype == DType::e4m3;  // the FP8 forward: q, k and v e4m3 codes
  TensorPlacement q, k, v, out;
  switch (shape.layout) {
    case Layout::contiguous:
    case Layout::padded: {
      const bool pad = shape.layout == Layout::padded;
      // e4m3 tensors (an FP8 cache's k and v, the FP8 forward's q too): 16-byte rows and starts
      // are 16 elements.
      const int q_pad = fp8 ? 16 : 8, kv_pad = fp8 || shape.fp8_cache ? 16 : 8;
      q.strides = pad ? padded_strides(Sq, Hq, D, q_pad) : contiguous_bshd(Sq, Hq, D);
      k.strides = pad ? padded_strides(Sk, Hkv, D, kv_pad) : contiguous_bshd(Sk, Hkv, D);
      v.strides = k.strides;
      out.strides = pad ? padded_strides(Sq, Hq, D) : contiguous_bshd(Sq, Hq, D);
      q.offset = 0;
      k.offset = round_up16(q.offset + extent(q.strides, B, Sq, Hq, D));
      v.offset = round_up16(k.offset + extent(k.strides, B, Sk, Hkv, D));
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

  // Host images: uniform values with unit variance around a non-zero mean, rounded to dtype
  // (e4m3 inputs: to bf16 here, to codes below).
  const DType value_dtype = fp8 ? DType::bf16 : shape.dtype;
  std::vector<uint16_t> bits(w->inputs.elements);
  w->inputs.host.resize(w->inputs.elements);
  const double half_width = std::sqrt(3.0);  // uniform on [-sqrt(3), sqrt(3)] has variance 1
  const float mean = 0.3f;
  parallel_for(bits.size(), [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const double u = double(splitmix64(seed * 0x2545f4914f6cdd1dull + i) >> 11) * 0x1.0p-53;
      const float x = mean + float((2 * u - 1) * half_width);
      bits[i] = ref::float_to_bits(x, value_dtype);
      w->inputs.host[i] = ref::bits_to_float(bits[i], value_dtype);
    }
  });
  if (!shape.leftpad_k.empty() && (int(shape.leftpad_k.size()) != shape.batch || shape.page_size > 0))
    return {StatusCode::invalid_argument, "leftpad_k: one offset per sequence, and not with page_size"};
  if (shape.kv_batch_idx && varlen) return {StatusCode::invalid_argument, "kv_batch_idx: not with varlen"};
  // Keys past a sequence's seqlens_k_used or before its leftpad_k are outside the problem (a
  // cache's unused rows): NaN there, on the GPU only, checks that no kernel lets them into a
  // result (0 x NaN is NaN).
  const bool used_set = !shape.seqlens_k_used.empty() && int(shape.seqlens_k_used.size()) == B;
  if ((used_set || !shape.leftpad_k.empty()) && !varlen) {
    for (const TensorPlacement* t : {&k, &v})
      for (int b = 0; b < B; ++b) {
        const int used = used_set ? std::clamp(shape.seqlens_k_used[b], 0, Sk) : Sk;
        const int pad = shape.leftpad_k.empty() ? 0 : std::clamp(shape.leftpad_k[b], 0, used);
        for (int j = 0; j < Sk; ++j)
          if (j < pad || j >= used)
            for (int h = 0; h < Hkv; ++h)
              std::fill_n(bits.begin() + t->offset + size_t(b * t->strides.batch + int64_t(j) * t->strides.seq +
                                                            h * t->strides.head),
                          D, uint16_t(0xFFFF));
      }
  }
  // e4m3 inputs (an FP8 KV cache's k and v; the FP8 forward's q, k and v): the elements become
  // e4m3 codes (the NaN poison the NaN code 0xFF), kept in the low byte of `bits` until upload,
  // and their host values code x descale.
  std::vector<float> descale[3];  // k's, v's, q's: [batch, heads_kv] (a query head takes its K/V head's)
  if (shape.fp8_cache || fp8) {
    if ((shape.fp8_cache && fp8) || shape.layout == Layout::packed_qkv)
      return {StatusCode::invalid_argument,
              "e4m3 inputs: fp8_cache needs bf16 or fp16 q, and neither takes the packed_qkv layout"};
    std::mt19937 rng(uint32_t(seed * 977 + 13));
    std::uniform_real_distribution<float> scale_dist(0.25f, 2.f);
    // The sequence of tensor entry b's row j (of `starts`' tensor): b, or in a varlen batch the
    // one holding row j.
    auto sequence_of_row = [&](const std::vector<int>& starts, int b, int j) {
      return varlen ? int(std::upper_bound(starts.begin(), starts.end(), j) - starts.begin()) - 1 : b;
    };
    for (int t = 0; t < (fp8 ? 3 : 2); ++t) {
      descale[t].resize(size_t(shape.batch) * Hkv);
      for (float& x : descale[t]) x = scale_dist(rng);
      const TensorPlacement& place = t == 0 ? k : t == 1 ? v : q;
      const int rows = t == 2 ? Sq : Sk, heads = t == 2 ? Hq : Hkv, group = t == 2 ? Hq / Hkv : 1;
      const std::vector<int>& starts = t == 2 ? w->cu_q : w->cu_k;
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < rows; ++j)
          for (int h = 0; h < heads; ++h) {
            const Strides& st = place.strides;
            const size_t at = place.offset + size_t(b * st.batch + int64_t(j) * st.seq + h * st.head);
            const float scale = descale[t][size_t(sequence_of_row(starts, b, j)) * Hkv + h / group];
            for (int d = 0; d < D; ++d) {
              const uint16_t code =
                  bits[at + d] == 0xFFFF ? 0xFF : ref::float_to_bits(w->inputs.host[at + d], DType::e4m3);
              bits[at + d] = code;
              w->inputs.host[at + d] = ref::bits_to_float(code, DType::e4m3) * scale;
            }
          }
    }
  }
  // e4m3 codes as bytes (the device image of e4m3 inputs), from their 16-bit slots.
  auto codes_of = [](const std::vector<uint16_t>& slots) {
    std::vector<uint8_t> codes(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) codes[i] = uint8_t(slots[i]);
    return codes;
  };
  const bool kv_codes = shape.fp8_cache || fp8;
  const size_t kv_elem_bytes = kv_codes ? 1 : 2;
  // Uploads a cache image (16-bit slots) as the kernel reads it: 16-bit, or e4m3 bytes.
  auto upload_cache = [&](void* to, const std::vector<uint16_t>& slots, const char* what) {
    if (!kv_codes) return cuda_check(cudaMemcpy(to, slots.data(), slots.size() * 2, cudaMemcpyHostToDevice), what);
    const std::vector<uint8_t> codes = codes_of(slots);
    return cuda_check(cudaMemcpy(to, codes.data(), codes.size(), cudaMemcpyHostToDevice), what);
  };
  // kv_batch_idx: sequence b's cache entry, a shuffle of batch + 1 entries (the last one spare).
  std::vector<int32_t> entry_of(size_t(B) + 1);
  for (int b = 0; b <= B; ++b) entry_of[b] = b;
  if (shape.kv_batch_idx) std::shuffle(entry_of.begin(), entry_of.end(), std::mt19937_64(seed ^ 0x9e3779b9u));
  const int entries = shape.kv_batch_idx ? B + 1 : B;
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
  if (kv_codes) {  // k and v (the FP8 forward: q too) from a byte image of the inputs (an FP8 cache's q bytes unused)
    if (!(s = w->codes.allocate(bits.size())).ok() ||
        !(s = upload_cache(w->codes.get(), bits, "uploading e4m3 codes")).ok())
      return s;
    auto* codes = static_cast<uint8_t*>(w->codes.get());
    p.k = codes + k.offset;
    p.v = codes + v.offset;
    if (fp8) p.q = codes + q.offset;
    if (shape.fp8_cache) p.kv_dtype = DType::e4m3;
    const int tensors = fp8 ? 3 : 2;
    const size_t n = size_t(shape.batch) * Hkv;
    if (!(s = w->descales.allocate(tensors * n * sizeof(float))).ok()) return s;
    auto* d = static_cast<float*>(w->descales.get());
    for (int t = 0; t < tensors; ++t) {
      s = cuda_check(cudaMemcpy(d + t * n, descale[t].data(), n * 4, cudaMemcpyHostToDevice), "uploading descales");
      if (!s.ok()) return s;
    }
    p.k_descale = d;
    p.v_descale = d + n;
    if (fp8) p.q_descale = d + 2 * n;
  }
  p.out = static_cast<uint16_t*>(w->output.device.get()) + out.offset;
  p.out_strides = out.strides;
  p.lse = shape.with_lse ? static_cast<float*>(w->lse.get()) : nullptr;
  p.causal = shape.causal;
  p.window_left = shape.window_left;
  p.window_right = shape.window_right;
  p.softmax_scale = shape.scale;
  p.softcap = shape.softcap;
  p.num_splits = shape.num_splits;
  p.pack_gqa = shape.pack_gqa;
  if (!shape.seqlens_k_used.empty()) {
    if (varlen || int(shape.seqlens_k_used.size()) != B)
      return {StatusCode::invalid_argument, "seqlens_k_used: one length per sequence, and not with varlen"};
    if (!(s = w->seqlens_k.allocate(size_t(B) * 4)).ok()) return s;
    if (!(s = cuda_check(cudaMemcpy(w->seqlens_k.get(), shape.seqlens_k_used.data(), size_t(B) * 4,
                                    cudaMemcpyHostToDevice),
                         "uploading seqlens_k"))
             .ok())
      return s;
    p.seqlens_k = static_cast<const int32_t*>(w->seqlens_k.get());
  }
  if (shape.page_size > 0) {
    // The cache: B * ceil(Sk / page_size) pages plus two spare ones, in a shuffled order; page
    // rows that hold no key in use are NaN.
    if (shape.seqlens_k_used.empty() || shape.layout == Layout::packed_qkv)
      return {StatusCode::invalid_argument, "page_size: needs seqlens_k_used and no packed_qkv layout"};
    const int per_seq = (Sk + shape.page_size - 1) / shape.page_size, num_pages = B * per_seq + 2;
    const int spare = entry_of[B];  // kv_batch_idx: the table's row of no sequence, pointing at the spare pages
    const size_t page_elems = size_t(shape.page_size) * Hkv * D, cache_elems = size_t(num_pages) * page_elems;
    std::vector<int32_t> order(num_pages);
    for (int i = 0; i < num_pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed ^ 0x5bd1e995u));
    std::vector<uint16_t> cache(2 * cache_elems);
    std::fill(cache.begin(), cache.end(), uint16_t(0xFFFF));
    std::vector<int32_t> table(size_t(entries) * per_seq);
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < per_seq; ++j) table[size_t(entry_of[b]) * per_seq + j] = order[size_t(b) * per_seq + j];
    if (shape.kv_batch_idx)
      for (int j = 0; j < per_seq; ++j) table[size_t(spare) * per_seq + j] = order[size_t(B) * per_seq + j % 2];
    for (int kv = 0; kv < 2; ++kv) {
      const TensorPlacement& src = kv == 0 ? k : v;
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < Sk; ++j)
          for (int h = 0; h < Hkv; ++h) {
            const size_t from = src.offset + size_t(b * src.strides.batch + int64_t(j) * src.strides.seq + h * src.strides.head);
            const size_t to = kv * cache_elems +
                              size_t(table[size_t(entry_of[b]) * per_seq + j / shape.page_size]) * page_elems +
                              (size_t(j % shape.page_size) * Hkv + h) * D;
            std::copy_n(bits.begin() + from, D, cache.begin() + to);
          }
    }
    const size_t cache_bytes = cache.size() * kv_elem_bytes, bytes = cache_bytes + table.size() * 4;
    if (!(s = w->pages.allocate(bytes)).ok()) return s;
    auto* base = static_cast<char*>(w->pages.get());
    if (!(s = upload_cache(base, cache, "uploading pages")).ok() ||
        !(s = cuda_check(cudaMemcpy(base + cache_bytes, table.data(), table.size() * 4, cudaMemcpyHostToDevice),
                         "uploading the block table"))
             .ok())
      return s;
    p.k = base;
    p.v = base + cache_elems * kv_elem_bytes;
    p.k_strides = p.v_strides = contiguous_bshd(shape.page_size, Hkv, D);  // batch stride: one page
    p.block_table = reinterpret_cast<const int32_t*>(base + cache_bytes);
    p.max_pages_per_seq = per_seq;
    p.num_pages = num_pages;
    p.page_size = shape.page_size;
  } else if (shape.kv_batch_idx) {
    // A dense cache of batch + 1 entries, NaN but for each sequence's keys in its entry.
    const size_t entry_elems = size_t(Sk) * Hkv * D, cache_elems = size_t(entries) * entry_elems;
    std::vector<uint16_t> cache(2 * cache_elems, uint16_t(0xFFFF));
    for (int kv = 0; kv < 2; ++kv) {
      const TensorPlacement& src = kv == 0 ? k : v;
      for (int b = 0; b < B; ++b)
        for (int j = 0; j < Sk; ++j)
          for (int h = 0; h < Hkv; ++h)
            std::copy_n(bits.begin() + src.offset +
                            size_t(b * src.strides.batch + int64_t(j) * src.strides.seq + h * src.strides.head),
                        D, cache.begin() + kv * cache_elems + entry_elems * entry_of[b] + (size_t(j) * Hkv + h) * D);
    }
    if (!(s = w->entries.allocate(cache.size() * kv_elem_bytes + size_t(B) * 4)).ok()) return s;
    auto* base = static_cast<char*>(w->entries.get());
    if (!(s = upload_cache(base, cache, "uploading entries")).ok()) return s;
    p.k = base;
    p.v = base + cache_elems * kv_elem_bytes;
    p.k_strides = p.v_strides = contiguous_bshd(Sk, Hkv, D);
  }
  if (shape.kv_batch_idx) {
    // The indices: after the dense entries, or alone (a paged cache's rows are in `pages`).
    if (shape.page_size > 0 && !(s = w->entries.allocate(size_t(B) * 4)).ok()) return s;
    auto* at = static_cast<char*>(w->entries.get()) + w->entries.bytes() - size_t(B) * 4;
    if (!(s = cuda_check(cudaMemcpy(at, entry_of.data(), size_t(B) * 4, cudaMemcpyHostToDevice),
                         "uploading kv_batch_idx"))
             .ok())
      return s;
    p.kv_batch_idx = reinterpret_cast<const int32_t*>(at);
    p.kv_batch = entries;
  }
  if (!shape.leftpad_k.empty()) {  // one offset per sequence (B is 1 for a varlen batch's tensors)
    const size_t bytes = shape.leftpad_k.size() * 4;
    if (!(s = w->leftpad_k.allocate(bytes)).ok()) return s;
    if (!(s = cuda_check(cudaMemcpy(w->leftpad_k.get(), shape.leftpad_k.data(), bytes, cudaMemcpyHostToDevice),
                         "uploading leftpad_k"))
             .ok())
      return s;
    p.leftpad_k = static_cast<const int32_t*>(w->leftpad_k.get());
  }
  if (varlen) {
    std::vector<int32_t> offsets(w->cu_q.begin(), w->cu_q.end());
    offsets.insert(offsets.end(), w->cu_k.begin(), w->cu_k.end());
    if (!(s = w->cu_seqlens.allocate(offsets.size() * sizeof(int32_t))).ok()) return s;
    if (!(s = cuda_check(cudaMemcpy(w->cu_seqlens.get(), offsets.data(), offsets.size() * sizeof(int32_t),
                                    cudaMemcpyHostToDevice),
                         "uploading cu_seqlens"))
             .ok())
      return s;
    p.batch = shape.batch;
    p.seqlen_q = shape.seqlen_q;
    p.seqlen_k = shape.seqlen_k;
    p.cu_seqlens_q = static_cast<const int32_t*>(w->cu_seqlens.get());
    p.cu_seqlens_k = p.cu_seqlens_q + w->cu_q.size();
    p.total_q = Sq;
    p.total_k = Sk;
  }

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
  h.softcap = shape.softcap;
  h.causal = shape.causal;
  h.window_left = shape.window_left;
  h.window_right = shape.window_right;
  w->fp8_score_error = fp8 ? ref::fp8_score_error(h) : 0.0;
  w->fp8_pv_sum_error = fp8 && shape.head_dim == 256 ? ref::fp8_pv_sum_error(h) : 0.0;
  return Status::Ok();
}

Status poison_outputs(Workload* w) {
  // 0xFF bytes: 0xFFFF is NaN in bf16 and fp16, 0xFFFFFFFF is NaN in fp32.
  Status s = cuda_check(cudaMemset(w->output.device.get(), 0xFF, w->output.device.bytes()), "poisoning out");
  if (!s.ok()) return s;
  return cuda_check(cudaMemset(w->lse.get(), 0xFF, w->lse.bytes()), "poisoning lse");
}

namespace {
int rows_of(const Shape& s, int b) { return s.varlen() ? s.seqlens_q[b] : s.seqlen_q; }
}  // namespace

std::vector<RowId> all_rows(const Shape& s) {
  std::vector<RowId> rows;
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads_q; ++h)
      for (int i = 0; i < rows_of(s, b); ++i) rows.push_back({b, h, i});
  return rows;
}

std::vector<RowId> sample_rows(const Shape& s, int count, uint64_t seed) {
  std::vector<RowId> rows;
  std::mt19937_64 rng(seed);
  const int heads_last = s.heads_q - 1, batch_last = s.batch - 1;
  for (const auto& [b, h] : {std::pair<int, int>{0, 0}, {batch_last, heads_last}}) {
    const int n = rows_of(s, b);
    for (int i : {0, 1, n - 1, n - 2, n / 2})
      if (i >= 0 && i < n) rows.push_back({b, h, i});
  }
  for (int tries = 0; int(rows.size()) < count && tries < 16 * count; ++tries) {
    const int b = std::uniform_int_distribution<int>(0, batch_last)(rng);
    const int h = std::uniform_int_distribution<int>(0, heads_last)(rng);
    if (rows_of(s, b) == 0) continue;  // an empty sequence of a varlen batch
    const int i = std::uniform_int_distribution<int>(0, rows_of(s, b) - 1)(rng);
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

ref::HostProblem sequence_host(const Workload& w, int b) {
  ref::HostProblem host = w.host;
  if (w.shape.varlen()) {
    host.batch = 1;
    host.seqlen_q = w.shape.seqlens_q[b];
    host.seqlen_k = w.shape.seqlens_k[b];
    host.q += int64_t(w.cu_q[b]) * host.q_strides.seq;
    host.k += int64_t(w.cu_k[b]) * host.k_strides.seq;
    host.v += int64_t(w.cu_k[b]) * host.v_strides.seq;
  }
  if (!w.shape.seqlens_k_used.empty()) host.seqlen_k = std::min(host.seqlen_k, std::max(0, w.shape.seqlens_k_used[b]));
  if (!w.shape.leftpad_k.empty()) {
    const int pad = std::clamp(w.shape.leftpad_k[b], 0, host.seqlen_k);
    host.k += int64_t(pad) * host.k_strides.seq;
    host.v += int64_t(pad) * host.v_strides.seq;
    host.seqlen_k -= pad;
  }
  return host;
}

CheckResult check_outputs(const Workload& w, const std::vector<RowId>& rows) {
  CheckResult r;
  const Shape& s = w.shape;
  const int D = s.head_dim;
  std::vector<uint16_t> out_bits(w.output.elements);
  const int lse_rows = s.varlen() ? w.cu_q.back() : s.seqlen_q;  // [B, Hq, Sq] or [Hq, total_q]
  std::vector<float> lse(size_t(s.varlen() ? 1 : s.batch) * s.heads_q * lse_rows);
  if (cudaMemcpy(out_bits.data(), w.output.device.get(), out_bits.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(lse.data(), w.lse.get(), lse.size() * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    r.passed = false;
    r.nan_outputs = -1;
    return r;
  }
  const DType dtype = s.dtype, out_dtype = output_dtype(dtype);  // the FP8 forward's out: bf16
  for (size_t i = 0; i < out_bits.size(); ++i) {
    if (w.is_output_element[i]) {
      if (!std::isfinite(ref::bits_to_float(out_bits[i], out_dtype))) ++r.nan_outputs;
    } else if (out_bits[i] != 0xFFFF) {
      ++r.touched_gaps;
    }
  }

  // Below the rounding step of either output dtype near 1: slack for outputs near zero. e4m3:
  // the emulation sums the scores (and P V) in fp32, the FP8 wgmma with about 14 bits
  // (fp8_score_error; fp8_pv_sum_error at D = 256).
  const double atol = (out_dtype == DType::bf16 ? 1e-3 : 2e-4) + w.fp8_pv_sum_error;
  const double lse_atol = 2e-4 + w.fp8_score_error;
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
      RowId row = rows[n];
      double ref_lse;
      float lowp_lse;
      // A varlen batch: sequence b on its own (a one-sequence problem over its rows), and its
      // row i at packed row cu_q[b] + i of batch entry 0.
      const ref::HostProblem host = sequence_host(w, row.b);
      ref::attention_row_fp64(host, s.varlen() ? 0 : row.b, row.h, row.i, ref_out.data(), &ref_lse);
      ref::attention_row_lowp(host, dtype, s.varlen() ? 0 : row.b, row.h, row.i, lowp_out.data(), &lowp_lse);
      if (s.varlen()) row = {0, row.h, w.cu_q[row.b] + row.i};
      const size_t base = size_t(row.b * os.batch + int64_t(row.i) * os.seq + row.h * os.head);
      for (int d = 0; d < D; ++d) {
        const double got = ref::bits_to_float(out_bits[base + d], out_dtype);
        if (std::isfinite(got)) part->max_err = std::max(part->max_err, std::abs(got - ref_out[d]));
        part->lowp_err = std::max(part->lowp_err, std::abs(double(lowp_out[d]) - ref_out[d]));
      }
      if (s.with_lse) {
        const double got = lse[(size_t(row.b) * s.heads_q + row.h) * lse_rows + row.i];
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
  const size_t work_per_row = size_t(std::max(s.seqlen_k, 1)) * size_t(D);
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

HostTensor random_normal(size_t count, DType dtype, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  HostTensor t;
  t.values.resize(count);
  t.bits.resize(count);
  for (size_t e = 0; e < count; ++e) {
    t.bits[e] = ref::float_to_bits(normal(*rng), dtype);
    t.values[e] = ref::bits_to_float(t.bits[e], dtype);
  }
  return t;
}

double backward_error_budget(DType dtype, double largest) {
  const double eps = dtype == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
  return 3 * eps * largest + 1e-6;
}

}  // namespace hattn::harness
