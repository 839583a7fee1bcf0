// The checking mode: the promises a call's device arrays make, which the host cannot see
// without reading them (varlen offsets, keys in use, page and entry indices, left padding, FP8
// descales), read back on the call's stream and checked, with an error that names the
// argument. Off by default: it costs a few small copies and a host synchronization per call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_checks.h"

namespace hattn {
namespace {

Status broken(std::string message) { return {StatusCode::invalid_argument, std::move(message)}; }

// `count` elements of device array `ptr` (null: none), copied to the host on `stream`, which
// is then waited for.
template <typename T>
Status read_back(const T* ptr, size_t count, cudaStream_t stream, const char* name, std::vector<T>* out) {
  out->assign(ptr == nullptr ? 0 : count, T{});
  if (out->empty()) return Status::Ok();
  // A copy to the host and a wait would fail a CUDA graph capture and invalidate it: refuse first.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture != cudaStreamCaptureStatusNone)
    return {StatusCode::not_supported, std::string(name) + ": the checking mode cannot read it back while the stream "
                                                           "is captured into a CUDA graph (turn it off for the capture)"};
  cudaError_t err = cudaMemcpyAsync(out->data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return {StatusCode::cuda_error, std::string(name) + ": reading it for the checking mode: " + cudaGetErrorString(err)};
}

// cu_seqlens: from 0, never decreasing, within the tensor's rows; every length within the
// longest length the problem gives (seqlen_q / seqlen_k, FlashAttention's max_seqlen).
Status check_offsets(const char* name, const std::vector<int32_t>& cu, int rows, const char* rows_name,
                     const char* longest_name, int longest) {
  if (cu.empty()) return Status::Ok();
  if (cu[0] != 0) return broken(std::string(name) + ": must start at 0, got " + std::to_string(cu[0]));
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t length = int64_t(cu[b + 1]) - cu[b];
    if (length < 0)
      return broken(std::string(name) + ": must not decrease (entry " + std::to_string(b + 1) + ": " +
                    std::to_string(cu[b + 1]) + " after " + std::to_string(cu[b]) + ")");
    if (length > longest)
      return broken(std::string(longest_name) + ": " + std::to_string(longest) + " (the longest length) is below sequence " +
                    std::to_string(b) + "'s length " + std::to_string(length) + " (" + name + ")");
  }
  if (cu.back() > rows)
    return broken(std::string(name) + ": ends at " + std::to_string(cu.back()) + ", past " + rows_name + " = " +
                  std::to_string(rows));
  return Status::Ok();
}

// Every entry of `values` in [low, high]; `what` says what the range is.
Status check_range(const char* name, const std::vector<int32_t>& values, int64_t low, int64_t high,
                   const std::string& what) {
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i] < low || values[i] > high)
      return broken(std::string(name) + ": entry " + std::to_string(i) + " is " + std::to_string(values[i]) +
                    ", outside [" + std::to_string(low) + ", " + std::to_string(high) + "] (" + what + ")");
  return Status::Ok();
}

// The pages each of `batch` sequences reads (those holding its keys_of(b) keys, in row
// row_of(b) of `table`, rows of max_pages entries) within [0, num_pages). `who` names a
// sequence in the message ("sequence", MLA's "request").
template <typename RowOf, typename KeysOf>
Status check_pages_in_use(const std::vector<int32_t>& table, size_t batch, int max_pages, int page_size,
                          int num_pages, const char* who, RowOf row_of, KeysOf keys_of) {
  for (size_t b = 0; b < batch; ++b) {
    const int64_t row = row_of(b);
    const int64_t pages = std::min<int64_t>((int64_t(keys_of(b)) + page_size - 1) / page_size, max_pages);
    for (int64_t j = 0; j < pages; ++j) {
      const int32_t page = table[size_t(row) * max_pages + size_t(j)];
      if (page < 0 || page >= num_pages)
        return broken("block_table: entry (" + std::to_string(row) + ", " + std::to_string(j) + ") is " +
                      std::to_string(page) + ", outside [0, " + std::to_string(num_pages - 1) +
                      "] (the pages of a cache of num_pages; " + who + " " + std::to_string(b) + " reads it)");
    }
  }
  return Status::Ok();
}

}  // namespace

bool checking_from_environment() {
  static const bool on = [] {
    const char* value = std::getenv("HATTN_CHECK");
    return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
  }();
  return on;
}

