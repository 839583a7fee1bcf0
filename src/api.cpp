// forward(): argument validation, device checks, kernel resolution and launch.
//
// Messages are built with std::string and std::to_string, not iostreams: inside a Python
// extension loaded beside torch, ostream formatting crashed in libstdc++'s locale code (seen on
// the H200 image), and validation must never crash.
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "hattn/hattn.h"
#include "backward.h"
#include "device_checks.h"
#include "registry.h"

namespace hattn {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::e4m3: return "e4m3";
  }
  return "unknown";
}

int dtype_size(DType dtype) { return dtype == DType::e4m3 ? 1 : 2; }

DType output_dtype(DType dtype) { return dtype == DType::e4m3 ? DType::bf16 : dtype; }

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::ok: return "ok";
    case StatusCode::invalid_argument: return "invalid_argument";
    case StatusCode::not_supported: return "not_supported";
    case StatusCode::no_device: return "no_device";
    case StatusCode::cuda_error: return "cuda_error";
    case StatusCode::out_of_memory: return "out_of_memory";
  }
  return "unknown";
}

std::string Status::to_string() const {
  return ok() ? std::string("ok") : std::string(status_code_name(code_)) + ": " + message_;
}

Strides contiguous_bshd(int seqlen, int heads, int head_dim) {
  Strides s;
  s.head = head_dim;
  s.seq = int64_t(heads) * head_dim;
  s.batch = int64_t(seqlen) * heads * head_dim;
  return s;
}

float AttentionProblem::scale() const {
  return softmax_scale ? *softmax_scale : 1.0f / std::sqrt(float(head_dim));
}

// Built without the lineage (HATTN_LINEAGE=OFF), the registries hold what "auto" runs.
const std::vector<const KernelEntry*>& registry() {
  static const std::vector<const KernelEntry*> entries = {
#if HATTN_WITH_LINEAGE
      &kernel_01_naive(),
      &kernel_02_fused_online_softmax(),
      &kernel_03_mma_sync(),
      &kernel_04_swizzle(),
      &kernel_05_cp_async_pipeline(),
      &kernel_06_tma_mbarrier(),
      &kernel_07_wgmma(),
      &kernel_08_warp_specialization(),
      &kernel_09_pingpong(),
      &kernel_10_intra_warpgroup_overlap(),
      &kernel_11_persistent(),
      &kernel_12_epilogue_hot_loop(),
      &kernel_13_wide_tiles(),
      &kernel_14_seamless_items(),
      &kernel_15_three_consumers(),
      &kernel_16_coalesced_store(),
#endif
      &kernel_fwd_sm90(),  // the production forward: last, so that "auto" asks it first
  };
  return entries;
}

std::vector<KernelInfo> kernels() {
  std::vector<KernelInfo> out;
  for (const KernelEntry* e : registry()) out.push_back({e->name, e->description});
  return out;
}

namespace {

Status invalid(const std::string& message) { return {StatusCode::invalid_argument, message}; }

// Kernels index grid dimensions y and z with batch and heads.
constexpr int kMaxGridYZ = 65535;
// Rows are read with 16-byte vector loads.
constexpr int kRowAlignBytes = 16;

// elem_bytes: 2, or 1 for e4m3 inputs.
Status check_tensor(const char* name, const void* ptr, const Strides& strides, int batch, int seqlen,
                    int heads, int head_dim, bool is_output, int elem_bytes = 2) {
  if (ptr == nullptr) return invalid(std::string(name) + ": pointer is null");
  if (reinterpret_cast<uintptr_t>(ptr) % kRowAlignBytes != 0)
    return invalid(std::string(name) + ": pointer must be 16-byte aligned");
  struct Dim {
    const char* what;
    int64_t stride;
    int64_t extent;
  };
  const Dim dims[3] = {{"batch", strides.batch, batch}, {"seq", strides.seq, seqlen}, {"head", strides.head, heads}};
  const int64_t align_elems = kRowAlignBytes / elem_bytes;
  for (const Dim& d : dims) {
    if (d.extent == 1) continue;  // a stride over a dimension of extent 1 is never used
    if (d.stride <= 0 || d.stride % align_elems != 0) {
      return invalid(std::string(name) + ": " + d.what + " stride " + std::to_string(d.stride) +
                     " must be positive and a multiple of " + std::to_string(align_elems) +
                     " elements (16-byte aligned rows)");
    }
  }
  if (is_output) {
    // Distinct output elements must not alias, or two threads would race on one address.
    // Sort the dimensions by stride; each must step past everything spanned by the smaller ones.
    Dim sorted[4] = {{"dim", 1, head_dim}, dims[0], dims[1], dims[2]};
    for (int i = 1; i < 4; ++i)
      for (int j = i; j > 0 && sorted[j].stride < sorted[j - 1].stride; --j) std::swap(sorted[j], sorted[j - 1]);
    int64_t span = 0;  // largest offset reachable with the dimensions so far
    for (const Dim& d : sorted) {
      if (d.extent == 1) continue;
      if (d.stride <= span) {
        return invalid(std::string(name) + ": strides make distinct elements overlap (" + d.what + " stride " +
                       std::to_string(d.stride) + ")");
      }
      span += d.stride * (d.extent - 1);
    }
  }
  return Status::Ok();
}

// The bytes [begin, end) a strided [batch, seqlen, heads, head_dim] tensor can touch (strides in
// elements, positive where the extent is above 1: check_tensor's rule).
struct ByteRange {
  const char* name;
  uintptr_t begin, end;
};
ByteRange tensor_bytes(const char* name, const void* ptr, const Strides& strides, int batch, int seqlen, int heads,
                       int head_dim, int elem_bytes) {
  const int64_t last = (batch - 1) * (batch > 1 ? strides.batch : 0) + (seqlen - 1) * (seqlen > 1 ? strides.seq : 0) +
                       (heads - 1) * (heads > 1 ? strides.head : 0) + head_dim - 1;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr);
  return {name, begin, begin + uintptr_t(last + 1) * uintptr_t(elem_bytes)};
}

