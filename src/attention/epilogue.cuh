// The epilogue: a consumer warpgroup's O rows (normalized) and their LSE leave for global
// memory at an item's end, in one of three forms:
//   - a part of a split item (split-KV, or a cut tail item): fp32 O and LSE into the
//     workspace, for combine.cuh to merge;
//   - through a shared-memory staging tile and a TMA store (D = 64, and D = 128 with 128-key
//     tiles, where that tile fits beside the ring);
//   - from registers, after a transpose across each quad, in 16-byte stores (D = 256, wide
//     D = 128).
#pragma once

#include <cuda.h>

#include "../common/fragment.cuh"
#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../ptx/named_barrier.cuh"
#include "../ptx/smem.cuh"
#include "../ptx/tma.cuh"
#include "shared_storage.cuh"
#include "softmax.cuh"
#include "work_list.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// A consumer thread's place: its warpgroup (0-based consumer index), its warp in it, its lane,
// and the accumulator coordinates (rows group, group + 8; columns 2 tig, 2 tig + 1).
struct ConsumerThread {
  int warpgroup, warp_in_wg, lane, group, tig;
  int warp_row;  // first row of this warp inside the CTA tile
};

template <typename T, int D, typename Cfg, bool kRuntimeBounds, bool kWindow>
struct Epilogue {
  using OutT = OutType<T>;
  static constexpr bool kFp8 = kIsFp8<T>;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kDTiles = D / 8;  // n8 column tiles of O
  using Softmax = OnlineSoftmax<Cfg::kBlockN / 8, Cfg::kFmaExp2Tiles, kFp8>;

  SharedStorage<T, Cfg>& smem;
  const CUtensorMap& o_map;
  const FeatureParams& p;
  const ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>& items;
  const ConsumerThread& t;

