// Lineage step 11: persistent CTAs that walk a work list (snake order, longest first where it pays).
// Parent: 10_intra_warpgroup_overlap.
//
// Kernel 11 focus (what changed from 10_intra_warpgroup_overlap):
//   1. One CTA per SM, launched once, loops over work items (batch, head, query block) from
//      TileScheduler (tile_scheduler.cuh) instead of one CTA per item. The launch, the barrier
//      set-up and setmaxnreg are paid once per SM, not once per 128 query rows.
//   2. The producer runs ahead across items: as soon as the consumers' last S of an item has
//      read Q it loads the next item's Q and K/V tiles, so they land while the consumers finish
//      the last PV and store O. The K/V ring and its phases continue across items (a running
//      tile count replaces the per-item tile index).
//   3. Q gets a q_empty barrier: the consumers release Q after the last S of an item.
//   4. Work order (tile_scheduler.cuh): CTAs take items in a snake order (c, then G - 1 - c,
//      ...). The list runs query blocks fastest, so the CTAs that run together share one
//      head's K/V in L2. Under the causal mask, where that leaves one CTA far busier (few
//      heads of many blocks), the host switches to the longest blocks of all heads first.
//
// Per item with keys (n_tiles > 0), running counts kv (tiles so far) and uses (items so far):
//   producer: [uses > 0: wait q_empty (uses - 1) % 2]; load Q -> q_full; per tile: as in 10,
//             with stage kv % kStages and the previous use's parity (kv / kStages - 1) % 2.
//   consumers: wait q_full (uses % 2); the tile loop of 10; after the last S has completed,
//             lane 0 of each warp arrives q_empty; last PV; store O and LSE.
// An item whose rows see no key (causal, Sq > Sk) loads nothing: the consumers write O = 0
// and LSE = -inf, and neither side counts it.
//
// Barriers (who arrives -> who waits): as in 10, plus
//   q_empty     lane 0 of each of the 8 consumer warps after the item's last S -> the producer,
//               before it loads the next item's Q
//
// Why: in 10 every CTA starts cold: Q and the first K/V tiles arrive while the tensor cores
// idle, and the store of O runs while nothing else does. With short sequences (4 K/V tiles
// at S = 512) that start and finish is a large share of each CTA's time. Under the causal
// mask the grid of 10 runs its longest blocks last.
// Expected effect: largest at short sequences and with the causal mask; small at 16k
// non-causal. Figures: results/ and docs/guide/11_persistent.md.
// Known limits: a static order (no work stealing); the epilogue still stores from
// registers while the tensor cores wait for the next item's first S (step 12).
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

constexpr const char* kName = "11_persistent";

// Named barrier ids (0 is __syncthreads): one "turn" barrier per consumer warpgroup.
enum NamedBarrier : int { kTurnConsumer0 = 1, kTurnConsumer1 = 2 };
constexpr int kTurnThreads = 2 * 128;  // the waiting warpgroup + the arriving one

template <int D>
struct Config {
  static constexpr int kConsumers = 2;                  // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);  // + the producer warpgroup
  static constexpr int kBlockM = 64 * kConsumers;      // query rows per CTA: 64 per consumer
  static constexpr int kBlockN = D == 256 ? 64 : 128;  // keys per K/V tile (the N of S = Q K^T)
  static constexpr int kStages = 2;                    // K/V tiles in flight
  static constexpr int kColBlocks = D / 64;            // 64-element (128-byte) column blocks of a row
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
    persistent_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                      const __grid_constant__ CUtensorMap v_map, const AttentionParams p, const TileScheduler sched) {
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
  const float scale_log2 = p.scale * kLog2e;
  const int my_turn = warpgroup == 0 ? kTurnConsumer0 : kTurnConsumer1;
  const int next_turn = warpgroup == 0 ? kTurnConsumer1 : kTurnConsumer0;

  float o[kDTiles * 4];              // O: n8 tile dt holds columns 8 dt + 2 t + {0, 1}
  float s[kNTiles * 4];              // S / P of the current tile
  float row_max[2];                  // running max of the raw scores s
  float row_sum[2];                  // running sum of 2^(c s - c max) over this thread's columns
  uint32_t p_frag[kBlockN / 16][4];  // P of the previous tile, as wgmma A fragments
  float alpha[2];                    // the previous tile's rescale factor, not yet applied to O
  int kv = 0;                        // K/V tiles consumed so far: the ring position
  int uses = 0;                      // items with keys so far: Q's phase

  // O *= alpha, then O += P V(tile) issued (not waited for). PV of the tile before has
  // completed, so O is not being written; P and the rescaled O are fenced in before the wgmmas
  // read them. `ring` is the tile's position in the K/V ring.
  auto issue_pv = [&](int ring) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o[dt * 4 + 0] *= alpha[0];
      o[dt * 4 + 1] *= alpha[0];
      o[dt * 4 + 2] *= alpha[1];
      o[dt * 4 + 3] *= alpha[1];
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

      // Online softmax (a row lives in the 4 threads of a quad), beside PV(t - 1). alpha(t)
      // is applied to O just before PV(t) is issued.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        // c = scale_log2 > 0 (supports()), so max(c s) = c max(s): the max is taken on raw scores
        // and c goes into the exponent, one FFMA per score. A row with no visible key yet
        // subtracts 0: weights 0, not NaN.
        const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
        alpha[r] = ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - m_scaled);
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
      if (p.lse != nullptr && tig == 0)
        p.lse[(int64_t(item.batch) * p.heads_q + item.head_q) * p.seqlen_q + row] =
            row_sum[r] > 0.f ? row_max[r] * p.scale + logf(row_sum[r]) : -INFINITY;
    }
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
  const auto kernel = persistent_kernel<T, D>;
  s = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
                  std::string(kName) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!s.ok()) return s;
  const int sms = sm_count();
  if (sms <= 0) return {StatusCode::cuda_error, std::string(kName) + ": cannot query the number of SMs of the current device"};
  const PersistentLaunch plan = plan_persistent_launch(problem.batch, problem.heads_q, problem.seqlen_q,
                                                       problem.seqlen_k, problem.causal, Cfg::kBlockM, Cfg::kBlockN, sms);
  const dim3 grid(unsigned(plan.ctas), 1u, 1u);  // one CTA per SM (the 384 threads x 168 registers allow no more)
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(maps.q, maps.k, maps.v, make_params(problem), plan.sched);
  return launch_status(kName);
}

// The whole contract with a positive scale, as long as the work list fits an int with room
// for the snake order's overshoot (B * Hq * ceil(Sq / 128) <= 2^30).
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

const KernelEntry& kernel_11_persistent() {
  static const KernelEntry entry{kName, "persistent CTAs over a snake-ordered work list; the next item's loads overlap the end of this one",
                                 supports, launch};
  return entry;
}

}  // namespace hattn
