// hopper-attention: the public C++ API.
//
// One function computes forward attention with any registered kernel:
//
//   O   = softmax(scale * Q K^T + mask) V
//   LSE = log(sum_j exp(scale * q.k_j + mask_j))      (natural log, per query row)
//
// Tensors live on the GPU in BSHD layout, as FlashAttention-3 and diffusers pass them.
// Every call validates its arguments first and returns a Status whose message names the
// offending argument; nothing is launched or written when the status is not ok.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace hattn {

// e4m3: float8 e4m3 inputs (PyTorch's float8_e4m3fn) for the FP8 forward, whose out is bf16.
enum class DType : int { bf16 = 0, fp16 = 1, e4m3 = 2 };

const char* dtype_name(DType dtype);
// Bytes per element of `dtype`.
int dtype_size(DType dtype);
// The dtype of out for inputs of `dtype`: the same, except bf16 for e4m3.
DType output_dtype(DType dtype);

enum class StatusCode : int {
  ok = 0,
  invalid_argument,  // the problem itself is malformed (bad shape, pointer, stride, ...)
  not_supported,     // well-formed, but the chosen kernel (or any kernel, for "auto") can't run it
  no_device,         // no usable CUDA device (none present, or not Hopper sm_90)
  cuda_error,        // a CUDA call failed; the message carries the CUDA error string
  out_of_memory,     // the scratch allocator (or the stream's pool) had no memory for a call
};

const char* status_code_name(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::ok; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: q: pointer is null" style, for logs and exceptions.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::ok;
  std::string message_;
};

// Element strides of a BSHD tensor; the last (D) dimension is always contiguous.
struct Strides {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t head = 0;
};

// Strides of a contiguous [B, S, H, D] tensor.
Strides contiguous_bshd(int seqlen, int heads, int head_dim);

// Where a call takes the device memory it needs beside its tensors: split-KV's partial results
// and FP8's transposed V (when no workspace is given), the sign-flipped copy of q for a negative
// scale, the backward's fp32 sums. Without one (AttentionProblem::allocator null) the library
// takes it from the stream's pool with cudaMallocAsync. The memory is used in the call's stream
// order: taken before the call's first launch, given back once its last launch is enqueued (the
// work may still run), so an allocator that hands a block out again only to work later in that
// stream's order (a stream-ordered pool, torch's caching allocator on the call's stream) is
// safe. The Python package passes torch's.
struct ScratchAllocator {
  // `bytes` (> 0) of device memory, 16-byte aligned, or null when there is none: the call then
  // returns out_of_memory, naming what it needed.
  void* (*allocate)(void* context, size_t bytes, cudaStream_t stream) = nullptr;
  // Takes back what allocate gave, with the same bytes and stream.
  void (*release)(void* context, void* ptr, size_t bytes, cudaStream_t stream) = nullptr;
  void* context = nullptr;  // passed to both
};

// The most parts AttentionProblem::num_splits may ask for.
inline constexpr int kMaxSplits = 64;

struct AttentionProblem {
  DType dtype = DType::bf16;  // q, k, v and out share it; e4m3 inputs give a bf16 out (output_dtype())
  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0: query head h reads kv head h / (heads_q / heads_kv)
  int head_dim = 0;  // 64, 128 or 256

  const void* q = nullptr;  // [B, Sq, Hq, D]
  Strides q_strides;
  const void* k = nullptr;  // [B, Sk, Hkv, D]
  Strides k_strides;
  const void* v = nullptr;  // [B, Sk, Hkv, D]
  Strides v_strides;
  void* out = nullptr;  // [B, Sq, Hq, D], dtype output_dtype(dtype)
  Strides out_strides;
  float* lse = nullptr;  // optional [B, Hq, Sq] contiguous fp32 ([Hq, total_q] when varlen); -inf for a fully masked row

