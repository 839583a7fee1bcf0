// The backward: argument checks (CPU) and the gradients against the fp64 reference (GPU).
//
// The GPU cases build q, k, v and dout on the host (values rounded to the dtype), take out and
// lse from the fp64 reference forward (out rounded to the dtype, as a forward kernel would
// store it), run hattn::backward and compare dq, dk and dv with ref::attention_backward_fp64.
// NaN never passes; each gradient's error must stay within 3 ulps of its largest element.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "../src/backward/backward.h"
#include "../tools/harness.h"
#include "gpu_env.h"
#include "hattn/hattn.h"
#include "hattn/reference.h"

namespace hattn {
namespace {

void* fake(uintptr_t n) { return reinterpret_cast<void*>(0x200000 + n * 0x10000); }

BackwardProblem valid_backward() {
  BackwardProblem b;
  AttentionProblem& p = b.forward;
  p.batch = 2;
  p.seqlen_q = 100;
  p.seqlen_k = 120;
  p.heads_q = 4;
  p.heads_kv = 2;
  p.head_dim = 128;
  p.q = fake(1);
  p.q_strides = contiguous_bshd(100, 4, 128);
  p.k = fake(2);
  p.k_strides = contiguous_bshd(120, 2, 128);
  p.v = fake(3);
  p.v_strides = p.k_strides;
  p.out = fake(4);
  p.out_strides = p.q_strides;
  p.lse = static_cast<float*>(fake(5));
  b.dout = fake(6);
  b.dout_strides = p.q_strides;
  b.dq = fake(7);
  b.dq_strides = p.q_strides;
  b.dk = fake(8);
  b.dk_strides = p.k_strides;
  b.dv = fake(9);
  b.dv_strides = p.k_strides;
  return b;
}

void expect_invalid(const BackwardProblem& b, const std::string& argument) {
  const Status s = validate_backward_arguments(b);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  EXPECT_EQ(s.message().rfind(argument + ":", 0), 0u) << "message should start with '" << argument << ":', got "
                                                      << s.message();
}

TEST(BackwardValidation, NamesTheArgument) {
  EXPECT_TRUE(validate_backward_arguments(valid_backward()).ok());
  BackwardProblem b = valid_backward();
  b.forward.lse = nullptr;
  expect_invalid(b, "lse");
  b = valid_backward();
  b.dout = nullptr;
  expect_invalid(b, "dout");
  b = valid_backward();
  b.dq = static_cast<char*>(b.dq) + 2;
  expect_invalid(b, "dq");
  b = valid_backward();
  b.dk_strides.seq = 100;  // not a multiple of 8 elements
  expect_invalid(b, "dk");
  b = valid_backward();
  b.dv_strides.head = 0;  // heads of dv would alias
  expect_invalid(b, "dv");
  b = valid_backward();
  b.forward.head_dim = 96;
  expect_invalid(b, "head_dim");
}

TEST(BackwardValidation, RefusesWhatItDoesNotRun) {
  BackwardProblem b = valid_backward();
  Options options;
  options.kernel = "16_coalesced_store";  // a forward kernel
  Status s = backward(b, options);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_EQ(s.message().rfind("kernel:", 0), 0u) << s.message();
  b.forward.seqlens_k = static_cast<const int32_t*>(fake(10));
  s = backward(b);
  EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
}

TEST(BackwardValidation, KernelsSayWhatTheyRefuse) {
  BackwardProblem b = valid_backward();
  AttentionProblem& p = b.forward;
  p.head_dim = 256;
  p.q_strides = p.out_strides = b.dout_strides = b.dq_strides = contiguous_bshd(100, 4, 256);
  p.k_strides = p.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(120, 2, 256);
  ASSERT_TRUE(validate_backward_arguments(b).ok());
  Options options;
  for (const char* name : {"bwd_03_wgmma", "bwd_04_dq_per_cta", "bwd_05_tma_dq"}) {  // so "auto" is bwd_02 here
    options.kernel = name;
    const Status refused = backward(b, options);  // refused before any GPU is needed
    EXPECT_EQ(refused.code(), StatusCode::not_supported) << name << ": " << refused.to_string();
    EXPECT_NE(refused.message().find("head_dim 256"), std::string::npos) << refused.message();
  }
  options.kernel = "bwd_99";
  const Status unknown = backward(b, options);
  EXPECT_EQ(unknown.code(), StatusCode::invalid_argument);
  for (const std::string& name : backward_kernel_names())
    EXPECT_NE(unknown.message().find(name), std::string::npos) << unknown.message();
}

// "auto" is the newest kernel that supports the problem: the order is the lineage's, and no
// trial variant is registered.
TEST(BackwardValidation, KernelNamesInLineageOrder) {
  const std::vector<std::string> want{"bwd_01_cuda_core", "bwd_02_mma_sync", "bwd_03_wgmma", "bwd_04_dq_per_cta",
                                      "bwd_05_tma_dq"};
  EXPECT_EQ(backward_kernel_names(), want);
}

// B05 takes dense batches at D <= 128, so "auto" picks it there; what it refuses falls to an
// older kernel. Its supports() directly: backward() refuses sequence bounds before asking it.
TEST(BackwardValidation, TmaDqSupports) {
  const BackwardKernel& b05 = backward_tma_dq();
  EXPECT_STREQ(b05.name, "bwd_05_tma_dq");
  BackwardProblem b = valid_backward();
  EXPECT_TRUE(b05.supports(b).ok()) << b05.supports(b).to_string();
  b.forward.head_dim = 64;
  EXPECT_TRUE(b05.supports(b).ok()) << b05.supports(b).to_string();
  auto expect_refused = [&](const BackwardProblem& problem, const std::string& argument) {
    const Status s = b05.supports(problem);
    EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
    EXPECT_EQ(s.message().rfind("bwd_05_tma_dq: ", 0), 0u) << s.message();
    EXPECT_NE(s.message().find(argument), std::string::npos) << "should name " << argument << ": " << s.message();
  };
  b = valid_backward();
  b.forward.head_dim = 256;
  expect_refused(b, "head_dim 256");
  b = valid_backward();
  b.forward.cu_seqlens_q = b.forward.cu_seqlens_k = static_cast<const int32_t*>(fake(10));
  expect_refused(b, "cu_seqlens_q");
  b = valid_backward();
  b.forward.seqlens_k = static_cast<const int32_t*>(fake(10));
  expect_refused(b, "seqlens_k");
  b = valid_backward();
  b.forward.block_table = static_cast<const int32_t*>(fake(11));
  expect_refused(b, "block_table");
}

struct Case {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  int window_left;
  DType dtype;
  bool padded;  // dq, dk and dv with gaps between rows and heads
};

std::string describe(const Case& c) {
  return "B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seqlen_q) + " Sk=" + std::to_string(c.seqlen_k) +
         " Hq=" + std::to_string(c.heads_q) + " Hkv=" + std::to_string(c.heads_kv) + " D=" +
         std::to_string(c.head_dim) + (c.causal ? " causal" : "") +
         (c.window_left >= 0 ? " window_left=" + std::to_string(c.window_left) : "") +
         (c.dtype == DType::bf16 ? " bf16" : " fp16") + (c.padded ? " padded" : "");
}

class BackwardTest : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

TEST_P(BackwardTest, MatchesFp64Reference) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto& [kernel, c] = GetParam();
  SCOPED_TRACE(kernel + ": " + describe(c));
  const int D = c.head_dim;
  const size_t q_elems = size_t(c.batch) * c.seqlen_q * c.heads_q * D;
  const size_t k_elems = size_t(c.batch) * c.seqlen_k * c.heads_kv * D;
  std::mt19937 rng(uint32_t(c.seqlen_q * 7919 + c.seqlen_k * 31 + D));
  using harness::random_normal;
  const harness::HostTensor q = random_normal(q_elems, c.dtype, &rng), k = random_normal(k_elems, c.dtype, &rng),
                            v = random_normal(k_elems, c.dtype, &rng), dout = random_normal(q_elems, c.dtype, &rng);

