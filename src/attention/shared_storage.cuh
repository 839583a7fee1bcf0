// The production forward's element types and its shared memory, as a struct of named tiles.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "config.h"
#include "work_list.cuh"

namespace hattn::fwd {

// FP8 inputs: e4m3 q, k and v, out in bf16.
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, __nv_fp8_e4m3>;
template <typename T>
using OutType = std::conditional_t<kIsFp8<T>, __nv_bfloat16, T>;
template <typename T, int D, bool kWide, int kNumConsumers, bool kFp8Kv = false, bool kDynamicList = false>
using ConfigOf = Config<D, kWide, kNumConsumers, kIsFp8<T>, kFp8Kv, kDynamicList>;
// The type the tensor cores multiply in: T, or fp16 for bf16 queries over an FP8 KV cache. Its
// codes widen to fp16 in one instruction a pair, where bf16 takes four, and the widening bounds
// the decode (kv_dequant.cuh); the consumers then turn Q into fp16 in place (q_to_half) and O
// still leaves as T.
template <typename T, typename Cfg>
using ComputeType = std::conditional_t<Cfg::kFp8Cache && std::is_same_v<T, __nv_bfloat16>, __half, T>;

// The n-th tile through a ring of kSlots buffers, each with a full and an empty mbarrier: its
// slot, the parity of the phase its fill completes, and whether the slot held an earlier tile,
// whose release (the phase of parity previous_use) a writer must wait for first.
template <int kSlots>
struct RingPosition {
  int slot;
  uint32_t phase;
  bool reused;
  uint32_t previous_use;
  __host__ __device__ explicit RingPosition(int n)
      : slot(n % kSlots), phase(uint32_t(n / kSlots) % 2), reused(n >= kSlots), previous_use(phase ^ 1u) {}
};

// Every tile is [kColBlocks][rows][kAtomCols]: TMA writes one 128-byte-wide box per block,
// 128B-swizzled.
template <typename T, typename Cfg>
struct SharedStorage {
  alignas(kAtomBytes) T q[Cfg::kColBlocks][Cfg::kBlockM * Cfg::kAtomCols];
  alignas(kAtomBytes) T k[Cfg::kStages][Cfg::kColBlocks][Cfg::kBlockN * Cfg::kAtomCols];
  alignas(kAtomBytes) T v[Cfg::kStages][Cfg::kVBlocks][Cfg::kVBlockElems];
  // O's staging tile, [D / 64][kBlockM][64] (a placeholder when O is stored from registers).
  alignas(kAtomBytes) OutType<T> o[Cfg::kStoreByTma ? Cfg::kOutColBlocks : 1]
                                  [Cfg::kStoreByTma ? Cfg::kBlockM * 64 : 64];
  uint64_t q_full[Cfg::kConsumers];   // one per consumer warpgroup: its 64 rows of Q
  uint64_t q_empty[Cfg::kConsumers];
  uint64_t k_full[Cfg::kStages];
  uint64_t v_full[Cfg::kStages];
  uint64_t k_empty[Cfg::kStages];
  uint64_t v_empty[Cfg::kStages];
  uint64_t v_landed;  // a V tile that ends past its sequence: landed, its tail not yet zeroed
  // A work list taken from its counter (Config::kDynamic): the positions the scheduler
  // thread hands the producer and the consumers, with their items and sequences, a ring of
  // two (a negative position: no more).
  //   item_full[i]   scheduler, slot written                 -> producer, consumers: read it
  //   item_empty[i]  producer and each consumer thread, read -> scheduler, before slot i again
  uint64_t item_full[2];
  uint64_t item_empty[2];
  TakenItem item_slot[2];
};

// An FP8 KV cache (Cfg::kFp8Cache): K and V land as e4m3 tiles, [kBlockN keys][D] bytes
// unswizzled, in a staging ring of their own, from which the producer warpgroup's other warps
// write them as 16-bit tiles into the K/V ring above (kv_dequant.cuh).
//   k8_full[s], v8_full[s]    producer's TMA                -> the dequantizing warps
//   k8_empty[s], v8_empty[s]  each dequantizing warp, read  -> producer, before stage s loads again
// and k_full, v_full count the dequantizing warps' arrivals instead of the TMA's.
template <typename T, typename Cfg>
struct Fp8KvStorage : SharedStorage<T, Cfg> {
  alignas(kAtomBytes) uint8_t k8[Cfg::kStagingStages][Cfg::kBlockN * Cfg::kHeadDim];
  alignas(kAtomBytes) uint8_t v8[Cfg::kStagingStages][Cfg::kBlockN * Cfg::kHeadDim];
  uint64_t k8_full[Cfg::kStagingStages];
  uint64_t v8_full[Cfg::kStagingStages];
  uint64_t k8_empty[Cfg::kStagingStages];
  uint64_t v8_empty[Cfg::kStagingStages];
};

// The kernel's shared memory: the plain storage, or with the FP8 KV cache's staging ring.
template <typename T, typename Cfg>
using StorageOf = std::conditional_t<Cfg::kFp8Cache, Fp8KvStorage<T, Cfg>, SharedStorage<T, Cfg>>;

template <typename T, typename Cfg>
constexpr int smem_bytes() {
  return int(sizeof(StorageOf<T, Cfg>)) + kAtomBytes;  // + slack to align the base to 1024
}

// A stage's K tile (or V's, when not FP8), and its V tile, as SharedStorage lays them out.
template <typename T, typename Cfg>
using KTile = T[Cfg::kColBlocks][Cfg::kBlockN * Cfg::kAtomCols];
template <typename T, typename Cfg>
using VTile = T[Cfg::kVBlocks][Cfg::kVBlockElems];

}  // namespace hattn::fwd