  std::optional<float> softmax_scale;  // default 1/sqrt(head_dim)
  // Softcapping (FlashAttention's softcap, as in Gemma 2): with softcap > 0 each score
  // scale * q.k becomes softcap * tanh(scale * q.k / softcap) before the mask and the softmax,
  // which bounds it to (-softcap, softcap); 0 turns it off. Only the production forward; the backward
  // in bwd_sm90, and in the lineage bwd_15_tma_sums (head_dim <= 128), bwd_12_dkdv_pipeline and
  // bwd_10_dq_pass (head_dim 256).
  float softcap = 0.f;
  // Causal mask aligned to the bottom-right corner: query i sees key j iff
  // j <= i + (seqlen_k - seqlen_q). Rows that see no key get output 0 and LSE -inf.
  bool causal = false;
  // Sliding window (local attention), aligned to the bottom-right corner like the causal mask:
  // query i sees key j iff i + (seqlen_k - seqlen_q) - window_left <= j and
  // j <= i + (seqlen_k - seqlen_q) + window_right. -1 leaves that side open (the default, no
  // window). With causal, window_right must be -1 or 0: causal is the window's right edge at 0.
  // Only the production kernels (fwd_sm90, bwd_sm90) support a window; the lineage refuses it.
  int window_left = -1;
  int window_right = -1;

