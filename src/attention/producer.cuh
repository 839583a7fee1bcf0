// The mainloop's producer: one thread of the producer warpgroup loads each item's Q (one box
// per consumer warpgroup) and its K/V tiles into the ring of shared-memory stages with TMA,
// following the same work list as the consumers.
//
// Barriers (who arrives -> who waits):
//   q_full[c]    producer's TMA (expect_tx)      -> consumer c, before its first S of an item
//   q_empty[c]   consumer c's 4 warps, last S    -> producer, before the next item's Q rows
//   k_full[s]    producer's TMA                  -> consumers, before S(t) reads K(t)
//   k_empty[s]   every consumer warp, after S    -> producer, before stage s takes K again
//   v_full[s]    producer's TMA (or the zeroing) -> consumers, before PV(t) reads V(t)
//   v_empty[s]   every consumer warp, after PV   -> producer, before stage s takes V again
//   v_landed     producer's TMA                  -> producer, before it zeroes a V tile's tail
//   item_full[i], item_empty[i]: a list taken from its counter (scheduler.cuh)
#pragma once

#include <cuda.h>

#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/tma.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"
#include "work_list.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// Zeros for the rows of a V tile past its sequence's end (static storage starts zeroed): at
// most a whole tile's rows of one 64-column block.
static __device__ __align__(128) uint4 g_zero_rows[256 * kSwizzleBytes / sizeof(uint4)];

// Issues the TMA copies of one K or V tile (kBlockN keys from row `first_key`) into `dst`,
// completing on `full` (the producer thread only): one 128-byte-wide box per column block.
template <typename T, typename Cfg, int D>
__device__ __forceinline__ void load_tile(KTile<T, Cfg>& dst, const CUtensorMap* map, int first_key, int head_kv,
                                          int batch, uint64_t* full) {
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(dst[cb], map, cb * Cfg::kAtomCols, first_key, head_kv, batch, full);
}

// FP8: the TMA copy of one V^T tile (the kBlockN keys from `first_key`, all D rows) from the
// transposed copy [B][Hkv][D][keys], completing on `full`.
template <typename T, typename Cfg, int D>
__device__ __forceinline__ void load_vt_tile(VTile<T, Cfg>& dst, const CUtensorMap* map, int first_key, int head_kv,
                                             int batch, uint64_t* full) {
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * D * sizeof(T));
#pragma unroll
  for (int vb = 0; vb < Cfg::kVBlocks; ++vb)
    ptx::cp_async_bulk_tensor_4d_g2s(dst[vb], map, first_key + vb * kVtTileKeys, 0, head_kv, batch, full);
}

// Where a tile starting at the sequence's key `key` lies in k and v: its first row and its
// batch coordinate. A paged cache's tile is rows key % page_size onward of one page (page_size
// is a multiple of kBlockN), the page clamped to the cache.
struct TileSource {
  int row, entry;
};
template <bool kRuntimeBounds>
__device__ __forceinline__ TileSource tile_source(const FeatureParams& p, const Sequence& seq, int key) {
  if (kRuntimeBounds && p.block_table != nullptr) {
    const int page = __ldg(p.block_table + int64_t(seq.kv_entry) * p.max_pages_per_seq + key / p.page_size);
    return {key % p.page_size, min(max(page, 0), p.num_pages - 1)};
  }
  return {seq.k_start + key, seq.kv_entry};
}

// An FP8 KV cache: the TMA copy of one e4m3 K or V tile (kBlockN keys from row `first_key`, all
// D codes of each, unswizzled) into the staging ring, completing on `full` (kv_dequant.cuh).
template <typename Cfg>
__device__ __forceinline__ void load_staged_tile(uint8_t* dst, const CUtensorMap* map, int first_key, int head_kv,
                                                 int batch, uint64_t* full) {
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * Cfg::kHeadDim);
  ptx::cp_async_bulk_tensor_4d_g2s(dst, map, 0, first_key, head_kv, batch, full);
}

