// Parent: bwd_02_mma_sync.
// Backward step 3: the backward on Hopper's machinery (TMA, mbarriers, wgmma), D = 64 and 128.
//
// B02's algorithm (a CTA per block of keys walks the query blocks that see them), with the
// forward's steps 06-07 applied to it:
//   1. Tiles arrive by TMA into 128B-swizzled shared memory: K and V once (128 keys), Q and dO
//      per query block of 64 rows, two stages, on mbarriers.
//   2. Each warpgroup owns 64 of the keys and computes the transposed scores, keys as rows:
//          S^T = K Q^T,  dP^T = V dO^T        (wgmma m64n64, both operands in shared memory)
//      so that P^T and dS^T land in the accumulator layout that is, packed to 16 bits, the A
//      operand of the next two products straight from registers:
//          dV += P^T dO,  dK += dS^T Q        (wgmma m64nD, A from registers, B N-major)
//      P never goes through shared memory, and no warp needs another warp's values.
//   3. dQ = dS K needs dS with queries as rows: the warpgroup stores dS^T (16-bit, swizzled)
//      and reads it back as an M-major A operand (the instruction's transpose-A flag):
//          dQ_partial = dS K_wg               (wgmma m64nD over this warpgroup's 64 keys)
//      then adds it into the fp32 dQ sum (both warpgroups add: one sum per 64 keys, as B02).
//
// Barriers (who arrives -> who waits):
//   kv_full          thread 0's expect_tx + TMA bytes -> all threads, once
//   qdo_full[s]      thread 0's expect_tx + TMA bytes -> all threads, per use of stage s
//   __syncthreads    all threads -> thread 0, before it refills the stage the last block read
//   named 1 + wg     the warpgroup's 128 threads: dS^T written (and fenced to the async
//                    proxy) before its wgmma reads it
#include <cuda.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "backward.h"
#include "backward_common.cuh"
#include "fragment.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/named_barrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"
#include "tensor_map.h"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_03_wgmma";
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBlockN = 64 * kWarpgroups;  // keys per CTA: 64 per warpgroup
constexpr int kBlockM = 64;                // query rows per step
constexpr int kStages = 2;                 // Q/dO blocks in flight
constexpr int kSwizzleBytes = 128;         // one row of a 64-column block
constexpr int kAtomBytes = 1024;           // 8 rows x 128 bytes: the swizzle pattern's period
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kDsBarrier = 1;              // named barriers 1 and 2, one per warpgroup

// Every tile is [D / 64][rows][64]: TMA writes one 64-column box per block, 128B-swizzled.
template <typename T, int D>
struct SharedStorage {
  static constexpr int kColBlocks = D / 64;
  alignas(kAtomBytes) T k[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T v[kColBlocks][kBlockN * 64];
  alignas(kAtomBytes) T q[kStages][kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T dout[kStages][kColBlocks][kBlockM * 64];
  alignas(kAtomBytes) T ds[kWarpgroups][64 * kBlockM];  // dS^T of each warpgroup: [key][query], swizzled
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

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    main_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap dout_map,
                const BaseBackwardParams p) {
  constexpr int kDTiles = D / 8;       // n8 column tiles of dK, dV and dQ
  constexpr int kQTiles = kBlockM / 8;  // n8 column tiles of S^T and dP^T
  extern __shared__ unsigned char smem_raw[];
  // TMA's 128-byte swizzle repeats every 1024 bytes and wgmma descriptors assume tiles start
  // on that period: align the base by hand (dynamic shared memory only promises 16 bytes).
  auto& smem = *reinterpret_cast<SharedStorage<T, D>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes);
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
    ptx::mbarrier_init(&smem.kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) ptx::mbarrier_init(&smem.qdo_full[s], 1);
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
  }
  __syncthreads();  // no thread waits on a barrier before it is initialized
  if (steps == 0) return;  // no query sees these keys: their dK and dV stay 0

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
  auto load_row_stats = [&](int stage, int m0) {
    const int t = int(threadIdx.x) % kBlockM, i = m0 + t;
    if (threadIdx.x < kBlockM)
      smem.lse_log2[stage][t] = i < f.seqlen_q ? f.lse[row_base + i] * kLog2e : 0.f;
    else if (threadIdx.x < 2 * kBlockM)
      smem.delta[stage][t] = i < f.seqlen_q ? p.delta[row_base + i] : 0.f;
  };
  load_row_stats(0, m_begin);

