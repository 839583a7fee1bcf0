// The masks: which K/V tiles a query block sweeps, and which scores of a tile are hidden, under
// the causal mask (aligned bottom-right), a sliding window, the sequence's keys (Sk, varlen,
// seqlens_k) and softcapping, applied to the scores before the softmax.
#pragma once

#include <cmath>

#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../common/tile_scheduler.cuh"
#include "../ptx/ex2.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// kRuntimeBounds: each item reads its sequence's bounds at run time (varlen, seqlens_k, a
// cache); kWindow: a sliding window, whose edges bound the sweeps and masks. pack_shift: GQA
// packing, under which packed row r is query position r >> pack_shift.
template <int kBlockM, int kBlockN, bool kRuntimeBounds, bool kWindow>
struct Mask {
  // GQA packing: only the run-time bounds kernels without a window pack (the shifts in the
  // window's masks cost its kernels 6-15% at D = 64 and 128, measured at 6107497); elsewhere
  // the shift is a compile-time 0.
  static constexpr bool kPacks = kRuntimeBounds && !kWindow;
  const FeatureParams& p;
  int packed_shift;  // p.pack_shift, read once
  __device__ __forceinline__ int shift() const { return kPacks ? packed_shift : 0; }

  // K/V tiles [first, last) query block `m_block` of `seq` sweeps: all of them, or those
  // between the edges of the causal mask or the sliding window (none when no row sees a key,
  // or when the block lies past a short sequence's queries in a variable-length batch).
  __device__ __forceinline__ KvTileRange kv_tiles(int m_block, const Sequence& seq) const {
    const int pack_shift = shift();
    if (kRuntimeBounds && m_block * kBlockM >= seq.seqlen_q << pack_shift) return {0, 0};
    const int block_positions = kBlockM >> pack_shift;  // query positions per block
    if constexpr (kWindow) {
      return masked_kv_tiles(m_block, block_positions, kBlockN, seq.seqlen_q, seq.seqlen_k, p.window_left,
                             p.window_right);
    } else {
      return {0, p.causal ? causal_kv_tiles(m_block, block_positions, kBlockN, seq.seqlen_q, seq.seqlen_k)
                          : (seq.seqlen_k + kBlockN - 1) / kBlockN};
    }
  }

  // Softcapping: s -> tanh(s scale / softcap) (the exponent's scale is then the softcap),
  // before the mask, whose -inf must stay -inf. The run-time bounds kernels only. `factor`
  // scales the scores first: an FP8 KV cache's k descale, which must act inside the tanh.
  template <int kScores>
  __device__ __forceinline__ void softcap(float (&s)[kScores], float factor = 1.f) const {
    if constexpr (kRuntimeBounds) {
      if (p.softcap_scale > 0.f) {
        const float scale = p.softcap_scale * factor;
#pragma unroll
        for (int i = 0; i < kScores; ++i) s[i] = ptx::tanh_approx_f32(s[i] * scale);
      }
    }
  }

  // Masked entries to -inf (only tiles crossing Sk or an edge of the mask: the diagonal
  // under causal, window_right keys past it, or window_left keys before it). The warp's
  // first row has the nearest right edge, its last row (+ 15) the farthest left edge.
  // `s` is a warp's m64nN accumulator tile from key n_start: thread (group, tig) holds rows
  // row0, row0 + 8 (packed rows), columns 2 tig, 2 tig + 1 of each n8 tile.
  template <int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kNTiles * 4], int n_start, int warp_first_row, int row0, int tig,
                                        int causal_offset, const Sequence& seq) const {
    const int pack_shift = shift();
    const int warp_diagonal = (warp_first_row >> pack_shift) + causal_offset;
    bool need_mask;
    if constexpr (kWindow)
      need_mask = n_start + kBlockN > seq.seqlen_k ||
                  (p.window_right >= 0 && n_start + kBlockN - 1 > warp_diagonal + p.window_right) ||
                  (p.window_left >= 0 && n_start < warp_diagonal + 15 - p.window_left);
    else
      need_mask = n_start + kBlockN > seq.seqlen_k || (p.causal && n_start + kBlockN - 1 > warp_diagonal);
    if (need_mask) {
      if constexpr (kWindow) {
        // Each of the thread's two rows sees keys [first, last]: the window's edges (an open
        // side: no edge) clipped to [0, Sk). Worked out once per row, then two compares an
        // entry without branches (per entry, the edges' conditions made ptxas branch, and spill
        // 152 bytes at D = 64). A window wider than the keys is clipped first, which changes no
        // edge (the diagonal lies in [-Sq, Sk)) and keeps the sums inside int.
        const int left = min(p.window_left, seq.seqlen_k), right = min(p.window_right, seq.seqlen_k + seq.seqlen_q);
        int first[2], last[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int diagonal = ((row0 + 8 * r) >> pack_shift) + causal_offset;
          first[r] = left >= 0 ? max(diagonal - left, 0) : 0;
          last[r] = right >= 0 ? min(diagonal + right, seq.seqlen_k - 1) : seq.seqlen_k - 1;
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n_start + nt * 8 + 2 * tig + e % 2;
            if ((col < first[e / 2]) | (col > last[e / 2])) s[nt * 4 + e] = -INFINITY;
          }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n_start + nt * 8 + 2 * tig + e % 2;
            const int row = (row0 + e / 2 * 8) >> pack_shift;  // the query position
            const bool hidden = col >= seq.seqlen_k || (p.causal && col > row + causal_offset);
            if (hidden) s[nt * 4 + e] = -INFINITY;
          }
      }
    }
  }
};
#endif

}  // namespace hattn::fwd
