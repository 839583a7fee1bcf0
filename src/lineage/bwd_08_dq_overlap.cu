// Parent: bwd_07_dkdv_direct.
// Backward step 8: a block's dQ leaves while the next block's S^T runs. In B07 each warpgroup
// waits for its dQ wgmma, scales dQ, stores it to shared memory and hands it to the TMA unit,
// and only after the CTA barrier at the top of the next step issues the next S^T and dP^T: the
// tensor cores idle through the dQ epilogue, the barrier and the loads (ncu source counters of
// B07 at D = 128: about half of the stall samples fall between its dQ wgmma's issue and the
// next block's first S^T wgmma; results/evidence/bwd_07_profile_e3a642e/).
//
// Here a block's dQ wgmma is issued at the top of the next step, before that step's barrier
// and loads: its dS^T tiles were written before named barrier 1 of its own step. The step then
// issues S^T, waits only for dQ (wait_group 1: groups complete in order) and sends it out while
// S^T runs, and issues dP^T after that: with dP^T in flight as well, dQ's, dK's, dV's, S^T's and
// dP^T's accumulators (224 registers a thread at D = 128) would not fit beside the rest. At
// D = 64 they do, and dQ goes out while S^T and dP^T both run (1.02-1.05x S^T alone from
// S = 4k). The dS^T tiles get a second buffer, by block parity: the other warpgroup may still
// be reading the last block's while this one writes the next. The first step has no block
// before it, and is its own instantiation of the step (a compile-time flag; see run_step).
//
// D = 64 and 128. At D = 128 the order above first needed 255 registers and spilled 72 bytes
// (0.94-1.01x B07). The spilled values were ones the compiler had hoisted out of the loop: 16
// dS^T store addresses, the wgmma descriptors of K and V per k16 step, and dQ's 4 store offsets.
// Here dS^T goes out by stmatrix (one address a lane), descriptors are built once and advanced
// by constants, and the bases of the rest are re-read each step: 244 registers, no spill, and
// 1.09-1.24x B07 at D = 128 in two runs (results/evidence/bwd_08_dq_overlap/).
//
// Dense batches only (the production backward runs variable-length ones).
//
// The rest is B07: without GQA a CTA writes its keys' dK and dV once; with GQA it adds into
// fp32 sums. And B06 (B05 with a lean elementwise loop):
//   S^T = K Q^T,  dP^T = V dO^T   (wgmma m64n64, both operands in shared memory)
//   dV += P^T dO, dK += dS^T Q    (A from registers)
//   dQ[:, half w] = dS K[:, half w] over all 128 keys, added by TMA reductions from shared memory
//
// Barriers (who arrives -> who waits):
//   kv_full          thread 0's expect_tx + TMA bytes -> all threads, once
//   qdo_full[s]      thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   __syncthreads    all threads -> thread 0, before it refills the stage the last block read;
//                    also: every dQ wgmma of two blocks ago has read that parity's dS^T tiles
//                    (each warpgroup waited for its own a step ago), and the dQ tile the
//                    last block's dQ goes to has been read by its reduction (each warpgroup's
//                    issuing thread waited for that before it)
//   named 1          all 256 threads: both dS^T tiles written (and fenced to the async proxy)
//                    before either warpgroup's dQ wgmma reads them
//   named 2 + wg     the warpgroup's 128 threads: its dQ tile written (and fenced) before its
//                    issuing thread starts the reduction
// Bulk-group waits (cp.async.bulk.wait_group.read, the issuing thread of each warpgroup):
//   read 1           at the top of a step: the reduction of three blocks ago has read the
//                    tile this step rewrites with the last block's dQ
//   read 0           before the CTA exits: every reduction has read its tile (shared memory
//                    ends with the CTA)
#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backward.h"
#include "backward_common.cuh"
#include "fragment.cuh"
#include "ptx/ex2.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/named_barrier.cuh"
#include "ptx/smem.cuh"
#include "ptx/stmatrix.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_08_dq_overlap";
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockN = 64 * kWarpgroups;  // keys per CTA: 64 per warpgroup
constexpr int kBlockM = 64;                // query rows per step
constexpr int kStages = 2;                 // Q/dO blocks in flight
constexpr int kSwizzleBytes = 128;         // one row of a 64-column block
constexpr int kAtomBytes = 1024;           // 8 rows x 128 bytes: the swizzle pattern's period
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kDsBarrier = 1;              // named barrier 1: both dS^T tiles are written
constexpr int kDqTileBarrier = 2;          // named barriers 2 and 3: a warpgroup's dQ tile is written