  float dk[kDTiles * 4] = {}, dv[kDTiles * 4] = {};
  ptx::mbarrier_wait(&smem.kv_full, 0);

  for (int step = 0; step < steps; ++step) {
    const int m0 = m_begin + step * kBlockM, stage = step % kStages;
    // WAR: every thread is done with the block before (its wgmmas completed, its reads of
    // the LSE and delta done), so that block's stage may take the next one. RAW: this
    // block's LSE and delta, written a step ago, are visible.
    __syncthreads();
    if (step + 1 < steps) {
      if (threadIdx.x == 0)
        load_queries<T, D>(smem, &q_map, &dout_map, (step + 1) % kStages, m0 + kBlockM, head, batch);
      load_row_stats((step + 1) % kStages, m0 + kBlockM);
    }

    // S^T = K Q^T and dP^T = V dO^T: per 16 columns of D one wgmma each, K-major operands.
    float s[kQTiles * 4], dp[kQTiles * 4];
    ptx::mbarrier_wait(&smem.qdo_full[stage], (step / kStages) % 2);
#pragma unroll
    for (int i = 0; i < kQTiles * 4; ++i) ptx::fence_operand(s[i]), ptx::fence_operand(dp[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* k_tile = smem.k[kk / 4] + warpgroup * 64 * 64 + kk % 4 * 16;
      const T* q_tile = smem.q[stage][kk / 4] + kk % 4 * 16;
      ptx::WgmmaM64K16<T, kBlockM>::template ss<0>(s, ptx::make_smem_desc_sw128(k_tile, 16, kAtomBytes),
                                                   ptx::make_smem_desc_sw128(q_tile, 16, kAtomBytes), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const T* v_tile = smem.v[kk / 4] + warpgroup * 64 * 64 + kk % 4 * 16;
      const T* do_tile = smem.dout[stage][kk / 4] + kk % 4 * 16;
      ptx::WgmmaM64K16<T, kBlockM>::template ss<0>(dp, ptx::make_smem_desc_sw128(v_tile, 16, kAtomBytes),
                                                   ptx::make_smem_desc_sw128(do_tile, 16, kAtomBytes), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<0>();
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
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bool visible = true;
        if (need_mask) {
          const int i = m0 + 8 * nt + 2 * tig + e % 2, j = key0 + 8 * (e / 2);
          int first = 0, last = 0;
          if (i < f.seqlen_q) visible_keys(f, i, &first, &last);
          visible = j >= first && j < last;
        }
        // Under the select: a query that sees no key has LSE -inf, and exp2 of +inf is unused.
        const int col = 8 * nt + 2 * tig + e % 2;
        const float pv = visible ? exp2f(s[nt * 4 + e] * scale_log2 - smem.lse_log2[stage][col]) : 0.f;
        s[nt * 4 + e] = pv;
        dp[nt * 4 + e] = pv * (dp[nt * 4 + e] - smem.delta[stage][col]);
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
    // 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), from the packed
    // fragments (register 2 (nt % 2) + r: n8 tile nt, row g + 8 r). Before the wgmmas below
    // are issued: the PTX ISA allows no access to the A registers of a wgmma in flight.
    T* ds_tile = smem.ds[warpgroup];
#pragma unroll
    for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * warp_in_wg + group + 8 * r;
        *reinterpret_cast<uint32_t*>(&ds_tile[row * 64 + ((nt ^ (row % 8)) * 8) + 2 * tig]) =
            ds_frag[nt / 2][2 * (nt % 2) + r];
      }
    ptx::fence_proxy_async_shared_cta();  // the writes above, before the dQ wgmma (async proxy) reads them

    // dV += P^T dO and dK += dS^T Q: per 16 queries one wgmma with N = D; dO and Q are read
    // N-major (16 queries = 2048 bytes down the tile; column blocks kBlockM * 128 bytes apart).
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
    ptx::wgmma_fence();  // the packed fragments are written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const T* do_tile = smem.dout[stage][0] + kk * 16 * 64;
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dv, p_frag[kk], ptx::make_smem_desc_sw128(do_tile, kBlockM * kSwizzleBytes, kAtomBytes), 1);
    }
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const T* q_tile = smem.q[stage][0] + kk * 16 * 64;
      ptx::WgmmaM64K16<T, D>::template rs<1>(
          dk, ds_frag[kk], ptx::make_smem_desc_sw128(q_tile, kBlockM * kSwizzleBytes, kAtomBytes), 1);
    }
    ptx::wgmma_commit_group();

    ptx::bar_sync(kDsBarrier + warpgroup, 128);  // all 128 threads have stored and fenced their part of dS^T
    ptx::wgmma_wait_group<0>();  // dV, dK done: the fragments' registers are free
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) ptx::fence_operand(dk[i]), ptx::fence_operand(dv[i]);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) ptx::fence_operand(p_frag[kk][r]), ptx::fence_operand(ds_frag[kk][r]);

    // dQ_partial = dS K_wg over this warpgroup's 64 keys, 64 columns of D at a time: A is dS^T
    // read M-major (16 keys = 2048 bytes down), B is K read N-major (rows of this warpgroup).
