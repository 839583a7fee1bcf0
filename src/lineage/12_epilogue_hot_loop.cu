// Lineage step 12: the epilogue and the hot loop (TMA store of O, rescale on demand).
// Parent: 11_persistent.
//
// Kernel 12 focus (what changed from 11_persistent):
//   1. The epilogue stages O in shared memory (128B-swizzled, as TMA wants it) and one thread
//      per warpgroup stores it with a TMA bulk copy, so the consumers go on to the next item
//      while the copy drains. Rows past Sq are clipped by the copy. This needs an O tile beside
//      the ring: at D = 256 it does not fit in 227 KB, and O is stored from registers as in 11.
//   2. (The scale has been folded into the exponent since 07: one FFMA and one MUFU per score.)
//   3. O is rescaled only when some row of the warp raised its max (alpha != 1). The longer
//      the rows, the rarer that gets; each skip takes 4 * D / 8 FMULs out of the turn, where
//      they delayed the issue of PV.
//
// Epilogue per item (warpgroup wg, its 64 rows):
//   one thread: wait until the previous item's store has read the staging rows; bar(wg)
//   all: write O / sum into the staging rows; fence.proxy.async (generic writes -> TMA reads)
//   bar(wg); one thread: issue the D / 64 box stores; commit.
//
// Barriers: as in 11, plus a named barrier per consumer warpgroup for the epilogue.
//
// Why: with the ring, the turn and the persistent loop in place, what remains is the rescale
// inside the turn (it delays the issue of PV) and the time the consumers spend storing O
// instead of starting the next item.
// Known limits: D = 256 keeps the register-store epilogue; the tile shape is the same for
// every D; the folded max needs scale > 0 (supports() refuses others, "auto" then takes 06).
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "fragment.cuh"
#include "params.h"
#include "ptx/ex2.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/named_barrier.cuh"
#include "ptx/setmaxnreg.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "registry.h"
#include "tensor_map.h"
#include "tile_scheduler.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "12_epilogue_hot_loop";

// Named barrier ids (0 is __syncthreads): one "turn" barrier per consumer warpgroup.
// Then one per consumer warpgroup for its epilogue (ids 3, 4).
enum NamedBarrier : int { kTurnConsumer0 = 1, kTurnConsumer1 = 2, kEpilogueConsumer0 = 3 };
constexpr int kTurnThreads = 2 * 128;  // the waiting warpgroup + the arriving one

template <int D>
struct Config {
  static constexpr int kConsumers = 2;                  // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
  static constexpr int kBlockM = 64 * kConsumers;      // query rows per CTA: 64 per consumer
  static constexpr int kBlockN = D == 256 ? 64 : 128;  // keys per K/V tile (the N of S = Q K^T)
  static constexpr int kStages = D == 64 ? 3 : 2;      // K/V tiles in flight (3 fit beside O only at D = 64)
  static constexpr int kColBlocks = D / 64;            // 64-element (128-byte) column blocks of a row
  // O leaves through a shared-memory tile and a TMA store when that tile fits beside Q and
  // the ring: Q + 2 x (K + V) + O is 192 KB at D = 128 and would be 256 KB at D = 256.
  static constexpr bool kStoreByTma = D <= 128;
  // Register budgets per thread after setmaxnreg. setmaxnreg only moves registers inside the
  // CTA's own pool, which is what the CTA got at launch: kThreads x the compiler's cap under
  // __launch_bounds__(kThreads, 1), 65536 / kThreads rounded down to a multiple of 8 (168).
  // The budgets of the 1 + kConsumers warpgroups must fit in it, or setmaxnreg.inc waits
  // forever for registers that never come (24 + 2 x 240 = 504 = 3 x 168).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <= (1 + kConsumers) * kLaunchRegisters,
                "setmaxnreg budgets exceed the CTA's registers at launch");

  static_assert(D % 64 == 0, "tiles are stored as 64-column blocks, the width of a 128-byte swizzle atom");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "S = Q K^T is one m64nNk16 per 16 columns of D");
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kSwizzleBytes = 128;  // one row of a 64-column block
constexpr int kAtomBytes = 1024;    // 8 rows x 128 bytes: the swizzle pattern's period

