// MLA decoding's attention kernel, the seesaw schedule: one CTA per (run of the split-KV
// schedule, 64 query rows).
//
// The rows are a request's query heads x new tokens, which all read one latent K/V head. A
// producer thread streams the cache in pairs of 64-key tiles (576 columns: nine 64-column TMA
// boxes): the pair's even tile into stage 0, its odd tile into stage 1, each as three pieces
// (boxes 0-3, 4-7 and 8) that are reloaded as soon as their last reader is done with them. Each
// box completes on a barrier of its own, so a product starts on a box as soon as it lands.
// Two consumer warpgroups work the pair as a seesaw, so that one's softmax runs while the
// other's matrix products keep the tensor cores busy:
//   - consumer 0 scores the even tile (S0 = Q K0^T over all 576 features), takes the running
//     max m0 with it, and hands m0 on; consumer 1 scores the odd tile and takes the pair's max
//     m1 = max(m0, its tile's). Each exponentiates its own tile's scores: P0 and P1.
//   - consumer w owns output columns 256w .. 256w + 255 (V is a tile's first 512 columns, read
//     N-major from the same boxes): consumer 0 adds P0 V0 (P0 in registers) while consumer 1
//     scores; consumer 1 adds P1 V1 (registers), then P0 V0 with P0 rescaled to m1 and shared
//     by consumer 0; consumer 0 adds P1 V1 with P1 shared by consumer 1.
//   - consumer 1 finishes a pair first, but its next S1 waits until consumer 0 has issued the
//     next S0 (kS0Issued): the pair waits on m0, so S0 goes to the tensor cores first.
// The shared P tiles take the place of their tiles' rope boxes (K's last 64 columns), which
// only the scorer reads: Q and the two stages fill shared memory. A request's segment ends with
// O / sum, the sums added across the two consumers: to out and lse when the request is not
// split, else to its slot of fp32 partial results.
//
// It replaced a schedule in which both consumers shared every tile (S split by keys, O by
// columns, the row maxima and P exchanged per tile), so that both waited through each softmax.
// In one H100 run (results/evidence/h100_9b25b3f/) the seesaw took 0.87 to 0.93 of that one's
// time at 128 heads x 2 new tokens with 32 or 128 requests, and 0.98 to 1.03 at the other
// points, where memory or a call's floor bounds both. The barrier per box, S0 first and the
// rescale skip then took 0.89 to 0.93 of the seesaw's time at 256 rows and 0.96 to 1.01 at 16
// to 64 rows, on 1 to 128 requests of 1k to 32k keys (results/evidence/h100_29e7535/, an H100).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../common/fragment.cuh"
#include "../ptx/cp_async.cuh"
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
constexpr int kStages = 2;                          // a pair's two tiles, one a stage: 2 x 72 KB beside Q's
constexpr int kThreads = 384;                       // the producer warpgroup, then two consumers
constexpr int kConsumerThreads = 256;
constexpr int kHalfV = kDimV / 2;                   // output columns a consumer owns
constexpr int kLatentBoxes = kDimV / 64;            // V's boxes: a tile's first 512 columns
constexpr int kRopeBox = kBoxes - 1;                // K's rope columns: once scored, the tile's P
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;             // 128 x (40 + 2 x 232) <= 65536
// A stage's three pieces, the units it is released and reloaded in: boxes 0-3 (K's first 256
// features, V's left half), boxes 4-7 (V's right half) and box 8 (the rope part, then P).
constexpr int kPieces = 3;
constexpr int kRopePiece = 2;  // the piece that is box 8 alone
__host__ __device__ constexpr int piece_first_box(int piece) { return piece * 4; }
__host__ __device__ constexpr int piece_boxes(int piece) { return piece == kRopePiece ? 1 : 4; }

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
  unsigned char q[kTileBytes];                 // Q's 64 rows, 128-byte swizzled boxes
  unsigned char kv[kStages][kTileBytes];       // the pair's tiles, as TMA writes them
  float max_exchange[kBlockM];                 // the running max: consumer 0's m0, then consumer 1's m1
  float sum_exchange[2][kBlockM];              // each consumer's row sums at a segment's end
  uint64_t full[kStages][kBoxes];   // a box landed (TMA's bytes)
  uint64_t empty[kStages][kPieces];  // a piece's readers are done with it
};
static_assert(sizeof(SharedStorage) + 1024 <= 227 * 1024, "MLA's shared memory exceeds sm_90's 227 KB");