// Every tile is [D / 64][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D>
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
};

template <typename T, int D>
constexpr int smem_bytes() {
  return int(sizeof(SharedStorage<T, D>)) + kAtomBytes;  // + slack to align the base to 1024
}

// Issues the TMA copies of query block `m0` (Q and dO) into `stage` (thread 0 only).
template <typename T, int D>
__device__ __forceinline__ void load_queries(SharedStorage<T, D>& smem, const CUtensorMap* q_map,
                                             const CUtensorMap* dout_map, int stage, int m0, int head, int batch) {
  ptx::mbarrier_arrive_expect_tx(&smem.qdo_full[stage], 2 * kBlockM * D * sizeof(T));
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb) {
    ptx::cp_async_bulk_tensor_4d_g2s(smem.q[stage][cb], q_map, cb * 64, m0, head, batch, &smem.qdo_full[stage]);
    ptx::cp_async_bulk_tensor_4d_g2s(smem.dout[stage][cb], dout_map, cb * 64, m0, head, batch,
                                     &smem.qdo_full[stage]);
  }
}

// This thread's dK and dV rows (keys key0 and key0 + 8; columns 8 dt + 2 t, + 1), scaled dK:
// into the fp32 sums of the K/V head with atomics, or, when run_backward made none
// (dk_accum null: no GQA, this CTA alone computes these rows), written once in T.
template <typename T, int D>
__device__ __forceinline__ void store_dk_dv(const BaseBackwardParams& p, int batch, int head_kv, int key0, int tig,
                                            const float* dk, const float* dv) {
  constexpr int kDTiles = D / 8;
  const AttentionParams& f = p.fwd;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= f.seqlen_k) continue;
    if (p.dk_accum == nullptr) {
      // 4-byte stores: the gradients' rows are 16-byte aligned (validate_backward_arguments).
      T* dk_row = static_cast<T*>(p.dk) + batch * p.dk_batch_stride + key * p.dk_seq_stride + head_kv * p.dk_head_stride;
      T* dv_row = static_cast<T*>(p.dv) + batch * p.dv_batch_stride + key * p.dv_seq_stride + head_kv * p.dv_head_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dk_row + 8 * dt + 2 * tig) =
            frag::pack2<T>(f.scale * dk[dt * 4 + 2 * r], f.scale * dk[dt * 4 + 2 * r + 1]);
        *reinterpret_cast<uint32_t*>(dv_row + 8 * dt + 2 * tig) = frag::pack2<T>(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]);
      }
    } else {
      const int64_t at = ((int64_t(batch) * f.seqlen_k + key) * f.heads_kv + head_kv) * D + 2 * tig;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        atomicAdd(reinterpret_cast<float2*>(p.dk_accum + at + 8 * dt),
                  make_float2(f.scale * dk[dt * 4 + 2 * r], f.scale * dk[dt * 4 + 2 * r + 1]));
        atomicAdd(reinterpret_cast<float2*>(p.dv_accum + at + 8 * dt), make_float2(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]));
      }
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    main_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
                const __grid_constant__ CUtensorMap dq_map, const BaseBackwardParams p) {
  constexpr int kDTiles = D / 8;       // n8 column tiles of dK, dV and dQ
  constexpr int kQTiles = kBlockM / 8;  // n8 column tiles of S^T and dP^T
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes). An
  // offset added to smem_raw keeps the pointer in the shared window (B05 went through an
  // integer, and its plain loads and stores of shared memory became generic ones).
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(ptx::align_shared<kAtomBytes>(smem_raw));
  const AttentionParams& f = p.fwd;
  // Through a shuffle, so that the compiler knows it is warp-uniform and keeps the wgmma
  // descriptors built from it in uniform registers (with plain threadIdx.x / 128, ptxas spilled).
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  const int warp_in_wg = int(threadIdx.x) % 128 / 32, lane = int(threadIdx.x) % 32;
  const int group = lane / 4, tig = lane % 4;  // accumulator coordinates: rows g, g+8; columns 2t, 2t+1
  const int n0 = int(blockIdx.x) * kBlockN, head = int(blockIdx.y), batch = int(blockIdx.z);
  const int head_kv = head / f.heads_per_kv;
  const int n_wg = n0 + 64 * warpgroup;                   // this warpgroup's first key
  const int key0 = n_wg + 16 * warp_in_wg + group;        // this thread's keys: key0 and key0 + 8
  const float scale_log2 = f.scale * kLog2e;

  int q_first, q_last;
  queries_seeing(f, n0, n0 + kBlockN, &q_first, &q_last);
  const int m_begin = q_first / kBlockM * kBlockM;
  const int steps = q_last > m_begin ? (q_last - m_begin + kBlockM - 1) / kBlockM : 0;

  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&q_map);
    ptx::prefetch_tensormap(&k_map);
    ptx::prefetch_tensormap(&v_map);
    ptx::prefetch_tensormap(&dout_map);
    ptx::prefetch_tensormap(&dq_map);
    ptx::mbarrier_init(&smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&smem.qdo_full[s], 1);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized
  if (steps == 0) {  // no query sees these keys: their dK and dV are 0
    if (p.dk_accum == nullptr) {  // no zeroed sums here: write the zeros
      const float zeros[kDTiles * 4] = {};
      store_dk_dv<T, D>(p, batch, head_kv, key0, tig, zeros, zeros);
    }
    return;
  }

  if (threadIdx.x == 0) {
    ptx::mbarrier_arrive_expect_tx(&smem.kv_full, 2 * kBlockN * D * sizeof(T));
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) {
      ptx::cp_async_bulk_tensor_4d_g2s(smem.k[cb], &k_map, cb * 64, n0, head_kv, batch, &smem.kv_full);
      ptx::cp_async_bulk_tensor_4d_g2s(smem.v[cb], &v_map, cb * 64, n0, head_kv, batch, &smem.kv_full);
    }
    load_queries<T, D>(smem, &q_map, &dout_map, 0, m_begin, head, batch);
  }

  // A block's LSE and delta go to shared memory a step ahead (64 threads each): in registers,
  // 16 of each a thread made ptxas spill at D = 128.
  const int64_t row_base = (int64_t(batch) * f.heads_q + head) * f.seqlen_q;
  const int seqlen_q = f.seqlen_q;  // read once (read from f in the lambda, it takes two more loads)
  // Threads 0-63 fetch LSE, 64-127 delta (0 past Sq), and store it in the block's stage: B04's
  // loads, split into a fetch and a store as in the build that was timed
  // (results/evidence/backward_tma_dq/; ptxas schedules B04's form a little differently).
  auto fetch_row_stat = [&](int m0) -> float {
    const int t = int(threadIdx.x) % kBlockM, i = m0 + t;
    if (threadIdx.x < kBlockM) return i < seqlen_q ? f.lse[row_base + i] * kLog2e : 0.f;
    if (threadIdx.x < 2 * kBlockM) return i < seqlen_q ? p.delta[row_base + i] : 0.f;
    return 0.f;
  };
  auto store_row_stat = [&](int stage, float value) {
    const int t = int(threadIdx.x) % kBlockM;
    if (threadIdx.x < kBlockM)
      smem.lse_log2[stage][t] = value;
    else if (threadIdx.x < 2 * kBlockM)
      smem.delta[stage][t] = value;
  };
  store_row_stat(0, fetch_row_stat(m_begin));

  float dk[kDTiles * 4] = {}, dv[kDTiles * 4] = {};
  constexpr int kCols = D / 2;
  const int c0 = warpgroup * kCols;
  // dQ[:, c0 : c0 + D/2] of a block: its wgmma is issued at the top of the next step, and it
  // leaves during that step.
  float dq[kCols / 2];
  // The scaled half into its block's parity's tile, and the reduction (after waiting for the
  // wgmma). Accumulator rows are 16 warp + g (+ 8), columns 8 nt + 2 t of the half: box nt / 4,
  // 16-byte chunk 2 (nt % 4) + t / 2 of the 128-byte row, stored at chunk ^ (row % 8) =
  // chunk ^ g (the box's swizzle): the lane's nt = 0 float offset XOR 8 (nt % 4).
  const int dq_lane = (16 * warp_in_wg + group) * 32 + ((tig / 2 ^ group) << 2) + 2 * (tig % 2);
  auto store_dq = [&](int step) {
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) ptx::fence_operand(dq[i]);
    float* tiles = smem.dq[step % 2][warpgroup][0];
    // Re-read each step, so that the compiler does not keep the four offsets it makes from it
    // live across the loop (at D = 128 it spilled them).
    uint32_t lane_offset = dq_lane;
    ptx::fence_operand(lane_offset);
