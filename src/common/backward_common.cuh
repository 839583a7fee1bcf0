// What every backward kernel shares: its parameters, the mask rule, the delta and conversion
// kernels, and the host steps around the main kernel (fp32 scratch, zeroing, delta, main,
// conversion to the gradients' dtype and strides, free).
//
// A backward kernel adds dQ, dK and dV into fp32 sums (other CTAs add to the same rows), and
// convert_kernel writes them out at the end. The sums make the result nondeterministic in its
// last bits. A kernel that owns its keys' dK and dV (one CTA per key block and query head,
// without GQA) may ask run_backward to skip their sums: it then writes dk and dv itself.
//
// A variable-length batch (cu_seqlens) keeps the forward's packed layout: its tensors, the
// sums and delta are one batch entry of total rows ([total, H, D]; delta [Hq, total_q] like
// lse), and a CTA finds its sequence's rows and lengths with sequence_of. The masks align to
// each sequence's own bottom-right corner.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "fragment.cuh"
#include "hattn/hattn.h"
#include "params.h"
#include "scratch.h"
#include "ptx/ex2.cuh"
#include "ptx/tma.cuh"
#include "sequence.cuh"

namespace hattn {
namespace {

// The backward's parameters over the forward's: Forward is FeatureParams for the production
// backward, AttentionParams (the base contract: dense batches, causal, GQA) for the lineage.
template <typename Forward>
struct BackwardParamsOf {
  Forward fwd;  // q, k, v, out, lse and the mask, as in the forward call
  const void* dout;     // like q: [B, Sq, Hq, D], or [total_q, Hq, D] when varlen
  int64_t dout_batch_stride, dout_seq_stride, dout_head_stride;
  float* delta;     // rowsum(dO * O), laid out like lse: [B, Hq, Sq], or [Hq, total_q] when varlen
  float* dq_accum;  // like q, contiguous: [B, Sq, Hq, D] or [total_q, Hq, D]; nullptr when the kernel writes dq
  float* dk_accum;  // like k, contiguous: [B, Sk, Hkv, D] or [total_k, Hkv, D]
  float* dv_accum;  // nullptr, like dk_accum, when the kernel writes dk and dv itself
  void* dq;         // the gradients, at the caller's strides (for the kernels that write them)
  void* dk;
  void* dv;
  int64_t dq_batch_stride, dq_seq_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_seq_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_seq_stride, dv_head_stride;
  // The deterministic backward (BackwardProblem::deterministic; null otherwise): counters of
  // turns that order the adds into the fp32 sums, zeroed per call. dq_turns: [B][Hq][q_blocks]
  // [2] (a block of the kernel's queries, a consumer warpgroup's half of the columns);
  // dkdv_turns: [B][Hkv][k_blocks][2] (GQA only: a block of keys, a warpgroup's 64 of them).
  int* dq_turns;
  int* dkdv_turns;
  int q_blocks, k_blocks;
  // Heads of the dK and dV sums: Hkv, or Hq where each query head adds into rows of its own
  // (run_backward's dkdv_sums_per_query_head: the deterministic D = 256 backward with GQA).
  int dkdv_sum_heads;
};
using BackwardParams = BackwardParamsOf<FeatureParams>;      // the production backward
using BaseBackwardParams = BackwardParamsOf<AttentionParams>;  // the lineage's steps

// How many turn counters a deterministic backward needs (BackwardParams::dq_turns, dkdv_turns):
// zero for the kernels that add in a fixed order without them.
struct TurnCounts {
  int64_t dq = 0, dkdv = 0;
  int q_blocks = 0, k_blocks = 0;
};

// Softcapping (the kernels with Features::softcap): the forward's softmax saw
// t = tanh(s softcap_scale) (its tanh.approx) with the softcap as its scale, so dS = P (dP -
// delta) (1 - t^2). In place, before a kernel's P and dS loop: s becomes t, and dP becomes
// (dP - delta) (1 - t^2) + delta, so that the loop's unchanged P (dP - delta) is that dS.
__device__ __forceinline__ void softcap_score_and_dp(float* s, float* dp, float delta, float softcap_scale) {
  const float t = ptx::tanh_approx_f32(*s * softcap_scale);
  *s = t;
  *dp = fmaf(*dp - delta, fmaf(-t, t, 1.f), delta);
}

// d score / d(q.k), which dQ and dK take at the end: the softmax scale (with softcapping,
// `scale` is the softcap and softcap_scale * scale the softmax scale; the cap's slope is in dS).
__device__ __forceinline__ float score_grad_scale(const FeatureParams& f) {
  return f.softcap_scale > 0.f ? f.softcap_scale * f.scale : f.scale;
}

// The keys query i sees, [first, last), among seqlen_k keys whose causal diagonal runs through
// key i + offset (bottom-right aligned: offset = seqlen_k - seqlen_q): the causal mask and
// the window.
__host__ __device__ __forceinline__ void keys_seen_by(const FeatureParams& p, int64_t offset, int seqlen_k, int i,
                                                     int* first, int* last) {
  const int64_t diagonal = int64_t(i) + offset;
  const int right = p.causal ? 0 : p.window_right;
  int64_t lo = p.window_left >= 0 ? diagonal - p.window_left : 0;
  int64_t hi = right >= 0 ? diagonal + right + 1 : seqlen_k;
  lo = lo < 0 ? 0 : lo > seqlen_k ? seqlen_k : lo;
  hi = hi < lo ? lo : hi > seqlen_k ? seqlen_k : hi;
  *first = int(lo);
  *last = int(hi);
}

// The queries [first, last) among seqlen_q that see at least one of the keys [n0, n1): the
// inverse of keys_seen_by over a block of keys.
__host__ __device__ __forceinline__ void queries_seeing_keys(const FeatureParams& p, int64_t offset, int seqlen_q,
                                                             int n0, int n1, int* first, int* last) {
  const int right = p.causal ? 0 : p.window_right;
  // Query i sees key n1 - 1 or earlier only from i + offset + right >= n0; it sees a key
  // before n1 only while i + offset - window_left < n1.
  int64_t lo = right >= 0 ? int64_t(n0) - offset - right : 0;
  int64_t hi = p.window_left >= 0 ? int64_t(n1) - offset + p.window_left : seqlen_q;
  lo = lo < 0 ? 0 : lo > seqlen_q ? seqlen_q : lo;
  hi = hi < lo ? lo : hi > seqlen_q ? seqlen_q : hi;
  *first = int(lo);
  *last = int(hi);
}

// The same two under the base contract (the lineage's AttentionParams): the causal mask or
// none, no window.
__host__ __device__ __forceinline__ void keys_seen_by(const AttentionParams& p, int64_t offset, int seqlen_k, int i,
                                                     int* first, int* last) {
  int64_t hi = p.causal ? int64_t(i) + offset + 1 : seqlen_k;
  hi = hi < 0 ? 0 : hi > seqlen_k ? seqlen_k : hi;
  *first = 0;
  *last = int(hi);
}
__host__ __device__ __forceinline__ void queries_seeing_keys(const AttentionParams& p, int64_t offset, int seqlen_q,
                                                             int n0, int /*n1*/, int* first, int* last) {
  // Under the causal mask query i sees key n0 (and so one of [n0, n1)) from i + offset >= n0.
  int64_t lo = p.causal ? int64_t(n0) - offset : 0;
  lo = lo < 0 ? 0 : lo > seqlen_q ? seqlen_q : lo;
  *first = int(lo);
  *last = seqlen_q;
}

// The two for a dense batch: the problem's lengths and the forward's causal_offset. Both run on
// the host too (tests/test_backward_turns.cu checks the deterministic backward's turns with
// them; the persistent backward trial planned its work list with queries_seeing:
// results/evidence/bwd_14_persistent/).
template <typename Params>
__host__ __device__ __forceinline__ void visible_keys(const Params& p, int i, int* first, int* last) {
  keys_seen_by(p, p.causal_offset, p.seqlen_k, i, first, last);
}
template <typename Params>
__host__ __device__ __forceinline__ void queries_seeing(const Params& p, int n0, int n1, int* first, int* last) {
  queries_seeing_keys(p, p.causal_offset, p.seqlen_q, n0, n1, first, last);
}

// The same two for one sequence of a variable-length batch: its own lengths, its masks
// aligned to its own bottom-right corner.
__device__ __forceinline__ void visible_keys(const FeatureParams& p, const Sequence& seq, int i, int* first,
                                             int* last) {
  keys_seen_by(p, seq.seqlen_k - seq.seqlen_q, seq.seqlen_k, i, first, last);
}
__device__ __forceinline__ void queries_seeing(const FeatureParams& p, const Sequence& seq, int n0, int n1,
                                               int* first, int* last) {
  queries_seeing_keys(p, seq.seqlen_k - seq.seqlen_q, seq.seqlen_q, n0, n1, first, last);
}

// The kernels that run a variable-length batch take it as a template flag, kVarlen, so that
// their dense instantiation is the code they had before (no sequence arithmetic, no reads of
// cu_seqlens). The helpers below are that code for kVarlen = false. `seq` is
// sequence_of<kVarlen>(p, blockIdx.z): for a dense batch {Sq, Sk, 0, 0, b, b}.
//
// The CTA's sequence b: a dense batch's entry b ({Sq, Sk, 0, 0, b, b}, no reads), or a packed
// one's from cu_seqlens. The varlen instantiations run only with cu_seqlens set and without
// seqlens_k, leftpad_k or kv_batch_idx (backward() refuses those): told so, the compiler drops
// sequence_of's other paths.
template <bool kVarlen>
__device__ __forceinline__ Sequence sequence_at(const FeatureParams& p, int b) {
  if constexpr (kVarlen) {
    __builtin_assume(p.cu_seqlens_q != nullptr);
    __builtin_assume(p.seqlens_k == nullptr);
    __builtin_assume(p.leftpad_k == nullptr);
    __builtin_assume(p.kv_batch_idx == nullptr);
  }
  return sequence_of<kVarlen>(p, b);
}
// The sequence's lengths: a dense batch's read where they are used, as before.
template <bool kVarlen>
__device__ __forceinline__ int seqlen_q_of(const FeatureParams& p, const Sequence& seq) {
  return kVarlen ? seq.seqlen_q : p.seqlen_q;
}
template <bool kVarlen>
__device__ __forceinline__ int seqlen_k_of(const FeatureParams& p, const Sequence& seq) {
  return kVarlen ? seq.seqlen_k : p.seqlen_k;
}
// Row j of the sequence's keys in the rows of the fp32 sums, counted over the batch entries:
// [b, j] of a dense batch, [0, start + j] of a packed one.
template <bool kVarlen>
__device__ __forceinline__ int64_t key_row(const FeatureParams& p, const Sequence& seq, int j) {
  if constexpr (kVarlen) return int64_t(seq.k_start) + j;
  return int64_t(seq.batch_coord) * p.seqlen_k + j;
}
// Where query 0 of the sequence's head h lies in lse and delta: [B, Hq, Sq] or [Hq, total_q].
template <bool kVarlen>
__device__ __forceinline__ int64_t stats_row0(const FeatureParams& p, const Sequence& seq, int h) {
  if constexpr (kVarlen) return int64_t(h) * p.total_q + seq.q_start;
  return (int64_t(seq.batch_coord) * p.heads_q + h) * p.seqlen_q;
}
// visible_keys and queries_seeing of the sequence: a dense batch's from the forward's
// causal_offset, as before.
template <bool kVarlen>
__device__ __forceinline__ void visible_keys(const FeatureParams& p, const Sequence& seq, int i, int* first,
                                             int* last) {
  if constexpr (kVarlen)
    visible_keys(p, seq, i, first, last);
  else
    visible_keys(p, i, first, last);
}
template <bool kVarlen>
__device__ __forceinline__ void queries_seeing(const FeatureParams& p, const Sequence& seq, int n0, int n1,
                                               int* first, int* last) {
  if constexpr (kVarlen)
    queries_seeing(p, seq, n0, n1, first, last);
  else
    queries_seeing(p, n0, n1, first, last);
}

// Varlen, where a TMA box ran past the sequence into the next one's rows: zeroes rows
// [first, kRows) of a [D / 64][kRows][64] tile (first >= 0), each of the kThreads threads
// (`thread` 0 .. kThreads - 1 of them) a share of the 16-byte chunks: a row's 128 bytes stay in
// the row whatever the swizzle. The caller fences (to the async proxy) and synchronizes before
// a wgmma reads the tile.
template <typename T, int D, int kRows, int kThreads>
__device__ __forceinline__ void zero_tile_rows(T* tile, int first, int thread = int(threadIdx.x)) {
  constexpr int kChunks = 64 * int(sizeof(T)) / 16;  // per row of a column block
  const int rows = kRows - first;
  for (int e = thread; e < D / 64 * rows * kChunks; e += kThreads) {
    const int cb = e / (rows * kChunks), r = first + e / kChunks % rows, c = e % kChunks;
    reinterpret_cast<uint4*>(tile + (cb * kRows + r) * 64)[c] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// delta_i = rowsum(dO_i * O_i), the softmax's term in dS. A row's D elements of O and of dO are
// D / 8 lanes' 16-byte loads (rows are 16-byte aligned: validated). A block takes
// delta_rows_per_block consecutive rows in (b, i, h) order, head fastest, so that a warp reads
// whole tokens of a dense BSHD tensor, contiguous bytes; each thread has kDeltaPasses rows'
// loads in flight before it sums any. The row indices are divisions by run-time heads and
// seqlen: 64-bit once a block, 32-bit once a row. A packed batch's rows are one batch entry of
// total_q rows here (run_backward sets p.fwd so), its rows that belong to no sequence included:
// no kernel reads their delta. Where the main kernel adds dQ into fp32 sums (p.dq_accum), this
// kernel also zeroes each row's sum, which is row block_row + k of it (a separate memset of
// the sums took about half as long as this kernel, on top of it; cuDNN's backward zeroes its
// dQ sum in its dot(dO, O) kernel the same way, results/evidence/backward_kernel_times/).
constexpr int kDeltaThreads = 256, kDeltaPasses = 4;
template <int D>
constexpr int delta_rows_per_block() {
  return kDeltaThreads / (D / 8) * kDeltaPasses;
}
template <typename T, int D, typename Forward>
__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(BackwardParamsOf<Forward> p) {
  constexpr int kLanesPerRow = D / 8, kRowsPerPass = kDeltaThreads / kLanesPerRow;
  static_assert(kLanesPerRow <= 32 && 32 % kLanesPerRow == 0, "a row's lanes are within one warp");
  const AttentionParams& f = p.fwd;
  const int64_t rows = int64_t(f.batch) * f.heads_q * f.seqlen_q;
  const int64_t block_row = int64_t(blockIdx.x) * delta_rows_per_block<D>();  // token (b, i), head h
  const int64_t block_token = block_row / f.heads_q;
  const int block_h = int(block_row - block_token * f.heads_q);
  const int block_b = int(block_token / f.seqlen_q), block_i = int(block_token - int64_t(block_b) * f.seqlen_q);
  const int d = int(threadIdx.x % kLanesPerRow) * 8;
  int4 o[kDeltaPasses], d_o[kDeltaPasses];
  int64_t out_row[kDeltaPasses];  // (b, h, i), i fastest: where delta goes; -1 past the last row
#pragma unroll
  for (int pass = 0; pass < kDeltaPasses; ++pass) {
    const int k = pass * kRowsPerPass + int(threadIdx.x) / kLanesPerRow;  // row block_row + k
    o[pass] = d_o[pass] = make_int4(0, 0, 0, 0);
    out_row[pass] = -1;
    if (block_row + k < rows) {
      const unsigned tokens_on = unsigned(block_h + k) / unsigned(f.heads_q);  // past block_token
      const int h = block_h + k - int(tokens_on) * f.heads_q;
      const unsigned entries_on = (unsigned(block_i) + tokens_on) / unsigned(f.seqlen_q);  // past block_b
      const int b = block_b + int(entries_on), i = block_i + int(tokens_on) - int(entries_on) * f.seqlen_q;
      o[pass] = *reinterpret_cast<const int4*>(static_cast<const T*>(f.out) + b * f.out_batch_stride +
                                               int64_t(i) * f.out_seq_stride + h * f.out_head_stride + d);
      d_o[pass] = *reinterpret_cast<const int4*>(static_cast<const T*>(p.dout) + b * p.dout_batch_stride +
                                                 int64_t(i) * p.dout_seq_stride + h * p.dout_head_stride + d);
      out_row[pass] = (int64_t(b) * f.heads_q + h) * f.seqlen_q + i;
      if (p.dq_accum != nullptr) {  // the row's dQ sum starts at 0: row block_row + k of [B, Sq, Hq, D]
        float4* sum = reinterpret_cast<float4*>(p.dq_accum + (block_row + k) * D + d);
        sum[0] = sum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
#pragma unroll
  for (int pass = 0; pass < kDeltaPasses; ++pass) {
    const uint32_t* ow = reinterpret_cast<const uint32_t*>(&o[pass]);
    const uint32_t* dw = reinterpret_cast<const uint32_t*>(&d_o[pass]);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 a = frag::unpack2<T>(ow[w]), b = frag::unpack2<T>(dw[w]);
      sum = fmaf(a.x, b.x, fmaf(a.y, b.y, sum));
    }
    // Every lane takes part (rows past the last sum zeros): the row's lanes are aligned groups.
#pragma unroll
    for (int x = kLanesPerRow / 2; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    if (threadIdx.x % kLanesPerRow == 0 && out_row[pass] >= 0) p.delta[out_row[pass]] = sum;
  }
}

// The dQ sum in tiles (the production backward at D <= 128): per tensor entry and query head,
// blocks of 64 rows, each D / 64 tiles of 64 x 64 floats laid out as a warpgroup's m64n64
// accumulators: [8 n8 tiles][128 threads][4], thread t's float4 i holding rows 16 (t / 32) +
// t % 32 / 4 and + 8, columns 8 i + 2 (t % 4) and + 1. So a warpgroup stores its share with
// 16-byte stores in accumulator order, and one 16 KB bulk reduction adds it. A packed batch (one
// entry) starts sequence b at row block (cu_seqlens_q[b] + 64 b) / 64, so that no two sequences
// share a tile (the rows of a sequence's last block past its end fall into its own padding).
constexpr int kDqTileRows = 64, kDqTileFloats = 64 * 64;
// Row blocks per entry and head: ceil(Sq / 64), or for a packed batch of `batch` sequences over
// total_q rows ceil((total_q + 64 batch) / 64).
__host__ __device__ inline int dq_tile_blocks(int rows, int batch, bool varlen) {
  return (rows + (varlen ? kDqTileRows * batch : 0) + kDqTileRows - 1) / kDqTileRows;
}
// The first row block of sequence `b` starting at packed row q_start (a dense entry's: 0).
__host__ __device__ inline int dq_tile_first_block(int q_start, int b, bool varlen) {
  return varlen ? (q_start + kDqTileRows * b) / kDqTileRows : 0;
}
// The tiles of a problem's dQ sum: entries x query heads x row blocks x D / 64.
inline int64_t dq_sum_tiles(const AttentionProblem& fwd) {
  return int64_t(fwd.tensor_batch()) * fwd.heads_q * dq_tile_blocks(fwd.tensor_rows_q(), fwd.batch, fwd.is_varlen()) *
         (fwd.head_dim / 64);
}

// dQ out of the tiled sum: a CTA per 64 x 64 tile reads it whole (16-byte loads), puts it in
// rows in shared memory and writes the rows its sequence owns in T, 16 bytes a store. A packed
// batch's tile finds its sequence by a binary search over the sequences' first blocks (a tile
// between two sequences' blocks is left alone, and so are rows that no sequence owns: those
// are zeroed apart).
template <typename T, int D>
__global__ void __launch_bounds__(256) convert_dq_tiles_kernel(const float* src, T* dst, int heads, int seqlen,
                                                               int blocks, const int32_t* cu_seqlens, int batch,
                                                               int total, int64_t batch_stride, int64_t seq_stride,
                                                               int64_t head_stride) {
  constexpr int kChunks = D / 64, kPad = 4;  // + 4 floats a row: rows 4 banks apart
  __shared__ float tile[kDqTileRows][64 + kPad];
  const int64_t index = blockIdx.x;  // ((entry heads + head) blocks + block) chunks + chunk
  const int chunk = int(index % kChunks);
  const int64_t row_block = index / kChunks;
  const int block = int(row_block % blocks), entry_head = int(row_block / blocks);
  const int h = entry_head % heads, entry = entry_head / heads;
  int first_row = block * kDqTileRows, rows = seqlen;  // the tile's first row in dst's entry, the sequence's end
  if (cu_seqlens != nullptr) {
    auto start = [&](int b) { return min(max(__ldg(cu_seqlens + b), 0), total); };
    int lo = 0, hi = batch - 1;  // the last sequence whose first block is at most `block`
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (dq_tile_first_block(start(mid), mid, true) <= block) lo = mid; else hi = mid - 1;
    }
    const int q_start = start(lo), first_block = dq_tile_first_block(q_start, lo, true);
    first_row = q_start + (block - first_block) * kDqTileRows;
    rows = max(start(lo + 1), q_start);
    if (block < first_block || first_row >= rows) return;  // CTA-uniform: padding, no sequence's rows
  }
  const float4* from = reinterpret_cast<const float4*>(src + index * kDqTileFloats);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = int(threadIdx.x) + 256 * k, i = e / 128, t = e % 128;
    const float4 v = from[e];
    const int r = 16 * (t / 32) + t % 32 / 4, c = 8 * i + 2 * (t % 4);
    tile[r][c] = v.x;
    tile[r][c + 1] = v.y;
    tile[r + 8][c] = v.z;
    tile[r + 8][c + 1] = v.w;
  }
  __syncthreads();  // the tile is in rows
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int piece = int(threadIdx.x) + 256 * k, r = piece / 8, c = piece % 8 * 8;  // 8 pieces of 8 a row
    const int s = first_row + r;
    if (s >= rows) continue;
    const float* x = &tile[r][c];
    __stcs(reinterpret_cast<int4*>(dst + entry * batch_stride + int64_t(s) * seq_stride + h * head_stride +
                                   chunk * 64 + c),
           make_int4(int(frag::pack2<T>(x[0], x[1])), int(frag::pack2<T>(x[2], x[3])), int(frag::pack2<T>(x[4], x[5])),
                     int(frag::pack2<T>(x[6], x[7]))));
  }
}

// dst[b, s, h, :] = src (contiguous fp32 [B, S, H, D]) in T, at dst's strides, 8 elements a
// thread: two 16-byte loads and one 16-byte store (dst's rows are 16-byte aligned: validated),
// and the row's indices, divisions by the run-time heads and seqlen, once per 8 elements (one
// element a thread spent more time on that arithmetic than on the bytes). With group > 1, src
// is [B, S, H * group, D] and dst's head h the sum of src's heads h * group .. + group - 1,
// added in that order (the deterministic backward's per-query-head sums of dK and dV).
constexpr int kConvertElems = 8;
template <typename T, int D>
__global__ void __launch_bounds__(256) convert_kernel(const float* src, T* dst, int seqlen, int heads, int64_t rows,
                                                      int64_t batch_stride, int64_t seq_stride, int64_t head_stride,
                                                      int group) {
  static_assert(D % kConvertElems == 0, "a row is whole 8-element pieces");
  constexpr int kPieces = D / kConvertElems;
  const int64_t piece = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (piece >= rows * kPieces) return;
  const int64_t row = piece / kPieces, seq_row = row / heads;
  const int d = int(piece % kPieces) * kConvertElems, h = int(row % heads), s = int(seq_row % seqlen),
            b = int(seq_row / seqlen);
  const float4* from = reinterpret_cast<const float4*>(src + row * group * D + d);
  float4 lo = from[0], hi = from[1];
  for (int g = 1; g < group; ++g) {
    const float4 lo_g = from[g * D / 4], hi_g = from[g * D / 4 + 1];
    lo = make_float4(lo.x + lo_g.x, lo.y + lo_g.y, lo.z + lo_g.z, lo.w + lo_g.w);
    hi = make_float4(hi.x + hi_g.x, hi.y + hi_g.y, hi.z + hi_g.z, hi.w + hi_g.w);
  }
  // Written once and not read again here: a streaming store.
  __stcs(reinterpret_cast<int4*>(dst + b * batch_stride + int64_t(s) * seq_stride + h * head_stride + d),
         make_int4(int(frag::pack2<T>(lo.x, lo.y)), int(frag::pack2<T>(lo.z, lo.w)), int(frag::pack2<T>(hi.x, hi.y)),
                   int(frag::pack2<T>(hi.z, hi.w))));
}

// A packed batch's dK and dV rows that no sequence owns, [0, cu_seqlens_k[0]) and
// [cu_seqlens_k[batch], total_k), get zeros (as the conversion of zeroed sums would give them)
// where the main kernel writes the sequences' rows itself. 8 elements a thread, grid-stride;
// the bounds are read on the GPU (usually both ranges are empty).
template <typename T, int D>
__global__ void __launch_bounds__(256) zero_unowned_rows_kernel(T* dst, const int32_t* cu_seqlens, int batch,
                                                                int total, int heads, int64_t seq_stride,
                                                                int64_t head_stride) {
  constexpr int kPieces = D / kConvertElems;
  const int first = min(max(__ldg(cu_seqlens), 0), total);
  const int last = min(max(__ldg(cu_seqlens + batch), first), total);
  const int64_t unowned = int64_t(first + total - last) * heads * kPieces;
  for (int64_t piece = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; piece < unowned;
       piece += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = piece / kPieces;  // over the unowned rows' heads
    const int h = int(row % heads), r = int(row / heads), s = r < first ? r : last + (r - first);
    const int d = int(piece % kPieces) * kConvertElems;
    *reinterpret_cast<int4*>(dst + int64_t(s) * seq_stride + h * head_stride + d) = make_int4(0, 0, 0, 0);
  }
}

// Launches `kernel` on `grid` with `smem` bytes of dynamic shared memory (raising the kernel's
// limit to that first).
template <typename Kernel, typename... Args>
Status launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, cudaStream_t stream, const char* name,
                        const Args&... args) {
  Status st = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                          std::string(name) + ": cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!st.ok()) return st;
  kernel<<<grid, threads, smem, stream>>>(args...);
  return launch_status(name);
}

// A backward kernel's grid: one CTA per `rows` rows (of `seqlen` keys or queries, the longest
// sequence's when varlen: a CTA past its own sequence's rows exits) of each query head and
// batch element.
inline dim3 per_block_grid(int seqlen, int rows, const AttentionParams& f) {
  return dim3(unsigned((seqlen + rows - 1) / rows), unsigned(f.heads_q), unsigned(f.batch));
}

// Launches a backward's main kernel, one CTA per `block_n` keys (per_block_grid).
template <typename Kernel, typename... Args>
Status launch_per_key_block(Kernel kernel, int block_n, int threads, int smem, const AttentionParams& f,
                            cudaStream_t stream, const char* name, const Args&... args) {
  return launch_with_smem(kernel, per_block_grid(f.seqlen_k, block_n, f), threads, smem, stream, name, args...);
}

// The same, one CTA per `block_m` queries.
template <typename Kernel, typename... Args>
Status launch_per_query_block(Kernel kernel, int block_m, int threads, int smem, const AttentionParams& f,
                              cudaStream_t stream, const char* name, const Args&... args) {
  return launch_with_smem(kernel, per_block_grid(f.seqlen_q, block_m, f), threads, smem, stream, name, args...);
}

// The host side of a backward: Forward is the parameters its kernels read (BackwardParamsOf);
// scratch for the fp32 sums and delta (from the problem's
// allocator, scratch.h), zeroed; delta; then launch_main.template operator()<T, D>(params), which launches the
// kernel's main pass and returns its Status; then the conversions; then the free.
// With dkdv_written_by_kernel, dK and dV get no sums (params.dk_accum and dv_accum are null)
// and no conversion: the kernel writes params.dk and dv. dq_written_by_kernel does the same for
// dQ (params.dq_accum null; the kernel writes every row of params.dq, zeros included, but a
// packed batch's rows that no sequence owns, which get zeros here).
// With problem.deterministic, `turns` counters are taken from the same scratch and zeroed.
// With dkdv_sums_per_query_head (GQA), the dK and dV sums have a row per query head
// (BackwardParams::dkdv_sum_heads = Hq), which the conversion adds by group, in head order.
// With kDqTiles the dQ sum is in tiles (dq_tile_blocks), zeroed by a memset and converted by
// convert_dq_tiles_kernel (a template argument, so that only its user instantiates that kernel).
template <typename Forward, bool kDqTiles = false, typename LaunchMain>
Status run_backward(const BackwardProblem& problem, cudaStream_t stream, const char* name, LaunchMain&& launch_main,
                    bool dkdv_written_by_kernel = false, bool dq_written_by_kernel = false, TurnCounts turns = {},
                    bool dkdv_sums_per_query_head = false) {
  const AttentionProblem& fwd = problem.forward;
  BackwardParamsOf<Forward> p{};
  if constexpr (std::is_same_v<Forward, FeatureParams>)
    p.fwd = make_feature_params(fwd);
  else
    p.fwd = make_params(fwd);
  p.dout = problem.dout;
  p.dout_batch_stride = problem.dout_strides.batch;
  p.dout_seq_stride = problem.dout_strides.seq;
  p.dout_head_stride = problem.dout_strides.head;
  p.dq = problem.dq;
  p.dk = problem.dk;
  p.dv = problem.dv;
  p.dq_batch_stride = problem.dq_strides.batch;
  p.dq_seq_stride = problem.dq_strides.seq;
  p.dq_head_stride = problem.dq_strides.head;
  p.dk_batch_stride = problem.dk_strides.batch;
  p.dk_seq_stride = problem.dk_strides.seq;
  p.dk_head_stride = problem.dk_strides.head;
  p.dv_batch_stride = problem.dv_strides.batch;
  p.dv_seq_stride = problem.dv_strides.seq;
  p.dv_head_stride = problem.dv_strides.head;
  // The tensors' [batch entries, rows]: [B, Sq] and [B, Sk], or [1, total_q] and [1, total_k]
  // for a variable-length batch.
  const int entries = fwd.tensor_batch(), seq_rows_q = fwd.tensor_rows_q(), seq_rows_k = fwd.tensor_rows_k();
  const int64_t rows_q = int64_t(entries) * seq_rows_q * fwd.heads_q;  // rows of dq and delta, over the heads
  const int64_t rows_q_sums = dq_written_by_kernel ? 0
                              : kDqTiles           ? dq_sum_tiles(fwd) * kDqTileFloats / fwd.head_dim
                                                   : rows_q;  // rows of the dQ sum
  const int sum_heads = dkdv_sums_per_query_head ? fwd.heads_q : fwd.heads_kv;
  const int64_t rows_k_sums =
      dkdv_written_by_kernel ? 0 : int64_t(entries) * seq_rows_k * sum_heads;  // rows of the dK and dV sums
  const size_t floats = size_t(rows_q) + size_t(rows_q_sums + 2 * rows_k_sums) * fwd.head_dim;
  const size_t counters = problem.deterministic ? size_t(turns.dq + turns.dkdv) : 0;
  const size_t bytes = (floats + counters) * sizeof(float);  // the counters are int32, after the floats
  void* taken = nullptr;
  Status s = take_scratch(fwd.allocator, bytes, stream, std::string(name) + ": fp32 sums and delta", &taken);
  if (!s.ok()) return s;
  float* scratch = static_cast<float*>(taken);
  // [dQ sum][dK sum][dV sum][delta], each sum only where the kernel does not write the gradient.
  p.dq_accum = dq_written_by_kernel ? nullptr : scratch;
  p.dk_accum = dkdv_written_by_kernel ? nullptr : scratch + rows_q_sums * fwd.head_dim;
  p.dv_accum = dkdv_written_by_kernel ? nullptr : p.dk_accum + rows_k_sums * fwd.head_dim;
  p.dkdv_sum_heads = sum_heads;
  p.delta = scratch + (rows_q_sums + 2 * rows_k_sums) * fwd.head_dim;
  if (counters > 0) {
    int* turn_counters = reinterpret_cast<int*>(scratch + floats);
    p.dq_turns = turns.dq > 0 ? turn_counters : nullptr;
    p.dkdv_turns = turns.dkdv > 0 ? turn_counters + turns.dq : nullptr;
    p.q_blocks = turns.q_blocks;
    p.k_blocks = turns.k_blocks;
    s = cuda_status(cudaMemsetAsync(turn_counters, 0, counters * sizeof(int), stream),
                    std::string(name) + ": zeroing the deterministic backward's turn counters");
  }
  // The dK and dV sums are zeroed here, the dQ sum by delta_kernel (row by row, as it goes), or
  // here when it is in tiles.
  if (s.ok() && kDqTiles && rows_q_sums > 0)
    s = cuda_status(cudaMemsetAsync(p.dq_accum, 0, size_t(rows_q_sums) * fwd.head_dim * sizeof(float), stream),
                    std::string(name) + ": zeroing the fp32 sum of dQ");
  if (s.ok() && rows_k_sums > 0)
    s = cuda_status(cudaMemsetAsync(p.dk_accum, 0, size_t(2 * rows_k_sums) * fwd.head_dim * sizeof(float), stream),
                    std::string(name) + ": zeroing the fp32 sums of dK and dV");
  if (s.ok()) {
    s = dispatch_dtype_headdim(fwd, [&]<typename T, int D>() -> Status {
      BackwardParamsOf<Forward> rows = p;  // delta over the tensors' rows: a packed batch as one entry of total_q
      rows.fwd.batch = entries;
      rows.fwd.seqlen_q = seq_rows_q;
      if (kDqTiles) rows.dq_accum = nullptr;  // zeroed above
      constexpr int kDeltaRows = delta_rows_per_block<D>();
      delta_kernel<T, D, Forward><<<unsigned((rows_q + kDeltaRows - 1) / kDeltaRows), kDeltaThreads, 0, stream>>>(rows);
      Status st = launch_status(name);
      if (!st.ok()) return st;
      // A packed batch's rows that no sequence owns, in the gradients the kernel writes itself
      // (it writes the rest).
      auto zero_unowned = [&](void* dst, const int32_t* cu_seqlens, int total, int heads, const Strides& strides) {
        zero_unowned_rows_kernel<T, D><<<64, 256, 0, stream>>>(static_cast<T*>(dst), cu_seqlens, fwd.batch, total,
                                                               heads, strides.seq, strides.head);
        return launch_status(name);
      };
      if (dkdv_written_by_kernel && fwd.is_varlen()) {
        if (!(st = zero_unowned(problem.dk, fwd.cu_seqlens_k, fwd.total_k, fwd.heads_kv, problem.dk_strides)).ok() ||
            !(st = zero_unowned(problem.dv, fwd.cu_seqlens_k, fwd.total_k, fwd.heads_kv, problem.dv_strides)).ok())
          return st;
      }
      if ((dq_written_by_kernel || kDqTiles) && fwd.is_varlen()) {
        if (!(st = zero_unowned(problem.dq, fwd.cu_seqlens_q, fwd.total_q, fwd.heads_q, problem.dq_strides)).ok())
          return st;
      }
      if (!(st = launch_main.template operator()<T, D>(p)).ok()) return st;
      auto convert = [&](const float* src, void* dst, int seqlen, int heads, const Strides& strides, int group = 1) {
        const int64_t rows = int64_t(entries) * seqlen * heads, pieces = rows * (D / kConvertElems);
        convert_kernel<T, D><<<unsigned((pieces + 255) / 256), 256, 0, stream>>>(
            src, static_cast<T*>(dst), seqlen, heads, rows, strides.batch, strides.seq, strides.head, group);
        return launch_status(name);
      };
      if constexpr (kDqTiles) {
        convert_dq_tiles_kernel<T, D><<<unsigned(dq_sum_tiles(fwd)), 256, 0, stream>>>(
            p.dq_accum, static_cast<T*>(problem.dq), fwd.heads_q, seq_rows_q,
            dq_tile_blocks(seq_rows_q, fwd.batch, fwd.is_varlen()), fwd.cu_seqlens_q, fwd.batch, fwd.total_q,
            problem.dq_strides.batch, problem.dq_strides.seq, problem.dq_strides.head);
        if (!(st = launch_status(name)).ok()) return st;
      } else if (!dq_written_by_kernel &&
                 !(st = convert(p.dq_accum, problem.dq, seq_rows_q, fwd.heads_q, problem.dq_strides)).ok()) {
        return st;
      }
      if (dkdv_written_by_kernel) return st;
      const int group = sum_heads / fwd.heads_kv;
      if (!(st = convert(p.dk_accum, problem.dk, seq_rows_k, fwd.heads_kv, problem.dk_strides, group)).ok()) return st;
      return convert(p.dv_accum, problem.dv, seq_rows_k, fwd.heads_kv, problem.dv_strides, group);
    });
  }
  const Status freed = give_back_scratch(fwd.allocator, taken, bytes, stream, name, "fp32 sums and delta");
  return s.ok() ? freed : s;
}

}  // namespace
}  // namespace hattn