// Every tile is [kColBlocks][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D>
struct SharedStorage {
  using Cfg = Config<D>;
  alignas(kAtomBytes) T q[Cfg::kColBlocks][Cfg::kBlockM * 64];
  alignas(kAtomBytes) T k[Cfg::kStages][Cfg::kColBlocks][Cfg::kBlockN * 64];
  alignas(kAtomBytes) T v[Cfg::kStages][Cfg::kColBlocks][Cfg::kBlockN * 64];
  // O's staging tile, laid out like Q (a placeholder when O is stored from registers).
  alignas(kAtomBytes) T o[Cfg::kStoreByTma ? Cfg::kColBlocks : 1][Cfg::kStoreByTma ? Cfg::kBlockM * 64 : 64];
  uint64_t q_full;
  uint64_t q_empty;
  uint64_t k_full[Cfg::kStages];
  uint64_t v_full[Cfg::kStages];
  uint64_t k_empty[Cfg::kStages];
  uint64_t v_empty[Cfg::kStages];
};

template <typename T, int D>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D>)) + kAtomBytes;  // + slack to align the base to 1024
}

// Issues the TMA copies of one K or V tile (`tile` of the keys) into `dst`, completing on
// `full` (the producer thread only): one 64-column box per column block.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T (&dst)[Config<D>::kColBlocks][Config<D>::kBlockN * 64],
                                          const CUtensorMap* map, int tile, int head_kv, int batch, uint64_t* full) {
  using Cfg = Config<D>;
  ptx::mbarrier_arrive_expect_tx(full, Cfg::kBlockN * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
    ptx::cp_async_bulk_tensor_4d_g2s(dst[cb], map, cb * 64, tile * Cfg::kBlockN, head_kv, batch, full);
}

template <typename T, int D>
__global__ void __launch_bounds__(Config<D>::kThreads, 1)
    epilogue_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap o_map,
                    const AttentionParams p, const TileScheduler sched) {
  using Cfg = Config<D>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kNTiles = kBlockN / 8;  // n8 column tiles of S in the accumulator
  constexpr int kDTiles = D / 8;        // n8 column tiles of O

  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes);

  const int warpgroup = int(threadIdx.x) / 128 - 1;  // consumer index; -1 is the producer
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1

  // K/V tiles query block `m_block` sweeps: all of them, or under the causal mask those up to
  // the diagonal of its last row (0 when no row sees a key).
  auto tiles_of = [&](int m_block) {
    return p.causal ? causal_kv_tiles(m_block, kBlockM, kBlockN, p.seqlen_q, p.seqlen_k)
                    : (p.seqlen_k + kBlockN - 1) / kBlockN;
  };

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    if constexpr (Cfg::kStoreByTma) ptx::prefetch_tensormap(&o_map);
    ptx::mbarrier_init(&smem.q_full, 1);
    ptx::mbarrier_init(&smem.q_empty, Cfg::kConsumers * 4);  // one arrival per consumer warp
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbarrier_init(&smem.k_full[s], 1);
      ptx::mbarrier_init(&smem.v_full[s], 1);
      ptx::mbarrier_init(&smem.k_empty[s], Cfg::kConsumers * 4);  // one arrival per consumer warp
      ptx::mbarrier_init(&smem.v_empty[s], Cfg::kConsumers * 4);
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized

  if (warpgroup < 0) {
    // Producer. Every warp of the warpgroup must execute setmaxnreg; one thread then loads.
    ptx::setmaxnreg_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) {
      int kv = 0;    // K/V tiles loaded so far: the ring position
      int uses = 0;  // items loaded so far: Q's phase
      for (int round = 0, w = sched.position(0); w < sched.total(); w = sched.position(++round)) {
        const WorkItem item = sched.item(w);
        const int n_tiles = tiles_of(item.m_block);
        if (n_tiles == 0) continue;
        const int head_kv = item.head_q / p.heads_per_kv;
        // WAR: the consumers' last S of the previous item has finished reading Q.
        if (uses > 0) ptx::mbarrier_wait(&smem.q_empty, (uses - 1) % 2);
        ptx::mbarrier_arrive_expect_tx(&smem.q_full, kBlockM * D * sizeof(T));
#pragma unroll
        for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_g2s(smem.q[cb], &q_map, cb * 64, item.m_block * kBlockM, item.head_q,
                                           item.batch, &smem.q_full);
        ++uses;
        for (int tile = 0; tile < n_tiles; ++tile, ++kv) {
          const int stage = kv % Cfg::kStages;
          // WAR: the consumers have released this stage's K (then V) of its previous use,
          // kv - kStages, whose phase parity is (kv / kStages - 1) % 2.
          const bool reused = kv >= Cfg::kStages;
          const uint32_t previous_use = reused ? (kv / Cfg::kStages - 1) % 2 : 0;
          if (reused) ptx::mbarrier_wait(&smem.k_empty[stage], previous_use);
          load_tile<T, D>(smem.k[stage], &k_map, tile, head_kv, item.batch, &smem.k_full[stage]);
          if (reused) ptx::mbarrier_wait(&smem.v_empty[stage], previous_use);
          load_tile<T, D>(smem.v[stage], &v_map, tile, head_kv, item.batch, &smem.v_full[stage]);
        }
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegisters>();

  const int warp_row = warpgroup * 64 + warp_in_wg * 16;  // first row of this warp inside the CTA tile
  const float scale_log2 = p.scale * kLog2e;  // c: 2^(s c) = e^(scale s)
  const int my_turn = warpgroup == 0 ? kTurnConsumer0 : kTurnConsumer1;
  const int next_turn = warpgroup == 0 ? kTurnConsumer1 : kTurnConsumer0;

  float o[kDTiles * 4];              // O: n8 tile dt holds columns 8 dt + 2 t + {0, 1}
  float s[kNTiles * 4];              // S / P of the current tile
  float row_max[2];                  // running max of the raw scores s
  float row_sum[2];                  // running sum of 2^(x - max) over this thread's columns
  uint32_t p_frag[kBlockN / 16][4];  // P of the previous tile, as wgmma A fragments
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
    }
    ptx::mbarrier_wait(&smem.v_full[ring % Cfg::kStages], (ring / Cfg::kStages) % 2);
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
    ptx::wgmma_fence();
    // Per 16 keys one wgmma with N = D. V is read N-major: 16 keys = 2048 bytes down the tile;
    // the 64-column blocks are kBlockN * 128 bytes apart (LBO).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const T* v_tile = smem.v[ring % Cfg::kStages][0] + kk * 16 * 64;
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          o, p_frag[kk], ptx::make_smem_desc_sw128(v_tile, kBlockN * kSwizzleBytes, kAtomBytes), 1);
    }
    ptx::wgmma_commit_group();
  };
  // After wait_group<0>: PV has read V and P; release V's stage.
  auto finish_pv = [&](int ring) {
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(o[i]);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) ptx::fence_operand(p_frag[kk][i]);
    if (lane == 0) ptx::mbarrier_arrive(&smem.v_empty[ring % Cfg::kStages]);
  };

  for (int round = 0, w = sched.position(0); w < sched.total(); w = sched.position(++round)) {
    const WorkItem item = sched.item(w);
    const int m_block = item.m_block * kBlockM;
    const int n_tiles = tiles_of(item.m_block);
    const int row0 = m_block + warp_row + group;  // this thread's rows: row0 and row0 + 8

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
      const int n_start = tile * kBlockN;

      // In the turn: S(t) = Q K(t)^T, then PV(t - 1) right behind it.
      ptx::mbarrier_wait(&smem.k_full[stage], (ring / Cfg::kStages) % 2);
      ptx::bar_sync(my_turn, kTurnThreads);  // wait for the turn: the other warpgroup has issued its GEMMs
#pragma unroll
      for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const T* q_tile = smem.q[kk / 4] + warpgroup * 64 * 64 + kk % 4 * 16;
        const T* k_tile = smem.k[stage][kk / 4] + kk % 4 * 16;
        ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(s, ptx::make_smem_desc_sw128(q_tile, 16, kAtomBytes),
                                                     ptx::make_smem_desc_sw128(k_tile, 16, kAtomBytes), kk > 0);
      }
      ptx::wgmma_commit_group();
      if constexpr (kHasPrevious) issue_pv(ring - 1);
      // Pass the turn on. Consumer 1's last hand-off of the item would have no matching
      // bar.sync: the next item starts with consumer 0 again.
      if (warpgroup == 0 || tile + 1 < n_tiles) ptx::bar_arrive(next_turn, kTurnThreads);
      ptx::wgmma_wait_group<kHasPrevious ? 1 : 0>();  // S(t) has completed; PV(t - 1) may still run
