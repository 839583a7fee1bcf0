// append_kv(): writes a decoding step's new keys and values into a dense or paged KV cache,
// with optional rotary embedding of the new keys and of q, in one launch.
//
// Each thread owns one pair of features of one row: the pair a rotation mixes, (2i, 2i + 1)
// interleaved or (i, i + rotary_dim / 2) in halves, and past rotary_dim the plain pair
// (2i, 2i + 1), which is copied. So a row of D features takes D / 2 threads and no thread
// reads what another writes. Rows are the new K/V rows (B x seqlen_new x Hkv) and, with a q
// to rotate, q's rows (B x seqlen_q x Hq), one grid over both.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common.cuh"
#include "device_checks.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

constexpr const char* kName = "append_kv";
constexpr int kThreads = 128;

Status invalid(const std::string& message) { return {StatusCode::invalid_argument, message}; }

// Strides of a [batch, rows, heads, head_dim] tensor: positive wherever the extent exceeds 1.
Status check_strides(const char* name, const Strides& s, int batch, int64_t rows, int heads) {
  const struct {
    const char* what;
    int64_t stride, extent;
  } dims[3] = {{"batch", s.batch, batch}, {"seq", s.seq, rows}, {"head", s.head, heads}};
  for (const auto& d : dims)
    if (d.extent > 1 && d.stride <= 0)
      return invalid(std::string(name) + ": " + d.what + " stride " + std::to_string(d.stride) + " must be positive");
  return Status::Ok();
}

// The features a thread owns: its pair index, and whether (and by which angle) it rotates.
struct PairSlot {
  int first, second;  // feature indices
  bool rotates;
};

__device__ __forceinline__ PairSlot pair_slot(int pair, int rotary_dim, bool interleaved) {
  const int half = rotary_dim / 2;
  if (pair >= half) return {2 * pair, 2 * pair + 1, false};  // past rotary_dim: copied as is
  return interleaved ? PairSlot{2 * pair, 2 * pair + 1, true} : PairSlot{pair, pair + half, true};
}

// (x, y) turned by the angle whose cosine and sine are row `position`, column `pair` of the tables.
template <typename T>
__device__ __forceinline__ void rotate(float& x, float& y, const KvAppendProblem& p, int64_t position, int pair) {
  const int64_t at = position * (p.rotary_dim / 2) + pair;
  const float c = to_float(static_cast<const T*>(p.rotary_cos)[at]);
  const float s = to_float(static_cast<const T*>(p.rotary_sin)[at]);
  const float x_turned = x * c - y * s;
  y = x * s + y * c;
  x = x_turned;
}

// An FP8 cache's pair: the e4m3 codes of (x, y) / descale (the quotients rounded to fp32, then
// to the nearest code), written as two bytes `at` elements into the cache at the pair's
// features (first, first + 1 or first, first + rotary_dim / 2). A zero descale writes zeros
// rather than x / 0.
__device__ __forceinline__ void store_codes(uint8_t* cache, int64_t at, const PairSlot& slot, float x, float y,
                                            const float* descale, int64_t descale_at) {
  const float scale = descale != nullptr ? descale[descale_at] : 1.f;
  const float2 quotient = scale > 0.f ? make_float2(__fdiv_rn(x, scale), __fdiv_rn(y, scale)) : make_float2(0.f, 0.f);
  const __nv_fp8x2_storage_t codes = __nv_cvt_float2_to_fp8x2(quotient, __NV_SATFINITE, __NV_E4M3);
  cache[at + slot.first] = uint8_t(codes & 0xFF);
  cache[at + slot.second] = uint8_t(codes >> 8);
}