#pragma unroll
    for (int nt = 0; nt < kCols / 8; ++nt) {
      float* at = tiles + nt / 4 * kBlockM * 32 + (lane_offset ^ (nt % 4) << 3);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(at + 8 * r * 32) =
            make_float2(f.scale * dq[nt * 4 + 2 * r], f.scale * dq[nt * 4 + 2 * r + 1]);
    }
  };
  // The reduction of a stored tile: issued after the next wgmmas where there are any, so that
  // the fence's and the barrier's waits do not hold them back.
  auto reduce_dq = [&](int step) {
    const int m0 = m_begin + step * kBlockM;
    float* tiles = smem.dq[step % 2][warpgroup][0];
    ptx::fence_proxy_async_shared_cta();  // the stores above, before the reduction (async proxy) reads them
    ptx::bar_sync(kDqTileBarrier + warpgroup, 128);  // the whole half is in the tile
    if (threadIdx.x % 128 == 0) {
#pragma unroll
      for (int box = 0; box < kCols / 32; ++box)
        ptx::cp_reduce_async_bulk_tensor_4d_add(&dq_map, c0 + 32 * box, m0, head, batch, tiles + box * kBlockM * 32);
      ptx::cp_async_bulk_commit_group();
    }
  };
  auto send_dq = [&](int step) {
    store_dq(step);
    reduce_dq(step);
  };
  // Every wgmma operand's descriptor is built once here; a k16 step adds a byte offset
  // (advance_smem_desc). Built per step from their addresses, the S^T and dP^T operands'
  // descriptors were kept in registers across the loop, and at D = 128 they spilled.
  constexpr uint32_t kKBlockBytes = kBlockN * 64 * sizeof(T);  // one 64-column block of K or V
  constexpr uint32_t kQBlockBytes = kBlockM * 64 * sizeof(T);  // one of Q or dO
  constexpr uint32_t kQStageBytes = D / 64 * kQBlockBytes;
  constexpr uint32_t kDsBytes = 64 * kBlockM * sizeof(T);      // one warpgroup's dS^T tile
  // K-major (S^T = K Q^T, dP^T = V dO^T): this warpgroup's 64 keys of K and V; Q and dO of stage 0.
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.k[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.v[0] + warpgroup * 64 * 64, 16, kAtomBytes);
  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q[0][0], 16, kAtomBytes);
  const uint64_t do_desc = ptx::make_smem_desc_sw128(smem.dout[0][0], 16, kAtomBytes);
  // N-major B operands (dK += dS^T Q, dV += P^T dO): column blocks kBlockM * 128 bytes apart.
  const uint64_t q_n_desc = ptx::make_smem_desc_sw128(smem.q[0][0], kBlockM * kSwizzleBytes, kAtomBytes);
  const uint64_t do_n_desc = ptx::make_smem_desc_sw128(smem.dout[0][0], kBlockM * kSwizzleBytes, kAtomBytes);
  // dQ = dS K: dS^T read M-major (parity 0), and K's columns c0 .. c0 + D/2 read N-major.
  const uint64_t ds_desc = ptx::make_smem_desc_sw128(smem.ds[0][0], 64 * kSwizzleBytes, kAtomBytes);
  const uint64_t k_dq_desc = ptx::make_smem_desc_sw128(smem.k[c0 / 64] + c0 % 64, kBlockN * kSwizzleBytes, kAtomBytes);

  // dQ[:, c0 : c0 + D/2] = dS K[:, c0 : c0 + D/2] of block `step` over all 128 keys, 16 at a
  // time: A is the dS^T tile of the warpgroup that owns those keys, read M-major (16 keys = 2048
  // bytes down); B is K read N-major, D/2 columns from column c0 (at D = 64, from the middle of
  // the 128-byte swizzled rows: 64 bytes in, the same swizzle). Issued at the top of the next
  // step (or after the loop), where both warpgroups' dS^T tiles of the block are written.
  auto issue_dq = [&](int step) {
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) ptx::fence_operand(dq[i]);
    ptx::wgmma_fence();  // likewise for dq's registers
    const uint64_t ds_parity_desc = ptx::advance_smem_desc(ds_desc, step % 2 * kWarpgroups * kDsBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      // 16 keys: dS^T tile kk / 4 (the warpgroup owning them), 16 rows = 2048 bytes down it.
      const uint32_t ds_bytes = kk / 4 * kDsBytes + kk % 4 * 16 * kSwizzleBytes;
      ptx::WgmmaM64K16<T, kCols>::template ss<1, 1>(dq, ptx::advance_smem_desc(ds_parity_desc, ds_bytes),
                                                    ptx::advance_smem_desc(k_dq_desc, kk * 16 * kSwizzleBytes), kk > 0);
    }
    ptx::wgmma_commit_group();
  };
  ptx::mbarrier_wait(&smem.kv_full, 0);  // K and V have landed

  // One step. The first has no block before it: a compile-time flag, so that ptxas sees every
  // dQ wgmma waited for on every path (with a run-time one it serializes all wgmmas, C7514).
  auto run_step = [&](int step, auto has_last) {
    constexpr bool kHasLast = decltype(has_last)::value;
    const int m0 = m_begin + step * kBlockM, stage = step % kStages;
    // The last block's dQ goes to the tensor cores first: it needs no barrier (its dS^T tiles
    // were written before named barrier 1 of the last step), and it runs while this step
    // waits at the barrier below and issues its loads.
    if constexpr (kHasLast) issue_dq(step - 1);
    // The reduction of three blocks ago has read the dQ tile that the last block's dQ goes to
    // (each warpgroup's issuing thread waits for its own; the barrier below passes that on).
    if (threadIdx.x % 128 == 0) ptx::cp_async_bulk_wait_group_read<1>();
    // WAR: every thread is done with the block before (its wgmmas completed, its reads of
    // the LSE and delta done), so that block's stage may take the next one. RAW: this
    // block's LSE and delta, written a step ago, are visible.
    __syncthreads();
    float next_stat = 0.f;  // the next block's LSE or delta (threads 0-127)
    if (step + 1 < steps) {
      if (threadIdx.x == 0)
        load_queries<T, D>(smem, &q_map, &dout_map, (step + 1) % kStages, m0 + kBlockM, head, batch);
      next_stat = fetch_row_stat(m0 + kBlockM);
      store_row_stat((step + 1) % kStages, next_stat);
    }

    // S^T = K Q^T and dP^T = V dO^T: per 16 columns of D one wgmma each, K-major operands.
    float s[kQTiles * 4], dp[kQTiles * 4];
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) % 2);  // this block's Q and dO have landed
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();  // s and dp reuse registers of the step before: those accesses come first
    const uint32_t stage_bytes = stage * kQStageBytes;
    // K's and V's descriptors re-read each step: otherwise the compiler keeps all D / 16 of
    // each that it makes from them live across the loop (at D = 128 it spilled them).
    uint64_t k_step_desc = k_desc, v_step_desc = v_desc;
    ptx::fence_operand(k_step_desc), ptx::fence_operand(v_step_desc);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // 16 columns of D: column block kk / 4, 32 bytes along its rows.
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, q_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kBlockM>::template ss<0>(s, ptx::advance_smem_desc(k_step_desc, kv_bytes),
                                                   ptx::advance_smem_desc(q_desc, stage_bytes + q_bytes), kk > 0);
    }
    // At D = 128, S^T alone goes behind the last block's dQ: with dP^T in flight too, dQ's
    // accumulators, dK, dV, S^T and dP^T would be 224 registers a thread. At D = 64 (144) both
    // go, and dQ is sent out while both run.
    constexpr bool kDpBehindDq = D == 64;
    if constexpr (kHasLast && !kDpBehindDq) {
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();  // the last block's dQ is in registers; S^T may still run
      store_dq(step - 1);
      ptx::wgmma_fence();  // dp's registers, before the wgmmas below write them
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t kv_bytes = kk / 4 * kKBlockBytes + kk % 4 * 32, do_bytes = kk / 4 * kQBlockBytes + kk % 4 * 32;
      ptx::WgmmaM64K16<T, kBlockM>::template ss<0>(dp, ptx::advance_smem_desc(v_step_desc, kv_bytes),
                                                   ptx::advance_smem_desc(do_desc, stage_bytes + do_bytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    if constexpr (kHasLast && kDpBehindDq) {
      ptx::wgmma_wait_group<1>();  // the last block's dQ is in registers; S^T and dP^T may still run
      send_dq(step - 1);
    }
    if constexpr (kHasLast && !kDpBehindDq) reduce_dq(step - 1);  // with S^T and dP^T running
    ptx::wgmma_wait_group<0>();  // S^T and dP^T are in registers
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);

    // P^T and dS^T. Accumulator element e of n8 tile nt is key key0 + 8 (e / 2), query
    // m0 + 8 nt + 2 t + e % 2. Masked where the tile is not wholly visible: a tail past Sq or
    // Sk, or the causal diagonal (visible_keys is monotone in the query).
    int first_lo, last_lo, first_hi, last_hi;
    visible_keys(f, m0, &first_lo, &last_lo);
    visible_keys(f, m0 + kBlockM - 1, &first_hi, &last_hi);
    const bool need_mask = m0 + kBlockM > f.seqlen_q || n_wg + 64 > f.seqlen_k || last_lo < n_wg + 64 ||
                           first_hi > n_wg;
    // Columns 8 nt + 2 t and + 1 of the block: their LSE and delta as one 8-byte load each.
    auto column_stats = [&](int nt, float2* lse, float2* delta) {
      *lse = *reinterpret_cast<const float2*>(&smem.lse_log2[stage][8 * nt + 2 * tig]);
      *delta = *reinterpret_cast<const float2*>(&smem.delta[stage][8 * nt + 2 * tig]);
    };
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt) {
        float2 lse, delta;
        column_stats(nt, &lse, &delta);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = m0 + 8 * nt + 2 * tig + e % 2, j = key0 + 8 * (e / 2);
          int first = 0, last = 0;
          if (i < f.seqlen_q) visible_keys(f, i, &first, &last);
          // Under the select: a query that sees no key has LSE -inf, and 2^+inf is unused.
          const float pv = j >= first && j < last
                               ? ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -(e % 2 ? lse.y : lse.x)))
                               : 0.f;
          s[nt * 4 + e] = pv;
          dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x));
        }
      }
    } else {
      // Every entry visible: every query of the block sees a key, so its LSE is finite.
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt) {
        float2 lse, delta;
        column_stats(nt, &lse, &delta);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], scale_log2, -(e % 2 ? lse.y : lse.x)));
          s[nt * 4 + e] = pv;
          dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - (e % 2 ? delta.y : delta.x));
        }
      }
    }

    // P^T and dS^T as wgmma A fragments, one per 16 queries (n8 tiles 2kk and 2kk + 1).
    uint32_t p_frag[kBlockM / 16][4], ds_frag[kBlockM / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p_frag[kk][r] = frag::pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        ds_frag[kk][r] = frag::pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
      }

    // dS^T into shared memory: row = key (64 rows of 128 bytes), column = query, in TMA's
    // 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)). Per 16 queries one
    // stmatrix of the packed fragment's four 8x8 matrices (register i: keys g + 8 (i % 2),
    // queries 8 (2 kk + i / 2) + 2 t); lane l gives row l % 8 of matrix l / 8. The tile starts
    // on a 1024-byte boundary, so the swizzled chunk (2 kk + l / 16) ^ (l % 8) is the lane's
    // kk = 0 address XOR 32 kk bytes: one address a lane (16 store addresses spilled at D = 128).
    // Before the wgmmas below are issued: the PTX ISA allows no access to the A registers of a
    // wgmma in flight.
    const int ds_row = 16 * warp_in_wg + lane % 8 + 8 * (lane / 8 % 2);
    const uint32_t ds_lane = ptx::cvta_to_shared_u32(smem.ds[step % 2][warpgroup]) + ds_row * kSwizzleBytes +
                             ((lane / 16 ^ lane % 8) << 4);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) ptx::stmatrix_x4(ds_lane ^ (kk << 5), ds_frag[kk]);
    ptx::fence_proxy_async_shared_cta();  // the writes above, before the dQ wgmma (async proxy) reads them

    // dV += P^T dO and dK += dS^T Q: per 16 queries one wgmma with N = D; dO and Q are read
    // N-major (16 queries = 2048 bytes down the tile; column blocks kBlockM * 128 bytes apart).
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
    ptx::wgmma_fence();  // the packed fragments are written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dv, p_frag[kk], ptx::advance_smem_desc(do_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dk, ds_frag[kk], ptx::advance_smem_desc(q_n_desc, stage_bytes + kk * 16 * kSwizzleBytes), 1);
    ptx::wgmma_commit_group();

    ptx::bar_sync(kDsBarrier, kThreads);  // both warpgroups have stored and fenced their dS^T tiles
    ptx::wgmma_wait_group<0>();  // dV, dK done: the fragments' registers are free
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) ptx::fence_operand(p_frag[kk][r]), ptx::fence_operand(ds_frag[kk][r]);
  };
  run_step(0, std::false_type{});
  for (int step = 1; step < steps; ++step) run_step(step, std::true_type{});
  issue_dq(steps - 1);
  // The reduction of two blocks before the last has read the tile that the last block's dQ
  // goes to: its issuing thread waits, and the warpgroup waits for that thread.
  if (threadIdx.x % 128 == 0) ptx::cp_async_bulk_wait_group_read<1>();
  ptx::bar_sync(kDqTileBarrier + warpgroup, 128);
  ptx::wgmma_wait_group<0>();  // the last block's dQ
  send_dq(steps - 1);
  // Shared memory must outlive the reductions that read it.
  if (threadIdx.x % 128 == 0) ptx::cp_async_bulk_wait_group_read<0>();

  // This warpgroup's dK and dV: written once, or into the sums of its K/V head (a GQA group's
  // query heads add up).
  store_dk_dv<T, D>(p, batch, head_kv, key0, tig, dk, dv);
}

