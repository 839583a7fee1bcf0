// The work list of a variable-length batch, ordered by cost (WorkList::order).
//
// The host plans a packed batch as a dense one of its longest sequence: every sequence gets
// the longest one's query blocks, and those past a short sequence's end are skipped. In the
// snake order of tile_scheduler.cuh the items of a long sequence pile up on some CTAs while
// others idle: up to 1.86x the ideal load on the mixed-lengths grid, where the forward read
// 0.54 of FA3 (results/evidence/varlen_balance_sim/). Before the attention kernel one CTA
// reads the lengths and writes the list's permutation: position w takes item order[w] of the
// order by pair, the pairs sorted by their sequence's K/V tiles (most first, the blocks past
// their sequences last), ties in the order by pair so that CTAs working at the same time work
// on few (batch, head) pairs and share their K/V in L2; under the causal mask a pair's blocks
// from its last. The attention kernel's CTAs then take the positions from a counter as they
// finish (WorkList::next_item, where the plan says so: dynamic_order), else in the snake's
// turns. Any permutation gives the same results.
#pragma once

#include "../common/params.h"
#include "../common/sequence.cuh"
#include "work_order.h"

namespace hattn::fwd {

// One CTA of kOrderThreads: order[w] for every position w < o.total, and the trailer
// (kOrderTrailer). A stable counting sort of the items in order_item's order by class,
// highest first. Each warp counts the classes of its own contiguous share of the
// list; a scan over (class descending, warp ascending) turns the counts into each warp's first
// slot per class; then each warp walks its share 32 items at a time, in order, and a lane's
// slot is its warp's next slot of the class plus the lanes before it of the same class.
__global__ void __launch_bounds__(kOrderThreads, 1) order_items_kernel(const FeatureParams p, const OrderPlan o,
                                                                      int* order) {
  extern __shared__ int slots[];  // [warp][class]: the counts, then each warp's next slot
  __shared__ int class_start[kOrderBins];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int share = (o.total + kOrderWarps * 32 - 1) / (kOrderWarps * 32) * 32;  // items per warp
  const int begin = min(warp * share, o.total), end = min(begin + share, o.total);
  auto class_of = [&](int v) {
    const int w = order_item(o, v), pair = w / o.m_blocks;
    const Sequence seq = sequence_of<true>(p, pair / o.heads);
    return order_class(o, w - pair * o.m_blocks, seq.seqlen_q, seq.seqlen_k);
  };

  for (int i = int(threadIdx.x); i < kOrderWarps * kOrderBins; i += kOrderThreads) slots[i] = 0;
  __syncthreads();  // zeroed before any count
  for (int w = begin + lane; w < end; w += 32) atomicAdd(&slots[warp * kOrderBins + class_of(w)], 1);
  __syncthreads();  // every count in

  // Class c's items start after those of every higher class: a scan over the classes from the
  // top (one a thread), in place in class_start (Hillis-Steele, the sum of the classes above).
  const int c = int(threadIdx.x);  // kOrderThreads == kOrderBins
  int count = 0;
  for (int v = 0; v < kOrderWarps; ++v) count += slots[v * kOrderBins + c];
  class_start[c] = count;
  __syncthreads();
  for (int step = 1; step < kOrderBins; step *= 2) {
    const int above = c + step < kOrderBins ? class_start[c + step] : 0;
    __syncthreads();  // every read of this step before any write
    class_start[c] += above;
    __syncthreads();
  }
  if (c == 0) {
    order[o.total + kOrderInside] = class_start[1];  // the items inside their sequences (classes 1 and up)
    order[o.total + kOrderCounter] = 0;              // the counter, for this launch
  }
  int next = class_start[c] - count;  // the inclusive sum of c and above, less c's own count
  for (int v = 0; v < kOrderWarps; ++v) {
    const int n = slots[v * kOrderBins + c];
    slots[v * kOrderBins + c] = next;
    next += n;
  }
  __syncthreads();  // every warp's first slots written

  int* mine = slots + warp * kOrderBins;
  for (int base = begin; base < end; base += 32) {
    const int w = base + lane;
    const bool active = w < end;
    const unsigned lanes = __ballot_sync(0xffffffffu, active);
    if (active) {
      const int cls = class_of(w);
      const unsigned peers = __match_any_sync(lanes, cls);
      const int rank = __popc(peers & ((1u << lane) - 1));
      order[mine[cls] + rank] = order_item(o, w);
      __syncwarp(lanes);  // every peer has read the class's next slot
      if (rank == 0) mine[cls] += __popc(peers);
    }
    __syncwarp();  // the next slots advanced before the next 32 items read them
  }
}

}  // namespace hattn::fwd