  // Variable-length batch (FlashAttention's varlen): with cu_seqlens_q and cu_seqlens_k set,
  // the `batch` sequences lie one after another along the rows of q and out ([total_q, Hq, D])
  // and of k and v ([total_k, Hkv, D]); strides.batch is not used. Sequence b's queries are
  // rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its keys likewise, and the masks align to
  // each sequence's own bottom-right corner. seqlen_q and seqlen_k are then the longest
  // lengths (FlashAttention's max_seqlen); the work is planned by them, so no sequence may be
  // longer. lse, when set, is [Hq, total_q]. The offsets are device int32 arrays of batch + 1
  // non-decreasing values from 0 to the totals, read only by the kernel: the host cannot check
  // them without a synchronization, so they are the caller's promise. The kernel clamps them
  // to [0, total] so that it never touches memory outside the tensors.
  // Only the production forward supports a variable-length batch in the forward; the others refuse it.
  // In the backward, bwd_sm90 supports it; the lineage's steps refuse it (see backward()).
  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1]
  const int32_t* cu_seqlens_k = nullptr;  // [batch + 1]
  int total_q = 0;  // rows of q and out
  int total_k = 0;  // rows of k and v

  // Keys in use per sequence (FlashAttention's cache_seqlens / seqused_k): when set, sequence
  // b attends to the first seqlens_k[b] of its keys only (clamped to the keys it has), and the
  // masks align to that length. A device int32 array [batch], read only by the kernel.
  const int32_t* seqlens_k = nullptr;
  // Paged KV cache (FlashAttention's and vLLM's block_table): when set, k and v are caches of
  // num_pages pages of page_size keys, [num_pages, page_size, Hkv, D] (strides.batch is the
  // page stride), and sequence b's key j lies in page block_table[b * max_pages_per_seq +
  // j / page_size], row j % page_size. seqlens_k must then be set too; seqlen_k is the
  // longest length, at most max_pages_per_seq * page_size. A device int32 array
  // [batch, max_pages_per_seq], read only by the kernel, which clamps page indices to the
  // cache. Only the production forward supports it, with page_size a multiple of 128 (one K/V tile
  // never spans two pages), and not with a variable-length batch.
  const int32_t* block_table = nullptr;
  int max_pages_per_seq = 0;
  int num_pages = 0;
  int page_size = 0;

  // A cache entry per sequence (FlashAttention's cache_batch_idx / kv_batch_idx): when set,
  // sequence b reads the keys of cache entry kv_batch_idx[b] instead of entry b: batch entry
  // kv_batch_idx[b] of a dense k and v of kv_batch entries, or row kv_batch_idx[b] of a
  // block_table of kv_batch rows. A device int32 array [batch], read only by the kernel, which
  // clamps it to [0, kv_batch). Not with a variable-length batch. Only the production forward.
  const int32_t* kv_batch_idx = nullptr;
  int kv_batch = 0;  // entries kv_batch_idx indexes; only with kv_batch_idx
  // Left padding of the keys (FlashAttention's cache_leftpad / leftpad_k): when set, sequence
  // b's keys start at key leftpad_k[b] of its rows: it attends to keys leftpad_k[b] ..
  // seqlens_k[b] - 1 (or .. the last key it has, without seqlens_k), and the masks align to
  // that range as to a sequence of seqlens_k[b] - leftpad_k[b] keys. A device int32 array
  // [batch], read only by the kernel, which clamps it to [0, the sequence's keys]. Not with a
  // paged cache (a K/V tile must start on a page). Only the production forward.
  const int32_t* leftpad_k = nullptr;

  // Split-KV (flash-decoding): each query block's keys are cut into num_splits parts computed
  // by different CTAs, whose partial results a second kernel combines. It fills the GPU when
  // there are few query blocks and long key sweeps (decoding: a few queries per sequence).
  // 0 lets the production forward decide; 1 turns it off; n > 1 asks for n parts (at most 64;
  // fewer when a block has fewer K/V tiles). With 0 the production forward also cuts the last round
  // of its persistent grid when it would leave most SMs idle (the tail split: dense batches
  // without a mask); 1 turns that off too. The partial results live in a workspace the
  // library takes from `allocator` on the call's stream, unless the caller gives one below.
  // A hint: the lineage kernels ignore it.
  int num_splits = 0;

  // GQA packing: one work item takes all query heads of a K/V head as rows of its tile, so
  // that they share each K/V tile's load and sweep (FlashAttention-3's pack_gqa). Empty lets
  // the production forward decide (on when it at least halves the query blocks, as with few queries
  // per sequence); true or false forces it, where the heads per K/V head are a power of two
  // up to 64 and there is no sliding window (otherwise it stays off). A hint: the result is
  // the same up to rounding, and the lineage kernels ignore it.
  std::optional<bool> pack_gqa;

  // Device memory for split-KV's partial results (or the FP8 forward's transposed V), owned by
  // the caller and used in the call's stream order (16-byte aligned): at least workspace_size()
  // bytes, or the call fails naming workspace_bytes. Null: the library takes it from
  // `allocator` when it needs one.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  // Scratch memory (see ScratchAllocator), for this call and the backward of this problem. Null:
  // the stream's pool (cudaMallocAsync). Not owned; it must outlive the call.
  const ScratchAllocator* allocator = nullptr;

  // FP8 (dtype e4m3): the inputs' dequantization scales, as FlashAttention-3's q_descale,
  // k_descale and v_descale: device fp32 arrays [batch, heads_kv]. Query head h of batch b
  // computes with q * q_descale[b * heads_kv + h / (heads_q / heads_kv)], and its K/V head's k
  // and v likewise. Null means 1. Only with e4m3 (k_descale and v_descale also with an e4m3
  // kv_dtype, below). The values must be finite and >= 0 (the kernel takes the softmax's
  // running max on unscaled scores; a q or k descale of 0 weighs every key a row sees alike, as
  // a zero softmax_scale does); like varlen offsets they stay on the GPU and are the caller's
  // promise. The production forward runs e4m3 at head_dim 64, 128 and 256,
  // dense batches (no window, varlen, seqlens_k or paged cache); P enters the PV product in
  // e4m3 too, as in FlashAttention-3. Its V goes through a transposed copy in the workspace.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;

  // An FP8 KV cache, as inference engines keep one to halve decoding's reads: k and v in e4m3
  // while q and out stay in dtype (bf16 or fp16), each K/V head's keys and values dequantized by
  // k_descale and v_descale above (q_descale stays null). Empty, or equal to dtype: k and v are
  // dtype. The production forward widens each tile to dtype in shared memory, exactly (every e4m3
  // value is a bf16 and an fp16 value), at every head dim, with every feature but a sliding
  // window; forward only.
  std::optional<DType> kv_dtype;

  float scale() const;
  // The dtype of k and v.
  DType kv_type() const { return kv_dtype.value_or(dtype); }
  // k and v are an e4m3 cache beside 16-bit queries.
  bool has_fp8_cache() const { return kv_type() == DType::e4m3 && dtype != DType::e4m3; }
  bool is_varlen() const { return cu_seqlens_q != nullptr || cu_seqlens_k != nullptr; }
  bool is_paged() const { return block_table != nullptr; }
  // Features only the production forward has: a variable-length batch, keys in use, a paged cache,
  // cache entries per sequence, left padding.
  bool has_sequence_bounds() const {
    return is_varlen() || seqlens_k != nullptr || is_paged() || kv_batch_idx != nullptr || leftpad_k != nullptr;
  }
  // The [batch, rows] extents q, k, v and out are laid out with: [batch, seqlen], or for a
  // variable-length batch one packed sequence, [1, total]; k and v of a paged cache are
  // [num_pages, page_size], and a dense k and v indexed by kv_batch_idx [kv_batch, seqlen_k].
  int tensor_batch() const { return is_varlen() ? 1 : batch; }
  int tensor_rows_q() const { return is_varlen() ? total_q : seqlen_q; }
  int tensor_batch_k() const { return is_paged() ? num_pages : kv_batch_idx != nullptr ? kv_batch : tensor_batch(); }
  int tensor_rows_k() const { return is_paged() ? page_size : is_varlen() ? total_k : seqlen_k; }
  // A window edge that causal does not already give (causal with window_right = 0 is plain causal).
  bool has_window() const { return window_left >= 0 || (window_right >= 0 && !causal); }
};

