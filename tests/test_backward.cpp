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
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../src/common/backward.h"
#include "../tools/harness.h"
#include "counting_scratch.h"
#include "fake_problem.h"
#include "gpu_env.h"
#include "hattn/hattn.h"
#include "hattn/reference.h"

namespace hattn {
namespace {

// Addresses never dereferenced, as the forward's validation tests use (apart enough that no two
// tensors of a problem share memory).
void* fake(uintptr_t n) { return const_cast<void*>(testing::fake_ptr(n)); }

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

TEST(BackwardValidation, GradientsSharingMemoryAreRefused) {
  BackwardProblem b = valid_backward();
  b.dq = const_cast<void*>(b.dout);  // dq written over dout, which the kernel still reads
  Status s = validate_backward_arguments(b);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument);
  EXPECT_NE(s.message().find("dq: overlaps dout"), std::string::npos) << s.message();
  b = valid_backward();
  b.dv = b.dk;
  s = validate_backward_arguments(b);
  EXPECT_NE(s.message().find("dk: overlaps dv"), std::string::npos) << s.message();
  b = valid_backward();
  b.dk = const_cast<void*>(b.forward.k);
  s = validate_backward_arguments(b);
  EXPECT_NE(s.message().find("dk: overlaps k"), std::string::npos) << s.message();
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
  // Refused here; "auto" is bwd_sm90 (its two passes at D = 256).
  for (const char* name :
       {"bwd_03_wgmma", "bwd_04_dq_per_cta", "bwd_05_tma_dq", "bwd_06_hot_loop", "bwd_07_dkdv_direct",
        "bwd_08_dq_overlap", "bwd_13_producer", "bwd_14_tma_dkdv", "bwd_15_tma_sums"}) {
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

// "auto" is the newest kernel that supports the problem: the order is the lineage's, then the
// production backward, and no trial variant is registered.
TEST(BackwardValidation, KernelNamesInLineageOrder) {
  const std::vector<std::string> want{"bwd_01_cuda_core", "bwd_02_mma_sync", "bwd_03_wgmma", "bwd_04_dq_per_cta",
                                      "bwd_05_tma_dq", "bwd_06_hot_loop", "bwd_07_dkdv_direct",
                                      "bwd_08_dq_overlap", "bwd_09_split_d", "bwd_10_dq_pass",
                                      "bwd_11_dq_pipeline", "bwd_12_dkdv_pipeline", "bwd_13_producer",
                                      "bwd_14_tma_dkdv", "bwd_15_tma_sums", "bwd_sm90"};
  EXPECT_EQ(backward_kernel_names(), want);
}

BackwardProblem valid_varlen_backward();

// B05 (and B06, B05's loop made lean) take dense batches at D <= 128, as every lineage step
// does. Its own supports() refuses the head dims; resolve_backward_kernel refuses centrally a
// variable-length batch by the kernel's name (it goes to bwd_sm90) and, for every kernel,
// keys in use ("backward: ...").
TEST(BackwardValidation, TmaDqSupports) {
  const BackwardKernel& b05 = backward_tma_dq();
  EXPECT_STREQ(b05.name, "bwd_05_tma_dq");
  BackwardProblem b = valid_backward();
  EXPECT_TRUE(b05.supports(b).ok()) << b05.supports(b).to_string();
  b.forward.head_dim = 64;
  EXPECT_TRUE(b05.supports(b).ok()) << b05.supports(b).to_string();
  auto expect_refused = [&](const BackwardProblem& problem, const std::string& prefix, const std::string& argument) {
    std::string resolved;
    const Status s = resolve_backward_kernel(problem, "bwd_05_tma_dq", &resolved);
    EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
    EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << s.message();
    EXPECT_NE(s.message().find(argument), std::string::npos) << "should name " << argument << ": " << s.message();
  };
  b = valid_backward();
  b.forward.head_dim = 256;
  const Status own = b05.supports(b);
  EXPECT_EQ(own.code(), StatusCode::not_supported) << own.to_string();
  EXPECT_NE(own.message().find("bwd_05_tma_dq: head_dim 256"), std::string::npos) << own.message();
  expect_refused(valid_varlen_backward(), "bwd_05_tma_dq: ", "cu_seqlens_q");
  b = valid_varlen_backward();
  b.forward.seqlens_k = static_cast<const int32_t*>(fake(12));
  expect_refused(b, "backward: ", "seqlens_k");
}

// A variable-length batch of 3 sequences, 100 + 20 + 7 queries and 120 + 1 + 9 keys, packed
// along the rows of contiguous [total, H, D] tensors.
BackwardProblem valid_varlen_backward() {
  BackwardProblem b = valid_backward();
  AttentionProblem& p = b.forward;
  p.batch = 3;
  p.cu_seqlens_q = static_cast<const int32_t*>(fake(10));
  p.cu_seqlens_k = static_cast<const int32_t*>(fake(11));
  p.total_q = 127;
  p.total_k = 130;
  p.q_strides = p.out_strides = b.dout_strides = b.dq_strides = contiguous_bshd(127, 4, 128);
  p.k_strides = p.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(130, 2, 128);
  return b;
}

TEST(BackwardValidation, VarlenArguments) {
  EXPECT_TRUE(validate_backward_arguments(valid_varlen_backward()).ok());
  BackwardProblem b = valid_varlen_backward();
  b.forward.cu_seqlens_k = nullptr;
  expect_invalid(b, "cu_seqlens_k");
  b = valid_varlen_backward();
  b.forward.total_q = 0;
  expect_invalid(b, "total_q");
  b = valid_varlen_backward();
  b.forward.cu_seqlens_q = reinterpret_cast<const int32_t*>(reinterpret_cast<uintptr_t>(b.forward.cu_seqlens_q) + 2);
  expect_invalid(b, "cu_seqlens_q");
  // Packed gradients: strides over [total, H, D]; their batch stride is not used.
  b = valid_varlen_backward();
  b.dq_strides.batch = 0;
  b.dk_strides.batch = 0;
  b.dv_strides.batch = 0;
  b.dout_strides.batch = 0;
  EXPECT_TRUE(validate_backward_arguments(b).ok()) << validate_backward_arguments(b).to_string();
  b.dq_strides.seq = 4 * 128 + 4;  // not a multiple of 8 elements
  expect_invalid(b, "dq");
  b = valid_varlen_backward();
  b.dout_strides.seq = 100;
  expect_invalid(b, "dout");
  b = valid_varlen_backward();
  b.dk_strides.seq = 128;  // the 2 heads of a row overlap the next row
  expect_invalid(b, "dk");
  b = valid_varlen_backward();
  b.dv = static_cast<char*>(b.dv) + 8;
  expect_invalid(b, "dv");
}

TEST(BackwardValidation, VarlenRefusals) {
  // seqlens_k and a paged cache are refused whatever the kernel, before any GPU is needed.
  BackwardProblem b = valid_varlen_backward();
  b.forward.seqlens_k = static_cast<const int32_t*>(fake(12));
  for (const std::string kernel : {"auto", "bwd_08_dq_overlap", "bwd_04_dq_per_cta", "bwd_02_mma_sync"}) {
    Options options;
    options.kernel = kernel;
    const Status s = backward(b, options);
    EXPECT_EQ(s.code(), StatusCode::not_supported) << kernel << ": " << s.to_string();
    EXPECT_NE(s.message().find("seqlens_k"), std::string::npos) << s.message();
  }
  b = valid_backward();  // a dense paged cache
  AttentionProblem& p = b.forward;
  p.seqlens_k = static_cast<const int32_t*>(fake(12));
  p.block_table = static_cast<const int32_t*>(fake(13));
  p.page_size = 128;
  p.num_pages = 4;
  p.max_pages_per_seq = 1;
  p.k_strides = p.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(128, 2, 128);
  ASSERT_TRUE(validate_backward_arguments(b).ok()) << validate_backward_arguments(b).to_string();
  Status s = backward(b);
  EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
  EXPECT_NE(s.message().find("block_table"), std::string::npos) << s.message();
  // Softcapping: bwd_sm90 only (every head dim); every lineage step is refused it by name, at
  // D = 128 and at D = 256.
  b = valid_backward();
  b.forward.softcap = 30.f;
  std::string resolved;
  s = resolve_backward_kernel(b, "auto", &resolved);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(resolved, "bwd_sm90");
  auto expect_no_softcap = [&](const BackwardProblem& problem) {
    for (const std::string& name : backward_kernel_names()) {
      if (name == "bwd_sm90") continue;
      const Status t = resolve_backward_kernel(problem, name, &resolved);
      EXPECT_EQ(t.code(), StatusCode::not_supported) << name << ": " << t.to_string();
      EXPECT_NE(t.message().find(name + ": no softcap"), std::string::npos) << t.message();
    }
  };
  expect_no_softcap(b);
  b.forward.head_dim = 256;
  b.forward.q_strides = b.forward.out_strides = b.dout_strides = b.dq_strides = contiguous_bshd(100, 4, 256);
  b.forward.k_strides = b.forward.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(120, 2, 256);
  ASSERT_TRUE(validate_backward_arguments(b).ok()) << validate_backward_arguments(b).to_string();
  s = resolve_backward_kernel(b, "auto", &resolved);
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(resolved, "bwd_sm90");
  expect_no_softcap(b);
  // Cache entries and left padding likewise.
  for (bool entries : {true, false}) {
    b = valid_backward();
    if (entries) {
      b.forward.kv_batch_idx = static_cast<const int32_t*>(fake(12));
      b.forward.kv_batch = 2;
    } else {
      b.forward.leftpad_k = static_cast<const int32_t*>(fake(12));
    }
    ASSERT_TRUE(validate_backward_arguments(b).ok()) << validate_backward_arguments(b).to_string();
    s = backward(b);
    EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
    EXPECT_NE(s.message().find(entries ? "kv_batch_idx" : "leftpad_k"), std::string::npos) << s.message();
  }

  // The lineage refuses a variable-length batch and names the kernel that runs it.
  b = valid_varlen_backward();
  Options options;
  for (const std::string kernel : {"bwd_01_cuda_core", "bwd_03_wgmma", "bwd_15_tma_sums"}) {
    options.kernel = kernel;
    s = backward(b, options);
    EXPECT_EQ(s.code(), StatusCode::not_supported) << kernel << ": " << s.to_string();
    EXPECT_NE(s.message().find("variable-length"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("bwd_sm90"), std::string::npos) << s.message();
  }
  // "auto" and bwd_sm90 accept it: they get as far as the device check (no GPU) or the pointer
  // checks (these pointers are not GPU memory).
  for (const std::string kernel : {"auto", "bwd_sm90"}) {
    options.kernel = kernel;
    s = backward(b, options);
    EXPECT_NE(s.code(), StatusCode::not_supported) << kernel << ": " << s.to_string();
    EXPECT_FALSE(s.ok()) << kernel;
  }
  // A sliding window likewise: the lineage runs the causal mask or none.
  b = valid_backward();
  b.forward.window_left = 30;
  for (const std::string& kernel : backward_kernel_names()) {
    s = resolve_backward_kernel(b, kernel, &resolved);
    if (kernel == "bwd_sm90") {
      EXPECT_TRUE(s.ok()) << s.to_string();
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::not_supported) << kernel << ": " << s.to_string();
    if (s.message().find("head_dim") != std::string::npos) continue;  // a D = 256 step
    EXPECT_NE(s.message().find("window_left"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("bwd_sm90"), std::string::npos) << s.message();
  }
}

// Which kernel "auto" runs (resolve_backward_kernel: backward()'s choice, without a GPU): the
// production backward for dense and variable-length batches at every head dim. A kernel named
// for what it refuses says why.
TEST(BackwardValidation, AutoRouting) {
  auto with_head_dim = [](BackwardProblem b, int d) {
    AttentionProblem& p = b.forward;
    const int rows_q = p.is_varlen() ? p.total_q : p.seqlen_q, rows_k = p.is_varlen() ? p.total_k : p.seqlen_k;
    p.head_dim = d;
    p.q_strides = p.out_strides = b.dout_strides = b.dq_strides = contiguous_bshd(rows_q, p.heads_q, d);
    p.k_strides = p.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(rows_k, p.heads_kv, d);
    return b;
  };
  struct Want {
    bool varlen;
    int head_dim;
    const char* kernel;
  };
  for (const Want& w : {Want{false, 64, "bwd_sm90"}, Want{false, 128, "bwd_sm90"}, Want{false, 256, "bwd_sm90"},
                        Want{true, 64, "bwd_sm90"}, Want{true, 128, "bwd_sm90"}, Want{true, 256, "bwd_sm90"}}) {
    const BackwardProblem b = with_head_dim(w.varlen ? valid_varlen_backward() : valid_backward(), w.head_dim);
    std::string resolved;
    const Status s = resolve_backward_kernel(b, "auto", &resolved);
    EXPECT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(resolved, w.kernel) << (w.varlen ? "varlen" : "dense") << " D = " << w.head_dim;
    for (const std::string& name : backward_kernel_names()) {  // a named kernel: itself, or why not
      std::string named;
      const Status t = resolve_backward_kernel(b, name, &named);
      if (t.ok()) {
        EXPECT_EQ(named, name);
        continue;
      }
      EXPECT_EQ(t.code(), StatusCode::not_supported) << name << ": " << t.to_string();
      EXPECT_EQ(t.message().rfind(name + ": ", 0), 0u) << t.message();
      EXPECT_NE(name, w.kernel);
    }
  }
  // Every lineage step refuses a variable-length batch at the head dims it runs, naming the
  // kernel that runs one.
  for (const std::string& name : backward_kernel_names()) {
    if (name == "bwd_sm90") continue;
    int refusals = 0;
    for (int d : {64, 128, 256}) {
      std::string resolved;
      const Status s = resolve_backward_kernel(with_head_dim(valid_varlen_backward(), d), name, &resolved);
      EXPECT_EQ(s.code(), StatusCode::not_supported) << name << " D = " << d << ": " << s.to_string();
      if (s.message().find("head_dim") != std::string::npos) continue;  // not a head dim it runs
      EXPECT_NE(s.message().find("cu_seqlens"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find("bwd_sm90"), std::string::npos) << s.message();
      ++refusals;
    }
    EXPECT_GT(refusals, 0) << name;
  }
  // Refused whatever the kernel: seqlens_k; an unknown name lists the known ones.
  BackwardProblem b = valid_varlen_backward();
  b.forward.seqlens_k = static_cast<const int32_t*>(fake(12));
  std::string resolved;
  Status s = resolve_backward_kernel(b, "auto", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
  EXPECT_NE(s.message().find("seqlens_k"), std::string::npos) << s.message();
  s = resolve_backward_kernel(valid_backward(), "bwd_99", &resolved);
  EXPECT_EQ(s.code(), StatusCode::invalid_argument) << s.to_string();
  for (const std::string& name : backward_kernel_names())
    EXPECT_NE(s.message().find(name), std::string::npos) << s.message();
}

struct Case {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  int window_left;
  DType dtype;
  bool padded;  // dq, dk and dv with gaps between rows and heads
  float softcap = 0.f;
};

std::string describe(const Case& c) {
  return "B=" + std::to_string(c.batch) + " Sq=" + std::to_string(c.seqlen_q) + " Sk=" + std::to_string(c.seqlen_k) +
         " Hq=" + std::to_string(c.heads_q) + " Hkv=" + std::to_string(c.heads_kv) + " D=" +
         std::to_string(c.head_dim) + (c.causal ? " causal" : "") +
         (c.window_left >= 0 ? " window_left=" + std::to_string(c.window_left) : "") +
         (c.dtype == DType::bf16 ? " bf16" : " fp16") + (c.padded ? " padded" : "") +
         (c.softcap > 0.f ? " softcap=" + std::to_string(c.softcap) : "");
}

// Compares a gradient on the GPU ([entries, rows, heads, D] at `strides`, in `dtype`) with the
// fp64 reference (contiguous, same shape): every element finite, the largest error within
// backward_error_budget.
// Rows [skip_begin, skip_end) of every entry are not checked (a sequence whose own inputs hold NaN).
void check_gradient(const char* name, const harness::DeviceBuffer& got, const Strides& strides, int entries, int rows,
                    int heads, int head_dim, DType dtype, const std::vector<double>& want, int skip_begin = 0,
                    int skip_end = 0) {
  std::vector<uint16_t> bits(got.bytes() / 2);
  ASSERT_EQ(cudaMemcpy(bits.data(), got.get(), got.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
  double largest = 0, worst = 0;
  int64_t bad = 0;
  for (double w : want)
    if (std::isfinite(w)) largest = std::max(largest, std::abs(w));
  for (int bb = 0; bb < entries; ++bb)
    for (int t = 0; t < rows; ++t)
      for (int hh = 0; hh < heads; ++hh)
        for (int d = 0; d < head_dim; ++d) {
          if (t >= skip_begin && t < skip_end) continue;
          const float g =
              ref::bits_to_float(bits[bb * strides.batch + int64_t(t) * strides.seq + hh * strides.head + d], dtype);
          const double w = want[((size_t(bb) * rows + t) * heads + hh) * head_dim + d];
          if (!std::isfinite(g)) {
            ++bad;
            continue;
          }
          worst = std::max(worst, std::abs(double(g) - w));
        }
  EXPECT_EQ(bad, 0) << name << ": elements not finite (unwritten or NaN)";
  EXPECT_LE(worst, harness::backward_error_budget(dtype, largest))
      << name << ": max error " << worst << ", largest |grad| " << largest;
}

// The device side of a backward test: the inputs uploaded, the gradients filled with NaN (so
// that an element the kernel leaves unwritten fails), and the problem's pointers and strides.
// Call load() under ASSERT_NO_FATAL_FAILURE.
struct BackwardBuffers {
  harness::DeviceBuffer q, k, v, out, lse, dout, dq, dk, dv;

  void load(const harness::HostTensor& q_host, const harness::HostTensor& k_host, const harness::HostTensor& v_host,
            const std::vector<uint16_t>& out_bits, const std::vector<float>& lse_host,
            const harness::HostTensor& dout_host, size_t dq_elems, size_t dk_elems) {
    const size_t q_elems = q_host.bits.size(), k_elems = k_host.bits.size();
    for (auto [buf, bytes] : {std::pair{&q, q_elems * 2}, {&k, k_elems * 2}, {&v, k_elems * 2}, {&out, q_elems * 2},
                              {&lse, lse_host.size() * 4}, {&dout, q_elems * 2}, {&dq, dq_elems * 2},
                              {&dk, dk_elems * 2}, {&dv, dk_elems * 2}})
      ASSERT_TRUE(buf->allocate(bytes).ok());
    for (auto [dst, src, bytes] : {std::tuple{&q, static_cast<const void*>(q_host.bits.data()), q_elems * 2},
                                   {&k, k_host.bits.data(), k_elems * 2}, {&v, v_host.bits.data(), k_elems * 2},
                                   {&out, out_bits.data(), q_elems * 2}, {&lse, lse_host.data(), lse_host.size() * 4},
                                   {&dout, dout_host.bits.data(), q_elems * 2}})
      ASSERT_EQ(cudaMemcpy(dst->get(), src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    for (auto* buf : {&dq, &dk, &dv}) ASSERT_EQ(cudaMemset(buf->get(), 0xFF, buf->bytes()), cudaSuccess);  // NaN
  }

  // Points `b` at the buffers: out and dO are laid out like Q, V like K.
  void point(BackwardProblem* b, const Strides& q_strides, const Strides& k_strides, const Strides& dq_strides,
             const Strides& dk_strides) const {
    AttentionProblem& p = b->forward;
    p.q = q.get();
    p.q_strides = q_strides;
    p.k = k.get();
    p.k_strides = k_strides;
    p.v = v.get();
    p.v_strides = k_strides;
    p.out = out.get();
    p.out_strides = q_strides;
    p.lse = static_cast<float*>(lse.get());
    b->dout = dout.get();
    b->dout_strides = q_strides;
    b->dq = dq.get();
    b->dq_strides = dq_strides;
    b->dk = dk.get();
    b->dk_strides = dk_strides;
    b->dv = dv.get();
    b->dv_strides = dk_strides;
  }
};

// Runs `kernel` on case `c` (scratch from `allocator`; null: the stream's pool) and checks the
// gradients against the fp64 reference; skips a case the kernel does not run. Needs a GPU.
// With deterministic_repeats > 0 the backward runs with BackwardProblem::deterministic, then
// that many times again while another backward of the same problem runs on a second stream:
// every repeat's dq, dk and dv must be bitwise the first's.
void check_backward_case(const std::string& kernel, const Case& c, const ScratchAllocator* allocator = nullptr,
                         int deterministic_repeats = 0) {
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
  h.softcap = c.softcap;
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

  BackwardBuffers d;
  ASSERT_NO_FATAL_FAILURE(d.load(q, k, v, out_bits, lse_host, dout, dq_span, dk_span));

  BackwardProblem b;
  AttentionProblem& p = b.forward;
  p.dtype = c.dtype;
  p.batch = c.batch;
  p.seqlen_q = c.seqlen_q;
  p.seqlen_k = c.seqlen_k;
  p.heads_q = c.heads_q;
  p.heads_kv = c.heads_kv;
  p.head_dim = D;
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.softcap = c.softcap;
  d.point(&b, h.q_strides, h.k_strides, dq_strides, dk_strides);
  p.allocator = allocator;
  b.deterministic = deterministic_repeats > 0;
  Options options;
  options.kernel = kernel;
  const Status s = backward(b, options);
  if (s.code() == StatusCode::not_supported) GTEST_SKIP() << s.message();  // e.g. bwd_03 at D = 256
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

  check_gradient("dq", d.dq, dq_strides, c.batch, c.seqlen_q, c.heads_q, D, c.dtype, dq_ref);
  check_gradient("dk", d.dk, dk_strides, c.batch, c.seqlen_k, c.heads_kv, D, c.dtype, dk_ref);
  check_gradient("dv", d.dv, dk_strides, c.batch, c.seqlen_k, c.heads_kv, D, c.dtype, dv_ref);
  if (deterministic_repeats == 0) return;

  auto bytes_of = [](const harness::DeviceBuffer& buf) {
    std::vector<unsigned char> host(buf.bytes());
    EXPECT_EQ(cudaMemcpy(host.data(), buf.get(), buf.bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  };
  const std::vector<unsigned char> dq_first = bytes_of(d.dq), dk_first = bytes_of(d.dk), dv_first = bytes_of(d.dv);
  // The other backward: the same inputs, its own gradients, the default (unordered) sums.
  BackwardBuffers other;
  ASSERT_NO_FATAL_FAILURE(other.load(q, k, v, out_bits, lse_host, dout, dq_span, dk_span));
  BackwardProblem busy = b;
  busy.deterministic = false;
  other.point(&busy, h.q_strides, h.k_strides, dq_strides, dk_strides);
  cudaStream_t side = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
  Options busy_options;
  busy_options.stream = side;
  for (int r = 0; r < deterministic_repeats; ++r) {
    SCOPED_TRACE("repeat " + std::to_string(r));
    for (auto* buf : {&d.dq, &d.dk, &d.dv}) ASSERT_EQ(cudaMemset(buf->get(), 0xFF, buf->bytes()), cudaSuccess);
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(backward(busy, busy_options).ok());  // queued first, running beside
    ASSERT_TRUE(backward(b, options).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());
    EXPECT_TRUE(bytes_of(d.dq) == dq_first) << "dq differs from the first run's";
    EXPECT_TRUE(bytes_of(d.dk) == dk_first) << "dk differs from the first run's";
    EXPECT_TRUE(bytes_of(d.dv) == dv_first) << "dv differs from the first run's";
  }
  ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
}

class BackwardTest : public ::testing::TestWithParam<std::tuple<std::string, Case>> {};

TEST_P(BackwardTest, MatchesFp64Reference) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto& [kernel, c] = GetParam();
  check_backward_case(kernel, c);
}

// BackwardProblem::deterministic: 20 repeats bitwise equal, with another backward on a second
// stream, at each head dim: causal GQA and a window through bwd_sm90, D = 256 through its two
// passes without GQA and with it (each query head's dK and dV rows apart, added by group in the
// conversion); more CTAs than SMs (512: CTAs wait on CTAs of earlier waves), and rows that see
// no key (causal, Sq > Sk).
TEST(BackwardDeterministic, RepeatsAreBitwiseEqual) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (const Case& c : {Case{2, 300, 517, 8, 2, 64, true, -1, DType::bf16, false},
                        Case{1, 700, 700, 4, 1, 128, false, 100, DType::fp16, true},
                        Case{2, 257, 384, 4, 4, 128, true, -1, DType::bf16, false, 30.f},
                        Case{1, 333, 450, 2, 2, 256, true, -1, DType::bf16, false},
                        Case{1, 333, 450, 4, 2, 256, true, -1, DType::bf16, false},
                        Case{2, 500, 1024, 8, 2, 256, false, -1, DType::fp16, false},
                        Case{8, 512, 512, 16, 4, 64, true, -1, DType::bf16, false},
                        Case{1, 1000, 300, 4, 2, 128, true, -1, DType::fp16, false}})
    check_backward_case("auto", c, nullptr, /*deterministic_repeats=*/20);
}

// A causal grid of 2048 rows or more launches by groups of (batch, head) pairs, heaviest block
// first (src/attention/backward/work.cuh): every block of every pair must still run once, where
// the pairs fill more than one group and the last is partial (16 key blocks, groups of 8 pairs,
// 10 pairs; 17 key blocks, groups of 7, 9 pairs with GQA 3). At D = 256 the dK/dV pass's 64-key
// blocks (33, groups of 3, 10 pairs) and the dQ pass's 128-query blocks (16, heaviest last,
// groups of 8, 9 pairs with GQA 3).
TEST(BackwardLaunchOrder, CausalGroupsCoverEveryKeyBlock) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  for (const Case& c : {Case{2, 100, 2000, 5, 5, 64, true, -1, DType::bf16, false},
                        Case{3, 130, 2100, 3, 1, 128, true, -1, DType::fp16, true},
                        Case{2, 100, 2100, 5, 5, 256, true, -1, DType::fp16, false},
                        Case{1, 2000, 100, 9, 3, 256, true, -1, DType::bf16, false}})
    check_backward_case("bwd_sm90", c);
}

// Who runs BackwardProblem::deterministic: bwd_sm90 at every head dim, with GQA too; the other
// kernels are refused with the reason.
TEST(BackwardValidation, DeterministicRouting) {
  auto with_head_dim = [](BackwardProblem b, int d, int heads_kv) {
    AttentionProblem& p = b.forward;
    p.head_dim = d;
    p.heads_kv = heads_kv;
    p.q_strides = p.out_strides = b.dout_strides = b.dq_strides = contiguous_bshd(p.seqlen_q, p.heads_q, d);
    p.k_strides = p.v_strides = b.dk_strides = b.dv_strides = contiguous_bshd(p.seqlen_k, p.heads_kv, d);
    b.deterministic = true;
    return b;
  };
  std::string resolved;
  for (int d : {64, 128}) {
    ASSERT_TRUE(resolve_backward_kernel(with_head_dim(valid_backward(), d, 2), "auto", &resolved).ok());
    EXPECT_EQ(resolved, "bwd_sm90");
  }
  for (int heads_kv : {4, 2}) {
    ASSERT_TRUE(resolve_backward_kernel(with_head_dim(valid_backward(), 256, heads_kv), "auto", &resolved).ok());
    EXPECT_EQ(resolved, "bwd_sm90");
  }
  Status s = resolve_backward_kernel(with_head_dim(valid_backward(), 128, 2), "bwd_15_tma_sums", &resolved);
  EXPECT_EQ(s.code(), StatusCode::not_supported) << s.to_string();
  EXPECT_EQ(s.message().rfind("bwd_15_tma_sums: deterministic=true is not supported", 0), 0u) << s.message();
}

// The fp32 sums come from the problem's allocator, one block a call, all of it given back; the
// block comes poisoned (NaN), so the call must zero every sum it adds into (dQ's, and dK's and
// dV's with GQA); an allocator with nothing to give makes the call fail with out_of_memory
// before any launch.
TEST(BackwardScratch, ComesFromTheProblemsAllocator) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const std::pair<const char*, Case> cases[] = {
      {"bwd_sm90", Case{2, 37, 53, 4, 2, 64, false, -1, DType::bf16, false}},
      {"bwd_sm90", Case{1, 200, 300, 4, 2, 128, true, -1, DType::fp16, true}},
      {"bwd_sm90", Case{2, 300, 260, 4, 2, 256, true, -1, DType::bf16, true}},
      {"bwd_12_dkdv_pipeline", Case{2, 300, 260, 4, 2, 256, true, -1, DType::bf16, true}},
      {"bwd_10_dq_pass", Case{1, 150, 90, 2, 2, 256, false, -1, DType::bf16, false}}};
  for (const auto& [kernel, c] : cases) {
    testing::CountingScratch scratch;
    scratch.poison = true;
    ASSERT_NO_FATAL_FAILURE(check_backward_case(kernel, c, &scratch.allocator));
    EXPECT_EQ(scratch.taken, 1) << kernel;
    EXPECT_EQ(scratch.given_back, 1) << kernel;
    EXPECT_EQ(scratch.bytes_given_back, scratch.bytes_taken) << kernel;
  }
  // The deterministic mode's turn counters come from the same poisoned block, and at D = 256
  // with GQA its per-query-head dK and dV sums.
  for (const Case& c : {Case{1, 200, 300, 4, 2, 128, true, -1, DType::bf16, false},
                        Case{1, 200, 300, 4, 2, 256, true, -1, DType::bf16, false}}) {
    testing::CountingScratch scratch;
    scratch.poison = true;
    ASSERT_NO_FATAL_FAILURE(check_backward_case("bwd_sm90", c, &scratch.allocator, 1));
  }
  // valid_backward()'s shape on device memory (the pointer checks come before the scratch).
  BackwardProblem b = valid_backward();
  AttentionProblem& p = b.forward;
  const size_t q_bytes = size_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim * 2;
  const size_t k_bytes = size_t(p.batch) * p.seqlen_k * p.heads_kv * p.head_dim * 2;
  harness::DeviceBuffer q, k, v, out, lse, dout, dq, dk, dv;
  for (auto [buffer, bytes] : {std::pair{&q, q_bytes}, {&k, k_bytes}, {&v, k_bytes}, {&out, q_bytes},
                               {&lse, size_t(p.batch) * p.heads_q * p.seqlen_q * 4}, {&dout, q_bytes},
                               {&dq, q_bytes}, {&dk, k_bytes}, {&dv, k_bytes}})
    ASSERT_TRUE(buffer->allocate(bytes).ok());
  p.q = q.get();
  p.k = k.get();
  p.v = v.get();
  p.out = out.get();
  p.lse = static_cast<float*>(lse.get());
  b.dout = dout.get();
  b.dq = dq.get();
  b.dk = dk.get();
  b.dv = dv.get();
  testing::CountingScratch empty;
  empty.fail = true;
  p.allocator = &empty.allocator;
  const Status s = backward(b);
  EXPECT_EQ(s.code(), StatusCode::out_of_memory) << s.to_string();
  EXPECT_NE(s.message().find("fp32 sums"), std::string::npos) << s.message();
  EXPECT_EQ(empty.given_back, 0);
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
                      Case{1, 640, 640, 2, 2, 64, true, -1, bf, false},     // 10 query blocks, causal
                      Case{1, 100, 300, 2, 2, 64, false, 30, bf, true},     // keys 0-169 seen by no query: dK, dV 0
                      Case{2, 64, 256, 4, 4, 128, false, 20, fp, false},    // the same at D = 128, whole blocks
                      Case{2, 300, 260, 4, 2, 256, true, -1, bf, true},     // D = 256: causal, GQA, tails
                      Case{1, 640, 512, 2, 2, 256, false, -1, fp, false},   // D = 256: 10 query blocks
                      // Softcapping (bwd_sm90; caps near the scores' size, where tanh bends)
                      Case{2, 37, 53, 4, 2, 64, false, -1, bf, false, 2.f},   // tails, GQA
                      Case{1, 200, 300, 4, 2, 128, true, -1, fp, true, 1.5f},  // causal, padded gradients
                      Case{1, 192, 256, 2, 1, 64, false, 70, bf, false, 3.f},  // a window, MQA
                      Case{1, 700, 650, 2, 1, 128, false, -1, bf, false, 30.f},  // a loose cap, ring wraps
                      Case{2, 300, 260, 4, 2, 256, true, -1, bf, true, 5.f},     // D = 256: causal, GQA, tails
                      Case{1, 640, 512, 2, 2, 256, false, -1, fp, false, 30.f})),  // D = 256: dK, dV written once
    [](const ::testing::TestParamInfo<std::tuple<std::string, Case>>& info) {
      return std::get<0>(info.param) + "_" + std::to_string(info.index);
    });


// Variable-length batches: sequences packed along the rows of [total, H, D] tensors, the
// reference run per sequence. A sequence without keys gets NaN queries and dO (its rows see no
// key: its dq is 0 whatever they hold) and one without queries NaN keys and values (its dk and
// dv are 0): a kernel whose boxes run past a neighbour's last row must keep them out of the
// neighbour's gradients. With nan_sequence >= 0 that sequence's own first query and key hold
// NaN (its gradients are NaN, and not checked): the others' must stay exact, although a box of
// its rows runs into theirs (0 x NaN is NaN on the tensor cores). With unowned_k > 0, k and v
// have that many NaN rows before the first sequence and after the last, which no sequence owns:
// their dk and dv rows must be 0; unowned_q does the same for q and dout, and their dq rows.
struct VarlenCase {
  std::vector<int> lens_q, lens_k;
  int heads_q, heads_kv, head_dim;
  bool causal;
  int window_left;
  DType dtype;
  bool padded;  // dq, dk and dv with gaps between rows and heads
  int nan_sequence = -1;
  float softcap = 0.f;
  int unowned_k = 0;
  int unowned_q = 0;
};

std::string describe(const VarlenCase& c) {
  std::string lens;
  for (size_t b = 0; b < c.lens_q.size(); ++b)
    lens += (b ? "," : "") + std::to_string(c.lens_q[b]) + "/" + std::to_string(c.lens_k[b]);
  return "varlen q/k=" + lens + " Hq=" + std::to_string(c.heads_q) + " Hkv=" + std::to_string(c.heads_kv) +
         " D=" + std::to_string(c.head_dim) + (c.causal ? " causal" : "") +
         (c.window_left >= 0 ? " window_left=" + std::to_string(c.window_left) : "") +
         (c.dtype == DType::bf16 ? " bf16" : " fp16") + (c.padded ? " padded" : "") +
         (c.nan_sequence >= 0 ? " NaN in sequence " + std::to_string(c.nan_sequence) : "") +
         (c.softcap > 0.f ? " softcap=" + std::to_string(c.softcap) : "") +
         (c.unowned_k > 0 ? " unowned_k=" + std::to_string(c.unowned_k) : "") +
         (c.unowned_q > 0 ? " unowned_q=" + std::to_string(c.unowned_q) : "");
}

class BackwardVarlenTest : public ::testing::TestWithParam<std::tuple<std::string, VarlenCase>> {};

TEST_P(BackwardVarlenTest, MatchesFp64ReferencePerSequence) {
  const std::string skip = testing::gpu_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
  const auto& [kernel, c] = GetParam();
  SCOPED_TRACE(kernel + ": " + describe(c));
  const int D = c.head_dim, Hq = c.heads_q, Hkv = c.heads_kv, batch = int(c.lens_q.size());
  std::vector<int> cu_q{c.unowned_q}, cu_k{c.unowned_k};
  for (int b = 0; b < batch; ++b) {
    cu_q.push_back(cu_q.back() + c.lens_q[b]);
    cu_k.push_back(cu_k.back() + c.lens_k[b]);
  }
  const int total_q = cu_q.back() + c.unowned_q, total_k = cu_k.back() + c.unowned_k;
  const size_t q_elems = size_t(total_q) * Hq * D, k_elems = size_t(total_k) * Hkv * D;
  std::mt19937 rng(uint32_t(total_q * 7919 + total_k * 31 + D));
  using harness::random_normal;
  harness::HostTensor q = random_normal(q_elems, c.dtype, &rng), k = random_normal(k_elems, c.dtype, &rng),
                      v = random_normal(k_elems, c.dtype, &rng), dout = random_normal(q_elems, c.dtype, &rng);
  auto poison = [&](harness::HostTensor* t, int row0, int rows, int heads) {
    const uint16_t nan_bits = c.dtype == DType::bf16 ? 0x7fc0 : 0x7e00;
    for (size_t e = size_t(row0) * heads * D; e < size_t(row0 + rows) * heads * D; ++e) {
      t->bits[e] = nan_bits;
      t->values[e] = std::numeric_limits<float>::quiet_NaN();
    }
  };
  for (int row0 : {0, cu_k.back()}) poison(&k, row0, c.unowned_k, Hkv), poison(&v, row0, c.unowned_k, Hkv);
  for (int row0 : {0, cu_q.back()}) poison(&q, row0, c.unowned_q, Hq), poison(&dout, row0, c.unowned_q, Hq);
  for (int b = 0; b < batch; ++b) {
    if (c.lens_k[b] == 0) poison(&q, cu_q[b], c.lens_q[b], Hq), poison(&dout, cu_q[b], c.lens_q[b], Hq);
    if (c.lens_q[b] == 0) poison(&k, cu_k[b], c.lens_k[b], Hkv), poison(&v, cu_k[b], c.lens_k[b], Hkv);
  }
  if (c.nan_sequence >= 0) {  // its first query and key row: every query of it then sees a NaN key
    poison(&q, cu_q[c.nan_sequence], 1, Hq);
    poison(&k, cu_k[c.nan_sequence], 1, Hkv);
  }

  // The reference, one sequence at a time (a one-entry batch over its rows), into the packed
  // layout: out and the gradients [total, H, D], lse [Hq, total_q].
  const Strides q_strides = contiguous_bshd(total_q, Hq, D), k_strides = contiguous_bshd(total_k, Hkv, D);
  std::vector<uint16_t> out_bits(q_elems, 0);
  std::vector<float> lse_host(size_t(Hq) * total_q, 0.f);
  std::vector<double> dq_ref(q_elems, 0.0), dk_ref(k_elems, 0.0), dv_ref(k_elems, 0.0);
  for (int b = 0; b < batch; ++b) {
    const int sq = c.lens_q[b], sk = c.lens_k[b];
    if (sq == 0) continue;  // no queries: no gradient (its dk, dv rows stay 0)
    ref::HostProblem h;
    h.batch = 1;
    h.seqlen_q = sq;
    h.seqlen_k = sk;
    h.heads_q = Hq;
    h.heads_kv = Hkv;
    h.head_dim = D;
    h.q = q.values.data() + size_t(cu_q[b]) * Hq * D;
    h.q_strides = q_strides;
    h.k = k.values.data() + size_t(cu_k[b]) * Hkv * D;
    h.k_strides = k_strides;
    h.v = v.values.data() + size_t(cu_k[b]) * Hkv * D;
    h.v_strides = k_strides;
    h.scale = 1.f / std::sqrt(float(D));
    h.causal = c.causal;
    h.window_left = c.window_left;
    h.softcap = c.softcap;
    std::vector<double> out, lse, dq, dk, dv;
    ref::attention_fp64(h, &out, &lse);  // [1, sq, Hq, D], [1, Hq, sq]
    ref::attention_backward_fp64(h, dout.values.data() + size_t(cu_q[b]) * Hq * D, q_strides, &dq, &dk, &dv);
    for (size_t e = 0; e < out.size(); ++e) {
      out_bits[size_t(cu_q[b]) * Hq * D + e] = ref::float_to_bits(float(out[e]), c.dtype);
      dq_ref[size_t(cu_q[b]) * Hq * D + e] = dq[e];
    }
    for (int hh = 0; hh < Hq; ++hh)
      for (int i = 0; i < sq; ++i) lse_host[size_t(hh) * total_q + cu_q[b] + i] = float(lse[size_t(hh) * sq + i]);
    for (size_t e = 0; e < dk.size(); ++e) {
      dk_ref[size_t(cu_k[b]) * Hkv * D + e] = dk[e];
      dv_ref[size_t(cu_k[b]) * Hkv * D + e] = dv[e];
    }
  }

  // Gradients with gaps when padded: one spare head and 8 spare elements per row.
  auto grad_strides = [&](int heads) {
    Strides s;
    s.head = D + (c.padded ? 8 : 0);
    s.seq = s.head * (heads + (c.padded ? 1 : 0));
    s.batch = 0;  // one packed entry: not used
    return s;
  };
  const Strides dq_strides = grad_strides(Hq), dk_strides = grad_strides(Hkv);
  const size_t dq_span = size_t(dq_strides.seq) * total_q, dk_span = size_t(dk_strides.seq) * total_k;

  BackwardBuffers d;
  ASSERT_NO_FATAL_FAILURE(d.load(q, k, v, out_bits, lse_host, dout, dq_span, dk_span));
  harness::DeviceBuffer d_cu_q, d_cu_k;
  for (auto [buf, offsets] : {std::pair{&d_cu_q, &cu_q}, {&d_cu_k, &cu_k}}) {
    ASSERT_TRUE(buf->allocate(offsets->size() * 4).ok());
    ASSERT_EQ(cudaMemcpy(buf->get(), offsets->data(), offsets->size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }

  BackwardProblem b;
  AttentionProblem& p = b.forward;
  p.dtype = c.dtype;
  p.batch = batch;
  p.seqlen_q = *std::max_element(c.lens_q.begin(), c.lens_q.end());
  p.seqlen_k = *std::max_element(c.lens_k.begin(), c.lens_k.end());
  p.heads_q = Hq;
  p.heads_kv = Hkv;
  p.head_dim = D;
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.softcap = c.softcap;
  p.cu_seqlens_q = static_cast<const int32_t*>(d_cu_q.get());
  p.cu_seqlens_k = static_cast<const int32_t*>(d_cu_k.get());
  p.total_q = total_q;
  p.total_k = total_k;
  d.point(&b, q_strides, k_strides, dq_strides, dk_strides);
  Options options;
  options.kernel = kernel;
  const Status s = backward(b, options);
  // Refused: every lineage step (dense batches only); bwd_sm90 runs them all.
  if (s.code() == StatusCode::not_supported) GTEST_SKIP() << s.message();
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << cudaGetErrorString(cudaGetLastError());

  const int n = c.nan_sequence;  // its rows are not checked
  check_gradient("dq", d.dq, dq_strides, 1, total_q, Hq, D, c.dtype, dq_ref, n >= 0 ? cu_q[n] : 0,
                 n >= 0 ? cu_q[n + 1] : 0);
  check_gradient("dk", d.dk, dk_strides, 1, total_k, Hkv, D, c.dtype, dk_ref, n >= 0 ? cu_k[n] : 0,
                 n >= 0 ? cu_k[n + 1] : 0);
  check_gradient("dv", d.dv, dk_strides, 1, total_k, Hkv, D, c.dtype, dv_ref, n >= 0 ? cu_k[n] : 0,
                 n >= 0 ? cu_k[n + 1] : 0);
}

INSTANTIATE_TEST_SUITE_P(
    Varlen, BackwardVarlenTest,
    ::testing::Combine(
        ::testing::ValuesIn(backward_kernel_names()),
        ::testing::Values(
            // GQA 2, tails of 100 and 257 rows, a one-row sequence, a whole 128-row one.
            VarlenCase{{100, 257, 1, 128}, {100, 257, 1, 128}, 4, 2, 128, false, -1, bf, false},
            // Causal; a sequence without queries (NaN keys and values after the first one's
            // last key block, which ends at key 300 mid-box); Sq < Sk; padded gradients.
            VarlenCase{{300, 0, 77, 130}, {300, 5, 77, 200}, 2, 1, 64, true, -1, fp, true},
            // D = 256, causal, a one-row sequence.
            VarlenCase{{190, 64, 1}, {190, 64, 1}, 2, 2, 256, true, -1, bf, false},
            // A sequence without keys (NaN queries and dO right after the first one's 60
            // rows, inside its query box), causal, GQA 2.
            VarlenCase{{60, 50, 40}, {60, 0, 45}, 4, 2, 64, true, -1, bf, false},
            // A window; Sq > Sk and Sq < Sk in one batch.
            VarlenCase{{130, 8, 500}, {200, 700, 9}, 2, 1, 128, false, 40, fp, false},
            // Whole blocks, causal, MQA.
            VarlenCase{{256, 320, 64}, {256, 320, 64}, 4, 1, 128, true, -1, fp, false},
            // 11 query blocks in one sequence: the stage ring wraps.
            VarlenCase{{33, 700}, {40, 650}, 2, 2, 64, false, -1, bf, true},
            // D = 256, Sq much shorter than Sk, partial blocks, padded.
            VarlenCase{{150, 40}, {1100, 300}, 2, 2, 256, false, -1, fp, true},
            // D = 256 (64-row boxes): causal, GQA 2, padded; a sequence without queries (NaN
            // keys and values inside the first one's last key box) and one without keys (NaN
            // queries and dO inside its last query box).
            VarlenCase{{70, 0, 50}, {130, 40, 0}, 4, 2, 256, true, -1, bf, true},
            // D = 256, MQA, a window; Sq > Sk and Sq < Sk in one batch; 5 query blocks.
            VarlenCase{{300, 8, 130}, {9, 200, 330}, 2, 1, 256, false, 40, fp, false},
            // NaN in sequence 0's own first query and key (70 queries, 90 keys: its last query
            // and key boxes run into sequence 1's rows), at each head dim; GQA 2 at D = 128.
            VarlenCase{{70, 90}, {90, 70}, 2, 2, 64, false, -1, bf, false, 0},
            VarlenCase{{70, 90}, {90, 70}, 4, 2, 128, true, -1, fp, false, 0},
            VarlenCase{{70, 90}, {90, 70}, 2, 2, 256, false, -1, bf, false, 0},
            // Softcapping: causal with a sequence without keys; a
            // window; D = 256 causal, GQA 2, padded, sequences without queries or keys.
            VarlenCase{{60, 50, 40}, {60, 0, 45}, 4, 2, 64, true, -1, bf, false, -1, 2.f},
            VarlenCase{{130, 8, 500}, {200, 700, 9}, 2, 1, 128, false, 40, fp, true, -1, 1.5f},
            VarlenCase{{70, 0, 50}, {130, 40, 0}, 4, 2, 256, true, -1, bf, true, -1, 5.f},
            // Rows no sequence owns: 7 NaN key rows before the first sequence and after the
            // last (whose last key box runs into them); their dk and dv rows must be 0. Without
            // GQA (the production backward may write dK and dV itself) and with GQA 2.
            VarlenCase{{100, 1, 60}, {90, 130, 5}, 4, 4, 64, true, -1, bf, true, -1, 0.f, 7},
            VarlenCase{{100, 60}, {90, 130}, 4, 2, 128, false, -1, fp, false, -1, 0.f, 7},
            // The same at D = 256, with 5 unowned query rows too (whose dq rows must be 0):
            // causal without GQA, padded; a window with GQA 2.
            VarlenCase{{100, 1, 60}, {90, 130, 5}, 2, 2, 256, true, -1, bf, true, -1, 0.f, 7, 5},
            VarlenCase{{100, 60}, {90, 130}, 4, 2, 256, false, 40, fp, false, -1, 0.f, 7, 5})),
    [](const ::testing::TestParamInfo<std::tuple<std::string, VarlenCase>>& info) {
      return std::get<0>(info.param) + "_" + std::to_string(info.index);
    });

}  // namespace
}  // namespace hattn
