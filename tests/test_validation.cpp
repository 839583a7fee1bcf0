// CPU tests: every malformed problem is refused with a status naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "fake_problem.h"
#include "gpu_env.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

using testing::fake_ptr;
using testing::valid_problem;
using testing::varlen_problem;
using testing::paged_problem;

void expect_invalid(const AttentionProblem& p, const std::string& argument) {
  Status s = validate_arguments(p);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << "message should start with '" << argument
                                                      << ":' but is: " << s.message();
  // forward() runs the same checks first, so it refuses before touching the device.
  EXPECT_EQ(forward(p).code(), StatusCode::invalid_argument);
}

TEST(Validation, ValidProblemPasses) { EXPECT_TRUE(validate_arguments(valid_problem()).ok()); }

TEST(Validation, BadDtype) {
  auto p = valid_problem();
  p.dtype = static_cast<DType>(7);
  expect_invalid(p, "dtype");
}

TEST(Validation, UnsupportedHeadDim) {
  for (int d : {0, 32, 96, 100, 512}) {
    auto p = valid_problem();
    p.head_dim = d;
    expect_invalid(p, "head_dim");
  }
}

TEST(Validation, NonPositiveSizes) {
  const std::pair<const char*, int AttentionProblem::*> fields[] = {{"batch", &AttentionProblem::batch},
                                                                     {"seqlen_q", &AttentionProblem::seqlen_q},
                                                                     {"seqlen_k", &AttentionProblem::seqlen_k},
                                                                     {"heads_q", &AttentionProblem::heads_q},
                                                                     {"heads_kv", &AttentionProblem::heads_kv}};
  for (const auto& [name, field] : fields)
    for (int value : {0, -3}) {
      auto p = valid_problem();
      p.*field = value;
      expect_invalid(p, name);
    }
}

TEST(Validation, HeadsNotDivisible) {
  auto p = valid_problem();
  p.heads_kv = 3;
  expect_invalid(p, "heads_kv");
}

TEST(Validation, GridLimits) {
  auto p = valid_problem();
  p.batch = 70000;
  expect_invalid(p, "batch");
}

TEST(Validation, NullPointers) {
  for (const char* name : {"q", "k", "v", "out"}) {
    auto p = valid_problem();
    if (std::string(name) == "q") p.q = nullptr;
    if (std::string(name) == "k") p.k = nullptr;
    if (std::string(name) == "v") p.v = nullptr;
    if (std::string(name) == "out") p.out = nullptr;
    expect_invalid(p, name);
  }
}

TEST(Validation, MisalignedPointers) {
  auto p = valid_problem();
  p.k = static_cast<const char*>(p.k) + 2;  // element-aligned but not 16-byte aligned
  expect_invalid(p, "k");
  p = valid_problem();
  p.lse = reinterpret_cast<float*>(0x100002);
  expect_invalid(p, "lse");
}

TEST(Validation, BadStrides) {
  auto p = valid_problem();
  p.q_strides.seq += 4;  // rows no longer 16-byte aligned
  expect_invalid(p, "q");
  p = valid_problem();
  p.v_strides.head = -128;
  expect_invalid(p, "v");
  p = valid_problem();
  p.k_strides.batch = 0;
  expect_invalid(p, "k");
}

TEST(Validation, StrideOfExtentOneDimensionIsIgnored) {
  auto p = valid_problem();
  p.batch = 1;
  p.q_strides.batch = 0;
  p.out_strides.batch = 12345;  // never used with a single batch
  EXPECT_TRUE(validate_arguments(p).ok());
}

TEST(Validation, OverlappingOutputIsRefused) {
  auto p = valid_problem();
  p.out_strides.head = 64;  // heads of D = 128 would overlap
  expect_invalid(p, "out");
  // Inputs may overlap (a broadcast view is legal to read).
  p = valid_problem();
  p.k_strides.head = 64;
  EXPECT_TRUE(validate_arguments(p).ok());
}

