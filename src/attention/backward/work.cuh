// A CTA's work: the query blocks that see its 128 keys, in the order it visits them.
#pragma once

#include "../../common/backward_common.cuh"
#include "config.h"

namespace hattn::bwd {

// The blocks of kBlockM queries from m_begin that see keys [n0, n0 + kBlockN), `steps` of them,
// visited with a stagger: step s is block (s + rotation) % steps, rotation = blockIdx.x % steps,
// so that the CTAs of a head (one range when not causal) add into different dQ blocks at once.
// The deterministic backward visits them in order (rotation 0): there the CTAs add into a
// block in turn, and in order each CTA's turns come one after another.
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

template <bool kVarlen>
__device__ __forceinline__ QueryBlocks query_blocks(const AttentionParams& f, const Sequence& seq, int n0,
                                                    bool in_order) {
  int q_first, q_last;
  queries_seeing<kVarlen>(f, seq, n0, n0 + kBlockN, &q_first, &q_last);
  QueryBlocks blocks;
  blocks.m_begin = q_first / kBlockM * kBlockM;
  blocks.steps = (!kVarlen || n0 < seq.seqlen_k) && q_last > blocks.m_begin
                     ? (q_last - blocks.m_begin + kBlockM - 1) / kBlockM
                     : 0;
  blocks.rotation = blocks.steps > 0 && !in_order ? int(blockIdx.x) % blocks.steps : 0;
  return blocks;
}

}  // namespace hattn::bwd