// Consumers that read each piece before it may be reloaded. One consumer alone: stage 0's boxes
// 0-3 (consumer 0: S0, P0 V0 left) and stage 1's boxes 4-7 (consumer 1: S1, P1 V1 right). Both:
// stage 0's boxes 4-7 (S0; V0 right) and 8 (S0; P0 for consumer 1), stage 1's boxes 0-3 (S1;
// V1 left) and 8 (S1; P1 for consumer 0).
__host__ __device__ constexpr int piece_readers(int stage, int piece) {
  return (stage == 0 && piece == 0) || (stage == 1 && piece == 1) ? 128 : 256;
}

// Named barriers (0 is __syncthreads).
enum Barrier : int {
  kQReady = 1,        // both consumers wrote Q
  kMaxReady0 = 2,     // consumer 0 wrote m0 (and zeroed its tile's V rows past the request)
  kMaxReady1 = 3,     // consumer 1 wrote m1 and P1 (and zeroed its tile's V rows past the request)
  kP0Ready = 4,       // consumer 0 wrote P0 rescaled to m1
  kSumExchange = 5,   // both wrote their row sums
  kOwnGroup = 6,      // (+ w) consumer w's four warps, around zeroing V rows
  kS0Issued = 8,      // consumer 0 issued S0's products (consumer 1's S1 goes to the tensor cores after them)
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

// Producer: one thread, the same walk over the run's pairs as the consumers. A pair's pieces
// load in the order the pair before frees them: stage 0's boxes 0-3 (consumer 0 alone, after P0
// V0 left), stage 1's boxes 4-7 (consumer 1 alone, after P1 V1 right), then stage 0's boxes 4-7
// and 8 (consumer 1's last product, P0 V0 right) and stage 1's boxes 0-3 and 8 (consumer 0's
// last, P1 V1 left). Each consumer's next S starts on the piece it freed first: the pair's last
// products run while that piece loads, and the next S's first 16 k-steps while the rest load.
__device__ __forceinline__ void produce(SharedStorage& smem, const CUtensorMap& kv_map, const Params& p) {
  const Run run = load_run(p);
  int loads_even = 0, loads_odd = 0;  // tiles loaded into stages 0 and 1 so far
  for (int b = run.begin_batch; run_covers(run, b); ++b) {
    const Segment seg = segment(p, run, b);
    const int32_t* pages = p.block_table + int64_t(b) * p.max_pages_per_seq;
    // Piece `piece` of `tile` into `stage`, the stage's `loads`-th tile.
    auto load_piece = [&](int stage, int piece, int tile, int loads) {
      const int key = tile * kBlockN;
      // A page outside the cache reads as zeros (TMA's bounds); the caller checks the table.
      const int page = pages[key / p.page_size], row = key % p.page_size;
      const int first_box = piece_first_box(piece);
      // The piece's readers released its previous tile (a fresh barrier passes parity 1).
      ptx::mbarrier_wait(&smem.empty[stage][piece], uint32_t(loads % 2) ^ 1u);
#pragma unroll
      for (int box = first_box; box < first_box + piece_boxes(piece); ++box) {
        ptx::mbarrier_arrive_expect_tx(&smem.full[stage][box], kBoxBytes);
        ptx::cp_async_bulk_tensor_4d_g2s(smem.kv[stage] + box * kBoxBytes, &kv_map, box * 64, row, 0, page,
                                         &smem.full[stage][box]);
      }
    };
    for (int tile0 = seg.lo; tile0 < seg.hi; tile0 += 2) {
      const bool has_odd = tile0 + 1 < seg.hi;
      load_piece(0, 0, tile0, loads_even);
      if (has_odd) load_piece(1, 1, tile0 + 1, loads_odd);
      load_piece(0, 1, tile0, loads_even);
      load_piece(0, kRopePiece, tile0, loads_even);
      ++loads_even;
      if (has_odd) {
        load_piece(1, 0, tile0 + 1, loads_odd);
        load_piece(1, kRopePiece, tile0 + 1, loads_odd);
        ++loads_odd;
      }
    }
  }
}

// Q's 64 rows of request b into the 128-byte swizzled boxes wgmma reads (16-byte chunk c of
// row r at chunk c ^ r % 8), zeros past the request's rows. The 256 consumer threads share it,
// 18 cp.async copies each, all in flight at once: loaded through registers, the loop's 18 loads
// went one round trip at a time, several microseconds before a request's first S.
template <typename T>
__device__ __forceinline__ void load_q(SharedStorage& smem, const Params& p, int b, int row_base, int thread) {
  constexpr int kChunks = kDimQk * int(sizeof(T)) / 16;  // 72 per row
  const uint32_t q = ptx::cvta_to_shared_u32(smem.q);
  for (int i = thread; i < kBlockM * kChunks; i += kConsumerThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    // A row past the request's copies nothing (zero fill) from the block's first row.
    const bool in_rows = row_base + r < p.rows;
    const int row = in_rows ? row_base + r : row_base;
    const int s = row / p.heads_q, h = row % p.heads_q;
    const T* src = static_cast<const T*>(p.q) + b * p.q_batch + s * p.q_seq + h * p.q_head + chunk * 8;
    const int box = chunk / 8, c = chunk % 8;
    ptx::cp_async_cg_shared_global_16(q + box * kBoxBytes + r * 128 + (c ^ r % 8) * 16, src, in_rows);
  }
  ptx::cp_async_commit_group();
  ptx::cp_async_wait_group<0>();  // this thread's copies are in Q (the caller fences and meets)
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

// The CTA's start: thread 0 prefetches the tensor map, initializes the pieces' barriers and lets
// the combine kernel launch: its CTAs take the SMs this grid leaves free and wait there
// (griddepcontrol.wait) for this grid to finish, so its launch does not follow the last CTA's
// exit. No thread waits on a barrier before it is initialized.
__device__ __forceinline__ void start_cta(SharedStorage& smem, const CUtensorMap& kv_map) {
  if (threadIdx.x == 0) {
    ptx::prefetch_tensormap(&kv_map);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      for (int box = 0; box < kBoxes; ++box) ptx::mbarrier_init(&smem.full[s][box], 1);
      for (int piece = 0; piece < kPieces; ++piece)
        ptx::mbarrier_init(&smem.empty[s][piece], piece_readers(s, piece));  // each reader thread releases
    }
    ptx::fence_mbarrier_init();  // the TMA unit (async proxy) must see initialized barriers
    ptx::griddepcontrol_launch_dependents();
  }
  __syncthreads();
}

// The state a consumer carries through a segment: its 64 x 256 share of O, and per row (g and
// g + 8 of the accumulator) the running max and this thread's part of the row sum.
struct RowState {
  float o[kHalfV / 2];
  float max[2], sum[2];
};

// What both consumers need to score and mask a tile.
struct TileContext {
  uint64_t q_desc, k_desc;
  int len;                    // the request's keys
  int limit_shift[2];         // causal: row r sees the keys below len + limit_shift[r]
  int min_shift;
  int col;
};

// A descriptor the compiler cannot see through: each matrix product's k-step descriptors are then
// computed next to it, not hoisted out of the tile loop (72 loop-invariant 64-bit descriptors
// per consumer would not fit in its registers beside O).
__device__ __forceinline__ uint64_t opaque(uint64_t desc) {
  asm volatile("" : "+l"(desc));
  return desc;
}

// The order a stage's boxes are scored in: first the piece the scorer itself freed early in the
// pair before (stage 0: boxes 0-3; stage 1: boxes 4-7), then the other four, then the rope box.
__host__ __device__ constexpr int scored_box(int stage, int i) { return stage == 1 && i < 8 ? (i + 4) % 8 : i; }

// Waits until boxes first .. first + count - 1 of `stage` have landed.
__device__ __forceinline__ void wait_boxes(SharedStorage& smem, int stage, int first, int count, uint32_t parity) {
#pragma unroll
  for (int box = first; box < first + count; ++box) ptx::mbarrier_wait(&smem.full[stage][box], parity);
}

// S = Q K^T for the tile in `stage`: 36 k16 steps, four per box, each box's as soon as it lands.
template <typename T, int stage>
__device__ __forceinline__ void score(float (&s)[32], SharedStorage& smem, const TileContext& c, uint32_t parity) {
  const uint64_t q_desc = opaque(c.q_desc), k_base = opaque(c.k_desc);
#pragma unroll
  for (int i = 0; i < kBoxes; ++i) {
    const int box = scored_box(stage, i);
    ptx::mbarrier_wait(&smem.full[stage][box], parity);
    ptx::wgmma_fence();  // after the wait's loop: before the chain's first product, and again
                         // where the compiler would otherwise insert it
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t k_desc = ptx::advance_smem_desc(k_base, stage * kTileBytes + box * kBoxBytes + k * 32);
      ptx::WgmmaM64K16<T, kBlockN>::template ss<0>(s, ptx::advance_smem_desc(q_desc, box * kBoxBytes + k * 32),
                                                    k_desc, i > 0 || k > 0);
    }
  }
  ptx::wgmma_commit_group();
  if (stage == 0) ptx::bar_arrive(kS0Issued, kConsumerThreads);
  ptx::wgmma_wait_group<0>();
#pragma unroll
  for (int i = 0; i < 32; ++i) ptx::fence_operand(s[i]);
}

