// The production forward's launch: the host side of kernel.cuh. plan.h decides, this file
// makes the tensor maps and the workspace and launches the kernels the plan names (the FP8 V
// transpose, the attention kernel, the combine of split items).
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "../common/common.cuh"
#include "../common/scratch.h"
#include "../common/tile_scheduler.cuh"
#include "../registry.h"
#include "../tensor_map.h"
#include "combine.cuh"
#include "fp8_transpose.cuh"
#include "kernel.cuh"
#include "negated_q.cuh"
#include "plan.h"
#include "work_order.cuh"

namespace hattn::fwd {
namespace {

constexpr const char* kName = "fwd_sm90";

// The plan's workspace (V^T, the split-KV partials or the sorted work order: one of them a
// call): the caller's (forward() checked its size), else `bytes` of scratch from the problem's
// allocator, which *scratch then holds for the caller to give back.
template <typename Ptr>
Status take_workspace(const AttentionProblem& problem, size_t bytes, cudaStream_t stream, const char* what, Ptr** out,
                      void** scratch) {
  *scratch = nullptr;
  if (problem.workspace != nullptr) {
    *out = static_cast<Ptr*>(problem.workspace);
    return Status::Ok();
  }
  const Status s = take_scratch(problem.allocator, bytes, stream, std::string(kName) + ": " + what, scratch);
  *out = static_cast<Ptr*>(*scratch);
  return s;
}

// `fp` is make_plan(problem): split.splits > 1 (run-time bounds kernels only): split-KV with
// that many parts; or split.tail_parts > 1 (not the window's kernels): the tail split. Either
// in the caller's workspace or, without one, in scratch from the problem's allocator.
// kFp8Kv: k and v are an e4m3 cache (kv_dequant.cuh). kDynamicList: fp.dynamic_order's kernel.
template <typename T, int D, bool kWide, int kNumConsumers, bool kRuntimeBounds, bool kWindow, bool kFp8Kv = false,
          bool kDynamicList = false>
Status launch_typed(const AttentionProblem& problem, const ForwardPlan& fp, cudaStream_t stream) {
  const FeatureParams& params = fp.params;
  const SplitPlan& split = fp.split;
  const int sms = fp.sms;
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers, kFp8Kv, kDynamicList>;
  constexpr int kSmem = smem_bytes<T, Cfg>();
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(problem, 64, Cfg::kBlockN, kName, &maps);  // Q: one consumer's rows per box
  if (!s.ok()) return s;
  // The run-time bounds kernels take Q and O in 5-D boxes of head groups (one head each
  // unless GQA packing puts a K/V head's query heads into the rows).
  const int group = 1 << params.pack_shift;
  if constexpr (kRuntimeBounds) {
    s = make_grouped_bshd_tensor_map(&maps.q, problem.q, problem.dtype, problem.tensor_batch(), problem.tensor_rows_q(),
                                     problem.heads_q, D, problem.q_strides, group, 64, 64);
    if (!s.ok()) return {s.code(), std::string(kName) + ": q: " + s.message()};
  }
  CUtensorMap o_map{};  // only read when O leaves by TMA
  if constexpr (Cfg::kStoreByTma) {
    if constexpr (kRuntimeBounds)
      s = make_grouped_bshd_tensor_map(&o_map, problem.out, output_dtype(problem.dtype), problem.tensor_batch(),
                                       problem.tensor_rows_q(), problem.heads_q, D, problem.out_strides, group, 64, 64);
    else
      s = make_bshd_tensor_map(&o_map, problem.out, output_dtype(problem.dtype), problem.tensor_batch(),
                               problem.tensor_rows_q(), problem.heads_q, D, problem.out_strides, 64,
                               64);  // one consumer warpgroup's rows per box
    if (!s.ok()) return {s.code(), std::string(kName) + ": out: " + s.message()};
  }
  const auto kernel = forward_kernel<T, D, kWide, kNumConsumers, kRuntimeBounds, kWindow, kFp8Kv, kDynamicList>;
  s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                  std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  // FP8: V is read through its transposed copy (8-bit wgmma operands are K-major only), made
  // first in the caller's workspace or in scratch (taken after every step that can fail without
  // giving it back).
  const ScratchAllocator* allocator = problem.allocator;
  uint8_t* vt = nullptr;
  void* vt_scratch = nullptr;  // taken here, given back here
  const size_t vt_bytes = fp.workspace_bytes;  // V^T's copy (FP8 only)
  if constexpr (kIsFp8<T>) {
    const int keys = vt_keys(problem.seqlen_k);
    if (!(s = take_workspace(problem, vt_bytes, stream, "V^T", &vt, &vt_scratch)).ok()) return s;
    transpose_v_kernel<D><<<dim3(unsigned(keys / kVtTileKeys), unsigned(problem.heads_kv), unsigned(problem.batch)), 256,
                            0, stream>>>(params, vt, keys);
    s = launch_status(kName);
    if (s.ok()) s = make_transposed_tensor_map(&maps.v, vt, problem.batch, problem.heads_kv, D, keys, kVtTileKeys);
    if (!s.ok()) {
      give_back_scratch(allocator, vt_scratch, vt_bytes, stream, kName, "V^T");
      return {s.code(), std::string(kName) + ": V^T: " + s.message()};
    }
  }
  PersistentLaunch grid_plan = fp.launch;  // planned on fp.block_m x fp.block_n, this kernel's tiles
  FeatureParams kernel_params = params;
  const int splits = split.splits;
  const int64_t rows_all = split.rows_all;
  bool tail = false;  // the tail split runs: its parts are in the work list
  float* workspace = nullptr;
  void* split_scratch = nullptr;  // taken here, given back here
  if ((kRuntimeBounds && splits > 1) || (!kWindow && split.tail_parts > 1)) {
    // A failure is the caller's to see (out of memory), not a silent switch to the unsplit plan.
    Status st = take_workspace(problem, split.bytes, stream, "split-KV workspace", &workspace, &split_scratch);
    if (!st.ok()) {
      give_back_scratch(allocator, vt_scratch, vt_bytes, stream, kName, "V^T");
      return st;
    }
    if (workspace != nullptr && split.tail_parts > 1) {
      // The tail split: the parts of the cut items, [tail item][part][row of the block].
      tail = true;
      const int64_t parts_all = int64_t(grid_plan.sched.total() - split.tail_start) * split.tail_parts;
      kernel_params.o_partial = workspace;
      kernel_params.lse_partial = workspace + size_t(parts_all) * Cfg::kBlockM * D;  // after all parts' rows
    } else if (workspace != nullptr) {
      kernel_params.splits = splits;
      kernel_params.o_partial = workspace;
      kernel_params.lse_partial = workspace + size_t(splits) * size_t(rows_all) * D;
      // The parts of a block are adjacent items (m_block = block * splits + part) in the order
      // by pair: each part's cost is a share of its block's.
      grid_plan.sched.m_blocks *= splits;
      grid_plan.sched.by_rank = false;
      grid_plan.ctas = int(std::min<int64_t>(int64_t(grid_plan.sched.total()), sms));
    }
  }
  // A variable-length batch: the list sorted by cost, written by one CTA before the attention
  // kernel (work_order.cuh), in the caller's workspace or in scratch.
  int* order = nullptr;
  void* order_scratch = nullptr;  // taken here, given back here
  if (fp.sorted_order) {
    if (!(s = take_workspace(problem, fp.workspace_bytes, stream, "work order", &order, &order_scratch)).ok()) return s;
    s = cuda_status(cudaFuncSetAttribute(order_items_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kOrderSmemBytes),
                    std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize) of the work order");
    if (s.ok()) {
      order_items_kernel<<<1, kOrderThreads, kOrderSmemBytes, stream>>>(kernel_params, fp.order, order);
      s = launch_status(kName);
    }
    if (!s.ok()) {
      give_back_scratch(allocator, order_scratch, fp.workspace_bytes, stream, kName, "work order");
      return s;
    }
    grid_plan.sched.by_rank = false;  // order[] holds positions of the order by pair
  }
  WorkList list(grid_plan.sched, tail ? split.tail_start : 0, tail ? split.tail_parts : 1, kernel_params.splits,
                kernel_params.heads_per_kv);
  list.own_sweeps = fp.own_sweeps;
  list.order = order;
  if constexpr (kDynamicList) list.next_item = order + list.total() + kOrderCounter;  // work_order.h
  const dim3 grid(unsigned(grid_plan.ctas), 1u, 1u);  // one CTA per SM (its threads take all 65536 registers)
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(maps.q, maps.k, maps.v, o_map, kernel_params, list);
  s = launch_status(kName);
  if (workspace != nullptr) {
    if (s.ok() && tail) {
      const int64_t tail_rows = int64_t(list.tail_items()) * Cfg::kBlockM;
      combine_tail_kernel<OutType<T>, D><<<unsigned((tail_rows + 3) / 4), 128, 0, stream>>>(kernel_params, list,
                                                                                             Cfg::kBlockM);
      s = launch_status(kName);
    } else if (s.ok()) {  // started early, beside the attention kernel's last CTAs
      s = launch_dependent(combine_splits_kernel<OutType<T>, D>, dim3(unsigned((rows_all + 3) / 4)), dim3(128), stream,
                           std::string(kName) + ": launching the split-KV combine", kernel_params, rows_all);
    }
  }
  const Status split_back = give_back_scratch(allocator, split_scratch, split.bytes, stream, kName, "split-KV workspace");
  const Status vt_back = give_back_scratch(allocator, vt_scratch, vt_bytes, stream, kName, "V^T");
  const Status order_back =
      give_back_scratch(allocator, order_scratch, fp.sorted_order ? fp.workspace_bytes : 0, stream, kName, "work order");
  if (s.ok()) s = split_back;
  if (s.ok()) s = vt_back;
  return s.ok() ? order_back : s;
}

static_assert(kPageMultiple % Config<64, false, 3>::kBlockN == 0 && kPageMultiple % Config<128, false, 2>::kBlockN == 0 &&
                  kPageMultiple % Config<256, false, 2>::kBlockN == 0 && kPageMultiple % Config<64, false, 2>::kBlockN == 0,
              "a page holds whole K/V tiles of the narrow shapes");

// The whole contract, any finite scale, as long as the work list fits an int
// (B * Hq * ceil(Sq / 128) < 2^31); a paged cache's pages must hold whole K/V tiles.
Status supports(const AttentionProblem& problem) {
  if (problem.dtype == DType::e4m3) {
    if (problem.has_window() || problem.has_sequence_bounds() || problem.softcap > 0.f)
      return {StatusCode::not_supported, std::string(kName) + ": e4m3 (FP8) inputs run dense batches only: no sliding "
                                                              "window, cu_seqlens, seqlens_k, block_table, "
                                                              "kv_batch_idx, leftpad_k or softcap"};
    if (problem.seqlen_k > (1 << 30))  // V^T's copy pads the keys to a multiple of 128 in an int
      return {StatusCode::not_supported, std::string(kName) + ": e4m3 (FP8) inputs take seqlen_k up to 2^30; got " +
                                             std::to_string(problem.seqlen_k)};
  }
  if (problem.has_fp8_cache() && problem.has_window())
    return {StatusCode::not_supported, std::string(kName) + ": an e4m3 KV cache (kv_dtype) runs without a sliding "
                                                            "window (window_left / window_right)"};
  if (problem.is_paged() && problem.page_size % kPageMultiple != 0)
    return {StatusCode::not_supported, std::string(kName) + ": page_size must be a multiple of " +
                                           std::to_string(kPageMultiple) + " (a K/V tile never spans two pages); got " +
                                           std::to_string(problem.page_size)};
  const int64_t items = work_items(problem.batch, problem.heads_q, problem.seqlen_q, Config<64, false, 2>::kBlockM);
  if (items > kMaxWorkItems)
    return {StatusCode::not_supported, std::string(kName) + ": batch * heads_q * ceil(seqlen_q / 128) = " +
                                           std::to_string(items) + " work items exceeds 2^30"};
  return Status::Ok();
}

// The kernel variant the plan names: run-time bounds (varlen, caches, split-KV, packing,
// softcap, decoding at D = 64), with a variable-length batch's list taken from its counter, a
// window, or neither.
template <typename T, int D, bool kWide, int kConsumers>
Status launch_variant(const AttentionProblem& problem, const ForwardPlan& fp, cudaStream_t stream) {
  if (fp.window) return launch_typed<T, D, kWide, kConsumers, true, true>(problem, fp, stream);
  if constexpr (kConsumers == 2) {
    if (fp.dynamic_order) return launch_typed<T, D, kWide, kConsumers, true, false, false, true>(problem, fp, stream);
  }
  if (!fp.dense) return launch_typed<T, D, kWide, kConsumers, true, false>(problem, fp, stream);
  return launch_typed<T, D, kWide, kConsumers, false, false>(problem, fp, stream);
}

Status launch_planned(const AttentionProblem& problem, ForwardPlan fp, cudaStream_t stream);

// scale < 0: the same problem on a sign-flipped copy of q with |scale| (negated_q.cuh), and the
// same plan. The copy is scratch from the problem's allocator, given back after the call.
Status launch_with_negated_q(const AttentionProblem& problem, const ForwardPlan& fp, cudaStream_t stream) {
  const int elem_bytes = problem.dtype == DType::e4m3 ? 1 : 2;
  const int64_t rows = int64_t(problem.tensor_batch()) * problem.tensor_rows_q() * problem.heads_q;
  const size_t bytes = size_t(rows) * problem.head_dim * elem_bytes;
  void* copy = nullptr;
  Status s = take_scratch(problem.allocator, bytes, stream,
                          std::string(kName) + ": q with its signs flipped (softmax_scale < 0)", &copy);
  if (!s.ok()) return s;
  const int64_t chunks = rows * problem.head_dim * elem_bytes / 16;
  const unsigned blocks = unsigned(std::min<int64_t>((chunks + 255) / 256, 65535));
  negate_q_kernel<<<blocks, 256, 0, stream>>>(make_params(problem), problem.tensor_batch(), problem.tensor_rows_q(),
                                              elem_bytes, static_cast<uint4*>(copy));
  s = launch_status(kName);
  if (s.ok()) {
    AttentionProblem flipped = problem;
    flipped.q = copy;
    flipped.q_strides = contiguous_bshd(problem.tensor_rows_q(), problem.heads_q, problem.head_dim);
    flipped.softmax_scale = -problem.scale();
    s = launch_planned(flipped, fp, stream);
  }
  const Status freed = give_back_scratch(problem.allocator, copy, bytes, stream, kName, "q copy");
  return s.ok() ? freed : s;
}

// `fp`: make_plan's decisions for the problem's shape; its params are made again from `problem`,
// whose addresses may be another call's than the planned one's (hattn::run()).
Status launch_planned(const AttentionProblem& problem, ForwardPlan fp, cudaStream_t stream) {
  if (problem.scale() < 0.f) return launch_with_negated_q(problem, fp, stream);
  bind_params(problem, &fp);
  if (fp.fp8_cache) {  // the run-time bounds kernel, narrow tiles, two consumers (make_plan)
    return dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {
      return launch_typed<T, D, false, 2, true, false, true>(problem, fp, stream);
    });
  }
  if (fp.fp8) {  // one shape per head dim: the dense kernel, 128-key tiles, two consumers
    if (problem.head_dim == 64) return launch_typed<__nv_fp8_e4m3, 64, false, 2, false, false>(problem, fp, stream);
    if (problem.head_dim == 128) return launch_typed<__nv_fp8_e4m3, 128, false, 2, false, false>(problem, fp, stream);
    return launch_typed<__nv_fp8_e4m3, 256, false, 2, false, false>(problem, fp, stream);
  }
  return dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {
    if constexpr (D == 64) {  // D = 64 never takes the wide tiles
      if (fp.consumers == 3) return launch_variant<T, 64, false, 3>(problem, fp, stream);
      return launch_variant<T, 64, false, 2>(problem, fp, stream);
    } else {
      if (fp.wide) return launch_variant<T, D, true, 2>(problem, fp, stream);
      return launch_variant<T, D, false, 2>(problem, fp, stream);
    }
  });
}

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  ForwardPlan fp;
  if (Status s = make_plan(problem, sm_count(), &fp); !s.ok()) return s;
  return launch_planned(problem, fp, stream);
}