struct Options {
  std::string kernel = "auto";  // a registered kernel's name, or "auto" for the best that supports the problem
  cudaStream_t stream = nullptr;
  // The checking mode: before launching, the promises the problem's device arrays make are
  // read back on `stream` and checked (check_promises()); a broken one is refused with
  // invalid_argument naming it. It costs a few small copies and a host synchronization per
  // call, and cannot run while `stream` is captured into a CUDA graph. Unset: on when
  // HATTN_CHECK=1 is in the environment, else off.
  std::optional<bool> check;
};

// Validates `problem`, picks the kernel and launches it on `options.stream`. Asynchronous:
// no host synchronization; launch errors are reported, execution errors surface on the stream.
Status forward(const AttentionProblem& problem, const Options& options = {});

// The same checks as forward() (arguments, kernel support, device), without launching.
Status check(const AttentionProblem& problem, const std::string& kernel = "auto");

// The checking mode's checks (Options::check) alone. The promises the kernels rely on but the
// host cannot see without reading device memory, read back on `stream` (which is then waited
// for): cu_seqlens_q/k start at 0, never decrease and end within total_q/k, and no sequence is
// longer than seqlen_q/k; seqlens_k within [0, seqlen_k]; kv_batch_idx within the kv_batch
// entries; leftpad_k within each sequence's keys; the block_table pages each sequence uses
// (those holding its keys in use) within num_pages; the FP8 descales finite and >= 0. A broken
// promise gives invalid_argument naming the argument (and the entry). Validates the problem
// and the device first. While `stream` is captured into a CUDA graph, a problem with device
// arrays to read gives not_supported.
Status check_promises(const AttentionProblem& problem, cudaStream_t stream = nullptr);

// Bytes of workspace forward() needs for this problem beside its tensors (split-KV's partial
// results; 0 when it runs unsplit), after the same checks. The answer depends on the problem's
// shape and num_splits, the kernel and the current device, not on the tensors' contents.
Status workspace_size(const AttentionProblem& problem, size_t* bytes, const std::string& kernel = "auto");

// Checks of the arguments alone: shapes, dtype, pointers' nullness and alignment, strides.
// Needs no GPU.
Status validate_arguments(const AttentionProblem& problem);

