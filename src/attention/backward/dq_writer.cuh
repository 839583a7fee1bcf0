// The dQ writers: one warp of the producer warpgroup per consumer warpgroup. Each step its
// consumers store their share of the block's dQ into a buffer and arrive (without waiting);
// the writer waits for them, adds the share into the fp32 dQ sum by one TMA reduction (the
// share is a tile of the sum in accumulator order, backward_common.cuh's dq tiles), waits
// until those have read the buffer, and hands it back. So no consumer thread waits on a bulk
// group, and a consumer warp goes on as soon as its own stores are fenced (on an H100 the
// backward took 0.98-0.99 of the time it took with the consumers sending dQ themselves:
// results/evidence/bwd_dq_writer/).
//
// Barriers (named, 128 consumer threads + the writer's 32; buffer b = step % kDqBuffers):
//   kDqFullBarrier + 2 b + wg    the consumers arrive once their share is stored and fenced to
//                                the async proxy -> the writer waits
//   kDqEmptyBarrier + 2 b + wg   the writer arrives once its reductions have read the buffer ->
//                                the consumers wait before they store into it again (from step
//                                kDqBuffers on; the writer skips the arrivals nobody waits for)
#pragma once

#include <cuda.h>

#include "../../common/backward_common.cuh"
#include "../../ptx/named_barrier.cuh"
#include "../../ptx/tma.cuh"
#include "../../ptx/turns.cuh"
#include "config.h"
#include "shared_storage.cuh"
#include "work.cuh"

namespace hattn::bwd {

// The writer warp of consumer warpgroup `warpgroup`: every lane meets the barriers, lane 0 issues.
template <typename T, int D, bool kVarlen>
__device__ __forceinline__ void write_dq(SharedStorage<T, D, kVarlen>& smem, const CUtensorMap& dq_map,
                                         const BackwardParams& p, const Sequence& seq,
                                         const QueryBlocks<kBlockM<D>>& blocks, int warpgroup, int n0, int head,
                                         int batch) {
  using Storage = SharedStorage<T, D, kVarlen>;
  constexpr int kRows = Storage::kRows;
  constexpr int kBuffers = Storage::kDqBuffers;
  static_assert(Storage::kDqCols == 64, "a warpgroup's share is one 64 x 64 tile of the sum");
  const int r0 = Storage::kDqByRows ? 64 * warpgroup : 0;
  const bool issuer = threadIdx.x % 32 == 0;
  if (issuer) ptx::prefetch_tensormap(&dq_map);
  // The share's tile of the sum (dq_map's rows: 32 a tile): by rows, chunk 0 of the 64-row
  // block at m0 + r0; by columns, chunk `warpgroup` of the block at m0.
  const FeatureParams& f = p.fwd;
  const int head_block =
      (seq.batch_coord * f.heads_q + head) * dq_tile_blocks(kVarlen ? f.total_q : f.seqlen_q, f.batch, kVarlen) +
      dq_tile_first_block(seq.q_start, batch, kVarlen);
  constexpr int kChunks = D / 64;
  const int chunk = Storage::kDqByRows ? 0 : warpgroup;
  for (int step = 0; step < blocks.steps; ++step) {
    const int buffer = step % kBuffers, m0 = blocks.row(step);
    ptx::bar_sync(kDqFullBarrier + 2 * buffer + warpgroup, kDqHandOffThreads);  // the share is in the buffer
    int* turn = nullptr;
    if (issuer) {
      // The deterministic backward (p.dq_turns): the CTAs whose keys a block sees add into its
      // share in key order from the last key block down, each in its turn (ptx/turns.cuh,
      // work.cuh's dq_turn). A block past the promised longest sequence (max_seqlen_q
      // understated, the checking mode off) has no counter: it adds out of turn rather than
      // wait on another block's.
      if (p.dq_turns != nullptr && m0 / kRows < p.q_blocks) {
        int first_key, last_key;  // the keys the block's last query sees
        visible_keys<kVarlen>(f, seq, min(m0 + kRows, seqlen_q_of<kVarlen>(f, seq)) - 1, &first_key, &last_key);
        turn = p.dq_turns + ((int64_t(batch) * f.heads_q + head) * p.q_blocks + m0 / kRows) * kWarpgroups + warpgroup;
        ptx::wait_turn(turn, dq_turn(n0, last_key));
      }
      const int tile = (head_block + (m0 + r0) / kDqTileRows) * kChunks + chunk;
      ptx::cp_reduce_async_bulk_tensor_2d_add(&dq_map, 0, tile * 32, smem.dq[buffer][warpgroup]);
      ptx::cp_async_bulk_commit_group();
      ptx::cp_async_bulk_wait_group_read<0>();  // the buffer has been read: it may be written again
    }
    __syncwarp();  // lane 0's wait, before the warp's arrival
    if (step + kBuffers < blocks.steps) ptx::bar_arrive(kDqEmptyBarrier + 2 * buffer + warpgroup, kDqHandOffThreads);
    if (turn != nullptr) ptx::pass_turn(turn);  // once the adds have completed: the next CTA's turn
  }
  // Shared memory must outlive the reductions that read it: the last wait above covers them.
}

}  // namespace hattn::bwd