// lse: fp32 [B, Hq, Sq], or [Hq, total_q] for a variable-length batch; {0, 0} when not given.
ByteRange lse_bytes(const AttentionProblem& p) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p.lse);
  if (begin == 0) return {"lse", 0, 0};
  const int64_t rows = p.is_varlen() ? int64_t(p.total_q) : int64_t(p.batch) * p.seqlen_q;
  return {"lse", begin, begin + uintptr_t(rows * p.heads_q) * sizeof(float)};
}

// The bytes of a forward call's tensors (validated: check_tensor's rules hold).
struct ForwardRanges {
  ByteRange q, k, v, out, lse;
};
ForwardRanges forward_ranges(const AttentionProblem& p) {
  const int b = p.tensor_batch(), rows_q = p.tensor_rows_q(), kv_b = p.tensor_batch_k(), rows_k = p.tensor_rows_k();
  const int in_bytes = dtype_size(p.dtype), kv_bytes = dtype_size(p.kv_type());
  const int out_bytes = dtype_size(output_dtype(p.dtype));
  return {tensor_bytes("q", p.q, p.q_strides, b, rows_q, p.heads_q, p.head_dim, in_bytes),
          tensor_bytes("k", p.k, p.k_strides, kv_b, rows_k, p.heads_kv, p.head_dim, kv_bytes),
          tensor_bytes("v", p.v, p.v_strides, kv_b, rows_k, p.heads_kv, p.head_dim, kv_bytes),
          tensor_bytes("out", p.out, p.out_strides, b, rows_q, p.heads_q, p.head_dim, out_bytes), lse_bytes(p)};
}

// An output that shares memory with another tensor of the call would be read while it is written
// (or written twice): refused. The ranges are the tensors' spans, so a layout that interleaves
// an output with another tensor in one buffer is refused too.
Status check_no_overlap(const ByteRange& output, std::initializer_list<ByteRange> others) {
  for (const ByteRange& other : others) {
    if (other.begin == 0 || output.begin == 0) continue;  // an optional tensor not given
    if (output.begin < other.end && other.begin < output.end)
      return invalid(std::string(output.name) + ": overlaps " + other.name +
                     "'s memory (an output must not share memory with the call's other tensors)");
  }
  return Status::Ok();
}

}  // namespace

// The device the calling thread has current, checked to be a Hopper (sm_90) GPU.
Status check_device() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear, so the caller's next CUDA call does not see our probe's error
    return {StatusCode::no_device, std::string("no CUDA device is available (") +
                                       (err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0") + ")"};
  }
  int device = 0, major = 0, minor = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess) {
    cudaGetLastError();
    return {StatusCode::cuda_error, std::string("querying the current device: ") + cudaGetErrorString(err)};
  }
  if (major != 9 || minor != 0) {
    return {StatusCode::no_device, "hattn kernels are built for Hopper (sm_90a); device " + std::to_string(device) +
                                       " is sm_" + std::to_string(major) + std::to_string(minor)};
  }
  return Status::Ok();
}

// A host pointer handed to a kernel would fault the whole context, and another GPU's memory
// would be read over the interconnect or fault: refuse both here.
Status check_device_pointer(const char* name, const void* ptr, int device) {
  if (ptr == nullptr) return Status::Ok();
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return {StatusCode::cuda_error, std::string(name) + ": cudaPointerGetAttributes failed: " + cudaGetErrorString(err)};
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return invalid(std::string(name) + ": pointer is not GPU memory (device or managed)");
  if (attr.type == cudaMemoryTypeDevice && attr.device != device)
    return invalid(std::string(name) + ": pointer is memory of GPU " + std::to_string(attr.device) +
                   ", but the call runs on GPU " + std::to_string(device) + " (the current device)");
  return Status::Ok();
}

