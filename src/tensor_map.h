// TMA descriptors (CUtensorMap) for BSHD tensors, built on the host.
#pragma once

#include <cuda.h>

#include "hattn/hattn.h"

namespace hattn {

// A 4-D tensor map over a [B, S, H, D] tensor with element strides `strides`: dimensions
// {D, S, H, B} innermost first, a box of {box_cols, box_rows, 1, 1} elements whose rows of
// box_cols * dtype_size(dtype) bytes are 128 (128-byte swizzle) or 64 (64-byte swizzle). Rows
// past S read as zero and are not written.
Status make_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                            int head_dim, const Strides& strides, int box_rows, int box_cols);

// The same map with unswizzled boxes of {head_dim, box_rows, 1, 1}: whole rows of
// head_dim * dtype_size(dtype) bytes (a multiple of 16, at most 256 elements), one after
// another (an FP8 KV cache's tiles, which the kernel widens in shared memory).
Status make_bshd_rows_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                                 int head_dim, const Strides& strides, int box_rows);

// A 4-D tensor map over a contiguous fp32 [B, S, H, D] tensor (the backward's dQ sum): boxes
// of {32, box_rows, 1, 1} elements (128-byte rows), 128-byte swizzle. Rows past S are skipped.
Status make_fp32_bshd_tensor_map(CUtensorMap* map, const float* base, int batch, int seqlen, int heads, int head_dim,
                                 int box_rows);

// A 2-D tensor map over `tiles` contiguous 64 x 64 fp32 tiles (the backward's dQ sum in
// accumulator order) as rows of 128 floats: a box of {128, 32}, unswizzled, is one tile.
Status make_fp32_tiles_tensor_map(CUtensorMap* map, const float* base, int64_t tiles);

// A 5-D tensor map over the same [B, S, H, D] tensor whose boxes take `group` adjacent heads
// (a K/V head's query heads) at box_rows / group positions: dimensions {D, group, H / group,
// S, B} innermost first, a box of {box_cols, group, 1, box_rows / group, 1}. The box lands in
// shared memory as box_rows rows, position-major: row i is position i / group, head i % group
// of the head group. group = 1 is the plain map's box. Needs group | box_rows and group | H.
Status make_grouped_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                                    int head_dim, const Strides& strides, int group, int box_rows, int box_cols);

// A 4-D tensor map over a contiguous byte tensor [B, H, D, keys] (the FP8 forward's V^T):
// dimensions {keys, D, H, B} innermost first, a box of {box_keys, D, 1, 1} (box_keys = 128: one
// 128-byte swizzle row per element of D). keys must be a multiple of 16.
Status make_transposed_tensor_map(CUtensorMap* map, const void* base, int batch, int heads, int head_dim, int keys,
                                  int box_keys);

// The three maps of an attention problem: q with boxes of q_box_rows rows, k and v with
// boxes of kv_box_rows rows, one swizzle row wide: 128 bytes (64 columns, 128 for e4m3), or
// 64 for e4m3 at D = 64; a variable-length batch's maps are over its packed rows
// ([1, total, H, D]), a paged cache's over its pages ([num_pages, page_size, H, D]); an e4m3
// KV cache's k and v (kv_dtype) in unswizzled boxes of whole rows. Errors name `kernel`.
struct QkvTensorMaps {
  CUtensorMap q, k, v;
};
Status make_qkv_tensor_maps(const AttentionProblem& problem, int q_box_rows, int kv_box_rows, const char* kernel,
                            QkvTensorMaps* maps);

}  // namespace hattn
