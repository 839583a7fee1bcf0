// plan() and run(): a plan refuses what forward() refuses, and runs on other tensors of the
// planned layout exactly as forward() runs them (bit for bit, and within the reference's
// budget); buffers that do not match the plan are refused by name.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "../tools/harness.h"
#include "fake_problem.h"
#include "gpu_env.h"
#include "make_shape.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

using harness::Layout;
using harness::Shape;

void expect_refused(const Status& s, StatusCode code, const std::string& argument) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << "message should start with '" << argument
                                                      << ":' but is: " << s.message();
}

TEST(Plan, RefusesWhatForwardRefuses) {
  Plan made;
  AttentionProblem p = testing::valid_problem();
  p.head_dim = 96;
  expect_refused(plan(p, &made), StatusCode::invalid_argument, "head_dim");
  EXPECT_TRUE(made.empty());
  expect_refused(plan(testing::valid_problem(), &made, "no_such_kernel"), StatusCode::invalid_argument, "kernel");
  expect_refused(plan(testing::valid_problem(), nullptr), StatusCode::invalid_argument, "plan");
  if (testing::gpu_skip_reason().empty()) return;
  EXPECT_EQ(plan(testing::valid_problem(), &made).code(), StatusCode::no_device);
  EXPECT_TRUE(made.empty());
}

TEST(Plan, EmptyPlanRunsNothing) {
  const Plan empty;
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.kernel(), "");
  EXPECT_EQ(empty.workspace_bytes(), 0u);
  EXPECT_EQ(empty.splits(), 1);
  EXPECT_EQ(empty.problem().q, nullptr);
  expect_refused(run(empty, buffers_of(testing::valid_problem())), StatusCode::invalid_argument, "plan");
}

TEST(Plan, BuffersOfAProblemAreItsMemory) {
  AttentionProblem p = testing::paged_problem();
  uintptr_t next = 100;  // every field a distinct address
  auto fake = [&] { return testing::fake_ptr(next++); };
  p.lse = static_cast<float*>(const_cast<void*>(fake()));
  p.cu_seqlens_q = static_cast<const int32_t*>(fake());
  p.cu_seqlens_k = static_cast<const int32_t*>(fake());
  p.kv_batch_idx = static_cast<const int32_t*>(fake());
  p.leftpad_k = static_cast<const int32_t*>(fake());
  p.q_descale = static_cast<const float*>(fake());
  p.k_descale = static_cast<const float*>(fake());
  p.v_descale = static_cast<const float*>(fake());
  p.workspace = const_cast<void*>(fake());
  p.workspace_bytes = 12345;
  const ScratchAllocator allocator;
  p.allocator = &allocator;
  const Buffers b = buffers_of(p);
  EXPECT_EQ(b.q, p.q);
  EXPECT_EQ(b.k, p.k);
  EXPECT_EQ(b.v, p.v);
  EXPECT_EQ(b.out, p.out);
  EXPECT_EQ(b.lse, p.lse);
  EXPECT_EQ(b.cu_seqlens_q, p.cu_seqlens_q);
  EXPECT_EQ(b.cu_seqlens_k, p.cu_seqlens_k);
  EXPECT_EQ(b.seqlens_k, p.seqlens_k);
  EXPECT_EQ(b.block_table, p.block_table);
  EXPECT_EQ(b.kv_batch_idx, p.kv_batch_idx);
  EXPECT_EQ(b.leftpad_k, p.leftpad_k);
  EXPECT_EQ(b.q_descale, p.q_descale);
  EXPECT_EQ(b.k_descale, p.k_descale);
  EXPECT_EQ(b.v_descale, p.v_descale);
  EXPECT_EQ(b.workspace, p.workspace);
  EXPECT_EQ(b.workspace_bytes, 12345u);
  EXPECT_EQ(b.allocator, &allocator);
}

// Padded strides, bf16, with an LSE.
Shape shape_of(int b, int sq, int sk, int hq, int hkv, int d, bool causal) {
  return testing::make(b, sq, sk, hq, hkv, d, causal, DType::bf16, Layout::padded);
}

// The cases: a dense causal batch, decoding that splits its keys, a varlen batch with a
// window, a paged cache, a negative scale (a sign-flipped copy of q), softcap at D = 64. Each
// with the shape run on: the same, except that the varlen and paged cases' sequences trade
// lengths (the totals and the longest, which the plan reads, stay), so that a run that read the
// planned workload's arrays would give other rows.
std::vector<std::pair<Shape, Shape>> planned_shapes() {
  std::vector<std::pair<Shape, Shape>> shapes;
  for (const Shape& s : {shape_of(2, 300, 300, 4, 2, 128, true), shape_of(2, 1, 5000, 8, 2, 128, false)})
    shapes.emplace_back(s, s);
  Shape varlen = shape_of(1, 1, 1, 4, 4, 64, true), varlen_other;
  varlen.window_left = 64;
  varlen_other = varlen;
  harness::set_varlen(&varlen, {100, 0, 257}, {130, 5, 300});
  harness::set_varlen(&varlen_other, {257, 100, 0}, {300, 130, 5});
  shapes.emplace_back(varlen, varlen_other);
  Shape paged = shape_of(3, 2, 700, 8, 1, 128, true);
  paged.page_size = 256;
  Shape paged_other = paged;
  paged.seqlens_k_used = {700, 1, 333};
  paged_other.seqlens_k_used = {333, 700, 1};
  shapes.emplace_back(paged, paged_other);
  Shape negative = shape_of(1, 200, 200, 2, 2, 256, false);
  negative.scale = -0.05f;
  shapes.emplace_back(negative, negative);
  Shape softcap = shape_of(2, 129, 400, 4, 4, 64, false);
  softcap.softcap = 20.f;
  shapes.emplace_back(softcap, softcap);
  return shapes;
}