Status check_cache_entries(const int32_t* kv_batch_idx, int kv_batch) {
  if (kv_batch_idx == nullptr) {
    if (kv_batch != 0) return invalid("kv_batch: only with kv_batch_idx (got " + std::to_string(kv_batch) + ")");
    return Status::Ok();
  }
  if (reinterpret_cast<uintptr_t>(kv_batch_idx) % alignof(int32_t) != 0)
    return invalid("kv_batch_idx: pointer must be 4-byte aligned (int32 entries)");
  if (kv_batch < 1)
    return invalid("kv_batch: must be >= 1 with kv_batch_idx (the cache entries it indexes), got " +
                   std::to_string(kv_batch));
  return Status::Ok();
}

Status current_device(int* device) {
  if (cudaError_t err = cudaGetDevice(device); err != cudaSuccess) {
    cudaGetLastError();
    return {StatusCode::cuda_error, std::string("querying the current device: ") + cudaGetErrorString(err)};
  }
  return Status::Ok();
}

Status check_device_and_pointers(std::initializer_list<std::pair<const char*, const void*>> pointers) {
  Status s = check_device();
  if (!s.ok()) return s;
  int device = 0;
  if (!(s = current_device(&device)).ok()) return s;
  for (const auto& [name, ptr] : pointers)
    if (!(s = check_device_pointer(name, ptr, device)).ok()) return s;
  return Status::Ok();
}

namespace {

// What `features` lack of `problem`, named for kernel `name`; `production` names the kernel that
// has every feature of its direction (the forward's or the backward's). Ok when nothing lacks.
Status refuse_missing_features(const char* name, const Features& features, const AttentionProblem& problem,
                               const char* production) {
  const char* missing = nullptr;
  if (problem.has_window() && !features.window)
    missing = "no sliding window (window_left / window_right)";
  else if (problem.is_varlen() && !features.varlen)
    missing = "no variable-length batch (cu_seqlens_q / cu_seqlens_k)";
  else if ((problem.seqlens_k != nullptr || problem.is_paged()) && !features.paged)
    missing = "no seqlens_k or paged KV cache (block_table)";
  else if ((problem.kv_batch_idx != nullptr || problem.leftpad_k != nullptr) && !features.paged)
    missing = "no kv_batch_idx or leftpad_k (KV cache entries, left padding)";
  else if (problem.softcap > 0.f && !features.softcap)
    missing = "no softcap";
  else if (problem.dtype == DType::e4m3 && !features.fp8)
    missing = "no e4m3 (FP8) inputs";
  else if (problem.has_fp8_cache() && !features.fp8_cache)
    missing = "no e4m3 KV cache (kv_dtype)";
  if (missing == nullptr) return Status::Ok();
  return {StatusCode::not_supported, std::string(name) + ": " + missing + "; " + production + " has it"};
}

// The kernel's own supports(), after the features only some kernels have.
Status supports(const KernelEntry& entry, const AttentionProblem& problem) {
  const Status s = refuse_missing_features(entry.name, entry.features, problem, "the production forward fwd_sm90");
  return s.ok() ? entry.supports(problem) : s;
}

Status resolve(const AttentionProblem& problem, const std::string& kernel, const KernelEntry** out) {
  return resolve_entry(registry(), kernel, "kernel",
                       [&](const KernelEntry& entry) { return supports(entry, problem); }, out);
}

// Every address of a forward call, by name: of an AttentionProblem or of Buffers, which name
// them alike.
struct NamedPointer {
  const char* name;
  const void* ptr;
};
template <typename Memory>
std::array<NamedPointer, 15> named_pointers(const Memory& m) {
  return {{{"q", m.q},
           {"k", m.k},
           {"v", m.v},
           {"out", m.out},
           {"lse", m.lse},
           {"cu_seqlens_q", m.cu_seqlens_q},
           {"cu_seqlens_k", m.cu_seqlens_k},
           {"seqlens_k", m.seqlens_k},
           {"block_table", m.block_table},
           {"kv_batch_idx", m.kv_batch_idx},
           {"leftpad_k", m.leftpad_k},
           {"workspace", m.workspace},
           {"q_descale", m.q_descale},
           {"k_descale", m.k_descale},
           {"v_descale", m.v_descale}}};
}

// The memory of a call (addresses, workspace, allocator) from an AttentionProblem or Buffers to
// the other.
template <typename From, typename To>
void copy_memory(const From& from, To* to) {
  to->q = from.q;
  to->k = from.k;
  to->v = from.v;
  to->out = from.out;
  to->lse = from.lse;
  to->cu_seqlens_q = from.cu_seqlens_q;
  to->cu_seqlens_k = from.cu_seqlens_k;
  to->seqlens_k = from.seqlens_k;
  to->block_table = from.block_table;
  to->kv_batch_idx = from.kv_batch_idx;
  to->leftpad_k = from.leftpad_k;
  to->q_descale = from.q_descale;
  to->k_descale = from.k_descale;
  to->v_descale = from.v_descale;
  to->workspace = from.workspace;
  to->workspace_bytes = from.workspace_bytes;
  to->allocator = from.allocator;
}

// Each address of the call is memory of GPU `device`.
Status check_forward_pointers(const AttentionProblem& problem, int device) {
  for (const auto& [name, ptr] : named_pointers(problem))
    if (Status s = check_device_pointer(name, ptr, device); !s.ok()) return s;
  return Status::Ok();
}

Status check_all(const AttentionProblem& problem, const std::string& kernel, const KernelEntry** entry) {
  Status s = validate_arguments(problem);
  if (!s.ok()) return s;
  if (!(s = resolve(problem, kernel, entry)).ok()) return s;
  if (!(s = check_device()).ok()) return s;
  int device = 0;
  if (!(s = current_device(&device)).ok()) return s;
  return check_forward_pointers(problem, device);
}

// The caller's workspace, when given, holds the `needed` bytes.
Status check_workspace(const AttentionProblem& problem, const KernelEntry& entry, size_t needed) {
  if (problem.workspace == nullptr || problem.workspace_bytes >= needed) return Status::Ok();
  return invalid("workspace_bytes: " + std::to_string(problem.workspace_bytes) + " bytes given; " + entry.name +
                 " needs " + std::to_string(needed) + " for this problem (workspace_size())");
}

}  // namespace

