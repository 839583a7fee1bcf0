// The consumers' last act: dK and dV out of registers. Without GQA a CTA owns its keys'
// gradients and stores them by TMA through shared memory (over K and V); a packed batch's too,
// except a box that runs past its sequence's end (into the next sequence's rows): that
// warpgroup stores its rows from registers. With GQA the CTAs add fp32 rows into the sums that
// run_backward zeroed and converts afterwards, by TMA reductions. And the zeros of a CTA whose
// keys no query sees.
#pragma once

#include <cuda.h>

#include "../../common/backward_common.cuh"
#include "../../common/fragment.cuh"
#include "../../ptx/named_barrier.cuh"
#include "../../ptx/smem.cuh"
#include "../../ptx/tma.cuh"
#include "../../ptx/turns.cuh"
#include "config.h"
#include "shared_storage.cuh"

namespace hattn::bwd {

// This thread's dK (times `k_scale`) and dV rows straight from registers (keys key0 and key0 + 8
// of the sequence, those below its seqlen_k; columns 8 dt + 2 t, + 1), where a TMA box cannot
// go: a CTA whose keys no query sees (dk, dv null: zeros; every other path leaves by TMA, and
// fp32 sums (GQA) are zeroed before the kernel), and a packed batch's box past its sequence's end.
template <typename T, int D, int N = 1>
__device__ __forceinline__ void store_dk_dv_rows(const BackwardParams& p, const Sequence& seq, int head_kv, int key0,
                                                 int tig, const float (*dk)[N] = nullptr,
                                                 const float (*dv)[N] = nullptr, float k_scale = 1.f) {
  constexpr int kDTiles = D / 8;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= seq.seqlen_k) continue;
    // 4-byte stores: the gradients' rows are 16-byte aligned (validate_backward_arguments).
    const int64_t row = int64_t(seq.k_start) + key;
    T* dk_row = static_cast<T*>(p.dk) + seq.batch_coord * p.dk_batch_stride + row * p.dk_seq_stride +
                head_kv * p.dk_head_stride;
    T* dv_row = static_cast<T*>(p.dv) + seq.batch_coord * p.dv_batch_stride + row * p.dv_seq_stride +
                head_kv * p.dv_head_stride;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      uint32_t k2 = frag::pack2<T>(0.f, 0.f), v2 = k2;
      if constexpr (N > 1) {
        k2 = frag::pack2<T>(k_scale * (*dk)[dt * 4 + 2 * r], k_scale * (*dk)[dt * 4 + 2 * r + 1]);
        v2 = frag::pack2<T>((*dv)[dt * 4 + 2 * r], (*dv)[dt * 4 + 2 * r + 1]);
      }
      *reinterpret_cast<uint32_t*>(dk_row + 8 * dt + 2 * tig) = k2;
      *reinterpret_cast<uint32_t*>(dv_row + 8 * dt + 2 * tig) = v2;
    }
  }
}

