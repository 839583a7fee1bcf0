// hattn._C: the Python module over the public C++ API.
//
// It binds at the level of raw device pointers and integer element strides, so it needs no
// torch headers: the build stays fast and works with any torch version. The problem types
// (AttentionProblem, BackwardProblem) are bound once, as classes whose attributes are their
// fields; python/hattn/ops/runner.py fills them from tensors.
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

// Scratch memory from a Python callable: scratch(bytes, stream) returns an object with data_ptr()
// for memory usable in that stream's order (the package passes torch.empty(bytes, dtype=
// torch.uint8) on the current device and that stream: torch's caching allocator), kept alive
// until the library gives it back. None: the
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
  static void* allocate(void* context, size_t bytes, cudaStream_t stream) {
    auto* self = static_cast<PythonScratch*>(context);
    nb::gil_scoped_acquire gil;
    try {
      nb::object block = self->fn_(bytes, reinterpret_cast<uintptr_t>(stream));
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

// A pointer field as an int (0: null), the Python side's data_ptr().
template <typename Class, typename T>
void def_pointer(nb::class_<Class>& c, const char* name, T* Class::*field) {
  c.def_prop_rw(
      name, [field](const Class& p) { return reinterpret_cast<uintptr_t>(p.*field); },
      [field](Class& p, uintptr_t value) { p.*field = reinterpret_cast<T*>(value); });
}

// A Strides field as a (batch, seq, head) tuple of element strides.
template <typename Class>
void def_strides(nb::class_<Class>& c, const char* name, hattn::Strides Class::*field) {
  c.def_prop_rw(
      name,
      [field](const Class& p) {
        const hattn::Strides& s = p.*field;
        return StrideTuple{s.batch, s.seq, s.head};
      },
      [field](Class& p, const StrideTuple& t) { p.*field = to_strides(t); });
}

// The addresses an AttentionProblem and a Buffers both hold, by the same names.
template <typename Class>
void def_addresses(nb::class_<Class>& c) {
  for (auto [name, field] : {std::pair{"q", &Class::q}, {"k", &Class::k}, {"v", &Class::v}}) def_pointer(c, name, field);
  def_pointer(c, "out", &Class::out);
  def_pointer(c, "lse", &Class::lse);
  for (auto [name, field] : {std::pair{"cu_seqlens_q", &Class::cu_seqlens_q}, {"cu_seqlens_k", &Class::cu_seqlens_k},
                             {"seqlens_k", &Class::seqlens_k}, {"block_table", &Class::block_table},
                             {"kv_batch_idx", &Class::kv_batch_idx}, {"leftpad_k", &Class::leftpad_k}})
    def_pointer(c, name, field);
  def_pointer(c, "workspace", &Class::workspace);
  for (auto [name, field] : {std::pair{"q_descale", &Class::q_descale}, {"k_descale", &Class::k_descale},
                             {"v_descale", &Class::v_descale}})
    def_pointer(c, name, field);
}

// `problem` with its allocator from `scratch`, for one call.
template <typename Call>
void with_scratch(nb::object scratch, Call&& call) {
  PythonScratch python_scratch(std::move(scratch));
  try {
    call(python_scratch.allocator());
  } catch (const nb::python_error& e) {
    if (python_scratch.error().empty()) throw;
    // The call found no scratch: its status names what it needed, the callable's error why.
    const std::string message =
        std::string(nb::str(e.value()).c_str()) + " (scratch raised " + python_scratch.error() + ")";
    PyErr_SetString(PyExc_RuntimeError, message.c_str());
    throw nb::python_error();
  }
}

hattn::Options make_options(const std::string& kernel, uintptr_t stream, std::optional<bool> check) {
  hattn::Options options;
  options.kernel = kernel;
  options.stream = reinterpret_cast<cudaStream_t>(stream);
  options.check = check;
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

void forward(const hattn::AttentionProblem& problem, const std::string& kernel, uintptr_t stream, nb::object scratch,
             std::optional<bool> check) {
  with_scratch(std::move(scratch), [&](const hattn::ScratchAllocator* allocator) {
    hattn::AttentionProblem p = problem;
    p.allocator = allocator;
    without_gil([&] { return hattn::forward(p, make_options(kernel, stream, check)); });
  });
}

void backward(const hattn::BackwardProblem& problem, const std::string& kernel, uintptr_t stream, nb::object scratch,
              std::optional<bool> check) {
  with_scratch(std::move(scratch), [&](const hattn::ScratchAllocator* allocator) {
    hattn::BackwardProblem b = problem;
    b.forward.allocator = allocator;
    without_gil([&] { return hattn::backward(b, make_options(kernel, stream, check)); });
  });
}

std::string resolve_kernel(const hattn::AttentionProblem& problem, const std::string& kernel) {
  std::string resolved;
  const hattn::Status status = hattn::resolve_kernel(problem, kernel, &resolved);
  if (!status.ok()) raise_status(status);
  return resolved;
}

hattn::Plan plan(const hattn::AttentionProblem& problem, const std::string& kernel) {
  hattn::Plan made;
  without_gil([&] { return hattn::plan(problem, &made, kernel); });
  return made;
}

void run(const hattn::Plan& plan, const hattn::Buffers& buffers, uintptr_t stream, nb::object scratch,
         std::optional<bool> check) {
  with_scratch(std::move(scratch), [&](const hattn::ScratchAllocator* allocator) {
    hattn::Buffers b = buffers;
    b.allocator = allocator;
    without_gil([&] { return hattn::run(plan, b, reinterpret_cast<cudaStream_t>(stream), check); });
  });
}

size_t workspace_size(const hattn::AttentionProblem& problem, const std::string& kernel) {
  size_t bytes = 0;
  without_gil([&] { return hattn::workspace_size(problem, &bytes, kernel); });
  return bytes;
}

// The problem types, bound once: fields as attributes (pointers as ints, strides as tuples),
// as include/hattn/hattn.h describes them.
void bind_problems(nb::module_& m) {
  using P = hattn::AttentionProblem;
  nb::class_<P> problem(m, "AttentionProblem",
                        "hattn::AttentionProblem (include/hattn/hattn.h): every field as an attribute; pointers are "
                        "device addresses as ints (0: none), strides (batch, seq, head) in elements.");
  problem.def(nb::init<>())
      .def_prop_rw(
          "dtype", [](const P& p) { return std::string(hattn::dtype_name(p.dtype)); },
          [](P& p, const std::string& name) { p.dtype = parse_dtype(name); })
      .def_prop_rw(  // an FP8 KV cache: 'e4m3' beside bf16/fp16 q; None: k and v are dtype
          "kv_dtype",
          [](const P& p) -> std::optional<std::string> {
            if (!p.kv_dtype) return std::nullopt;
            return std::string(hattn::dtype_name(*p.kv_dtype));
          },
          [](P& p, const std::optional<std::string>& name) {
            p.kv_dtype = name ? std::optional<hattn::DType>(parse_dtype(*name)) : std::nullopt;
          })
      .def_rw("batch", &P::batch)
      .def_rw("seqlen_q", &P::seqlen_q)
      .def_rw("seqlen_k", &P::seqlen_k)
      .def_rw("heads_q", &P::heads_q)
      .def_rw("heads_kv", &P::heads_kv)
      .def_rw("head_dim", &P::head_dim)
      .def_rw("softmax_scale", &P::softmax_scale)
      .def_rw("softcap", &P::softcap)
      .def_rw("causal", &P::causal)
      .def_rw("window_left", &P::window_left)
      .def_rw("window_right", &P::window_right)
      .def_rw("total_q", &P::total_q)
      .def_rw("total_k", &P::total_k)
      .def_rw("max_pages_per_seq", &P::max_pages_per_seq)
      .def_rw("num_pages", &P::num_pages)
      .def_rw("page_size", &P::page_size)
      .def_rw("kv_batch", &P::kv_batch)
      .def_rw("num_splits", &P::num_splits)
      .def_rw("pack_gqa", &P::pack_gqa)
      .def_rw("workspace_bytes", &P::workspace_bytes)
      .def("__copy__", [](const P& p) { return p; });
  def_addresses(problem);
  for (auto [name, field] : {std::pair{"q_strides", &P::q_strides}, {"k_strides", &P::k_strides},
                             {"v_strides", &P::v_strides}, {"out_strides", &P::out_strides}})
    def_strides(problem, name, field);

  using B = hattn::BackwardProblem;
  nb::class_<B> grads(m, "BackwardProblem",
                      "hattn::BackwardProblem: the forward problem (its out and lse are inputs) and the gradients' "
                      "tensors, dout, dq, dk and dv, with their strides; deterministic: gradients bitwise the same "
                      "from run to run.");
  grads.def(nb::init<>())
      .def_rw("forward", &B::forward)
      .def_rw("deterministic", &B::deterministic)
      .def("__copy__", [](const B& b) { return b; });
  def_pointer(grads, "dout", &B::dout);
  for (auto [name, field] : {std::pair{"dq", &B::dq}, {"dk", &B::dk}, {"dv", &B::dv}}) def_pointer(grads, name, field);
  for (auto [name, field] : {std::pair{"dout_strides", &B::dout_strides}, {"dq_strides", &B::dq_strides},
                             {"dk_strides", &B::dk_strides}, {"dv_strides", &B::dv_strides}})
    def_strides(grads, name, field);
}

// plan() and run(): the plan as a read-only object, a call's buffers like a problem's pointers.
void bind_plans(nb::module_& m) {
  using Bf = hattn::Buffers;
  nb::class_<Bf> buffers(m, "Buffers",
                         "hattn::Buffers: the addresses of one forward call (ints, 0: none), its workspace and "
                         "workspace_bytes; what run() takes in place of the plan's.");
  buffers.def(nb::init<>())
      .def_rw("workspace_bytes", &Bf::workspace_bytes)
      .def("__copy__", [](const Bf& b) { return b; });
  def_addresses(buffers);
  m.def("buffers_of", &hattn::buffers_of, nb::arg("problem"), "The Buffers an AttentionProblem names.");

  using Pl = hattn::Plan;
  nb::class_<Pl>(m, "Plan",
                 "hattn::Plan from plan(): a forward problem checked, its kernel resolved and the kernel's decisions "
                 "made once, for run() on calls that differ only in their buffers.")
      .def_prop_ro("kernel", &Pl::kernel)
      .def_prop_ro("workspace_bytes", &Pl::workspace_bytes)
      .def_prop_ro("block_m", &Pl::block_m)
      .def_prop_ro("block_n", &Pl::block_n)
      .def_prop_ro("splits", &Pl::splits);
  m.def("plan", &plan, nb::arg("problem"), nb::arg("kernel") = "auto",
        "A Plan for `problem` (an AttentionProblem) with `kernel` ('auto' or a name): forward()'s checks and\n"
        "decisions, on the current GPU, launching nothing.");
  m.def("run", &run, nb::arg("plan"), nb::arg("buffers"), nb::arg("stream") = 0, nb::arg("scratch") = nb::none(),
        nb::arg("check") = nb::none(),
        "Launches `plan` on `buffers` (a Buffers) on `stream`, as forward() would launch the plan's problem with\n"
        "them; scratch and check as for forward(). Asynchronous.");
}

// MLA decoding's problem, bound like the others.
void bind_mla(nb::module_& m) {
  using M = hattn::MlaDecodeProblem;
  nb::class_<M> mla(m, "MlaDecodeProblem",
                    "hattn::MlaDecodeProblem (include/hattn/hattn.h): q [B, Sq, Hq, 576], the paged latent cache "
                    "[num_pages, page_size, 1, 576], out [B, Sq, Hq, 512]; pointers as ints (0: none).");
  mla.def(nb::init<>())
      .def_prop_rw(
          "dtype", [](const M& p) { return std::string(hattn::dtype_name(p.dtype)); },
          [](M& p, const std::string& name) { p.dtype = parse_dtype(name); })
      .def_rw("batch", &M::batch)
      .def_rw("seqlen_q", &M::seqlen_q)
      .def_rw("heads_q", &M::heads_q)
      .def_rw("page_stride", &M::page_stride)
      .def_rw("row_stride", &M::row_stride)
      .def_rw("num_pages", &M::num_pages)
      .def_rw("page_size", &M::page_size)
      .def_rw("max_pages_per_seq", &M::max_pages_per_seq)
      .def_rw("softmax_scale", &M::softmax_scale)
      .def_rw("causal", &M::causal)
      .def_rw("check", &M::check);
  def_pointer(mla, "q", &M::q);
  def_pointer(mla, "kv_cache", &M::kv_cache);
  def_pointer(mla, "block_table", &M::block_table);
  def_pointer(mla, "cache_seqlens", &M::cache_seqlens);
  def_pointer(mla, "out", &M::out);
  def_pointer(mla, "lse", &M::lse);
  def_pointer(mla, "schedule", &M::schedule);
  def_pointer(mla, "workspace", &M::workspace);
  def_strides(mla, "q_strides", &M::q_strides);
  def_strides(mla, "out_strides", &M::out_strides);
  m.def(
      "mla_schedule_ints",
      [](const M& p) {
        size_t ints = 0;
        without_gil([&] { return hattn::mla_schedule_ints(p, &ints); });
        return ints;
      },
      nb::arg("problem"), "int32 entries of the split-KV schedule for this problem on the current GPU.");
  m.def(
      "mla_schedule",
      [](const M& p, uintptr_t schedule, uintptr_t stream) {
        without_gil([&] {
          return hattn::mla_schedule(p, reinterpret_cast<int32_t*>(schedule), reinterpret_cast<cudaStream_t>(stream));
        });
      },
      nb::arg("problem"), nb::arg("schedule"), nb::arg("stream") = 0,
      "Plans the split-KV schedule from problem.cache_seqlens into `schedule` (device int32, mla_schedule_ints\n"
      "entries) on `stream`, with no host sync.");
  m.def(
      "mla_decode",
      [](const M& problem, uintptr_t stream, nb::object scratch) {
        with_scratch(std::move(scratch), [&](const hattn::ScratchAllocator* allocator) {
          M p = problem;
          p.allocator = allocator;
          without_gil([&] { return hattn::mla_decode(p, reinterpret_cast<cudaStream_t>(stream)); });
        });
      },
      nb::arg("problem"), nb::arg("stream") = 0, nb::arg("scratch") = nb::none(),
      "Validates `problem` (an MlaDecodeProblem) and launches MLA decoding on `stream`; asynchronous.\n"
      "Without problem.schedule the schedule is made in the call; without problem.workspace the split parts'\n"
      "results are scratch (as for forward()).");
  m.def(
      "validate_mla_arguments",
      [](const M& p) {
        const hattn::Status status = hattn::validate_mla_arguments(p);
        if (!status.ok()) raise_status(status);
      },
      nb::arg("problem"), "The checks of mla_decode()'s arguments alone; needs no GPU.");
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
               bool q_positions_per_row, const std::string& cache_dtype, uintptr_t k_descale, uintptr_t v_descale,
               uintptr_t stream) {
  hattn::KvAppendProblem p;
  p.dtype = parse_dtype(dtype);
  if (!cache_dtype.empty()) p.cache_dtype = parse_dtype(cache_dtype);
  p.k_descale = reinterpret_cast<const float*>(k_descale);
  p.v_descale = reinterpret_cast<const float*>(v_descale);
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
  bind_problems(m);
  bind_plans(m);
  bind_mla(m);
  m.def("forward", &forward, nb::arg("problem"), nb::arg("kernel") = "auto", nb::arg("stream") = 0,
        nb::arg("scratch") = nb::none(), nb::arg("check") = nb::none(),
        "Validates `problem` (an AttentionProblem) and launches `kernel` ('auto' or a name) on `stream` (a\n"
        "cudaStream_t as int). Asynchronous. Without problem.workspace, split-KV's partial results and FP8's\n"
        "transposed V are scratch. scratch: None (the stream's pool) or a callable (bytes, stream) -> an object\n"
        "with data_ptr() (e.g. a uint8 torch tensor allocated for that stream) for the memory a call needs\n"
        "beside its tensors, kept alive until the call has enqueued its work. check: the checking mode\n"
        "(Options::check; None: HATTN_CHECK in the environment decides).");
  m.def("workspace_size", &workspace_size, nb::arg("problem"), nb::arg("kernel") = "auto",
        "Bytes of workspace forward() needs for this problem (split-KV's partial results, or the FP8 path's\n"
        "transposed V; 0 when it needs none), after the same checks. Pass a buffer of at least that size as\n"
        "problem.workspace / workspace_bytes.");
  m.def("backward", &backward, nb::arg("problem"), nb::arg("kernel") = "auto", nb::arg("stream") = 0,
        nb::arg("scratch") = nb::none(), nb::arg("check") = nb::none(),
        "The gradients of problem.forward (a BackwardProblem; the forward's out and lse are inputs here) into\n"
        "dq, dk and dv. A variable-length batch takes the forward's cu_seqlens_q/k and total_q/k, the gradients\n"
        "packed like q and k. Launches on `stream`; asynchronous; scratch and check as for forward().");
  m.def("resolve_kernel", &resolve_kernel, nb::arg("problem"), nb::arg("kernel") = "auto",
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
        nb::arg("cache_dtype") = "", nb::arg("k_descale") = 0, nb::arg("v_descale") = 0, nb::arg("stream") = 0,
        "Writes k_new/v_new [B, seqlen_new, Hkv, D] into a dense (cache_seqlen rows) or paged (block_table)\n"
        "cache at keys seqlens[b] + i (device int32), skipping keys past the cache; seqlens_out (optional)\n"
        "gets seqlens + seqlen_new. With rotary_cos/rotary_sin [rotary_seqlen, rotary_dim / 2] (the dtype's)\n"
        "the new keys are rotated, and q into q_rotated (row i at seqlens[b] + i if q_positions_per_row,\n"
        "else seqlens[b]). kv_batch_idx (device int32 [B]): each sequence's entry among kv_batch (dense\n"
        "batch entries or block_table rows). cache_dtype 'e4m3' (with k_descale/v_descale, fp32 [B, Hkv]):\n"
        "an FP8 cache, each value written as the e4m3 code of value / descale. Pointers are device addresses\n"
        "as ints; launches on `stream`; asynchronous.");
  m.def("kernels", &kernels, "The registered kernels in lineage order as (name, description); the last is the default.");
}
