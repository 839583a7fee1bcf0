// A block's P^T and dS^T from its S^T and dP^T in registers (the consumers' step, consumer.cuh):
// softcapping, the masks (a tail past Sq or Sk, the causal diagonal, a window edge; varlen: the
// sequence's keys) where the block needs them, and exp2 of the scores with the scale folded in.
#pragma once

#include "../../common/backward_common.cuh"
#include "../../ptx/ex2.cuh"
#include "config.h"
#include "shared_storage.cuh"
#include "work.cuh"

namespace hattn::bwd {

// s (S^T) becomes P^T and dp (dP^T) becomes dS^T = P^T (dP^T - delta), for the accumulators of
// a thread of the warpgroup whose keys start at n_wg: element e of n8 tile nt is key
// key0 + 8 (e / 2), query m0 + 8 nt + 2 t + e % 2 (of the sequence). The block's LSE (log2
// units) and delta per query are in `stage` of shared memory; with kViewerMasks, `viewers` are
// the queries that see the thread's keys.
template <typename T, int D, bool kVarlen, int N>
__device__ __forceinline__ void probabilities_and_score_grads(float (&s)[N], float (&dp)[N],
                                                              const SharedStorage<T, D, kVarlen>& smem, int stage,
                                                              const FeatureParams& f, const Sequence& seq, int m0,
                                                              int n_wg, int key0, const KeyViewers& viewers,
                                                              int tig, float scale_log2) {
  using Storage = SharedStorage<T, D, kVarlen>;
  constexpr int kQTiles = N / 4;  // n8 column tiles of S^T and dP^T
  constexpr int kRows = Storage::kRows;
  // Columns 8 nt + 2 t and + 1 of the block: their LSE and delta as one 8-byte load each.
  auto column_stats = [&](int nt, float2* lse, float2* delta) {
    *lse = *reinterpret_cast<const float2*>(&smem.lse_log2[stage][8 * nt + 2 * tig]);
    *delta = *reinterpret_cast<const float2*>(&smem.delta[stage][8 * nt + 2 * tig]);
  };
  // P^T and dS^T. Masked where the tile is not wholly visible: a tail past Sq or Sk (varlen:
  // the sequence's), the causal diagonal or a window edge (visible_keys is monotone in the
  // query, so the block's first and last rows decide). With viewer masks decided before the
  // softcap, else after it: the other order spilled (D = 64 dense, D = 128 varlen).
  bool need_mask;
  if constexpr (Storage::kViewerMasks) {
    int first_lo, last_lo, first_hi, last_hi;
    visible_keys<kVarlen>(f, seq, m0, &first_lo, &last_lo);
    visible_keys<kVarlen>(f, seq, m0 + kRows - 1, &first_hi, &last_hi);
    need_mask = m0 + kRows > seqlen_q_of<kVarlen>(f, seq) || n_wg + 64 > seqlen_k_of<kVarlen>(f, seq) ||
                last_lo < n_wg + 64 || first_hi > n_wg;
  }
  // Softcapping, before the shared loops below: s -> t and dP for the capped dS (softcap_score_and_dp).
  if (f.softcap_scale > 0.f) {
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
      float2 lse, delta;
      column_stats(nt, &lse, &delta);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        softcap_score_and_dp(&s[nt * 4 + e], &dp[nt * 4 + e], e % 2 ? delta.y : delta.x, f.softcap_scale);
    }
  }

  // At D = 128, from the block's first and last rows.
  if constexpr (!Storage::kViewerMasks) {
    int first_lo, last_lo, first_hi, last_hi;
    visible_keys<kVarlen>(f, seq, m0, &first_lo, &last_lo);
    visible_keys<kVarlen>(f, seq, m0 + kRows - 1, &first_hi, &last_hi);
    need_mask = m0 + kRows > seqlen_q_of<kVarlen>(f, seq) || n_wg + 64 > seqlen_k_of<kVarlen>(f, seq) ||
                last_lo < n_wg + 64 || first_hi > n_wg;
  }

  if (need_mask) {
    // Each of the thread's two keys is seen by one run of the block's rows (the masks are
    // monotone). With kViewerMasks the CTA's viewers say which; else (D = 128) this step's,
    // found here (held across the loop they cost 4-10% there) as bounds on the element's row
    // offset 8 nt + e % 2 from m0 + 2 t, a constant, so two compares an element. Worked out per
    // element from visible_keys, a masked step issued about three times the instructions of an
    // unmasked one. (D = 64 with bounds like these spilled.)
    [[maybe_unused]] KeyViewers rows;
    if constexpr (!Storage::kViewerMasks) rows = offset_viewers(viewers_of<kVarlen>(f, seq, key0), m0 + 2 * tig);
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
      float2 lse, delta;
      column_stats(nt, &lse, &delta);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bool visible;
        if constexpr (Storage::kViewerMasks) {
          const int i = m0 + 8 * nt + 2 * tig + e % 2;
          visible = i >= viewers.first[e / 2] && i < viewers.last[e / 2];
        } else {
          const int row = 8 * nt + e % 2;
          visible = row >= rows.first[e / 2] && row < rows.last[e / 2];
        }
        // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
        const float pv =
            visible ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -(e % 2 ? lse.y : lse.x))) : 0.f;
        s[nt * 4 + e] = pv;
        // Varlen: a select too, for a key past the sequence's may have dP^T = inf or NaN from V.
        if constexpr (kVarlen)
          dp[nt * 4 + e] = visible ? pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x)) : 0.f;
        else
          dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x));
      }
    }
  } else {
    // Every entry visible: every query of the block sees a key, so its LSE is finite.
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt) {
      float2 lse, delta;
      column_stats(nt, &lse, &delta);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -(e % 2 ? lse.y : lse.x)));
        s[nt * 4 + e] = pv;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x));
      }
    }
  }
}

}  // namespace hattn::bwd
