// FP8 (e4m3) forward: two kernels of one build on the same inputs, interleaved per round
// (A B B A), L2 flushed before each call, CUDA-event medians; the V transpose is part of the
// call. Random e4m3 codes (no NaN), descales 1/8..1/2, bf16 out.
// Usage: fp8_ab [KERNEL_A KERNEL_B]   (default 16_coalesced_store fwd_sm90); prints a table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "hattn/hattn.h"

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e));                \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

int main(int argc, char** argv) {
  const std::string a = argc > 2 ? argv[1] : "16_coalesced_store", b = argc > 2 ? argv[2] : "fwd_sm90";
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::printf("D    S      causal  %-20s %-20s  A/B\n", (a + " us").c_str(), (b + " us").c_str());
  for (int d : {64, 128})
    for (int s : {1024, 2048, 4096, 8192, 16384})
      for (bool causal : {false, true}) {
        const int batch = 16384 / s, heads = 2048 / d;
        const size_t elems = size_t(batch) * s * heads * d;
        std::vector<uint8_t> host(elems);
        std::mt19937 rng(uint32_t(d * 100000 + s + causal));
        for (auto& x : host) {
          x = uint8_t(rng());
          if ((x & 0x7F) == 0x7F) x ^= 1;  // 0x7F and 0xFF are NaN
        }
        void *q, *k, *v, *out;
        float *lse, *descale;
        CHECK(cudaMalloc(&q, elems));
        CHECK(cudaMalloc(&k, elems));
        CHECK(cudaMalloc(&v, elems));
        CHECK(cudaMalloc(&out, elems * 2));
        CHECK(cudaMalloc(&lse, size_t(batch) * heads * s * 4));
        CHECK(cudaMalloc(&descale, size_t(batch) * heads * 4));
        CHECK(cudaMemcpy(q, host.data(), elems, cudaMemcpyHostToDevice));
        std::reverse(host.begin(), host.end());
        CHECK(cudaMemcpy(k, host.data(), elems, cudaMemcpyHostToDevice));
        std::rotate(host.begin(), host.begin() + elems / 3, host.end());
        CHECK(cudaMemcpy(v, host.data(), elems, cudaMemcpyHostToDevice));
        std::vector<float> scales(size_t(batch) * heads);
        for (auto& x : scales) x = 0.125f + 0.375f * float(rng() % 1000) / 1000.f;
        CHECK(cudaMemcpy(descale, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
        hattn::AttentionProblem p;
        p.dtype = hattn::DType::e4m3;
        p.batch = batch;
        p.seqlen_q = p.seqlen_k = s;
        p.heads_q = p.heads_kv = heads;
        p.head_dim = d;
        p.causal = causal;
        p.q = q;
        p.k = k;
        p.v = v;
        p.out = out;
        p.lse = lse;
        p.q_strides = p.k_strides = p.v_strides = p.out_strides = hattn::contiguous_bshd(s, heads, d);
        p.q_descale = p.k_descale = p.v_descale = descale;
        std::vector<float> times[2];
        const std::string names[2] = {a, b};
        for (int round = 0; round < 2 + 40; ++round)
          for (int i = 0; i < 2; ++i) {
            const int which = (round % 2 == 0) ? i : 1 - i;  // A B, then B A
            hattn::Options o;
            o.kernel = names[which];
            CHECK(cudaMemsetAsync(flush, round & 0xFF, flush_bytes));
            CHECK(cudaEventRecord(start));
            const hattn::Status st = hattn::forward(p, o);
            CHECK(cudaEventRecord(stop));
            if (!st.ok()) {
              std::fprintf(stderr, "%s: %s\n", names[which].c_str(), st.to_string().c_str());
              return 1;
            }
            CHECK(cudaEventSynchronize(stop));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (round >= 2) times[which].push_back(ms * 1000.f);  // two rounds of warm-up
          }
        for (auto& t : times) std::sort(t.begin(), t.end());
        const float ta = times[0][times[0].size() / 2], tb = times[1][times[1].size() / 2];
        std::printf("%-4d %-6d %-7s %-20.1f %-20.1f  %.3f\n", d, s, causal ? "yes" : "no", ta, tb, ta / tb);
        cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(out), cudaFree(lse), cudaFree(descale);
      }
  return 0;
}
