// Lineage step 16: O leaves registers in 16-byte stores (a transpose across the quad).
//
// Kernel 16 focus (what changed from 15_three_consumers):
//   1. Where O is stored from registers (D = 256, and D = 128 with the wide tiles, where no
//      O staging tile fits beside the ring), each row's four threads first swap their pairs
//      of O elements with two rounds of shuffles (a 4 x 4 transpose across the quad), so that
//      each thread holds 8 contiguous elements and writes them with one 16-byte store. 15
//      wrote 4 bytes per thread per n8 tile: 16 contiguous bytes per quad, half of each
//      32-byte sector a store sends.
//   2. The API already requires 16-byte aligned rows, so every thread's 8 elements start on
//      a 16-byte boundary.
//
// Why: short sweeps at D = 256 spend a large share of each item in the epilogue; Nsight
// Compute on 15 at D = 256, S = 512 flagged the stores' half-used sectors
// (results/evidence/ncu_15_d256_s512_3bed0fe.txt).
// Known limits: as in 15 (the epilogue spills at D = 64, measured thresholds, scale > 0).
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "exp2_fma.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/ex2.cuh"
#include "ptx/griddepcontrol.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/named_barrier.cuh"
#include "ptx/setmaxnreg.cuh"
#include "ptx/smem.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "registry.h"
#include "sequence.cuh"
#include "tensor_map.h"
#include "tile_scheduler.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "16_coalesced_store";

// Named barrier ids (0 is __syncthreads): one "turn" barrier per consumer warpgroup (ids 1-3
// with three consumers), then one per consumer warpgroup for its epilogue (ids 4-6).
constexpr int kMaxConsumers = 3;
enum NamedBarrier : int { kTurnConsumer0 = 1, kEpilogueConsumer0 = 1 + kMaxConsumers };
constexpr int kTurnThreads = 2 * 128;  // the waiting warpgroup + the arriving one
// FP8: keys in one 128-byte swizzle row of V^T (e4m3): the PV wgmma's V^T tile, the TMA box the
// producer loads it with, the transpose kernel's tile and the padding of V^T's keys.
constexpr int kVtTileKeys = 128;

// kWide: the wide tile shape for long key sweeps; kNumConsumers: consumer warpgroups (2, or 3
// at D = 64); kFp8: e4m3 inputs (the FP8 forward, D = 64 or 128 with 128-key tiles).
template <int D, bool kWide, int kNumConsumers, bool kFp8 = false>
struct Config {
  static constexpr int kConsumers = kNumConsumers;     // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
  static constexpr int kBlockM = 64 * kConsumers;      // query rows per CTA: 64 per consumer
  // Keys per K/V tile (the N of S = Q K^T).
  static constexpr int kBlockN = D == 256 ? (kWide ? 80 : 64) : !kWide ? 128 : D == 128 ? 176 : 160;
  static constexpr int kStages = D == 64 ? 3 : 2;      // K/V tiles in flight (3 fit beside O only at D = 64)
  // Q's and K's rows go in swizzle rows of 128 bytes, or 64 where a whole row is shorter (FP8 at
  // D = 64: 64-byte swizzle).
  static constexpr int kRowBytes = kFp8 && D < 128 ? D : 128;
  static constexpr int kAtomCols = kFp8 ? kRowBytes : 64;  // elements in a swizzle row of Q or K
  static constexpr int kColBlocks = D / kAtomCols;         // column blocks of a row
  // V's tile as the PV wgmma reads it: [kColBlocks][kBlockN keys][64], N-major; with FP8 V^T,
  // [kBlockN / 128][D][128 keys], K-major (8-bit operands are never read transposed).
  static constexpr int kVBlocks = kFp8 ? kBlockN / kVtTileKeys : kColBlocks;
  static constexpr int kVBlockElems = kFp8 ? D * kVtTileKeys : kBlockN * kAtomCols;
  static constexpr int kOutColBlocks = D / 64;         // O is 16-bit (bf16 for FP8 inputs)
  // O leaves through a shared-memory tile and a TMA store when that tile fits beside Q and
  // the ring: Q + 2 x (K + V) + O is 192 KB at D = 128, but would be 240 KB with 176-key
  // tiles and 256 KB at D = 256 (64-key tiles). At D = 64 it is 130 KB, 152 KB with 160-key
  // tiles.
  static constexpr bool kStoreByTma = D == 64 || (D == 128 && !kWide);
  // Of every 4 n8 tiles of P, this many take their exponentials on the FMA pipe (exp2_fma)
  // instead of MUFU.EX2. FP8 at D = 128 is bound by MUFU (a tile pair's ex2 and e4m3
  // conversions take as long as its halved GEMMs): on the H200 one of four ran 1-2% faster
  // from S = 4k, two or three slower, and every count slowed bf16 at D = 64
  // (results/evidence/fp8_fma_exp2_trial/).
  static constexpr int kFmaExp2Tiles = kFp8 && D == 128 ? 1 : 0;
  // FP8: K/V tiles whose P V products o_tile sums in the tensor cores before the CUDA cores add
  // them to O. Two halve the adds at D = 64, where they ran 3-6% faster from S = 4k (1% slower at
  // 1k); at D = 128 two ran 3% slower (results/evidence/fp8_promote_trial/).
  static constexpr int kPvTilesPerSum = kFp8 && D == 64 ? 2 : 1;
  static constexpr bool kSumsPvTiles = kPvTilesPerSum > 1;
  // Register budgets per thread after setmaxnreg. setmaxnreg only moves registers inside the
  // CTA's own pool, which is what the CTA got at launch: kThreads x the compiler's cap under
  // __launch_bounds__(kThreads, 1), 65536 / kThreads rounded down to a multiple of 8 (168).
  // The budgets of the 1 + kConsumers warpgroups must fit in it, or setmaxnreg.inc waits
  // forever for registers that never come (24 + 2 x 240 = 504 = 3 x 168; with three
  // consumers 24 + 3 x 160 = 504 <= 4 x 128).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumers == 3 ? 160 : 240;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * kLaunchRegisters,
                "setmaxnreg budgets exceed the CTA's registers at launch");

  static_assert(D % 64 == 0, "tiles are stored as 64-column blocks, the width of a 128-byte swizzle atom");
  static_assert(kConsumers == 2 || (kConsumers == 3 && D == 64 && !kWide),
                "three consumers fit their registers only at D = 64 with 128-key tiles");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "S = Q K^T is one m64nNk16 per 16 columns of D");
  static_assert(!kFp8 || ((D == 64 || D == 128) && !kWide && kConsumers == 2 && kBlockN == 128),
                "the FP8 forward runs D = 64 and 128 with 128-key tiles (one swizzle row of V^T)");
};

// FP8 inputs: e4m3 q, k and v, out in bf16.
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, __nv_fp8_e4m3>;
template <typename T>
using OutType = std::conditional_t<kIsFp8<T>, __nv_bfloat16, T>;
template <typename T, int D, bool kWide, int kNumConsumers>
using ConfigOf = Config<D, kWide, kNumConsumers, kIsFp8<T>>;

constexpr float kLog2e = 1.4426950408889634f;
// FP8: P is kept as 2^8 P (at most 256 < 448, e4m3's largest), so that weights down to 2^-14
// stay in e4m3's normal range (2^-6 up) with 3 mantissa bits instead of rounding among the
// subnormals' steps of 2^-9 (or to 0). The row sums carry the same factor, so O / sum is
// unchanged; the LSE takes 8 ln 2 off.
constexpr float kFp8PLog2 = 8.f;
constexpr int kSwizzleBytes = 128;  // one row of a 64-column block
constexpr int kAtomBytes = 1024;    // 8 rows x 128 bytes: the swizzle pattern's period

// Every tile is [kColBlocks][rows][kAtomCols]: TMA writes one 128-byte-wide box per block,
// 128B-swizzled.
template <typename T, int D, bool kWide, int kNumConsumers>
struct SharedStorage {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers>;
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
};

// Zeros for the rows of a V tile past its sequence's end (static storage starts zeroed): at
// most a whole tile's rows of one 64-column block.
__device__ __align__(128) uint4 g_zero_rows[256 * kSwizzleBytes / sizeof(uint4)];

template <typename T, int D, bool kWide, int kNumConsumers>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D, kWide, kNumConsumers>)) + kAtomBytes;  // + slack to align the base to 1024
}

// A stage's K tile (or V's, when not FP8), and its V tile, as SharedStorage lays them out.
template <typename T, int D, bool kWide, int kNumConsumers, typename Cfg = ConfigOf<T, D, kWide, kNumConsumers>>
using KTile = T[Cfg::kColBlocks][Cfg::kBlockN * Cfg::kAtomCols];
template <typename T, int D, bool kWide, int kNumConsumers, typename Cfg = ConfigOf<T, D, kWide, kNumConsumers>>
using VTile = T[Cfg::kVBlocks][Cfg::kVBlockElems];

// Issues the TMA copies of one K or V tile (kBlockN keys from row `first_key`) into `dst`,
// completing on `full` (the producer thread only): one 128-byte-wide box per column block.
template <typename T, int D, bool kWide, int kNumConsumers>
__device__ __forceinline__ void load_tile(KTile<T, D, kWide, kNumConsumers>& dst, const CUtensorMap* map,
                                          int first_key, int head_kv, int batch, uint64_t* full) {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers>;
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(dst[cb], map, cb * Cfg::kAtomCols, first_key, head_kv, batch, full);
}

// FP8: the TMA copy of one V^T tile (the kBlockN keys from `first_key`, all D rows) from the
// transposed copy [B][Hkv][D][keys], completing on `full`.
template <typename T, int D, bool kWide, int kNumConsumers>
__device__ __forceinline__ void load_vt_tile(VTile<T, D, kWide, kNumConsumers>& dst, const CUtensorMap* map,
                                             int first_key, int head_kv, int batch, uint64_t* full) {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers>;
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * D * sizeof(T));
#pragma unroll
  for (int vb = 0; vb < Cfg::kVBlocks; ++vb)
    ptx::cp_async_bulk_tensor_4d_g2s(dst[vb], map, first_key + vb * kVtTileKeys, 0, head_kv, batch, full);
}

// The work list with its last round cut (the final kernel's tail split). Without a mask every
// item costs the same, so when the items are not a whole number of rounds, the last round
// keeps a few CTAs busy for a whole item while the others idle. Items from tail_start on are
// each cut into tail_parts parts along the keys (part i sweeps its share of the item's tiles),
// written as fp32 partial results that a second kernel combines; the parts fill that round.
struct PartItem : WorkItem {
  int part = 0, parts = 1;  // parts > 1: this item is part `part` of a cut tail item
  int tail = 0;             // which tail item (its partial results' slot)
};
struct WorkList {
  TileScheduler sched;
  int tail_start = 0;  // items [0, tail_start) run whole; with tail_parts == 1 all do
  int tail_parts = 1;
  // The divisions an item's coordinates take, as FastDivisor: the producer works out its first
  // item before its first load, and with the GPU's division that took 1.0-1.5 us of a decoding
  // call's ~15 us kernel (results/evidence/decode_timeline/).
  FastItemOrder order;  // sched's order
  FastDivisor tail;     // tail_parts
  FastDivisor splits;   // split-KV's parts per query block (AttentionParams::splits)
  FastDivisor group;    // query heads per K/V head (AttentionParams::heads_per_kv)
  // Each consumer sweeps only the tiles its own rows see (kOwnSweeps in the kernel).
  bool own_sweeps = false;