// For hattn::plan() and run(): make_plan's decisions kept, and handed back.
struct Planned final : KernelPlan {
  ForwardPlan fp;
};

Status plan_decisions(const AttentionProblem& problem, std::shared_ptr<const KernelPlan>* decisions) {
  auto planned = std::make_shared<Planned>();
  if (Status s = make_plan(problem, sm_count(), &planned->fp); !s.ok()) return s;
  planned->block_m = planned->fp.block_m;
  planned->block_n = planned->fp.block_n;
  planned->splits = planned->fp.split.splits;
  planned->workspace_bytes = planned->fp.workspace_bytes;
  *decisions = std::move(planned);
  return Status::Ok();
}

Status launch_decided(const AttentionProblem& problem, const KernelPlan& decisions, cudaStream_t stream) {
  return launch_planned(problem, static_cast<const Planned&>(decisions).fp, stream);  // only its own plans come back
}

// The workspace launch() will use: the same plan, no launch.
Status workspace_bytes(const AttentionProblem& problem, size_t* bytes) {
  ForwardPlan fp;
  if (Status s = make_plan(problem, sm_count(), &fp); !s.ok()) return s;
  *bytes = fp.workspace_bytes;
  return Status::Ok();
}

}  // namespace
}  // namespace hattn::fwd

namespace hattn {

const KernelEntry& kernel_fwd_sm90() {
  static const KernelEntry entry{fwd::kName,
                                 "the production forward: every feature (windows, varlen, KV caches, split-KV, "
                                 "softcap, FP8, FP8 KV caches, GQA packing), split by role in src/attention/",
                                 fwd::supports, fwd::launch,
                                 Features{.window = true, .varlen = true, .paged = true, .fp8 = true, .fp8_cache = true,
                                          .softcap = true},
                                 fwd::workspace_bytes, fwd::plan_decisions, fwd::launch_decided};
  return entry;
}

}  // namespace hattn
