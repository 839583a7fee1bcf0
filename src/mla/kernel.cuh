// MLA decoding's attention kernel: one CTA per (run of the schedule, 64 query rows).
//
// The rows are a request's query heads x new tokens, which all read one latent K/V head. A
// producer thread streams 64-key tiles of the paged cache (576 columns: nine 64-column TMA
// boxes) into a two-stage ring. Two consumer warpgroups share each tile:
//   - S = Q K^T: consumer w scores keys 32w .. 32w + 31 against all 576 features;
//   - the row max: each writes its half's maxima to shared memory, both take the larger, so
//     both keep the same running max and rescale factor;
//   - P: each packs its half into wgmma A fragments and hands them to the other through
//     shared memory (the same thread index holds the same rows in both warpgroups);
//   - O += P V: consumer w owns output columns 256w .. 256w + 255, all 64 keys (V is the
//     tile's first 512 columns, read N-major from the same boxes as K).
// A request's segment ends with O / sum, the sums added across the two halves: to out and
// lse when the request is not split, else to its slot of fp32 partial results.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/fragment.cuh"
#include "../ptx/ex2.cuh"
#include "../ptx/griddepcontrol.cuh"
#include "../ptx/mbarrier.cuh"
#include "../ptx/named_barrier.cuh"
#include "../ptx/setmaxnreg.cuh"
#include "../ptx/smem.cuh"
#include "../ptx/tma.cuh"
#include "../ptx/wgmma.cuh"
#include "schedule.cuh"

namespace hattn::mla {

constexpr int kDimQk = 576;
constexpr int kDimV = 512;
constexpr int kBoxes = kDimQk / 64;                 // 64-column boxes (128-byte swizzled rows) per row
constexpr int kBoxBytes = kBlockN * 128;            // one box of 64 rows: 8 KB
constexpr int kTileBytes = kBoxes * kBoxBytes;      // Q's block, or one K/V tile: 72 KB
constexpr int kStages = 2;                          // K/V ring: 2 x 72 KB beside Q's 72 KB
constexpr int kThreads = 384;                       // the producer warpgroup, then two consumers
constexpr int kConsumerThreads = 256;
constexpr int kHalfKeys = kBlockN / 2;              // keys a consumer scores
constexpr int kHalfV = kDimV / 2;                   // output columns a consumer owns
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;             // 128 x (40 + 2 x 232) <= 65536

struct Params {
  const void* q;  // [B, Sq, Hq, 576]
  int64_t q_batch, q_seq, q_head;
  void* out;  // [B, Sq, Hq, 512]
  int64_t o_batch, o_seq, o_head;
  float* lse;  // [B, Hq, Sq] or null
  const int32_t* block_table;
  const int32_t* cache_seqlens;
  int max_pages_per_seq, page_size, capacity;  // capacity: max_pages_per_seq * page_size keys
  int batch, seqlen_q, heads_q, rows;          // rows = heads_q * seqlen_q
  float scale, scale_log2;
  int causal;
  const int32_t* schedule;
  int parts;
  float* o_partial;    // [slot][rows][512]
  float* lse_partial;  // [slot][rows]
};

struct alignas(1024) SharedStorage {
  unsigned char q[kTileBytes];              // Q's 64 rows, 128-byte swizzled boxes
  unsigned char kv[kStages][kTileBytes];    // the K/V ring, as TMA writes it
  uint32_t p_exchange[2][128][8];           // consumer w's P fragments (its 32 keys), per thread
  float row_exchange[2][kBlockM];           // consumer w's row maxima, then row sums
  uint64_t full[kStages], empty[kStages];
};
static_assert(sizeof(SharedStorage) + 1024 <= 227 * 1024, "MLA's shared memory exceeds sm_90's 227 KB");

// Named barriers (0 is __syncthreads).
enum Barrier : int {
  kQReady = 1,        // both consumers wrote Q
  kMaxExchange = 2,   // both wrote their row maxima
  kPExchange = 3,     // both wrote their P fragments
  kSumExchange = 4,   // both wrote their row sums
  kVZeroed = 5,       // (+ w) consumer w zeroed V's rows past the request's keys
};

#ifdef __CUDACC__
__device__ __forceinline__ Run load_run(const Params& p) {
  const int32_t* r = p.schedule + int64_t(blockIdx.x) * kRunInts;
  return {r[0], r[1], r[2], r[3], r[4]};
}

// Request b's keys, clamped to its pages (a length past them reads as the pages' keys), and
// this run's share of them.
__device__ __forceinline__ Segment segment(const Params& p, const Run& run, int b) {
  return segment_of(run, b, min(max(p.cache_seqlens[b], 0), p.capacity));
}

// Producer: one thread, the same walk over the run as the consumers.
__device__ __forceinline__ void produce(SharedStorage& smem, const CUtensorMap& kv_map, const Params& p) {
  const Run run = load_run(p);
  int ring = 0;
  for (int b = run.begin_batch; run_covers(run, b); ++b) {
    const Segment seg = segment(p, run, b);
    const int32_t* pages = p.block_table + int64_t(b) * p.max_pages_per_seq;
    for (int tile = seg.lo; tile < seg.hi; ++tile, ++ring) {
      const int stage = ring % kStages;
      // The consumers released this stage's previous tile (a fresh barrier passes parity 1).
      ptx::mbarrier_wait(&smem.empty[stage], (ring / kStages) % 2 ^ 1);
      ptx::mbarrier_arrive_expect_tx(&smem.full[stage], kTileBytes);
      const int key = tile * kBlockN;
      // A page outside the cache reads as zeros (TMA's bounds); the caller checks the table.
      const int page = pages[key / p.page_size], row = key % p.page_size;
#pragma unroll
      for (int box = 0; box < kBoxes; ++box)
        ptx::cp_async_bulk_tensor_4d_g2s(smem.kv[stage] + box * kBoxBytes, &kv_map, box * 64, row, 0, page,
                                         &smem.full[stage]);
    }
  }
}

// Q's 64 rows of request b into the 128-byte swizzled boxes wgmma reads (16-byte chunk c of
// row r at chunk c ^ r % 8), zeros past the request's rows. The 256 consumer threads share it.
template <typename T, typename Storage>  // Storage: this file's SharedStorage or seesaw.cuh's
__device__ __forceinline__ void load_q(Storage& smem, const Params& p, int b, int row_base, int thread) {
  constexpr int kChunks = kDimQk * int(sizeof(T)) / 16;  // 72 per row
  for (int i = thread; i < kBlockM * kChunks; i += kConsumerThreads) {
    const int r = i / kChunks, chunk = i % kChunks, row = row_base + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < p.rows) {
      const int s = row / p.heads_q, h = row % p.heads_q;
      const T* src = static_cast<const T*>(p.q) + b * p.q_batch + s * p.q_seq + h * p.q_head + chunk * 8;
      v = *reinterpret_cast<const uint4*>(src);
    }
    const int box = chunk / 8, c = chunk % 8;
    *reinterpret_cast<uint4*>(smem.q + box * kBoxBytes + r * 128 + (c ^ r % 8) * 16) = v;
  }
}