// The producer thread's whole life: every item of the CTA's share of the work list.
template <typename T, int D, typename Cfg, bool kRuntimeBounds, bool kWindow>
__device__ __forceinline__ void produce(StorageOf<T, Cfg>& smem, const CUtensorMap& q_map,
                                        const CUtensorMap& k_map, const CUtensorMap& v_map, const FeatureParams& p,
                                        const WorkList& sched,
                                        const ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>& items) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr bool kFastDivide = !kWindow;
  constexpr bool kOrdered = ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>::kOrdered;
  // The producer prefetches the next item's Q into L2 in the kernel with D = 128's 128-key
  // tiles (short sweeps): there it gained 1-3% on the H200, and up to 0.8% was lost with the
  // wide tiles and at D = 64 (results/evidence/q_prefetch_6b0b0f9/). The run-time bounds
  // kernels would first have to read the next item's sequence.
  constexpr bool kPrefetchNextQ = !kRuntimeBounds && D == 128 && Cfg::kBlockN == 128;  // not the wide tiles
  const int pack_shift = items.mask.shift();
  int kv = 0;      // K/V tiles loaded so far: the ring position
  int uses = 0;    // items loaded so far: Q's phase
  int landed = 0;  // V tiles whose tail was zeroed so far: v_landed's phase
  // The round-th position: the snake's, or as the scheduler thread hands it out with its item
  // and sequence (scheduler.cuh).
  TakenItem taken;
  auto take = [&](int round) {
    if constexpr (!Cfg::kDynamic) return sched.position(round);
    taken = take_position(smem, sched, round);
    return taken.w;
  };
  for (int round = 0, w = take(0); w < sched.total(); w = take(++round)) {
    const auto at = items.template locate<Cfg::kDynamic>(w, taken);
    const PartItem& item = at.item;
    const Sequence& seq = at.seq;
    const KvTileRange range = items.tiles(item, seq);
    const int n_tiles = range.last - range.first;
    if (n_tiles == 0) continue;
    const int block_row = items.block_of(item) * kBlockM;  // the block's first row
    const int head_kv = pack_shift > 0 ? item.head_q : items.kv_head_of(item.head_q);  // packed: a K/V head's item
    // Q in two halves, one per consumer, each loaded as soon as its consumer is done with
    // it. WAR: consumer c's last S of the previous item has finished reading its rows.
#pragma unroll
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      if (uses > 0) ptx::mbarrier_wait(&smem.q_empty[c], (uses - 1) % 2);
      ptx::mbarrier_arrive_expect_tx(&smem.q_full[c], 64 * D * sizeof(T));
#pragma unroll
      for (int cb = 0; cb < Cfg::kColBlocks; ++cb) {
        if constexpr (kRuntimeBounds)  // (column, head in the group, head group, position, batch)
          ptx::cp_async_bulk_tensor_5d_g2s(smem.q[cb] + c * 64 * Cfg::kAtomCols, &q_map, cb * Cfg::kAtomCols, 0,
                                           item.head_q, seq.q_start + ((block_row + c * 64) >> pack_shift),
                                           seq.batch_coord, &smem.q_full[c]);
        else
          ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb] + c * 64 * Cfg::kAtomCols, &q_map, cb * Cfg::kAtomCols,
                                           block_row + c * 64, item.head_q, seq.batch_coord, &smem.q_full[c]);
      }
    }
    ++uses;
    for (int tile = 0; tile < n_tiles; ++tile, ++kv) {
      if constexpr (Cfg::kFp8Cache) {
        // An FP8 KV cache: both tiles into the staging ring, once the dequantizing warps have
        // read its previous use (they wait for the 16-bit stage the consumers release).
        const RingPosition<Cfg::kStagingStages> staged(kv);
        const TileSource src = tile_source<kRuntimeBounds>(p, seq, (range.first + tile) * kBlockN);
        const int kv_row = src.row, kv_entry = src.entry, s8 = staged.slot;
        if (staged.reused) ptx::mbarrier_wait(&smem.k8_empty[s8], staged.previous_use);
        load_staged_tile<Cfg>(smem.k8[s8], &k_map, kv_row, head_kv, kv_entry, &smem.k8_full[s8]);
        if (staged.reused) ptx::mbarrier_wait(&smem.v8_empty[s8], staged.previous_use);
        load_staged_tile<Cfg>(smem.v8[s8], &v_map, kv_row, head_kv, kv_entry, &smem.v8_full[s8]);
        continue;
      }
      // WAR: the consumers have released this stage's K (then V) of its previous use, kv - kStages.
      const RingPosition<Cfg::kStages> ring(kv);
      const int stage = ring.slot;
      if (ring.reused) ptx::mbarrier_wait(&smem.k_empty[stage], ring.previous_use);
      // In a variable-length batch the last tile may run into the next sequence's keys:
      // the consumers mask them like keys past Sk (which TMA fills with zeros).
      const int key = (range.first + tile) * kBlockN;  // the tile's first key in the sequence
      const TileSource src = tile_source<kRuntimeBounds>(p, seq, key);
      const int kv_row = src.row, kv_entry = src.entry;
      load_tile<T, Cfg, D>(smem.k[stage], &k_map, kv_row, head_kv, kv_entry, &smem.k_full[stage]);
      if constexpr (kPrefetchNextQ) {
        // With the item's last K tile, the next item's Q into L2: its load waits for this
        // item's last S, and would then take longer from memory than the consumers' last
        // PV and epilogue do.
        const int next = tile + 1 == n_tiles ? sched.position(round + 1) : sched.total();
        if (next < sched.total()) {
          const PartItem after = sched.item<kFastDivide, kOrdered>(next);
#pragma unroll
          for (int c = 0; c < Cfg::kConsumers; ++c)
#pragma unroll
            for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
              ptx::cp_async_bulk_prefetch_tensor_4d_l2(&q_map, cb * Cfg::kAtomCols,
                                                       items.block_of(after) * kBlockM + c * 64, after.head_q,
                                                       after.batch);
        }
      }
      if (ring.reused) ptx::mbarrier_wait(&smem.v_empty[stage], ring.previous_use);
      const int valid = seq.seqlen_k - key;  // keys of the tile inside the sequence
      if constexpr (kIsFp8<T>) {  // V^T: v_map is over the transposed copy (zeros past Sk; dense batches only)
        load_vt_tile<T, Cfg, D>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry, &smem.v_full[stage]);
      } else if (kRuntimeBounds && valid < kBlockN) {
        // The rows past the sequence's end hold anything: the next sequence's keys, a
        // cache's unused rows. Their weights are 0, but 0 x NaN is NaN in P V. So the tile
        // first lands on v_landed; then (one async copy after the other, the first seen
        // complete) zeros overwrite those rows, and that copy completes v_full. K needs
        // nothing: its masked scores are set to -inf.
        load_tile<T, Cfg, D>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry, &smem.v_landed);
        ptx::mbarrier_wait(&smem.v_landed, landed++ % 2);
        const uint32_t zero_bytes = uint32_t(kBlockN - valid) * kSwizzleBytes;  // per 64-column block
        ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], zero_bytes * Cfg::kColBlocks);
#pragma unroll
        for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
          ptx::cp_async_bulk_g2s(smem.v[stage][cb] + valid * 64, g_zero_rows, zero_bytes, &smem.v_full[stage]);
      } else {
        load_tile<T, Cfg, D>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry, &smem.v_full[stage]);
      }
    }
  }
}
#endif

}  // namespace hattn::fwd