TEST(Validation, OutputsSharingMemoryWithTheInputsAreRefused) {
  auto expect_overlap = [](const AttentionProblem& p, const std::string& message) {
    expect_invalid(p, message.substr(0, message.find(':')));
    EXPECT_NE(validate_arguments(p).message().find(message), std::string::npos) << validate_arguments(p).message();
  };
  auto p = valid_problem();
  p.out = const_cast<void*>(p.q);  // in place over q
  expect_overlap(p, "out: overlaps q's memory");
  p = valid_problem();
  p.out = static_cast<char*>(const_cast<void*>(p.v)) + 4096;  // inside v
  expect_overlap(p, "out: overlaps v's memory");
  p = valid_problem();
  p.lse = reinterpret_cast<float*>(static_cast<char*>(p.out) + 1024);  // inside out
  expect_overlap(p, "lse: overlaps out's memory");
  p = valid_problem();
  p.lse = reinterpret_cast<float*>(const_cast<void*>(fake_ptr(9)));  // its own memory
  EXPECT_TRUE(validate_arguments(p).ok());
  // Right after the end of out: no overlap (out spans B Sq Hq D bf16 elements).
  p.lse = reinterpret_cast<float*>(static_cast<char*>(p.out) + size_t(2) * 100 * 8 * 128 * 2);
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
}

TEST(Validation, SoftcapTooSmallForTheScale) {
  auto p = valid_problem();
  p.softcap = 1e-45f;  // scale / softcap overflows fp32: every capped score would be NaN
  expect_invalid(p, "softcap");
  p.softcap = 1e-30f;
  EXPECT_TRUE(validate_arguments(p).ok());
}

TEST(Validation, NonFiniteScale) {
  auto p = valid_problem();
  p.softmax_scale = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(p, "softmax_scale");
}

TEST(Validation, DefaultScale) {
  auto p = valid_problem();
  EXPECT_FLOAT_EQ(p.scale(), 1.0f / std::sqrt(128.0f));
  p.softmax_scale = 0.5f;
  EXPECT_FLOAT_EQ(p.scale(), 0.5f);
}

TEST(Dispatch, UnknownKernelNamesTheArgument) {
  std::string resolved;
  Status s = resolve_kernel(valid_problem(), "no_such_kernel", &resolved);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find("kernel:"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("01_naive"), std::string::npos) << "should list the known kernels: " << s.message();
}

TEST(Dispatch, RegistryListsTheLineageInOrderThenTheProductionForward) {
  const auto list = kernels();
  ASSERT_GE(list.size(), 3u);
  EXPECT_EQ(list[0].name, "01_naive");
  EXPECT_EQ(list[1].name, "02_fused_online_softmax");
  EXPECT_EQ(list.back().name, "fwd_sm90");
  for (size_t i = 1; i + 1 < list.size(); ++i)
    EXPECT_LT(list[i - 1].name, list[i].name) << "numbered in lineage order";
  for (const auto& k : list) EXPECT_FALSE(k.description.empty()) << k.name;
}

TEST(Validation, BadWindow) {
  AttentionProblem p = valid_problem();
  p.window_left = -2;
  expect_invalid(p, "window_left");
  p = valid_problem();
  p.window_right = -5;
  expect_invalid(p, "window_right");
  p = valid_problem();  // causal's right edge is the diagonal: a window cannot move it
  p.causal = true;
  p.window_right = 3;
  expect_invalid(p, "window_right");
  p.window_right = 0;
  p.window_left = 10;
  EXPECT_TRUE(validate_arguments(p).ok());
}

// Only the production forward has the sliding window: "auto" picks it, a lineage kernel says no.
TEST(Dispatch, WindowGoesToTheFinalKernelOnly) {
  AttentionProblem p = valid_problem();
  p.window_left = 32;
  p.window_right = 0;
  std::string resolved;
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
  Status s = resolve_kernel(p, "15_three_consumers", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("sliding window"), std::string::npos) << s.message();
  p.window_left = -1;  // no window: every kernel again
  p.window_right = -1;
  EXPECT_TRUE(resolve_kernel(p, "15_three_consumers", &resolved).ok());
  p.causal = true;  // FlashAttention's causal window (-1, 0) is plain causal
  p.window_right = 0;
  EXPECT_FALSE(p.has_window());
  EXPECT_TRUE(resolve_kernel(p, "15_three_consumers", &resolved).ok());
}

TEST(Validation, VarlenProblemPasses) { EXPECT_TRUE(validate_arguments(varlen_problem()).ok()); }