#pragma unroll
      for (int i = 0; i < kNTiles * 4; ++i) ptx::fence_operand(s[i]);
      if (lane == 0) {
        ptx::mbarrier_arrive(&smem.k_empty[stage]);                 // S(t) has read K(t)
        if (tile + 1 == n_tiles) ptx::mbarrier_arrive(&smem.q_empty);  // the item's last S has read Q
      }

      // Masked entries to -inf (only tiles crossing Sk or the diagonal).
      const bool need_mask = n_start + kBlockN > p.seqlen_k ||
                             (p.causal && n_start + kBlockN - 1 > m_block + warp_row + p.causal_offset);
      if (need_mask) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = n_start + nt * 8 + 2 * tig + e % 2;
            const int row = row0 + e / 2 * 8;
            if (col >= p.seqlen_k || (p.causal && col > row + p.causal_offset)) s[nt * 4 + e] = -INFINITY;
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
        // Exactly 1 when the max is unchanged (the compiler may fuse the exponent into an FFMA,
        // which would leave a rounding error instead of 0), so that the rescale can be skipped.
        alpha[r] = m == row_max[r] ? 1.f : ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - m_scaled);
        row_max[r] = m;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[nt * 4 + e] = ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -m_scaled));
            sum += s[nt * 4 + e];
          }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
      }
      rescale = __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f);

      if constexpr (kHasPrevious) {
        ptx::wgmma_wait_group<0>();  // PV(t - 1) has completed: P(t - 1)'s registers are free
        finish_pv(ring - 1);
      }
      // P(t) as wgmma A fragments, one per 16 keys: S tiles 2kk and 2kk+1, rows g and g+8.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        p_frag[kk][0] = frag::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        p_frag[kk][1] = frag::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        p_frag[kk][2] = frag::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        p_frag[kk][3] = frag::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };

    // An item whose rows see no key (causal, Sq > Sk) skips the GEMMs and loads nothing:
    // O = 0, LSE = -inf below.
    if (n_tiles > 0) {
      ptx::mbarrier_wait(&smem.q_full, uses % 2);  // this item's Q has landed
      // Consumer 0 goes first in every item.
      if (warpgroup == 1) ptx::bar_arrive(kTurnConsumer0, kTurnThreads);
      step(0, std::false_type{});
      for (int tile = 1; tile < n_tiles; ++tile) step(tile, std::true_type{});
      issue_pv(kv + n_tiles - 1);  // the last tile's PV
      ptx::wgmma_wait_group<0>();
      finish_pv(kv + n_tiles - 1);
      kv += n_tiles;
      ++uses;
    }

    // Epilogue: finish the row sums across the quad; rows that saw no key output 0, LSE -inf.
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      inv_sum[r] = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    }
    // LSE = ln(sum_j e^(scale s_j)) = scale max + ln(sum), max in raw units.
    if (p.lse != nullptr && tig == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row < p.seqlen_q)
          p.lse[(int64_t(item.batch) * p.heads_q + item.head_q) * p.seqlen_q + row] =
              row_sum[r] > 0.f ? row_max[r] * p.scale + logf(row_sum[r]) : -INFINITY;
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
              frag::pack2<T>(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
      }
      ptx::fence_proxy_async_shared_cta();  // this thread's writes, before the TMA unit reads them
      ptx::bar_sync(epilogue_barrier, 128);  // RAW: the warpgroup's 64 rows are all written and fenced
      if (storer) {
#pragma unroll
        for (int cb = 0; cb < Cfg::kColBlocks; ++cb)
          ptx::cp_async_bulk_tensor_4d_s2g(&o_map, cb * 64, m_block + warpgroup * 64, item.head_q, item.batch,
                                           &smem.o[cb][warpgroup * 64 * 64]);
        ptx::cp_async_bulk_commit_group();
      }
    } else {
      T* out = static_cast<T*>(p.out) + item.batch * p.out_batch_stride + item.head_q * p.out_head_stride;  // [Sq, D]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + r * 8;
        if (row >= p.seqlen_q) continue;
        T* out_row = out + row * p.out_seq_stride;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
          *reinterpret_cast<uint32_t*>(out_row + dt * 8 + 2 * tig) =
              frag::pack2<T>(o[dt * 4 + 2 * r] * inv_sum[r], o[dt * 4 + 2 * r + 1] * inv_sum[r]);
      }
    }
  }
  // The shared-memory source of the last store must stay allocated until the copy has read it.
  if constexpr (Cfg::kStoreByTma) {
    if (warp_in_wg == 0 && lane == 0) ptx::cp_async_bulk_wait_group<0>();
  }
}

