// ldmatrix: a warp loads 8x8 matrices of 16-bit elements from shared memory straight into the
// register fragments that mma.sync takes.
//
// PTX ISA: Warp Level Matrix Multiply-Accumulate Instructions: ldmatrix,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions-ldmatrix
//
// With .x4, lanes 8i .. 8i+7 give the shared addresses of the eight 16-byte rows of matrix i
// (each address 16-byte aligned), and register r[i] of lane l receives from matrix i:
//   plain:   M_i[l / 4][2 (l % 4)], M_i[l / 4][2 (l % 4) + 1]        (a row fragment)
//   .trans:  M_i[2 (l % 4)][l / 4], M_i[2 (l % 4) + 1][l / 4]        (a column fragment)
// the first element in the low half. The eight row reads of one matrix are served in one
// shared-memory wavefront only when they fall in distinct 16-byte bank groups.
#pragma once

#include <cstdint>

namespace hattn::ptx {

// Four 8x8 b16 matrices. "memory": reads shared memory the compiler does not see, so it must
// stay on its side of the barriers around it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

// Four 8x8 b16 matrices, each transposed on the way: the B operand of mma from a row-major
// [k][n] tile (V in O = P V).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr)
               : "memory");
}

}  // namespace hattn::ptx