// Keys past a row's limit (the request's end, or the causal diagonal) score -inf; returns the
// tile's row maxima over the quad.
__device__ __forceinline__ void mask_and_max(float (&s)[32], const TileContext& c, int tile, float (&tile_max)[2]) {
  if (tile * kBlockN + kBlockN > c.len + c.min_shift) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int key = tile * kBlockN + i / 4 * 8 + c.col + i % 2;
      if (key >= c.len + c.limit_shift[i % 4 / 2]) s[i] = -INFINITY;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) m = fmaxf(m, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    tile_max[r] = m;
  }
}

// The new max of each row: its scale factor for what was summed under the old max, and the
// new max times the log2 scale (0 for a row with no key yet: weights 0, not NaN).
__device__ __forceinline__ void take_max(float (&row_max)[2], const float (&new_max)[2], float scale_log2,
                                         float (&rescale)[2], float (&max_scaled)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    max_scaled[r] = new_max[r] == -INFINITY ? 0.f : new_max[r] * scale_log2;
    rescale[r] = new_max[r] == row_max[r] ? 1.f : ptx::ex2_approx_ftz_f32(row_max[r] * scale_log2 - max_scaled[r]);
    row_max[r] = new_max[r];
  }
}

// P = 2^(s c - m c) in place, its row sums added to the thread's running sums.
__device__ __forceinline__ void exponentiate(float (&s)[32], RowState& st, const float (&max_scaled)[2],
                                             float scale_log2) {
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    s[i] = ptx::ex2_approx_ftz_f32(fmaf(s[i], scale_log2, -max_scaled[i % 4 / 2]));
    st.sum[i % 4 / 2] += s[i];
  }
}