// dK (scaled) and dV of the warpgroup's 64 keys (from n_wg) into dK and dV, through the K and V
// tiles; a packed batch's warpgroup whose keys end inside its box, from registers (the box's
// other rows are the next sequence's). Every consumer thread calls it after its last wgmma.
template <typename T, int D, bool kVarlen, int N>
__device__ __forceinline__ void store_dk_dv(SharedStorage<T, D, kVarlen>& smem, const float (&dk)[N],
                                            const float (&dv)[N], const CUtensorMap& dk_map, const CUtensorMap& dv_map,
                                            const BackwardParams& p, const Sequence& seq, int warpgroup, int n_wg,
                                            int head_kv, int key0, float grad_scale) {
  constexpr int kDTiles = D / 8;  // n8 column tiles of dK and dV
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;
  // Warpgroup-uniform: a packed batch's box that would run into the next sequence.
  const bool by_rows = kVarlen && n_wg + 64 > seq.seqlen_k;
  if (by_rows) store_dk_dv_rows<T, D, N>(p, seq, head_kv, key0, tig, &dk, &dv, grad_scale);
  // dK and dV written once, through shared memory. WAR: every consumer's last dQ wgmma (each
  // read all 128 keys of K) has completed before either warpgroup overwrites K's tile; V's
  // last reads were the last step's dP^T.
  ptx::bar_sync(kDsBarrier, kConsumerThreads);
  // Rows 64 wg + 16 warp + g (+ 8) of the tiles, columns 8 dt + 2 t: 16-byte chunk dt % 8 of
  // column block dt / 8, stored at chunk ^ (row % 8) = chunk ^ g (the TMA box's swizzle).
  const int row = 64 * warpgroup + 16 * warp_in_wg + group;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int at = (row + 8 * r) * 64 + ((dt % 8 ^ group) << 3) + 2 * tig;
      *reinterpret_cast<uint32_t*>(&smem.k[dt / 8][at]) =
          frag::pack2<T>(grad_scale * dk[dt * 4 + 2 * r], grad_scale * dk[dt * 4 + 2 * r + 1]);
      *reinterpret_cast<uint32_t*>(&smem.v[dt / 8][at]) = frag::pack2<T>(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]);
    }
  ptx::fence_proxy_async_shared_cta();               // the stores above, before the TMA copies (async proxy) read them
  ptx::bar_sync(kDkDvTileBarrier + warpgroup, 128);  // the warpgroup's 64 rows are in the tiles
  if (threadIdx.x % 128 == 0 && !by_rows) {
    // Dense: rows past Sk are not written (the box's out-of-bounds part).
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) {
      ptx::cp_async_bulk_tensor_4d_s2g(&dk_map, cb * 64, seq.k_start + n_wg, head_kv, seq.batch_coord,
                                       smem.k[cb] + warpgroup * 64 * 64);
      ptx::cp_async_bulk_tensor_4d_s2g(&dv_map, cb * 64, seq.k_start + n_wg, head_kv, seq.batch_coord,
                                       smem.v[cb] + warpgroup * 64 * 64);
    }
    ptx::cp_async_bulk_commit_group();
  }
  // Shared memory must outlive the copies and reductions that read it.
  if (threadIdx.x % 128 == 0) ptx::cp_async_bulk_wait_group_read<0>();
}

