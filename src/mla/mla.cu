// MLA decoding's host side: the argument checks, the schedule, the cache's tensor map, and
// the launches (schedule when not given, attention, combine). kernel.cuh says how the kernel
// works, schedule.cuh how the keys are split across CTAs.
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "../common/common.cuh"
#include "../common/scratch.h"
#include "../common/tile_scheduler.cuh"
#include "../device_checks.h"
#include "../tensor_map.h"
#include "combine.cuh"
#include "kernel.cuh"
#include "schedule.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "mla_decode";

Status invalid(const std::string& message) { return {StatusCode::invalid_argument, message}; }

bool aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

int64_t row_stride_of(const MlaDecodeProblem& p) { return p.row_stride != 0 ? p.row_stride : kMlaHeadDimQk; }

int64_t page_stride_of(const MlaDecodeProblem& p) {
  return p.page_stride != 0 ? p.page_stride : int64_t(p.page_size) * row_stride_of(p);
}

int m_blocks_of(const MlaDecodeProblem& p) { return (p.rows() + mla::kBlockM - 1) / mla::kBlockM; }

// CTAs per 64-row block: together about one CTA per SM.
int parts_of(const MlaDecodeProblem& p, int sms) { return std::max(1, sms / m_blocks_of(p)); }

Status parts_on_device(const MlaDecodeProblem& p, int* parts) {
  const int sms = sm_count();
  if (sms <= 0) return {StatusCode::cuda_error, std::string(kName) + ": could not read the device's SM count"};
  *parts = parts_of(p, sms);
  return Status::Ok();
}

size_t workspace_bytes_for(const MlaDecodeProblem& p, int parts) {
  // Slots: each request has one more part than the runs that cut it, so at most batch + parts.
  const int64_t rows = int64_t(p.batch + parts) * p.rows();
  return size_t(rows) * (mla::kDimV + 1) * sizeof(float);
}

}  // namespace

float MlaDecodeProblem::scale() const {
  return softmax_scale != 0.f ? softmax_scale : 1.f / std::sqrt(float(kMlaHeadDimQk));
}

namespace {

// What the schedule reads: the request count, the rows per request and the lengths.
Status validate_schedule_arguments(const MlaDecodeProblem& p) {
  if (p.batch < 1) return invalid("batch: must be >= 1, got " + std::to_string(p.batch));
  if (p.seqlen_q < 1) return invalid("seqlen_q: must be >= 1, got " + std::to_string(p.seqlen_q));
  if (p.heads_q < 1) return invalid("heads_q: must be >= 1, got " + std::to_string(p.heads_q));
  if (int64_t(p.heads_q) * p.seqlen_q > (1 << 20))
    return invalid("heads_q * seqlen_q: at most 2^20 query rows per request, got " +
                   std::to_string(int64_t(p.heads_q) * p.seqlen_q));
  if (p.cache_seqlens == nullptr) return invalid("cache_seqlens: pointer is null");
  if (!aligned(p.cache_seqlens, 4)) return invalid("cache_seqlens: pointer must be 4-byte aligned (int32)");
  return Status::Ok();
}

}  // namespace