// kE4m3: the cache holds e4m3 codes (store_codes); else T, copied (or rotated) as is.
template <typename T, bool kE4m3>
__global__ void __launch_bounds__(kThreads) append_kv_kernel(const KvAppendProblem p, int64_t capacity, int64_t kv_rows,
                                                            int64_t rows) {
  const int pairs = p.head_dim / 2;
  const int pair = int(threadIdx.x) % pairs;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / pairs) + threadIdx.x / pairs;

  // The lengths after the append (the attention's seqlens_k); a grid-stride loop over batch.
  if (p.seqlens_out != nullptr)
    for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < p.batch; b += int64_t(gridDim.x) * blockDim.x)
      p.seqlens_out[b] = int32_t(min(int64_t(max(p.seqlens[b], 0)) + p.seqlen_new, int64_t(INT32_MAX)));
  if (row >= rows) return;

  const bool rotary = p.rotary_cos != nullptr;
  const PairSlot slot = pair_slot(pair, rotary ? p.rotary_dim : 0, p.rotary_interleaved);
  if (row < kv_rows) {
    // New row i of sequence b, K/V head h.
    const int h = int(row % p.heads_kv);
    const int64_t i = row / p.heads_kv % p.seqlen_new;
    const int b = int(row / p.heads_kv / p.seqlen_new);
    const int64_t position = int64_t(max(p.seqlens[b], 0)) + i;
    if (position >= capacity) return;  // past the cache: not written (the attention clamps to it)
    // The sequence's cache entry: its dense batch entry or block table row.
    const int entry = p.kv_batch_idx != nullptr ? min(max(p.kv_batch_idx[b], 0), p.kv_batch - 1) : b;
    int64_t k_at, v_at;  // the row's first element in each cache
    if (p.block_table != nullptr) {
      const int page_slot = int(position / p.page_size);
      const int page = min(max(p.block_table[int64_t(entry) * p.max_pages_per_seq + page_slot], 0), p.num_pages - 1);
      const int64_t in_page = position % p.page_size;
      k_at = page * p.k_cache_strides.batch + in_page * p.k_cache_strides.seq + h * p.k_cache_strides.head;
      v_at = page * p.v_cache_strides.batch + in_page * p.v_cache_strides.seq + h * p.v_cache_strides.head;
    } else {
      k_at = entry * p.k_cache_strides.batch + position * p.k_cache_strides.seq + h * p.k_cache_strides.head;
      v_at = entry * p.v_cache_strides.batch + position * p.v_cache_strides.seq + h * p.v_cache_strides.head;
    }
    const T* k_row = static_cast<const T*>(p.k_new) + b * p.k_new_strides.batch + i * p.k_new_strides.seq +
                     h * p.k_new_strides.head;
    const T* v_row = static_cast<const T*>(p.v_new) + b * p.v_new_strides.batch + i * p.v_new_strides.seq +
                     h * p.v_new_strides.head;
    if constexpr (kE4m3) {  // descales by sequence and K/V head, as the attention reads them
      float x = to_float(k_row[slot.first]), y = to_float(k_row[slot.second]);
      if (slot.rotates) rotate<T>(x, y, p, position, pair);
      const int64_t descale_at = int64_t(b) * p.heads_kv + h;
      store_codes(static_cast<uint8_t*>(p.k_cache), k_at, slot, x, y, p.k_descale, descale_at);
      store_codes(static_cast<uint8_t*>(p.v_cache), v_at, slot, to_float(v_row[slot.first]),
                  to_float(v_row[slot.second]), p.v_descale, descale_at);
      return;
    }
    T* k_out = static_cast<T*>(p.k_cache) + k_at;
    T* v_out = static_cast<T*>(p.v_cache) + v_at;
    v_out[slot.first] = v_row[slot.first];
    v_out[slot.second] = v_row[slot.second];
    if (slot.rotates) {
      float x = to_float(k_row[slot.first]), y = to_float(k_row[slot.second]);
      rotate<T>(x, y, p, position, pair);
      k_out[slot.first] = from_float<T>(x);
      k_out[slot.second] = from_float<T>(y);
    } else {
      k_out[slot.first] = k_row[slot.first];
      k_out[slot.second] = k_row[slot.second];
    }
    return;
  }
  // Row i of q for sequence b, query head h: rotated at its position into q_rotated.
  const int64_t q_row = row - kv_rows;
  const int h = int(q_row % p.heads_q);
  const int64_t i = q_row / p.heads_q % p.seqlen_q;
  const int b = int(q_row / p.heads_q / p.seqlen_q);
  const int64_t position =
      min(int64_t(max(p.seqlens[b], 0)) + (p.q_positions_per_row ? i : 0), int64_t(p.rotary_seqlen) - 1);
  const T* q_in = static_cast<const T*>(p.q) + b * p.q_strides.batch + i * p.q_strides.seq + h * p.q_strides.head;
  T* q_out = static_cast<T*>(p.q_rotated) + b * p.q_rotated_strides.batch + i * p.q_rotated_strides.seq +
             h * p.q_rotated_strides.head;
  float x = to_float(q_in[slot.first]), y = to_float(q_in[slot.second]);
  if (slot.rotates) rotate<T>(x, y, p, position, pair);
  q_out[slot.first] = from_float<T>(x);
  q_out[slot.second] = from_float<T>(y);
}

}  // namespace

