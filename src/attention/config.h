// The production forward's tile shapes and register budgets: one constexpr config per
// instantiation, plain C++ so that the host plan (plan.h) and its CPU tests read the same numbers.
#pragma once

namespace hattn::fwd {

// Named barrier ids (0 is __syncthreads): one "turn" barrier per consumer warpgroup (ids 1-3
// with three consumers), then one per consumer warpgroup for its epilogue (ids 4-6).
constexpr int kMaxConsumers = 3;
enum NamedBarrier : int { kTurnConsumer0 = 1, kEpilogueConsumer0 = 1 + kMaxConsumers };
constexpr int kTurnThreads = 2 * 128;  // the waiting warpgroup + the arriving one
// FP8: keys in one 128-byte swizzle row of V^T (e4m3): the PV wgmma's V^T tile, the TMA box the
// producer loads it with, the transpose kernel's tile and the padding of V^T's keys.
constexpr int kVtTileKeys = 128;
constexpr int kSwizzleBytes = 128;  // one row of a 64-column block
constexpr int kAtomBytes = 1024;    // 8 rows x 128 bytes: the swizzle pattern's period
constexpr float kLog2e = 1.4426950408889634f;
// The scale a zero softmax scale runs with (plan.cpp), and an FP8 item whose descales multiply
// to 0 (consumer.cuh): for scores below 10^22 in magnitude, |s| * kZeroScale * log2(e) stays
// below 2^-24, so 2^(s c) rounds to exactly 1, while a masked score's -inf stays -inf (times 0
// it would be NaN).
constexpr float kZeroScale = 1e-30f;
// FP8: P is kept as 2^8 P (at most 256 < 448, e4m3's largest), so that weights down to 2^-14
// stay in e4m3's normal range (2^-6 up) with 3 mantissa bits instead of rounding among the
// subnormals' steps of 2^-9 (or to 0). The row sums carry the same factor, so O / sum is
// unchanged; the LSE takes 8 ln 2 off.
constexpr float kFp8PLog2 = 8.f;

// kWide: the wide tile shape for long key sweeps; kNumConsumers: consumer warpgroups (2, or 3
// at D = 64); kFp8: e4m3 inputs (the FP8 forward, 128-key tiles at every head dim); kFp8Kv:
// an e4m3 KV cache beside 16-bit queries (kv_dequant.cuh), 128- or 64-key tiles, two consumers;
// kDynamicList: a variable-length batch's sorted work list, its items taken from a counter
// (work_order.cuh; the run-time bounds kernels with two consumers).
template <int D, bool kWide, int kNumConsumers, bool kFp8 = false, bool kFp8Kv = false, bool kDynamicList = false>
struct Config {
  static constexpr int kHeadDim = D;
  static constexpr bool kFp8Cache = kFp8Kv;
  static constexpr bool kDynamic = kDynamicList;
  static constexpr int kConsumers = kNumConsumers;     // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
  static constexpr int kBlockM = 64 * kConsumers;      // query rows per CTA: 64 per consumer
  // Keys per K/V tile (the N of S = Q K^T).
  // FP8: one 128-key swizzle row of V^T (kVtTileKeys) at every D.
  static constexpr int kBlockN = kFp8 ? kVtTileKeys : D == 256 ? (kWide ? 80 : 64) : !kWide ? 128 : D == 128 ? 176 : 160;
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
  // tiles. Elsewhere O leaves from registers in 16-byte stores (epilogue.cuh).
  // With an FP8 KV cache the e4m3 staging ring takes O's place (decoding's O is a few rows).
  static constexpr bool kStoreByTma = !kFp8Kv && (D == 64 || (D == 128 && !kWide));
  // FP8 KV cache: e4m3 K and V tiles in flight in the staging ring, [kBlockN][D] bytes each, as
  // many as fit beside Q and the 16-bit ring. At D = 128 and 256 that is exactly sm_90's 227 KB,
  // the 1 KB alignment slack included: any byte more in their storage trips launch_typed's
  // static_assert.
  static constexpr int kStagingStages = D == 64 ? 4 : D == 128 ? 2 : 1;
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
  // FP8 at D = 256: P V adds into O inside the tensor cores, as FlashAttention-3's FP8 does.
  // o_tile would be another 128 registers a thread beside O's 128, S's 64 and P's 16.
  static constexpr bool kPvIntoO = kFp8 && D == 256;
  // Register budgets per thread after setmaxnreg. setmaxnreg only moves registers inside the
  // CTA's own pool, which is what the CTA got at launch: kThreads x the compiler's cap under
  // __launch_bounds__(kThreads, 1), 65536 / kThreads rounded down to a multiple of 8 (168).
  // The budgets of the 1 + kConsumers warpgroups must fit in it, or setmaxnreg.inc waits
  // forever for registers that never come (24 + 2 x 240 = 504 = 3 x 168; with three
  // consumers 24 + 3 x 160 = 504 <= 4 x 128).
  // An FP8 KV cache's dequantizing warps (in the producer warpgroup) take 56: 56 + 2 x 224 = 504.
  // A list taken from its counter runs a scheduler thread beside the producer thread
  // (hand_out_positions), and with it ptxas spilled 64-112 bytes in the producer's 24 (a second
  // branch there, even one arrive, did it). At D = 128 8 a thread move from each consumer to
  // the producer warpgroup, 40 + 2 x 232, and neither spills; at D = 64 and 256 the consumers
  // then spilled 8-20 bytes, and the producer keeps its spills (results/evidence/dynamic_work_list/).
  static constexpr int kMovedRegisters = kDynamicList && D == 128 ? 8 : 0;
  static constexpr int kProducerRegisters = (kFp8Kv ? 56 : 24) + kMovedRegisters * kConsumers;
  static constexpr int kConsumerRegisters = (kConsumers == 3 ? 160 : kFp8Kv ? 224 : 240) - kMovedRegisters;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * kLaunchRegisters,
                "setmaxnreg budgets exceed the CTA's registers at launch");

  static_assert(D % 64 == 0, "tiles are stored as 64-column blocks, the width of a 128-byte swizzle atom");
  static_assert(kConsumers == 2 || (kConsumers == 3 && D == 64 && !kWide),
                "three consumers fit their registers only at D = 64 with 128-key tiles");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "S = Q K^T is one m64nNk16 per 16 columns of D");
  static_assert(!kFp8 || (!kWide && kConsumers == 2 && kBlockN == 128),
                "the FP8 forward runs 128-key tiles (one swizzle row of V^T) and two consumers");
  static_assert(!kDynamicList || (kConsumers == 2 && !kFp8 && !kFp8Kv),
                "a list taken from its counter runs in the two-consumer 16-bit kernels");
  static_assert(!kFp8Kv || (!kFp8 && !kWide && kConsumers == 2),
                "an FP8 KV cache runs 16-bit queries with the narrow tiles and two consumers");
};

}  // namespace hattn::fwd