// A request's segment ends with O / sum for consumer w's 256 columns (sum: the row's whole sum,
// both consumers'): to out and lse when the request is not split, else to slot `split` of its
// fp32 partial results.
template <typename T>
__device__ __forceinline__ void write_segment(const Params& p, const float (&o)[kHalfV / 2], const float (&sum)[2],
                                              const float (&row_max)[2], int b, int split, int w, int row_base,
                                              const int (&local_row)[2], int lane, int col) {
  const int32_t* split_begin = p.schedule + int64_t(p.parts) * kRunInts;
  const int first_slot = split_begin[b];
  const bool whole = split_begin[b + 1] - first_slot == 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;  // a row that saw no key: O = 0
    const float lse = sum[r] > 0.f ? row_max[r] * p.scale + __logf(sum[r]) : -INFINITY;
    const int row = row_base + local_row[r];
    if (row >= p.rows) continue;
    const int s_idx = row / p.heads_q, h = row % p.heads_q;
    if (whole) {
      T* dst = static_cast<T*>(p.out) + b * p.o_batch + s_idx * p.o_seq + h * p.o_head + w * kHalfV + col;
#pragma unroll
      for (int nt = 0; nt < kHalfV / 8; ++nt)
        *reinterpret_cast<uint32_t*>(dst + nt * 8) =
            frag::pack2<T>(o[nt * 4 + 2 * r] * inv, o[nt * 4 + 2 * r + 1] * inv);
      if (w == 0 && lane % 4 == 0 && p.lse != nullptr) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + s_idx] = lse;
    } else {
      const int64_t slot_row = int64_t(first_slot + split) * p.rows + row;
      float* dst = p.o_partial + slot_row * kDimV + w * kHalfV + col;
#pragma unroll
      for (int nt = 0; nt < kHalfV / 8; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[nt * 4 + 2 * r] * inv, o[nt * 4 + 2 * r + 1] * inv);
      if (w == 0 && lane % 4 == 0) p.lse_partial[slot_row] = lse;
    }
  }
}