  // Stores the item's rows of this thread: row0 and row0 + 8 (packed rows of the block at
  // m_block). `softmax` holds the rows' max and (not yet quad-summed) sums.
  __device__ __forceinline__ void store(const PartItem& item, float (&o)[kDTiles * 4], Softmax& softmax,
                                        float scale_log2, int m_block, int row0) const {
    const int pack_shift = items.mask.shift();
    // The query head of a (packed) row: the item's head, or with GQA packing its group's head
    // row % 2^pack_shift. The row's query position is row >> pack_shift.
    auto head_of = [&](int row) { return (item.head_q << pack_shift) + (row & ((1 << pack_shift) - 1)); };
    // The epilogue reads its sequence again instead of using the mainloop's copy: with the
    // copy, ptxas spilled 72 bytes in the varlen + window kernel at D = 128, and 0 with the re-read.
    const Sequence out_seq = sequence_of<kRuntimeBounds>(p, item.batch);
    float inv_sum[2];
    softmax.finish(inv_sum);
    // The LSE's scale: the item's own where descales scaled its scores (scale_log2 holds FP8's q
    // and k descales, an FP8 KV cache's k descale), else the call's.
    const float lse_scale = kFp8 || Cfg::kFp8Cache ? scale_log2 / kLog2e : p.scale;
    if constexpr (kFp8 || Cfg::kFp8Cache) {  // O in units of v's e4m3 codes: its descale with the normalizer
      if (p.v_descale != nullptr) {
        const float v_scale = __ldg(p.v_descale + items.descale_index(item));
        inv_sum[0] *= v_scale;
        inv_sum[1] *= v_scale;
      }
    }
    // A part's row r of the thread (split-KV or a cut tail item): its O, normalized by its own
    // sum, and its LSE, in fp32 at `index` of the partial layout for the combine step; -inf and
    // zeros where the part saw no key. A quad writes 32 contiguous bytes per n8 tile.
    auto store_partial_row = [&](int r, int64_t index) {
      if (t.tig == 0) p.lse_partial[index] = softmax.lse(r, lse_scale);
      float* o_row = p.o_partial + index * D;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * t.tig) =
            make_float2(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
    };
    if (kRuntimeBounds && p.splits > 1) {
      // Split-KV: partials at [part][batch][head][row].
      const bool packed = p.cu_seqlens_q != nullptr;
      const int rows = packed ? p.total_q : p.seqlen_q;
      const int part = items.split_mod(item.m_block);
      const int64_t part_heads0 = (int64_t(part) * (packed ? 1 : p.batch) + (packed ? 0 : item.batch)) * p.heads_q;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= out_seq.seqlen_q << pack_shift) continue;
        const int head = head_of(row);
        store_partial_row(r, (part_heads0 + head) * rows + out_seq.q_start + (row >> pack_shift));
      }
      return;  // the combine step writes out and lse
    }
    if (!kWindow && item.parts > 1) {
      // A part of a cut tail item: as split-KV's parts, at [tail item][part][row of the block]
      // (rows past Sq are left unwritten; the combine step skips them).
      const int64_t slot = (int64_t(item.tail) * item.parts + item.part) * kBlockM;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= p.seqlen_q) continue;
        store_partial_row(r, slot + (row - m_block));
      }
      return;  // the combine step writes out and lse
    }
    // LSE: [B, Hq, Sq], or [Hq, total_q] in a variable-length batch: the item's rows start at
    // lse_rows, a head's rows head_stride apart. FP8's sums carry P's 2^8.
    if (p.lse != nullptr && t.tig == 0) {
      const bool packed = kRuntimeBounds && p.cu_seqlens_q != nullptr;
      const int64_t head_stride = packed ? p.total_q : p.seqlen_q;
      float* const lse_rows =
          p.lse + (packed ? int64_t(out_seq.q_start) : int64_t(item.batch) * p.heads_q * p.seqlen_q);
      const int rows_end = out_seq.seqlen_q << pack_shift;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row < rows_end)
          lse_rows[head_of(row) * head_stride + (row >> pack_shift)] =
              kFp8 ? softmax.lse(r, lse_scale) - kFp8PLog2 / kLog2e : softmax.lse(r, lse_scale);
      }
    }
    if constexpr (Cfg::kStoreByTma)
      store_by_tma(item, o, inv_sum, m_block, out_seq, head_of);
    else
      store_from_registers(o, inv_sum, row0, out_seq, head_of);
  }

  // O through the staging tile: the warpgroup writes its 64 rows (swizzled), then one thread
  // stores them with TMA, or, for a box that would run past its sequence in a varlen batch,
  // the warpgroup copies the rows inside it.
  template <typename HeadOf>
  __device__ __forceinline__ void store_by_tma(const PartItem& item, float (&o)[kDTiles * 4], const float (&inv_sum)[2],
                                               int m_block, const Sequence& out_seq, HeadOf head_of) const {
    const int pack_shift = items.mask.shift();
    const int epilogue_barrier = kEpilogueConsumer0 + t.warpgroup;
    const bool storer = t.warp_in_wg == 0 && t.lane == 0;  // issues this warpgroup's stores
    // WAR: the previous item's store has read the staging rows before they are rewritten.
    if (storer) ptx::cp_async_bulk_wait_group_read<0>();
    ptx::bar_sync(epilogue_barrier, 128);
    // Element (row, col) of column block cb sits at row * 64 + ((col / 8) ^ (row % 8)) * 8
    // + col % 8, TMA's 128-byte swizzle: the 8 rows x 4 threads of a warp's write hit 32
    // distinct banks.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = t.warp_row + t.group + r * 8;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<uint32_t*>(&smem.o[dt / 8][row * 64 + ((dt % 8) ^ (row % 8)) * 8 + 2 * t.tig]) =
            frag::pack2<OutT>(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
    }
    ptx::fence_proxy_async_shared_cta();  // this thread's writes, before the TMA unit reads them
    ptx::bar_sync(epilogue_barrier, 128);  // RAW: the warpgroup's 64 rows are all written and fenced
    // A TMA store writes all 64 rows of the box and clips only at the tensor's end. In a
    // variable-length batch that is the last sequence's end: a box that runs past its own
    // sequence would overwrite the next one's rows, so the warpgroup copies the rows inside
    // it from the staging tile instead, 16 bytes per thread and step (warpgroup-uniform).
    const int box_row0 = m_block + t.warpgroup * 64;  // in the sequence (packed rows)
    if (!kRuntimeBounds || p.cu_seqlens_q == nullptr || box_row0 + 64 <= out_seq.seqlen_q << pack_shift) {
      if (storer) {
#pragma unroll
        for (int cb = 0; cb < Cfg::kOutColBlocks; ++cb) {
          if constexpr (kRuntimeBounds)  // the 5-D box of the Q load
            ptx::cp_async_bulk_tensor_5d_s2g(&o_map, cb * 64, 0, item.head_q,
                                             out_seq.q_start + (box_row0 >> pack_shift), out_seq.batch_coord,
                                             &smem.o[cb][t.warpgroup * 64 * 64]);
          else
            ptx::cp_async_bulk_tensor_4d_s2g(&o_map, cb * 64, box_row0, item.head_q, out_seq.batch_coord,
                                             &smem.o[cb][t.warpgroup * 64 * 64]);
        }
        ptx::cp_async_bulk_commit_group();
      }
    } else {
      constexpr int kChunks = D / 8;  // 16-byte pieces of a row
      const int rows = (out_seq.seqlen_q << pack_shift) - box_row0;  // < 64; the item has at least one
      OutT* out = static_cast<OutT*>(p.out) + int64_t(out_seq.q_start) * p.out_seq_stride;  // a varlen batch: no batch
      for (int i = int(threadIdx.x) % 128; i < rows * kChunks; i += 128) {
        const int r = i / kChunks, c = i % kChunks;  // the tile's row warpgroup * 64 + r: swizzled by r % 8
        const int row = box_row0 + r;
        const int head = head_of(row);
        *reinterpret_cast<uint4*>(out + int64_t(row >> pack_shift) * p.out_seq_stride + head * p.out_head_stride +
                                  c * 8) =
            *reinterpret_cast<const uint4*>(&smem.o[c / 8][(t.warpgroup * 64 + r) * 64 + ((c % 8) ^ (r % 8)) * 8]);
      }
    }
  }

  // O from registers: a 4 x 4 transpose across the quad gives each thread 8 contiguous
  // elements of its row, written as one 16-byte store.
  template <typename HeadOf>
  __device__ __forceinline__ void store_from_registers(float (&o)[kDTiles * 4], const float (&inv_sum)[2], int row0,
                                                       const Sequence& out_seq, HeadOf head_of) const {
    const int pack_shift = items.mask.shift();
    OutT* out = static_cast<OutT*>(p.out) + out_seq.batch_coord * p.out_batch_stride +
                out_seq.q_start * p.out_seq_stride;  // the sequence's [Sq, H, D] rows
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + r * 8;
      const int head = head_of(row);
      OutT* out_row = out + int64_t(row >> pack_shift) * p.out_seq_stride + head * p.out_head_stride;
      // Thread t gets the four threads' pairs of n8 tile 4k + t. Every row is 16-byte aligned:
      // the API checks out's pointer and its strides (multiples of 8 elements over every
      // dimension longer than 1). All four threads of the quad shuffle, also on rows past Sq;
      // only rows inside it store.
#pragma unroll
      for (int k = 0; k < kDTiles / 4; ++k) {
        uint32_t a[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          a[j] = frag::pack2<OutT>(o[(4 * k + j) * 4 + 2 * r] * inv_sum[r], o[(4 * k + j) * 4 + 2 * r + 1] * inv_sum[r]);
        const bool hi = t.tig & 2, odd = t.tig & 1;
        uint32_t s0 = hi ? a[0] : a[2], s1 = hi ? a[1] : a[3];
        s0 = __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 = __shfl_xor_sync(0xffffffffu, s1, 2);
        if (hi) { a[0] = s0; a[1] = s1; } else { a[2] = s0; a[3] = s1; }
        s0 = odd ? a[0] : a[1];
        s1 = odd ? a[2] : a[3];
        s0 = __shfl_xor_sync(0xffffffffu, s0, 1);
        s1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        if (odd) { a[0] = s0; a[2] = s1; } else { a[1] = s0; a[3] = s1; }
        if (row < out_seq.seqlen_q << pack_shift)
          *reinterpret_cast<uint4*>(out_row + (4 * k + t.tig) * 8) = make_uint4(a[0], a[1], a[2], a[3]);
      }
    }
  }
};
#endif

}  // namespace hattn::fwd