Status validate_append_kv_arguments(const KvAppendProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::fp16)
    return invalid("dtype: must be bf16 or fp16 (got value " + std::to_string(int(p.dtype)) + ")");
  if (p.cache_dtype.has_value() && *p.cache_dtype != p.dtype && *p.cache_dtype != DType::e4m3)
    return invalid(std::string("cache_dtype: the cache is dtype (") + dtype_name(p.dtype) + ") or e4m3, got value " +
                   std::to_string(int(*p.cache_dtype)));
  for (const auto& [name, ptr] : {std::pair<const char*, const float*>{"k_descale", p.k_descale},
                                  std::pair<const char*, const float*>{"v_descale", p.v_descale}}) {
    if (ptr == nullptr) continue;
    if (!p.has_fp8_cache()) return invalid(std::string(name) + ": only with an e4m3 cache (cache_dtype)");
    if (reinterpret_cast<uintptr_t>(ptr) % alignof(float) != 0)
      return invalid(std::string(name) + ": pointer must be 4-byte aligned (fp32 [batch, heads_kv])");
  }
  if (p.batch < 1) return invalid("batch: must be >= 1, got " + std::to_string(p.batch));
  if (p.seqlen_new < 0) return invalid("seqlen_new: must be >= 0, got " + std::to_string(p.seqlen_new));
  if (p.heads_kv < 1) return invalid("heads_kv: must be >= 1, got " + std::to_string(p.heads_kv));
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return invalid("head_dim: must be 64, 128 or 256, got " + std::to_string(p.head_dim));
  if (p.seqlens == nullptr) return invalid("seqlens: pointer is null (each sequence's keys before the append)");
  if (p.seqlens_out != nullptr && p.seqlens_out == p.seqlens)
    return invalid("seqlens_out: must not alias seqlens (other threads still read it)");
  Status s;
  if (p.is_paged()) {
    if (p.max_pages_per_seq < 1 || p.num_pages < 1 || p.page_size < 1)
      return invalid("block_table: max_pages_per_seq, num_pages and page_size must be >= 1, got " +
                     std::to_string(p.max_pages_per_seq) + ", " + std::to_string(p.num_pages) + ", " +
                     std::to_string(p.page_size));
    if (p.capacity() > INT32_MAX)
      return invalid("block_table: max_pages_per_seq * page_size keys exceed 2^31 - 1");
  } else if (p.cache_seqlen < 0) {
    return invalid("cache_seqlen: must be >= 0, got " + std::to_string(p.cache_seqlen));
  }
  if (!(s = check_cache_entries(p.kv_batch_idx, p.kv_batch)).ok()) return s;
  const int cache_batch = p.is_paged() ? p.num_pages : p.kv_batch_idx != nullptr ? p.kv_batch : p.batch;
  const int64_t cache_rows = p.is_paged() ? p.page_size : p.cache_seqlen;
  const struct {
    const char* name;
    const void* ptr;
    const Strides& strides;
    int batch;
    int64_t rows;
  } tensors[] = {{"k_new", p.k_new, p.k_new_strides, p.batch, p.seqlen_new},
                 {"v_new", p.v_new, p.v_new_strides, p.batch, p.seqlen_new},
                 {"k_cache", p.k_cache, p.k_cache_strides, cache_batch, cache_rows},
                 {"v_cache", p.v_cache, p.v_cache_strides, cache_batch, cache_rows}};
  for (const auto& t : tensors) {
    if (p.seqlen_new > 0 && t.ptr == nullptr) return invalid(std::string(t.name) + ": pointer is null");
    if (!(s = check_strides(t.name, t.strides, t.batch, t.rows, p.heads_kv)).ok()) return s;
  }
  const bool rotary = p.rotary_cos != nullptr || p.rotary_sin != nullptr;
  if (rotary) {
    if (p.rotary_cos == nullptr || p.rotary_sin == nullptr)
      return invalid(std::string(p.rotary_cos == nullptr ? "rotary_cos" : "rotary_sin") +
                     ": pointer is null (rotary takes both tables)");
    if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim)
      return invalid("rotary_dim: must be even, from 2 to head_dim (" + std::to_string(p.head_dim) + "), got " +
                     std::to_string(p.rotary_dim));
    if (p.rotary_seqlen < 1 || p.rotary_seqlen < p.capacity())
      return invalid("rotary_seqlen: must be at least the cache's keys per sequence (" + std::to_string(p.capacity()) +
                     ") and >= 1, got " + std::to_string(p.rotary_seqlen));
  }
  if (p.q != nullptr || p.q_rotated != nullptr) {
    if (!rotary) return invalid("q: rotated only with rotary_cos and rotary_sin");
    if (p.q == nullptr || p.q_rotated == nullptr)
      return invalid(std::string(p.q == nullptr ? "q" : "q_rotated") + ": pointer is null (q is rotated into q_rotated)");
    if (p.seqlen_q < 1 || p.heads_q < 1)
      return invalid("seqlen_q, heads_q: must be >= 1 with q, got " + std::to_string(p.seqlen_q) + ", " +
                     std::to_string(p.heads_q));
    if (!(s = check_strides("q", p.q_strides, p.batch, p.seqlen_q, p.heads_q)).ok()) return s;
    if (!(s = check_strides("q_rotated", p.q_rotated_strides, p.batch, p.seqlen_q, p.heads_q)).ok()) return s;
    if (p.q == p.q_rotated) return invalid("q_rotated: must not alias q");
  }
  return Status::Ok();
}