// Plan once, run many. Calls that repeat a problem's shape on other tensors (a decoding loop, a
// model's layers) can make forward()'s decisions once: plan() checks the problem as forward()
// does and resolves the kernel, and for the production forward fixes its tiles, split-KV parts
// and workspace; run() launches the plan on one call's memory, checking only what depends on
// the addresses (nullness, alignment, outputs overlapping inputs, the GPU they live on), as
// forward() checks them. A plan is immutable, may be shared between threads, and belongs to the
// GPU that was current when it was made.

// The memory of one forward call: every address of an AttentionProblem, its workspace and its
// scratch allocator. The arrays the kernel's decisions rest on (cu_seqlens_q/k, seqlens_k,
// block_table, kv_batch_idx, leftpad_k) must be given where the plan's problem has them and null
// where it has not; lse, the FP8 descales and the workspace may be given or not.
struct Buffers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  const int32_t* seqlens_k = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* kv_batch_idx = nullptr;
  const int32_t* leftpad_k = nullptr;
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  void* workspace = nullptr;  // at least Plan::workspace_bytes(), or null: taken from `allocator`
  size_t workspace_bytes = 0;
  const ScratchAllocator* allocator = nullptr;  // null: the stream's pool
};

// The buffers `problem` names.
Buffers buffers_of(const AttentionProblem& problem);

class Plan {
 public:
  struct State;  // what run() needs; defined in the library
  Plan() = default;
  explicit Plan(std::shared_ptr<const State> state) : state_(std::move(state)) {}

  bool empty() const { return state_ == nullptr; }
  // The kernel that runs ("auto" resolved); empty for an empty plan.
  const std::string& kernel() const;
  // Bytes of workspace a run needs beside its tensors (workspace_size() of the problem).
  size_t workspace_bytes() const;
  // The production forward's decisions: query rows and keys per tile, and split-KV parts (1:
  // unsplit). 0, 0 and 1 for the lineage kernels, which decide in each launch.
  int block_m() const;
  int block_n() const;
  int splits() const;
  // The problem it was made for, with the addresses it was made with but no workspace or
  // allocator (an empty plan: an empty problem).
  const AttentionProblem& problem() const;
  const State* state() const { return state_.get(); }

 private:
  std::shared_ptr<const State> state_;
};

// Validates `problem`, resolves `kernel` ("auto" or a name) and makes the kernel's decisions on
// the current GPU, as forward() does before launching; nothing is launched. The pointers are
// checked for nullness, alignment and overlap here and again in each run(), and for the GPU
// they live on only in run(); a given workspace is checked here and in each run(). On failure
// *plan is empty.
Status plan(const AttentionProblem& problem, Plan* plan, const std::string& kernel = "auto");

// Launches `plan` on `buffers` on `stream`, as forward() would launch the plan's problem with
// these buffers, without deciding again. check: the checking mode, as Options::check. On
// another GPU than the plan's, or with buffers that do not match the plan's arrays, it returns
// invalid_argument and launches nothing. Asynchronous, like forward().
Status run(const Plan& plan, const Buffers& buffers, cudaStream_t stream = nullptr, std::optional<bool> check = {});

// The gradients of a forward call (training): given dL/d out, dq, dk and dv. `forward` is the
// problem of that call, with its out and lse (lse is required here: the backward recomputes
// P = exp(scale S - lse) instead of storing it). A dense or a variable-length batch
// (cu_seqlens: dout, dq, dk and dv are then packed like q and k, [total, H, D], and lse is
// [Hq, total_q]); no seqlens_k or paged cache. Causal masks and sliding windows are fine (per
// sequence, bottom-right aligned), and GQA (dk, dv sum over a K/V head's query heads). dq, dk
// and dv are written whole, so they need no zeroing; rows of a packed tensor that belong to no
// sequence get 0.
struct BackwardProblem {
  AttentionProblem forward;
  const void* dout = nullptr;  // [B, Sq, Hq, D] ([total_q, Hq, D] when varlen), forward.dtype
  Strides dout_strides;
  void* dq = nullptr;  // [B, Sq, Hq, D] ([total_q, Hq, D] when varlen)
  Strides dq_strides;
  void* dk = nullptr;  // [B, Sk, Hkv, D] ([total_k, Hkv, D] when varlen)
  Strides dk_strides;
  void* dv = nullptr;  // [B, Sk, Hkv, D] ([total_k, Hkv, D] when varlen)
  Strides dv_strides;
  // Gradients bitwise the same from run to run: the kernel adds into its fp32 sums in a fixed
  // order (key blocks in turn for dQ, a group's query heads in turn for GQA's dK and dV), at
  // some cost in speed. bwd_sm90 has it at every head dim (at D = 256 its two passes write each
  // row once; with GQA each query head adds into rows of its own, summed in head order), and B12
  // and B10 at D = 256 without GQA; the other kernels refuse it.
  bool deterministic = false;
};