// Refuses what the kernel cannot run, so that "auto" passes it on to an older kernel.
Status supports(const BackwardProblem& problem) {
  const AttentionProblem& p = problem.forward;
  if (p.head_dim != 64 && p.head_dim != 128)
    return {StatusCode::not_supported,
            std::string(kName) + ": head_dim " + std::to_string(p.head_dim) +
                " is not supported (64 and 128 only: at D = 256 the accumulators do not fit in the registers; "
                "bwd_02_mma_sync runs it)"};
  return Status::Ok();  // windows, varlen and KV caches: refused centrally (api.cpp)
}

Status launch(const BackwardProblem& problem, cudaStream_t stream) {
  const AttentionProblem& fwd = problem.forward;
  QkvTensorMaps maps;
  Status s = make_qkv_tensor_maps(fwd, kBlockM, kBlockN, kName, &maps);
  CUtensorMap dout_map;
  if (s.ok())
    s = make_bshd_tensor_map(&dout_map, problem.dout, fwd.dtype, fwd.batch, fwd.seqlen_q, fwd.heads_q, fwd.head_dim,
                             problem.dout_strides, kBlockM, 64);
  if (!s.ok()) return {s.code(), std::string(kName) + ": " + s.message()};
  return run_backward<AttentionParams>(problem, stream, kName, [&]<typename T, int D>(const BaseBackwardParams& p) -> Status {
    if constexpr (D > 128) {
      return {StatusCode::not_supported, std::string(kName) + ": head_dim > 128"};  // refused by supports()
    } else {
      constexpr int kSmem = smem_bytes<T, D>();
      static_assert(kSmem <= 227 * 1024, "shared memory per CTA exceeds sm_90's 227 KB");
      CUtensorMap dq_map;  // over run_backward's fp32 dQ sum, which exists only from here on
      Status st = make_fp32_bshd_tensor_map(&dq_map, p.dq_accum, fwd.batch, fwd.seqlen_q, fwd.heads_q, D, kBlockM);
      if (!st.ok()) return {st.code(), std::string(kName) + ": " + st.message()};
      return launch_per_key_block(main_kernel<T, D>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, maps.q, maps.k,
                                  maps.v, dout_map, dq_map, p);
    }
  }, /*dkdv_written_by_kernel=*/fwd.heads_q == fwd.heads_kv);
}

}  // namespace

const BackwardKernel& backward_dq_overlap() {
  static const BackwardKernel kernel{
      kName, "a block's dQ issued at the top of the next step, sent out while that step's S^T runs", supports, launch};
  return kernel;
}

}  // namespace hattn
