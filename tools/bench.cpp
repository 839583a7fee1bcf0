// hattn-bench: times lineage kernels over the FlashAttention-3 benchmark grid.
//
// Every kernel is first checked against the fp64 CPU reference on a sample of rows of the
// same inputs it is then timed on. Times are CUDA-event medians with the L2 flushed before
// each call (--warm-l2: not flushed); the cuBLAS bf16 GEMM rate measured in the same run is
// the ceiling.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness.h"
#include "hattn/hattn.h"
#include "hattn/reference.h"

namespace {

using namespace hattn;
using harness::Shape;

struct Config {
  std::vector<std::string> kernels;  // empty: all
  std::vector<int> dims = {64, 128, 256};
  std::vector<int> seqlens = {512, 1024, 2048, 4096, 8192, 16384};
  std::vector<bool> causal = {false, true};
  int window_left = -1, window_right = -1;  // a sliding window on every shape; -1: that side open
  std::string varlen;  // "", "equal" or "mixed": every shape as a variable-length batch
  int seqlen_q = 0;     // queries per sequence; 0: as many as keys (the grid's S)
  int num_splits = 0;   // split-KV parts (AttentionProblem::num_splits): 0 automatic, 1 off
  int page_size = 0;    // > 0: K and V in a paged cache of such pages (every key in use)
  int gqa = 1;          // query heads per K/V head
  float softcap = 0.f;  // AttentionProblem::softcap on every shape; 0: off
  std::optional<bool> pack_gqa;  // AttentionProblem::pack_gqa; empty: automatic
  bool backward = false;         // time hattn::backward instead of the forward kernels
  bool fp8_cache = false;        // K and V as an e4m3 cache beside --dtype q (AttentionProblem::kv_dtype)
  bool with_fp8_cache = false;   // each shape twice: its --dtype cache, then an e4m3 one
  DType dtype = DType::bf16;
  int tokens = 16384;  // batch * seqlen
  int hidden = 2048;   // heads * head_dim
  bool capstone = false;
  int max_reps = 20;
  double seconds_per_point = 1.0;
  double settle_seconds = 0;  // untimed calls before a point's timed ones (forward only)
  double slow_call_seconds = 2.0;  // a call slower than this is timed once (its check run)
  int check_rows = 48;
  bool gemm = true;
  bool warm_l2 = false;  // no L2 flush before the timed calls (inputs that fit stay in L2)
  std::string csv;
  std::string commit;
};

void usage() {
  std::printf(
      "usage: hattn-bench [options]\n"
      "  --kernels a,b       kernels to run, or auto (default: all; see --list)\n"
      "  --dims 64,128,256   head dims\n"
      "  --seqlens 512,...   sequence lengths (default 512..16384)\n"
      "  --causal no|yes|both (default both)\n"
      "  --window L,R        a sliding window on every shape (-1: that side open; production forward only)\n"
      "  --varlen equal|mixed every shape as a variable-length batch (production forward only) of its B\n"
      "                      sequences: all of length S (compare with the dense run), or of lengths\n"
      "                      drawn from [S/4, 7S/4] (fixed seed; FLOPs count the real lengths)\n"
      "  --varlen short      instead of the grid, one batch per head dim of sequences of 50..2000\n"
      "                      tokens, 65536 in all (fixed seed; python -m hattn.bench --varlen short's\n"
      "                      kind of batch, not its lengths); the other flags apply as to the grid\n"
      "  --seqlen-q N        queries per sequence (default: S, as many as keys); e.g. 1 for decoding\n"
      "  --num-splits N      split-KV parts: 0 automatic (default), 1 off, N (production forward only)\n"
      "  --page-size N       K and V in a paged cache of N-key pages, shuffled (production forward only)\n"
      "  --gqa R             R query heads per K/V head (default 1; must divide the heads)\n"
      "  --pack-gqa on|off   force GQA packing (default: automatic; production forward only)\n"
      "  --fp8-cache         K and V as an e4m3 cache with descales beside bf16/fp16 q (production forward\n"
      "                      only); with --seqlen-q the GB/s count the cache's bytes at 1 each\n"
      "  --with-fp8-cache    each shape twice in one run: with a --dtype cache, then an e4m3 one\n"
      "  --softcap C         cap the scores at C * tanh(s / C) (production forward; backward: bwd_sm90)\n"
      "  --backward          time the backward (dq, dk, dv) after a forward; FLOPs 2.5x the forward's;\n"
      "                      sampled rows of dq are checked against the fp64 reference; --kernels\n"
      "                      then names backward kernels (default: auto); with --varlen too\n"
      "  --dtype bf16|fp16|e4m3  (default bf16; e4m3: the FP8 forward, q, k and v e4m3 codes with\n"
      "                      descales, out bf16; no GEMM ceiling: cuBLAS's bf16 one is not FP8's)\n"
      "  --tokens N          batch * seqlen (default 16384)\n"
      "  --hidden N          heads * head_dim (default 2048)\n"
      "  --capstone          add the video-model shapes (B=1, S=32760/75600, H=12/40, D=128)\n"
      "  --reps N            most timed calls per point (default 20)\n"
      "  --seconds S         time budget per point (default 1.0)\n"
      "  --settle S          forward: untimed calls for about S seconds before each point's timed\n"
      "                      ones (default 0: the timed calls are a burst after the point's idle\n"
      "                      setup, before the board reaches its power cap on the long shapes);\n"
      "                      not with --backward, nor for a point timed once (a call over 2 s)\n"
      "  --check-rows N      rows checked against the fp64 reference (default 48)\n"
      "  --no-gemm           skip the cuBLAS GEMM ceiling\n"
      "  --warm-l2           time without flushing L2 first: inputs that fit in L2 stay there, which\n"
      "                      shows a kernel's floor where DRAM is not the limit (not comparable with\n"
      "                      the default times; the CSV gets an l2 column)\n"
      "  --csv PATH          write results as CSV\n"
      "  --commit SHA        commit recorded in the CSV (default $HATTN_COMMIT)\n"
      "  --list              list the forward and the backward kernels and exit\n");
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

bool parse_ints(const std::string& s, std::vector<int>* out) {
  out->clear();
  for (const auto& item : split(s)) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (*end != '\0' || v <= 0) return false;
    out->push_back(int(v));
  }
  return !out->empty();
}

// Returns 0 to run, 1 to exit successfully (--help/--list), 2 on a bad flag.
int parse(int argc, char** argv, Config* c) {
  if (const char* env = std::getenv("HATTN_COMMIT")) c->commit = env;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "hattn-bench: %s needs a value\n", flag);
        return nullptr;
      }
      return argv[++i];
    };
    const char* v = nullptr;
    if (a == "--help" || a == "-h") {
      usage();
      return 1;
    } else if (a == "--list") {
      std::printf("forward kernels (--kernels):\n");
      for (const auto& k : kernels()) std::printf("  %-28s %s\n", k.name.c_str(), k.description.c_str());
      std::printf("backward kernels (--backward --kernels; \"auto\" runs the newest that takes the problem):\n");
      for (const auto& name : backward_kernel_names()) std::printf("  %s\n", name.c_str());
      return 1;
    } else if (a == "--capstone") {
      c->capstone = true;
    } else if (a == "--backward") {
      c->backward = true;
    } else if (a == "--fp8-cache") {
      c->fp8_cache = true;
    } else if (a == "--with-fp8-cache") {
      c->with_fp8_cache = true;
    } else if (a == "--no-gemm") {
      c->gemm = false;
    } else if (a == "--warm-l2") {
      c->warm_l2 = true;
    } else if (a == "--kernels" || a == "--dims" || a == "--seqlens" || a == "--causal" || a == "--dtype" ||
               a == "--tokens" || a == "--hidden" || a == "--reps" || a == "--seconds" || a == "--settle" ||
               a == "--check-rows" || a == "--csv" || a == "--commit" || a == "--window" || a == "--varlen" ||
               a == "--seqlen-q" || a == "--num-splits" || a == "--page-size" || a == "--gqa" || a == "--pack-gqa" ||
               a == "--softcap") {
      if (!(v = value(a.c_str()))) return 2;
      const std::string s = v;
      bool ok = true;
      std::vector<int> ints;
      if (a == "--kernels") {
        c->kernels = split(s);
      } else if (a == "--dims") {
        ok = parse_ints(s, &c->dims);
      } else if (a == "--seqlens") {
        ok = parse_ints(s, &c->seqlens);
      } else if (a == "--causal") {
        ok = s == "no" || s == "yes" || s == "both";
        c->causal = s == "no" ? std::vector<bool>{false} : s == "yes" ? std::vector<bool>{true}
                                                                        : std::vector<bool>{false, true};
      } else if (a == "--dtype") {
        ok = s == "bf16" || s == "fp16" || s == "e4m3";
        c->dtype = s == "fp16" ? DType::fp16 : s == "e4m3" ? DType::e4m3 : DType::bf16;
      } else if (a == "--window") {
        const std::vector<std::string> parts = split(s);
        ok = parts.size() == 2;
        int edges[2] = {-1, -1};
        for (size_t k = 0; ok && k < 2; ++k) {
          char* end = nullptr;
          const long e = std::strtol(parts[k].c_str(), &end, 10);
          ok = *end == '\0' && e >= -1 && e < (1L << 30);
          edges[k] = int(e);
        }
        c->window_left = edges[0];
        c->window_right = edges[1];
      } else if (a == "--seqlen-q" || a == "--num-splits") {
        char* end = nullptr;
        const long n = std::strtol(s.c_str(), &end, 10);
        ok = *end == '\0' && n >= (a == "--seqlen-q" ? 1 : 0) && n <= (a == "--seqlen-q" ? (1L << 30) : kMaxSplits);
        (a == "--seqlen-q" ? c->seqlen_q : c->num_splits) = int(n);
      } else if (a == "--pack-gqa") {
        ok = s == "on" || s == "off";
        c->pack_gqa = s == "on";
      } else if (a == "--varlen") {
        ok = s == "equal" || s == "mixed" || s == "short";
        c->varlen = s;
      } else if (a == "--csv") {
        c->csv = s;
      } else if (a == "--commit") {
        c->commit = s;
      } else if (a == "--softcap") {
        char* end = nullptr;
        c->softcap = std::strtof(s.c_str(), &end);
        ok = *end == '\0' && c->softcap > 0 && std::isfinite(c->softcap);
      } else if (a == "--settle") {
        char* end = nullptr;
        c->settle_seconds = std::strtod(s.c_str(), &end);
        ok = *end == '\0' && c->settle_seconds >= 0;
      } else if (a == "--seconds") {
        c->seconds_per_point = std::atof(s.c_str());
        ok = c->seconds_per_point > 0;
      } else {
        ok = parse_ints(s, &ints) && ints.size() == 1;
        if (ok) {
          if (a == "--tokens") c->tokens = ints[0];
          if (a == "--hidden") c->hidden = ints[0];
          if (a == "--reps") c->max_reps = ints[0];
          if (a == "--check-rows") c->check_rows = ints[0];
          if (a == "--gqa") {
            c->gqa = ints[0];
            ok = c->gqa >= 1;
          }
          if (a == "--page-size") {
            c->page_size = ints[0];
            ok = c->page_size >= 1;
          }
        }
      }
      if (!ok) {
        std::fprintf(stderr, "hattn-bench: bad value '%s' for %s\n", v, a.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "hattn-bench: unknown option '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }
  if (c->backward && c->settle_seconds > 0) {  // its CSV column would claim a settle that did not happen
    std::fprintf(stderr, "hattn-bench: --settle applies to the forward only, not with --backward\n");
    return 2;
  }
  if ((c->fp8_cache || c->with_fp8_cache) && (c->backward || c->dtype == DType::e4m3)) {
    std::fprintf(stderr, "hattn-bench: --fp8-cache is a forward's e4m3 cache beside bf16 or fp16 q\n");
    return 2;
  }
  if (c->dtype == DType::e4m3 && c->backward) {
    std::fprintf(stderr, "hattn-bench: --dtype e4m3 is the FP8 forward's (q, k and v e4m3 with descales), not "
                         "with --backward\n");
    return 2;
  }
  if (c->backward && c->page_size > 0) {  // the backward takes no paged cache
    std::fprintf(stderr, "hattn-bench: --backward takes dense or --varlen batches, not --page-size\n");
    return 2;
  }
  if (c->backward) {  // --kernels names backward kernels here; by default "auto"
    const std::vector<std::string> known = backward_kernel_names();
    if (c->kernels.empty()) c->kernels = {"auto"};
    for (const auto& name : c->kernels)
      if (name != "auto" && std::find(known.begin(), known.end(), name) == known.end()) {
        std::fprintf(stderr, "hattn-bench: unknown backward kernel '%s' (known:", name.c_str());
        for (const auto& k : known) std::fprintf(stderr, " %s", k.c_str());
        std::fprintf(stderr, ")\n");
        return 2;
      }
    return 0;
  }
  for (const auto& name : c->kernels) {
    bool known = name == "auto";  // what hattn::forward runs by default (the production forward)
    for (const auto& k : kernels()) known |= k.name == name;
    if (!known) {
      std::fprintf(stderr, "hattn-bench: unknown kernel '%s' (see --list)\n", name.c_str());
      return 2;
    }
  }
  if (c->kernels.empty())
    for (const auto& k : kernels()) c->kernels.push_back(k.name);
  return 0;
}

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    cudaError_t err_ = (call);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "hattn-bench: %s failed: %s (%s:%d)\n", #call, cudaGetErrorString(err_), \
                   __FILE__, __LINE__);                                                               \
      return false;                                                                                   \
    }                                                                                                 \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The SM clock right now, from nvidia-smi (0 when unavailable).