// A warp whose 16 rows all kept their max (take_max's factor is then exactly 1) skips the 128
// multiplies: after a request's first tiles the max seldom moves.
__device__ __forceinline__ void rescale_rows(RowState& st, const float (&rescale)[2]) {
  if (!__any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f)) return;
#pragma unroll
  for (int i = 0; i < kHalfV / 2; ++i) st.o[i] *= rescale[i % 4 / 2];
#pragma unroll
  for (int r = 0; r < 2; ++r) st.sum[r] *= rescale[r];
}

// P's k16 A fragments (keys 16 kk .. 16 kk + 15) from the accumulator layout of s.
template <typename T>
__device__ __forceinline__ void pack_p(uint32_t (&frag)[4][4], const float (&s)[32]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) frag[kk][i] = frag::pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

// P (times `factor` per row) into a 128-byte swizzled 64 x 64 box, the layout of an A operand.
template <typename T>
__device__ __forceinline__ void store_p(unsigned char* box, const float (&s)[32], const float (&factor)[2],
                                        const int (&local_row)[2], int col) {
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int r = local_row[i % 4 / 2], key = i / 4 * 8 + col;
    const float f = factor[i % 4 / 2];
    *reinterpret_cast<uint32_t*>(box + r * 128 + ((key / 8) ^ r % 8) * 16 + key % 8 * 2) =
        frag::pack2<T>(s[i] * f, s[i + 1] * f);
  }
}

