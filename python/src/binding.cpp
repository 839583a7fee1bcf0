// hattn._C: the Python module over the public C++ API.
//
// It binds at the level of raw device pointers and integer element strides, so it needs no
// torch headers: the build stays fast and works with any torch version. The torch op in
// python/hattn/ops/ turns tensors into these arguments (runner.py).
//
// Errors become Python exceptions whose text is Status::to_string() ("code: message"):
//   invalid_argument -> ValueError            (the problem is malformed; the message names the argument)
//   not_supported    -> NotImplementedError   (well-formed, but the chosen kernel, or every kernel for
//                                              "auto", refuses it)
//   no_device        -> RuntimeError          (no CUDA device, or not a Hopper sm_90 GPU)
//   cuda_error       -> RuntimeError          (a CUDA call failed)
//   out_of_memory    -> RuntimeError          (no scratch memory; torch's own OOM error is a RuntimeError too)
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hattn/hattn.h"

namespace nb = nanobind;

namespace {

// (batch, seq, head) element strides, as the Python side passes them.
using StrideTuple = std::tuple<int64_t, int64_t, int64_t>;

hattn::Strides to_strides(const StrideTuple& s) { return {std::get<0>(s), std::get<1>(s), std::get<2>(s)}; }

// The inputs' dtype; e4m3 (torch.float8_e4m3fn) is the FP8 forward's, whose out is bf16.
hattn::DType parse_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return hattn::DType::bf16;
  if (name == "fp16" || name == "float16") return hattn::DType::fp16;
  if (name == "e4m3" || name == "float8_e4m3fn") return hattn::DType::e4m3;
  PyErr_SetString(PyExc_ValueError, ("dtype: must be 'bf16', 'fp16' or 'e4m3' (got '" + name + "')").c_str());
  throw nb::python_error();
}

// Raises the Python exception that stands for a failed status.
[[noreturn]] void raise_status(const hattn::Status& status) {
  PyObject* type = PyExc_RuntimeError;
  switch (status.code()) {
    case hattn::StatusCode::invalid_argument: type = PyExc_ValueError; break;
    case hattn::StatusCode::not_supported: type = PyExc_NotImplementedError; break;
    default: break;
  }
  PyErr_SetString(type, status.to_string().c_str());
  throw nb::python_error();
}

// Scratch memory from a Python callable: scratch(bytes) returns an object with data_ptr() (the
// package passes torch.empty(bytes, dtype=torch.uint8) on the current device: torch's caching
// allocator, on the call's stream), kept alive until the library gives it back. None: the
// library's default (the stream's pool). The callbacks run inside a call that released the GIL,
// so they take it back.
class PythonScratch {
 public:
  explicit PythonScratch(nb::object fn) : fn_(std::move(fn)) {
    allocator_.allocate = &allocate;
    allocator_.release = &release;
    allocator_.context = this;
  }
  const hattn::ScratchAllocator* allocator() const { return fn_.is_none() ? nullptr : &allocator_; }
  // What the callable raised when it gave no memory (e.g. torch's out-of-memory message).
  const std::string& error() const { return error_; }

 private:
  static void* allocate(void* context, size_t bytes, cudaStream_t /*stream*/) {
    auto* self = static_cast<PythonScratch*>(context);
    nb::gil_scoped_acquire gil;
    try {
      nb::object block = self->fn_(bytes);
      void* ptr = reinterpret_cast<void*>(nb::cast<uintptr_t>(block.attr("data_ptr")()));
      if (ptr != nullptr) self->live_.emplace_back(ptr, std::move(block));
      return ptr;
    } catch (const nb::python_error& e) {  // its Python error is held here, not pending
      self->error_ = std::string(nb::type_name(e.type()).c_str()) + ": " + nb::str(e.value()).c_str();
    } catch (const std::exception& e) {  // data_ptr() gave no int
      self->error_ = std::string("data_ptr(): ") + e.what();
    }
    return nullptr;
  }
  static void release(void* context, void* ptr, size_t /*bytes*/, cudaStream_t /*stream*/) {
    auto* self = static_cast<PythonScratch*>(context);
    nb::gil_scoped_acquire gil;
    for (auto it = self->live_.begin(); it != self->live_.end(); ++it) {
      if (it->first == ptr) {
        self->live_.erase(it);  // drops the block: torch may reuse it for later work on the stream
        return;
      }
    }
  }