// Causal: the rows of new token s see the keys below len - (seqlen_q - 1 - s). Each of the
// thread's two accumulator rows (row_base + local_row[r]) gets its shift from len; returns the
// smallest shift of any row (tiles that end below len plus it need no mask).
__device__ __forceinline__ int causal_limits(const Params& p, int row_base, const int (&local_row)[2],
                                             int (&limit_shift)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = min(row_base + local_row[r], p.rows - 1);
    limit_shift[r] = p.causal ? row / p.heads_q - (p.seqlen_q - 1) : 0;
  }
  return p.causal ? -(p.seqlen_q - 1) : 0;
}

// The start both schedules' kernels share: thread 0 prefetches the tensor map, initializes the
// barriers (init_barriers) and lets the combine kernel launch: its CTAs take the SMs this grid
// leaves free and wait there (griddepcontrol.wait) for this grid to finish, so its launch does
// not follow the last CTA's exit. No thread waits on a barrier before it is initialized.
template <typename InitBarriers>
__device__ __forceinline__ void start_cta(const CUtensorMap& kv_map, InitBarriers init_barriers) {
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&kv_map);
    init_barriers();
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
    ptx::griddepcontrol_launch_dependents();
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ void consume(SharedStorage& smem, const Params& p, int w, int thread) {
  const int warp = thread / 32, lane = thread % 32;
  const int local_row[2] = {warp * 16 + lane / 4, warp * 16 + lane / 4 + 8};  // the accumulator's rows g, g + 8
  const int col = 2 * (lane % 4);                                               // its first column in an n8 tile
  const int row_base = int(blockIdx.y) * kBlockM;
  int limit_shift[2];
  const int min_shift = causal_limits(p, row_base, local_row, limit_shift);
  const Run run = load_run(p);

  const uint64_t q_desc = ptx::make_smem_desc_sw128(smem.q, 16, 1024);
  const uint64_t k_desc = ptx::make_smem_desc_sw128(smem.kv[0] + w * kHalfKeys * 128, 16, 1024);
  // V N-major: this consumer's four 64-column boxes, kBoxBytes apart (LBO).
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.kv[0] + w * 4 * kBoxBytes, kBoxBytes, 1024);

  int ring = 0;
  for (int b = run.begin_batch; run_covers(run, b); ++b) {
    const Segment seg = segment(p, run, b);
    const int len = seg.keys;

    // Both consumers have waited for their last S of the previous request (before its max
    // exchange), so Q may be overwritten. Generic-proxy writes, then wgmma (async proxy) reads:
    // each writer fences, then the barrier.
    load_q<T>(smem, p, b, row_base, w * 128 + thread);
    ptx::fence_proxy_async_shared_cta();
    ptx::bar_sync(kQReady, kConsumerThreads);

    float o[kHalfV / 2];  // m64n256 accumulators: 128 per thread
#pragma unroll
    for (int i = 0; i < kHalfV / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

    for (int tile = seg.lo; tile < seg.hi; ++tile, ++ring) {
      const int stage = ring % kStages;
      ptx::mbarrier_wait(&smem.full[stage], (ring / kStages) % 2);

      // S = Q K^T over this consumer's 32 keys: 36 k16 steps, four per box.
      float s[kHalfKeys / 2];
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDimQk / 16; ++kk) {
        const uint32_t q_bytes = kk / 4 * kBoxBytes + kk % 4 * 32;
        const uint32_t k_bytes = stage * kTileBytes + kk / 4 * kBoxBytes + kk % 4 * 32;
        ptx::WgmmaM64K16<T, kHalfKeys>::template ss<0>(s, ptx::advance_smem_desc(q_desc, q_bytes),
                                                        ptx::advance_smem_desc(k_desc, k_bytes), kk > 0);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < kHalfKeys / 2; ++i) ptx::fence_operand(s[i]);

      // Keys past a row's limit (the request's end, or the causal diagonal) score -inf.
      const int key0 = tile * kBlockN + w * kHalfKeys;
      if (tile * kBlockN + kBlockN > len + min_shift) {
#pragma unroll
        for (int i = 0; i < kHalfKeys / 2; ++i) {
          const int key = key0 + i / 4 * 8 + col + i % 2;
          if (key >= len + limit_shift[i % 4 / 2]) s[i] = -INFINITY;
        }
      }

      // The row max over both halves: each consumer's through shared memory.
      float tile_max[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kHalfKeys / 8; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        tile_max[r] = m;
        if (lane % 4 == 0) smem.row_exchange[w][local_row[r]] = m;
      }
      ptx::bar_sync(kMaxExchange, kConsumerThreads);
      float alpha[2], m_scaled[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m = fmaxf(row_max[r], fmaxf(tile_max[r], smem.row_exchange[1 - w][local_row[r]]));
        m_scaled[r] = m == -INFINITY ? 0.f : m * p.scale_log2;  // no key yet: weights 0, not NaN
        alpha[r] = m == row_max[r] ? 1.f : ptx::ex2_approx_ftz_f32(row_max[r] * p.scale_log2 - m_scaled[r]);
        row_max[r] = m;
      }

      // The request's last tile: rows past its keys hold another request's keys or anything
      // (NaN too), and P = 0 there does not cancel NaN in P V: zero this consumer's V columns
      // of those rows. Both consumers' S are done (the exchange above), and the other reads
      // only its own columns. Generic writes before wgmma reads: fence, then this warpgroup's
      // barrier.
      if (tile * kBlockN + kBlockN > len) {
        const int valid = len - tile * kBlockN;
        unsigned char* v_tile = smem.kv[stage] + w * 4 * kBoxBytes;
        for (int i = thread; i < (kBlockN - valid) * 4 * 8; i += 128) {
          const int row = valid + i / 32, box = i / 8 % 4, c = i % 8;
          *reinterpret_cast<uint4*>(v_tile + box * kBoxBytes + row * 128 + c * 16) = make_uint4(0u, 0u, 0u, 0u);
        }
        ptx::fence_proxy_async_shared_cta();
        ptx::bar_sync(kVZeroed + w, 128);
      }

      // P = 2^(s c - m c), this consumer's 32 keys, packed as two k16 A fragments.
      uint32_t own[2][4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kHalfKeys / 8; ++nt)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[nt * 4 + e] = ptx::ex2_approx_ftz_f32(fmaf(s[nt * 4 + e], p.scale_log2, -m_scaled[r]));
            sum += s[nt * 4 + e];
          }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        own[kk][0] = frag::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
        own[kk][1] = frag::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
        own[kk][2] = frag::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
        own[kk][3] = frag::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
      }
      uint4* mine = reinterpret_cast<uint4*>(smem.p_exchange[w][thread]);
      mine[0] = make_uint4(own[0][0], own[0][1], own[0][2], own[0][3]);
      mine[1] = make_uint4(own[1][0], own[1][1], own[1][2], own[1][3]);
      ptx::bar_sync(kPExchange, kConsumerThreads);
      const uint4* theirs = reinterpret_cast<const uint4*>(smem.p_exchange[1 - w][thread]);
      const uint4 t0 = theirs[0], t1 = theirs[1];
      const uint32_t other[2][4] = {{t0.x, t0.y, t0.z, t0.w}, {t1.x, t1.y, t1.z, t1.w}};
      // The four k16 fragments in key order, picked by value (a select, not an indexed array).
      uint32_t p_frag[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) p_frag[kk][i] = kk / 2 == w ? own[kk % 2][i] : other[kk % 2][i];

      // O = alpha O + P V: keys 0-31 are consumer 0's P, 32-63 consumer 1's; 16 keys = 2048
      // bytes down V's boxes.
