// One sequence of a batch as a kernel sees it: its lengths and where its rows lie. Shared by
// the final forward kernel and the backward kernels.
#pragma once

#include "params.h"

namespace hattn {

// A sequence's lengths, the rows before its first query and key, and the batch coordinate of
// its rows. A variable-length batch packs its sequences along the rows of one [1, total, H, D]
// tensor; otherwise sequence b is batch entry b. With seqlens_k it uses only its first
// seqlens_k[b] keys (a paged cache always has seqlens_k; its pages are found per tile, from
// the block table); with leftpad_k its keys start leftpad_k[b] rows further on; with
// kv_batch_idx its keys are those of cache entry kv_batch_idx[b].
struct Sequence {
  int seqlen_q, seqlen_k;
  int q_start, k_start;
  int batch_coord;  // q and out
  int kv_entry;     // k and v: the batch coordinate of a dense cache, or the block table's row
};

// Sequence `batch` of `p`; with kRuntimeBounds false, the dense batch entry (no reads).
template <bool kRuntimeBounds>
__device__ __forceinline__ Sequence sequence_of(const FeatureParams& p, int batch) {
  Sequence seq = {p.seqlen_q, p.seqlen_k, 0, 0, batch, batch};
  if (kRuntimeBounds && p.cu_seqlens_q != nullptr) {
    // Clamped to the tensors: offsets that break the caller's promise cannot send a load or a
    // store outside them.
    const int q_start = min(max(__ldg(p.cu_seqlens_q + batch), 0), p.total_q);
    const int q_end = min(max(__ldg(p.cu_seqlens_q + batch + 1), q_start), p.total_q);
    const int k_start = min(max(__ldg(p.cu_seqlens_k + batch), 0), p.total_k);
    const int k_end = min(max(__ldg(p.cu_seqlens_k + batch + 1), k_start), p.total_k);
    seq = {q_end - q_start, k_end - k_start, q_start, k_start, 0, 0};
  }
  if (kRuntimeBounds && p.seqlens_k != nullptr) seq.seqlen_k = min(max(__ldg(p.seqlens_k + batch), 0), seq.seqlen_k);
  if (kRuntimeBounds && p.leftpad_k != nullptr) {
    const int pad = min(max(__ldg(p.leftpad_k + batch), 0), seq.seqlen_k);
    seq.k_start += pad;
    seq.seqlen_k -= pad;
  }
  if (kRuntimeBounds && p.kv_batch_idx != nullptr)
    seq.kv_entry = min(max(__ldg(p.kv_batch_idx + batch), 0), p.kv_batch - 1);
  return seq;
}

}  // namespace hattn
