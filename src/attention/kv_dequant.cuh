// An FP8 KV cache beside 16-bit queries: wgmma multiplies operands of one type only, so the
// e4m3 K and V tiles are widened to the queries' type in shared memory before the consumers
// read them. The producer thread loads each tile unchanged into a staging ring (producer.cuh);
// the producer warpgroup's other three warps, idle otherwise, write it into the K/V ring the
// consumers already read, in the layout TMA would have written a 16-bit tile in: fp16 for
// bf16 queries too, whose problem then multiplies in fp16 (ComputeType, q_to_half). The
// consumers run as for a 16-bit cache, with k's descale folded into the softmax's scale and
// v's into the output. The aim is decoding bound by memory, the cache read once at half the
// bytes (docs/guide/production_fp8_cache.md says how close it comes).
//
// Barriers (who arrives -> who waits), beside producer.cuh's:
//   k8_full[s], v8_full[s]    producer's TMA                   -> dequantizing warps
//   k8_empty[s], v8_empty[s]  each dequantizing warp, tile read -> producer, before staging stage s loads again
//   k_full[s], v_full[s]      each dequantizing warp, written   -> consumers, before S (PV) reads the tile
//   k_empty[s], v_empty[s]    every consumer warp (unchanged)   -> dequantizing warps, before they write stage s
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/fragment.cuh"
#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/smem.cuh"
#include "../ptx/tma.cuh"
#include "shared_storage.cuh"
#include "work_list.cuh"