TEST(Validation, BadVarlen) {
  AttentionProblem p = varlen_problem();
  p.cu_seqlens_k = nullptr;
  expect_invalid(p, "cu_seqlens_k");
  p = varlen_problem();
  p.cu_seqlens_q = nullptr;
  expect_invalid(p, "cu_seqlens_q");
  p = varlen_problem();
  p.cu_seqlens_q = reinterpret_cast<const int32_t*>(static_cast<const char*>(fake_ptr(5)) + 2);
  expect_invalid(p, "cu_seqlens_q");
  p = varlen_problem();
  p.total_q = 0;
  expect_invalid(p, "total_q");
  p = varlen_problem();
  p.total_k = -3;
  expect_invalid(p, "total_k");
  p = valid_problem();  // totals without offsets
  p.total_q = 10;
  expect_invalid(p, "total_q, total_k");
  p = varlen_problem();  // the packed rows' strides are checked over total rows
  p.q_strides.seq = 12;
  expect_invalid(p, "q");
  p = varlen_problem();  // out's rows must not overlap across the packed rows
  p.out_strides.seq = 8;
  expect_invalid(p, "out");
}

TEST(Validation, PagedProblemPasses) { EXPECT_TRUE(validate_arguments(paged_problem()).ok()); }

TEST(Validation, BadPagedCache) {
  AttentionProblem p = paged_problem();
  p.seqlens_k = nullptr;
  expect_invalid(p, "seqlens_k");
  for (auto field : {&AttentionProblem::page_size, &AttentionProblem::num_pages, &AttentionProblem::max_pages_per_seq}) {
    p = paged_problem();
    p.*field = 0;
    expect_invalid(p, field == &AttentionProblem::page_size   ? "page_size"
                      : field == &AttentionProblem::num_pages ? "num_pages"
                                                              : "max_pages_per_seq");
  }
  p = paged_problem();
  p.max_pages_per_seq = 1;  // 128 keys < seqlen_k 130
  expect_invalid(p, "seqlen_k");
  p = paged_problem();
  p.block_table = reinterpret_cast<const int32_t*>(static_cast<const char*>(fake_ptr(8)) + 2);
  expect_invalid(p, "block_table");
  p = paged_problem();
  p.cu_seqlens_q = static_cast<const int32_t*>(fake_ptr(5));
  p.cu_seqlens_k = static_cast<const int32_t*>(fake_ptr(6));
  p.total_q = p.total_k = 300;
  expect_invalid(p, "block_table");
  p = valid_problem();  // page geometry without a block table
  p.page_size = 128;
  expect_invalid(p, "page_size, num_pages, max_pages_per_seq");
}

// Only the production forward has seqlens_k and paged caches, and only with pages of whole K/V tiles.
TEST(Dispatch, PagedGoesToTheFinalKernelOnly) {
  AttentionProblem p = paged_problem();
  std::string resolved;
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
  Status s = resolve_kernel(p, "15_three_consumers", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("paged"), std::string::npos) << s.message();
  p.page_size = 16;  // vLLM's default: a tile would span pages
  p.max_pages_per_seq = 16;
  p.k_strides = p.v_strides = contiguous_bshd(16, p.heads_kv, p.head_dim);
  s = resolve_kernel(p, "auto", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("page_size must be a multiple of 128"), std::string::npos) << s.message();
  p = valid_problem();  // seqlens_k alone, on a dense cache
  p.seqlens_k = static_cast<const int32_t*>(fake_ptr(7));
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
  EXPECT_EQ(resolve_kernel(p, "14_seamless_items", &resolved).code(), StatusCode::not_supported);
}

