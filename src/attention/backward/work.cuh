// A CTA's work: the query blocks that see its 128 keys, in the order it visits them.
#pragma once

#include "../../common/backward_common.cuh"
#include "config.h"

namespace hattn::bwd {

// The blocks of kBlockM queries from m_begin that see keys [n0, n0 + kBlockN), `steps` of them,
// visited with a stagger: step s is block (s + rotation) % steps, rotation = blockIdx.x % steps,
// so that the CTAs of a head (one range when not causal) add into different dQ blocks at once.
// The deterministic backward visits them in order (rotation 0): there the CTAs add into a
// block in turn (work.cuh's dq_turn), and in order each CTA's turns come one after another.
struct QueryBlocks {
  int m_begin;
  int steps;  // 0 when no query sees the keys (varlen: or they start past the sequence's)
  int rotation;

  // The first query row of step `step`'s block.
  __device__ __forceinline__ int row(int step) const {
    const int s = step + rotation;
    return m_begin + (s >= steps ? s - steps : s) * kBlockM;
  }
};

// The blocks that hold the queries [q_first, q_last) seeing a CTA's keys (none when those keys
// lie past their sequence), in order. Host too: tests/test_backward_turns.cu checks the
// deterministic backward's turns with it.
__host__ __device__ __forceinline__ QueryBlocks blocks_holding(int q_first, int q_last, bool keys_in_sequence) {
  QueryBlocks blocks;
  blocks.m_begin = q_first / kBlockM * kBlockM;
  blocks.steps =
      keys_in_sequence && q_last > blocks.m_begin ? (q_last - blocks.m_begin + kBlockM - 1) / kBlockM : 0;
  blocks.rotation = 0;
  return blocks;
}

template <bool kVarlen>
__device__ __forceinline__ QueryBlocks query_blocks(const FeatureParams& f, const Sequence& seq, int n0,
                                                    bool in_order) {
  int q_first, q_last;
  queries_seeing<kVarlen>(f, seq, n0, n0 + kBlockN, &q_first, &q_last);
  QueryBlocks blocks = blocks_holding(q_first, q_last, !kVarlen || n0 < seq.seqlen_k);
  if (blocks.steps > 0 && !in_order) blocks.rotation = int(blockIdx.x) % blocks.steps;
  return blocks;
}

// The deterministic backward's turn of the CTA whose keys start at n0 on a query block whose
// last query sees keys up to last_key (exclusive): its key block's place among the block's
// adders counted from the last (the masks are monotone, so those run without a gap down from
// the block of key last_key - 1). From the last down, as FlashAttention-3's deterministic causal
// backward: the CTA of key block n starts on query blocks that key block n + 1's CTA (launched
// just before it, kernel.cuh) reached a step earlier, where counted from the first it would wait
// for key block 0's CTA to sweep down to its first block.
__host__ __device__ __forceinline__ int dq_turn(int n0, int last_key) {
  return (last_key - 1) / kBlockN - n0 / kBlockN;
}

// The packed grid of a variable-length batch (on trial, BackwardParams::packed_key_blocks):
// CTA x takes key block x of the sequences' blocks laid end to end, sequence b having
// ceil(len_k(b) / kBlockN) of them. Where the grid is per longest sequence, CTAs past their
// own sequence's keys start and exit at once (about two in five with bench_backward's mixed
// lengths, S/4 to 7S/4). Each warp finds its CTA's place from cu_seqlens_k,
// 32 sequences at a time (a scan of the block counts, then the first lane past x); the same
// answer in every warp, so the CTA needs no shared memory for it. *batch = -1 past the last
// block (the grid's slack: at most one block per sequence).
__device__ __forceinline__ void packed_key_block(const FeatureParams& f, int x, int* batch, int* key_block) {
  const int lane = int(threadIdx.x) % 32;
  int before = 0;  // blocks of the sequences before this group of 32
  for (int b0 = 0; b0 < f.batch; b0 += 32) {
    const int b = b0 + lane;
    const int blocks = b < f.batch ? (f.cu_seqlens_k[b + 1] - f.cu_seqlens_k[b] + kBlockN - 1) / kBlockN : 0;
    int through = blocks;  // blocks of sequences b0 .. b
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, through, d);
      if (lane >= d) through += below;
    }
    const unsigned past = __ballot_sync(0xffffffffu, before + through > x);  // sequences that end past x
    if (past != 0) {
      const int owner = __ffs(int(past)) - 1;
      *batch = b0 + owner;
      *key_block = x - before - __shfl_sync(0xffffffffu, through - blocks, owner);
      return;
    }
    before += __shfl_sync(0xffffffffu, through, 31);
  }
  *batch = -1;
  *key_block = 0;
}

}  // namespace hattn::bwd
