// The problem as the kernels see it: plain values, usable on host and device.
#pragma once

#include <cstdint>

#include "hattn/hattn.h"

namespace hattn {

// The base contract as the kernels see it (dense batches, causal masks, GQA): all the lineage's
// forward steps read.
struct AttentionParams {
  const void* q;  // [B, Sq, Hq, D]
  const void* k;  // [B, Sk, Hkv, D]
  const void* v;  // [B, Sk, Hkv, D]
  void* out;      // [B, Sq, Hq, D]
  float* lse;     // [B, Hq, Sq] or null

  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t out_batch_stride, out_seq_stride, out_head_stride;

  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  int heads_per_kv;   // heads_q / heads_kv
  float scale;        // softmax scale; with softcapping, the softcap (the tanh's outputs' scale)
  bool causal;
  int causal_offset;  // seqlen_k - seqlen_q: query i sees keys j <= i + causal_offset
};

// The base and the features: what the production forward and the backward kernels read.
struct FeatureParams : AttentionParams {
  // Sliding window: query i sees keys j >= i + causal_offset - window_left and
  // j <= i + causal_offset + window_right; -1 leaves that side open. Causal is window_right = 0.
  int window_left, window_right;
  // Variable-length batch (null otherwise): sequence b's rows are cu_seqlens_q[b] ..
  // cu_seqlens_q[b + 1] - 1 of total_q (keys likewise), and seqlen_q, seqlen_k are the
  // longest lengths.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int total_q, total_k;
  // Keys in use per sequence and a paged cache (null otherwise): see AttentionProblem.
  const int32_t* seqlens_k;
  const int32_t* block_table;
  int max_pages_per_seq, num_pages, page_size;
  // Cache entries per sequence and left padding (null otherwise): see AttentionProblem.
  const int32_t* kv_batch_idx;
  int kv_batch;
  const int32_t* leftpad_k;
  // Split-KV (the production forward): with splits > 1 each item computes one part of its
  // block's K/V tiles and writes fp32 partial results, O (normalized by the part's own sum) to
  // o_partial [splits][B][Hq][rows][D] and its LSE to lse_partial [splits][B][Hq][rows], rows =
  // seqlen_q (B = 1 and rows = total_q for a varlen batch); a second kernel combines them.
  int splits;
  float* o_partial;
  float* lse_partial;
  // GQA packing (the production forward): with pack_shift = log2(heads_per_kv) > 0, a work
  // item's head is a K/V head and its rows are (query position, query head of the group) pairs,
  // row i being position i >> pack_shift, head (kv_head << pack_shift) + i % group. Rows of the
  // same K/V tile then share one sweep. 0 when off.
  int pack_shift;
  // FP8 inputs (the production forward): fp32 [B][Hkv] dequantization scales of q, k and v, or
  // null for 1.
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  // Softcapping: scores s become tanh(s * softcap_scale), with softcap_scale = softmax scale /
  // softcap, and `scale` is the softcap; 0 without softcapping.
  float softcap_scale;
};

// The base contract's fields of a validated problem.
inline AttentionParams make_params(const AttentionProblem& p) {
  AttentionParams a{};
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.out = p.out;
  a.lse = p.lse;
  a.q_batch_stride = p.q_strides.batch;
  a.q_seq_stride = p.q_strides.seq;
  a.q_head_stride = p.q_strides.head;
  a.k_batch_stride = p.k_strides.batch;
  a.k_seq_stride = p.k_strides.seq;
  a.k_head_stride = p.k_strides.head;
  a.v_batch_stride = p.v_strides.batch;
  a.v_seq_stride = p.v_strides.seq;
  a.v_head_stride = p.v_strides.head;
  a.out_batch_stride = p.out_strides.batch;
  a.out_seq_stride = p.out_strides.seq;
  a.out_head_stride = p.out_strides.head;
  a.batch = p.batch;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.head_dim = p.head_dim;
  a.heads_per_kv = p.heads_q / p.heads_kv;
  a.scale = p.softcap > 0.f ? p.softcap : p.scale();
  a.causal = p.causal;
  a.causal_offset = p.seqlen_k - p.seqlen_q;
  return a;
}

// Every field of a validated problem.
inline FeatureParams make_feature_params(const AttentionProblem& p) {
  FeatureParams a{};
  static_cast<AttentionParams&>(a) = make_params(p);
  a.softcap_scale = p.softcap > 0.f ? p.scale() / p.softcap : 0.f;
  // An edge that binds no row is dropped (-1), which also keeps the kernels' index sums small:
  // the left edge of row Sq - 1 is at Sk - 1 - window_left, the right edge of row 0 at
  // Sk - Sq + window_right. A variable-length batch's seqlen_q and seqlen_k are promised longest
  // lengths, so its bounds are the tensors' rows, which no sequence outgrows: an understated
  // max_seqlen then cannot drop an edge that binds.
  const int keys = p.is_varlen() ? p.total_k : p.seqlen_k, rows = p.is_varlen() ? p.total_q : p.seqlen_q;
  a.window_left = p.window_left >= keys ? -1 : p.window_left;
  a.window_right = p.causal ? 0 : p.window_right >= rows ? -1 : p.window_right;
  a.cu_seqlens_q = p.cu_seqlens_q;
  a.cu_seqlens_k = p.cu_seqlens_k;
  a.total_q = p.total_q;
  a.total_k = p.total_k;
  a.seqlens_k = p.seqlens_k;
  a.block_table = p.block_table;
  a.max_pages_per_seq = p.max_pages_per_seq;
  a.num_pages = p.num_pages;
  a.page_size = p.page_size;
  a.kv_batch_idx = p.kv_batch_idx;
  a.kv_batch = p.kv_batch;
  a.leftpad_k = p.leftpad_k;
  a.splits = 1;  // the production forward's launch decides
  a.o_partial = nullptr;
  a.lse_partial = nullptr;
  a.pack_shift = 0;  // likewise
  a.q_descale = p.q_descale;
  a.k_descale = p.k_descale;
  a.v_descale = p.v_descale;
  return a;
}

}  // namespace hattn