Status validate_arguments(const AttentionProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::fp16 && p.dtype != DType::e4m3)
    return invalid("dtype: must be bf16, fp16 or e4m3 (got value " + std::to_string(int(p.dtype)) + ")");
  if (p.kv_dtype.has_value()) {
    const DType kv = *p.kv_dtype;
    if (kv != DType::bf16 && kv != DType::fp16 && kv != DType::e4m3)
      return invalid("kv_dtype: must be bf16, fp16 or e4m3 (got value " + std::to_string(int(kv)) + ")");
    if (kv != p.dtype && (kv != DType::e4m3 || p.dtype == DType::e4m3))
      return invalid(std::string("kv_dtype: k and v are dtype (") + dtype_name(p.dtype) +
                     ") or, beside bf16 or fp16 q, an e4m3 cache; got " + dtype_name(kv));
  }
  for (const auto& [name, ptr] : {std::pair<const char*, const float*>{"q_descale", p.q_descale},
                                  std::pair<const char*, const float*>{"k_descale", p.k_descale},
                                  std::pair<const char*, const float*>{"v_descale", p.v_descale}}) {
    if (ptr == nullptr) continue;
    if (p.has_fp8_cache() && std::string_view(name) == "q_descale")
      return invalid(std::string("q_descale: q is ") + dtype_name(p.dtype) +
                     "; an e4m3 KV cache takes k_descale and v_descale only");
    if (p.dtype != DType::e4m3 && !p.has_fp8_cache())
      return invalid(std::string(name) + ": dequantization scales are only for e4m3 inputs or an e4m3 kv_dtype (dtype is " +
                     dtype_name(p.dtype) + ")");
    if (reinterpret_cast<uintptr_t>(ptr) % alignof(float) != 0)
      return invalid(std::string(name) + ": pointer must be 4-byte aligned (fp32 [batch, heads_kv])");
  }
  const std::pair<const char*, int> sizes[] = {{"batch", p.batch},       {"seqlen_q", p.seqlen_q},
                                               {"seqlen_k", p.seqlen_k}, {"heads_q", p.heads_q},
                                               {"heads_kv", p.heads_kv}};
  for (const auto& [name, value] : sizes)
    if (value < 1) return invalid(std::string(name) + ": must be >= 1 (got " + std::to_string(value) + ")");
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return invalid("head_dim: must be 64, 128 or 256 (got " + std::to_string(p.head_dim) + ")");
  if (p.heads_q % p.heads_kv != 0)
    return invalid("heads_kv: heads_q (" + std::to_string(p.heads_q) + ") must be a multiple of heads_kv (" +
                   std::to_string(p.heads_kv) + ")");
  if (p.batch > kMaxGridYZ) return invalid("batch: at most 65535 (got " + std::to_string(p.batch) + ")");
  if (p.heads_q > kMaxGridYZ) return invalid("heads_q: at most 65535 (got " + std::to_string(p.heads_q) + ")");
  if (p.softmax_scale && !std::isfinite(*p.softmax_scale)) return invalid("softmax_scale: must be finite");
  if (!(p.softcap >= 0.f) || !std::isfinite(p.softcap))
    return invalid("softcap: must be finite and >= 0 (0: off), got " + std::to_string(p.softcap));
  if (p.softcap > 0.f && !std::isfinite(p.scale() / p.softcap))  // the kernels' tanh argument: s * scale / softcap
    return invalid("softcap: " + std::to_string(p.softcap) + " is too small for the softmax scale (scale / softcap "
                   "overflows fp32)");
  if (p.window_left < -1)
    return invalid("window_left: must be >= 0, or -1 for no left edge (got " + std::to_string(p.window_left) + ")");
  if (p.window_right < -1)
    return invalid("window_right: must be >= 0, or -1 for no right edge (got " + std::to_string(p.window_right) + ")");
  if (p.causal && p.window_right > 0)
    return invalid("window_right: must be -1 or 0 with causal, whose right edge is the diagonal (got " +
                   std::to_string(p.window_right) + ")");

  // A variable-length batch's tensors are one packed sequence of total rows each.
  const bool varlen = p.is_varlen();
  if (varlen) {
    if (p.cu_seqlens_q == nullptr) return invalid("cu_seqlens_q: must be set together with cu_seqlens_k");
    if (p.cu_seqlens_k == nullptr) return invalid("cu_seqlens_k: must be set together with cu_seqlens_q");
    for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"cu_seqlens_q", p.cu_seqlens_q},
                                    std::pair<const char*, const void*>{"cu_seqlens_k", p.cu_seqlens_k}})
      if (reinterpret_cast<uintptr_t>(ptr) % alignof(int32_t) != 0)
        return invalid(std::string(name) + ": pointer must be 4-byte aligned (int32 offsets)");
    if (p.total_q < 1) return invalid("total_q: must be >= 1 with cu_seqlens (got " + std::to_string(p.total_q) + ")");
    if (p.total_k < 1) return invalid("total_k: must be >= 1 with cu_seqlens (got " + std::to_string(p.total_k) + ")");
  } else if (p.total_q != 0 || p.total_k != 0) {
    return invalid("total_q, total_k: only for a variable-length batch (set cu_seqlens_q and cu_seqlens_k), got " +
                   std::to_string(p.total_q) + ", " + std::to_string(p.total_k));
  }
  if (p.num_splits < 0 || p.num_splits > kMaxSplits)
    return invalid("num_splits: must be 0 (automatic), 1 (off) or up to " + std::to_string(kMaxSplits) + " (got " +
                   std::to_string(p.num_splits) + ")");
  if (p.workspace != nullptr && reinterpret_cast<uintptr_t>(p.workspace) % kRowAlignBytes != 0)
    return invalid("workspace: pointer must be 16-byte aligned");
  if (p.allocator != nullptr && (p.allocator->allocate == nullptr || p.allocator->release == nullptr))
    return invalid("allocator: needs both allocate and release");
  if (p.workspace == nullptr && p.workspace_bytes != 0)
    return invalid("workspace_bytes: " + std::to_string(p.workspace_bytes) + " given without a workspace pointer");
  if (p.seqlens_k != nullptr && reinterpret_cast<uintptr_t>(p.seqlens_k) % alignof(int32_t) != 0)
    return invalid("seqlens_k: pointer must be 4-byte aligned (int32 lengths)");
  const bool paged = p.is_paged();
  if (paged) {
    if (varlen) return invalid("block_table: a paged cache cannot be combined with cu_seqlens (varlen)");
    if (p.seqlens_k == nullptr) return invalid("seqlens_k: must be set with block_table (keys in each sequence's pages)");
    if (reinterpret_cast<uintptr_t>(p.block_table) % alignof(int32_t) != 0)
      return invalid("block_table: pointer must be 4-byte aligned (int32 page indices)");
    const std::pair<const char*, int> counts[] = {
        {"page_size", p.page_size}, {"num_pages", p.num_pages}, {"max_pages_per_seq", p.max_pages_per_seq}};
    for (const auto& [name, value] : counts)
      if (value < 1) return invalid(std::string(name) + ": must be >= 1 with block_table (got " + std::to_string(value) + ")");
    if (int64_t(p.max_pages_per_seq) * p.page_size < p.seqlen_k)
      return invalid("seqlen_k: " + std::to_string(p.seqlen_k) + " keys do not fit in max_pages_per_seq (" +
                     std::to_string(p.max_pages_per_seq) + ") pages of page_size (" + std::to_string(p.page_size) + ")");
  } else if (p.page_size != 0 || p.num_pages != 0 || p.max_pages_per_seq != 0) {
    return invalid("page_size, num_pages, max_pages_per_seq: only with block_table (a paged cache)");
  }
  if (p.kv_batch_idx != nullptr && varlen)
    return invalid("kv_batch_idx: not with cu_seqlens (a variable-length batch has no cache entries)");
  if (Status s = check_cache_entries(p.kv_batch_idx, p.kv_batch); !s.ok()) return s;
  if (p.leftpad_k != nullptr) {
    if (paged) return invalid("leftpad_k: not with block_table (a paged cache's K/V tiles start on its pages)");
    if (reinterpret_cast<uintptr_t>(p.leftpad_k) % alignof(int32_t) != 0)
      return invalid("leftpad_k: pointer must be 4-byte aligned (int32 offsets)");
  }
  const int tensor_batch = p.tensor_batch(), rows_q = p.tensor_rows_q();
  const int kv_batch = p.tensor_batch_k(), kv_rows = p.tensor_rows_k();
  Status s;
  const int in_bytes = dtype_size(p.dtype), kv_bytes = dtype_size(p.kv_type());
  const int out_bytes = dtype_size(output_dtype(p.dtype));
  if (!(s = check_tensor("q", p.q, p.q_strides, tensor_batch, rows_q, p.heads_q, p.head_dim, false, in_bytes)).ok())
    return s;
  if (!(s = check_tensor("k", p.k, p.k_strides, kv_batch, kv_rows, p.heads_kv, p.head_dim, false, kv_bytes)).ok())
    return s;
  if (!(s = check_tensor("v", p.v, p.v_strides, kv_batch, kv_rows, p.heads_kv, p.head_dim, false, kv_bytes)).ok())
    return s;
  if (!(s = check_tensor("out", p.out, p.out_strides, tensor_batch, rows_q, p.heads_q, p.head_dim, true, out_bytes))
           .ok())
    return s;
  if (p.lse != nullptr && reinterpret_cast<uintptr_t>(p.lse) % alignof(float) != 0)
    return invalid("lse: pointer must be 4-byte aligned");
  const ForwardRanges r = forward_ranges(p);
  if (!(s = check_no_overlap(r.out, {r.q, r.k, r.v})).ok()) return s;
  return check_no_overlap(r.lse, {r.q, r.k, r.v, r.out});
}