namespace hattn::fwd {

// The producer warpgroup's warps 1-3; warp 0's first lane loads.
constexpr int kDequantWarps = 3;
// Consumer warpgroup 1's four warps join them on the tiles of items where it has no rows of
// its own (decoding), 7 warps a tile.
constexpr int kHelperWarps = 4;

#ifdef __CUDACC__
// Eight e4m3 codes (code 0 in the low byte of .x) as eight fp16, two to a register: cvt per pair.
__device__ __forceinline__ uint4 widen8(uint2 codes) {
  return make_uint4(frag::e4m3x2_to_half2(uint16_t(codes.x)), frag::e4m3x2_to_half2(uint16_t(codes.x >> 16)),
                    frag::e4m3x2_to_half2(uint16_t(codes.y)), frag::e4m3x2_to_half2(uint16_t(codes.y >> 16)));
}

// One tile: `src`, [kBlockN keys][D] e4m3 codes row by row, into `dst`, the fp16 tile
// [D / 64][kBlockN][64] with TMA's 128-byte swizzle (16-byte chunk j of a row at chunk
// j ^ row % 8), keys from `valid` on as zeros: rows past the sequence hold anything, NaN codes
// too, and 0 x NaN in P V would be NaN. (Addresses in the .shared window.)
//
// A thread widens 16 codes at a time: one 16-byte load, eight pair conversions, two 16-byte
// stores. It keeps one 16-code column unit of rows kRowStep apart, so its swizzled addresses
// come from a row count, and it loads kBatch units before it converts any (an earlier loop of
// 8-code chunks with per-chunk addresses spent 54 instructions per 8 codes and stalled on its
// few loads in flight).
//
// Bank conflicts, none either way: each quarter warp takes two neighbouring rows, four units
// of each, from 64-column blocks of opposite parity. Its loads then read the two 64-byte halves
// of a 128-byte bank line. Its stores put the even row's even chunks, after the swizzle, in even
// slots and the odd row's in odd slots: its first stores (each unit's even chunk) fill the 8
// slots of a row once, and so do its second (the odd chunks). At D = 64 the two rows are one
// block, and a row of codes is 64 bytes: the same holds.
template <typename Cfg, int kThreads = kDequantWarps * 32>
__device__ __forceinline__ void dequantize_tile(uint32_t src, uint32_t dst, int valid, int thread) {
  constexpr int D = Cfg::kHeadDim, kRows = Cfg::kBlockN;
  constexpr int kBlocks = D / 64;       // 64-column blocks of the swizzled tile: 4 units each
  constexpr int kUnitsPerRow = D / 16;  // 16 codes in (one 16-byte load), 32 bytes out (two stores)
  static_assert(kThreads % (8 * kBlocks) == 0 && kThreads / (D / 16) % 2 == 0,
                "whole row pairs per pass, and a thread's rows all of one parity");
  constexpr int kRowStep = kThreads / kUnitsPerRow;  // rows between a thread's units: 24, 12, 6 with 96 threads
  constexpr int kSteps = (kRows + kRowStep - 1) / kRowStep;
  constexpr int kBatch = 3;  // 16-byte loads in flight per thread before the first conversion
  const int quarter = thread / 8, odd_row = thread % 8 / 4;
  const int block = kBlocks == 1 ? 0 : (quarter % kBlocks) ^ odd_row;  // the other row's block has the other parity
  const int unit = block * 4 + thread % 4;
  const int first_row = 2 * (quarter / kBlocks) + odd_row;
  const int chunk = unit % 4 * 2;  // the unit's first 8 columns as a chunk of its block's row; the second is chunk + 1
  const uint32_t block_base = dst + uint32_t(block) * uint32_t(kRows * kSwizzleBytes);
  valid = min(max(valid, 0), kRows);
  // Not unrolled: a whole tile's units at once would not fit the warps' 56 registers.
#pragma unroll 1
  for (int i0 = 0; i0 < kSteps; i0 += kBatch) {
    uint4 codes[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int row = first_row + (i0 + b) * kRowStep;
      codes[b] = make_uint4(0u, 0u, 0u, 0u);  // e4m3 0x00 is +0
      if (i0 + b < kSteps && row < valid) codes[b] = ptx::ld_shared_v4(src + uint32_t(row * D + unit * 16));
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int row = first_row + (i0 + b) * kRowStep;
      if (i0 + b < kSteps && row < kRows) {
        // The even chunk's swizzled slot; the odd one's is its neighbour (slot ^ 1: byte ^ 16).
        const uint32_t at = block_base + uint32_t(row) * kSwizzleBytes + uint32_t(chunk ^ (row % 8)) * 16;
        ptx::st_shared_v4(at, widen8(make_uint2(codes[b].x, codes[b].y)));
        ptx::st_shared_v4(at ^ 16u, widen8(make_uint2(codes[b].z, codes[b].w)));
      }
    }
  }
}

// bf16 queries over an FP8 KV cache compute in fp16 (ComputeType). Q is scaled by kHalfQScale
// on the way, and the consumers fold its inverse into the scores' scale: fp16 then holds every
// bf16 query element from 2^-9 to 1.6e7 in magnitude exactly (below 2^-6 as subnormals, whose
// steps of 2^-16 bf16's own reach only there), rounds smaller ones to those steps (far below the
// e4m3 keys' error) and saturates larger ones.
constexpr float kHalfQScale = 1.f / 256.f;

// A consumer warpgroup's 64 rows of Q, landed as bf16 (TMA's swizzle moves whole 16-byte
// chunks, so an element keeps its place), rewritten in place as fp16 times kHalfQScale.
// `rows`: the warpgroup's first row in column block 0 (.shared window); `thread`: 0 .. 127.
// The caller fences and syncs the warpgroup before its wgmmas read them.
template <typename Cfg>
__device__ __forceinline__ void q_to_half(uint32_t rows, int thread) {
  constexpr int kChunksPerBlock = 64 * kSwizzleBytes / 16;  // 64 rows of 8 chunks
  constexpr int kChunks = Cfg::kColBlocks * kChunksPerBlock;
  constexpr uint32_t kBlockBytes = Cfg::kBlockM * kSwizzleBytes;  // a column block of the whole Q tile
  // Not unrolled: beside the consumers' live O (128 registers at D = 256) an unrolled loop spilled.
#pragma unroll 1
  for (int c = thread; c < kChunks; c += 128) {
    const uint32_t at = rows + uint32_t(c / kChunksPerBlock) * kBlockBytes + uint32_t(c % kChunksPerBlock) * 16;
    const uint4 bf = ptx::ld_shared_v4(at);
    auto half2 = [](uint32_t pair) {
      const float2 x = frag::unpack2<__nv_bfloat16>(pair);
      return frag::pack2_half_satfinite(x.x * kHalfQScale, x.y * kHalfQScale);
    };
    ptx::st_shared_v4(at, make_uint4(half2(bf.x), half2(bf.y), half2(bf.z), half2(bf.w)));
  }
}

// Whether consumer warpgroup 1 widens beside the dequantizing warps on an item: it has no rows
// there (the item's packed rows end within consumer 0's 64) and consumer 0 has some.
// `rows_end`: the sequence's packed query rows. The consumers and the widening warps both ask.
__device__ __forceinline__ bool consumer_helps(int m_block, int rows_end) {
  return m_block < rows_end && m_block + 64 >= rows_end;
}

// Widens staging tile `from` into ring tile `to`, this thread one of kThreads (`thread`), once
// both are ready, then hands each on: the warp's leader arrives on `full` and `staged_empty`
// with `arrivals` (1, or more for warps that sit the tile out: their barriers count 7).
// WAR on `to`: the consumers' arrivals on `empty` follow their wgmma reads of its previous use.
template <typename Cfg, int kThreads>
__device__ __forceinline__ void widen_and_hand_on(uint8_t* from, uint64_t* staged_full, uint64_t* staged_empty,
                                                  uint32_t staged_parity, void* to, uint64_t* full, uint64_t* empty,
                                                  bool reused, uint32_t previous_use, int valid, int thread,
                                                  uint32_t arrivals) {
  ptx::mbarrier_wait(staged_full, staged_parity);
  if (reused) ptx::mbarrier_wait(empty, previous_use);
  dequantize_tile<Cfg, kThreads>(ptx::cvta_to_shared_u32(from), ptx::cvta_to_shared_u32(to), valid, thread);
  // This thread's generic-proxy writes, before the consumers' wgmmas (async proxy) read them.
  ptx::fence_proxy_async_shared_cta();
  __syncwarp();  // the warp's writes and fences, before its leader's arrivals release them
  if (thread % 32 == 0) {
    ptx::mbarrier_arrive(full, arrivals);
    ptx::mbarrier_arrive(staged_empty, arrivals);  // the staging tile is read: the producer may load it again
  }
}

// Ring position `kv`'s K tile, then its V tile (`valid` keys of them in the sequence), each
// widened by kThreads threads and handed on with `arrivals` (widen_and_hand_on). Returns the
// tiles' ring slot.
template <typename Cfg, int kThreads, typename T>
__device__ __forceinline__ int widen_kv_tiles(Fp8KvStorage<T, Cfg>& smem, int kv, int valid, int thread,
                                              uint32_t arrivals) {
  const RingPosition<Cfg::kStages> ring(kv);
  const RingPosition<Cfg::kStagingStages> staged(kv);
  const int stage = ring.slot, s8 = staged.slot;
  widen_and_hand_on<Cfg, kThreads>(smem.k8[s8], &smem.k8_full[s8], &smem.k8_empty[s8], staged.phase, smem.k[stage],
                                      &smem.k_full[stage], &smem.k_empty[stage], ring.reused, ring.previous_use, valid,
                                      thread, arrivals);
  widen_and_hand_on<Cfg, kThreads>(smem.v8[s8], &smem.v8_full[s8], &smem.v8_empty[s8], staged.phase, smem.v[stage],
                                      &smem.v_full[stage], &smem.v_empty[stage], ring.reused, ring.previous_use, valid,
                                      thread, arrivals);
  return stage;
}

// The dequantizing warps' whole life: the K and V tile of every item of the CTA's share of the
// work list, in the producer's order (the same items, the same ring positions). `thread`:
// 0 .. 32 kDequantWarps - 1. Where consumer 1 helps (consumer_helps), a tile's units go to
// both; elsewhere warp 0 also arrives for consumer 1's four warps.
template <typename T, int D, typename Cfg, bool kRuntimeBounds, bool kWindow>
__device__ __forceinline__ void dequantize(Fp8KvStorage<T, Cfg>& smem, const FeatureParams& p, const WorkList& sched,
                                           const ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>& items,
                                           int thread) {
  static_assert(kRuntimeBounds, "an FP8 KV cache runs in the run-time bounds kernels (their tiles find their keys)");
  static_assert(std::is_same_v<ComputeType<T, Cfg>, __half>, "the widening writes fp16 tiles");
  constexpr bool kFastDivide = !kWindow;
  constexpr bool kOrdered = ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>::kOrdered;
  constexpr int kAlone = kDequantWarps * 32, kHelped = (kDequantWarps + kHelperWarps) * 32;
  const int pack_shift = items.mask.shift();
  int kv = 0;  // K/V tiles so far: the ring position
  for (int round = 0, w = sched.position(0); w < sched.total(); w = sched.position(++round)) {
    const PartItem item = sched.item<kFastDivide, kOrdered>(w);
    const Sequence seq = sequence_of<kRuntimeBounds>(p, item.batch);
    const KvTileRange range = items.tiles(item, seq);
    const bool helped = consumer_helps(items.block_of(item) * Cfg::kBlockM, seq.seqlen_q << pack_shift);
    const uint32_t arrivals = helped || thread >= 32 ? 1u : 1u + kHelperWarps;
    for (int tile = 0; tile < range.last - range.first; ++tile, ++kv) {
      const int valid = seq.seqlen_k - (range.first + tile) * Cfg::kBlockN;  // keys of the tile in the sequence
      if (helped)
        widen_kv_tiles<Cfg, kHelped>(smem, kv, valid, thread, arrivals);
      else
        widen_kv_tiles<Cfg, kAlone>(smem, kv, valid, thread, arrivals);
    }
  }
}

// Consumer warpgroup 1's share of an item it has no rows of (consumer_helps), in place of
// passing the tiles on: each K and V tile widened beside the dequantizing warps (this thread
// kDequantWarps * 32 + its index in the warpgroup), and its arrivals on the empty barriers
// after its own waits on them (the slots' previous phases have completed). No turns: consumer
// 0 computes such an item alone (consume's `solo`), so the widening runs ahead of its GEMMs.
template <typename T, typename Cfg, typename Storage>
__device__ __forceinline__ void help_widen(Storage& storage, const Sequence& seq, const KvTileRange& range, int kv,
                                           int wg_thread, uint64_t* q_empty) {
  static_assert(Cfg::kFp8Cache, "only an FP8 KV cache has tiles to widen");
  auto& smem = static_cast<Fp8KvStorage<T, Cfg>&>(storage);
  constexpr int kHelped = (kDequantWarps + kHelperWarps) * 32;
  const int thread = kDequantWarps * 32 + wg_thread;
  const int n_tiles = range.last - range.first;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int valid = seq.seqlen_k - (range.first + tile) * Cfg::kBlockN;
    const int stage = widen_kv_tiles<Cfg, kHelped>(smem, kv + tile, valid, thread, 1u);
    if (wg_thread % 32 == 0) {
      ptx::mbarrier_arrive(&smem.k_empty[stage]);
      ptx::mbarrier_arrive(&smem.v_empty[stage]);
      if (tile + 1 == n_tiles) ptx::mbarrier_arrive(q_empty);
    }
  }
}
#endif

}  // namespace hattn::fwd