// Cache entries (kv_batch_idx, with kv_batch entries) and left padding (leftpad_k).
TEST(Validation, BadCacheEntriesAndLeftPadding) {
  const auto* indices = static_cast<const int32_t*>(fake_ptr(9));
  AttentionProblem p = valid_problem();
  p.kv_batch_idx = indices;
  p.kv_batch = 1;  // k and v are then [1, Sk, Hkv, D]: their batch stride is not used
  p.k_strides.batch = p.v_strides.batch = 0;
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  p.kv_batch = 3;
  expect_invalid(p, "k");
  p.kv_batch = 0;
  expect_invalid(p, "kv_batch");
  p = valid_problem();
  p.kv_batch = 2;  // without kv_batch_idx
  expect_invalid(p, "kv_batch");
  p.kv_batch_idx = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(indices) + 2);
  expect_invalid(p, "kv_batch_idx");
  p = varlen_problem();
  p.kv_batch_idx = indices;
  p.kv_batch = 2;
  expect_invalid(p, "kv_batch_idx");
  p = paged_problem();  // a paged cache takes entries: block table rows
  p.kv_batch_idx = indices;
  p.kv_batch = 5;
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();

  p = valid_problem();
  p.leftpad_k = static_cast<const int32_t*>(fake_ptr(10));
  EXPECT_TRUE(validate_arguments(p).ok()) << validate_arguments(p).to_string();
  p.leftpad_k = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(p.leftpad_k) + 1);
  expect_invalid(p, "leftpad_k");
  p = paged_problem();
  p.leftpad_k = static_cast<const int32_t*>(fake_ptr(10));
  expect_invalid(p, "leftpad_k");
}

// Only the production forward has cache entries and left padding, and not with e4m3 inputs.
TEST(Dispatch, CacheEntriesAndLeftPaddingGoToTheFinalKernelOnly) {
  for (bool entries : {true, false}) {
    SCOPED_TRACE(entries ? "kv_batch_idx" : "leftpad_k");
    AttentionProblem p = valid_problem();
    if (entries) {
      p.kv_batch_idx = static_cast<const int32_t*>(fake_ptr(9));
      p.kv_batch = 2;
    } else {
      p.leftpad_k = static_cast<const int32_t*>(fake_ptr(10));
    }
    std::string resolved;
    ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
    EXPECT_EQ(resolved, kernels().back().name);
    Status s = resolve_kernel(p, "15_three_consumers", &resolved);
    EXPECT_EQ(s.code(), StatusCode::not_supported);
    EXPECT_NE(s.message().find("kv_batch_idx or leftpad_k"), std::string::npos) << s.message();
    p.dtype = DType::e4m3;
    s = resolve_kernel(p, kernels().back().name, &resolved);
    EXPECT_EQ(s.code(), StatusCode::not_supported);
    EXPECT_NE(s.message().find("dense batches only"), std::string::npos) << s.message();
  }
}

