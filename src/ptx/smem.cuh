// Shared-memory addresses in the form PTX shared-space instructions take.
//
// ldmatrix, cp.async and friends address shared memory with a 32-bit offset in the .shared
// window, not a generic 64-bit pointer. __cvta_generic_to_shared is the compiler's spelling of
// `cvta.to.shared.u64` (PTX ISA: Data Movement and Conversion Instructions: cvta,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cvta).
#pragma once

#include <cstdint>

namespace hattn::ptx {

// The .shared-window address of a pointer into this block's shared memory.
__device__ __forceinline__ uint32_t cvta_to_shared_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// `raw` (this block's dynamic shared memory) moved up to the next multiple of kAlign bytes of
// the .shared window. The offset is added to the pointer itself, so the compiler still knows it
// points into shared memory and plain loads and stores through it stay LDS/STS; rounding the
// address as an integer would make them generic LD/ST.
template <int kAlign>
__device__ __forceinline__ unsigned char* align_shared(unsigned char* raw) {
  const uint32_t misalignment = cvta_to_shared_u32(raw) % kAlign;
  return raw + (kAlign - misalignment) % kAlign;
}

// 16 bytes from and to a .shared-window address (LDS.128, STS.128 whatever the compiler knows
// of the pointer it came from).
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace hattn::ptx
