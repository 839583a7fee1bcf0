// The cost classes by which a variable-length batch's work list is sorted (work_order.cuh),
// for the host too: tests check the ordering kernel's list against them.
#pragma once

#include <cstdint>

namespace hattn::fwd {

// What the ordering kernel needs of the plan: the list as launched (order by pair) and the
// tiles' shape. No window (plan.cpp sorts no such list).
struct OrderPlan {
  int total;       // items: m_blocks x batch x heads
  int m_blocks;    // query blocks per (batch, head) of the longest sequence
  int heads;       // per batch entry: query heads, or K/V heads where GQA packs
  int block_m;     // query rows of a block (packed rows where GQA packs)
  int pack_shift;  // log2 of the query heads a packed block holds
  int block_n;     // keys per K/V tile
  bool causal;     // a pair's blocks from the last (the most keys) to the first
  bool by_rank;    // causal, and the host chose the order by rank (tile_scheduler.cuh)
};

// The workspace the ordering kernel writes: order[total], then a trailer of kOrderTrailer ints
// at order + total: the number of items inside their sequences (the list's first ones), then
// the counter the attention kernel's CTAs take their next items from (WorkList::next_item),
// zeroed there.
constexpr int kOrderInside = 0, kOrderCounter = 1;  // the trailer's slots
constexpr int kOrderTrailer = 2;

// Cost classes: a pair's K/V tiles (all of its sequence's) plus one, the same for each of its
// blocks so that a pair's blocks stay together in the list; 0 for a block past its sequence.
// Sweeps of kOrderBins - 1 tiles or more (about 130k keys at 128 a tile) share the top class,
// which only loosens the order.
constexpr int kOrderBins = 1024;
constexpr int kOrderThreads = 1024;
constexpr int kOrderWarps = kOrderThreads / 32;
constexpr int kOrderSmemBytes = kOrderWarps * kOrderBins * int(sizeof(int));  // the warps' counts per class
static_assert(kOrderThreads == kOrderBins, "the scan over the classes takes one a thread");

// The class of query block m_block of a sequence: the sequence's K/V tiles.
__host__ __device__ inline int order_class(const OrderPlan& o, int m_block, int seqlen_q, int seqlen_k) {
  if (int64_t(m_block) * o.block_m >= int64_t(seqlen_q) << o.pack_shift) return 0;
  const int tiles = (seqlen_k + o.block_n - 1) / o.block_n;
  return tiles + 1 < kOrderBins ? tiles + 1 : kOrderBins - 1;
}

// The item (of the order by pair) the sort takes v-th, so that the sort keeps this order among
// the items of a class: the order by pair; under the causal mask a pair's blocks from the last,
// so that its most expensive ones start first, or the order by rank where the host chose it
// for the longest sequence (as for a dense batch: a pair's blocks one after another leave the
// last pairs' most expensive blocks for the end when the pairs are few and their blocks many;
// simulated on the mixed-lengths grid, 1.15 of the ideal load at D = 256 with one sequence of
// 10,942, 1.03 by rank).
__host__ __device__ inline int order_item(const OrderPlan& o, int v) {
  if (!o.causal) return v;
  if (o.by_rank) {
    const int pairs = o.total / o.m_blocks, rank = v / pairs;
    return (v - rank * pairs) * o.m_blocks + (o.m_blocks - 1 - rank);
  }
  const int pair = v / o.m_blocks;
  return pair * o.m_blocks + (o.m_blocks - 1 - (v - pair * o.m_blocks));
}

}  // namespace hattn::fwd