Status resolve_kernel(const AttentionProblem& problem, const std::string& kernel, std::string* resolved) {
  Status s = validate_arguments(problem);
  if (!s.ok()) return s;
  const KernelEntry* entry = nullptr;
  if (!(s = resolve(problem, kernel, &entry)).ok()) return s;
  if (resolved) *resolved = entry->name;
  return s;
}

Status check(const AttentionProblem& problem, const std::string& kernel) {
  const KernelEntry* entry = nullptr;
  return check_all(problem, kernel, &entry);
}

Status workspace_size(const AttentionProblem& problem, size_t* bytes, const std::string& kernel) {
  if (bytes == nullptr) return invalid("bytes: pointer is null");
  *bytes = 0;
  const KernelEntry* entry = nullptr;
  Status s = check_all(problem, kernel, &entry);
  if (!s.ok() || entry->workspace_bytes == nullptr) return s;
  return entry->workspace_bytes(problem, bytes);
}

Status forward(const AttentionProblem& problem, const Options& options) {
  const KernelEntry* entry = nullptr;
  Status s = check_all(problem, options.kernel, &entry);
  if (!s.ok()) return s;
  if (problem.workspace != nullptr && entry->workspace_bytes != nullptr) {
    size_t needed = 0;
    if (!(s = entry->workspace_bytes(problem, &needed)).ok() || !(s = check_workspace(problem, *entry, needed)).ok())
      return s;
  }
  if (options.check.value_or(checking_from_environment()) && !(s = check_promises_on(problem, options.stream)).ok())
    return s;
  return entry->launch(problem, options.stream);
}

