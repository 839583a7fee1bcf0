// Parent: bwd_01_cuda_core.
// Backward step 2: the five products of the backward on tensor cores (mma.sync m16n8k16).
//
// Step 1 walked one query row at a time on CUDA cores. Here a CTA owns a block of 64 keys (K,
// V and the dK, dV sums stay put) and walks the 64-row blocks of queries that see any of them.
// For each query block, with Q, dO, LSE and delta of its rows:
//
//      S  = Q K^T            dP = dO V^T                          [64 queries x 64 keys]
//      P  = exp(scale S - LSE)                dS = P (dP - delta)
//      dV += P^T dO          dK += scale dS^T Q                   [64 keys x D]
//      dQ += scale dS K   (added to the fp32 sum: other key blocks add to the same rows)
//
// Every product is a warp-level mma.sync with both operands in shared memory (ldmatrix; .trans
// where the operand is stored the other way round). P and dS go through shared memory in the
// input dtype, because the warps that make a row of P are not the ones that use its column.
// Rows are padded by 16 bytes so that ldmatrix's eight rows fall in distinct bank groups.
// The next query block's Q and dO load (cp.async) while this one computes, except at D = 128,
// where one buffer of each lets two CTAs share an SM (ctas_per_sm below).
//
// Dense batches only (the production backward runs variable-length ones).
//
// Work of the 8 warps (w = 0..7; a = w % 4, c = w / 4):
//   S, dP:   queries 16a .. 16a + 15, keys 32c .. 32c + 31
//   dV, dK:  keys 16a .. 16a + 15, columns c D/2 .. (c + 1) D/2 - 1     (kept in registers)
//   dQ:      queries 16a .. 16a + 15, columns c D/2 .. (c + 1) D/2 - 1  (64 columns at a time)
#include <string>

#include "backward.h"
#include "backward_common.cuh"
#include "fragment.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/ldmatrix.cuh"
#include "ptx/mma.cuh"
#include "ptx/smem.cuh"