// Validates `problem` and launches the backward on `options.stream`. options.kernel is "auto"
// (the newest kernel that supports the problem: the production backward bwd_sm90, dense or
// variable-length, D = 64, 128 and 256) or one of backward_kernel_names(); a kernel that cannot
// run the problem returns not_supported and says why (bwd_03_wgmma to bwd_08_dq_overlap and
// bwd_13 to bwd_15: D <= 128;
// bwd_09 to bwd_12: D = 256; bwd_03_wgmma, bwd_05_tma_dq to bwd_07_dkdv_direct, bwd_09, bwd_11
// and bwd_12: no variable-length batch).
// Takes fp32 scratch memory from forward.allocator (default: the stream's pool): delta, and
// fp32 sums of the gradients a kernel adds into (dQ; dK and dV with GQA), each about the gradient's
// size, except that bwd_sm90 at D <= 128 pads a variable-length batch's dQ sum to 64-row blocks
// per sequence (many very short sequences: up to 64 times their rows), and at D = 256 with GQA
// and deterministic=true gives each query head its own rows of the dK and dV sums (Hq / Hkv
// times their size). Asynchronous, like forward().
Status backward(const BackwardProblem& problem, const Options& options = {});

// The backward kernels in lineage order.
std::vector<std::string> backward_kernel_names();

// Which backward kernel "auto" (or a given name) resolves to for this problem, without
// launching: the checks of backward() before it needs a GPU. Needs no GPU.
Status resolve_backward_kernel(const BackwardProblem& problem, const std::string& kernel, std::string* resolved);

// Checks of the backward's arguments alone (the forward problem's, then the gradients'). Needs
// no GPU.
Status validate_backward_arguments(const BackwardProblem& problem);

// Appending to a KV cache before a decoding step (FlashAttention's flash_attn_with_kvcache with
// k and v): sequence b's new rows k_new[b, i] and v_new[b, i] are written at key seqlens[b] + i
// of its cache (negative seqlens read as 0), optionally rotated first (rotary embedding), and
// q may be rotated into q_rotated at the same positions. Keys at or past the cache's capacity
// (cache_seqlen, or max_pages_per_seq * page_size) are not written, as the attention clamps
// seqlens_k to it: the lengths stay on the GPU, the host never reads them. One kernel launch.
struct KvAppendProblem {
  DType dtype = DType::bf16;  // bf16 or fp16: every tensor below but the int32 arrays (and an e4m3 cache)
  int batch = 0;
  int seqlen_new = 0;  // new rows per sequence (0: nothing to write)
  int heads_kv = 0;
  int head_dim = 0;  // 64, 128 or 256

  const void* k_new = nullptr;  // [B, seqlen_new, Hkv, D]
  Strides k_new_strides;
  const void* v_new = nullptr;  // [B, seqlen_new, Hkv, D]
  Strides v_new_strides;
  void* k_cache = nullptr;  // dense [B, cache_seqlen, Hkv, D], or paged [num_pages, page_size, Hkv, D]
  Strides k_cache_strides;
  void* v_cache = nullptr;  // the same shape as k_cache
  Strides v_cache_strides;
  int cache_seqlen = 0;  // dense: rows per sequence of the cache

  // Paged cache, as in AttentionProblem: key j of sequence b lies in page block_table[b *
  // max_pages_per_seq + j / page_size] (clamped to the pages), row j % page_size.
  const int32_t* block_table = nullptr;
  int max_pages_per_seq = 0;
  int num_pages = 0;
  int page_size = 0;