Status validate_mla_arguments(const MlaDecodeProblem& p) {
  if (p.dtype != DType::bf16 && p.dtype != DType::fp16)
    return invalid("dtype: must be bf16 or fp16 (got " + std::string(dtype_name(p.dtype)) + ")");
  if (Status s = validate_schedule_arguments(p); !s.ok()) return s;
  if (!std::isfinite(p.softmax_scale) || p.softmax_scale < 0.f)
    return invalid("softmax_scale: must be > 0 (or 0 for 1 / sqrt(576)), got " + std::to_string(p.softmax_scale));
  const struct {
    const char* name;
    const void* ptr;
  } pointers[] = {{"q", p.q}, {"kv_cache", p.kv_cache}, {"block_table", p.block_table},
                  {"cache_seqlens", p.cache_seqlens}, {"out", p.out}};
  for (const auto& t : pointers)
    if (t.ptr == nullptr) return invalid(std::string(t.name) + ": pointer is null");
  // Q's rows are read in 16-byte pieces, out's written in pairs, the cache by TMA.
  if (!aligned(p.q, 16)) return invalid("q: pointer must be 16-byte aligned");
  if (p.q_strides.batch % 8 != 0 || p.q_strides.seq % 8 != 0 || p.q_strides.head % 8 != 0)
    return invalid("q: strides must be multiples of 8 elements (16-byte aligned rows)");
  if (!aligned(p.out, 4)) return invalid("out: pointer must be 4-byte aligned");
  if (p.out_strides.batch % 2 != 0 || p.out_strides.seq % 2 != 0 || p.out_strides.head % 2 != 0)
    return invalid("out: strides must be even (pairs of elements are written together)");
  const struct {
    const char* name;
    const Strides& s;
  } tensors[] = {{"q", p.q_strides}, {"out", p.out_strides}};
  for (const auto& t : tensors) {
    const struct {
      const char* what;
      int64_t stride, extent;
    } dims[3] = {{"batch", t.s.batch, p.batch}, {"seq", t.s.seq, p.seqlen_q}, {"head", t.s.head, p.heads_q}};
    for (const auto& d : dims)
      if (d.extent > 1 && d.stride <= 0)
        return invalid(std::string(t.name) + ": " + d.what + " stride " + std::to_string(d.stride) +
                       " must be positive");
  }
  if (p.out == p.q) return invalid("out: must not alias q");
  if (p.page_size < mla::kBlockN || p.page_size % mla::kBlockN != 0)
    return invalid("page_size: must be a positive multiple of 64, got " + std::to_string(p.page_size));
  if (p.num_pages < 1) return invalid("num_pages: must be >= 1, got " + std::to_string(p.num_pages));
  if (p.max_pages_per_seq < 1)
    return invalid("max_pages_per_seq: must be >= 1, got " + std::to_string(p.max_pages_per_seq));
  if (int64_t(p.max_pages_per_seq) * p.page_size > INT32_MAX)
    return invalid("max_pages_per_seq * page_size: keys per request exceed 2^31 - 1");
  if (!aligned(p.kv_cache, 16)) return invalid("kv_cache: pointer must be 16-byte aligned");
  const int64_t row_stride = row_stride_of(p), page_stride = page_stride_of(p);
  if (row_stride < kMlaHeadDimQk || row_stride % 8 != 0)
    return invalid("kv_cache: row stride must be >= 576 and a multiple of 8 elements, got " + std::to_string(row_stride));
  if (page_stride < int64_t(p.page_size) * row_stride || page_stride % 8 != 0)
    return invalid("kv_cache: page stride must hold page_size rows and be a multiple of 8 elements, got " +
                   std::to_string(page_stride));
  if (!aligned(p.block_table, 4) || !aligned(p.cache_seqlens, 4))
    return invalid(std::string(aligned(p.block_table, 4) ? "cache_seqlens" : "block_table") +
                   ": pointer must be 4-byte aligned (int32)");
  if (p.lse != nullptr && !aligned(p.lse, 4)) return invalid("lse: pointer must be 4-byte aligned (fp32)");
  if (p.workspace != nullptr && !aligned(p.workspace, 16)) return invalid("workspace: pointer must be 16-byte aligned");
  if (p.schedule != nullptr && !aligned(p.schedule, 4)) return invalid("schedule: pointer must be 4-byte aligned");
  return Status::Ok();
}

Status mla_schedule_ints(const MlaDecodeProblem& problem, size_t* ints) {
  if (Status s = validate_schedule_arguments(problem); !s.ok()) return s;
  if (Status s = check_device(); !s.ok()) return s;
  int parts = 0;
  if (Status s = parts_on_device(problem, &parts); !s.ok()) return s;
  *ints = size_t(mla::schedule_ints(problem.batch, parts));
  return Status::Ok();
}

