// The mainloop's consumers: each consumer warpgroup owns 64 query rows of a block. Per K/V tile
// it issues S = Q K^T in its turn (the turn goes round the consumers, so that one's softmax
// runs beside the others' GEMMs), right behind it the previous tile's O += P V, then the
// softmax of this tile beside that PV. At the item's end the epilogue stores its rows.
//
// Barriers (who arrives -> who waits), beside producer.cuh's ring:
//   turn barrier c (named, kTurnConsumer0 + c): consumer c - 1 after issuing its GEMMs ->
//     consumer c, before issuing its own (consumer 0 waits for the last one).
//   epilogue barrier c (named, kEpilogueConsumer0 + c): consumer c's 128 threads, around the
//     staging tile's writes (epilogue.cuh).
#pragma once

#include <cuda.h>

#include <type_traits>

#include "../common/fragment.cuh"
#include "../common/params.h"
#include "../common/sequence.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/named_barrier.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/wgmma.cuh"
#include "epilogue.cuh"
#include "kv_dequant.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"
#include "softmax.cuh"
#include "work_list.cuh"

namespace hattn::fwd {

#ifdef __CUDACC__
// What a consumer's sweep of one item needs to know of it.
struct ItemRows {
  Sequence seq;
  int first_tile, n_tiles;  // the item's K/V tiles: [first_tile, first_tile + n_tiles)
  int wg_tiles;             // this warpgroup's own sweep: the item's first wg_tiles tiles
  int m_block;              // the block's first (packed) row
  int causal_offset;        // the sequence's diagonal: query i sees keys j <= i + causal_offset
  int row0;                 // this thread's rows: row0 and row0 + 8 (packed rows)
};

// The consumer warpgroup's whole life: every item of the CTA's share of the work list. The
// loop's state (O, S, the softmax's rows, P, the ring position) lives in registers; the tile
// step, the sweep and the PV issue are lambdas over it, in the order ptxas schedules best (the
// same code as a struct's methods ran 2-4% slower on short causal sweeps at D = 64).
template <typename T, int D, typename Cfg, bool kRuntimeBounds, bool kWindow>
__device__ __forceinline__ void consume(SharedStorage<T, Cfg>& smem, const CUtensorMap& o_map, const FeatureParams& p,
                                        const WorkList& sched,
                                        const ItemSweep<Cfg::kBlockM, Cfg::kBlockN, kRuntimeBounds, kWindow>& items,
                                        const ConsumerThread& t) {
  constexpr bool kFp8 = kIsFp8<T>;  // e4m3 q, k, v (V as its transposed copy), bf16 out
  using C = ComputeType<T, Cfg>;     // what the wgmmas multiply: T, or fp16 for bf16 over an FP8 cache
  constexpr bool kHalfQ = !std::is_same_v<C, T>;  // Q turned into fp16 times kHalfQScale per item
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8;  // n8 column tiles of S in the accumulator
  constexpr int kDTiles = D / 8;        // n8 column tiles of O
  // wgmma k steps, 32 bytes of a row each (k16 for 16-bit types, k32 for e4m3): over D for S,
  // over the tile's keys for PV (P's A fragments).
  constexpr int kSSteps = D * int(sizeof(T)) / 32, kPSteps = kBlockN * int(sizeof(T)) / 32;
  // Own sweeps: under the causal mask a consumer's 64 rows end before its block's last row.
  // With three consumers on 192-row blocks and 128-key tiles, one or two of them see none of
  // the last tile's keys on most items (a tenth of the work at S = 2k); each then computes
  // only the tiles its rows see and passes the rest on, where the host sets list.own_sweeps
  // (plan.h). Rows wholly past the sequence pass their item on without a mask, or with own
  // sweeps; on long causal sweeps with own sweeps off, that alone ran 2.5% slower at D = 64,
  // S = 8k (as the idle-consumer path below did at 16k). With two consumers the 128-row
  // blocks and 128-key tiles line up, nothing is skipped, and the code alone cost 1-3.5%; the
  // window's kernels keep their sweep (their registers are short). Measured on the H200:
  // results/evidence/wg_sweep/.
  constexpr bool kOwnSweeps = !kWindow && Cfg::kConsumers == 3;
  // A warpgroup whose 64 rows all lie past the sequence's queries computes nothing. Decoding
  // (one query per sequence, or a few packed GQA heads) leaves every consumer but the first
  // without rows, and their GEMMs and exponentials took the tensor cores and MUFU from it. It
  // passes the item's tiles on and skips the epilogue, which would store nothing. Only in the
  // run-time-bounds kernels without a window, which decoding from a KV cache takes (sequence
  // lengths, split-KV, GQA packing): in the window's kernels the path made ptxas spill 24
  // bytes at D = 128 (budget 12), and in the dense ones it cost prefill 2.7% at D = 64,
  // causal, 16k on the H200 (results/evidence/idle_consumers/run2/). Elsewhere it sweeps
  // the item like the others, or with own sweeps passes it on with wg_tiles = 0.
  constexpr bool kSkipsIdleConsumers = kRuntimeBounds && !kWindow;
  // Where Q's release goes, and with it PV(t - 1)'s wait: ptxas lifts that wait as far up as
  // the nearest mbarrier arrive or branch above it. With both releases right after S(t)'s
  // wait, the row maxima and exponentials waited for PV(t - 1) too. Issued after the softmax,
  // Q's release is still scheduled up to just below the row maxima, and the wait with it:
  // where FlashAttention-3 waits. On an H100, D = 128 ran up to 7% faster, D = 256 1-2%;
  // D = 64 (short PV) 0-2% slower, and the wait pinned below every exponential slower than
  // this. FP8: D = 256 about 1% faster, D = 128 1-3% slower (its spills grew from 4 bytes to 8)
  // (results/evidence/ncu_vs_fa3/). Not in the run-time-bounds kernels: on mixed-length
  // batches most points gained 2-6%, but 32 causal sequences, many a single tile long, lost
  // 21% at D = 128 and 59% at D = 256: the producer loads nothing of the next item, Q first,
  // before the release (results/evidence/h100_6f0248a/).
  constexpr bool kLateQRelease = !kRuntimeBounds && (kFp8 ? D == 256 : D >= 128);
  const int warpgroup = t.warpgroup, lane = t.lane, group = t.group, tig = t.tig, warp_row = t.warp_row;
  const int pack_shift = items.mask.shift();

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

  float scale_log2 = p.scale * kLog2e;  // c: 2^(s c) = e^(scale s)
  // The turn goes round the consumers: 0 -> 1 (-> 2) -> 0.
  const int my_turn = kTurnConsumer0 + warpgroup;
  const int next_turn = kTurnConsumer0 + (warpgroup + 1) % Cfg::kConsumers;

  float o[kDTiles * 4];              // O: n8 tile dt holds columns 8 dt + 2 t + {0, 1}
  // FP8: one tile's P V, added to O by the CUDA cores. Hopper's FP8 wgmma adds into its
  // accumulators with about 14 bits kept (DeepSeek-V3's report), so O summed over a long
  // sweep inside the wgmmas drifted (python -m hattn.bench_fp8 at 16k keys: 0.086 off cuDNN's
  // output summed there, 0.070 summed here; most of the rest was P's rounding, see kFp8PLog2).
  // With kPvTilesPerSum > 1 it holds the P V of an item's tiles since the last one whose
  // index is a multiple of kPvTilesPerSum. The index is ring - kv: a counter, or even a
  // constexpr local here, changed ptxas's code for the bf16 kernels. At D = 256 (kPvIntoO) P V
  // adds into O itself: no room for o_tile.
  constexpr bool kOTile = kFp8 && !Cfg::kPvIntoO;
  float o_tile[kOTile ? kDTiles * 4 : 1];
  float s[kNTiles * 4];              // S / P of the current tile
  // The rows' max and sum, O's rescale. Each item resets it before issue_pv reads it; the {}
  // only tells nvcc so (warning 549-D), and leaves the PTX unchanged.
  OnlineSoftmax<kNTiles, Cfg::kFmaExp2Tiles, kFp8> softmax{};
  uint32_t p_frag[kPSteps][4];       // P of the previous tile, as wgmma A fragments
  int kv = 0;                        // K/V tiles consumed so far: the ring position
  int uses = 0;                      // items with keys so far: Q's phase
  const Epilogue<T, D, Cfg, kRuntimeBounds, kWindow> epilogue{smem, o_map, p, items, t};

  // O *= alpha, then O += P V(tile) issued (not waited for). PV of the tile before has
  // completed, so O is not being written; P and the rescaled O are fenced in before the wgmmas
  // read them. `ring` is the tile's position in the K/V ring.
  auto issue_pv = [&](int ring) {
    if (softmax.rescale) {  // warp-uniform
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        o[dt * 4 + 0] *= softmax.alpha[0];
        o[dt * 4 + 1] *= softmax.alpha[0];
        o[dt * 4 + 2] *= softmax.alpha[1];
        o[dt * 4 + 3] *= softmax.alpha[1];
      }
      if constexpr (Cfg::kSumsPvTiles) {
        if ((ring - kv) % Cfg::kPvTilesPerSum != 0) {  // o_tile's tiles, not yet in O, follow the max too
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o_tile[dt * 4 + 0] *= softmax.alpha[0];
            o_tile[dt * 4 + 1] *= softmax.alpha[0];
            o_tile[dt * 4 + 2] *= softmax.alpha[1];
            o_tile[dt * 4 + 3] *= softmax.alpha[1];
          }
        }
      }
    }
    // The stage's V descriptor, before the wait: after it, each wgmma adds only a constant.
    const RingPosition<Cfg::kStages> at(ring);
    uint64_t v_stage_desc = ptx::advance_smem_desc(v_desc, at.slot * kVStageBytes);
    ptx::fence_operand(v_stage_desc);
    ptx::mbarrier_wait(&smem.v_full[at.slot], at.phase);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
    if constexpr (kOTile) {
#pragma unroll
      for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o_tile[i]);
    }
    ptx::wgmma_fence();
    // Per 16 keys one wgmma with N = D. V is read N-major: 16 keys = 2048 bytes down the tile;
    // the 64-column blocks are kBlockN * 128 bytes apart (LBO). FP8: per 32 keys, 32 bytes along
    // V^T's rows.
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      if constexpr (kFp8 && Cfg::kPvIntoO) {
        ptx::WgmmaM64K32<T, D>::rs(o, p_frag[kk], ptx::advance_smem_desc(v_stage_desc, kk * 32), 1);
      } else if constexpr (kFp8) {
        ptx::WgmmaM64K32<T, D>::rs(o_tile, p_frag[kk], ptx::advance_smem_desc(v_stage_desc, kk * 32),
                                   kk > 0 || (Cfg::kSumsPvTiles && (ring - kv) % Cfg::kPvTilesPerSum != 0));
      } else {
        const uint32_t v_bytes = kk * 16 * 64 * sizeof(T);
        ptx::WgmmaM64K16<C, D>::template rs<1>(o, p_frag[kk], ptx::advance_smem_desc(v_stage_desc, v_bytes), 1);
      }
    }
    ptx::wgmma_commit_group();
  };
  // After wait_group<0>: PV has read V and P; release V's stage (FP8 below D = 256: and add
  // o_tile's P V to O every kPvTilesPerSum tiles; the sweep adds what an item's last tiles leave).
  auto finish_pv = [&](int ring) {
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::fence_operand(p_frag[kk][i]);
    if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[RingPosition<Cfg::kStages>(ring).slot]);
    if constexpr (kOTile) {
#pragma unroll
      for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o_tile[i]);
      if (!Cfg::kSumsPvTiles || (ring - kv) % Cfg::kPvTilesPerSum == Cfg::kPvTilesPerSum - 1) {
#pragma unroll
        for (int i = 0; i < kDTiles * 4; ++i) o[i] += o_tile[i];
      }
    }
  };

  // The round-th position: the snake's, or as the scheduler thread hands it out with its item
  // and sequence (scheduler.cuh).
  TakenItem taken;
  auto take = [&](int round) {
    if constexpr (!Cfg::kDynamic) return sched.position(round);
    taken = take_position(smem, sched, round);
    return taken.w;
  };
  for (int round = 0, w = take(0); w < sched.total(); w = take(++round)) {
    const auto at = items.template locate<Cfg::kDynamic>(w, taken);
    const PartItem& item = at.item;
    const Sequence& seq = at.seq;
    const int causal_offset = kRuntimeBounds ? seq.seqlen_k - seq.seqlen_q : p.causal_offset;  // the sequence's diagonal
    const int m_block = items.block_of(item) * kBlockM;
    if (kRuntimeBounds && m_block >= seq.seqlen_q << pack_shift) continue;  // past a short sequence of a varlen batch
    const KvTileRange range = items.tiles(item, seq);
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
    // An FP8 KV cache's item where consumer 1 widens (consumer_helps): consumer 0 computes alone
    // and neither takes turns. The turn's token (consumer 1's pending arrival on consumer 0's
    // barrier) then waits untouched for the next item. Folds to false in the other kernels.
    bool solo = false;
    if constexpr (Cfg::kFp8Cache) solo = consumer_helps(m_block, seq.seqlen_q << pack_shift);
    // An FP8 KV cache with softcapping: k's descale, which scales the scores inside the tanh.
    float score_factor = 1.f;
    if constexpr (kFp8 || Cfg::kFp8Cache) {
      // Scores are in units of q's and k's e4m3 codes (an FP8 KV cache: k's only, q_descale
      // null): the item's heads' descales fold into scale_log2 (the epilogue scales O by v's),
      // or with softcapping (an FP8 cache only) k's into the tanh's argument.
      const int64_t at = items.descale_index(item);
      // With Q in fp16 the scores come kHalfQScale small: k's factor takes its inverse.
      const float k_descale = p.k_descale != nullptr ? __ldg(p.k_descale + at) : 1.f;
      const float k_scale = kHalfQ ? k_descale / kHalfQScale : k_descale;
      if (Cfg::kFp8Cache && p.softcap_scale > 0.f) {
        score_factor = k_scale;
      } else {
        scale_log2 = p.scale * (p.q_descale != nullptr ? __ldg(p.q_descale + at) : 1.f) * k_scale * kLog2e;
        if (scale_log2 == 0.f) scale_log2 = kZeroScale * kLog2e;  // a zero descale: equal weights, not NaN
      }
    }

#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) o[i] = 0.f;
    softmax.reset();

    // One K/V tile of this item: S(t) and, after the first tile, PV(t - 1) issued in the turn,
    // then the softmax of t beside PV(t - 1). kHasPrevious is a compile-time flag: a wgmma
    // under a run-time branch makes ptxas serialize every wgmma of the kernel (C7518), so the
    // first tile is peeled off instead.
    auto step = [&](int tile, auto has_previous) {
      constexpr bool kHasPrevious = decltype(has_previous)::value;
      const int ring = kv + tile;
      const RingPosition<Cfg::kStages> at(ring);
      const int stage = at.slot;
      const int n_start = (range.first + tile) * kBlockN;

      // The stage's K descriptor, before the waits: in the turn, each wgmma adds only a constant.
      uint64_t k_stage_desc = ptx::advance_smem_desc(k_desc, stage * kKStageBytes);
      ptx::fence_operand(k_stage_desc);
      // In the turn: S(t) = Q K(t)^T, then PV(t - 1) right behind it.
      ptx::mbarrier_wait(&smem.k_full[stage], at.phase);
      if (!solo) ptx::bar_sync(my_turn, kTurnThreads);  // wait for the turn: the previous warpgroup has issued its GEMMs
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
          ptx::WgmmaM64K16<C, kBlockN>::template ss<0>(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                                       ptx::advance_smem_desc(k_stage_desc, k_bytes), kk > 0);
      }
      ptx::wgmma_commit_group();
      if constexpr (kHasPrevious) issue_pv(ring - 1);
      // Pass the turn on, also after an item's last tile: the turn runs across items.
      if (!solo) ptx::bar_arrive(next_turn, kTurnThreads);
      ptx::wgmma_wait_group<kHasPrevious ? 1 : 0>();  // S(t) has completed; PV(t - 1) may still run
#pragma unroll
      for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
      if (lane == 0) {
        ptx::mbarrier_arrive(&smem.k_empty[stage]);  // S(t) has read K(t)
        // Our last S has read our Q rows.
        if (!kLateQRelease && tile + 1 == wg_tiles) ptx::mbarrier_arrive(&smem.q_empty[warpgroup]);
      }

      items.mask.softcap(s, score_factor);
      items.mask.template apply<kNTiles>(s, n_start, m_block + warp_row, row0, tig, causal_offset, seq);
      // Online softmax (a row lives in the 4 threads of a quad), beside PV(t - 1).
      softmax.update(s, scale_log2);
      // Our last S has read our Q rows (kLateQRelease says why here).
      if (kLateQRelease && lane == 0 && tile + 1 == wg_tiles) ptx::mbarrier_arrive(&smem.q_empty[warpgroup]);

      if constexpr (kHasPrevious) {
        ptx::wgmma_wait_group<0>();  // PV(t - 1) has completed: P(t - 1)'s registers are free
        finish_pv(ring - 1);
      }
      if constexpr (kFp8) {
        // P(t) as e4m3 A fragments, one per 32 keys (S tiles 4kk .. 4kk+3). A fragment holds k
        // 4t .. 4t+3 (registers 0, 1: rows g, g+8) and 16 + 4t .. 16 + 4t+3 (2, 3), where the
        // accumulator gives a thread columns 2t, 2t+1 of each tile: k 4t + j takes tile 4kk + j / 2's
        // column 2t + j % 2 (then tiles 4kk+2, 4kk+3). The sum over keys does not care, as long as
        // V^T's copy holds its keys in the same order (kVtKeyOrder, fp8_transpose.cuh).
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          const float* x = s + 16 * kk;
          p_frag[kk][0] = frag::pack4_e4m3(x[0], x[1], x[4], x[5]);
          p_frag[kk][1] = frag::pack4_e4m3(x[2], x[3], x[6], x[7]);
          p_frag[kk][2] = frag::pack4_e4m3(x[8], x[9], x[12], x[13]);
          p_frag[kk][3] = frag::pack4_e4m3(x[10], x[11], x[14], x[15]);
        }
      } else {
        // P(t) as wgmma A fragments, one per 16 keys: S tiles 2kk and 2kk+1, rows g and g+8.
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
          p_frag[kk][0] = frag::pack2<C>(s[8 * kk + 0], s[8 * kk + 1]);
          p_frag[kk][1] = frag::pack2<C>(s[8 * kk + 2], s[8 * kk + 3]);
          p_frag[kk][2] = frag::pack2<C>(s[8 * kk + 4], s[8 * kk + 5]);
          p_frag[kk][3] = frag::pack2<C>(s[8 * kk + 6], s[8 * kk + 7]);
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
        const RingPosition<Cfg::kStages> at(kv + tile);
        const int stage = at.slot;
        ptx::mbarrier_wait(&smem.k_full[stage], at.phase);
        ptx::bar_sync(my_turn, kTurnThreads);  // pass the turn straight on
        ptx::bar_arrive(next_turn, kTurnThreads);
        ptx::mbarrier_wait(&smem.v_full[stage], at.phase);
        if (lane == 0) {
          ptx::mbarrier_arrive(&smem.k_empty[stage]);
          ptx::mbarrier_arrive(&smem.v_empty[stage]);
          if (from == 0 && tile + 1 == n_tiles) ptx::mbarrier_arrive(&smem.q_empty[warpgroup]);
        }
      }
    };

    // Consumers without rows (kSkipsIdleConsumers) pass the item's tiles on.
    if constexpr (kSkipsIdleConsumers) {
      if (n_tiles > 0 && m_block + warpgroup * 64 >= seq.seqlen_q << pack_shift) {
        ptx::mbarrier_wait(&smem.q_full[warpgroup], uses % 2);
        if (warpgroup == Cfg::kConsumers - 1 && uses == 0) ptx::bar_arrive(kTurnConsumer0, kTurnThreads);
        bool helps = false;  // with an FP8 KV cache consumer 1 widens instead (kv_dequant.cuh)
        if constexpr (Cfg::kFp8Cache) {
          helps = warpgroup == 1 && consumer_helps(m_block, seq.seqlen_q << pack_shift);
          if (helps) help_widen<T, Cfg>(smem, seq, range, kv, t.warp_in_wg * 32 + lane, &smem.q_empty[warpgroup]);
        }
        if (!helps) pass_tiles(0);
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
      if constexpr (kHalfQ) {
        q_to_half<Cfg>(ptx::cvta_to_shared_u32(smem.q[0] + warpgroup * 64 * Cfg::kAtomCols), t.warp_in_wg * 32 + lane);
        // The warpgroup's generic writes, before its wgmmas (async proxy) read the rows.
        ptx::fence_proxy_async_shared_cta();
        // All 64 rows converted. (The barrier is the epilogue's, which FP8 caches do not use.)
        ptx::bar_sync(kEpilogueConsumer0 + warpgroup, 128);
      }
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

    // Epilogue: rows that saw no key output 0, LSE -inf.
    epilogue.store(item, o, softmax, scale_log2, m_block, row0);
  }
  // The last consumer's hand-off after the last tile has no next tile to open: take it, so
  // that no named barrier is left half-arrived when the CTA exits.
  if (warpgroup == 0 && uses > 0) ptx::bar_sync(kTurnConsumer0, kTurnThreads);
  // The shared-memory source of the last store must stay allocated until the copy has read it.
  if constexpr (Cfg::kStoreByTma) {
    if (t.warp_in_wg == 0 && lane == 0) ptx::cp_async_bulk_wait_group<0>();
  }
}
#endif

}  // namespace hattn::fwd
