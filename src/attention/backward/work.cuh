// A CTA's work: the query blocks that see its 128 keys, in the order it visits them.
#pragma once

#include "../../common/backward_common.cuh"
#include "config.h"

namespace hattn::bwd {

// The blocks of kRows queries (kBlockM) from m_begin that see keys [n0, n0 + kBlockN), `steps` of them,
// visited with a stagger: step s is block (s + rotation) % steps, rotation = key block % steps,
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
  if (blocks.steps > 0 && !in_order) blocks.rotation = n0 / kBlockN % blocks.steps;
  return blocks;
}

// A CTA's block (of keys; the dQ pass at D = 256: of queries), head and batch entry (or
// sequence) from a grid of (blocks, heads, batch).
struct CtaCoordinates {
  int block, head, batch;
};

// CTAs in flight on the GPU at once (one per SM; H100 and H200 have 132): a causal launch
// group's size.
constexpr int kWaveCtas = 128;
// Shorter grids keep their order: at S = 1k the groups measured 2% slower on an H100 (8 blocks
// of 128 keys here, 16 of 64 in the dK/dV pass at D = 256), where from 2k up they were level
// or faster (results/evidence/bwd_launch_order/).
constexpr int kMinGroupedRows = 2048;

// SMs take CTAs in launch order (blockIdx.x fastest) as they free up. Under the causal mask a key
// block's work falls with its index (every query sees block 0; about half see the middle one),
// and launched head by head, a head's heaviest CTA starts behind the light ones of the heads
// before it, and the last heads' heavy CTAs run on alone at the end of the grid. So a dense
// causal grid launches by groups of (batch, head) pairs, about kWaveCtas CTAs a group (the CTAs
// in flight at once then read the Q and dO of as few heads as before), and inside a group key
// block 0 of each pair first, then block 1, ...: the heaviest first, FlashAttention-3's
// longest-first order. The deterministic backward takes each head's key blocks from the last
// (its turns, dq_turn below, count on that order); varlen keeps the grid's order. With
// heaviest_last (the dQ pass at D = 256, a CTA per query block: the last sees the most keys) the
// blocks go from the last. kBlockRows: the keys (or queries) of a block. Grid gives blockIdx
// and gridDim (ThisGrid below; by hand in tests/test_backward_turns.cu, which checks the order
// on the host; read through calls, the kernels' code is what it was with them inline).
template <bool kVarlen, int kBlockRows, typename Grid>
__host__ __device__ __forceinline__ CtaCoordinates cta_coordinates_in(const Grid& g, bool causal, bool deterministic,
                                                                      bool heaviest_last) {
  const int blocks = g.blocks(), heads = g.heads();
  if (deterministic) return {blocks - 1 - g.x(), g.y(), g.z()};
  if (kVarlen || !causal || blocks * kBlockRows < kMinGroupedRows) return {g.x(), g.y(), g.z()};
  const int pairs = heads * g.entries(), group = max(1, kWaveCtas / blocks);
  const int linear = g.x() + blocks * (g.y() + heads * g.z());
  const int first_pair = linear / (group * blocks) * group;  // the group's
  const int size = min(group, pairs - first_pair);           // the last group may be smaller
  const int in_group = linear - first_pair * blocks;
  const int pair = first_pair + in_group % size;
  const int block = in_group / size;
  return {heaviest_last ? blocks - 1 - block : block, pair % heads, pair / heads};
}

// blockIdx and gridDim, read where cta_coordinates_in uses them.
struct ThisGrid {
  __device__ __forceinline__ int x() const { return int(blockIdx.x); }
  __device__ __forceinline__ int y() const { return int(blockIdx.y); }
  __device__ __forceinline__ int z() const { return int(blockIdx.z); }
  __device__ __forceinline__ int blocks() const { return int(gridDim.x); }
  __device__ __forceinline__ int heads() const { return int(gridDim.y); }
  __device__ __forceinline__ int entries() const { return int(gridDim.z); }
};

// This CTA's coordinates in the backward's launch order.
template <bool kVarlen, int kBlockRows>
__device__ __forceinline__ CtaCoordinates cta_coordinates(const FeatureParams& f, bool deterministic,
                                                          bool heaviest_last = false) {
  return cta_coordinates_in<kVarlen, kBlockRows>(ThisGrid{}, f.causal, deterministic, heaviest_last);
}

// The queries [first, last) of the sequence that see each of a thread's two keys (key0 and
// key0 + 8; none for a key past the sequence): the masks are monotone, so each key's viewers
// are one run of queries, and a masked element's test is two compares (scores.cuh: at D = 64
// found once per CTA, at D = 128 per masked step; the D = 256 dK/dV pass per masked step).
struct KeyViewers {
  int first[2], last[2];
};
template <bool kVarlen>
__device__ __forceinline__ KeyViewers viewers_of(const FeatureParams& f, const Sequence& seq, int key0) {
  KeyViewers v;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key0 + 8 * r;
    v.first[r] = v.last[r] = 0;
    if (j < seqlen_k_of<kVarlen>(f, seq)) queries_seeing<kVarlen>(f, seq, j, j + 1, &v.first[r], &v.last[r]);
  }
  return v;
}

// The viewers as offsets from query row0: a masked element at query row0 + r is visible to key
// key0 + 8 k when first[k] <= r < last[k], two compares against a constant r.
__device__ __forceinline__ KeyViewers offset_viewers(KeyViewers v, int row0) {
#pragma unroll
  for (int k = 0; k < 2; ++k) v.first[k] -= row0, v.last[k] -= row0;
  return v;
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