Status mla_workspace_size(const MlaDecodeProblem& problem, size_t* bytes) {
  if (Status s = validate_mla_arguments(problem); !s.ok()) return s;
  if (Status s = check_device(); !s.ok()) return s;
  int parts = 0;
  if (Status s = parts_on_device(problem, &parts); !s.ok()) return s;
  *bytes = workspace_bytes_for(problem, parts);
  return Status::Ok();
}

namespace {

// The schedule on the GPU (schedule.cuh's make_schedule): launched as <<<1, 32>>>, thread 0 plans.
__global__ void schedule_kernel(const int32_t* __restrict__ cache_seqlens, int batch, int parts,
                                int32_t* __restrict__ schedule) {
  if (threadIdx.x == 0) mla::make_schedule(cache_seqlens, batch, parts, schedule);
}

Status launch_schedule(const MlaDecodeProblem& p, int parts, int32_t* schedule, cudaStream_t stream) {
  schedule_kernel<<<1, 32, 0, stream>>>(p.cache_seqlens, p.batch, parts, schedule);
  return launch_status("mla_schedule");
}

}  // namespace

Status mla_schedule(const MlaDecodeProblem& problem, int32_t* schedule, cudaStream_t stream) {
  if (Status s = validate_schedule_arguments(problem); !s.ok()) return s;
  if (schedule == nullptr) return invalid("schedule: pointer is null");
  if (!aligned(schedule, 4)) return invalid("schedule: pointer must be 4-byte aligned");
  if (Status s = check_device_and_pointers({{"cache_seqlens", problem.cache_seqlens}, {"schedule", schedule}});
      !s.ok())
    return s;
  int parts = 0;
  if (Status s = parts_on_device(problem, &parts); !s.ok()) return s;
  return launch_schedule(problem, parts, schedule, stream);
}