  WorkList() = default;
  WorkList(const TileScheduler& s, int first_tail_item, int parts, int kv_splits, int heads_per_kv)
      : sched(s), tail_start(first_tail_item), tail_parts(parts), order(s), tail(parts), splits(kv_splits),
        group(heads_per_kv) {}

  // The items from tail_start on, each cut into tail_parts parts (or run whole when it is 1).
  __host__ __device__ int tail_items() const { return sched.total() - tail_start; }
  __host__ __device__ int total() const { return tail_start + tail_items() * tail_parts; }
#ifdef __CUDACC__
  __device__ int position(int round) const { return sched.position(round); }
#endif
  // kFast: the FastDivisors' divisions, else the GPU's (the same item).
  template <bool kFast = true>
  __host__ __device__ PartItem item(int w) const {
    PartItem it;
    if (tail_parts == 1 || w < tail_start) {
      static_cast<WorkItem&>(it) = kFast ? order.item(w) : sched.item(w);
      return it;
    }
    it.tail = kFast ? tail.div(w - tail_start) : (w - tail_start) / tail_parts;
    it.part = w - tail_start - it.tail * tail_parts;
    it.parts = tail_parts;
    static_cast<WorkItem&>(it) = kFast ? order.item(tail_start + it.tail) : sched.item(tail_start + it.tail);
    return it;
  }
};

