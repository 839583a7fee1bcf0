// A CTA's work: the query blocks that see its 128 keys, in the order it visits them.
#pragma once

#include "../../common/backward_common.cuh"
#include "config.h"

namespace hattn::bwd {

// The blocks of kRows queries (kBlockM) from m_begin that see keys [n0, n0 + kBlockN), `steps` of them,
// visited with a stagger: step s is block (s + rotation) % steps, rotation = blockIdx.x % steps,
// so that the CTAs of a head (one range when not causal) add into different dQ blocks at once.
// The deterministic backward visits them in order (rotation 0): there the CTAs add into a
// block in turn (work.cuh's dq_turn), and in order each CTA's turns come one after another.
template <int kRows>
struct QueryBlocks {
  int m_begin;
  int steps;  // 0 when no query sees the keys (varlen: or they start past the sequence's)
  int rotation;

  // The first query row of step `step`'s block.
  __device__ __forceinline__ int row(int step) const {
    const int s = step + rotation;
    return m_begin + (s >= steps ? s - steps : s) * kRows;
  }
};

// The blocks that hold the queries [q_first, q_last) seeing a CTA's keys (none when those keys
// lie past their sequence), in order. Host too: tests/test_backward_turns.cu checks the
// deterministic backward's turns with it.
template <int kRows>
__host__ __device__ __forceinline__ QueryBlocks<kRows> blocks_holding(int q_first, int q_last, bool keys_in_sequence) {
  QueryBlocks<kRows> blocks;
  blocks.m_begin = q_first / kRows * kRows;
  blocks.steps = keys_in_sequence && q_last > blocks.m_begin ? (q_last - blocks.m_begin + kRows - 1) / kRows : 0;
  blocks.rotation = 0;
  return blocks;
}

template <int kRows, bool kVarlen>
__device__ __forceinline__ QueryBlocks<kRows> query_blocks(const FeatureParams& f, const Sequence& seq, int n0,
                                                    bool in_order) {
  int q_first, q_last;
  queries_seeing<kVarlen>(f, seq, n0, n0 + kBlockN, &q_first, &q_last);
  QueryBlocks<kRows> blocks = blocks_holding<kRows>(q_first, q_last, !kVarlen || n0 < seq.seqlen_k);
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

}  // namespace hattn::bwd