int sm_clock_mhz() {
  int device = 0;
  cudaGetDevice(&device);
  const std::string cmd =
      "nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits -i " + std::to_string(device) + " 2>/dev/null";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return 0;
  int mhz = 0;
  if (std::fscanf(pipe, "%d", &mhz) != 1) mhz = 0;
  pclose(pipe);
  return mhz;
}

// cuBLAS bf16 GEMM, 8192^3, fp32 accumulation, random inputs: the tensor-core ceiling.
bool gemm_ceiling(double* tflops) {
  const int n = 8192;
  harness::DeviceBuffer a, b, c;
  if (!a.allocate(size_t(n) * n * 2).ok() || !b.allocate(size_t(n) * n * 2).ok() || !c.allocate(size_t(n) * n * 2).ok())
    return false;
  std::vector<uint16_t> host(size_t(n) * n);
  uint32_t state = 1;
  for (auto& x : host) {
    state = state * 1664525u + 1013904223u;
    x = ref::float_to_bits(float(state >> 8) / float(1 << 24) - 0.5f, DType::bf16);
  }
  CHECK_CUDA(cudaMemcpy(a.get(), host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(b.get(), host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return false;
  const float alpha = 1.f, beta = 0.f;
  auto run = [&] {
    return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n, b.get(),
                        CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  std::vector<double> times;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  bool ok = true;
  for (int i = 0; i < 23 && ok; ++i) {
    cudaEventRecord(start);
    ok = run() == CUBLAS_STATUS_SUCCESS;
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 3) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  if (!ok) return false;
  *tflops = 2.0 * n * n * double(n) / (median(times) * 1e-3) / 1e12;
  return true;
}

struct Row {
  std::string kernel;
  Shape shape;
  int reps = 0;
  double ms = 0, tflops = 0, gbps = 0;
  int clock = 0;
  std::string check;  // PASS, FAIL or why it did not run
  double max_err = 0, budget = 0;
};

// `reps` timed calls of `call` (which returns false on failure), each after an L2 flush and
// between two events, queued back to back and synchronized once: the host's part of a call
// runs while the GPU works on the calls before it. Their times go to *ms.
template <typename Call>
bool time_queued(int reps, void* flush, size_t flush_bytes, Call&& call, std::vector<double>* ms) {
  std::vector<cudaEvent_t> events(2 * reps);
  for (auto& e : events) CHECK_CUDA(cudaEventCreate(&e));
  auto destroy_events = [&] {
    for (auto& e : events) cudaEventDestroy(e);
  };
  for (int r = 0; r < reps; ++r) {
    if (flush_bytes > 0) CHECK_CUDA(cudaMemsetAsync(flush, r & 0xff, flush_bytes));  // evict the inputs from L2
    CHECK_CUDA(cudaEventRecord(events[2 * r]));
    if (!call()) {
      destroy_events();  // a failed call: the point is skipped, its events are not kept
      return false;
    }
    CHECK_CUDA(cudaEventRecord(events[2 * r + 1]));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  ms->assign(reps, 0.0);
  for (int r = 0; r < reps; ++r) {
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, events[2 * r], events[2 * r + 1]));
    (*ms)[r] = t;
  }
  destroy_events();
  return true;
}

// Times `kernel` on `w`: an L2 flush, then the call between events, repeated.
bool time_kernel(const Config& cfg, harness::Workload& w, const std::string& kernel, void* flush, size_t flush_bytes,
                 double first_call_ms, Row* row) {
  Options options;
  options.kernel = kernel;
  if (first_call_ms > cfg.slow_call_seconds * 1e3) {
    row->reps = 1;
    row->ms = first_call_ms;
    return true;
  }
  const int reps = std::clamp(int(cfg.seconds_per_point * 1e3 / std::max(first_call_ms, 1e-3)), 3, cfg.max_reps);
  // Warm-up call (module load, smem attribute setting) outside the timed ones.
  if (!forward(w.problem, options).ok()) return false;
  // --settle: calls like the timed ones, untimed, queued right before them, so that the timed
  // calls run at the clock the board holds under sustained load. Without them, the 20 calls
  // that follow the point's idle setup read up to 12% faster on the long shapes
  // (results/evidence/clock_carryover/).
  const int settle_calls = int(cfg.settle_seconds * 1e3 / std::max(first_call_ms, 1e-3));
  for (int i = 0; i < settle_calls; ++i) {
    if (flush_bytes > 0) CHECK_CUDA(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
    if (!forward(w.problem, options).ok()) return false;
  }
  std::vector<double> ms;
  if (!time_queued(reps, flush, flush_bytes, [&] { return forward(w.problem, options).ok(); }, &ms)) return false;
  row->reps = reps;
  row->ms = median(ms);
  return true;
}

// The backward on `w`: a forward (the production forward) makes out and lse, then hattn::backward
// with a random dout is checked on the sampled rows of dq (fp64 reference; a varlen batch's
// sequence on its own, as check_outputs does) and timed like the forward: an L2 flush, then the
// call between events. FLOPs: 2.5x the forward's (FlashAttention's convention: five matrix
// products where the forward has two).
bool time_backward(const Config& cfg, const Options& options, harness::Workload& w,
                   const std::vector<harness::RowId>& sample, uint64_t seed, void* flush, size_t flush_bytes, Row* row) {
  const Shape& shape = w.shape;
  const AttentionProblem& p = w.problem;
  if (!forward(p).ok() || cudaDeviceSynchronize() != cudaSuccess) return false;
  // Dense [B, S, H, D], or packed [total, H, D] (one batch entry of total rows).
  const size_t q_elems = size_t(p.tensor_batch()) * p.tensor_rows_q() * p.heads_q * p.head_dim;
  const size_t k_elems = size_t(p.tensor_batch()) * p.tensor_rows_k() * p.heads_kv * p.head_dim;
  std::mt19937 rng{uint32_t(seed)};
  const harness::HostTensor dout_host = harness::random_normal(q_elems, shape.dtype, &rng);
  harness::DeviceBuffer dout, dq, dk, dv;
  if (!dout.allocate(q_elems * 2).ok() || !dq.allocate(q_elems * 2).ok() || !dk.allocate(k_elems * 2).ok() ||
      !dv.allocate(k_elems * 2).ok())
    return false;
  CHECK_CUDA(cudaMemcpy(dout.get(), dout_host.bits.data(), q_elems * 2, cudaMemcpyHostToDevice));
  BackwardProblem b;
  b.forward = p;
  const Strides q_strides = contiguous_bshd(p.tensor_rows_q(), p.heads_q, p.head_dim);
  const Strides k_strides = contiguous_bshd(p.tensor_rows_k(), p.heads_kv, p.head_dim);
  b.dout = dout.get();
  b.dout_strides = q_strides;
  b.dq = dq.get();
  b.dq_strides = q_strides;
  b.dk = dk.get();
  b.dk_strides = k_strides;
  b.dv = dv.get();
  b.dv_strides = k_strides;
  cudaEvent_t a, e;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&e));
  CHECK_CUDA(cudaEventRecord(a));
  Status s = backward(b, options);
  CHECK_CUDA(cudaEventRecord(e));
  if (s.code() == StatusCode::not_supported) {
    row->check = "unsupported";
    cudaEventDestroy(a);
    cudaEventDestroy(e);
    return true;
  }
  if (!s.ok() || cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "hattn-bench: backward: %s / %s\n", s.to_string().c_str(), cudaGetErrorString(cudaGetLastError()));
    return false;
  }
  float first_ms = 0;
  cudaEventElapsedTime(&first_ms, a, e);
  cudaEventDestroy(a);
  cudaEventDestroy(e);
  // Sampled rows of dq against the fp64 reference: within 3 ulps of the sample's largest element.
  std::vector<uint16_t> dq_bits(q_elems);
  CHECK_CUDA(cudaMemcpy(dq_bits.data(), dq.get(), q_elems * 2, cudaMemcpyDeviceToHost));
  std::vector<double> want(p.head_dim);
  double largest = 0, worst = 0;
  bool finite = true;
  for (const harness::RowId& r : sample) {
    const ref::HostProblem host = harness::sequence_host(w, r.b);  // varlen: sequence r.b on its own
    const float* dout_rows = dout_host.values.data();
    int64_t row = int64_t(r.b) * p.seqlen_q + r.i;  // of the [B * S, H, D] or [total, H, D] rows
    if (shape.varlen()) {
      dout_rows += int64_t(w.cu_q[r.b]) * q_strides.seq;
      row = w.cu_q[r.b] + r.i;
    }
    ref::attention_backward_dq_row_fp64(host, dout_rows, q_strides, shape.varlen() ? 0 : r.b, r.h, r.i, want.data());
    for (int d = 0; d < p.head_dim; ++d) {
      const float got = ref::bits_to_float(dq_bits[(size_t(row) * p.heads_q + r.h) * p.head_dim + d], shape.dtype);
      finite &= std::isfinite(got);
      largest = std::max(largest, std::abs(want[d]));
      worst = std::max(worst, std::abs(double(got) - want[d]));
    }
  }
  row->max_err = worst;
  row->budget = harness::backward_error_budget(shape.dtype, largest);
  row->check = finite && worst <= row->budget ? "PASS" : "FAIL";
  // Timed calls.
  std::vector<double> ms;
  const int reps = first_ms > cfg.slow_call_seconds * 1e3
                       ? 0
                       : std::clamp(int(cfg.seconds_per_point * 1e3 / std::max(first_ms, 1e-3f)), 3, cfg.max_reps);
  // Queued as the forward's: synchronized after every call, each call's time would include its
  // host part (tensor maps, scratch, launches), which shows at the short shapes
  // (results/evidence/bwd_13_varlen_timed/).
  if (!time_queued(reps, flush, flush_bytes, [&] { return backward(b, options).ok(); }, &ms)) return false;
  row->reps = reps > 0 ? reps : 1;
  row->ms = reps > 0 ? median(ms) : first_ms;
  row->tflops = 2.5 * harness::forward_flops(shape) / (row->ms * 1e-3) / 1e12;
  row->gbps = 0;
  row->clock = sm_clock_mhz();
  return true;
}

std::vector<Shape> grid(const Config& cfg) {
  std::vector<Shape> shapes;
  // --varlen: the shape's B sequences packed along the rows, of length S or of lengths drawn
  // from [S/4, 7S/4] (seeded by S and D).
  auto packed = [&](Shape* sh, int s, int d) {
    if (cfg.varlen.empty()) return;
    std::vector<int> lens(sh->batch, s);
    if (cfg.varlen == "mixed") {
      std::mt19937 rng(uint32_t(s) * 131u + uint32_t(d));
      for (int& n : lens) n = std::uniform_int_distribution<int>(std::max(1, s / 4), s * 7 / 4)(rng);
    }
    const std::vector<int> lens_q = cfg.seqlen_q > 0 ? std::vector<int>(lens.size(), cfg.seqlen_q) : lens;
    harness::set_varlen(sh, lens_q, lens);
  };
  // A point's shape from every flag but --varlen: `batch` sequences of `s` tokens.
  auto point = [&](int d, bool causal, int batch, int s) {
    Shape sh;
    sh.batch = batch;
    sh.seqlen_q = sh.seqlen_k = s;
    if (cfg.seqlen_q > 0) sh.seqlen_q = cfg.seqlen_q;
    sh.num_splits = cfg.num_splits;
    sh.pack_gqa = cfg.pack_gqa;
    sh.softcap = cfg.softcap;
    if (cfg.page_size > 0) {
      sh.page_size = cfg.page_size;
      sh.seqlens_k_used.assign(size_t(sh.batch), s);
    }
    sh.heads_q = std::max(1, cfg.hidden / d);
    sh.heads_kv = std::max(1, sh.heads_q / cfg.gqa);
    sh.head_dim = d;
    sh.causal = causal;
    sh.window_left = cfg.window_left;
    sh.window_right = causal && cfg.window_right > 0 ? 0 : cfg.window_right;  // causal's right edge
    sh.dtype = cfg.dtype;
    sh.fp8_cache = cfg.fp8_cache;
    return sh;
  };
  if (cfg.varlen == "short") {  // instead of the grid: many short sequences, one batch per head dim
    constexpr int kShortest = 50, kLongest = 2000, kTokens = 65536;
    for (int d : cfg.dims) {
      std::mt19937 rng(7919u + uint32_t(d));
      std::vector<int> lens;
      for (int tokens = 0; tokens < kTokens; tokens += lens.back())
        lens.push_back(std::uniform_int_distribution<int>(kShortest, kLongest)(rng));
      for (bool causal : cfg.causal) {
        Shape sh = point(d, causal, int(lens.size()), *std::max_element(lens.begin(), lens.end()));
        harness::set_varlen(&sh, lens, lens);  // the batch and the longest lengths too
        shapes.push_back(sh);
      }
    }
    return shapes;
  }
  for (int d : cfg.dims)
    for (bool causal : cfg.causal)
      for (int s : cfg.seqlens) {
        Shape sh = point(d, causal, std::max(1, cfg.tokens / s), s);
        packed(&sh, s, d);
        shapes.push_back(sh);
        if (cfg.with_fp8_cache && !sh.fp8_cache) {  // the same shape over an e4m3 cache, right after
          sh.fp8_cache = true;
          shapes.push_back(sh);
        }
      }
  if (cfg.capstone)
    for (int s : {32760, 75600})
      for (int h : {12, 40}) {
        Shape sh;
        sh.batch = 1;
        sh.seqlen_q = sh.seqlen_k = s;
        sh.heads_q = h;
        sh.heads_kv = std::max(1, h / cfg.gqa);
        sh.head_dim = 128;
        sh.window_left = cfg.window_left;
        sh.window_right = cfg.window_right;
        sh.dtype = cfg.dtype;
        packed(&sh, s, sh.head_dim);
        shapes.push_back(sh);
      }
  return shapes;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  if (int rc = parse(argc, argv, &cfg)) return rc == 1 ? 0 : rc;
  const bool windowed = cfg.window_left >= 0 || cfg.window_right >= 0;  // CSV and labels show the window
  const bool varlen = !cfg.varlen.empty();

  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr,
                 "hattn-bench: no CUDA GPU on this machine; the benchmark needs an H200/H100 (sm_90). "
                 "Build and tests still work without one.\n");
    return 3;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr, "hattn-bench: GPU %s is sm_%d%d; the kernels need Hopper (sm_90)\n", prop.name, prop.major,
                 prop.minor);
    return 3;
  }
  const std::string gpu = prop.name;
  std::printf("# hattn-bench on %s (%d SMs), commit %s\n", gpu.c_str(), prop.multiProcessorCount,
              cfg.commit.empty() ? "unknown" : cfg.commit.c_str());
  if (windowed)
    std::printf("# sliding window (%d, %d) on every shape (causal rows keep their right edge at 0); FLOPs count the "
                "visible entries\n",
                cfg.window_left, cfg.window_right);
  if (varlen)
    std::printf("# variable-length batches (%s): each shape's B sequences packed along the rows%s\n", cfg.varlen.c_str(),
                cfg.varlen == "mixed"   ? ", of lengths from [S/4, 7S/4]; S is the longest, FLOPs count the real lengths"
                : cfg.varlen == "short" ? ": one batch per head dim of 50..2000 tokens each, 65536 in all; S is the "
                                          "longest, FLOPs count the real lengths"
                                        : ", all of length S");

  if (cfg.backward)
    std::printf("# the backward (dq, dk, dv) of every shape, after a forward; FLOPs 2.5x the forward's; dq checked "
                "on sampled rows\n");

  double gemm = 0;
  if (cfg.gemm && cfg.dtype == DType::e4m3) {
    std::printf("# --dtype e4m3: no GEMM ceiling (cuBLAS's bf16 one is not FP8's)\n");
  } else if (cfg.gemm) {
    if (!gemm_ceiling(&gemm)) std::fprintf(stderr, "hattn-bench: cuBLAS GEMM ceiling failed\n");
    std::printf("# cuBLAS bf16 GEMM 8192^3: %.1f TFLOP/s (SM clock %d MHz)\n", gemm, sm_clock_mhz());
  }
  if (cfg.warm_l2) std::printf("# --warm-l2: L2 is not flushed before the timed calls\n");

  // Rows are appended as they complete, so an interrupted run still leaves its results.
  std::ofstream csv;
  if (!cfg.csv.empty()) {
    csv.open(cfg.csv);
    if (!csv) {
      std::fprintf(stderr, "hattn-bench: cannot write %s\n", cfg.csv.c_str());
      return 2;
    }
    csv << "commit,gpu,sm_clock_mhz,gemm_tflops,kernel,dtype,head_dim,causal,batch,seqlen_q,seqlen_k,heads_q,"
           "heads_kv,reps,ms,tflops,pct_gemm,max_err,err_budget,check,gbps"
        << (windowed ? ",window_left,window_right" : "") << (varlen ? ",varlen" : "")
        << (cfg.num_splits != 0 ? ",num_splits" : "") << (cfg.pack_gqa.has_value() ? ",pack_gqa" : "")
        << (cfg.settle_seconds > 0 ? ",settle_s" : "") << (cfg.softcap > 0 ? ",softcap" : "")
        << (cfg.warm_l2 ? ",l2" : "") << (cfg.fp8_cache || cfg.with_fp8_cache ? ",kv_dtype" : "") << '\n';
  }

  harness::DeviceBuffer flush;
  const size_t flush_bytes = cfg.warm_l2 ? 0 : size_t(256) << 20;  // > 4x the 60 MB L2
  if (flush_bytes > 0 && !flush.allocate(flush_bytes).ok()) return 4;

  const std::vector<Shape> shapes = grid(cfg);
  std::vector<Row> rows;
  bool all_passed = true;
  const size_t total = shapes.size() * cfg.kernels.size();
  size_t done = 0;
  std::printf("%-9s %-26s %4s %-6s %6s %5s %10s %9s %7s %9s %s\n", "progress", "kernel", "D", "mask", "S", "BxH",
              "ms", "TFLOP/s", "%gemm", "max_err", "check");
  for (const Shape& shape : shapes) {
    harness::Workload w;
    Status ws = harness::make_workload(shape, 1234 + done, &w);
    if (!ws.ok()) {
      std::fprintf(stderr, "hattn-bench: %s: %s\n", harness::describe(shape).c_str(), ws.to_string().c_str());
      return 4;
    }
    const auto sample = harness::sample_rows(shape, cfg.check_rows, 42 + done);
    for (const std::string& kernel : cfg.kernels) {
      ++done;
      Row row;
      row.kernel = kernel;
      row.shape = shape;
      Options options;
      options.kernel = kernel;
      Status s = cfg.backward ? Status::Ok() : check(w.problem, kernel);
      if (cfg.backward) {  // dense or varlen shapes: parse() refuses --page-size with it
        if (!time_backward(cfg, options, w, sample, 1234 + done, flush.get(), flush_bytes, &row)) row.check = "error";
      } else if (!s.ok()) {
        row.check = s.code() == StatusCode::not_supported ? "unsupported" : "error";
      } else if (!harness::poison_outputs(&w).ok()) {
        row.check = "error";
      } else {
        // The checked call doubles as the first timing, which decides how many reps fit.
        cudaEvent_t a, b;
        cudaEventCreate(&a);
        cudaEventCreate(&b);
        cudaEventRecord(a);
        s = forward(w.problem, options);
        cudaEventRecord(b);
        const bool ran = s.ok() && cudaDeviceSynchronize() == cudaSuccess;
        float first_ms = 0;
        cudaEventElapsedTime(&first_ms, a, b);
        cudaEventDestroy(a);
        cudaEventDestroy(b);
        if (!ran) {
          row.check = "error";
          std::fprintf(stderr, "hattn-bench: %s: %s / %s\n", kernel.c_str(), s.to_string().c_str(),
                       cudaGetErrorString(cudaGetLastError()));
        } else {
          const harness::CheckResult r = harness::check_outputs(w, sample);
          row.check = r.passed ? "PASS" : "FAIL";
          row.max_err = r.max_err;
          row.budget = r.budget;
          if (!r.passed) std::fprintf(stderr, "hattn-bench: %s %s: %s\n", kernel.c_str(),
                                      harness::describe(shape).c_str(), r.summary().c_str());
          if (!time_kernel(cfg, w, kernel, flush.get(), flush_bytes, first_ms, &row)) row.check = "error";
          row.tflops = harness::forward_flops(shape) / (row.ms * 1e-3) / 1e12;
          row.gbps = harness::forward_bytes(shape) / (row.ms * 1e-3) / 1e9;
          row.clock = sm_clock_mhz();
        }
      }
      all_passed &= row.check == "PASS" || row.check == "unsupported";
      char progress[32];
      std::snprintf(progress, sizeof progress, "[%zu/%zu]", done, total);
      std::printf("%-9s %-26s %4d %-6s %6d %2dx%-2d %10.3f %9.1f %7.1f %9.2e %s\n", progress, kernel.c_str(),
                  shape.head_dim, shape.causal ? "causal" : "full", shape.seqlen_k, shape.batch, shape.heads_q, row.ms,
                  row.tflops, gemm > 0 ? 100 * row.tflops / gemm : 0.0, row.max_err, row.check.c_str());
      std::fflush(stdout);
      if (csv.is_open()) {
        csv << (cfg.commit.empty() ? "unknown" : cfg.commit) << ',' << gpu << ',' << row.clock << ',' << gemm << ','
            << row.kernel << ',' << dtype_name(shape.dtype) << ',' << shape.head_dim << ',' << int(shape.causal) << ','
            << shape.batch << ',' << shape.seqlen_q << ',' << shape.seqlen_k << ',' << shape.heads_q << ','
            << shape.heads_kv << ',' << row.reps << ',' << row.ms << ',' << row.tflops << ','
            << (gemm > 0 ? 100 * row.tflops / gemm : 0) << ',' << row.max_err << ',' << row.budget << ','
            << row.check << ',' << row.gbps;
        if (windowed) csv << ',' << shape.window_left << ',' << shape.window_right;
        if (varlen) csv << ',' << cfg.varlen;
        if (cfg.num_splits != 0) csv << ',' << cfg.num_splits;
        if (cfg.pack_gqa.has_value()) csv << ',' << (*cfg.pack_gqa ? "on" : "off");
        if (cfg.settle_seconds > 0) csv << ',' << cfg.settle_seconds;
        if (cfg.softcap > 0) csv << ',' << cfg.softcap;
        if (cfg.warm_l2) csv << ",warm";
        if (cfg.fp8_cache || cfg.with_fp8_cache) csv << ',' << (shape.fp8_cache ? "e4m3" : dtype_name(shape.dtype));
        csv << '\n' << std::flush;
      }
      rows.push_back(row);
    }
  }

  if (csv.is_open()) {
    std::printf("# wrote %s\n", cfg.csv.c_str());
  }

  // Compact summary per shape (rows) and kernel (columns): TFLOP/s, or GB/s for decoding shapes
  // (--seqlen-q), which are bound by memory, not by the tensor cores.
  const bool bytes_bound = cfg.seqlen_q > 0;
  if (bytes_bound)
    std::printf("\n# GB/s (%s%s; Q, K, V and O moved once; HBM specified at 3350 on the H100, 4800 on the H200)\n%-22s",
                dtype_name(cfg.dtype),
                cfg.fp8_cache          ? ", e4m3 KV cache"
                : cfg.with_fp8_cache ? "; e4m3: an e4m3 KV cache, then its time over the 16-bit cache's"
                                     : "",
                "shape");
  else
    std::printf("\n# TFLOP/s (%s; cuBLAS GEMM ceiling %.0f)\n%-22s", dtype_name(cfg.dtype), gemm, "shape");
  for (const auto& k : cfg.kernels) std::printf(" %10.10s", k.c_str());
  std::printf("\n");
  for (size_t i = 0; i < rows.size(); i += cfg.kernels.size()) {
    const Shape& s = rows[i].shape;
    char label[64];
    if (s.seqlen_q == s.seqlen_k)
      std::snprintf(label, sizeof label, "D%d %s S%d H%d", s.head_dim, s.causal ? "causal" : "full", s.seqlen_q,
                    s.heads_q);
    else
      std::snprintf(label, sizeof label, "D%d %s Sq%d Sk%d H%d", s.head_dim, s.causal ? "causal" : "full",
                    s.seqlen_q, s.seqlen_k, s.heads_q);
    if (s.heads_kv != s.heads_q) {
      const std::string base = label;  // GQA: query heads:K/V heads
      std::snprintf(label, sizeof label, "%s:%d", base.c_str(), s.heads_kv);
    }
    if (windowed) {
      const std::string base = label;  // the window as a suffix; the column stays 22 wide when it fits
      std::snprintf(label, sizeof label, "%s w%d,%d", base.c_str(), s.window_left, s.window_right);
    }
    if (cfg.with_fp8_cache && s.fp8_cache) {
      const std::string base = label;
      std::snprintf(label, sizeof label, "%s e4m3", base.c_str());
    }
    if (varlen) {
      const std::string base = label;
      std::snprintf(label, sizeof label, "%s varlen", base.c_str());
    }
    std::printf("%-22s", label);
    for (size_t k = 0; k < cfg.kernels.size(); ++k) {
      const Row& r = rows[i + k];
      if (r.check == "PASS") std::printf(" %10.1f", bytes_bound ? r.gbps : r.tflops);
      else std::printf(" %10s", r.check.c_str());
    }
    // --with-fp8-cache times each shape over the 16-bit cache, then the e4m3 one: the row before.
    if (cfg.with_fp8_cache && s.fp8_cache && i >= cfg.kernels.size()) {
      for (size_t k = 0; k < cfg.kernels.size(); ++k) {
        const Row& e4m3 = rows[i + k];
        const Row& wide = rows[i - cfg.kernels.size() + k];
        if (e4m3.check == "PASS" && wide.check == "PASS" && wide.ms > 0) std::printf("  %.2fx", e4m3.ms / wide.ms);
      }
    }
    std::printf("\n");
  }
  if (!all_passed) std::printf("# SOME CHECKS FAILED\n");
  return all_passed ? 0 : 1;
}
