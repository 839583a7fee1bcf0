// wgmma: warpgroup-level asynchronous matrix multiply-accumulate (sm_90a).
//
// PTX ISA: Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#asynchronous-warpgroup-level-matrix-instructions
//
// The discipline: wgmma_fence() before the first wgmma that touches registers written by
// ordinary instructions; issue the wgmmas; wgmma_commit_group(); wgmma_wait_group<N>() before
// reading their accumulators (N = groups that may stay in flight).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "ptx/smem.cuh"

namespace hattn::ptx {

// wgmma.fence: orders earlier register writes (accumulators, the A fragment) before the
// wgmmas that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// wgmma.commit_group: closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// wgmma.wait_group: waits until at most kInFlight committed groups are still running.
template <int kInFlight>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(kInFlight >= 0 && kInFlight <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kInFlight) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator register across a wgmma
// that is still writing it asynchronously (the asm claims to modify the value).
__device__ __forceinline__ void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& reg) { asm volatile("" : "+r"(reg)::"memory"); }
// A descriptor fenced here is computed here: the compiler does not move its arithmetic past the
// (volatile) waits that follow, into the instructions between a barrier and the first wgmma.
__device__ __forceinline__ void fence_operand(uint64_t& reg) { asm volatile("" : "+l"(reg)::"memory"); }

// Shared-memory matrix descriptor of a swizzled operand:
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 62-63  swizzle mode: 1 = 128B, 2 = 64B
__device__ __forceinline__ uint64_t make_smem_desc(const void* tile, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                   uint32_t swizzle_mode) {
  const uint32_t addr = cvta_to_shared_u32(tile);
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t(swizzle_mode) << 62);
}

// A 128-byte-swizzled operand (the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B; the tile
// must start on a 1024-byte boundary).
// K-major operands (Q, K): LBO is unused (1); SBO = 1024, the step between 8-row groups.
// MN-major operands (V read as N-major B): LBO = the step between 64-element column blocks;
// SBO = 1024, the step between groups of 8 rows along K.
__device__ __forceinline__ uint64_t make_smem_desc_sw128(const void* tile, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_smem_desc(tile, lbo_bytes, sbo_bytes, 1);
}

// A 64-byte-swizzled operand (CU_TENSOR_MAP_SWIZZLE_64B; rows of 64 bytes, 8-row atoms of 512
// bytes, the tile on a 512-byte boundary). K-major: LBO unused (1), SBO = 512.
__device__ __forceinline__ uint64_t make_smem_desc_sw64(const void* tile, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_smem_desc(tile, lbo_bytes, sbo_bytes, 2);
}

// The descriptor of the same layout `bytes` further on (a multiple of 16): only the start
// address field (address / 16, bits 0-13) moves. Shared memory ends below 256 KB, so the 32-bit
// add never carries out of that field, and the upper word (SBO, swizzle mode) is kept as is.
// A k16 step's descriptor is then one add of a constant to a descriptor built once. Host too:
// tests/test_descriptors.cu checks it against the PTX ISA's field layout.
__host__ __device__ __forceinline__ uint64_t advance_smem_desc(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

// wgmma.mma_async m64nNk16, fp32 accumulators: WgmmaM64K16<T, N>::ss / ::rs; m64nNk32 with
// 8-bit operands: WgmmaM64K32<__nv_fp8_e4m3, N>. Each k step spans 32 bytes of a row either way.
template <typename T, int N>
struct WgmmaM64K16;
template <typename T, int N>
struct WgmmaM64K32;
#include "ptx/wgmma_mma_async.inc"

}  // namespace hattn::ptx