// --- plan() and run() ----------------------------------------------------------------------------

struct Plan::State {
  AttentionProblem problem;  // as planned: its addresses, no workspace or allocator
  const KernelEntry* entry = nullptr;
  std::string kernel;                           // entry->name
  std::shared_ptr<const KernelPlan> decisions;  // null: the kernel decides in each launch
  size_t workspace_bytes = 0;
  int device = 0;  // the GPU current at plan()
};

const std::string& Plan::kernel() const {
  static const std::string none;
  return state_ ? state_->kernel : none;
}
size_t Plan::workspace_bytes() const { return state_ ? state_->workspace_bytes : 0; }
int Plan::block_m() const { return state_ && state_->decisions ? state_->decisions->block_m : 0; }
int Plan::block_n() const { return state_ && state_->decisions ? state_->decisions->block_n : 0; }
int Plan::splits() const { return state_ && state_->decisions ? state_->decisions->splits : 1; }
const AttentionProblem& Plan::problem() const {
  static const AttentionProblem none;
  return state_ ? state_->problem : none;
}

Buffers buffers_of(const AttentionProblem& problem) {
  Buffers b;
  copy_memory(problem, &b);
  return b;
}

Status plan(const AttentionProblem& problem, Plan* plan, const std::string& kernel) {
  if (plan == nullptr) return invalid("plan: pointer is null");
  *plan = Plan{};
  auto state = std::make_shared<Plan::State>();
  Status s = validate_arguments(problem);
  if (!s.ok() || !(s = resolve(problem, kernel, &state->entry)).ok() || !(s = check_device()).ok() ||
      !(s = current_device(&state->device)).ok())
    return s;
  const KernelEntry& entry = *state->entry;
  if (problem.workspace != nullptr && entry.workspace_bytes != nullptr) {  // as forward() refuses it
    size_t needed = 0;
    if (!(s = entry.workspace_bytes(problem, &needed)).ok() || !(s = check_workspace(problem, entry, needed)).ok())
      return s;
  }
  if (entry.plan != nullptr) {  // the decisions once, the workspace with them
    if (!(s = entry.plan(problem, &state->decisions)).ok()) return s;
    state->workspace_bytes = state->decisions->workspace_bytes;
  } else if (entry.workspace_bytes != nullptr && !(s = entry.workspace_bytes(problem, &state->workspace_bytes)).ok()) {
    return s;
  }
  state->problem = problem;
  // Each run gives its own workspace and allocator; the plan keeps neither (a caller's may not
  // outlive the planning call).
  state->problem.workspace = nullptr;
  state->problem.workspace_bytes = 0;
  state->problem.allocator = nullptr;
  state->kernel = entry.name;
  *plan = Plan(std::move(state));
  return Status::Ok();
}

