// stmatrix: a warp stores 8x8 matrices of 16-bit elements from the register fragments that
// mma.sync and wgmma use to shared memory (sm_90). ldmatrix's mirror image.
//
// PTX ISA: Warp Level Matrix Multiply-Accumulate Instructions: stmatrix,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-instructions-stmatrix
//
// With .x4, lanes 8i .. 8i+7 give the shared addresses of the eight 16-byte rows of matrix i
// (each address 16-byte aligned), and register r[i] of lane l holds M_i[l / 4][2 (l % 4)] (low
// half) and M_i[l / 4][2 (l % 4) + 1]: the accumulator's row fragment, packed in pairs. One
// instruction replaces four 4-byte stores a lane, and a lane keeps one address instead of four.
#pragma once

#include <cstdint>

namespace hattn::ptx {

// Four 8x8 b16 matrices. "memory": writes shared memory the compiler does not see.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace hattn::ptx