namespace hattn {
namespace {

constexpr const char* kName = "bwd_02_mma_sync";
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 64;  // keys per CTA
constexpr int kBlockM = 64;  // query rows per step
constexpr int kPad = 8;      // elements (16 bytes) after each shared-memory row
constexpr float kLog2e = 1.4426950408889634f;

// Two CTAs per SM up to D = 128, so that one CTA's products run while the other waits at a
// barrier or on its exponentials and atomics: at most 128 registers a thread (ptxas spills
// 20 bytes at D = 128), and at D = 128 one buffer of Q and dO instead of two, to fit half an
// SM's shared memory (88 KB). At D = 256 the dK and dV sums alone take 128 registers.
constexpr int ctas_per_sm(int head_dim) { return head_dim <= 128 ? 2 : 1; }

template <typename T, int D>
struct SharedStorage {
  static constexpr int kRow = D + kPad;  // elements per row of a [rows][D] tile
  static constexpr int kRowP = kBlockN + kPad;
  static constexpr int kQBuffers = ctas_per_sm(D) == 2 && D == 128 ? 1 : 2;
  T k[kBlockN * kRow];
  T v[kBlockN * kRow];
  T q[kQBuffers][kBlockM * kRow];  // with two buffers the next block loads while this one computes
  T dout[kQBuffers][kBlockM * kRow];
  T p[kBlockM * kRowP];       // P and dS of the current block, [query][key]
  T ds[kBlockM * kRowP];
};

// acc[16 x 8 kNTiles] += A[16 x kK] B[kK x 8 kNTiles], one warp, both operands in shared memory
// (byte addresses of element (0, 0) of this warp's part; row strides in elements).
//   kATrans false: A[m][k] at a + (m * a_row + k);  true: at a + (k * a_row + m)
//   kBTrans false: B[k][n] at b + (n * b_row + k);  true: at b + (k * b_row + n)
// Fragments per the PTX ISA's m16n8k16 layouts; ldmatrix .x4 takes four 8x8 matrices, lanes
// 8i .. 8i + 7 addressing the rows of matrix i.
template <typename T, bool kATrans, bool kBTrans, int kNTiles, int kK>
__device__ __forceinline__ void warp_gemm(float (&acc)[kNTiles][4], uint32_t a, int a_row, uint32_t b, int b_row) {
  static_assert(kNTiles % 2 == 0 && kK % 16 == 0, "B is loaded two n8 tiles at a time, k in steps of 16");
  const int lane = threadIdx.x % 32;
  const int i = lane / 8, r = lane % 8;  // the matrix and the row this lane addresses
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 16) {
    // A's matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
    uint32_t af[4];
    if constexpr (!kATrans) {
      ptx::ldmatrix_x4(af, a + 2 * ((r + 8 * (i % 2)) * a_row + k0 + 8 * (i / 2)));
    } else {  // stored [k][m]: each matrix transposed on the way
      ptx::ldmatrix_x4_trans(af, a + 2 * ((k0 + r + 8 * (i / 2)) * a_row + 8 * (i % 2)));
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      // B's matrices: (n tile nt, k 0-7), (nt, k 8-15), (nt + 1, k 0-7), (nt + 1, k 8-15).
      uint32_t bf[4];
      if constexpr (!kBTrans) {
        ptx::ldmatrix_x4(bf, b + 2 * ((8 * nt + r + 8 * (i / 2)) * b_row + k0 + 8 * (i % 2)));
      } else {  // stored [k][n]
        ptx::ldmatrix_x4_trans(bf, b + 2 * ((k0 + r + 8 * (i % 2)) * b_row + 8 * nt + 8 * (i / 2)));
      }
      ptx::mma_m16n8k16<T>(acc[nt], af, bf[0], bf[1]);
      ptx::mma_m16n8k16<T>(acc[nt + 1], af, bf[2], bf[3]);
    }
  }
}

// rows x D elements of a BSHD tensor (row r at base + r * row_stride) into a padded tile, 16
// bytes per cp.async; rows at or past `valid` are zero-filled.
template <typename T, int D, int kRows>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int64_t row_stride, int valid) {
  constexpr int kChunks = D * int(sizeof(T)) / 16;  // 16-byte pieces per row
  for (int e = threadIdx.x; e < kRows * kChunks; e += kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    const bool inside = r < valid;
    const T* src = base + (inside ? int64_t(r) * row_stride : 0) + c * (16 / int(sizeof(T)));
    ptx::cp_async_cg_shared_global_16(ptx::cvta_to_shared_u32(tile + r * (D + kPad) + c * (16 / int(sizeof(T)))), src,
                                      inside);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, ctas_per_sm(D)) main_kernel(BaseBackwardParams p) {
  using Smem = SharedStorage<T, D>;
  constexpr int kQBuffers = Smem::kQBuffers;
  constexpr int kRow = Smem::kRow, kRowP = Smem::kRowP;
  constexpr int kHalf = D / 2;                    // columns of dK, dV and dQ per warp
  constexpr int kDqCols = kHalf < 64 ? kHalf : 64;  // dQ columns per pass
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  const AttentionParams& f = p.fwd;
  const int n0 = blockIdx.x * kBlockN, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / f.heads_per_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // the accumulator's row group and column pair
  const int slab = warp % 4, half = warp / 4;
  const float scale_log2 = f.scale * kLog2e;

  int q_first, q_last;
  queries_seeing(f, n0, n0 + kBlockN, &q_first, &q_last);
  const int m_begin = q_first / kBlockM * kBlockM;
  const int n_keys = f.seqlen_k - n0 < kBlockN ? f.seqlen_k - n0 : kBlockN;

  const T* k = static_cast<const T*>(f.k) + b * f.k_batch_stride + int64_t(n0) * f.k_seq_stride + hk * f.k_head_stride;
  const T* v = static_cast<const T*>(f.v) + b * f.v_batch_stride + int64_t(n0) * f.v_seq_stride + hk * f.v_head_stride;
  const T* q = static_cast<const T*>(f.q) + b * f.q_batch_stride + h * f.q_head_stride;
  const T* d_o = static_cast<const T*>(p.dout) + b * p.dout_batch_stride + h * p.dout_head_stride;
  auto load_queries = [&](int m0, int buffer) {
    const int valid = f.seqlen_q - m0;
    load_tile<T, D, kBlockM>(smem.q[buffer], q + int64_t(m0) * f.q_seq_stride, f.q_seq_stride, valid);
    load_tile<T, D, kBlockM>(smem.dout[buffer], d_o + int64_t(m0) * p.dout_seq_stride, p.dout_seq_stride, valid);
  };
  load_tile<T, D, kBlockN>(smem.k, k, f.k_seq_stride, n_keys);
  load_tile<T, D, kBlockN>(smem.v, v, f.v_seq_stride, n_keys);
  if (m_begin < q_last) load_queries(m_begin, 0);
  ptx::cp_async_commit_group();

  float dk[kHalf / 8][4] = {}, dv[kHalf / 8][4] = {};
  const uint32_t k_s = ptx::cvta_to_shared_u32(smem.k), v_s = ptx::cvta_to_shared_u32(smem.v);
  const uint32_t p_s = ptx::cvta_to_shared_u32(smem.p), ds_s = ptx::cvta_to_shared_u32(smem.ds);

  for (int m0 = m_begin, buffer = 0; m0 < q_last; m0 += kBlockM, buffer = (buffer + 1) % kQBuffers) {
    // With two buffers, start the next block's loads into the other one; its readers
    // finished at the barrier that ended the last step.
    if (kQBuffers == 2 && m0 + kBlockM < q_last) load_queries(m0 + kBlockM, buffer ^ 1);
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group<kQBuffers - 1>();  // this thread's copies of this block (and K, V) have landed
    __syncthreads();                // ... and every thread's
    const uint32_t q_s = ptx::cvta_to_shared_u32(smem.q[buffer]), do_s = ptx::cvta_to_shared_u32(smem.dout[buffer]);

    // S and dP of this warp's 16 queries x 32 keys.
    float s[4][4] = {}, dp[4][4] = {};
    warp_gemm<T, false, false, 4, D>(s, q_s + 2 * (16 * slab * kRow), kRow, k_s + 2 * (32 * half * kRow), kRow);
    warp_gemm<T, false, false, 4, D>(dp, do_s + 2 * (16 * slab * kRow), kRow, v_s + 2 * (32 * half * kRow), kRow);

    // P and dS, masked, into shared memory. Accumulator element e of n8 tile nt is row
    // g + 8 (e / 2), key 8 nt + 2 t + e % 2 of the warp's part.
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = 16 * slab + g + 8 * rr, i = m0 + row;
      int first = 0, last = 0;
      float lse_log2 = 0.f, delta = 0.f;
      if (i < f.seqlen_q) {
        visible_keys(f, i, &first, &last);
        const int64_t at = (int64_t(b) * f.heads_q + h) * f.seqlen_q + i;
        lse_log2 = f.lse[at] * kLog2e;
        delta = p.delta[at];
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = 32 * half + 8 * nt + 2 * t;
        float pv[2], dsv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n0 + col + e;
          // Under the select: a row that sees no key has LSE -inf, and exp2 of +inf is unused.
          pv[e] = j >= first && j < last ? exp2f(s[nt][2 * rr + e] * scale_log2 - lse_log2) : 0.f;
          dsv[e] = pv[e] * (dp[nt][2 * rr + e] - delta);
        }
        *reinterpret_cast<uint32_t*>(smem.p + row * kRowP + col) = frag::pack2<T>(pv[0], pv[1]);
        *reinterpret_cast<uint32_t*>(smem.ds + row * kRowP + col) = frag::pack2<T>(dsv[0], dsv[1]);
      }
    }
    __syncthreads();  // P and dS whole before any warp reads their columns

    // dV += P^T dO and dK += dS^T Q over this warp's 16 keys x D/2 columns.
    warp_gemm<T, true, true, kHalf / 8, kBlockM>(dv, p_s + 2 * (16 * slab), kRowP, do_s + 2 * (kHalf * half), kRow);
    warp_gemm<T, true, true, kHalf / 8, kBlockM>(dk, ds_s + 2 * (16 * slab), kRowP, q_s + 2 * (kHalf * half), kRow);

    // dQ += scale dS K over this warp's 16 queries, kDqCols columns at a time.
#pragma unroll
    for (int pass = 0; pass < kHalf / kDqCols; ++pass) {
      const int c0 = kHalf * half + kDqCols * pass;
      float dq[kDqCols / 8][4] = {};
      warp_gemm<T, false, true, kDqCols / 8, kBlockN>(dq, ds_s + 2 * (16 * slab * kRowP), kRowP, k_s + 2 * c0, kRow);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int i = m0 + 16 * slab + g + 8 * rr;
        if (i >= f.seqlen_q) continue;
        float* row = p.dq_accum + ((int64_t(b) * f.seqlen_q + i) * f.heads_q + h) * D + c0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < kDqCols / 8; ++nt)
          atomicAdd(reinterpret_cast<float2*>(row + 8 * nt),
                    make_float2(f.scale * dq[nt][2 * rr], f.scale * dq[nt][2 * rr + 1]));
      }
    }
    __syncthreads();  // every warp is done with Q, dO, P and dS before they are overwritten
    // With one buffer, the next block loads only now (into the buffer just read).
    if (kQBuffers == 1 && m0 + kBlockM < q_last) load_queries(m0 + kBlockM, 0);
  }
  ptx::cp_async_wait_group<0>();  // nothing left in flight when the CTA exits

  // This CTA's dK and dV into the sums of its K/V head (a GQA group's query heads add up).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int key = 16 * slab + g + 8 * rr;
    if (key >= n_keys) continue;
    const int64_t at = ((int64_t(b) * f.seqlen_k + n0 + key) * f.heads_kv + hk) * D + kHalf * half + 2 * t;