  nb::object fn_;
  hattn::ScratchAllocator allocator_;
  std::vector<std::pair<void*, nb::object>> live_;
  std::string error_;
};

// The backward's tensors: (dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides).
using GradArgs = std::tuple<uintptr_t, StrideTuple, uintptr_t, StrideTuple, uintptr_t, StrideTuple, uintptr_t, StrideTuple>;

// Defines `name` on `m` with the keyword signature of a problem plus grads (only backward
// takes them), kernel, stream and scratch, and calls fn(problem, grads, kernel, stream) with
// problem.allocator from scratch. The Python side passes keywords; the signature is written once.
template <typename Fn>
void def_problem_function(nb::module_& m, const char* name, Fn fn, const char* doc) {
  m.def(
      name,
      [fn](const std::string& dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
           uintptr_t q, const StrideTuple& q_strides, uintptr_t k, const StrideTuple& k_strides, uintptr_t v,
           const StrideTuple& v_strides, uintptr_t out, const StrideTuple& out_strides, uintptr_t lse,
           std::optional<float> softmax_scale, float softcap, bool causal, int window_left, int window_right,
           uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q, int total_k, uintptr_t seqlens_k,
           uintptr_t block_table, int max_pages_per_seq, int num_pages, int page_size, uintptr_t kv_batch_idx,
           int kv_batch, uintptr_t leftpad_k, int num_splits,
           uintptr_t workspace, size_t workspace_bytes, uintptr_t q_descale, uintptr_t k_descale, uintptr_t v_descale,
           const std::optional<GradArgs>& grads, const std::string& kernel, uintptr_t stream, nb::object scratch) {
        PythonScratch python_scratch(std::move(scratch));
        hattn::AttentionProblem p;
        p.allocator = python_scratch.allocator();
        p.dtype = parse_dtype(dtype);
        p.batch = batch;
        p.seqlen_q = seqlen_q;
        p.seqlen_k = seqlen_k;
        p.heads_q = heads_q;
        p.heads_kv = heads_kv;
        p.head_dim = head_dim;
        p.q = reinterpret_cast<const void*>(q);
        p.q_strides = to_strides(q_strides);
        p.k = reinterpret_cast<const void*>(k);
        p.k_strides = to_strides(k_strides);
        p.v = reinterpret_cast<const void*>(v);
        p.v_strides = to_strides(v_strides);
        p.out = reinterpret_cast<void*>(out);
        p.out_strides = to_strides(out_strides);
        p.lse = reinterpret_cast<float*>(lse);
        p.softmax_scale = softmax_scale;
        p.softcap = softcap;
        p.causal = causal;
        p.window_left = window_left;
        p.window_right = window_right;
        p.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu_seqlens_q);
        p.cu_seqlens_k = reinterpret_cast<const int32_t*>(cu_seqlens_k);
        p.total_q = total_q;
        p.total_k = total_k;
        p.seqlens_k = reinterpret_cast<const int32_t*>(seqlens_k);
        p.block_table = reinterpret_cast<const int32_t*>(block_table);
        p.max_pages_per_seq = max_pages_per_seq;
        p.num_pages = num_pages;
        p.page_size = page_size;
        p.kv_batch_idx = reinterpret_cast<const int32_t*>(kv_batch_idx);
        p.kv_batch = kv_batch;
        p.leftpad_k = reinterpret_cast<const int32_t*>(leftpad_k);
        p.num_splits = num_splits;
        p.workspace = reinterpret_cast<void*>(workspace);
        p.workspace_bytes = workspace_bytes;
        p.q_descale = reinterpret_cast<const float*>(q_descale);
        p.k_descale = reinterpret_cast<const float*>(k_descale);
        p.v_descale = reinterpret_cast<const float*>(v_descale);
        try {
          return fn(p, grads, kernel, stream);
        } catch (const nb::python_error& e) {
          if (python_scratch.error().empty()) throw;
          // The call found no scratch: its status names what it needed, the callable's error why.
          const std::string message =
              std::string(nb::str(e.value()).c_str()) + " (scratch raised " + python_scratch.error() + ")";
          PyErr_SetString(PyExc_RuntimeError, message.c_str());
          throw nb::python_error();
        }
      },
      nb::kw_only(), nb::arg("dtype"), nb::arg("batch"), nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("heads_q"),
      nb::arg("heads_kv"), nb::arg("head_dim"), nb::arg("q"), nb::arg("q_strides"), nb::arg("k"), nb::arg("k_strides"),
      nb::arg("v"), nb::arg("v_strides"), nb::arg("out"), nb::arg("out_strides"), nb::arg("lse") = 0,
      nb::arg("softmax_scale") = nb::none(), nb::arg("softcap") = 0.f, nb::arg("causal") = false,
      nb::arg("window_left") = -1, nb::arg("window_right") = -1, nb::arg("cu_seqlens_q") = 0, nb::arg("cu_seqlens_k") = 0,
      nb::arg("total_q") = 0, nb::arg("total_k") = 0, nb::arg("seqlens_k") = 0, nb::arg("block_table") = 0, nb::arg("max_pages_per_seq") = 0,
      nb::arg("num_pages") = 0, nb::arg("page_size") = 0, nb::arg("kv_batch_idx") = 0, nb::arg("kv_batch") = 0,
      nb::arg("leftpad_k") = 0, nb::arg("num_splits") = 0, nb::arg("workspace") = 0,
      nb::arg("workspace_bytes") = 0, nb::arg("q_descale") = 0, nb::arg("k_descale") = 0, nb::arg("v_descale") = 0,
      nb::arg("grads") = nb::none(), nb::arg("kernel") = "auto", nb::arg("stream") = 0, nb::arg("scratch") = nb::none(),
      doc);
}

