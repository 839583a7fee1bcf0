// Attention on the CPU: an fp64 reference, and a same-precision emulation that sets the
// error budget a GPU kernel is held to (FlashAttention's testing rule: a kernel's error
// against fp64 may be about twice that of a straightforward low-precision implementation).
#pragma once

#include <cstdint>
#include <vector>

#include "hattn/hattn.h"

namespace hattn::ref {

// bf16/fp16 bit patterns <-> float, round to nearest even; e4m3 in the low byte (saturated to
// +-448, as the kernels' conversions do; NaN stays NaN).
uint16_t float_to_bits(float x, DType dtype);
float bits_to_float(uint16_t bits, DType dtype);

// A problem whose tensors live on the host as float (values already rounded to the dtype),
// in BSHD layout with the given element strides (last dim contiguous).
struct HostProblem {
  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  const float* q = nullptr;  // [B, Sq, Hq, D]
  Strides q_strides;
  const float* k = nullptr;  // [B, Sk, Hkv, D]
  Strides k_strides;
  const float* v = nullptr;  // [B, Sk, Hkv, D]
  Strides v_strides;
  float scale = 0.f;
  float softcap = 0.f;  // as in AttentionProblem: scores s become softcap * tanh(s / softcap); 0 off
  bool causal = false;
  int window_left = -1, window_right = -1;  // as in AttentionProblem; -1: that side open
};

// The keys query i sees: [*first, *last), empty when the mask hides every key.
void visible_key_range(const HostProblem& p, int i, int* first, int* last);

// One output row in fp64: out[0..D) and the natural-log LSE (-inf, and a zero row, when the
// mask hides every key from query i).
void attention_row_fp64(const HostProblem& p, int b, int h, int i, double* out, double* lse);

// One output row the way a plain bf16/fp16 implementation computes it: fp32 scores and sums,
// P rounded to `dtype` before the PV product (e4m3: 2^8 P, as the FP8 kernel keeps it), the
// output rounded to output_dtype(dtype).
void attention_row_lowp(const HostProblem& p, DType dtype, int b, int h, int i, float* out, float* lse);

// How far Hopper's FP8 wgmma may move a score: its adder keeps about 14 bits, not fp32's 24
// (DeepSeek-V3's report measured it; FlashAttention-3's FP8 shares it). Each k32 step of the
// head dimension adds into a running sum no larger than scale |q| |k| (Cauchy-Schwarz over the
// dimensions summed so far), losing up to 2^-13 of it; the losses of the ceil(D / 32) steps add
// up (truncation keeps one sign) and move the LSE as much. So: ceil(D / 32) 2^-13 scale times the
// largest row norms of q and k. attention_row_lowp sums in fp32, so tests of the FP8 forward
// add this to the LSE's budget.
double fp8_score_error(const HostProblem& p);

// How far the same adder may move an output where P V adds into O inside the tensor cores
// (the FP8 forward at D = 256, and FlashAttention-3's FP8 at every D): each add of a k32 step
// keeps about 14 bits of O's running sum, which in O's units is at most max |v|; the losses
// of a sweep's ceil(Sk / 32) steps add up (truncation keeps one sign). attention_row_lowp sums
// in fp32, so tests of that forward add this to the output's budget.
double fp8_pv_sum_error(const HostProblem& p);

// Whole problem in fp64: out [B, Sq, Hq, D] and lse [B, Hq, Sq], both contiguous.
void attention_fp64(const HostProblem& p, std::vector<double>* out, std::vector<double>* lse);

// The gradients of attention in fp64, for a loss L with dL/d out = dout ([B, Sq, Hq, D],
// element strides dout_strides). dq [B, Sq, Hq, D], dk and dv [B, Sk, Hkv, D], contiguous; a
// K/V head's gradients sum over its query heads (GQA). A row that sees no key contributes
// nothing. With P = softmax(scale Q K^T + mask), dS = P * (dO V^T - rowsum(dO * O)):
// dq = scale dS K, dk = scale dS^T Q, dv = P^T dO.
void attention_backward_fp64(const HostProblem& p, const float* dout, const Strides& dout_strides,
                             std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv);

// Row (b, h, i) of dq alone (dq[0..D)), as attention_backward_fp64 computes it: O(Sk * D) work,
// for checking a sample of rows of a large problem.
void attention_backward_dq_row_fp64(const HostProblem& p, const float* dout, const Strides& dout_strides, int b, int h,
                                    int i, double* dq);

}  // namespace hattn::ref