template <typename T, int D>
Status launch_typed(const AttentionProblem& problem, cudaStream_t stream) {
  using Cfg = Config<D>;
  constexpr int kSmem = smem_bytes<T, D>();
  static_assert(kSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(problem, Cfg::kBlockM, Cfg::kBlockN, kName, &maps);
  if (!s.ok()) return s;
  CUtensorMap o_map{};  // only read when O leaves by TMA
  if constexpr (Cfg::kStoreByTma) {
    s = make_bshd_tensor_map(&o_map, problem.out, problem.dtype, problem.batch, problem.seqlen_q, problem.heads_q,
                             D, problem.out_strides, 64, 64);  // one consumer warpgroup's rows per box
    if (!s.ok()) return {s.code(), std::string(kName) + ": out: " + s.message()};
  }
  const auto kernel = epilogue_kernel<T, D>;
  s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                  std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  const int sms = sm_count();
  if (sms <= 0) return {StatusCode::cuda_error, std::string(kName) + ": cannot query the number of SMs of the current device"};
  const PersistentLaunch plan = plan_persistent_launch(problem.batch, problem.heads_q, problem.seqlen_q,
                                                       problem.seqlen_k, problem.causal, Cfg::kBlockM, Cfg::kBlockN, sms);
  const dim3 grid(unsigned(plan.ctas), 1u, 1u);  // one CTA per SM (the 384 threads x 168 registers allow no more)
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(maps.q, maps.k, maps.v, o_map, make_params(problem), plan.sched);
  return launch_status(kName);
}

// The whole contract with a positive scale, as long as the work list fits an int
// (B * Hq * ceil(Sq / 128) < 2^31).
Status supports(const AttentionProblem& problem) {
  if (Status s = require_positive_scale(problem, kName); !s.ok()) return s;
  const int64_t items = work_items(problem.batch, problem.heads_q, problem.seqlen_q, Config<64>::kBlockM);
  if (items > kMaxWorkItems)
    return {StatusCode::not_supported, std::string(kName) + ": batch * heads_q * ceil(seqlen_q / 128) = " +
                                           std::to_string(items) + " work items exceeds 2^30"};
  return Status::Ok();
}

Status launch(const AttentionProblem& problem, cudaStream_t stream) {
  return dispatch_dtype_headdim(problem,
                                [&]<typename T, int D>() -> Status { return launch_typed<T, D>(problem, stream); });
}

}  // namespace

const KernelEntry& kernel_12_epilogue_hot_loop() {
  static const KernelEntry entry{kName, "TMA store of O from shared memory, O rescaled only when a max changes",
                                 supports, launch};
  return entry;
}

}  // namespace hattn
