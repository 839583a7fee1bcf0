// The cost classes by which a variable-length batch's work list is sorted (work_order.cuh),
// for the host too: tests check the ordering kernel's list against them.
#pragma once

#include <cstdint>

namespace hattn::fwd {

// What the ordering kernel needs of the plan: the list as launched (order by pair) and the
// tiles' shape. Without a mask (plan.cpp sorts no other list), so every query block of a
// sequence sweeps all its keys.
struct OrderPlan {
  int total;       // items: m_blocks x batch x heads
  int m_blocks;    // query blocks per (batch, head) of the longest sequence
  int heads;       // per batch entry: query heads, or K/V heads where GQA packs
  int block_m;     // query rows of a block (packed rows where GQA packs)
  int pack_shift;  // log2 of the query heads a packed block holds
  int block_n;     // keys per K/V tile
};

// Cost classes: an item's K/V tiles plus one (its fixed cost), 0 for an item past its
// sequence. Sweeps of kOrderBins - 1 tiles or more (about 130k keys at 128 a tile) share the
// top class, which only loosens the order.
constexpr int kOrderBins = 1024;
constexpr int kOrderThreads = 1024;
constexpr int kOrderWarps = kOrderThreads / 32;
constexpr int kOrderSmemBytes = kOrderWarps * kOrderBins * int(sizeof(int));  // the warps' counts per class
static_assert(kOrderThreads == kOrderBins, "the scan over the classes takes one a thread");

// The class of query block m_block of a sequence: its sweep's K/V tiles, all of the sequence's.
__host__ __device__ inline int order_class(const OrderPlan& o, int m_block, int seqlen_q, int seqlen_k) {
  if (int64_t(m_block) * o.block_m >= int64_t(seqlen_q) << o.pack_shift) return 0;
  const int tiles = (seqlen_k + o.block_n - 1) / o.block_n;
  return tiles + 1 < kOrderBins ? tiles + 1 : kOrderBins - 1;
}

}  // namespace hattn::fwd