#pragma unroll
    for (int nt = 0; nt < kHalf / 8; ++nt) {
      atomicAdd(reinterpret_cast<float2*>(p.dk_accum + at + 8 * nt),
                make_float2(f.scale * dk[nt][2 * rr], f.scale * dk[nt][2 * rr + 1]));
      atomicAdd(reinterpret_cast<float2*>(p.dv_accum + at + 8 * nt), make_float2(dv[nt][2 * rr], dv[nt][2 * rr + 1]));
    }
  }
}

Status supports(const BackwardProblem& problem) {
  return Status::Ok();  // windows, varlen and KV caches: refused centrally (api.cpp)
}

Status launch(const BackwardProblem& problem, cudaStream_t stream) {
  return run_backward<AttentionParams>(problem, stream, kName, [&]<typename T, int D>(const BaseBackwardParams& p) -> Status {
    constexpr int kSmem = int(sizeof(SharedStorage<T, D>));
    return launch_per_key_block(main_kernel<T, D>, kBlockN, kThreads, kSmem, p.fwd, stream, kName, p);
  });
}

}  // namespace

const BackwardKernel& backward_mma_sync() {
  static const BackwardKernel kernel{
      kName, "tensor cores (mma.sync): a CTA per 64 keys walks the query blocks that see them", supports, launch};
  return kernel;
}

}  // namespace hattn