Status run(const Plan& plan, const Buffers& buffers, cudaStream_t stream, std::optional<bool> check) {
  const Plan::State* state = plan.state();
  if (state == nullptr) return invalid("plan: empty (make one with hattn::plan())");
  // The arrays the kernel's decisions rest on (a variable-length batch, keys in use, a paged
  // cache, cache entries, left padding) must be there exactly where they were planned; lse, the
  // descales and the workspace may come and go.
  const auto planned = named_pointers(state->problem), given = named_pointers(buffers);
  for (size_t i = 0; i < planned.size(); ++i) {
    const std::string_view name = planned[i].name;
    const bool decides = name == "cu_seqlens_q" || name == "cu_seqlens_k" || name == "seqlens_k" ||
                         name == "block_table" || name == "kv_batch_idx" || name == "leftpad_k";
    if (!decides || (planned[i].ptr == nullptr) == (given[i].ptr == nullptr)) continue;
    return invalid(std::string(name) + ": the plan was made " + (planned[i].ptr ? "with" : "without") +
                   " it, and this run " + (given[i].ptr ? "gives" : "does not give") + " it (plan this problem)");
  }
  AttentionProblem p = state->problem;
  copy_memory(buffers, &p);
  // The addresses as forward() checks them (the shape checks again too: arithmetic only).
  Status s = validate_arguments(p);
  if (!s.ok()) return s;
  int device = 0;
  if (!(s = current_device(&device)).ok()) return s;
  if (device != state->device)
    return invalid("plan: made for GPU " + std::to_string(state->device) + ", but GPU " + std::to_string(device) +
                   " is current (a plan belongs to one GPU)");
  if (!(s = check_forward_pointers(p, device)).ok()) return s;
  if (!(s = check_workspace(p, *state->entry, state->workspace_bytes)).ok()) return s;
  if (check.value_or(checking_from_environment()) && !(s = check_promises_on(p, stream)).ok()) return s;
  if (state->decisions != nullptr) return state->entry->launch_planned(p, *state->decisions, stream);
  return state->entry->launch(p, stream);
}

Status validate_backward_arguments(const BackwardProblem& problem) {
  const AttentionProblem& p = problem.forward;
  Status s = validate_arguments(p);
  if (!s.ok()) return s;
  if (p.lse == nullptr)
    return invalid("lse: the backward needs the forward's log-sum-exp (fp32 [B, Hq, Sq], or [Hq, total_q] for a "
                   "variable-length batch)");
  if (!(s = check_tensor("dout", problem.dout, problem.dout_strides, p.tensor_batch(), p.tensor_rows_q(), p.heads_q,
                         p.head_dim, false)).ok())
    return s;
  if (!(s = check_tensor("dq", problem.dq, problem.dq_strides, p.tensor_batch(), p.tensor_rows_q(), p.heads_q,
                         p.head_dim, true)).ok())
    return s;
  if (!(s = check_tensor("dk", problem.dk, problem.dk_strides, p.tensor_batch(), p.tensor_rows_k(), p.heads_kv,
                         p.head_dim, true)).ok())
    return s;
  if (!(s = check_tensor("dv", problem.dv, problem.dv_strides, p.tensor_batch(), p.tensor_rows_k(), p.heads_kv,
                         p.head_dim, true)).ok())
    return s;
  // The forward's tensors were checked against each other by validate_arguments; the
  // gradients against every tensor of the call.
  const int b = p.tensor_batch(), rows_q = p.tensor_rows_q(), rows_k = p.tensor_rows_k();
  const int e = dtype_size(p.dtype);
  const ForwardRanges r = forward_ranges(p);
  const ByteRange dout =
      tensor_bytes("dout", problem.dout, problem.dout_strides, b, rows_q, p.heads_q, p.head_dim, e);
  const ByteRange dq = tensor_bytes("dq", problem.dq, problem.dq_strides, b, rows_q, p.heads_q, p.head_dim, e);
  const ByteRange dk = tensor_bytes("dk", problem.dk, problem.dk_strides, b, rows_k, p.heads_kv, p.head_dim, e);
  const ByteRange dv = tensor_bytes("dv", problem.dv, problem.dv_strides, b, rows_k, p.heads_kv, p.head_dim, e);
  if (!(s = check_no_overlap(dq, {r.q, r.k, r.v, r.out, dout, r.lse, dk, dv})).ok()) return s;
  if (!(s = check_no_overlap(dk, {r.q, r.k, r.v, r.out, dout, r.lse, dv})).ok()) return s;
  return check_no_overlap(dv, {r.q, r.k, r.v, r.out, dout, r.lse});
}