namespace {

template <typename T>
Status launch_typed(const MlaDecodeProblem& problem, const CUtensorMap& kv_map, const mla::Params& params,
                    int m_blocks, cudaStream_t stream) {
  constexpr int kSmem = int(sizeof(mla::SharedStorage)) + 1024;  // + the 1024-byte alignment
  Status s = cuda_status(
      cudaFuncSetAttribute(mla::mla_decode_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
      std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  mla::mla_decode_kernel<T><<<dim3(unsigned(params.parts), unsigned(m_blocks)), mla::kThreads, kSmem, stream>>>(
      kv_map, params);
  if (s = launch_status(kName); !s.ok()) return s;
  // The combine: a warp per 128 columns of a row while that keeps the warps within about
  // 16 an SM (a long cache's few requests), else a warp per row. Started early, beside the
  // attention kernel's last CTAs.
  const int64_t rows = int64_t(problem.batch) * params.rows;
  const int64_t wide_warps = rows * (mla::kDimV / 128);
  const bool wide = wide_warps <= int64_t(16) * params.parts * m_blocks;
  const int64_t warps = wide ? wide_warps : rows;
  const dim3 grid(unsigned((warps + mla::kCombineWarps - 1) / mla::kCombineWarps)), block(32 * mla::kCombineWarps);
  const std::string what = std::string(kName) + ": launching the combine";
  return wide ? launch_dependent(mla::combine_kernel<T, 128>, grid, block, stream, what, params)
              : launch_dependent(mla::combine_kernel<T, mla::kDimV>, grid, block, stream, what, params);
}

}  // namespace

Status mla_decode(const MlaDecodeProblem& problem, cudaStream_t stream) {
  if (Status s = validate_mla_arguments(problem); !s.ok()) return s;
  if (Status s = check_device_and_pointers({{"q", problem.q},
                                            {"kv_cache", problem.kv_cache},
                                            {"block_table", problem.block_table},
                                            {"cache_seqlens", problem.cache_seqlens},
                                            {"out", problem.out},
                                            {"lse", problem.lse},
                                            {"schedule", problem.schedule},
                                            {"workspace", problem.workspace}});
      !s.ok())
    return s;
  if (problem.check.value_or(checking_from_environment()))
    if (Status s = check_mla_promises_on(problem, stream); !s.ok()) return s;
  int parts = 0;
  if (Status s = parts_on_device(problem, &parts); !s.ok()) return s;
  const int m_blocks = m_blocks_of(problem);
  if (int64_t(problem.batch) * problem.rows() >= INT32_MAX)
    return {StatusCode::not_supported,
            std::string(kName) + ": batch * heads_q * seqlen_q must be below 2^31 - 1 (a combine CTA per row)"};

  CUtensorMap kv_map{};
  const int64_t row_stride = row_stride_of(problem);
  Status s = make_bshd_tensor_map(&kv_map, problem.kv_cache, problem.dtype, problem.num_pages, problem.page_size, 1,
                                  kMlaHeadDimQk, Strides{page_stride_of(problem), row_stride, row_stride}, 64, 64);
  if (!s.ok()) return {s.code(), std::string(kName) + ": kv_cache: " + s.message()};

  // Scratch: the schedule when not given, the partial results when no workspace is.
  const size_t schedule_bytes = size_t(mla::schedule_ints(problem.batch, parts)) * sizeof(int32_t);
  const size_t partial_bytes = workspace_bytes_for(problem, parts);
  void* schedule_scratch = nullptr;
  void* partial_scratch = nullptr;
  const int32_t* schedule = problem.schedule;
  if (schedule == nullptr) {
    if (s = take_scratch(problem.allocator, schedule_bytes, stream, std::string(kName) + ": schedule", &schedule_scratch);
        !s.ok())
      return s;
    s = launch_schedule(problem, parts, static_cast<int32_t*>(schedule_scratch), stream);
    schedule = static_cast<const int32_t*>(schedule_scratch);
  }
  float* partial = static_cast<float*>(problem.workspace);
  if (s.ok() && partial == nullptr) {
    s = take_scratch(problem.allocator, partial_bytes, stream, std::string(kName) + ": split-KV workspace",
                     &partial_scratch);
    partial = static_cast<float*>(partial_scratch);
  }
  if (s.ok()) {
    mla::Params params{};
    params.q = problem.q;
    params.q_batch = problem.q_strides.batch, params.q_seq = problem.q_strides.seq, params.q_head = problem.q_strides.head;
    params.out = problem.out;
    params.o_batch = problem.out_strides.batch, params.o_seq = problem.out_strides.seq;
    params.o_head = problem.out_strides.head;
    params.lse = problem.lse;
    params.block_table = problem.block_table;
    params.cache_seqlens = problem.cache_seqlens;
    params.max_pages_per_seq = problem.max_pages_per_seq;
    params.page_size = problem.page_size;
    params.capacity = problem.max_pages_per_seq * problem.page_size;
    params.batch = problem.batch, params.seqlen_q = problem.seqlen_q, params.heads_q = problem.heads_q;
    params.rows = problem.rows();
    params.scale = problem.scale();
    params.scale_log2 = problem.scale() * float(M_LOG2E);
    params.causal = problem.causal ? 1 : 0;
    params.schedule = schedule;
    params.parts = parts;
    params.o_partial = partial;
    params.lse_partial = partial + size_t(problem.batch + parts) * params.rows * mla::kDimV;
    if (problem.dtype == DType::bf16)
      s = launch_typed<__nv_bfloat16>(problem, kv_map, params, m_blocks, stream);
    else
      s = launch_typed<__half>(problem, kv_map, params, m_blocks, stream);
  }
  const Status partial_back =
      give_back_scratch(problem.allocator, partial_scratch, partial_bytes, stream, kName, "split-KV workspace");
  const Status schedule_back =
      give_back_scratch(problem.allocator, schedule_scratch, schedule_bytes, stream, kName, "schedule");
  if (s.ok()) s = partial_back;
  return s.ok() ? schedule_back : s;
}

}  // namespace hattn
