// The scheduler thread of the production forward's kernels that take a variable-length
// batch's sorted work list from a counter (Config::kDynamic; work_order.cuh writes the list,
// its count and the zeroed counter), and how the producer and the consumers take each position
// from it.
//
// Barriers (who arrives -> who waits), a ring of two slots (SharedStorage::item_slot, each a
// TakenItem: the position, its item and the item's sequence):
//   item_full[i]   the scheduler, slot written                   -> the producer, consumers: read it
//   item_empty[i]  the producer thread and every consumer thread  -> the scheduler, before slot i again
#pragma once

#include "../common/sequence.cuh"
#include "../ptx/mbarrier.cuh"
#include "shared_storage.cuh"
#include "work_list.cuh"
#include "work_order.h"

namespace hattn::fwd {

#ifdef __CUDACC__
// The scheduler thread: lane 0 of the producer warpgroup's second warp, beside the producer
// thread, whose registers are too few for it. It hands out the round-th position through slot
// round % 2: first the CTA's own (as in the snake's first turn), then the counter's
// (WorkList::next_item) plus the grid's size, each taken once every reader has the position
// before the last; a negative one once the list's positions are gone (from order[total] on
// they are items past their sequences, never taken). With the position it writes the item
// and its sequence: the readers then start an item without global loads (the list's entry,
// then the sequence's offsets) on their path.
template <typename T, typename Cfg>
__device__ __forceinline__ void hand_out_positions(StorageOf<T, Cfg>& smem, const WorkList& sched,
                                                   const FeatureParams& p) {
  const int end = __ldg(sched.order + sched.total() + kOrderInside);
#pragma unroll 1
  for (int round = 0;; ++round) {
    const int slot = round % 2;
    // WAR: the producer and every consumer warp have read the position the slot held.
    if (round >= 2) ptx::mbarrier_wait(&smem.item_empty[slot], (round / 2 - 1) % 2);
    const int w = round == 0 ? int(blockIdx.x) : atomicAdd(sched.next_item, 1) + int(gridDim.x);
    TakenItem taken;
    taken.w = -1;
    if (w < end) {
      taken.w = w;
      taken.item = sched.item_order.item(__ldg(sched.order + w));
      taken.seq = sequence_of<true>(p, taken.item.batch);
    }
    smem.item_slot[slot] = taken;
    ptx::mbarrier_arrive(&smem.item_full[slot]);  // release: the writes are seen with the phase
    if (w >= end) return;
  }
}

// The round-th position as the scheduler thread handed it out, with its item and sequence:
// wait for its slot, read it, release the slot. Every reading thread releases it itself (the
// producer thread and each consumer thread): an arrival releases its own thread's reads. Where
// lane 0 of each consumer warp arrived for its lanes after __syncwarp, racecheck reported
// hazards between the scheduler's writes of a slot and the consumers' reads of it
// (results/evidence/racecheck_item_slots/). A negative position (no more) reads as
// sched.total(), which ends the caller's loop.
template <typename Storage>
__device__ __forceinline__ TakenItem take_position(Storage& smem, const WorkList& sched, int round) {
  const int slot = round % 2;
  ptx::mbarrier_wait(&smem.item_full[slot], (round / 2) % 2);  // acquire: the scheduler's writes
  TakenItem taken = smem.item_slot[slot];
  ptx::mbarrier_arrive(&smem.item_empty[slot]);  // release: this thread's read is done
  if (taken.w < 0) taken.w = sched.total();
  return taken;
}
#endif

}  // namespace hattn::fwd