// The request's last tile: rows past its keys hold another request's keys or anything (NaN
// too), and P = 0 there does not cancel NaN in P V. The tile's scorer zeroes V's rows there
// once all its warps' S are done; the other consumer reads them after a barrier that follows.
// Generic writes before wgmma reads: fence, then this warpgroup's barrier.
__device__ __forceinline__ void zero_tail_rows(SharedStorage& smem, int stage, int valid, int w, int thread) {
  ptx::bar_sync(kOwnGroup + w, 128);
  unsigned char* tile = smem.kv[stage];
  for (int i = thread; i < (kBlockN - valid) * kLatentBoxes * 8; i += 128) {
    const int row = valid + i / (kLatentBoxes * 8), box = i / 8 % kLatentBoxes, c = i % 8;
    *reinterpret_cast<uint4*>(tile + box * kBoxBytes + row * 128 + c * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
  ptx::fence_proxy_async_shared_cta();
  ptx::bar_sync(kOwnGroup + w, 128);
}

// O += P V over 64 keys for this consumer's 256 columns of the tile in `stage`; P from
// registers or from a shared box. Two may be chained (issued with the first in flight); the
// caller fences O (fence_o) after writing it and before the first.
template <typename T>
__device__ __forceinline__ void add_pv_regs(RowState& st, const uint32_t (&frag)[4][4], uint64_t v_desc, int stage) {
  v_desc = opaque(v_desc);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // 16 keys = 2048 bytes down V's boxes
    ptx::WgmmaM64K16<T, kHalfV>::template rs<1>(st.o, frag[kk],
                                                ptx::advance_smem_desc(v_desc, stage * kTileBytes + kk * 2048), 1);
  ptx::wgmma_commit_group();
}

template <typename T>
__device__ __forceinline__ void add_pv_shared(RowState& st, uint64_t p_desc, uint64_t v_desc, int stage) {
  p_desc = opaque(p_desc), v_desc = opaque(v_desc);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    ptx::WgmmaM64K16<T, kHalfV>::template ss<1>(st.o, ptx::advance_smem_desc(p_desc, stage * kTileBytes + kk * 32),
                                                ptx::advance_smem_desc(v_desc, stage * kTileBytes + kk * 2048), 1);
  ptx::wgmma_commit_group();
}

__device__ __forceinline__ void fence_o(RowState& st) {
#pragma unroll
  for (int i = 0; i < kHalfV / 2; ++i) ptx::fence_operand(st.o[i]);
}

__device__ __forceinline__ void wait_pv(RowState& st) {
  ptx::wgmma_wait_group<0>();
#pragma unroll
  for (int i = 0; i < kHalfV / 2; ++i) ptx::fence_operand(st.o[i]);
}

// Consumer w (a template argument: each role is compiled on its own, and the registers of one
// do not constrain the other's).
template <typename T, int w>
__device__ __forceinline__ void consume(SharedStorage& smem, const Params& p, int thread) {
  const int warp = thread / 32, lane = thread % 32;
  const int local_row[2] = {warp * 16 + lane / 4, warp * 16 + lane / 4 + 8};  // the accumulator's rows g, g + 8
  const int row_base = int(blockIdx.y) * kBlockM;
  TileContext c;
  c.col = 2 * (lane % 4);  // the thread's first column in an n8 tile
  c.min_shift = causal_limits(p, row_base, local_row, c.limit_shift);
  c.q_desc = ptx::make_smem_desc_sw128(smem.q, 16, 1024);
  c.k_desc = ptx::make_smem_desc_sw128(smem.kv[0], 16, 1024);
  // V N-major: this consumer's four 64-column boxes, kBoxBytes apart (LBO).
  const uint64_t v_desc = ptx::make_smem_desc_sw128(smem.kv[0] + w * 4 * kBoxBytes, kBoxBytes, 1024);
  // P0 and P1 as A operands: each in its tile's rope box, dead once the tile is scored.
  const uint64_t p_desc = ptx::make_smem_desc_sw128(smem.kv[0] + kRopeBox * kBoxBytes, 16, 1024);
  const Run run = load_run(p);
  int uses = 0;  // tiles this consumer scored so far: its stage's full barriers' phase
  // Tiles of the other stage this consumer read so far: that stage's full barriers' phase. The
  // other consumer waited on them already, but each reader waits itself, so that the TMA's
  // writes are seen through the barrier that completes them (a wait that returns at once: the
  // phase cannot move on before this consumer releases it).
  int other_uses = 0;

  for (int b = run.begin_batch; run_covers(run, b); ++b) {
    const Segment seg = segment(p, run, b);
    c.len = seg.keys;

    // Both consumers have waited for their last S of the previous request (before the sum
    // exchange), so Q may be overwritten. Generic-proxy writes (cp.async's, complete once
    // load_q's wait returns), then wgmma (async proxy) reads: each writer fences, then the barrier.
    load_q<T>(smem, p, b, row_base, w * 128 + thread);
    ptx::fence_proxy_async_shared_cta();
    ptx::bar_sync(kQReady, kConsumerThreads);

    RowState st;
#pragma unroll
    for (int i = 0; i < kHalfV / 2; ++i) st.o[i] = 0.f;
    st.max[0] = st.max[1] = -INFINITY;
    st.sum[0] = st.sum[1] = 0.f;

    for (int tile0 = seg.lo; tile0 < seg.hi; tile0 += 2) {
      const bool has_odd = tile0 + 1 < seg.hi;
      float s[32], tile_max[2], rescale[2], max_scaled[2];
      uint32_t frag[4][4];
      if constexpr (w == 0) {
        // S0, m0, P0; O rescaled to m0.
        score<T, 0>(s, smem, c, uses++ % 2);
        // S0 read boxes 4-7 and 8. Those pieces are free only once consumer 1 arrives too, after
        // P0 V0 right, and after this consumer's writes to them below (tail zeros, P0), which
        // reach it through kMaxReady0 / kP0Ready first.
        ptx::mbarrier_arrive(&smem.empty[0][1]);
        ptx::mbarrier_arrive(&smem.empty[0][kRopePiece]);
        mask_and_max(s, c, tile0, tile_max);
        const float m0[2] = {fmaxf(st.max[0], tile_max[0]), fmaxf(st.max[1], tile_max[1])};
        take_max(st.max, m0, p.scale_log2, rescale, max_scaled);
        if (lane % 4 == 0) {
          smem.max_exchange[local_row[0]] = m0[0];
          smem.max_exchange[local_row[1]] = m0[1];
        }
        if (tile0 * kBlockN + kBlockN > c.len) zero_tail_rows(smem, 0, c.len - tile0 * kBlockN, 0, thread);
        ptx::bar_arrive(kMaxReady0, kConsumerThreads);
        rescale_rows(st, rescale);
        exponentiate(s, st, max_scaled, p.scale_log2);
        // O += P0 V0 (left) while consumer 1 takes the pair's max.
        pack_p<T>(frag, s);
        fence_o(st);
        add_pv_regs<T>(st, frag, v_desc, 0);
        wait_pv(st);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int i = 0; i < 4; ++i) ptx::fence_operand(frag[kk][i]);  // the registers wgmma read stay live to here
        ptx::mbarrier_arrive(&smem.empty[0][0]);  // P0 V0 left read boxes 0-3
        // m1: P0 and O rescaled to it; P0 shared for consumer 1's half of P0 V0.
        ptx::bar_sync(kMaxReady1, kConsumerThreads);
        float m1[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) m1[r] = smem.max_exchange[local_row[r]];
        take_max(st.max, m1, p.scale_log2, rescale, max_scaled);
        store_p<T>(smem.kv[0] + kRopeBox * kBoxBytes, s, rescale, local_row, c.col);
        ptx::fence_proxy_async_shared_cta();
        ptx::bar_arrive(kP0Ready, kConsumerThreads);
        rescale_rows(st, rescale);
        if (has_odd) {  // O += P1 V1 (left), P1 from consumer 1
          wait_boxes(smem, 1, 0, 4, other_uses % 2);                     // V1's left boxes
          ptx::mbarrier_wait(&smem.full[1][kRopeBox], other_uses++ % 2);  // P1's box
          fence_o(st);
          add_pv_shared<T>(st, p_desc, v_desc, 1);
          wait_pv(st);
          ptx::mbarrier_arrive(&smem.empty[1][0]);  // P1 V1 left read boxes 0-3
          ptx::mbarrier_arrive(&smem.empty[1][kRopePiece]);  // and P1 in the rope box
        }
      } else {
        // S1 (the odd tile, if any), then m1 = max(m0, its max), P1; O rescaled to m1.
        tile_max[0] = tile_max[1] = -INFINITY;
        // Consumer 1 finishes a pair first. Its S1 waits until consumer 0 has issued S0: the
        // tensor cores take a warpgroup's products in the order they are issued, and S0 leads
        // the pair (m0, then P0 V0 while consumer 1 takes its softmax). Issued first, S1 would
        // delay S0 by its own length, and the tensor cores would idle through both softmaxes.
        ptx::bar_sync(kS0Issued, kConsumerThreads);
        if (has_odd) {
          score<T, 1>(s, smem, c, uses++ % 2);
          // S1 read boxes 0-3 and 8. Those pieces are free only once consumer 0 arrives too,
          // after P1 V1 left, and after this consumer's writes to them below (tail zeros, P1),
          // which reach it through kMaxReady1.
          ptx::mbarrier_arrive(&smem.empty[1][0]);
          ptx::mbarrier_arrive(&smem.empty[1][kRopePiece]);
          mask_and_max(s, c, tile0 + 1, tile_max);
        }
        ptx::bar_sync(kMaxReady0, kConsumerThreads);
        float m1[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) m1[r] = fmaxf(smem.max_exchange[local_row[r]], tile_max[r]);
        __syncwarp();  // every lane of the quad read m0 before one writes m1 over it
        if (lane % 4 == 0) {
          smem.max_exchange[local_row[0]] = m1[0];
          smem.max_exchange[local_row[1]] = m1[1];
        }
        take_max(st.max, m1, p.scale_log2, rescale, max_scaled);
        rescale_rows(st, rescale);
        if (has_odd) {
          exponentiate(s, st, max_scaled, p.scale_log2);
          const int odd_key0 = (tile0 + 1) * kBlockN;
          if (odd_key0 + kBlockN > c.len) zero_tail_rows(smem, 1, c.len - odd_key0, 1, thread);
          const float one[2] = {1.f, 1.f};
          store_p<T>(smem.kv[1] + kRopeBox * kBoxBytes, s, one, local_row, c.col);
          ptx::fence_proxy_async_shared_cta();
        }
        ptx::bar_arrive(kMaxReady1, kConsumerThreads);
        wait_boxes(smem, 0, 4, 5, other_uses++ % 2);  // V0's right boxes and P0's, read below
        fence_o(st);
        // O += P1 V1 (right), then P0 V0 (right) with P0 from consumer 0, already rescaled to
        // m1. Two straight paths: a chain of matrix products with a branch inside is serialized.
        if (has_odd) {
          pack_p<T>(frag, s);
          add_pv_regs<T>(st, frag, v_desc, 1);
          ptx::bar_sync(kP0Ready, kConsumerThreads);
          add_pv_shared<T>(st, p_desc, v_desc, 0);
          ptx::wgmma_wait_group<1>();  // P1 V1 right is done (products complete in order)
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int i = 0; i < 4; ++i) ptx::fence_operand(frag[kk][i]);
          // S1 and P1 V1 right read boxes 4-7: released a product before the pair ends, so the
          // next odd tile's first boxes load while P0 V0 right runs.
          ptx::mbarrier_arrive(&smem.empty[1][1]);
          wait_pv(st);
        } else {
          ptx::bar_sync(kP0Ready, kConsumerThreads);
          add_pv_shared<T>(st, p_desc, v_desc, 0);
          wait_pv(st);
        }
        ptx::mbarrier_arrive(&smem.empty[0][1]);  // P0 V0 right read boxes 4-7
        ptx::mbarrier_arrive(&smem.empty[0][kRopePiece]);  // and P0 in the rope box
      }
    }

    // The segment's end: the row sums over the quad and both consumers.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.sum[r] += __shfl_xor_sync(0xffffffffu, st.sum[r], 1);
      st.sum[r] += __shfl_xor_sync(0xffffffffu, st.sum[r], 2);
      if (lane % 4 == 0) smem.sum_exchange[w][local_row[r]] = st.sum[r];
    }
    ptx::bar_sync(kSumExchange, kConsumerThreads);
    const float total[2] = {st.sum[0] + smem.sum_exchange[1 - w][local_row[0]],
                            st.sum[1] + smem.sum_exchange[1 - w][local_row[1]]};
    write_segment<T>(p, st.o, total, st.max, b, seg.split, w, row_base, local_row, lane, c.col);
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
  start_cta(smem, kv_map);
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) produce(smem, kv_map, p);
    return;
  }
  ptx::setmaxnreg_inc<kConsumerRegisters>();
  if (warpgroup == 1)
    consume<T, 0>(smem, p, int(threadIdx.x) % 128);
  else
    consume<T, 1>(smem, p, int(threadIdx.x) % 128);
}
#endif

}  // namespace hattn::mla
