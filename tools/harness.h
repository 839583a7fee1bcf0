// Test and benchmark harness: builds attention workloads on the GPU in several memory
// layouts, poisons the outputs, and checks results against the CPU reference.
// Shared by tests/ and the benchmark CLI so both check kernels the same way.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "hattn/hattn.h"
#include "hattn/reference.h"

namespace hattn::harness {

enum class Layout {
  contiguous,  // [B, S, H, D] dense
  padded,      // every stride padded: rows, heads and batches do not touch
  packed_qkv,  // q, k, v interleaved in one [B, S, 3, H, D] buffer (needs Sq == Sk, Hq == Hkv)
};
const char* layout_name(Layout layout);

struct Shape {
  int batch = 1, seqlen_q = 1, seqlen_k = 1, heads_q = 1, heads_kv = 1, head_dim = 64;
  bool causal = false;
  int window_left = -1, window_right = -1;  // sliding window; -1: that side open
  DType dtype = DType::bf16;
  Layout layout = Layout::contiguous;
  bool with_lse = true;
  std::optional<float> scale;  // softmax scale; default 1/sqrt(D)
  float softcap = 0.f;         // AttentionProblem::softcap (0: off)
  // A variable-length batch when not empty: sequence b has seqlens_q[b] queries and
  // seqlens_k[b] keys, packed along the rows of [total, H, D] tensors (contiguous or padded
  // layout); batch, seqlen_q and seqlen_k are then the count and the longest lengths
  // (set_varlen fills them).
  std::vector<int> seqlens_q, seqlens_k;
  bool varlen() const { return !seqlens_q.empty(); }
  int num_splits = 0;  // split-KV: 0 automatic, 1 off, n parts (AttentionProblem::num_splits)
  std::optional<bool> pack_gqa;  // GQA packing: empty automatic (AttentionProblem::pack_gqa)
  // Keys in use per sequence (AttentionProblem::seqlens_k) when not empty: sequence b uses its
  // first seqlens_k_used[b] keys (<= seqlen_k). Not with a varlen batch.
  std::vector<int> seqlens_k_used;
  // A paged KV cache when > 0: k and v go into pages of page_size keys in a shuffled order
  // with spare pages, and a block table; needs seqlens_k_used (contiguous or padded layout).
  int page_size = 0;
  // Left padding (AttentionProblem::leftpad_k) when not empty: sequence b's keys start at key
  // leftpad_k[b]. Not with a paged cache.
  std::vector<int> leftpad_k;
  // Cache entries (AttentionProblem::kv_batch_idx): sequence b's keys go to a shuffled entry of
  // batch + 1 (the spare one NaN): dense k and v entries, or block table rows. Not with varlen.
  bool kv_batch_idx = false;
  // An FP8 KV cache (AttentionProblem::kv_dtype e4m3): k and v as e4m3 codes with random
  // descales per (batch, K/V head) in [0.25, 2]; the host images hold code x descale. dtype
  // stays q's and out's (bf16 or fp16). With dtype e4m3 instead, q, k and v are all such codes
  // (q's descale that of its K/V head) and out is bf16: the FP8 forward.
  bool fp8_cache = false;
};
// Makes `shape` a variable-length batch of these lengths (equal counts, some non-zero).
void set_varlen(Shape* shape, std::vector<int> seqlens_q, std::vector<int> seqlens_k);
std::string describe(const Shape& shape);

// FLOPs of the forward: 4 * B * Hq * Sq * Sk * D, halved when causal with Sq == Sk
// (the FlashAttention benchmark convention); counts the visible entries otherwise (other
// causal shapes, sliding windows).
double forward_flops(const Shape& shape);
// Bytes the forward must move at least: Q and O once each, and the keys and values in use once
// (each K/V head once however many query heads share it), at 2 bytes an element (1 for an FP8
// KV cache's); the LSE is left out. The yardstick of memory-bound shapes such as decoding (GB/s).
double forward_bytes(const Shape& shape);

// Owns one cudaMalloc'd allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  Status allocate(size_t bytes);
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One input/output allocation: its device memory and a host image of the same elements as
// float (values rounded to the dtype), at the same element offsets.
struct Storage {
  DeviceBuffer device;
  std::vector<float> host;
  size_t elements = 0;
};

struct Workload {
  Shape shape;
  Storage inputs;  // q, k and v live inside this one allocation (packed or one after another)
  Storage output;  // out, maybe with gaps that the kernel must not touch
  DeviceBuffer lse;
  std::vector<char> is_output_element;  // 1 where `output` holds an element of out, 0 in gaps
  AttentionProblem problem;             // device pointers and strides
  ref::HostProblem host;                // the same tensors on the host (varlen: one packed sequence)
  DeviceBuffer cu_seqlens;              // varlen: cu_seqlens_q then cu_seqlens_k, int32
  DeviceBuffer seqlens_k;               // seqlens_k_used, int32
  DeviceBuffer pages;                   // a paged cache: k's pages, then v's, and the block table
  DeviceBuffer entries;                 // kv_batch_idx: a dense cache's k entries, then v's, then the indices
  DeviceBuffer leftpad_k;               // leftpad_k, int32
  DeviceBuffer codes;                   // e4m3 inputs: dense k and v (dtype e4m3: q too), at inputs' element offsets
  DeviceBuffer descales;                // e4m3 inputs: k_descale, v_descale (and q_descale), fp32 [batch, heads_kv]
  // dtype e4m3: how far Hopper's FP8 wgmma may move a score (ref::fp8_score_error), added to
  // the LSE's budget; at D = 256, where the forward adds P V into O inside the tensor cores,
  // how far that may move an output (ref::fp8_pv_sum_error), added to the output's.
  double fp8_score_error = 0;
  double fp8_pv_sum_error = 0;
  std::vector<int> cu_q, cu_k;          // varlen: the same offsets on the host
};

// Random inputs (uniform with unit variance around a non-zero mean), fresh for each seed.
Status make_workload(const Shape& shape, uint64_t seed, Workload* workload);

// Fills out (gaps included) with NaN and lse with NaN, so unwritten elements cannot pass.
Status poison_outputs(Workload* workload);

struct CheckResult {
  bool passed = false;
  double max_err = 0;      // max |out - fp64 reference|
  double budget = 0;       // 2 * max |same-precision emulation - reference| + atol
  double lse_max_err = 0;  // over rows with a finite reference LSE
  double lse_budget = 0;
  int64_t nan_outputs = 0;     // NaN or inf in out (includes unwritten elements)
  int64_t touched_gaps = 0;    // gap elements of the output allocation that changed
  int64_t lse_mismatches = 0;  // -inf where the reference is finite or the reverse, or NaN
  int rows_checked = 0;
  std::string summary() const;
};

// Rows to check, as (batch, head, query) triples.
struct RowId {
  int b, h, i;
};
std::vector<RowId> all_rows(const Shape& shape);
// A sample for large problems: the first/last rows, rows around the causal diagonal's
// edges and random rows of the first and last (batch, head).
std::vector<RowId> sample_rows(const Shape& shape, int count, uint64_t seed);

// The host problem the reference runs for sequence `b`: that sequence's keys in use (past its
// left padding, up to seqlens_k_used[b]) and, in a varlen batch, that sequence on its own (one
// batch entry over its rows of the packed tensors). Run its row (b, h, i) as batch entry b of a
// dense batch, 0 of a varlen one.
ref::HostProblem sequence_host(const Workload& workload, int b);

// Copies the outputs back and checks `rows` (gaps and NaN are checked over the whole output).
CheckResult check_outputs(const Workload& workload, const std::vector<RowId>& rows);

// For the backward: `count` unit-normal values drawn from `rng`, rounded to `dtype`; their
// bits go to the GPU and their values to the fp64 reference.
struct HostTensor {
  std::vector<float> values;
  std::vector<uint16_t> bits;
};
HostTensor random_normal(size_t count, DType dtype, std::mt19937* rng);

// The backward's error budget: 3 units of the dtype's precision (bf16 2^-7, fp16 2^-10) at the
// largest reference element, plus 1e-6.
double backward_error_budget(DType dtype, double largest);

}  // namespace hattn::harness
