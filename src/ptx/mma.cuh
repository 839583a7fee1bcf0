// mma.sync: the warp-level tensor-core multiply-accumulate (sm_80 and later; on sm_90 it runs
// on the tensor cores at a fraction of wgmma's rate, but needs no warpgroup machinery).
//
// PTX ISA: Warp Level Matrix Multiply-Accumulate Instructions: mma, shape m16n8k16,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions-mma
// and the fragment figures in "Matrix Fragments for mma.m16n8k16 with floating point type".
//
// Fragments, per lane: g = lane / 4 (groupID), t = lane % 4 (threadID_in_group). Each 32-bit
// register holds two 16-bit elements, the lower column (A, C) or lower k (B) in the low half.
//
//   A (16x16, row-major)   a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//                          a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//   B (16x8, "col": each column's k values contiguous)
//                          b0   = B[2t, 2t+1  ][g]        b1   = B[2t+8, 2t+9][g]
//   C, D (16x8, fp32)      d[0], d[1] = D[g    ][2t, 2t+1]
//                          d[2], d[3] = D[g + 8][2t, 2t+1]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace hattn::ptx {

// d = a * b + d; bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_m16n8k16_row_col_f32_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a * b + d; fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_m16n8k16_row_col_f32_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                             uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The one above that matches the element type T (__nv_bfloat16 or __half).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "mma_m16n8k16: bf16 or fp16 only");
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    mma_m16n8k16_row_col_f32_bf16(d, a, b0, b1);
  else
    mma_m16n8k16_row_col_f32_f16(d, a, b0, b1);
}

}  // namespace hattn::ptx