  ref::HostProblem h;
  h.batch = c.batch;
  h.seqlen_q = c.seqlen_q;
  h.seqlen_k = c.seqlen_k;
  h.heads_q = c.heads_q;
  h.heads_kv = c.heads_kv;
  h.head_dim = D;
  h.q = q.values.data();
  h.q_strides = contiguous_bshd(c.seqlen_q, c.heads_q, D);
  h.k = k.values.data();
  h.k_strides = contiguous_bshd(c.seqlen_k, c.heads_kv, D);
  h.v = v.values.data();
  h.v_strides = h.k_strides;
  h.scale = 1.f / std::sqrt(float(D));
  h.causal = c.causal;
  h.window_left = c.window_left;
  std::vector<double> out, lse, dq_ref, dk_ref, dv_ref;
  ref::attention_fp64(h, &out, &lse);
  ref::attention_backward_fp64(h, dout.values.data(), h.q_strides, &dq_ref, &dk_ref, &dv_ref);
  std::vector<uint16_t> out_bits(q_elems);
  for (size_t e = 0; e < q_elems; ++e) out_bits[e] = ref::float_to_bits(float(out[e]), c.dtype);
  std::vector<float> lse_host(lse.begin(), lse.end());

  // Gradients with gaps when padded: one spare head and 8 spare elements per row.
  const int pad_heads = c.padded ? 1 : 0;
  auto grad_strides = [&](int seqlen, int heads) {
    Strides s;
    s.head = D + (c.padded ? 8 : 0);
    s.seq = s.head * (heads + pad_heads);
    s.batch = s.seq * seqlen;
    return s;
  };
  const Strides dq_strides = grad_strides(c.seqlen_q, c.heads_q), dk_strides = grad_strides(c.seqlen_k, c.heads_kv);
  const size_t dq_span = size_t(dq_strides.batch) * c.batch, dk_span = size_t(dk_strides.batch) * c.batch;

