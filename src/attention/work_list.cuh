// The work scheduler: the persistent CTAs' list of work items (query blocks of a head), in the
// order of tile_scheduler.cuh, with the last round cut along the keys (the tail split) and
// split-KV's parts numbered inside the blocks; and where an item lies (block, K/V head, tiles).
#pragma once

#include "../common/fast_divisor.cuh"
#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../common/tile_scheduler.cuh"
#include "mask.cuh"

namespace hattn::fwd {

// The work list with its last round cut (the tail split). Without a mask every item costs the
// same, so when the items are not a whole number of rounds, the last round keeps a few CTAs
// busy for a whole item while the others idle. Items from tail_start on are each cut into
// tail_parts parts along the keys (part i sweeps its share of the item's tiles), written as
// fp32 partial results that a second kernel combines (combine.cuh); the parts fill that round.
struct PartItem : WorkItem {
  int part = 0, parts = 1;  // parts > 1: this item is part `part` of a cut tail item
  int tail = 0;             // which tail item (its partial results' slot)
};
struct WorkList {
  TileScheduler sched;
  int tail_start = 0;  // items [0, tail_start) run whole; with tail_parts == 1 all do
  int tail_parts = 1;
  // The divisions an item's coordinates take, as FastDivisor: the producer works out its first
  // item before its first load, and with the GPU's division that took 1.0-1.5 us of a decoding
  // call's ~15 us kernel (results/evidence/decode_timeline/).
  FastItemOrder item_order;  // sched's order
  FastDivisor tail;     // tail_parts
  FastDivisor splits;   // split-KV's parts per query block (FeatureParams::splits)
  FastDivisor group;    // query heads per K/V head (FeatureParams::heads_per_kv)
  // Each consumer sweeps only the tiles its own rows see (Consumer::kOwnSweeps).
  bool own_sweeps = false;
  // A variable-length batch's list sorted by cost (work_order.cuh): position w takes item
  // order[w] of the order by pair. Null: the list's own order. Never with the tail split.
  const int* order = nullptr;
  // With `order`, in the kernels of Config::kDynamic: the counter from which a CTA takes its
  // next position once it has finished its first, order[total()] positions in all.
  int* next_item = nullptr;

  WorkList() = default;
  WorkList(const TileScheduler& s, int first_tail_item, int parts, int kv_splits, int heads_per_kv)
      : sched(s), tail_start(first_tail_item), tail_parts(parts), item_order(s), tail(parts), splits(kv_splits),
        group(heads_per_kv) {}

  // The items from tail_start on, each cut into tail_parts parts (or run whole when it is 1).
  __host__ __device__ int tail_items() const { return sched.total() - tail_start; }
  __host__ __device__ int total() const { return tail_start + tail_items() * tail_parts; }
#ifdef __CUDACC__
  __device__ int position(int round) const { return sched.position(round); }
#endif
  // kFast: the FastDivisors' divisions, else the GPU's (the same item). kOrdered: a kernel
  // that reads `order` when set (ItemSweep::kOrdered).
  template <bool kFast = true, bool kOrdered = false>
  __host__ __device__ PartItem item(int w) const {
    PartItem it;
    if (tail_parts == 1 || w < tail_start) {
#ifdef __CUDA_ARCH__
      if (kOrdered && order != nullptr) w = __ldg(order + w);
#endif
      static_cast<WorkItem&>(it) = kFast ? item_order.item(w) : sched.item(w);
      return it;
    }
    it.tail = kFast ? tail.div(w - tail_start) : (w - tail_start) / tail_parts;
    it.part = w - tail_start - it.tail * tail_parts;
    it.parts = tail_parts;
    static_cast<WorkItem&>(it) = kFast ? item_order.item(tail_start + it.tail) : sched.item(tail_start + it.tail);
    return it;
  }
};

// A position of a work list taken from its counter, with its item and the item's sequence, as
// the scheduler thread hands it out (scheduler.cuh).
struct TakenItem {
  int w;
  WorkItem item;
  Sequence seq;
};

#ifdef __CUDACC__
// Where an item lies: its query block, its K/V head, and the K/V tiles it sweeps. Split-KV
// numbers the parts of a query block inside the item's m_block (block * splits + part), and
// each part sweeps its share of the block's tiles. Only the run-time bounds kernels take it;
// without it p.splits is 1 and these are the block and the mask's tiles. A cut tail item
// carries its part in the item (never in the window's kernels, which run no tail split and
// spill more with its code).
//
// The divisions by p.splits, a cut item's parts and p.heads_per_kv go through WorkList's
// FastDivisors, except in the window's kernels, where their registers spilled (D = 128: 16
// bytes, budget 12); those divide as before.
template <int kBlockM, int kBlockN, bool kRuntimeBounds, bool kWindow>
struct ItemSweep {
  static constexpr bool kFastDivide = !kWindow;
  // The kernels that read WorkList::order: the run-time bounds kernels with two consumers
  // (plan.cpp's sorted_order sets it only without a mask). The read cost the others
  // registers: with three consumers (D = 64) ptxas spilled 32 bytes, in the dense D = 64 and
  // FP8 kernels 20-28.
  static constexpr bool kOrdered = kRuntimeBounds && kBlockM == 128;
  const FeatureParams& p;
  const WorkList& list;
  Mask<kBlockM, kBlockN, kRuntimeBounds, kWindow> mask;

