// FP8's V transpose: 8-bit wgmma operands are read K-major only, so the PV product reads V
// through a transposed copy V^T [B][Hkv][D][keys], made by a kernel ahead of the attention
// kernel in the same call (and timed with it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/params.h"
#include "config.h"

namespace hattn::fwd {

// FP8: V^T's key order inside each 16 keys. Position l of V^T's row holds key kVtKeyOrder(l):
// the e4m3 A fragment's k 4t + j is the accumulator's column 2t + j % 2 of n8 tile j / 2 (see
// the P packing), so positions 4t .. 4t+3 hold keys 2t, 2t+1, 8 + 2t, 9 + 2t.
__host__ __device__ constexpr int kVtKeyOrder(int l) {
  return (l & 3) < 2 ? 2 * (l >> 2) + (l & 3) : 6 + 2 * (l >> 2) + (l & 3);
}

// V^T's copy: padded keys, a whole number of tiles.
constexpr int vt_keys(int seqlen_k) { return (seqlen_k + kVtTileKeys - 1) / kVtTileKeys * kVtTileKeys; }
inline size_t vt_bytes(const AttentionProblem& problem) {
  return size_t(problem.batch) * problem.heads_kv * problem.head_dim * size_t(vt_keys(problem.seqlen_k));
}

#ifdef __CUDACC__
// FP8: V [B, Sk, Hkv, D] (any strides) -> V^T [B][Hkv][D][keys], keys = Sk rounded up to 128
// with zeros past Sk (their weights are 0, and 0 x 0 is 0 where 0 x NaN would not be), each 16
// keys in kVtKeyOrder. One CTA per 128 keys of a (batch, K/V head): the tile goes through
// shared memory, read in 16-byte rows of V; each thread then takes a 16-key x 4-column block,
// 16 words of the tile, and turns it into 16 bytes of 4 rows of V^T with byte permutes.
//
// The tile's 16-byte chunks are swizzled: chunk c of row r sits at c ^ (r / 16 % kChunks). A
// warp's read takes 4 adjacent words from one row of each of 8 key groups (rows 16 apart); the
// swizzle puts the 8 groups' words in 8 different chunks, so on 32 banks at D = 128 (2 ways at
// D = 64, whose rows have 4 chunks). Each of its stores writes 128 contiguous bytes of 4 V^T rows.
template <int D>
__global__ void __launch_bounds__(256) transpose_v_kernel(const FeatureParams p, uint8_t* vt, int keys) {
  constexpr int kChunks = D / 16;  // 16-byte pieces of a row of V
  constexpr int kGroups = kVtTileKeys / 16;
  __shared__ __align__(16) uint8_t tile[kVtTileKeys][D];
  const auto chunk_at = [](int row, int chunk) { return 16 * (chunk ^ (row / 16 % kChunks)); };
  const int first_key = int(blockIdx.x) * kVtTileKeys, head = int(blockIdx.y), batch = int(blockIdx.z);
  const uint8_t* v =
      static_cast<const uint8_t*>(p.v) + int64_t(batch) * p.v_batch_stride + int64_t(head) * p.v_head_stride;
  constexpr int kLoads = kVtTileKeys * kChunks / 256;
  uint4 x[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {  // all loads first: kLoads in flight per thread
    const int r = (int(threadIdx.x) + 256 * i) / kChunks, c = int(threadIdx.x) % kChunks, key = first_key + r;
    x[i] = key < p.seqlen_k ? *reinterpret_cast<const uint4*>(v + int64_t(key) * p.v_seq_stride + c * 16)
                            : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int r = (int(threadIdx.x) + 256 * i) / kChunks, c = int(threadIdx.x) % kChunks;
    *reinterpret_cast<uint4*>(&tile[r][chunk_at(r, c)]) = x[i];
  }
  __syncthreads();  // the whole tile has landed before any thread reads a column of it
  uint8_t* out = vt + ((int64_t(batch) * p.heads_kv + head) * D) * keys + first_key;
  for (int i = int(threadIdx.x); i < kGroups * (D / 4); i += 256) {
    const int group = i % kGroups, col = 4 * (i / kGroups);  // keys 16 group.., columns col..col + 3
    uint32_t w[16];  // w[l]: columns col..col + 3 of key kVtKeyOrder(l) of the group
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int r = group * 16 + kVtKeyOrder(l);
      w[l] = *reinterpret_cast<const uint32_t*>(&tile[r][chunk_at(r, col / 16) + col % 16]);
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {  // row col + b of V^T: byte b of each word, in order
      constexpr uint32_t kPair[4] = {0x40, 0x51, 0x62, 0x73};  // byte b of the first word, then of the second
      uint32_t row[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        row[q] = __byte_perm(__byte_perm(w[4 * q], w[4 * q + 1], kPair[b]),
                             __byte_perm(w[4 * q + 2], w[4 * q + 3], kPair[b]), 0x5410);
      *reinterpret_cast<uint4*>(out + int64_t(col + b) * keys + group * 16) = make_uint4(row[0], row[1], row[2], row[3]);
    }
  }
}
#endif

}  // namespace hattn::fwd