#pragma unroll
      for (int i = 0; i < kHalfV / 2; ++i) o[i] *= alpha[i % 4 / 2];
#pragma unroll
      for (int i = 0; i < kHalfV / 2; ++i) ptx::fence_operand(o[i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        ptx::WgmmaM64K16<T, kHalfV>::template rs<1>(
            o, p_frag[kk], ptx::advance_smem_desc(v_desc, stage * kTileBytes + kk * 16 * 128), 1);
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();
#pragma unroll
      for (int i = 0; i < kHalfV / 2; ++i) ptx::fence_operand(o[i]);
      ptx::mbarrier_arrive(&smem.empty[stage]);  // this thread is done with the stage
    }

    // The segment's end: the row sums over the quad and both halves (the exchange buffer is
    // free: both read the last maxima before the last P exchange).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
      row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
      if (lane % 4 == 0) smem.row_exchange[w][local_row[r]] = row_sum[r];
    }
    ptx::bar_sync(kSumExchange, kConsumerThreads);
    const float total[2] = {row_sum[0] + smem.row_exchange[1 - w][local_row[0]],
                            row_sum[1] + smem.row_exchange[1 - w][local_row[1]]};
    write_segment<T>(p, o, total, row_max, b, seg.split, w, row_base, local_row, lane, col);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_kernel(const __grid_constant__ CUtensorMap kv_map,  // [num_pages, page_size, 1, 576], 64 x 64 boxes
                      const __grid_constant__ Params p) {
  extern __shared__ unsigned char smem_raw[];
  // wgmma descriptors and TMA's 128-byte swizzle assume 1024-byte aligned boxes.
  auto& smem = *reinterpret_cast<SharedStorage*>(ptx::align_shared<1024>(smem_raw));
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  start_cta(kv_map, [&] {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kConsumerThreads);  // every consumer thread releases
    }
  });
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) produce(smem, kv_map, p);
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();
  consume<T>(smem, p, warpgroup - 1, int(threadIdx.x) % 128);
}
#endif

}  // namespace hattn::mla