// Refuses gradients given to a function other than backward.
void no_grads(const std::optional<GradArgs>& grads) {
  if (!grads) return;
  PyErr_SetString(PyExc_ValueError, "grads: only hattn._C.backward takes gradient tensors");
  throw nb::python_error();
}

hattn::Options make_options(const std::string& kernel, uintptr_t stream) {
  hattn::Options options;
  options.kernel = kernel;
  options.stream = reinterpret_cast<cudaStream_t>(stream);
  return options;
}

// Runs `call` with the GIL released, so that other Python threads run (validation, size
// queries and launches touch no Python object), and raises the status it returns if not ok.
template <typename Call>
void without_gil(Call&& call) {
  hattn::Status status;
  {
    nb::gil_scoped_release release;
    status = call();
  }
  if (!status.ok()) raise_status(status);
}

void forward(const hattn::AttentionProblem& problem, const std::optional<GradArgs>& grads, const std::string& kernel,
             uintptr_t stream) {
  no_grads(grads);
  without_gil([&] { return hattn::forward(problem, make_options(kernel, stream)); });
}

std::string resolve_kernel(const hattn::AttentionProblem& problem, const std::optional<GradArgs>& grads,
                           const std::string& kernel, uintptr_t /*stream*/) {
  no_grads(grads);
  std::string resolved;
  const hattn::Status status = hattn::resolve_kernel(problem, kernel, &resolved);
  if (!status.ok()) raise_status(status);
  return resolved;
}

size_t workspace_size(const hattn::AttentionProblem& problem, const std::optional<GradArgs>& grads,
                      const std::string& kernel, uintptr_t /*stream*/) {
  no_grads(grads);
  size_t bytes = 0;
  without_gil([&] { return hattn::workspace_size(problem, &bytes, kernel); });
  return bytes;
}

void backward(const hattn::AttentionProblem& problem, const std::optional<GradArgs>& grads, const std::string& kernel,
              uintptr_t stream) {
  if (!grads) {
    PyErr_SetString(PyExc_ValueError, "grads: backward needs (dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, "
                                      "dv_strides)");
    throw nb::python_error();
  }
  hattn::BackwardProblem b;
  b.forward = problem;
  const auto& [dout, dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides] = *grads;
  b.dout = reinterpret_cast<const void*>(dout);
  b.dout_strides = to_strides(dout_strides);
  b.dq = reinterpret_cast<void*>(dq);
  b.dq_strides = to_strides(dq_strides);
  b.dk = reinterpret_cast<void*>(dk);
  b.dk_strides = to_strides(dk_strides);
  b.dv = reinterpret_cast<void*>(dv);
  b.dv_strides = to_strides(dv_strides);
  without_gil([&] { return hattn::backward(b, make_options(kernel, stream)); });
}

