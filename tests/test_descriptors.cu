// The shared-memory descriptor arithmetic of src/ptx/wgmma.cuh, run on the host. Kernel 16
// builds a descriptor once and moves it per k16 step with advance_smem_desc; that has to
// equal the descriptor of the moved address, with the strides and swizzle mode untouched.
// Compiled by nvcc (the header is CUDA), checked without a GPU.
#include <gtest/gtest.h>

#include <cstdint>

#include "ptx/wgmma.cuh"

namespace hattn {
namespace {

// The PTX ISA's matrix-descriptor fields for a 128B-swizzled operand: start address / 16 in
// bits 0-13, LBO / 16 in bits 16-29, SBO / 16 in bits 32-45, swizzle mode 1 in bits 62-63.
uint64_t descriptor_at(uint32_t address, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t(address >> 4) | uint64_t(lbo_bytes >> 4) << 16 | uint64_t(sbo_bytes >> 4) << 32 |
         uint64_t(1) << 62;
}

TEST(SmemDescriptor, AdvanceMovesOnlyTheStartAddress) {
  constexpr uint32_t kSharedBytes = 227 * 1024;  // the most shared memory an sm_90 CTA can have
  constexpr uint32_t kSbo = 1024;                 // 8 rows of 128 bytes: what every operand uses
  int mismatches = 0;
  // LBO 16: K-major Q and K (unused); 176 * 128: V's step between 64-column blocks (wide tiles).
  for (uint32_t lbo : {16u, 176u * 128u})
    for (uint32_t base = 0; base < kSharedBytes; base += 1024)  // tiles start on a swizzle atom
      for (uint32_t bytes = 0; base + bytes < kSharedBytes; bytes += 16 * 61) {
        const uint64_t moved = ptx::advance_smem_desc(descriptor_at(base, lbo, kSbo), bytes);
        if (moved != descriptor_at(base + bytes, lbo, kSbo) && ++mismatches <= 5)
          ADD_FAILURE() << "base " << base << " + " << bytes << " bytes, LBO " << lbo << ": 0x" << std::hex
                        << moved << ", expected 0x" << descriptor_at(base + bytes, lbo, kSbo);
      }
  EXPECT_EQ(mismatches, 0);
  // The last 16 bytes of shared memory: the start field's largest value, still no carry.
  EXPECT_EQ(ptx::advance_smem_desc(descriptor_at(0, 16, kSbo), kSharedBytes - 16),
            descriptor_at(kSharedBytes - 16, 16, kSbo));
}

}  // namespace
}  // namespace hattn
