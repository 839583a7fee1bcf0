// The production backward's shared memory: K and V of the CTA's keys, a ring of Q/dO stages
// with each block's LSE and delta, the dS^T and dQ tiles, and the mbarriers.
#pragma once

#include <cstdint>

#include "../../common/sequence.cuh"
#include "config.h"

namespace hattn::bwd {

// Varlen at D = 64 only: the CTA's Sequence. read() gives it, or where it is not stored the
// caller's copy in registers.
template <bool kStored>
struct SequenceSlot {
  Sequence value;
  __device__ const Sequence& read(const Sequence&) const { return value; }
};
template <>
struct SequenceSlot<false> {
  __device__ const Sequence& read(const Sequence& in_registers) const { return in_registers; }
};

// Every tile is [D / 64][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D, bool kVarlen>
struct SharedStorage {
  static constexpr int kColBlocks = D / 64;
  static constexpr int kRows = kBlockM<D>;  // query rows of a block
  // dQ's split between the warpgroups: by rows (each 64 rows, all D columns) where a block has
  // 128 rows, else by columns (each D / 2). Either way a warpgroup's share is one 64 x 64 fp32
  // tile, single-buffered with 128 rows (two buffers would not fit at D = 64).
  static constexpr bool kDqByRows = kRows == 128;
  static constexpr int kDqCols = kDqByRows ? D : D / 2;
  static constexpr int kDqBuffers = kDqByRows ? 1 : 2;
  // How the masks find a query's visible keys. With 128-query blocks (D = 64), from each key's
  // viewers, found once per CTA (work.cuh's KeyViewers), and varlen consumers read the
  // CTA's Sequence here: held in registers beside those blocks' accumulators, it spilled. At
  // D = 128 the viewers are found per masked step: held across the loop, their four registers
  // made the whole backward 4-10% slower there (results/evidence/trials_3f3e20f/).
  static constexpr bool kViewerMasks = kRows == 128;
  static constexpr bool kStoresSequence = kVarlen && kViewerMasks;  // `seq` below
  alignas(kAtomBytes) T k[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T q[kStages][kColBlocks][kRows * 64];
  alignas(kAtomBytes) T dout[kStages][kColBlocks][kRows * 64];
  // dS^T of each warpgroup: [query block of 64][key][query], swizzled; by block parity (a
  // block's dQ wgmma reads both warpgroups' while the next block's are written).
  alignas(kAtomBytes) T ds[2][kWarpgroups][64 * kRows];
  // Each warpgroup's share of a block's dQ, per block parity (with two buffers): a 64 x 64 fp32
  // tile in accumulator order (backward_common.cuh's dq tiles).
  alignas(kAtomBytes) float dq[kDqBuffers][kWarpgroups][64 * kDqCols];
  float lse_log2[kStages][kRows];  // each block's LSE (log2 units) and delta, per query
  float delta[kStages][kRows];
  uint64_t kv_full;
  uint64_t qdo_full[kStages];
  uint64_t consumed[kStages];
  // Last, and empty unless used: varlen with kViewerMasks, the CTA's sequence, which the
  // consumers read here.
  [[no_unique_address]] SequenceSlot<kStoresSequence> seq;
};

template <typename T, int D, bool kVarlen>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D, kVarlen>)) + kAtomBytes;  // + slack to align the base to 1024
}

}  // namespace hattn::bwd
