// The checking mode (Options::check, check_promises): each promise a problem's device arrays
// make, broken, is refused with an error naming the argument; kept, it passes. The arrays live
// in device memory; the tensors' pointers stay fake where only check_promises runs (it never
// reads them), and are real where forward() and backward() run.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../tools/harness.h"
#include "fake_problem.h"
#include "gpu_env.h"
#include "hattn/hattn.h"

namespace hattn {
namespace {

// Device copies of small arrays, kept for the test's length.
class DeviceArrays {
 public:
  template <typename T>
  const T* put(const std::vector<T>& values) {
    buffers_.emplace_back();
    EXPECT_TRUE(buffers_.back().allocate(values.size() * sizeof(T)).ok());
    EXPECT_EQ(cudaMemcpy(buffers_.back().get(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    return static_cast<const T*>(buffers_.back().get());
  }

 private:
  std::vector<harness::DeviceBuffer> buffers_;
};

void expect_broken(const AttentionProblem& p, const std::string& argument, const std::string& detail) {
  const Status s = check_promises(p);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << s.message();
  EXPECT_NE(s.message().find(detail), std::string::npos) << s.message();
}

void expect_kept(const AttentionProblem& p) {
  const Status s = check_promises(p);
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(Checking, ValidatesTheProblemAndTheDeviceFirst) {
  AttentionProblem p = testing::valid_problem();
  p.head_dim = 96;
  EXPECT_EQ(check_promises(p).code(), StatusCode::invalid_argument);
  if (!testing::gpu_skip_reason().empty()) EXPECT_EQ(check_promises(testing::valid_problem()).code(), StatusCode::no_device);
}

// Three sequences, the longest 100 queries and 130 keys (seqlen_q, seqlen_k), in 500 and 700 rows.
TEST(Checking, VarlenOffsets) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  DeviceArrays d;
  AttentionProblem p = testing::varlen_problem();
  auto with = [&](std::vector<int32_t> q, std::vector<int32_t> k) {
    AttentionProblem c = p;
    c.cu_seqlens_q = d.put(q);
    c.cu_seqlens_k = d.put(k);
    return c;
  };
  expect_kept(with({0, 100, 180, 260}, {0, 130, 130, 260}));  // an empty sequence is fine
  expect_broken(with({5, 100, 180, 260}, {0, 130, 130, 260}), "cu_seqlens_q", "must start at 0, got 5");
  expect_broken(with({0, 100, 50, 260}, {0, 130, 130, 260}), "cu_seqlens_q", "must not decrease (entry 2: 50 after 100)");
  expect_broken(with({0, 100, 180, 290}, {0, 130, 130, 260}), "seqlen_q", "below sequence 2's length 110");
  expect_broken(with({0, 100, 180, 260}, {0, 131, 131, 261}), "seqlen_k", "below sequence 0's length 131");
  AttentionProblem few_rows = with({0, 100, 180, 260}, {0, 130, 130, 260});
  few_rows.total_k = 250;
  expect_broken(few_rows, "cu_seqlens_k", "ends at 260, past total_k = 250");
}

// Two sequences of a paged cache: 40 pages of 128 keys, 4 a sequence, seqlen_k 130.
TEST(Checking, KvCacheIndices) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  DeviceArrays d;
  AttentionProblem p = testing::paged_problem();
  auto with = [&](std::vector<int32_t> used, std::vector<int32_t> table) {
    AttentionProblem c = p;
    c.seqlens_k = d.put(used);
    c.block_table = d.put(table);
    return c;
  };
  // Pages a sequence does not use may hold anything (here -1).
  expect_kept(with({130, 7}, {3, 9, -1, -1, 12, -1, -1, -1}));
  expect_kept(with({130, 0}, {3, 9, -1, -1, -1, -1, -1, -1}));
  expect_broken(with({131, 7}, {3, 9, -1, -1, 12, -1, -1, -1}), "seqlens_k", "entry 0 is 131, outside [0, 130]");
  expect_broken(with({-1, 7}, {3, 9, -1, -1, 12, -1, -1, -1}), "seqlens_k", "entry 0 is -1");
  expect_broken(with({130, 7}, {3, 40, -1, -1, 12, -1, -1, -1}), "block_table", "entry (0, 1) is 40, outside [0, 39]");
  expect_broken(with({130, 7}, {3, 9, -1, -1, -1, -1, -1, -1}), "block_table", "entry (1, 0) is -1");
  // Cache entries: sequence b reads table row kv_batch_idx[b] of kv_batch = 3 rows.
  AttentionProblem entries = with({130, 7}, {-1, -1, -1, -1, 5, -1, -1, -1, 3, 9, -1, -1});
  entries.kv_batch = 3;
  entries.kv_batch_idx = d.put(std::vector<int32_t>{2, 1});
  expect_kept(entries);
  entries.kv_batch_idx = d.put(std::vector<int32_t>{2, 0});  // row 0's page is -1, and sequence 1 uses it
  expect_broken(entries, "block_table", "entry (0, 0) is -1");
  entries.kv_batch_idx = d.put(std::vector<int32_t>{2, 3});
  expect_broken(entries, "kv_batch_idx", "entry 1 is 3, outside [0, 2]");
}

TEST(Checking, LeftPadding) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  DeviceArrays d;
  AttentionProblem p = testing::valid_problem();  // a dense cache of seqlen_k = 130 keys a sequence
  p.leftpad_k = d.put(std::vector<int32_t>{0, 130});
  expect_kept(p);
  p.leftpad_k = d.put(std::vector<int32_t>{0, 131});
  expect_broken(p, "leftpad_k", "entry 1 is 131, outside [0, 130]");
  p.seqlens_k = d.put(std::vector<int32_t>{100, 50});
  p.leftpad_k = d.put(std::vector<int32_t>{0, 60});
  expect_broken(p, "leftpad_k", "entry 1 is 60, outside [0, 50]");
}

TEST(Checking, Fp8Descales) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  DeviceArrays d;
  AttentionProblem p = testing::valid_problem();  // batch 2, 2 K/V heads: [2, 2] descales
  p.dtype = DType::e4m3;
  p.q_descale = d.put(std::vector<float>{1.f, 0.5f, 2.f, 1.f});
  expect_kept(p);
  p.k_descale = d.put(std::vector<float>{1.f, 0.5f, 0.f, 1.f});  // 0: equal weights (tests/test_fp8.cpp)
  expect_kept(p);
  p.k_descale = d.put(std::vector<float>{1.f, 0.5f, -0.5f, 1.f});
  expect_broken(p, "k_descale", "entry 2 is -0.500000; descales must be finite and >= 0");
  p.k_descale = nullptr;
  p.v_descale = d.put(std::vector<float>{1.f, std::numeric_limits<float>::quiet_NaN(), 2.f, 1.f});
  expect_broken(p, "v_descale", "entry 1 is nan");
}

// forward() and backward() in the checking mode refuse a broken promise before launching, and
// run a kept one; without it they launch whatever the arrays say (the kernels clamp them).
TEST(Checking, ForwardAndBackwardRefuseBeforeLaunching) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  harness::Shape shape;
  shape.heads_q = 4;
  shape.heads_kv = 2;
  shape.head_dim = 64;
  harness::set_varlen(&shape, {40, 0, 70}, {50, 30, 90});
  harness::Workload w;
  ASSERT_TRUE(harness::make_workload(shape, 21, &w).ok());
  Options checked;
  checked.check = true;
  const int32_t kept = 0, broken = 3;
  int32_t* first = const_cast<int32_t*>(w.problem.cu_seqlens_q);
  ASSERT_EQ(cudaMemcpy(first, &broken, sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
  Status s = forward(w.problem, checked);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind("cu_seqlens_q: must start at 0", 0), 0u) << s.message();

  // The backward of the same problem, its gradients in buffers shaped like q and k.
  BackwardProblem b;
  b.forward = w.problem;
  harness::DeviceBuffer dout, dq, dk, dv;
  const size_t q_bytes = size_t(w.problem.total_q) * w.problem.q_strides.seq * 2;
  const size_t k_bytes = size_t(w.problem.total_k) * w.problem.k_strides.seq * 2;
  ASSERT_TRUE(dout.allocate(q_bytes).ok() && dq.allocate(q_bytes).ok() && dk.allocate(k_bytes).ok() &&
              dv.allocate(k_bytes).ok());
  b.dout = dout.get();  // its values do not matter: only the check runs
  b.dout_strides = w.problem.q_strides;
  b.dq = dq.get();
  b.dq_strides = w.problem.q_strides;
  b.dk = dk.get();
  b.dk_strides = w.problem.k_strides;
  b.dv = dv.get();
  b.dv_strides = w.problem.k_strides;
  s = backward(b, checked);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind("cu_seqlens_q: must start at 0", 0), 0u) << s.message();

  ASSERT_EQ(cudaMemcpy(first, &kept, sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(harness::poison_outputs(&w).ok());
  s = forward(w.problem, checked);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const harness::CheckResult r = harness::check_outputs(w, harness::all_rows(shape));
  EXPECT_TRUE(r.passed) << r.summary();
}

// A pointer to another GPU's memory is refused by name (needs two GPUs).
TEST(Checking, PointersOnAnotherGpu) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs two GPUs";
  harness::Shape shape;
  shape.batch = 1;
  shape.seqlen_q = shape.seqlen_k = 64;
  harness::Workload w;
  ASSERT_TRUE(harness::make_workload(shape, 5, &w).ok());  // on device 0
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  const Status s = forward(w.problem);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind("q: pointer is memory of GPU 0, but the call runs on GPU 1", 0), 0u) << s.message();
}

}  // namespace
}  // namespace hattn
