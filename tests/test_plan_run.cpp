// plan() and run(): a plan refuses what forward() refuses, and runs on other tensors of the
// planned layout exactly as forward() runs them (bit for bit, and within the reference's
// budget); buffers that do not match the plan are refused by name.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>
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

TEST(Plan, BuffersOfAProblemAreItsAddresses) {
  const AttentionProblem p = testing::paged_problem();
  const Buffers b = buffers_of(p);
  EXPECT_EQ(b.q, p.q);
  EXPECT_EQ(b.out, p.out);
  EXPECT_EQ(b.seqlens_k, p.seqlens_k);
  EXPECT_EQ(b.block_table, p.block_table);
  EXPECT_EQ(b.cu_seqlens_q, nullptr);
}

// Padded strides, bf16, with an LSE.
Shape shape_of(int b, int sq, int sk, int hq, int hkv, int d, bool causal) {
  return testing::make(b, sq, sk, hq, hkv, d, causal, DType::bf16, Layout::padded);
}

// The cases: a dense causal batch, decoding that splits its keys, a varlen batch with a
// window, a paged cache, a negative scale (a sign-flipped copy of q), softcap at D = 64.
std::vector<Shape> planned_shapes() {
  std::vector<Shape> shapes = {shape_of(2, 300, 300, 4, 2, 128, true), shape_of(2, 1, 5000, 8, 2, 128, false)};
  Shape varlen = shape_of(1, 1, 1, 4, 4, 64, true);
  harness::set_varlen(&varlen, {100, 0, 257}, {130, 5, 300});
  varlen.window_left = 64;
  shapes.push_back(varlen);
  Shape paged = shape_of(3, 2, 700, 8, 1, 128, true);
  paged.seqlens_k_used = {700, 1, 333};
  paged.page_size = 256;
  shapes.push_back(paged);
  Shape negative = shape_of(1, 200, 200, 2, 2, 256, false);
  negative.scale = -0.05f;
  shapes.push_back(negative);
  Shape softcap = shape_of(2, 129, 400, 4, 4, 64, false);
  softcap.softcap = 20.f;
  shapes.push_back(softcap);
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
  for (const Shape& shape : planned_shapes()) {
    SCOPED_TRACE(harness::describe(shape));
    harness::Workload planned, other;
    ASSERT_TRUE(harness::make_workload(shape, 1, &planned).ok());
    ASSERT_TRUE(harness::make_workload(shape, 2, &other).ok());
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
    const harness::CheckResult r = harness::check_outputs(other, harness::all_rows(shape));
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
  b.lse = nullptr;  // planned with an LSE
  expect_refused(run(made, b), StatusCode::invalid_argument, "lse");
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
}

}  // namespace
}  // namespace hattn