  harness::DeviceBuffer d_q, d_k, d_v, d_out, d_lse, d_dout, d_dq, d_dk, d_dv;
  for (auto [buf, bytes] : {std::pair{&d_q, q_elems * 2}, {&d_k, k_elems * 2}, {&d_v, k_elems * 2},
                            {&d_out, q_elems * 2}, {&d_lse, lse_host.size() * 4}, {&d_dout, q_elems * 2},
                            {&d_dq, dq_span * 2}, {&d_dk, dk_span * 2}, {&d_dv, dk_span * 2}})
    ASSERT_TRUE(buf->allocate(bytes).ok());
  auto upload = [](harness::DeviceBuffer& dst, const void* src, size_t bytes) {
    ASSERT_EQ(cudaMemcpy(dst.get(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  };
  upload(d_q, q.bits.data(), q_elems * 2);
  upload(d_k, k.bits.data(), k_elems * 2);
  upload(d_v, v.bits.data(), k_elems * 2);
  upload(d_out, out_bits.data(), q_elems * 2);
  upload(d_lse, lse_host.data(), lse_host.size() * 4);
  upload(d_dout, dout.bits.data(), q_elems * 2);
  for (auto* buf : {&d_dq, &d_dk, &d_dv}) ASSERT_EQ(cudaMemset(buf->get(), 0xFF, buf->bytes()), cudaSuccess);  // NaN

  BackwardProblem b;
  AttentionProblem& p = b.forward;
  p.dtype = c.dtype;
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = D;
  p.q = d_q.get();
  p.q_strides = h.q_strides;
  p.k = d_k.get();
  p.k_strides = h.k_strides;
  p.v = d_v.get();
  p.v_strides = h.k_strides;
  p.out = d_out.get();
  p.out_strides = h.q_strides;
  p.lse = static_cast<float*>(d_lse.get());
  p.causal = c.causal;
  p.window_left = c.window_left;
  b.dout = d_dout.get();
  b.dout_strides = h.q_strides;
  b.dq = d_dq.get();
  b.dq_strides = dq_strides;
  b.dk = d_dk.get();
  b.dk_strides = dk_strides;
  b.dv = d_dv.get();
  b.dv_strides = dk_strides;
  Options options;
  options.kernel = kernel;
  const Status s = backward(b, options);
  if (s.code() == StatusCode::not_supported) GTEST_SKIP() << s.message();  // e.g. bwd_03 at D = 256
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

  auto check = [&](const char* name, const harness::DeviceBuffer& got, const Strides& strides, int seqlen, int heads,
                   const std::vector<double>& want) {
    std::vector<uint16_t> bits(got.bytes() / 2);
    ASSERT_EQ(cudaMemcpy(bits.data(), got.get(), got.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    double largest = 0, worst = 0;
    int64_t bad = 0;
    for (double w : want) largest = std::max(largest, std::abs(w));
    for (int bb = 0; bb < c.batch; ++bb)
      for (int t = 0; t < seqlen; ++t)
        for (int hh = 0; hh < heads; ++hh)
          for (int d = 0; d < D; ++d) {
            const float g = ref::bits_to_float(bits[bb * strides.batch + int64_t(t) * strides.seq + hh * strides.head + d],
                                               c.dtype);
            const double w = want[((size_t(bb) * seqlen + t) * heads + hh) * D + d];
            if (!std::isfinite(g)) {
              ++bad;
              continue;
            }
            worst = std::max(worst, std::abs(double(g) - w));
          }
    EXPECT_EQ(bad, 0) << name << ": elements not finite (unwritten or NaN)";
    EXPECT_LE(worst, harness::backward_error_budget(c.dtype, largest)) << name << ": max error " << worst << ", largest |grad| " << largest;
  };
  check("dq", d_dq, dq_strides, c.seqlen_q, c.heads_q, dq_ref);
  check("dk", d_dk, dk_strides, c.seqlen_k, c.heads_kv, dk_ref);
  check("dv", d_dv, dk_strides, c.seqlen_k, c.heads_kv, dv_ref);
}

const DType bf = DType::bf16, fp = DType::fp16;
INSTANTIATE_TEST_SUITE_P(
    Shapes, BackwardTest,
    ::testing::Combine(
        ::testing::ValuesIn(backward_kernel_names()),
        ::testing::Values(Case{1, 1, 1, 1, 1, 64, false, -1, bf, false},       // one element
                      Case{2, 37, 53, 4, 2, 64, false, -1, bf, false},     // tails, GQA 2
                      Case{1, 70, 70, 2, 2, 128, true, -1, fp, true},      // causal, padded gradients
                      Case{2, 90, 40, 4, 1, 128, true, -1, bf, false},     // Sq > Sk: rows without keys, MQA
                      Case{1, 65, 130, 8, 2, 256, false, 20, fp, false},   // a window, GQA 4
                      Case{1, 33, 200, 2, 1, 256, true, 50, bf, true},     // causal window, Sq < Sk
                      Case{2, 129, 129, 3, 3, 64, true, -1, fp, false},    // more than 4 key blocks
                      Case{1, 200, 300, 4, 2, 128, true, -1, bf, true},    // several query and key blocks
                      Case{1, 150, 90, 2, 2, 256, false, -1, bf, false},   // Sq > Sk, partial blocks
                      Case{1, 192, 256, 2, 1, 64, false, 70, fp, false},    // a window across key blocks
                      Case{2, 256, 256, 8, 8, 64, true, -1, bf, false},    // whole blocks, causal
                      Case{1, 256, 256, 4, 4, 128, true, -1, bf, false},    // the same at D = 128
                      Case{1, 700, 650, 2, 1, 128, false, -1, fp, false},   // 11 query blocks: stage ring wraps
                      Case{1, 640, 640, 2, 2, 64, true, -1, bf, false})),   // 10 query blocks, causal
    [](const ::testing::TestParamInfo<std::tuple<std::string, Case>>& info) {
      return std::get<0>(info.param) + "_" + std::to_string(info.index);
    });

}  // namespace
}  // namespace hattn