// append_kv's keywords: tensors as (pointer, (batch, seq, head) strides); 0 for an absent pointer.
void append_kv(const std::string& dtype, int batch, int seqlen_new, int heads_kv, int head_dim, uintptr_t k_new,
               const StrideTuple& k_new_strides, uintptr_t v_new, const StrideTuple& v_new_strides, uintptr_t k_cache,
               const StrideTuple& k_cache_strides, uintptr_t v_cache, const StrideTuple& v_cache_strides,
               uintptr_t seqlens, int cache_seqlen, uintptr_t block_table, int max_pages_per_seq, int num_pages,
               int page_size, uintptr_t kv_batch_idx, int kv_batch, uintptr_t seqlens_out, uintptr_t rotary_cos,
               uintptr_t rotary_sin, int rotary_dim, int rotary_seqlen, bool rotary_interleaved, uintptr_t q,
               const StrideTuple& q_strides,
               uintptr_t q_rotated, const StrideTuple& q_rotated_strides, int seqlen_q, int heads_q,
               bool q_positions_per_row, uintptr_t stream) {
  hattn::KvAppendProblem p;
  p.dtype = parse_dtype(dtype);
  p.batch = batch;
  p.seqlen_new = seqlen_new;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.k_new = reinterpret_cast<const void*>(k_new);
  p.k_new_strides = to_strides(k_new_strides);
  p.v_new = reinterpret_cast<const void*>(v_new);
  p.v_new_strides = to_strides(v_new_strides);
  p.k_cache = reinterpret_cast<void*>(k_cache);
  p.k_cache_strides = to_strides(k_cache_strides);
  p.v_cache = reinterpret_cast<void*>(v_cache);
  p.v_cache_strides = to_strides(v_cache_strides);
  p.cache_seqlen = cache_seqlen;
  p.block_table = reinterpret_cast<const int32_t*>(block_table);
  p.max_pages_per_seq = max_pages_per_seq;
  p.num_pages = num_pages;
  p.page_size = page_size;
  p.kv_batch_idx = reinterpret_cast<const int32_t*>(kv_batch_idx);
  p.kv_batch = kv_batch;
  p.seqlens = reinterpret_cast<const int32_t*>(seqlens);
  p.seqlens_out = reinterpret_cast<int32_t*>(seqlens_out);
  p.rotary_cos = reinterpret_cast<const void*>(rotary_cos);
  p.rotary_sin = reinterpret_cast<const void*>(rotary_sin);
  p.rotary_dim = rotary_dim;
  p.rotary_seqlen = rotary_seqlen;
  p.rotary_interleaved = rotary_interleaved;
  p.q = reinterpret_cast<const void*>(q);
  p.q_strides = to_strides(q_strides);
  p.q_rotated = reinterpret_cast<void*>(q_rotated);
  p.q_rotated_strides = to_strides(q_rotated_strides);
  p.seqlen_q = seqlen_q;
  p.heads_q = heads_q;
  p.q_positions_per_row = q_positions_per_row;
  without_gil([&] { return hattn::append_kv(p, reinterpret_cast<cudaStream_t>(stream)); });
}