Status check_promises_on(const AttentionProblem& p, cudaStream_t stream) {
  const size_t batch = size_t(std::max(p.batch, 0));
  Status s;
  std::vector<int32_t> cu_q, cu_k, used, entries, pad, table;
  if (!(s = read_back(p.cu_seqlens_q, batch + 1, stream, "cu_seqlens_q", &cu_q)).ok() ||
      !(s = read_back(p.cu_seqlens_k, batch + 1, stream, "cu_seqlens_k", &cu_k)).ok() ||
      !(s = read_back(p.seqlens_k, batch, stream, "seqlens_k", &used)).ok() ||
      !(s = read_back(p.kv_batch_idx, batch, stream, "kv_batch_idx", &entries)).ok() ||
      !(s = read_back(p.leftpad_k, batch, stream, "leftpad_k", &pad)).ok())
    return s;
  if (!(s = check_offsets("cu_seqlens_q", cu_q, p.total_q, "total_q", "seqlen_q", p.seqlen_q)).ok() ||
      !(s = check_offsets("cu_seqlens_k", cu_k, p.total_k, "total_k", "seqlen_k", p.seqlen_k)).ok())
    return s;
  // Keys in use: at most the keys the problem gives a sequence (a dense cache's rows, or the
  // longest length of a paged one, at most its pages' keys).
  if (!(s = check_range("seqlens_k", used, 0, p.seqlen_k, "keys in use, at most seqlen_k")).ok()) return s;
  if (!(s = check_range("kv_batch_idx", entries, 0, int64_t(p.kv_batch) - 1, "entries of a cache of kv_batch")).ok())
    return s;
  for (size_t b = 0; b < pad.size(); ++b) {
    const int keys = used.empty() ? p.seqlen_k : used[b];
    if (pad[b] < 0 || pad[b] > keys)
      return broken("leftpad_k: entry " + std::to_string(b) + " is " + std::to_string(pad[b]) + ", outside [0, " +
                    std::to_string(keys) + "] (a first key within the sequence's " + std::to_string(keys) + " keys)");
  }
  if (p.is_paged()) {
    // The pages each sequence uses: those that hold its keys in use, in its row of the table
    // (row kv_batch_idx[b] with cache entries).
    const size_t rows = p.kv_batch_idx != nullptr ? size_t(p.kv_batch) : batch;
    if (!(s = read_back(p.block_table, rows * size_t(p.max_pages_per_seq), stream, "block_table", &table)).ok())
      return s;
    s = check_pages_in_use(
        table, batch, p.max_pages_per_seq, p.page_size, p.num_pages, "sequence",
        [&](size_t b) { return entries.empty() ? int64_t(b) : int64_t(entries[b]); },
        [&](size_t b) { return used.empty() ? p.seqlen_k : used[b]; });
    if (!s.ok()) return s;
  }
  const size_t scales = batch * size_t(std::max(p.heads_kv, 0));
  for (const auto& [name, ptr] : {std::pair<const char*, const float*>{"q_descale", p.q_descale},
                                  std::pair<const char*, const float*>{"k_descale", p.k_descale},
                                  std::pair<const char*, const float*>{"v_descale", p.v_descale}}) {
    std::vector<float> values;
    if (!(s = read_back(ptr, scales, stream, name, &values)).ok()) return s;
    for (size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i]) || values[i] < 0.f)  // 0 is fine: its rows weigh their keys alike
        return broken(std::string(name) + ": entry " + std::to_string(i) + " is " + std::to_string(values[i]) +
                      "; descales must be finite and >= 0");
  }
  return Status::Ok();
}

Status check_mla_promises_on(const MlaDecodeProblem& p, cudaStream_t stream) {
  const size_t batch = size_t(std::max(p.batch, 0));
  std::vector<int32_t> lens, table;
  Status s = read_back(p.cache_seqlens, batch, stream, "cache_seqlens", &lens);
  if (s.ok()) s = read_back(p.block_table, batch * size_t(p.max_pages_per_seq), stream, "block_table", &table);
  if (!s.ok()) return s;
  const int64_t capacity = int64_t(p.max_pages_per_seq) * p.page_size;
  if (!(s = check_range("cache_seqlens", lens, 0, capacity, "keys per request, at most max_pages_per_seq * page_size"))
           .ok())
    return s;
  return check_pages_in_use(
      table, batch, p.max_pages_per_seq, p.page_size, p.num_pages, "request", [](size_t b) { return int64_t(b); },
      [&](size_t b) { return lens[b]; });
}

Status check_mla_promises(const MlaDecodeProblem& problem, cudaStream_t stream) {
  Status s = validate_mla_arguments(problem);
  if (!s.ok()) return s;
  if (!(s = check_device()).ok()) return s;
  return check_mla_promises_on(problem, stream);
}

Status check_promises(const AttentionProblem& problem, cudaStream_t stream) {
  Status s = validate_arguments(problem);
  if (!s.ok()) return s;
  if (!(s = check_device()).ok()) return s;
  return check_promises_on(problem, stream);
}

}  // namespace hattn