Status append_kv(const KvAppendProblem& p, cudaStream_t stream) {
  Status s = validate_append_kv_arguments(p);
  if (!s.ok()) return s;
  s = check_device_and_pointers({{"k_new", p.k_new}, {"v_new", p.v_new}, {"k_cache", p.k_cache},
                                 {"v_cache", p.v_cache}, {"block_table", p.block_table},
                                 {"kv_batch_idx", p.kv_batch_idx}, {"seqlens", p.seqlens},
                                 {"seqlens_out", p.seqlens_out}, {"rotary_cos", p.rotary_cos},
                                 {"rotary_sin", p.rotary_sin}, {"q", p.q}, {"q_rotated", p.q_rotated},
                                 {"k_descale", p.k_descale}, {"v_descale", p.v_descale}});
  if (!s.ok()) return s;

  const int64_t kv_rows = p.capacity() > 0 ? int64_t(p.batch) * p.seqlen_new * p.heads_kv : 0;
  const int64_t q_rows = p.q != nullptr ? int64_t(p.batch) * p.seqlen_q * p.heads_q : 0;
  const int rows_per_block = kThreads / (p.head_dim / 2);
  int64_t blocks = (kv_rows + q_rows + rows_per_block - 1) / rows_per_block;
  if (p.seqlens_out != nullptr) blocks = std::max<int64_t>(blocks, 1);
  if (blocks == 0) return Status::Ok();
  if (blocks > INT32_MAX) return {StatusCode::not_supported, "append_kv: more than 2^31 - 1 blocks of rows"};
  const bool e4m3 = p.has_fp8_cache();
  const auto kernel = p.dtype == DType::bf16 ? (e4m3 ? append_kv_kernel<__nv_bfloat16, true>
                                                     : append_kv_kernel<__nv_bfloat16, false>)
                                             : (e4m3 ? append_kv_kernel<__half, true> : append_kv_kernel<__half, false>);
  kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p, p.capacity(), kv_rows, kv_rows + q_rows);
  return launch_status(kName);
}

}  // namespace hattn