std::vector<uint8_t> read_bytes(const void* ptr, size_t bytes) {
  std::vector<uint8_t> host(bytes);
  EXPECT_EQ(cudaMemcpy(host.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// Planned on one workload, run on another of the same shape (other memory, other values):
// the same bytes as forward() on the second, and within the reference's budget.
TEST(PlanRun, RunsOtherTensorsAsForwardDoes) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (const auto& [shape, other_shape] : planned_shapes()) {
    SCOPED_TRACE(harness::describe(other_shape));
    harness::Workload planned, other;
    ASSERT_TRUE(harness::make_workload(shape, 1, &planned).ok());
    ASSERT_TRUE(harness::make_workload(other_shape, 2, &other).ok());
    Plan made;
    ASSERT_TRUE(plan(planned.problem, &made).ok());
    EXPECT_EQ(made.kernel(), "fwd_sm90");
    EXPECT_GT(made.block_m(), 0);
    EXPECT_GT(made.block_n(), 0);
    size_t bytes = 0;
    ASSERT_TRUE(workspace_size(planned.problem, &bytes).ok());
    EXPECT_EQ(made.workspace_bytes(), bytes);

    ASSERT_TRUE(harness::poison_outputs(&other).ok());
    ASSERT_TRUE(forward(other.problem).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const size_t out_bytes = other.output.device.bytes(), lse_bytes = other.lse.bytes();
    const std::vector<uint8_t> out = read_bytes(other.output.device.get(), out_bytes);
    const std::vector<uint8_t> lse = read_bytes(other.lse.get(), lse_bytes);

    ASSERT_TRUE(harness::poison_outputs(&other).ok());
    const Status s = run(made, buffers_of(other.problem));
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(read_bytes(other.output.device.get(), out_bytes) == out) << "run() and forward() differ";
    EXPECT_TRUE(read_bytes(other.lse.get(), lse_bytes) == lse) << "run() and forward() differ in the LSE";
    const harness::CheckResult r = harness::check_outputs(other, harness::all_rows(other_shape));
    EXPECT_TRUE(r.passed) << r.summary();
  }
}

// Decoding, 2 sequences x 8 query heads (GQA 4) over 5000 keys: few items, so split-KV.
void planned_decoding(uint64_t seed, harness::Workload* w, Plan* made) {
  ASSERT_TRUE(harness::make_workload(shape_of(2, 1, 5000, 8, 2, 128, false), seed, w).ok());
  ASSERT_TRUE(plan(w->problem, made).ok());
}

// Decoding with few items splits its keys: the plan says so and sizes the workspace.
TEST(PlanRun, SaysItsDecisions) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  harness::Workload w;
  Plan made;
  ASSERT_NO_FATAL_FAILURE(planned_decoding(3, &w, &made));
  EXPECT_GT(made.splits(), 1);
  EXPECT_GT(made.workspace_bytes(), 0u);
  AttentionProblem unsplit = w.problem;
  unsplit.num_splits = 1;
  ASSERT_TRUE(plan(unsplit, &made).ok());
  EXPECT_EQ(made.splits(), 1);
  EXPECT_EQ(made.workspace_bytes(), 0u);
  // A lineage step decides in each launch; its plan runs it all the same.
  bool lineage = false;
  for (const KernelInfo& k : kernels()) lineage |= k.name == "13_wide_tiles";
  if (!lineage) return;
  ASSERT_TRUE(plan(w.problem, &made, "13_wide_tiles").ok());
  EXPECT_EQ(made.kernel(), "13_wide_tiles");
  EXPECT_EQ(made.block_m(), 0);
  EXPECT_TRUE(run(made, buffers_of(w.problem)).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(PlanRun, RefusesBuffersThatDoNotMatch) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  harness::Workload w;
  Plan made;
  ASSERT_NO_FATAL_FAILURE(planned_decoding(4, &w, &made));
  const Buffers good = buffers_of(w.problem);
  Buffers b = good;
  b.lse = nullptr;  // planned with an LSE: the decisions do not rest on it
  EXPECT_TRUE(run(made, b).ok());
  b = good;
  b.seqlens_k = static_cast<const int32_t*>(w.lse.get());  // planned without keys in use
  expect_refused(run(made, b), StatusCode::invalid_argument, "seqlens_k");
  b = good;
  b.out = static_cast<char*>(b.out) + 2;  // not 16-byte aligned
  expect_refused(run(made, b), StatusCode::invalid_argument, "out");
  b = good;
  std::vector<uint16_t> host(16);
  b.q = host.data();  // not GPU memory
  expect_refused(run(made, b), StatusCode::invalid_argument, "q");
  b = good;
  b.out = const_cast<void*>(b.q);  // out over q
  expect_refused(run(made, b), StatusCode::invalid_argument, "out");
  ASSERT_GT(made.workspace_bytes(), 0u);
  harness::DeviceBuffer workspace;
  ASSERT_TRUE(workspace.allocate(made.workspace_bytes()).ok());
  b = good;
  b.workspace = workspace.get();
  b.workspace_bytes = made.workspace_bytes() - 1;
  expect_refused(run(made, b), StatusCode::invalid_argument, "workspace_bytes");
  b.workspace_bytes = made.workspace_bytes();
  EXPECT_TRUE(run(made, b).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // A failed plan() leaves the plan empty, not the one it held.
  AttentionProblem bad = w.problem;
  bad.head_dim = 96;
  EXPECT_FALSE(plan(bad, &made).ok());
  EXPECT_TRUE(made.empty());
}

}  // namespace
}  // namespace hattn