// The final kernel's extensions, as template flags so that problems without them keep the
// step's own tile loop (the causal mask or none, with no window or sequence arithmetic):
//   kRuntimeBounds: each item reads its sequence's bounds at run time: a variable-length
//            batch, keys in use (seqlens_k), left padding, cache entries, a paged cache,
//            split-KV parts. These kernels also run softcapping.
//   kWindow: a sliding window, whose edges bound the sweeps and masks. Its kernels also take
//            run-time bounds (kWindow implies kRuntimeBounds), so three of the four
//            combinations are compiled.
template <typename T, int D, bool kWide, int kNumConsumers, bool kRuntimeBounds, bool kWindow>
__global__ void __launch_bounds__(Config<D, kWide, kNumConsumers>::kThreads, 1)
    coalesced_store_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
                      const AttentionParams p, const WorkList sched) {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers>;
  constexpr bool kFp8 = kIsFp8<T>;  // e4m3 q, k, v (V as its transposed copy), bf16 out
  using OutT = OutType<T>;
  static_assert(!kFp8 || !kRuntimeBounds, "the FP8 forward runs dense batches");
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8;  // n8 column tiles of S in the accumulator
  constexpr int kDTiles = D / 8;        // n8 column tiles of O
  // wgmma k steps, 32 bytes of a row each (k16 for 16-bit types, k32 for e4m3): over D for S,
  // over the tile's keys for PV (P's A fragments).
  constexpr int kSSteps = D * int(sizeof(T)) / 32, kPSteps = kBlockN * int(sizeof(T)) / 32;
  // The producer prefetches the next item's Q into L2 in the kernel with D = 128's 128-key
  // tiles (short sweeps): there it gained 1-3% on the H200, and up to 0.8% was lost with the
  // wide tiles and at D = 64 (results/evidence/q_prefetch_6b0b0f9/). The run-time bounds
  // kernels would first have to read the next item's sequence.
  constexpr bool kPrefetchNextQ = !kRuntimeBounds && D == 128 && !kWide;

  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  // At D <= 128 the offset is added to smem_raw itself: the compiler then still knows the
  // pointer is in shared memory, stores the O staging tile with STS instead of generic ST, and
  // spills less at D = 64 with three consumers (1-3% faster there; results/evidence/
  // smem_base_ab/). D = 256 has no generic access either way and measured 0.4-0.9% slower with
  // it, so it keeps the rounded integer.
  unsigned char* smem_base;
  if constexpr (D <= 128)
    smem_base = ptx::align_shared<kAtomBytes>(smem_raw);
  else
    smem_base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) /
                                                 kAtomBytes * kAtomBytes);
  auto& smem = *reinterpret_cast<SharedStorage<T, D, kWide, kNumConsumers>*>(smem_base);

  // The consumer index; -1 is the producer. Read from lane 0 so that the compiler knows it is
  // the same in the whole warp and keeps what derives from it (Q's descriptor) in uniform
  // registers.
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  // GQA packing: a row is query position row >> pack_shift of query head (item head <<
  // pack_shift) + row % 2^pack_shift. Only the run-time bounds kernels without a window pack:
  // the shifts in the window's masks cost its kernels 6-15% at D = 64 and 128 (measured at
  // 6107497), so there it is a compile-time 0, as in the kernels without run-time bounds.
  const int pack_shift = kRuntimeBounds && !kWindow ? p.pack_shift : 0;

  // K/V tiles [first, last) query block `m_block` of `seq` sweeps: all of them, or those
  // between the edges of the causal mask or the sliding window (none when no row sees a key,
  // or when the block lies past a short sequence's queries in a variable-length batch).
  auto kv_tiles = [&](int m_block, const Sequence& seq) -> KvTileRange {
    if (kRuntimeBounds && m_block * kBlockM >= seq.seqlen_q << pack_shift) return {0, 0};
    const int block_positions = kBlockM >> pack_shift;  // query positions per block
    if constexpr (kWindow) {
      return masked_kv_tiles(m_block, block_positions, kBlockN, seq.seqlen_q, seq.seqlen_k, p.window_left,
                             p.window_right);
    } else {
      return {0, p.causal ? causal_kv_tiles(m_block, block_positions, kBlockN, seq.seqlen_q, seq.seqlen_k)
                          : (seq.seqlen_k + kBlockN - 1) / kBlockN};
    }
  };
  // Split-KV numbers the parts of a query block inside the item's m_block (block * splits +
  // part), and each part sweeps its share of the block's tiles. Only the run-time bounds
  // kernels take it; without it p.splits is 1 and these are the block and kv_tiles. A cut
  // tail item carries its part in the item (never in the window's kernels, which run no tail
  // split and spill more with its code).
  //
  // The divisions by p.splits, a cut item's parts and p.heads_per_kv go through WorkList's
  // FastDivisors, except in the window's kernels, where their registers spilled (D = 128: 16
  // bytes, budget 12); those divide as before.
  constexpr bool kFastDivide = !kWindow;
  // Own sweeps: under the causal mask a consumer's 64 rows end before its block's last row.
  // With three consumers on 192-row blocks and 128-key tiles, one or two of them see none of
  // the last tile's keys on most items (a tenth of the work at S = 2k); each then computes
  // only the tiles its rows see and passes the rest on, where the host sets sched.own_sweeps
  // (short causal sweeps, kOwnSweepMaxKeys). Rows wholly past the sequence pass their item
  // on without a mask, or with own sweeps; on long causal sweeps with own sweeps off, that
  // alone ran 2.5% slower at D = 64, S = 8k (as the idle-consumer path below did at 16k).
  // With two consumers the 128-row blocks and 128-key tiles line up, nothing is skipped, and
  // the code alone cost 1-3.5%; the window's kernels keep their sweep (their registers are
  // short). Measured on the H200: results/evidence/wg_sweep/.
  constexpr bool kOwnSweeps = !kWindow && Cfg::kConsumers == 3;
  auto split_div = [&](int n) { return kFastDivide ? sched.splits.div(n) : n / p.splits; };
  auto split_mod = [&](int n) { return kFastDivide ? sched.splits.mod(n) : n % p.splits; };
  auto kv_head_of = [&](int head_q) { return kFastDivide ? sched.group.div(head_q) : head_q / p.heads_per_kv; };
  auto block_of = [&](const WorkItem& item) { return kRuntimeBounds ? split_div(item.m_block) : item.m_block; };
  auto item_tiles = [&](const PartItem& item, const Sequence& seq) -> KvTileRange {
    const KvTileRange all = kv_tiles(block_of(item), seq);
    const bool split = kRuntimeBounds && p.splits > 1;
    const int parts = split ? p.splits : kWindow ? 1 : item.parts;
    if (parts == 1) return all;
    const int part = split ? split_mod(item.m_block) : item.part, n = all.last - all.first;
    auto share = [&](int x) { return !kFastDivide ? x / parts : split ? sched.splits.div(x) : sched.tail.div(x); };
    return {all.first + share(n * part), all.first + share(n * (part + 1))};
  };

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    if constexpr (Cfg::kStoreByTma) ptx::prefetch_tensormap(&o_map);
#pragma unroll
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      ptx::mbarrier_init(&smem.q_full[c], 1);
      ptx::mbarrier_init(&smem.q_empty[c], 4);  // one arrival per warp of consumer c
    }
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.v_full[s], 1);
      ptx::mbarrier_init(&smem.k_empty[s], Cfg::kConsumers * 4);  // one arrival per consumer warp
      ptx::mbarrier_init(&smem.v_empty[s], Cfg::kConsumers * 4);
    }
    ptx::mbarrier_init(&smem.v_landed, 1);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
    // Split-KV: the combine kernel may launch now (one thread issues it for the CTA). Its CTAs
    // take the SMs this grid leaves free and wait there for this grid to finish, so its launch
    // no longer follows the last CTA's exit.
    if constexpr (kRuntimeBounds) {
      if (p.splits > 1) ptx::griddepcontrol_launch_dependents();
    }
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  if (warpgroup < 0) {
    // Producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads.
    ptx::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) {
      int kv = 0;      // K/V tiles loaded so far: the ring position
      int uses = 0;    // items loaded so far: Q's phase
      int landed = 0;  // V tiles whose tail was zeroed so far: v_landed's phase
      for (int round = 0, w = sched.position(0); w < sched.total(); w = sched.position(++round)) {
        const PartItem item = sched.item<kFastDivide>(w);
        const Sequence seq = sequence_of<kRuntimeBounds>(p, item.batch);
        const KvTileRange range = item_tiles(item, seq);
        const int n_tiles = range.last - range.first;
        if (n_tiles == 0) continue;
        const int block_row = block_of(item) * kBlockM;  // the block's first row
        const int head_kv = pack_shift > 0 ? item.head_q : kv_head_of(item.head_q);  // packed: a K/V head's item
        // Q in two halves, one per consumer, each loaded as soon as its consumer is done with
        // it. WAR: consumer c's last S of the previous item has finished reading its rows.
#pragma unroll
        for (int c = 0; c < Cfg::kConsumers; ++c) {
          if (uses > 0) ptx::mbarrier_wait(&smem.q_empty[c], (uses - 1) % 2);
          ptx::mbarrier_arrive_expect_tx(&smem.q_full[c], 64 * D * sizeof(T));
#pragma unroll
          for (int cb = 0; cb < Cfg::kColBlocks; ++cb) {
            if constexpr (kRuntimeBounds)  // (column, head in the group, head group, position, batch)
              ptx::cp_async_bulk_tensor_5d_g2s(smem.q[cb] + c * 64 * Cfg::kAtomCols, &q_map, cb * Cfg::kAtomCols, 0,
                                               item.head_q,
                                               seq.q_start + ((block_row + c * 64) >> pack_shift), seq.batch_coord,
                                               &smem.q_full[c]);
            else
              ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb] + c * 64 * Cfg::kAtomCols, &q_map, cb * Cfg::kAtomCols,
                                               block_row + c * 64,
                                               item.head_q, seq.batch_coord, &smem.q_full[c]);
          }
        }
        ++uses;
        for (int tile = 0; tile < n_tiles; ++tile, ++kv) {
          const int stage = kv % Cfg::kStages;
          // WAR: the consumers have released this stage's K (then V) of its previous use,
          // kv - kStages, whose phase parity is (kv / kStages - 1) % 2.
          const bool reused = kv >= Cfg::kStages;
          const uint32_t previous_use = reused ? (kv / Cfg::kStages - 1) % 2 : 0;
          if (reused) ptx::mbarrier_wait(&smem.k_empty[stage], previous_use);
          // In a variable-length batch the last tile may run into the next sequence's keys:
          // the consumers mask them like keys past Sk (which TMA fills with zeros).
          const int key = (range.first + tile) * kBlockN;  // the tile's first key in the sequence
          int kv_row = seq.k_start + key, kv_entry = seq.kv_entry;
          if (kRuntimeBounds && p.block_table != nullptr) {
            // A paged cache: the tile is rows key % page_size onward of one page (page_size is
            // a multiple of kBlockN), the page clamped to the cache.
            const int page = __ldg(p.block_table + int64_t(seq.kv_entry) * p.max_pages_per_seq + key / p.page_size);
            kv_entry = min(max(page, 0), p.num_pages - 1);
            kv_row = key % p.page_size;
          }
          load_tile<T, D, kWide, kNumConsumers>(smem.k[stage], &k_map, kv_row, head_kv, kv_entry, &smem.k_full[stage]);
          if constexpr (kPrefetchNextQ) {
            // With the item's last K tile, the next item's Q into L2: its load waits for this
            // item's last S, and would then take longer from memory than the consumers' last
            // PV and epilogue do.
            const int next = tile + 1 == n_tiles ? sched.position(round + 1) : sched.total();
            if (next < sched.total()) {
              const PartItem after = sched.item<kFastDivide>(next);
#pragma unroll
              for (int c = 0; c < Cfg::kConsumers; ++c)
#pragma unroll
                for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
                  ptx::cp_async_bulk_prefetch_tensor_4d_l2(&q_map, cb * Cfg::kAtomCols,
                                                           block_of(after) * kBlockM + c * 64, after.head_q, after.batch);
            }
          }
          if (reused) ptx::mbarrier_wait(&smem.v_empty[stage], previous_use);
          const int valid = seq.seqlen_k - key;  // keys of the tile inside the sequence
          if (kRuntimeBounds && valid < kBlockN) {
            // The rows past the sequence's end hold anything: the next sequence's keys, a
            // cache's unused rows. Their weights are 0, but 0 x NaN is NaN in P V. So the tile
            // first lands on v_landed; then (one async copy after the other, the first seen
            // complete) zeros overwrite those rows, and that copy completes v_full. K needs
            // nothing: its masked scores are set to -inf.
            load_tile<T, D, kWide, kNumConsumers>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry, &smem.v_landed);
            ptx::mbarrier_wait(&smem.v_landed, landed++ % 2);
            const uint32_t zero_bytes = uint32_t(kBlockN - valid) * kSwizzleBytes;  // per 64-column block
            ptx::mbarrier_arrive_expect_tx(&smem.v_full[stage], zero_bytes * Cfg::kColBlocks);
#pragma unroll
            for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
              ptx::cp_async_bulk_g2s(smem.v[stage][cb] + valid * 64, g_zero_rows, zero_bytes, &smem.v_full[stage]);
          } else if constexpr (kFp8) {  // V^T: v_map is over the transposed copy
            load_vt_tile<T, D, kWide, kNumConsumers>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry,
                                                     &smem.v_full[stage]);
          } else {
            load_tile<T, D, kWide, kNumConsumers>(smem.v[stage], &v_map, kv_row, head_kv, kv_entry, &smem.v_full[stage]);
          }
        }
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegisters>();

  // Descriptors built once: this consumer's Q rows, and the first stage's K and V (column block
  // 0). A tile's K and V descriptors add the stage's byte offset before the tile's waits, and
  // each k16 step a constant (advance_smem_desc), instead of building each from its address.
  // Q and K K-major: 128-byte swizzle, or 64-byte (8-row atoms of 512 bytes) for FP8 at D = 64.
  const auto qk_desc = [](const void* tile) {
    return Cfg::kRowBytes == 128 ? ptx::make_smem_desc_sw128(tile, 16, kAtomBytes)
                                 : ptx::make_smem_desc_sw64(tile, 16, 8 * Cfg::kRowBytes);
  };
  const uint64_t q_desc = qk_desc(smem.q[0] + warpgroup * 64 * Cfg::kAtomCols);
  const uint64_t k_desc = qk_desc(smem.k[0][0]);
  // V N-major (LBO: the step between 64-column blocks), or FP8's V^T K-major (LBO unused).
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0][0], kFp8 ? 16 : kBlockN * kSwizzleBytes, kAtomBytes);
  constexpr uint32_t kKStageBytes = sizeof(smem.k[0]), kVStageBytes = sizeof(smem.v[0]);

  const int warp_row = warpgroup * 64 + warp_in_wg * 16;  // first row of this warp inside the CTA tile
  float scale_log2 = p.scale * kLog2e;  // c: 2^(s c) = e^(scale s)
  // FP8: scores are in units of q's and k's e4m3 codes, so each item folds its heads' descales
  // into scale_log2 too, and the epilogue scales O by v's (read there: registers are short).
  auto descales_at = [&](const WorkItem& item) {
    return int64_t(item.batch) * p.heads_kv + kv_head_of(item.head_q);  // [B][Hkv]
  };
  // The turn goes round the consumers: 0 -> 1 (-> 2) -> 0.
  const int my_turn = kTurnConsumer0 + warpgroup;
  const int next_turn = kTurnConsumer0 + (warpgroup + 1) % Cfg::kConsumers;

  float o[kDTiles * 4];              // O: n8 tile dt holds columns 8 dt + 2 t + {0, 1}
  // FP8: one tile's P V, added to O by the CUDA cores. Hopper's FP8 wgmma adds into its
  // accumulators with about 14 bits kept (DeepSeek-V3's report), so O summed over a long
  // sweep inside the wgmmas drifted (python -m hattn.bench_fp8 at 16k keys: 0.086 off cuDNN's
  // output summed there, 0.070 summed here; most of the rest was P's rounding, see kFp8PLog2).
  float o_tile[kFp8 ? kDTiles * 4 : 1];
  // FP8 with kPvTilesPerSum > 1: o_tile holds the P V of an item's tiles since the last one
  // whose index is a multiple of kPvTilesPerSum. The index is ring - kv: a counter, or even a
  // constexpr local here, changed ptxas's code for the bf16 kernels.
  float s[kNTiles * 4];              // S / P of the current tile
  float row_max[2];                  // running max of the raw scores s
  float row_sum[2];                  // running sum of 2^(x - max) over this thread's columns
  uint32_t p_frag[kPSteps][4];       // P of the previous tile, as wgmma A fragments
  float alpha[2];                    // the previous tile's rescale factor, not yet applied to O
  bool rescale = false;              // some alpha of this warp is not 1: O *= alpha is needed
  int kv = 0;                        // K/V tiles consumed so far: the ring position
  int uses = 0;                      // items with keys so far: Q's phase

  // O *= alpha, then O += P V(tile) issued (not waited for). PV of the tile before has
  // completed, so O is not being written; P and the rescaled O are fenced in before the wgmmas
  // read them. `ring` is the tile's position in the K/V ring.
  auto issue_pv = [&](int ring) {
    if (rescale) {  // warp-uniform
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[dt * 4 + 0] *= alpha[0];
        o[dt * 4 + 1] *= alpha[0];
        o[dt * 4 + 2] *= alpha[1];
        o[dt * 4 + 3] *= alpha[1];
      }
      if constexpr (Cfg::kSumsPvTiles) {
        if ((ring - kv) % Cfg::kPvTilesPerSum != 0) {  // o_tile's tiles, not yet in O, follow the max too
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o_tile[dt * 4 + 0] *= alpha[0];
            o_tile[dt * 4 + 1] *= alpha[0];
            o_tile[dt * 4 + 2] *= alpha[1];
            o_tile[dt * 4 + 3] *= alpha[1];
          }
        }
      }
    }
    // The stage's V descriptor, before the wait: after it, each wgmma adds only a constant.
    uint64_t v_stage_desc = ptx::advance_smem_desc(v_desc, ring % Cfg::kStages * kVStageBytes);
    ptx::fence_operand(v_stage_desc);
    ptx::mbarrier_wait(&smem.v_full[ring % Cfg::kStages], (ring / Cfg::kStages) % 2);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o_tile[i]);
    }
    ptx::wgmma_fence();
    // Per 16 keys one wgmma with N = D. V is read N-major: 16 keys = 2048 bytes down the tile;
    // the 64-column blocks are kBlockN * 128 bytes apart (LBO). FP8: per 32 keys, 32 bytes along
    // V^T's rows.
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      if constexpr (kFp8) {
        ptx::WgmmaM64K32<T, D>::rs(o_tile, p_frag[kk], ptx::advance_smem_desc(v_stage_desc, kk * 32),
                                   kk > 0 || (Cfg::kSumsPvTiles && (ring - kv) % Cfg::kPvTilesPerSum != 0));
      } else {
        const uint32_t v_bytes = kk * 16 * 64 * sizeof(T);
        ptx::WgmmaM64K16<T, D>::template rs<1>(o, p_frag[kk], ptx::advance_smem_desc(v_stage_desc, v_bytes), 1);
      }
    }
    ptx::wgmma_commit_group();
  };
  // After wait_group<0>: PV has read V and P; release V's stage (FP8: and add o_tile's P V to
  // O every kPvTilesPerSum tiles; flush_o_tile adds what an item's last tiles leave).
  auto finish_pv = [&](int ring) {
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::fence_operand(p_frag[kk][i]);
    if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[ring % Cfg::kStages]);
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o_tile[i]);
      if (!Cfg::kSumsPvTiles || (ring - kv) % Cfg::kPvTilesPerSum == Cfg::kPvTilesPerSum - 1) {
#pragma unroll
        for (int i = 0; i < kDTiles * 4; ++i) o[i] += o_tile[i];
      }
    }
  };

  for (int round = 0, w = sched.position(0); w < sched.total(); w = sched.position(++round)) {
    const PartItem item = sched.item<kFastDivide>(w);
    const Sequence seq = sequence_of<kRuntimeBounds>(p, item.batch);
    const int causal_offset = kRuntimeBounds ? seq.seqlen_k - seq.seqlen_q : p.causal_offset;  // the sequence's diagonal
    const int m_block = block_of(item) * kBlockM;
    if (kRuntimeBounds && m_block >= seq.seqlen_q << pack_shift) continue;  // past a short sequence of a varlen batch
    const KvTileRange range = item_tiles(item, seq);
    const int n_tiles = range.last - range.first;
    // This warpgroup's own sweep: the item's first wg_tiles tiles (kOwnSweeps, below).
    int wg_tiles = n_tiles;
    if constexpr (kOwnSweeps) {
      const int rows_end = seq.seqlen_q << pack_shift;  // packed rows
      const int wg_row0 = m_block + warpgroup * 64;
      // Without own sweeps, the causal mask's last key is the block's (its last row's).
      const bool own = sched.own_sweeps;
      const int wg_row_end = min(m_block + (own ? (warpgroup + 1) * 64 : kBlockM), rows_end);
      if (wg_row0 >= rows_end && (own || !p.causal)) {
        wg_tiles = 0;  // rows past the sequence see no key
      } else if (p.causal) {
        const int key_end = min(seq.seqlen_k, ((wg_row_end - 1) >> pack_shift) + 1 + causal_offset);
        wg_tiles = min(n_tiles, max(0, (key_end + kBlockN - 1) / kBlockN - range.first));
      }
    }
    const int row0 = m_block + warp_row + group;  // this thread's rows: row0 and row0 + 8 (packed rows)
    // The query head of a (packed) row: the item's head, or with GQA packing its group's head
    // row % 2^pack_shift. The row's query position is row >> pack_shift.
    auto head_of = [&](int row) { return (item.head_q << pack_shift) + (row & ((1 << pack_shift) - 1)); };
    if constexpr (kFp8) {
      const int64_t at = descales_at(item);
      scale_log2 = p.scale * (p.q_descale != nullptr ? __ldg(p.q_descale + at) : 1.f) *
                   (p.k_descale != nullptr ? __ldg(p.k_descale + at) : 1.f) * kLog2e;
    }

#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) o[i] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[r] = -INFINITY, row_sum[r] = 0.f, alpha[r] = 1.f;
    rescale = false;

    // One K/V tile of this item: S(t) and, after the first tile, PV(t - 1) issued in the turn,
    // then the softmax of t beside PV(t - 1). kHasPrevious is a compile-time flag: a wgmma
    // under a run-time branch makes ptxas serialize every wgmma of the kernel (C7518), so the
    // first tile is peeled off instead.
    auto step = [&](int tile, auto has_previous) {
      constexpr bool kHasPrevious = decltype(has_previous)::value;
      const int ring = kv + tile;
      const int stage = ring % Cfg::kStages;
      const int n_start = (range.first + tile) * kBlockN;

      // The stage's K descriptor, before the waits: in the turn, each wgmma adds only a constant.
      uint64_t k_stage_desc = ptx::advance_smem_desc(k_desc, stage * kKStageBytes);
      ptx::fence_operand(k_stage_desc);
      // In the turn: S(t) = Q K(t)^T, then PV(t - 1) right behind it.
      ptx::mbarrier_wait(&smem.k_full[stage], (ring / Cfg::kStages) % 2);
      ptx::bar_sync(my_turn, kTurnThreads);  // wait for the turn: the previous warpgroup has issued its GEMMs
#pragma unroll
      for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kSSteps; ++kk) {
        // Q's block kk / 4 and K's, k step kk % 4 inside it (32 bytes per step).
        const uint32_t q_bytes = kk / 4 * sizeof(smem.q[0]) + kk % 4 * 32;
        const uint32_t k_bytes = kk / 4 * sizeof(smem.k[0][0]) + kk % 4 * 32;
        if constexpr (kFp8)
          ptx::WgmmaM64K32<T, kBlockN>::ss(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                           ptx::advance_smem_desc(k_stage_desc, k_bytes), kk > 0);
        else
          ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                                       ptx::advance_smem_desc(k_stage_desc, k_bytes), kk > 0);
      }
      ptx::wgmma_commit_group();
      if constexpr (kHasPrevious) issue_pv(ring - 1);
      // Pass the turn on, also after an item's last tile: the turn runs across items.
      ptx::bar_arrive(next_turn, kTurnThreads);
      ptx::wgmma_wait_group<kHasPrevious ? 1 : 0>();  // S(t) has completed; PV(t - 1) may still run
