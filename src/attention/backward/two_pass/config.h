// The production backward at D = 256 (namespace hattn::bwd::two_pass): backward step B12's two
// passes (src/lineage/bwd_12_dkdv_pipeline.cu), with variable-length batches. One pass per key
// block would hold dK and dV (64 keys x 256 columns each) and dQ's share in registers, more
// than a warpgroup has; so a dK/dV pass (dkdv_pass.cuh) computes S^T and dP^T for 64 keys and
// a dQ pass (dq_pass.cuh) computes S and dP again for 128 queries. Both launch a producer
// warpgroup and two consumer warpgroups (config.h's kThreads and register budgets).
#pragma once

#include <cstdint>

#include "../config.h"

namespace hattn::bwd::two_pass {

constexpr int kD = 256;
constexpr int kColBlocks = kD / 64;  // 64-element (128-byte) column blocks of a row

// The dK/dV pass: a CTA per 64 keys of a query head, 64 queries a step. Warpgroup w computes
// S^T and dP^T for the step's query columns 32 w .. 32 w + 31 (m64n32) and owns columns
// 128 w .. 128 w + 127 of dK and dV (m64n128).
constexpr int kDkdvKeys = 64;
constexpr int kDkdvQueries = 64;  // also the query rows of the Q and dO maps' boxes
constexpr int kHalfQueries = kDkdvQueries / kWarpgroups;
constexpr int kHalfD = kD / kWarpgroups;
constexpr int kQdoStages = 2;    // Q/dO blocks in flight
constexpr int kTilesBarrier = 1;  // named barrier: both warpgroups' halves of P^T and dS^T are written

// The dQ pass: a CTA per 128 queries of a query head (64 per consumer warpgroup, all of D),
// 64 keys a step.
constexpr int kDqQueries = 128;
constexpr int kDqKeys = 64;        // also the key rows of the K and V maps' boxes
constexpr int kKStages = 2;        // K blocks in flight (K is read by S and by dQ)
constexpr int kZeroBarrier = 1;    // named barrier (varlen): rows past the sequence zeroed

// The dK/dV pass's shared memory. Every tile is [column blocks][rows][64]: TMA writes one
// 64-column box per block, 128B-swizzled.
template <typename T>
struct DkdvStorage {
  alignas(kAtomBytes) T k[kColBlocks][kDkdvKeys * 64];
  alignas(kAtomBytes) T v[kColBlocks][kDkdvKeys * 64];
  alignas(kAtomBytes) T q[kQdoStages][kColBlocks][kDkdvQueries * 64];
  alignas(kAtomBytes) T dout[kQdoStages][kColBlocks][kDkdvQueries * 64];
  // P^T and dS^T of the step: [key][query], 64 x 64, swizzled like a TMA box.
  alignas(kAtomBytes) T pt[kDkdvKeys * kDkdvQueries];
  alignas(kAtomBytes) T dst[kDkdvKeys * kDkdvQueries];
  uint64_t kv_full;
  uint64_t qdo_full[kQdoStages];
  uint64_t consumed[kQdoStages];
};

// The dQ pass's: the CTA's 128 rows of Q and dO (loaded once), K of a block of 64 keys in two
// stages and V in one (V is done with after dP, early in a step, so the next block's V has the
// rest of the step to land; two V stages would not fit).
template <typename T>
struct DqStorage {
  alignas(kAtomBytes) T q[kColBlocks][kDqQueries * 64];
  alignas(kAtomBytes) T dout[kColBlocks][kDqQueries * 64];
  alignas(kAtomBytes) T k[kKStages][kColBlocks][kDqKeys * 64];
  alignas(kAtomBytes) T v[kColBlocks][kDqKeys * 64];
  uint64_t qdo_full;
  uint64_t k_full[kKStages];
  uint64_t k_empty[kKStages];
  uint64_t v_full;
  uint64_t v_empty;
};

template <typename Storage>
constexpr int storage_bytes() {
  return int(sizeof(Storage)) + kAtomBytes;  // + slack to align the base to 1024
}

}  // namespace hattn::bwd::two_pass
