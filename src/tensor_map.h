// TMA descriptors (CUtensorMap) for BSHD tensors, built on the host.
#pragma once

#include <cuda.h>

#include "hattn/hattn.h"

namespace hattn {

// A 4-D tensor map over a [B, S, H, D] tensor with element strides `strides`: dimensions
// {D, S, H, B} innermost first, a box of {box_cols, box_rows, 1, 1} elements, 128-byte
// swizzle (box_cols * 2 bytes must be 128). Rows past S read as zero and are not written.
Status make_bshd_tensor_map(CUtensorMap* map, const void* base, DType dtype, int batch, int seqlen, int heads,
                            int head_dim, const Strides& strides, int box_rows, int box_cols);

}  // namespace hattn