#pragma unroll
      for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
      if (lane == 0) {
        ptx::mbarrier_arrive(&smem.k_empty[stage]);                 // S(t) has read K(t)
        if (tile + 1 == wg_tiles) ptx::mbarrier_arrive(&smem.q_empty[warpgroup]);  // our last S has read our Q rows
      }

      if constexpr (kRuntimeBounds) {
        // Softcapping: s -> tanh(s scale / softcap) (the exponent's scale is then the softcap),
        // before the mask, whose -inf must stay -inf.
        if (p.softcap_scale > 0.f) {
#pragma unroll
          for (int i = 0; i < kNTiles * 4; ++i) s[i] = ptx::tanh_approx_f32(s[i] * p.softcap_scale);
        }
      }

      // Masked entries to -inf (only tiles crossing Sk or an edge of the mask: the diagonal
      // under causal, window_right keys past it, or window_left keys before it). The warp's
      // first row has the nearest right edge, its last row (+ 15) the farthest left edge.
      const int warp_diagonal = ((m_block + warp_row) >> pack_shift) + causal_offset;
      bool need_mask;
      if constexpr (kWindow)
        need_mask = n_start + kBlockN > seq.seqlen_k ||
                    (p.window_right >= 0 && n_start + kBlockN - 1 > warp_diagonal + p.window_right) ||
                    (p.window_left >= 0 && n_start < warp_diagonal + 15 - p.window_left);
      else
        need_mask = n_start + kBlockN > seq.seqlen_k || (p.causal && n_start + kBlockN - 1 > warp_diagonal);
      if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n_start + nt * 8 + 2 * tig + e % 2;
            const int row = (row0 + e / 2 * 8) >> pack_shift;  // the query position
            bool hidden;
            if constexpr (kWindow)
              hidden = col >= seq.seqlen_k || (p.window_right >= 0 && col > row + causal_offset + p.window_right) ||
                       (p.window_left >= 0 && col < row + causal_offset - p.window_left);
            else
              hidden = col >= seq.seqlen_k || (p.causal && col > row + causal_offset);
            if (hidden) s[nt * 4 + e] = -INFINITY;
          }
      }

      // Online softmax (a row lives in the 4 threads of a quad), beside PV(t - 1), on raw
      // scores: the max commutes with the positive scale, which is folded into the exponent,
      // 2^(s c - m c) with c = scale log2(e), one FFMA. alpha(t) is applied to O just before
      // PV(t) is issued, and only if it is not 1.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // A row with no visible key yet subtracts 0, not -inf: weights 0, not NaN.
        const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
        const float p_offset = kFp8 ? m_scaled - kFp8PLog2 : m_scaled;  // FP8: 2^8 P
        // Exactly 1 when the max is unchanged (the compiler may fuse the exponent into an FFMA,
        // which would leave a rounding error instead of 0), so that the rescale can be skipped.
        alpha[r] = m == row_max[r] ? 1.f : ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - m_scaled);
        row_max[r] = m;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float x = fmaf(s[nt * 4 + e], scale_log2, -p_offset);
            s[nt * 4 + e] = nt % 4 < Cfg::kFmaExp2Tiles ? exp2_fma(x) : ptx::ex2_approx_ftz_f32(x);
            sum += s[nt * 4 + e];
          }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
      }
      rescale = __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);

      if constexpr (kHasPrevious) {
        ptx::wgmma_wait_group<0>();  // PV(t - 1) has completed: P(t - 1)'s registers are free
        finish_pv(ring - 1);
      }
      if constexpr (kFp8) {
        // P(t) as e4m3 A fragments, one per 32 keys (S tiles 4kk .. 4kk+3). A fragment holds k
        // 4t .. 4t+3 (registers 0, 1: rows g, g+8) and 16 + 4t .. 16 + 4t+3 (2, 3), where the
        // accumulator gives a thread columns 2t, 2t+1 of each tile: k 4t + j takes tile 4kk + j / 2's
        // column 2t + j % 2 (then tiles 4kk+2, 4kk+3). The sum over keys does not care, as long as
        // V^T's copy holds its keys in the same order (kVtKeyOrder).
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          const float* t = s + 16 * kk;
          p_frag[kk][0] = frag::pack4_e4m3(t[0], t[1], t[4], t[5]);
          p_frag[kk][1] = frag::pack4_e4m3(t[2], t[3], t[6], t[7]);
          p_frag[kk][2] = frag::pack4_e4m3(t[8], t[9], t[12], t[13]);
          p_frag[kk][3] = frag::pack4_e4m3(t[10], t[11], t[14], t[15]);
        }
      } else {
        // P(t) as wgmma A fragments, one per 16 keys: S tiles 2kk and 2kk+1, rows g and g+8.
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          p_frag[kk][0] = frag::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
          p_frag[kk][1] = frag::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
          p_frag[kk][2] = frag::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
          p_frag[kk][3] = frag::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
        }
      }
    };

    // Computes tiles [0, tiles) of the item: S(0), then each tile's S with the PV before it,
    // then the last PV.
    auto sweep = [&](int tiles) {
      step(0, std::false_type{});
      for (int tile = 1; tile < tiles; ++tile) step(tile, std::true_type{});
      issue_pv(kv + tiles - 1);  // the last tile's PV
      ptx::wgmma_wait_group<0>();
      finish_pv(kv + tiles - 1);
      if constexpr (Cfg::kSumsPvTiles) {
        if (tiles % Cfg::kPvTilesPerSum != 0) {  // the last tiles
#pragma unroll
          for (int i = 0; i < kDTiles * 4; ++i) o[i] += o_tile[i];
        }
      }
    };

    // Passes tiles [from, n_tiles) of the item on without computing them: the warpgroup keeps
    // its part of the barrier protocol, each arrival after the wait that opens the phase it
    // belongs to: k_empty after k_full, v_empty after v_full, q_empty after q_full (the
    // producer's wait for the previous phase has then completed, so an arrival never counts
    // toward a phase the busy warpgroups are still in). q_empty only if no S of ours read Q.
    auto pass_tiles = [&](int from) {
      for (int tile = from; tile < n_tiles; ++tile) {
        const int ring = kv + tile, stage = ring % Cfg::kStages;
        const uint32_t parity = (ring / Cfg::kStages) % 2;
        ptx::mbarrier_wait(&smem.k_full[stage], parity);
        ptx::bar_sync(my_turn, kTurnThreads);  // pass the turn straight on
        ptx::bar_arrive(next_turn, kTurnThreads);
        ptx::mbarrier_wait(&smem.v_full[stage], parity);
        if (lane == 0) {
          ptx::mbarrier_arrive(&smem.k_empty[stage]);
          ptx::mbarrier_arrive(&smem.v_empty[stage]);
          if (from == 0 && tile + 1 == n_tiles) ptx::mbarrier_arrive(&smem.q_empty[warpgroup]);
        }
      }
    };

    // A warpgroup whose 64 rows all lie past the sequence's queries computes nothing. Decoding
    // (one query per sequence, or a few packed GQA heads) leaves every consumer but the first
    // without rows, and their GEMMs and exponentials took the tensor cores and MUFU from it. It
    // passes the item's tiles on and skips the epilogue, which would store nothing. Only in the
    // run-time-bounds kernels without a window, which decoding from a KV cache takes (sequence
    // lengths, split-KV, GQA packing): in the window's kernels the path made ptxas spill 24
    // bytes at D = 128 (budget 12), and in the dense ones it cost prefill 2.7% at D = 64,
    // causal, 16k on the H200 (results/evidence/idle_consumers/run2/). Elsewhere it sweeps
    // the item like the others, or with own sweeps (below) passes it on with wg_tiles = 0.
    constexpr bool kSkipsIdleConsumers = kRuntimeBounds && !kWindow;
    if constexpr (kSkipsIdleConsumers) {
      if (n_tiles > 0 && m_block + warpgroup * 64 >= seq.seqlen_q << pack_shift) {
        ptx::mbarrier_wait(&smem.q_full[warpgroup], uses % 2);
        if (warpgroup == Cfg::kConsumers - 1 && uses == 0) ptx::bar_arrive(kTurnConsumer0, kTurnThreads);
        pass_tiles(0);
        kv += n_tiles;
        ++uses;
        continue;
      }
    }

    // An item whose rows see no key (causal with Sq > Sk, or a window) skips the GEMMs and loads nothing:
    // O = 0, LSE = -inf below. With kOwnSweeps a warpgroup computes its own wg_tiles and passes
    // the rest on; a wgmma under a run-time branch inside the pipeline would make ptxas
    // serialize them all (C7518), so the branch wraps its whole sweep.
    if (n_tiles > 0) {
      ptx::mbarrier_wait(&smem.q_full[warpgroup], uses % 2);  // this item's Q rows have landed
      // Consumer 0 goes first; after the first item the turn comes from the tiles before.
      if (warpgroup == Cfg::kConsumers - 1 && uses == 0) ptx::bar_arrive(kTurnConsumer0, kTurnThreads);
      if constexpr (kOwnSweeps) {
        if (wg_tiles > 0) sweep(wg_tiles);
        pass_tiles(wg_tiles);
      } else {
        sweep(n_tiles);
      }
      kv += n_tiles;
      ++uses;
    }

    // Epilogue: finish the row sums across the quad; rows that saw no key output 0, LSE -inf.
    // The epilogue reads its sequence again instead of using the loop's copy: with the copy,
    // ptxas spilled 72 bytes in the varlen + window kernel at D = 128, and 0 with the re-read.
    const Sequence out_seq = sequence_of<kRuntimeBounds>(p, item.batch);
    // A row that saw a key has row_sum >= 1 (its max adds 2^0), so the hardware reciprocal and
    // logarithm (__fdividef, __logf: MUFU; a few ulp there, the log within 4e-7 near 1) replace
    // the IEEE division and logf, whose range checks and polynomial lengthen the serial chain at
    // each item's end.
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      inv_sum[r] = row_sum[r] > 0.f ? __fdividef(1.f, row_sum[r]) : 0.f;
    }
    if constexpr (kFp8) {
      if (p.v_descale != nullptr) {
        const float v_scale = __ldg(p.v_descale + descales_at(item));
        inv_sum[0] *= v_scale;
        inv_sum[1] *= v_scale;
      }
    }
    // A part's row r of the thread (split-KV or a cut tail item): its O, normalized by its own
    // sum, and its LSE, in fp32 at `index` of the partial layout for the combine step; -inf and
    // zeros where the part saw no key. A quad writes 32 contiguous bytes per n8 tile.
    auto store_partial_row = [&](int r, int64_t index) {
      if (tig == 0) p.lse_partial[index] = row_sum[r] > 0.f ? row_max[r] * p.scale + __logf(row_sum[r]) : -INFINITY;
      float* o_row = p.o_partial + index * D;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt)
        *reinterpret_cast<float2*>(o_row + dt * 8 + 2 * tig) =
            make_float2(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
    };
    if (kRuntimeBounds && p.splits > 1) {
      // Split-KV: partials at [part][batch][head][row].
      const bool packed = p.cu_seqlens_q != nullptr;
      const int rows = packed ? p.total_q : p.seqlen_q;
      const int part = split_mod(item.m_block);
      const int64_t part_heads0 = (int64_t(part) * (packed ? 1 : p.batch) + (packed ? 0 : item.batch)) * p.heads_q;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= out_seq.seqlen_q << pack_shift) continue;
        const int head = head_of(row);
        store_partial_row(r, (part_heads0 + head) * rows + out_seq.q_start + (row >> pack_shift));
      }
      continue;  // the combine step writes out and lse
    }
    if (!kWindow && item.parts > 1) {
      // A part of a cut tail item: as split-KV's parts, at [tail item][part][row of the block]
      // (rows past Sq are left unwritten; the combine step skips them).
      const int64_t slot = (int64_t(item.tail) * item.parts + item.part) * kBlockM;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= p.seqlen_q) continue;
        store_partial_row(r, slot + (row - m_block));
      }
      continue;  // the combine step writes out and lse
    }
    // LSE = ln(sum_j e^(scale s_j)) = scale max + ln(sum), max in raw units. [B, Hq, Sq], or
    // [Hq, total_q] in a variable-length batch.
    if (p.lse != nullptr && tig == 0) {
      const bool packed = kRuntimeBounds && p.cu_seqlens_q != nullptr;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        const int head = head_of(row);
        const int64_t index = packed ? int64_t(head) * p.total_q + out_seq.q_start + (row >> pack_shift)
                                     : (int64_t(item.batch) * p.heads_q + head) * p.seqlen_q + (row >> pack_shift);
        if (row < out_seq.seqlen_q << pack_shift)
          p.lse[index] = row_sum[r] > 0.f
                             ? kFp8 ? row_max[r] * (scale_log2 / kLog2e) + __logf(row_sum[r]) - kFp8PLog2 / kLog2e
                                    : row_max[r] * p.scale + __logf(row_sum[r])
                             : -INFINITY;
      }
    }
    if constexpr (Cfg::kStoreByTma) {
      const int epilogue_barrier = kEpilogueConsumer0 + warpgroup;
      const bool storer = warp_in_wg == 0 && lane == 0;  // issues this warpgroup's stores
      // WAR: the previous item's store has read the staging rows before they are rewritten.
      if (storer) ptx::cp_async_bulk_wait_group_read<0>();
      ptx::bar_sync(epilogue_barrier, 128);
      // Element (row, col) of column block cb sits at row * 64 + ((col / 8) ^ (row % 8)) * 8
      // + col % 8, TMA's 128-byte swizzle: the 8 rows x 4 threads of a warp's write hit 32
      // distinct banks.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row + group + r * 8;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          *reinterpret_cast<uint32_t*>(&smem.o[dt / 8][row * 64 + ((dt % 8) ^ (row % 8)) * 8 + 2 * tig]) =
              frag::pack2<OutT>(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
      }
      ptx::fence_proxy_async_shared_cta();  // this thread's writes, before the TMA unit reads them
      ptx::bar_sync(epilogue_barrier, 128);  // RAW: the warpgroup's 64 rows are all written and fenced
      // A TMA store writes all 64 rows of the box and clips only at the tensor's end. In a
      // variable-length batch that is the last sequence's end: a box that runs past its own
      // sequence would overwrite the next one's rows, so the warpgroup copies the rows inside
      // it from the staging tile instead, 16 bytes per thread and step (warpgroup-uniform).
      const int box_row0 = m_block + warpgroup * 64;  // in the sequence (packed rows)
      if (!kRuntimeBounds || p.cu_seqlens_q == nullptr || box_row0 + 64 <= out_seq.seqlen_q << pack_shift) {
        if (storer) {
#pragma unroll
          for (int cb = 0; cb < Cfg::kOutColBlocks; ++cb) {
            if constexpr (kRuntimeBounds)  // the 5-D box of the Q load
              ptx::cp_async_bulk_tensor_5d_s2g(&o_map, cb * 64, 0, item.head_q,
                                               out_seq.q_start + (box_row0 >> pack_shift), out_seq.batch_coord,
                                               &smem.o[cb][warpgroup * 64 * 64]);
            else
              ptx::cp_async_bulk_tensor_4d_s2g(&o_map, cb * 64, box_row0, item.head_q, out_seq.batch_coord,
                                               &smem.o[cb][warpgroup * 64 * 64]);
          }
          ptx::cp_async_bulk_commit_group();
        }
      } else {
        constexpr int kChunks = D / 8;  // 16-byte pieces of a row
        const int rows = (out_seq.seqlen_q << pack_shift) - box_row0;  // < 64; the item has at least one
        OutT* out = static_cast<OutT*>(p.out) + int64_t(out_seq.q_start) * p.out_seq_stride;  // a varlen batch: no batch
        for (int i = int(threadIdx.x) % 128; i < rows * kChunks; i += 128) {
          const int r = i / kChunks, c = i % kChunks;  // the tile's row warpgroup * 64 + r: swizzled by r % 8
          const int row = box_row0 + r;
          const int head = head_of(row);
          *reinterpret_cast<uint4*>(out + int64_t(row >> pack_shift) * p.out_seq_stride + head * p.out_head_stride +
                                    c * 8) =
              *reinterpret_cast<const uint4*>(&smem.o[c / 8][(warpgroup * 64 + r) * 64 + ((c % 8) ^ (r % 8)) * 8]);
        }
      }
    } else {
      OutT* out = static_cast<OutT*>(p.out) + out_seq.batch_coord * p.out_batch_stride +
               out_seq.q_start * p.out_seq_stride;  // the sequence's [Sq, H, D] rows
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        const int head = head_of(row);
        OutT* out_row = out + int64_t(row >> pack_shift) * p.out_seq_stride + head * p.out_head_stride;
        // A 4 x 4 transpose across the quad: thread t gets the four threads' pairs of n8 tile
        // 4k + t, 8 contiguous elements, and writes them as one 16-byte store. Every row is
        // 16-byte aligned: the API checks out's pointer and its strides (multiples of 8
        // elements over every dimension longer than 1). All four threads of the quad shuffle,
        // also on rows past Sq; only rows inside it store.
#pragma unroll
        for (int k = 0; k < kDTiles / 4; ++k) {
          uint32_t a[4];
#pragma unroll
          for (int j = 0; j < 4; ++j)
            a[j] = frag::pack2<OutT>(o[(4 * k + j) * 4 + 2 * r] * inv_sum[r],
                                     o[(4 * k + j) * 4 + 2 * r + 1] * inv_sum[r]);
          const bool hi = tig & 2, odd = tig & 1;
          uint32_t s0 = hi ? a[0] : a[2], s1 = hi ? a[1] : a[3];
          s0 = __shfl_xor_sync(0xffffffffu, s0, 2);
          s1 = __shfl_xor_sync(0xffffffffu, s1, 2);
          if (hi) { a[0] = s0; a[1] = s1; } else { a[2] = s0; a[3] = s1; }
          s0 = odd ? a[0] : a[1];
          s1 = odd ? a[2] : a[3];
          s0 = __shfl_xor_sync(0xffffffffu, s0, 1);
          s1 = __shfl_xor_sync(0xffffffffu, s1, 1);
          if (odd) { a[0] = s0; a[2] = s1; } else { a[1] = s0; a[3] = s1; }
          if (row < out_seq.seqlen_q << pack_shift)
            *reinterpret_cast<uint4*>(out_row + (4 * k + tig) * 8) = make_uint4(a[0], a[1], a[2], a[3]);
        }
      }
    }
  }
  // The last consumer's hand-off after the last tile has no next tile to open: take it, so
  // that no named barrier is left half-arrived when the CTA exits.
  if (warpgroup == 0 && uses > 0) ptx::bar_sync(kTurnConsumer0, kTurnThreads);
  // The shared-memory source of the last store must stay allocated until the copy has read it.
  if constexpr (Cfg::kStoreByTma) {
    if (warp_in_wg == 0 && lane == 0) ptx::cp_async_bulk_wait_group<0>();
  }
}

