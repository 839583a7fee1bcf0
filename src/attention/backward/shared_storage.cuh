// The production backward's shared memory: K and V of the CTA's keys, a ring of Q/dO stages
// with each block's LSE and delta, the dS^T and dQ tiles, and the mbarriers.
#pragma once

#include <cstdint>

#include "config.h"

namespace hattn::bwd {

// Varlen only: each block's visible keys per query, [first, last) (from visible_keys), counted
// from the CTA's first key and clamped to [0, kBlockN]: 16 bits each.
template <bool kVarlen>
struct KeyRanges {
  int16_t first[kStages][kBlockM];
  int16_t last[kStages][kBlockM];
};
template <>
struct KeyRanges<false> {};

// Every tile is [D / 64][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D, bool kVarlen>
struct SharedStorage {
  static constexpr int kColBlocks = D / 64;
  alignas(kAtomBytes) T k[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T q[kStages][kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T dout[kStages][kColBlocks][kBlockM * 64];
  // dS^T of each warpgroup: [key][query], swizzled; by block parity (a block's dQ wgmma reads
  // both warpgroups' while the next block's are written).
  alignas(kAtomBytes) T ds[2][kWarpgroups][64 * kBlockM];
  // Each warpgroup's half of a block's dQ (D / 2 columns), per block parity, as 64 x 32 fp32
  // boxes (128-byte rows, swizzled like the TMA box).
  alignas(kAtomBytes) float dq[2][kWarpgroups][D / 64][kBlockM * 32];
  float lse_log2[kStages][kBlockM];  // each block's LSE (log2 units) and delta, per query
  float delta[kStages][kBlockM];
  uint64_t kv_full;
  uint64_t qdo_full[kStages];
  uint64_t consumed[kStages];
  [[no_unique_address]] KeyRanges<kVarlen> keys;  // last, and empty when dense
};

template <typename T, int D, bool kVarlen>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D, kVarlen>)) + kAtomBytes;  // + slack to align the base to 1024
}

}  // namespace hattn::bwd