TEST(Validation, BadSoftcap) {
  for (float bad : {-1.f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    AttentionProblem p = valid_problem();
    p.softcap = bad;
    expect_invalid(p, "softcap");
  }
  AttentionProblem p = valid_problem();
  p.softcap = 30.f;
  EXPECT_TRUE(validate_arguments(p).ok());
}

// Only the production forward caps scores, and not with e4m3 inputs; the backward refuses it.
TEST(Dispatch, SoftcapGoesToTheFinalKernelOnly) {
  AttentionProblem p = valid_problem();
  p.softcap = 30.f;
  std::string resolved;
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
  Status s = resolve_kernel(p, "15_three_consumers", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("no softcap"), std::string::npos) << s.message();
  p.dtype = DType::e4m3;
  s = resolve_kernel(p, kernels().back().name, &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("softcap"), std::string::npos) << s.message();
}

TEST(Validation, BadNumSplits) {
  for (int parts : {-1, kMaxSplits + 1}) {
    AttentionProblem p = valid_problem();
    p.num_splits = parts;
    expect_invalid(p, "num_splits");
  }
  AttentionProblem p = valid_problem();
  for (int parts : {0, 1, 7, kMaxSplits}) {
    p.num_splits = parts;
    EXPECT_TRUE(validate_arguments(p).ok()) << parts;
  }
  std::string resolved;  // a hint: every kernel still runs the problem
  EXPECT_TRUE(resolve_kernel(p, "08_warp_specialization", &resolved).ok());
}

TEST(Validation, BadWorkspace) {
  AttentionProblem p = valid_problem();
  p.workspace = static_cast<char*>(const_cast<void*>(fake_ptr(8))) + 4;  // not 16-byte aligned
  p.workspace_bytes = 1024;
  expect_invalid(p, "workspace");
  p = valid_problem();
  p.workspace_bytes = 1024;  // a size without memory
  expect_invalid(p, "workspace_bytes");
  p.workspace = const_cast<void*>(fake_ptr(8));
  EXPECT_TRUE(validate_arguments(p).ok());
  size_t bytes = 1;
  EXPECT_EQ(workspace_size(p, nullptr).code(), StatusCode::invalid_argument);
  if (testing::gpu_skip_reason().empty()) return;  // without a GPU the query stops at the device check
  EXPECT_EQ(workspace_size(p, &bytes).code(), StatusCode::no_device);
  EXPECT_EQ(bytes, 0u);
}

// A scratch allocator must have both halves.
TEST(Validation, HalfAScratchAllocator) {
  AttentionProblem p = valid_problem();
  ScratchAllocator allocator;
  allocator.allocate = [](void*, size_t, cudaStream_t) -> void* { return nullptr; };
  p.allocator = &allocator;
  expect_invalid(p, "allocator");
  allocator.release = [](void*, void*, size_t, cudaStream_t) {};
  EXPECT_TRUE(validate_arguments(p).ok());
}

// Only the production forward has variable-length batches: "auto" picks it, a lineage kernel says no.
TEST(Dispatch, VarlenGoesToTheFinalKernelOnly) {
  AttentionProblem p = varlen_problem();
  std::string resolved;
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
  Status s = resolve_kernel(p, "15_three_consumers", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("variable-length"), std::string::npos) << s.message();
  p.causal = true;  // with the masks too
  p.window_left = 64;
  p.window_right = 0;
  EXPECT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
}

TEST(Dispatch, AutoPicksTheLastKernelThatSupportsTheProblem) {
  std::string resolved;
  ASSERT_TRUE(resolve_kernel(valid_problem(), "auto", &resolved).ok());
  EXPECT_EQ(resolved, kernels().back().name);
}

// The lineage kernels from 07 on take the max on raw scores and refuse a scale <= 0; the
// production forward takes every scale (a sign-flipped q for scale < 0), and "auto" runs it.
TEST(Dispatch, NonPositiveScaleGoesToTheProductionForward) {
  auto p = valid_problem();
  p.softmax_scale = -0.125f;
  std::string resolved;
  Status s = resolve_kernel(p, "12_epilogue_hot_loop", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("softmax_scale"), std::string::npos) << s.message();
  for (const char* name : {"07_wgmma", "08_warp_specialization", "09_pingpong", "10_intra_warpgroup_overlap",
                           "11_persistent", "13_wide_tiles", "14_seamless_items", "15_three_consumers",
                           "16_coalesced_store"})
    EXPECT_EQ(resolve_kernel(p, name, &resolved).code(), StatusCode::not_supported) << name;
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, "fwd_sm90");
  p.softmax_scale = 0.f;
  EXPECT_EQ(resolve_kernel(p, "07_wgmma", &resolved).code(), StatusCode::not_supported);
  ASSERT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_EQ(resolved, "fwd_sm90");
  EXPECT_TRUE(resolve_kernel(p, "06_tma_mbarrier", &resolved).ok());
  p.softmax_scale = 0.3f;
  ASSERT_TRUE(resolve_kernel(p, "12_epilogue_hot_loop", &resolved).ok());
}

TEST(Dispatch, NaiveRefusesHugeScoreMatrices) {
  auto p = valid_problem();
  p.seqlen_q = p.seqlen_k = 40000;  // S of one head: 6.4 GB
  p.q_strides = p.out_strides = contiguous_bshd(p.seqlen_q, p.heads_q, p.head_dim);
  p.k_strides = p.v_strides = contiguous_bshd(p.seqlen_k, p.heads_kv, p.head_dim);
  std::string resolved;
  Status s = resolve_kernel(p, "01_naive", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported);
  EXPECT_NE(s.message().find("01_naive"), std::string::npos) << s.message();
  // "auto" still finds a kernel that can run it.
  EXPECT_TRUE(resolve_kernel(p, "auto", &resolved).ok());
  EXPECT_NE(resolved, "01_naive");
}

TEST(Device, ForwardWithoutGpuOrWithHostPointersFailsCleanly) {
  // Valid arguments, but the fake pointers are not GPU memory. Without a GPU the device
  // check refuses first; with one, the pointer check does. Neither may crash.
  Status s = forward(valid_problem());
  if (!testing::gpu_skip_reason().empty()) {
    EXPECT_EQ(s.code(), StatusCode::no_device) << s.to_string();
  } else {
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
    EXPECT_EQ(s.message().rfind("q:", 0), 0u) << s.message();
  }
}

}  // namespace
}  // namespace hattn