  // The item at list position w and its sequence: worked out from the list and the sequence's
  // offsets, or (kTaken: the kernels of Config::kDynamic) as the scheduler thread handed them
  // out with the position (scheduler.cuh).
  struct Located {
    PartItem item;
    Sequence seq;
  };
  template <bool kTaken>
  __device__ __forceinline__ Located locate(int w, const TakenItem& taken) const {
    Located at;
    if constexpr (kTaken) {
      static_cast<WorkItem&>(at.item) = taken.item;
      at.seq = taken.seq;
    } else {
      at.item = list.template item<kFastDivide, kOrdered>(w);
      at.seq = sequence_of<kRuntimeBounds>(p, at.item.batch);
    }
    return at;
  }

  __device__ __forceinline__ int split_div(int n) const { return kFastDivide ? list.splits.div(n) : n / p.splits; }
  __device__ __forceinline__ int split_mod(int n) const { return kFastDivide ? list.splits.mod(n) : n % p.splits; }
  __device__ __forceinline__ int kv_head_of(int head_q) const {
    return kFastDivide ? list.group.div(head_q) : head_q / p.heads_per_kv;
  }
  // FP8: where the item's heads' descales sit in q_descale, k_descale and v_descale, [B][Hkv].
  // A packed item's head is already its K/V head (an FP8 KV cache packs; FP8 inputs do not).
  __device__ __forceinline__ int64_t descale_index(const WorkItem& item) const {
    const int head_kv = kRuntimeBounds && mask.shift() > 0 ? item.head_q : kv_head_of(item.head_q);
    return int64_t(item.batch) * p.heads_kv + head_kv;
  }
  __device__ __forceinline__ int block_of(const WorkItem& item) const {
    return kRuntimeBounds ? split_div(item.m_block) : item.m_block;
  }
  // The K/V tiles the item sweeps: its block's, or its part's share of them.
  __device__ __forceinline__ KvTileRange tiles(const PartItem& item, const Sequence& seq) const {
    const KvTileRange all = mask.kv_tiles(block_of(item), seq);
    const bool split = kRuntimeBounds && p.splits > 1;
    const int parts = split ? p.splits : kWindow ? 1 : item.parts;
    if (parts == 1) return all;
    const int part = split ? split_mod(item.m_block) : item.part, n = all.last - all.first;
    auto share = [&](int x) { return !kFastDivide ? x / parts : split ? list.splits.div(x) : list.tail.div(x); };
    return {all.first + share(n * part), all.first + share(n * (part + 1))};
  }
};
#endif

}  // namespace hattn::fwd