  const int32_t* seqlens = nullptr;  // [B] device: each sequence's keys before the append
  int32_t* seqlens_out = nullptr;    // optional [B] device: seqlens + seqlen_new (not aliasing seqlens)

  // Cache entries, as in AttentionProblem: sequence b writes into entry kv_batch_idx[b]
  // (clamped to [0, kv_batch)): batch entry of a dense cache of kv_batch entries, or row of a
  // block_table of kv_batch rows. Sequences that share an entry write the same rows, and which
  // one's values land there is not defined (as in FlashAttention).
  const int32_t* kv_batch_idx = nullptr;
  int kv_batch = 0;

  // Rotary embedding (optional): cos and sin [rotary_seqlen, rotary_dim / 2], contiguous, in
  // dtype; rotary_dim even, at most head_dim; rotary_seqlen at least the cache's capacity. The
  // new key at position p has its first rotary_dim features rotated by the angles of row p:
  // interleaved pairs (2i, 2i + 1) (GPT-J) or halves (i, i + rotary_dim / 2) (GPT-NeoX), in fp32.
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int rotary_dim = 0;
  int rotary_seqlen = 0;
  bool rotary_interleaved = true;
  // With rotary, q [B, seqlen_q, Hq, D] may be rotated into q_rotated (same shape): row i at
  // position seqlens[b] + i when q_positions_per_row (causal or windowed attention), else every
  // row at seqlens[b]. Positions are clamped to the table.
  const void* q = nullptr;
  Strides q_strides;
  void* q_rotated = nullptr;
  Strides q_rotated_strides;
  int seqlen_q = 0;
  int heads_q = 0;
  bool q_positions_per_row = false;

  // An FP8 cache (AttentionProblem::kv_dtype): k_cache and v_cache e4m3 while k_new and v_new
  // stay dtype. Each new value (rotated first) is written as the e4m3 code of value / descale,
  // rounded to nearest and saturated to +-448 (a zero descale writes 0), with sequence b's K/V
  // head h's k_descale and v_descale, fp32 [B, Hkv] (null: 1): the scales the attention then
  // reads it with. Empty, or dtype: a 16-bit cache.
  std::optional<DType> cache_dtype;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;

  bool is_paged() const { return block_table != nullptr; }
  bool has_fp8_cache() const { return cache_dtype.value_or(dtype) == DType::e4m3; }
  // Keys per sequence the cache holds.
  int64_t capacity() const { return is_paged() ? int64_t(max_pages_per_seq) * page_size : cache_seqlen; }
};

// Validates `problem` and launches the append on `stream`. Asynchronous, like forward().
Status append_kv(const KvAppendProblem& problem, cudaStream_t stream = nullptr);

// Checks of append_kv()'s arguments alone. Needs no GPU.
Status validate_append_kv_arguments(const KvAppendProblem& problem);

// MLA decoding (DeepSeek's multi-head latent attention): every query head reads one latent
// K/V head from a paged cache whose rows hold 576 features, a 512-wide latent and a 64-wide
// rope part; K is the whole row and V its first 512 columns. Out has 512 columns per head.
inline constexpr int kMlaHeadDimQk = 576;
inline constexpr int kMlaHeadDimV = 512;

struct MlaDecodeProblem {
  DType dtype = DType::bf16;  // bf16 or fp16: q, kv_cache and out
  int batch = 0;
  int seqlen_q = 0;  // new tokens per request (1, or 2 with speculative decoding)
  int heads_q = 0;   // query heads; heads_q * seqlen_q rows attend together