std::vector<std::pair<std::string, std::string>> kernels() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const hattn::KernelInfo& k : hattn::kernels()) out.emplace_back(k.name, k.description);
  return out;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() =
      "hattn._C: raw-pointer bindings of the hopper-attention C++ API. Use hattn.attention() for tensors.\n"
      "Errors: ValueError (invalid_argument), NotImplementedError (not_supported), "
      "RuntimeError (no_device, cuda_error, out_of_memory); the text starts with the status code.";
  def_problem_function(
      m, "forward", &forward,
      "Validates the problem and launches `kernel` on `stream` (a cudaStream_t as int). Asynchronous.\n"
      "Pointers are device addresses as ints; strides are (batch, seq, head) in elements, the head dim\n"
      "contiguous; lse is 0 or a contiguous fp32 [B, Hq, Sq] buffer; softmax_scale None means 1/sqrt(D).\n"
      "Variable-length batch: cu_seqlens_q/cu_seqlens_k are device int32 [batch + 1] offsets, total_q/total_k\n"
      "the packed rows, seqlen_q/seqlen_k the longest lengths, lse [Hq, total_q] (see AttentionProblem).\n"
      "softcap: scores s become softcap * tanh(s / softcap) (0: off; the production forward, forward).\n"
      "seqlens_k: device int32 [batch], keys in use per sequence. Paged KV: block_table device int32\n"
      "[batch, max_pages_per_seq], k/v [num_pages, page_size, Hkv, D]. num_splits: split-KV parts (0 auto).\n"
      "kv_batch_idx: device int32 [batch], each sequence's cache entry (a batch entry of k/v, or a block_table\n"
      "row) among kv_batch; leftpad_k: device int32 [batch], each sequence's first key.\n"
      "workspace/workspace_bytes: device memory for split-KV's partial results or FP8's transposed V\n"
      "(workspace_size()); 0: the library takes it as scratch.\n"
      "scratch: None (the stream's pool) or a callable bytes -> an object with data_ptr() (e.g. a uint8 torch\n"
      "tensor) for the memory a call needs beside its tensors, kept alive until the call has enqueued its work.\n"
      "FP8: dtype 'e4m3' (q, k, v float8_e4m3fn, out bf16, D = 128, dense); q_descale/k_descale/v_descale:\n"
      "0 (scale 1) or device fp32 [batch, heads_kv] contiguous dequantization scales (FlashAttention-3's).");
  def_problem_function(
      m, "workspace_size", &workspace_size,
      "Bytes of workspace forward() needs for this problem (split-KV's partial results, or the FP8 path's\n"
      "transposed V; 0 when it needs none), after the same checks. Pass a buffer of at least that size as\n"
      "workspace/workspace_bytes.");
  def_problem_function(
      m, "backward", &backward,
      "The gradients of the forward problem given (its out and lse are inputs here): grads = (dout,\n"
      "dout_strides, dq, dq_strides, dk, dk_strides, dv, dv_strides), device pointers as ints and\n"
      "(batch, seq, head) element strides; kernel 'auto'. A variable-length batch takes forward's\n"
      "cu_seqlens_q/cu_seqlens_k/total_q/total_k, the gradients packed like q and k ([total, H, D], batch\n"
      "stride unused) and lse [Hq, total_q]. Launches on `stream`; asynchronous.");
  def_problem_function(
      m, "resolve_kernel", &resolve_kernel,
      "The kernel name `kernel` (e.g. 'auto') resolves to for this problem, without launching or a GPU.");
  const StrideTuple none_strides{0, 0, 0};
  m.def("append_kv", &append_kv, nb::kw_only(), nb::arg("dtype"), nb::arg("batch"), nb::arg("seqlen_new"),
        nb::arg("heads_kv"), nb::arg("head_dim"), nb::arg("k_new"), nb::arg("k_new_strides"), nb::arg("v_new"),
        nb::arg("v_new_strides"), nb::arg("k_cache"), nb::arg("k_cache_strides"), nb::arg("v_cache"),
        nb::arg("v_cache_strides"), nb::arg("seqlens"), nb::arg("cache_seqlen") = 0, nb::arg("block_table") = 0,
        nb::arg("max_pages_per_seq") = 0, nb::arg("num_pages") = 0, nb::arg("page_size") = 0,
        nb::arg("kv_batch_idx") = 0, nb::arg("kv_batch") = 0, nb::arg("seqlens_out") = 0, nb::arg("rotary_cos") = 0,
        nb::arg("rotary_sin") = 0, nb::arg("rotary_dim") = 0,
        nb::arg("rotary_seqlen") = 0, nb::arg("rotary_interleaved") = true, nb::arg("q") = 0,
        nb::arg("q_strides") = none_strides, nb::arg("q_rotated") = 0, nb::arg("q_rotated_strides") = none_strides,
        nb::arg("seqlen_q") = 0, nb::arg("heads_q") = 0, nb::arg("q_positions_per_row") = false,
        nb::arg("stream") = 0,
        "Writes k_new/v_new [B, seqlen_new, Hkv, D] into a dense (cache_seqlen rows) or paged (block_table)\n"
        "cache at keys seqlens[b] + i (device int32), skipping keys past the cache; seqlens_out (optional)\n"
        "gets seqlens + seqlen_new. With rotary_cos/rotary_sin [rotary_seqlen, rotary_dim / 2] (the dtype's)\n"
        "the new keys are rotated, and q into q_rotated (row i at seqlens[b] + i if q_positions_per_row,\n"
        "else seqlens[b]). kv_batch_idx (device int32 [B]): each sequence's entry among kv_batch (dense\n"
        "batch entries or block_table rows). Pointers are device addresses as ints; launches on `stream`;\n"
        "asynchronous.");
  m.def("kernels", &kernels, "The registered kernels in lineage order as (name, description); the last is the default.");
}