// Split-KV's second step: one warp combines the `parts` fp32 results of one row, O = sum_s
// e^(lse_s - lse) O_s with lse = ln sum_s e^(lse_s), and writes `out` (in T) and `lse` (when
// not null). Part s's LSE is lse_parts[s * stride], its O row o_parts + s * stride * D. A lane
// holds two parts' LSEs (kMaxSplits = 64) and D / 32 columns. The parts' rows are loaded
// kCombineBatch at a time before any is summed: one part per load round trip kept a decoding
// combine with 16 parts at D = 256 at 10.5 us on the H200 (results/evidence/decode_profile/).
constexpr int kCombineBatch = 8;
template <typename T, int D>
__device__ __forceinline__ void combine_row(const float* lse_parts, const float* o_parts, int64_t stride, int parts,
                                            T* out, float* lse) {
  static_assert(kMaxSplits <= 64, "a lane holds two parts' LSEs");
  constexpr int kPerLane = D / 32;  // 2, 4 or 8 columns
  const int lane = int(threadIdx.x) % 32;
  const float lse0 = lane < parts ? lse_parts[lane * stride] : -INFINITY;
  const float lse1 = lane + 32 < parts ? lse_parts[(lane + 32) * stride] : -INFINITY;
  float m = fmaxf(lse0, lse1);
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  // No part saw a key: weights 0 (not NaN), output 0 and LSE -inf, as without splitting.
  const float w0 = m == -INFINITY ? 0.f : expf(lse0 - m), w1 = m == -INFINITY ? 0.f : expf(lse1 - m);
  float sum = w0 + w1;
#pragma unroll
  for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
  float acc[kPerLane] = {};
  for (int first = 0; first < parts; first += kCombineBatch) {
    float2 v[kCombineBatch][kPerLane / 2];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float* o = o_parts + (first + b) * stride * D + lane * kPerLane;
#pragma unroll
      for (int i = 0; i < kPerLane; i += 2)
        v[b][i / 2] = first + b < parts ? *reinterpret_cast<const float2*>(o + i) : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int part = first + b;
      const float w = part < parts ? __shfl_sync(0xffffffffu, part < 32 ? w0 : w1, part % 32) * inv_sum : 0.f;
      if (w == 0.f) continue;  // warp-uniform: a part without keys, or past the last, adds nothing
#pragma unroll
      for (int i = 0; i < kPerLane; i += 2) {
        acc[i] += w * v[b][i / 2].x;
        acc[i + 1] += w * v[b][i / 2].y;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; i += 2)
    *reinterpret_cast<uint32_t*>(out + lane * kPerLane + i) = frag::pack2<T>(acc[i], acc[i + 1]);
  if (lane == 0 && lse != nullptr) *lse = m == -INFINITY ? -INFINITY : m + logf(sum);
}

// Split-KV's combine: one warp per row of the partial layout [B][Hq][rows] (`rows_all` rows;
// B = 1 for a varlen batch), which is also the layout of lse.
template <typename T, int D>
__global__ void __launch_bounds__(128) combine_splits_kernel(const AttentionParams p, int64_t rows_all) {
  // The row's coordinates (64-bit divisions) do not depend on the attention kernel: worked
  // out while it still runs.
  const int64_t r = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  if (r >= rows_all) return;  // warp-uniform
  const bool packed = p.cu_seqlens_q != nullptr;
  const int rows = packed ? p.total_q : p.seqlen_q;
  const int row = int(r % rows);
  const int head = int(r / rows % p.heads_q), batch = int(r / rows / p.heads_q);  // batch 0 when packed
  T* out = static_cast<T*>(p.out) + int64_t(batch) * p.out_batch_stride + int64_t(row) * p.out_seq_stride +
           int64_t(head) * p.out_head_stride;
  // Launched as the attention kernel's programmatic dependent: its partials are complete and
  // visible only once this wait returns.
  ptx::griddepcontrol_wait();
  combine_row<T, D>(p.lse_partial + r, p.o_partial + r * D, rows_all, p.splits, out,
                    p.lse != nullptr ? p.lse + r : nullptr);
}

// The tail split's combine: one warp per row of the cut items' blocks, [tail item][row of the
// block], combining that row's parts (slots [tail item][part][row of the block]).
template <typename T, int D>
__global__ void __launch_bounds__(128) combine_tail_kernel(const AttentionParams p, const WorkList list, int block_m) {
  const int64_t r = int64_t(blockIdx.x) * 4 + threadIdx.x / 32;
  const int tail = int(r / block_m), row_in_block = int(r % block_m);
  if (tail >= list.tail_items()) return;  // warp-uniform
  const WorkItem item = list.sched.item(list.tail_start + tail);
  const int row = item.m_block * block_m + row_in_block;
  if (row >= p.seqlen_q) return;
  const int64_t slot = int64_t(tail) * list.tail_parts * block_m + row_in_block;
  T* out = static_cast<T*>(p.out) + int64_t(item.batch) * p.out_batch_stride + int64_t(row) * p.out_seq_stride +
           int64_t(item.head_q) * p.out_head_stride;
  float* lse = p.lse != nullptr ? p.lse + (int64_t(item.batch) * p.heads_q + item.head_q) * p.seqlen_q + row : nullptr;
  combine_row<T, D>(p.lse_partial + slot, p.o_partial + slot * D, block_m, list.tail_parts, out, lse);
}

// FP8: V^T's key order inside each 16 keys. Position l of V^T's row holds key kVtKeyOrder(l):
// the e4m3 A fragment's k 4t + j is the accumulator's column 2t + j % 2 of n8 tile j / 2 (see
// the P packing), so positions 4t .. 4t+3 hold keys 2t, 2t+1, 8 + 2t, 9 + 2t.
__host__ __device__ constexpr int kVtKeyOrder(int l) {
  return (l & 3) < 2 ? 2 * (l >> 2) + (l & 3) : 6 + 2 * (l >> 2) + (l & 3);
}

// V^T's copy: padded keys, a whole number of tiles.
constexpr int vt_keys(int seqlen_k) { return (seqlen_k + kVtTileKeys - 1) / kVtTileKeys * kVtTileKeys; }
inline size_t vt_bytes(const AttentionProblem& problem) {
  return size_t(problem.batch) * problem.heads_kv * problem.head_dim * size_t(vt_keys(problem.seqlen_k));
}

// FP8: V [B, Sk, Hkv, D] (any strides) -> V^T [B][Hkv][D][keys], keys = Sk rounded up to 128
// with zeros past Sk (their weights are 0, and 0 x 0 is 0 where 0 x NaN would not be), each 16
// keys in kVtKeyOrder. One CTA per 128 keys of a (batch, K/V head): the tile goes through
// shared memory, read in 16-byte rows of V; each thread then takes a 16-key x 4-column block,
// 16 words of the tile, and turns it into 16 bytes of 4 rows of V^T with byte permutes.
//
// The tile's 16-byte chunks are swizzled: chunk c of row r sits at c ^ (r / 16 % kChunks). A
// warp's read takes 4 adjacent words from one row of each of 8 key groups (rows 16 apart); the
// swizzle puts the 8 groups' words in 8 different chunks, so on 32 banks at D = 128 (2 ways at
// D = 64, whose rows have 4 chunks). Each of its stores writes 128 contiguous bytes of 4 V^T rows.
template <int D>
__global__ void __launch_bounds__(256) transpose_v_kernel(const AttentionParams p, uint8_t* vt, int keys) {
  constexpr int kChunks = D / 16;  // 16-byte pieces of a row of V
  constexpr int kGroups = kVtTileKeys / 16;
  __shared__ __align__(16) uint8_t tile[kVtTileKeys][D];
  const auto chunk_at = [](int row, int chunk) { return 16 * (chunk ^ (row / 16 % kChunks)); };
  const int first_key = int(blockIdx.x) * kVtTileKeys, head = int(blockIdx.y), batch = int(blockIdx.z);
  const uint8_t* v =
      static_cast<const uint8_t*>(p.v) + int64_t(batch) * p.v_batch_stride + int64_t(head) * p.v_head_stride;
  constexpr int kLoads = kVtTileKeys * kChunks / 256;
  uint4 x[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {  // all loads first: kLoads in flight per thread
    const int r = (int(threadIdx.x) + 256 * i) / kChunks, c = int(threadIdx.x) % kChunks, key = first_key + r;
    x[i] = key < p.seqlen_k ? *reinterpret_cast<const uint4*>(v + int64_t(key) * p.v_seq_stride + c * 16)
                            : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int r = (int(threadIdx.x) + 256 * i) / kChunks, c = int(threadIdx.x) % kChunks;
    *reinterpret_cast<uint4*>(&tile[r][chunk_at(r, c)]) = x[i];
  }
  __syncthreads();  // the whole tile has landed before any thread reads a column of it
  uint8_t* out = vt + ((int64_t(batch) * p.heads_kv + head) * D) * keys + first_key;
  for (int i = int(threadIdx.x); i < kGroups * (D / 4); i += 256) {
    const int group = i % kGroups, col = 4 * (i / kGroups);  // keys 16 group.., columns col..col + 3
    uint32_t w[16];  // w[l]: columns col..col + 3 of key kVtKeyOrder(l) of the group
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int r = group * 16 + kVtKeyOrder(l);
      w[l] = *reinterpret_cast<const uint32_t*>(&tile[r][chunk_at(r, col / 16) + col % 16]);
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {  // row col + b of V^T: byte b of each word, in order
      constexpr uint32_t kPair[4] = {0x40, 0x51, 0x62, 0x73};  // byte b of the first word, then of the second
      uint32_t row[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        row[q] = __byte_perm(__byte_perm(w[4 * q], w[4 * q + 1], kPair[b]),
                             __byte_perm(w[4 * q + 2], w[4 * q + 3], kPair[b]), 0x5410);
      *reinterpret_cast<uint4*>(out + int64_t(col + b) * keys + group * 16) = make_uint4(row[0], row[1], row[2], row[3]);
    }
  }
}

// The split plan of a problem: split-KV's parts (run-time bounds kernels), or the tail split
// (the others), and the size of their partial results.
struct SplitPlan {
  int splits = 1;        // split-KV parts; 1: unsplit
  int64_t rows_all = 0;  // rows of split-KV's partial layout, [B][Hq][rows]
  int tail_start = 0;    // tail split: the first cut item and the parts of each (1: none cut)
  int tail_parts = 1;
  size_t bytes = 0;      // workspace: fp32 partial outputs, then fp32 partial LSEs
};

// Three consumers on causal sweeps shorter than this (mean keys per block) each sweep only
// the tiles their own rows see (kOwnSweeps in the kernel). On the H200 at D = 64, on every
// causal sweep, that ran 1.048x at S = 2k and 1.022x at 4k, and 0.983x at 8k and 16k; below
// this, 1.04x at 2k and 1.01x at 4k, level elsewhere (results/evidence/wg_sweep/).
constexpr double kOwnSweepMaxKeys = 4096;

// `params` is make_params(problem), made once by launch(), which chose the kernel by its edges.
// split.splits > 1 (run-time bounds kernels only): split-KV with that many parts; or
// split.tail_parts > 1 (not the window's kernels): the tail split. Either in the caller's
// workspace or, without one, in memory taken here when it can be had.
template <typename T, int D, bool kWide, int kNumConsumers, bool kRuntimeBounds, bool kWindow>
Status launch_typed(const AttentionProblem& problem, const AttentionParams& params, const SplitPlan& split, int sms,
                    cudaStream_t stream) {
  using Cfg = ConfigOf<T, D, kWide, kNumConsumers>;
  constexpr int kSmem = smem_bytes<T, D, kWide, kNumConsumers>();
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(problem, 64, Cfg::kBlockN, kName, &maps);  // Q: one consumer's rows per box
  if (!s.ok()) return s;
  // The run-time bounds kernels take Q and O in 5-D boxes of head groups (one head each
  // unless GQA packing puts a K/V head's query heads into the rows).
  const int group = 1 << params.pack_shift;
  if constexpr (kRuntimeBounds) {
    s = make_grouped_bshd_tensor_map(&maps.q, problem.q, problem.dtype, problem.tensor_batch(), problem.tensor_rows_q(),
                                     problem.heads_q, D, problem.q_strides, group, 64, 64);
    if (!s.ok()) return {s.code(), std::string(kName) + ": q: " + s.message()};
  }
  CUtensorMap o_map{};  // only read when O leaves by TMA
  if constexpr (Cfg::kStoreByTma) {
    if constexpr (kRuntimeBounds)
      s = make_grouped_bshd_tensor_map(&o_map, problem.out, output_dtype(problem.dtype), problem.tensor_batch(),
                                       problem.tensor_rows_q(), problem.heads_q, D, problem.out_strides, group, 64, 64);
    else
      s = make_bshd_tensor_map(&o_map, problem.out, output_dtype(problem.dtype), problem.tensor_batch(),
                               problem.tensor_rows_q(), problem.heads_q, D, problem.out_strides, 64,
                               64);  // one consumer warpgroup's rows per box
    if (!s.ok()) return {s.code(), std::string(kName) + ": out: " + s.message()};
  }
  static_assert(kRuntimeBounds || !kWindow, "the windowed kernels also take run-time bounds");
  const auto kernel = coalesced_store_kernel<T, D, kWide, kNumConsumers, kRuntimeBounds, kWindow>;
  s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                  std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  // FP8: V is read through its transposed copy (8-bit wgmma operands are K-major only), made
  // first in the caller's workspace or in memory taken here on the stream (after every step
  // that can fail without freeing it).
  uint8_t* vt = nullptr;
  bool vt_owned = false;
  if constexpr (kIsFp8<T>) {
    const int keys = vt_keys(problem.seqlen_k);
    if (problem.workspace != nullptr) {  // forward() checked its size
      vt = static_cast<uint8_t*>(problem.workspace);
    } else {
      const size_t bytes = vt_bytes(problem);
      s = cuda_status(cudaMallocAsync(reinterpret_cast<void**>(&vt), bytes, stream),
                      std::string(kName) + ": cudaMallocAsync(V^T, " + std::to_string(bytes) + " bytes)");
      if (!s.ok()) return s;
      vt_owned = true;
    }
    transpose_v_kernel<D><<<dim3(unsigned(keys / kVtTileKeys), unsigned(problem.heads_kv), unsigned(problem.batch)), 256,
                            0, stream>>>(params, vt, keys);
    s = launch_status(kName);
    if (s.ok()) s = make_transposed_tensor_map(&maps.v, vt, problem.batch, problem.heads_kv, D, keys, kVtTileKeys);
    if (!s.ok()) {
      if (vt_owned) cudaFreeAsync(vt, stream);
      return {s.code(), std::string(kName) + ": V^T: " + s.message()};
    }
  }
  // Packed items are per K/V head, and their blocks hold kBlockM / group query positions.
  PersistentLaunch plan =
      plan_persistent_launch(problem.batch, params.pack_shift > 0 ? problem.heads_kv : problem.heads_q,
                             problem.seqlen_q, problem.seqlen_k, problem.causal, Cfg::kBlockM >> params.pack_shift,
                             Cfg::kBlockN, sms, params.window_left, params.window_right);
  AttentionParams kernel_params = params;
  const int splits = split.splits;
  const int64_t rows_all = split.rows_all;
  bool tail = false;  // the tail split runs: its parts are in the work list
  float* workspace = nullptr;
  bool owned = false;  // taken here, freed here
  if ((kRuntimeBounds && splits > 1) || (!kWindow && split.tail_parts > 1)) {
    if (problem.workspace != nullptr) {  // forward() checked its size
      workspace = static_cast<float*>(problem.workspace);
    } else if (cudaMallocAsync(reinterpret_cast<void**>(&workspace), split.bytes, stream) == cudaSuccess) {
      // Stream-ordered, so the pool hands the memory back to the next call on the stream, and a
      // CUDA graph capture records it. Without it the problem runs unsplit.
      owned = true;
    } else {
      cudaGetLastError();  // clear it: the unsplit launch below does not depend on it
      workspace = nullptr;
    }
    if (workspace != nullptr && split.tail_parts > 1) {
      // The tail split: the parts of the cut items, [tail item][part][row of the block].
      tail = true;
      const int64_t parts_all = int64_t(plan.sched.total() - split.tail_start) * split.tail_parts;
      kernel_params.o_partial = workspace;
      kernel_params.lse_partial = workspace + size_t(parts_all) * Cfg::kBlockM * D;  // after all parts' rows
    } else if (workspace != nullptr) {
      kernel_params.splits = splits;
      kernel_params.o_partial = workspace;
      kernel_params.lse_partial = workspace + size_t(splits) * size_t(rows_all) * D;
      // The parts of a block are adjacent items (m_block = block * splits + part) in the order
      // by pair: each part's cost is a share of its block's.
      plan.sched.m_blocks *= splits;
      plan.sched.by_rank = false;
      plan.ctas = int(std::min<int64_t>(int64_t(plan.sched.total()), sms));
    }
  }
  WorkList list(plan.sched, tail ? split.tail_start : 0, tail ? split.tail_parts : 1, kernel_params.splits,
                kernel_params.heads_per_kv);
  list.own_sweeps = Cfg::kConsumers == 3 && !kWindow && problem.causal &&
                    mean_keys_per_block(Cfg::kBlockM >> params.pack_shift, problem.seqlen_q, problem.seqlen_k, true) <
                        kOwnSweepMaxKeys;
  const dim3 grid(unsigned(plan.ctas), 1u, 1u);  // one CTA per SM (its threads take all 65536 registers)
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(maps.q, maps.k, maps.v, o_map, kernel_params, list);
  s = launch_status(kName);
  if (workspace != nullptr) {
    if (s.ok() && tail) {
      const int64_t tail_rows = int64_t(list.tail_items()) * Cfg::kBlockM;
      combine_tail_kernel<OutType<T>, D><<<unsigned((tail_rows + 3) / 4), 128, 0, stream>>>(kernel_params, list,
                                                                                             Cfg::kBlockM);
      s = launch_status(kName);
    } else if (s.ok()) {
      // A programmatic dependent launch: the attention kernel lets it start while it still runs
      // (griddepcontrol.launch_dependents), and the combine waits for it (griddepcontrol.wait).
      cudaLaunchAttribute dependent{};
      dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      dependent.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(unsigned((rows_all + 3) / 4));
      config.blockDim = dim3(128);
      config.stream = stream;
      config.attrs = &dependent;
      config.numAttrs = 1;
      // cudaLaunchKernelEx returns the launch's own error (cuda_status then clears it).
      s = cuda_status(cudaLaunchKernelEx(&config, combine_splits_kernel<OutType<T>, D>, kernel_params, rows_all),
                      std::string(kName) + ": launching the split-KV combine");
    }
    if (owned) {
      const Status freed = cuda_status(cudaFreeAsync(workspace, stream), std::string(kName) + ": cudaFreeAsync(workspace)");
      if (s.ok()) s = freed;
    }
  }
  if (vt_owned) {
    const Status freed = cuda_status(cudaFreeAsync(vt, stream), std::string(kName) + ": cudaFreeAsync(V^T)");
    if (s.ok()) s = freed;
  }
  return s;
}

// Pages of a paged cache hold a whole number of the K/V tiles paged problems run with (128 keys,
// 64 at D = 256).
constexpr int kPageMultiple = 128;
static_assert(kPageMultiple % Config<64, false, 3>::kBlockN == 0 && kPageMultiple % Config<128, false, 2>::kBlockN == 0 &&
                  kPageMultiple % Config<256, false, 2>::kBlockN == 0 && kPageMultiple % Config<64, false, 2>::kBlockN == 0,
              "a page holds whole K/V tiles of the narrow shapes");

// The whole contract with a positive scale, as long as the work list fits an int
// (B * Hq * ceil(Sq / 128) < 2^31); a paged cache's pages must hold whole K/V tiles.
Status supports(const AttentionProblem& problem) {
  if (problem.dtype == DType::e4m3) {
    if (problem.head_dim != 64 && problem.head_dim != 128)
      return {StatusCode::not_supported, std::string(kName) + ": e4m3 (FP8) inputs run at head_dim 64 and 128; got " +
                                             std::to_string(problem.head_dim)};
    if (problem.has_window() || problem.has_sequence_bounds() || problem.softcap > 0.f)
      return {StatusCode::not_supported, std::string(kName) + ": e4m3 (FP8) inputs run dense batches only: no sliding "
                                                              "window, cu_seqlens, seqlens_k, block_table, "
                                                              "kv_batch_idx, leftpad_k or softcap"};
    if (problem.seqlen_k > (1 << 30))  // V^T's copy pads the keys to a multiple of 128 in an int
      return {StatusCode::not_supported, std::string(kName) + ": e4m3 (FP8) inputs take seqlen_k up to 2^30; got " +
                                             std::to_string(problem.seqlen_k)};
  }
  if (Status s = require_positive_scale(problem, kName); !s.ok()) return s;
  if (problem.is_paged() && problem.page_size % kPageMultiple != 0)
    return {StatusCode::not_supported, std::string(kName) + ": page_size must be a multiple of " +
                                           std::to_string(kPageMultiple) + " (a K/V tile never spans two pages); got " +
                                           std::to_string(problem.page_size)};
  const int64_t items = work_items(problem.batch, problem.heads_q, problem.seqlen_q, Config<64, false, 2>::kBlockM);
  if (items > kMaxWorkItems)
    return {StatusCode::not_supported, std::string(kName) + ": batch * heads_q * ceil(seqlen_q / 128) = " +
                                           std::to_string(items) + " work items exceeds 2^30"};
  return Status::Ok();
}

// Sweeps at least this long (mean keys per query block) take the wide tiles at D = 128 and
// 256, as in 13 (chapter 13 has the measurements). At D = 128 the dense problems take them
// from 4096 keys: with this step's 16-byte O stores they gained 2.5% without a mask at S = 4k
// and 3% causal at S = 8k (results/evidence/tail_rounds_wide_a71743b/). Problems with a
// window, sequence bounds or GQA packing keep 13's 8192, where they were measured.
constexpr double wide_tile_min_keys(int head_dim, bool dense) {
  return head_dim == 256 ? 1024 : head_dim == 128 && dense ? 4096 : 8192;
}

// At D = 64 three consumers run unless the sweep is causal and short: measured on the H200
// (results/evidence/bench_x16_three_consumers_d64.log), they win by 2-23% without a mask at
// every S and with it from S = 2k (mean 1,088 keys per block), and lose 10-13% at causal
// S = 512 and 1k. Softcapped problems follow the same rule: 1.05-1.09x from S = 4k, 0.97x
// without a mask at S = 1k (results/evidence/softcap/run5/).
constexpr double kThreeConsumerMinCausalKeys = 1024;

// GQA packing: log2 of the query heads per K/V head when a work item takes all of them as
// rows, else 0. The group must be a power of two that divides a consumer's 64 rows (a Q box
// holds whole groups). Automatic: when it at least halves the 128-row blocks (few queries per
// sequence, as in decoding); pack_gqa forces it on or off. Never with a sliding window.
int pack_gqa_shift(const AttentionProblem& problem) {
  const int group = problem.heads_q / problem.heads_kv;
  if (group < 2 || group > 64 || (group & (group - 1)) != 0) return 0;
  int shift = 0;
  while ((1 << shift) < group) ++shift;
  if (problem.pack_gqa.has_value()) return *problem.pack_gqa ? shift : 0;
  const int64_t blocks = (int64_t(problem.seqlen_q) + 127) / 128 * group;
  const int64_t packed_blocks = (int64_t(problem.seqlen_q) * group + 127) / 128;
  return packed_blocks * 2 <= blocks ? shift : 0;
}

// What launch() decides from the problem's shape before a template is chosen.
struct TileChoice {
  AttentionParams params;  // the window's edges, normalized; varlen offsets; GQA packing
  double mean_keys = 0;    // keys per query block, on average
  bool wide = false;       // the wide K/V tiles (D = 128, 256)
  bool window = false;     // the window's kernels
  // No window, sequence bounds, GQA packing or softcap: every item sweeps all keys of its
  // sequence, so the tail split may cut the last round.
  bool dense_batch = false;
  // A dense batch, not decoding at D = 64: the kernels without run-time bounds.
  bool dense = false;
  bool three = false;      // three consumers (D = 64)
  int sms = 0;
};

Status choose_tiles(const AttentionProblem& problem, TileChoice* c) {
  c->params = make_params(problem);
  // The window's kernels only where a window edge binds beyond what causal already does.
  c->window = c->params.window_left >= 0 || (!problem.causal && c->params.window_right >= 0);
  c->params.pack_shift = c->window ? 0 : pack_gqa_shift(problem);  // the window's kernels do not pack
  c->mean_keys = mean_keys_per_block(Config<128, false, 2>::kBlockM >> c->params.pack_shift, problem.seqlen_q,
                                     problem.seqlen_k, problem.causal, c->params.window_left, c->params.window_right);
  // A paged cache keeps the 128- (D = 256: 64-) key tiles, so that a tile never spans two pages.
  c->dense_batch =
      !c->window && !problem.has_sequence_bounds() && c->params.pack_shift == 0 && problem.softcap == 0.f;
  c->dense = c->dense_batch;
  c->wide = !problem.is_paged() && c->mean_keys >= wide_tile_min_keys(problem.head_dim, c->dense);
  // Decoding at D = 64 (a query block of at most one consumer's 64 rows) runs in the run-time
  // bounds kernels also when dense: there its consumers without rows (two of three) skip
  // their tiles, which the dense kernels compute (4 x 4k keys: 55 us in the dense kernel,
  // 47.6 here; 32 x 4k: 371 and 272). At D = 128 and 256 (one idle consumer of two) they ran
  // 0.5% slower at 32 x 4k (results/evidence/deep_ring_tail_rounds/run2/). The tail split
  // still cuts its last round (dense_batch): 5 x 4k, 76.5 us without it, 62.9 with
  // (results/evidence/decode_d64_tail/).
  if (problem.head_dim == 64 && !c->window && problem.dtype != DType::e4m3 &&
      (int64_t(problem.seqlen_q) << c->params.pack_shift) <= 64)
    c->dense = false;
  // A sliding window is treated like the causal mask: its sweeps are as long as the window.
  c->three =
      !(problem.causal || c->window) || c->mean_keys >= kThreeConsumerMinCausalKeys;
  c->sms = sm_count();
  if (c->sms <= 0)
    return {StatusCode::cuda_error, std::string(kName) + ": cannot query the number of SMs of the current device"};
  return Status::Ok();
}

// K/V tiles each split-KV part sweeps at least, when the parts are chosen automatically.
constexpr int kMinTilesPerSplit = 4;

// Split-KV parts: num_splits when the caller gives it (1: off), else, when the query blocks
// alone would leave more than half of the SMs idle, as many parts as fit in one round of the
// SMs (rounding up left a second round with most SMs idle: 1.1-1.6x slower on the H200,
// results/evidence/split_rounds_397bfab/), as long as each part keeps kMinTilesPerSplit tiles
// of the mean sweep. Capped so that the work list still fits an int.
int split_parts(const AttentionProblem& problem, int pack_shift, int block_m, int block_n, double mean_keys, int sms) {
  const int64_t items = work_items(problem.batch, pack_shift > 0 ? problem.heads_kv : problem.heads_q, problem.seqlen_q,
                                   block_m >> pack_shift);
  int parts = problem.num_splits;
  if (parts == 0) {
    if (items * 2 > sms) return 1;
    const int64_t by_sms = sms / items;  // items <= sms / 2 here: at least 2
    const int64_t by_tiles = int64_t(mean_keys / block_n) / kMinTilesPerSplit;
    parts = int(std::min<int64_t>({by_sms, by_tiles, kMaxSplits}));
  }
  if (parts < 2 || items * parts > kMaxWorkItems) return 1;
  return parts;
}

// The tail split: without a mask, when the items are not a whole number of rounds of the
// persistent grid, each item of the last round is cut into as many parts as fill the grid's
// CTAs, as long as each part keeps kMinTilesPerSplit tiles. Automatic only (num_splits = 0),
// and only in dense batches: the kernels without run-time bounds, and decoding at D = 64 in
// the run-time bounds kernels.
void plan_tail_split(const AttentionProblem& problem, int block_m, int block_n, int sms, SplitPlan* plan) {
  const int64_t items = work_items(problem.batch, problem.heads_q, problem.seqlen_q, block_m);
  const int64_t ctas = std::min<int64_t>(items, sms);
  const int64_t left = ctas > 0 ? items % ctas : 0;  // items of the last, partial round
  if (left == 0) return;
  const int64_t by_ctas = ctas / left;
  const int64_t by_tiles = (int64_t(problem.seqlen_k) + block_n - 1) / block_n / kMinTilesPerSplit;
  const int parts = int(std::min<int64_t>({by_ctas, by_tiles, kMaxSplits}));
  if (parts < 2 || items - left + left * parts > kMaxWorkItems) return;
  plan->tail_start = int(items - left);
  plan->tail_parts = parts;
  plan->bytes = size_t(left) * parts * block_m * (problem.head_dim + 1) * sizeof(float);
}

SplitPlan split_plan(const AttentionProblem& problem, const TileChoice& c, int block_m, int block_n) {
  SplitPlan plan;
  plan.splits = split_parts(problem, c.params.pack_shift, block_m, block_n, c.mean_keys, c.sms);
  if (plan.splits < 2) {
    if (c.dense_batch && !problem.causal && problem.num_splits == 0)
      plan_tail_split(problem, block_m, block_n, c.sms, &plan);
    return plan;
  }
  plan.rows_all = int64_t(problem.tensor_batch()) * problem.heads_q * problem.tensor_rows_q();
  plan.bytes = size_t(plan.splits) * size_t(plan.rows_all) * (problem.head_dim + 1) * sizeof(float);
  return plan;
}

// Calls f.template operator()<kWide, kConsumers>() with the tile shape `c` picked at head dim D.
template <int D, typename F>
Status with_tile_shape(const TileChoice& c, F&& f) {
  static_assert(Config<128, true, 2>::kBlockM == Config<128, false, 2>::kBlockM &&
                    Config<256, true, 2>::kBlockM == Config<128, false, 2>::kBlockM,
                "the two-consumer shapes split the queries alike");
  if constexpr (D == 64) {  // 14's wide tile at D = 64 only ran where three consumers now do
    if (c.three) return f.template operator()<false, 3>();
    return f.template operator()<false, 2>();
  } else {
    if (c.wide) return f.template operator()<true, 2>();
    return f.template operator()<false, 2>();
  }
}

// FP8 runs one shape per head dim (64, 128): 128-key tiles, two consumers, the dense kernel
// without GQA packing or splits (supports() refused the rest).
Status launch_fp8(const AttentionProblem& problem, const TileChoice& c, cudaStream_t stream) {
  AttentionParams params = c.params;
  params.pack_shift = 0;
  if (problem.head_dim == 64)
    return launch_typed<__nv_fp8_e4m3, 64, false, 2, false, false>(problem, params, SplitPlan{}, c.sms, stream);
  return launch_typed<__nv_fp8_e4m3, 128, false, 2, false, false>(problem, params, SplitPlan{}, c.sms, stream);
}

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  TileChoice c;
  if (Status s = choose_tiles(problem, &c); !s.ok()) return s;
  if (problem.dtype == DType::e4m3) return launch_fp8(problem, c, stream);
  return dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {
    return with_tile_shape<D>(c, [&]<bool kWide, int kConsumers>() -> Status {
      using Cfg = Config<D, kWide, kConsumers>;
      // Split-KV runs in the run-time bounds kernels (their items already read their bounds).
      const SplitPlan split = split_plan(problem, c, Cfg::kBlockM, Cfg::kBlockN);
      if (c.window) return launch_typed<T, D, kWide, kConsumers, true, true>(problem, c.params, split, c.sms, stream);
      if (!c.dense || split.splits > 1)
        return launch_typed<T, D, kWide, kConsumers, true, false>(problem, c.params, split, c.sms, stream);
      return launch_typed<T, D, kWide, kConsumers, false, false>(problem, c.params, split, c.sms, stream);
    });
  });
}

// The workspace launch() will use: the same choices, no launch.
Status workspace_bytes(const AttentionProblem& problem, size_t* bytes) {
  if (problem.dtype == DType::e4m3) {  // V^T's copy
    *bytes = vt_bytes(problem);
    return Status::Ok();
  }
  TileChoice c;
  if (Status s = choose_tiles(problem, &c); !s.ok()) return s;
  return dispatch_dtype_headdim(problem, [&]<typename T, int D>() -> Status {  // T: the plan does not depend on it
    return with_tile_shape<D>(c, [&]<bool kWide, int kConsumers>() -> Status {
      using Cfg = Config<D, kWide, kConsumers>;
      *bytes = split_plan(problem, c, Cfg::kBlockM, Cfg::kBlockN).bytes;
      return Status::Ok();
    });
  });
}

}  // namespace

const KernelEntry& kernel_16_coalesced_store() {
  static const KernelEntry entry{kName, "O stored from registers in 16-byte pieces after a transpose across each quad (D = 256, wide D = 128)",
                                 supports, launch, /*supports_window=*/true, /*supports_varlen=*/true,
                                 /*supports_paged=*/true, /*supports_fp8=*/true, workspace_bytes,
                                 /*supports_softcap=*/true};
  return entry;
}

}  // namespace hattn