  const void* q = nullptr;  // [B, seqlen_q, heads_q, 576]
  Strides q_strides;
  // The paged latent cache [num_pages, page_size, 1, 576], rows contiguous (576 features) and
  // 16-byte aligned: key j of request b is row j % page_size of page
  // block_table[b * max_pages_per_seq + j / page_size].
  const void* kv_cache = nullptr;
  int64_t page_stride = 0;  // elements between pages (0: page_size * 576)
  int64_t row_stride = 0;   // elements between a page's rows (0: 576)
  int num_pages = 0;
  int page_size = 0;  // a multiple of 64
  const int32_t* block_table = nullptr;  // [B, max_pages_per_seq] device
  int max_pages_per_seq = 0;
  const int32_t* cache_seqlens = nullptr;  // [B] device: keys per request, the new tokens' included
  // block_table and cache_seqlens stay on the GPU: promises the host does not read, unless the
  // checking mode is on (`check` below). Broken, a length past a request's pages is clamped to
  // them, and a page outside the cache reads as zeros.

  void* out = nullptr;  // [B, seqlen_q, heads_q, 512]
  Strides out_strides;
  float* lse = nullptr;  // optional [B, heads_q, seqlen_q] fp32, contiguous (natural log)

  float softmax_scale = 0.f;  // > 0; 0: 1 / sqrt(576)
  // Query token i of request b (of seqlen_q) sits at key position cache_seqlens[b] - seqlen_q
  // + i and sees the keys up to it; without causal every token sees all the request's keys.
  bool causal = false;

  // The split-KV schedule from mla_schedule() (mla_schedule_ints() int32 on the GPU), made once
  // per decoding step from cache_seqlens and reused by every layer; null: made in the call.
  const int32_t* schedule = nullptr;
  // Room for the split parts' partial results (mla_workspace_size() bytes), or null: taken from
  // `allocator` (the stream's pool without one).
  void* workspace = nullptr;
  const ScratchAllocator* allocator = nullptr;
  // The checking mode, as Options::check for forward(): before the launch, cache_seqlens and
  // the block_table pages each request reads are read back on the stream (a host sync) and
  // checked: lengths within the request's pages (max_pages_per_seq * page_size), pages within
  // [0, num_pages). Unset: on when HATTN_CHECK=1 is in the environment.
  std::optional<bool> check;

  float scale() const;
  int rows() const { return heads_q * seqlen_q; }  // query rows per request
};

// The schedule's size in int32 for this problem on the current device (its parts: CTAs per
// 64-row block of query rows). Needs a GPU for the SM count. The schedule functions read and
// check only batch, seqlen_q, heads_q and cache_seqlens.
Status mla_schedule_ints(const MlaDecodeProblem& problem, size_t* ints);
// Plans the split-KV schedule from problem.cache_seqlens on the GPU (no host sync, so CUDA-graph
// safe) into `schedule`.
Status mla_schedule(const MlaDecodeProblem& problem, int32_t* schedule, cudaStream_t stream = nullptr);
// Bytes of workspace mla_decode() needs for the split parts (an upper bound, whatever the lengths).
Status mla_workspace_size(const MlaDecodeProblem& problem, size_t* bytes);
// Validates `problem` and launches MLA decoding on `stream` (the schedule, when not given, the
// attention kernel, and the combine of split requests). Asynchronous, like forward().
Status mla_decode(const MlaDecodeProblem& problem, cudaStream_t stream = nullptr);
// Checks of mla_decode()'s arguments alone. Needs no GPU.
Status validate_mla_arguments(const MlaDecodeProblem& problem);
// The checking mode's checks (MlaDecodeProblem::check) alone: cache_seqlens and the pages in
// use read back on `stream` (then waited for); a broken one is invalid_argument naming it.
// Validates the problem and the device first; not while `stream` is captured into a CUDA graph.
Status check_mla_promises(const MlaDecodeProblem& problem, cudaStream_t stream = nullptr);

// Which kernel "auto" (or a given name) resolves to for this problem, without launching.
Status resolve_kernel(const AttentionProblem& problem, const std::string& kernel, std::string* resolved);

struct KernelInfo {
  std::string name;         // e.g. "01_naive"
  std::string description;  // one line: the step's main idea
};

// The registered kernels in lineage order (the last is the default for "auto").
std::vector<KernelInfo> kernels();

}  // namespace hattn