namespace {
// The backward kernels in lineage order, then the production backward (last: "auto" asks it first).
const std::vector<const BackwardKernel*>& backward_kernels() {
#if HATTN_WITH_LINEAGE
  static const std::vector<const BackwardKernel*> all{&backward_cuda_core(), &backward_mma_sync(), &backward_wgmma(),
                                                      &backward_dq_per_cta(), &backward_tma_dq(), &backward_hot_loop(),
                                                      &backward_dkdv_direct(), &backward_dq_overlap(),
                                                      &backward_split_d(), &backward_dq_pass(),
                                                      &backward_dq_pipeline(), &backward_dkdv_pipeline(),
                                                      &backward_producer(), &backward_tma_dkdv(),
                                                      &backward_tma_sums(), &backward_sm90()};
#else
  static const std::vector<const BackwardKernel*> all{&backward_sm90()};
#endif
  return all;
}
}  // namespace

std::vector<std::string> backward_kernel_names() {
  std::vector<std::string> names;
  for (const BackwardKernel* k : backward_kernels()) names.emplace_back(k->name);
  return names;
}

namespace {
// The kernel that runs `problem` (validated): options.kernel by name, or "auto".
Status resolve_backward(const BackwardProblem& problem, const std::string& name, const BackwardKernel** out) {
  const AttentionProblem& p = problem.forward;
  if (p.dtype == DType::e4m3)
    return {StatusCode::not_supported, "backward: dtype e4m3 is forward-only; the backward takes bf16 or fp16"};
  if (p.has_fp8_cache())
    return {StatusCode::not_supported, "backward: an e4m3 kv_dtype (FP8 KV cache) is forward-only"};
  // A variable-length batch (cu_seqlens) is fine; keys in use and pages are not there yet.
  if (p.seqlens_k != nullptr || p.is_paged() || p.kv_batch_idx != nullptr || p.leftpad_k != nullptr)
    return {StatusCode::not_supported,
            "backward: no seqlens_k, paged KV cache (block_table), kv_batch_idx or leftpad_k yet; dense and "
            "variable-length (cu_seqlens) batches only"};
  // "auto", as for the forward (resolve_entry): the newest kernel that supports the problem (the
  // production backward bwd_sm90, dense or variable-length, at every head dim).
  // Windows, variable-length batches, softcapping: only the kernels that say so (as for the
  // forward, refuse_missing_features; each kernel's own supports() does not ask).
  auto supports = [&](const BackwardKernel& k) -> Status {
    const Status s = refuse_missing_features(k.name, k.features, p, "the production backward bwd_sm90");
    if (!s.ok()) return s;
    if (problem.deterministic) {
      using D = Features::Deterministic;
      const D d = k.features.deterministic;
      if (d == D::no || (d == D::without_gqa && p.heads_q != p.heads_kv))
        return {StatusCode::not_supported,
                std::string(k.name) + ": deterministic=true" + (d == D::no ? "" : " with GQA") +
                    " is not supported (its fp32 sums add in no fixed order; bwd_sm90 has it, at D = 256 "
                    "without GQA)"};
    }
    return k.supports(problem);
  };
  return resolve_entry(backward_kernels(), name, "backward kernel", supports, out);
}

}  // namespace

Status resolve_backward_kernel(const BackwardProblem& problem, const std::string& kernel, std::string* resolved) {
  Status s = validate_backward_arguments(problem);
  if (!s.ok()) return s;
  const BackwardKernel* k = nullptr;
  if (!(s = resolve_backward(problem, kernel, &k)).ok()) return s;
  if (resolved) *resolved = k->name;
  return s;
}

Status backward(const BackwardProblem& problem, const Options& options) {
  Status s = validate_backward_arguments(problem);
  if (!s.ok()) return s;
  const BackwardKernel* kernel = nullptr;
  if (!(s = resolve_backward(problem, options.kernel, &kernel)).ok()) return s;
  const AttentionProblem& p = problem.forward;
  s = check_device_and_pointers({{"q", p.q},           {"k", p.k},           {"v", p.v},
                                 {"out", p.out},       {"lse", p.lse},       {"cu_seqlens_q", p.cu_seqlens_q},
                                 {"cu_seqlens_k", p.cu_seqlens_k}, {"dout", problem.dout}, {"dq", problem.dq},
                                 {"dk", problem.dk},   {"dv", problem.dv}});
  if (!s.ok()) return s;
  if (options.check.value_or(checking_from_environment()) && !(s = check_promises_on(p, options.stream)).ok()) return s;
  return kernel->launch(problem, options.stream);
}

}  // namespace hattn