#pragma unroll
    for (int cb = 0; cb < D / 64; ++cb) {
      float dq[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::fence_operand(dq[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const T* a_tile = ds_tile + kk * 16 * 64;
        const T* k_tile = smem.k[cb] + (warpgroup * 64 + kk * 16) * 64;
        ptx::WgmmaM64K16<T, 64>::template ss<1, 1>(dq, ptx::make_smem_desc_sw128(a_tile, 64 * kSwizzleBytes, kAtomBytes),
                                                   ptx::make_smem_desc_sw128(k_tile, kBlockN * kSwizzleBytes, kAtomBytes),
                                                   kk > 0);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < 32; ++i) ptx::fence_operand(dq[i]);
      // Accumulator rows are queries m0 + 16 warp + g (+ 8), columns 64 cb + 8 nt + 2 t.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + 16 * warp_in_wg + group + 8 * r;
        if (i >= f.seqlen_q) continue;
        float* row = p.dq_accum + ((int64_t(batch) * f.seqlen_q + i) * f.heads_q + head) * D + 64 * cb + 2 * tig;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          atomicAdd(reinterpret_cast<float2*>(row + 8 * nt),
                    make_float2(f.scale * dq[nt * 4 + 2 * r], f.scale * dq[nt * 4 + 2 * r + 1]));
      }
    }
  }

  // This warpgroup's dK and dV into the sums of its K/V head (a GQA group's query heads add up).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    if (key >= f.seqlen_k) continue;
    const int64_t at = ((int64_t(batch) * f.seqlen_k + key) * f.heads_kv + head_kv) * D + 2 * tig;
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      atomicAdd(reinterpret_cast<float2*>(p.dk_accum + at + 8 * dt),
                make_float2(f.scale * dk[dt * 4 + 2 * r], f.scale * dk[dt * 4 + 2 * r + 1]));
      atomicAdd(reinterpret_cast<float2*>(p.dv_accum + at + 8 * dt), make_float2(dv[dt * 4 + 2 * r], dv[dt * 4 + 2 * r + 1]));
    }
  }
}

Status supports(const BackwardProblem& problem) {
  const int head_dim = problem.forward.head_dim;
  if (head_dim > 128)
    return {StatusCode::not_supported,
            std::string(kName) + ": head_dim " + std::to_string(head_dim) +
                " is not supported (D <= 128: dK and dV of 64 keys take D registers a thread; bwd_02_mma_sync runs D = 256)"};
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
      return launch_per_key_block(main_kernel<T, D>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, maps.q, maps.k,
                                  maps.v, dout_map, p);
    }
  });
}

}  // namespace

const BackwardKernel& backward_wgmma() {
  static const BackwardKernel kernel{
      kName, "TMA and wgmma, a CTA per 128 keys: S^T = K Q^T, so P^T and dS^T feed dV and dK from registers",
      supports, launch};
  return kernel;
}

}  // namespace hattn