// dK (scaled) and dV of the warpgroup's 64 keys added into the fp32 sums of the K/V head
// (dk_map, dv_map), from fp32 tiles over K and V (warpgroup 0) or Q and dO (warpgroup 1): 64 x
// 32 boxes of 128-byte rows, swizzled like TMA's.
// The deterministic backward with GQA (p.dkdv_turns): a group's query heads add in turn.
template <typename T, int D, bool kVarlen, int N>
__device__ __forceinline__ void add_dk_dv(SharedStorage<T, D, kVarlen>& smem, const float (&dk)[N],
                                          const float (&dv)[N], const CUtensorMap& dk_map, const CUtensorMap& dv_map,
                                          const BackwardParams& p, const Sequence& seq, int warpgroup, int n_wg,
                                          int head, int head_kv, int batch, int key0, float grad_scale) {
  constexpr int kDTiles = D / 8;  // n8 column tiles of dK and dV
  // The sums of the K/V head (a GQA group's query heads add up; a packed batch's rows), by TMA
  // reductions from fp32 tiles. WAR: both warpgroups' last wgmmas (which read K, V, Q and dO)
  // have completed, and every stage the producer filled has been consumed.
  ptx::bar_sync(kDsBarrier, kConsumerThreads);
  static_assert(sizeof(smem.k) >= 64 * D * sizeof(float) && sizeof(smem.q) >= 64 * D * sizeof(float),
                "a warpgroup's fp32 dK (and dV) rows fit over K (V) and over Q (dO)");
  float* const dk_tiles = reinterpret_cast<float*>(warpgroup == 0 ? smem.k[0] : smem.q[0][0]);
  float* const dv_tiles = reinterpret_cast<float*>(warpgroup == 0 ? smem.v[0] : smem.dout[0][0]);
  // Columns 8 nt + 2 t (+ 1) of rows 16 warp + g (+ 8): box nt / 4, 16-byte chunk 2 (nt % 4) +
  // t / 2 of the row, stored at chunk ^ (row % 8) = chunk ^ g: the lane's nt = 0 float offset
  // XOR 8 (nt % 4).
  const int lane = int(threadIdx.x) % 32, group = lane / 4, tig = lane % 4;
  const int box_lane = (16 * (int(threadIdx.x) % 128 / 32) + group) * 32 + ((tig / 2 ^ group) << 2) + 2 * (tig % 2);
#pragma unroll
  for (int nt = 0; nt < kDTiles; ++nt) {
    const int at = nt / 4 * 64 * 32 + (box_lane ^ (nt % 4) << 3);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Varlen: keys past the sequence (the next sequence's rows) get exact zeros, not 0 x Q.
      if constexpr (kVarlen) {
        const bool keep_key = key0 + 8 * r < seq.seqlen_k;
        *reinterpret_cast<float2*>(dk_tiles + at + 8 * r * 32) =
            keep_key ? make_float2(grad_scale * dk[nt * 4 + 2 * r], grad_scale * dk[nt * 4 + 2 * r + 1])
                     : make_float2(0.f, 0.f);
        *reinterpret_cast<float2*>(dv_tiles + at + 8 * r * 32) =
            keep_key ? make_float2(dv[nt * 4 + 2 * r], dv[nt * 4 + 2 * r + 1]) : make_float2(0.f, 0.f);
      } else {
        *reinterpret_cast<float2*>(dk_tiles + at + 8 * r * 32) =
            make_float2(grad_scale * dk[nt * 4 + 2 * r], grad_scale * dk[nt * 4 + 2 * r + 1]);
        *reinterpret_cast<float2*>(dv_tiles + at + 8 * r * 32) =
            make_float2(dv[nt * 4 + 2 * r], dv[nt * 4 + 2 * r + 1]);
      }
    }
  }
  ptx::fence_proxy_async_shared_cta();               // the stores above, before the reductions (async proxy) read them
  ptx::bar_sync(kDkDvTileBarrier + warpgroup, 128);  // the warpgroup's 64 rows are in the tiles
  if (threadIdx.x % 128 == 0) {
    int* turn = nullptr;
    if (p.dkdv_turns != nullptr) {
      const FeatureParams& f = p.fwd;
      turn = p.dkdv_turns + ((int64_t(batch) * f.heads_kv + head_kv) * p.k_blocks + n_wg / kBlockN) * kWarpgroups +
             warpgroup;
      ptx::wait_turn(turn, head - head_kv * f.heads_per_kv);
    }
    // Rows past the tensor are not written; rows of the next sequence get zeros added.
#pragma unroll
    for (int box = 0; box < D / 32; ++box) {
      ptx::cp_reduce_async_bulk_tensor_4d_add(&dk_map, 32 * box, seq.k_start + n_wg, head_kv, seq.batch_coord,
                                              dk_tiles + box * 64 * 32);
      ptx::cp_reduce_async_bulk_tensor_4d_add(&dv_map, 32 * box, seq.k_start + n_wg, head_kv, seq.batch_coord,
                                              dv_tiles + box * 64 * 32);
    }
    ptx::cp_async_bulk_commit_group();
    if (turn != nullptr) ptx::pass_turn(turn);  // once the adds completed: the next head's turn
  }
  // Shared memory must outlive the reductions that read it.
  if (threadIdx.x % 128 == 0) ptx::cp_async_bulk_wait_group_read<0>();
}

}  // namespace hattn::bwd
