// Division by a divisor fixed at launch, as a multiply-high, an add and a shift.
//
// The GPU has no integer divide: n / d compiles to about 20 dependent instructions through a
// floating-point reciprocal. The final kernel's producer works out its first item (query block,
// head, split-KV part, K/V head) from a handful of such divisions before it can issue a load,
// and in a decoding call, where each CTA runs one item of ~15 us, that took 1.0-1.5 us
// (results/evidence/decode_timeline/). With the magic numbers computed on the host, each
// division is three instructions.
//
// Method (Granlund and Montgomery, "Division by invariant integers using multiplication",
// 1994, round-up variant): with l = ceil(log2 d) and m = floor(2^(32+l) / d) + 1, which lies in
// [2^32, 2^33), n / d = floor(n m / 2^(32+l)) for every 0 <= n < 2^32. m is kept as its low 32
// bits (multiplier = m - 2^32), so n m / 2^32 = n + umulhi(n, multiplier); for n < 2^31 that sum
// fits in 32 bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hattn {

struct FastDivisor {
  int divisor = 1;
  uint32_t multiplier = 0;  // m - 2^32
  uint32_t shift = 0;       // l

  FastDivisor() = default;
  // d >= 1 (a count: blocks, heads, parts); anything smaller is taken as 1.
  explicit FastDivisor(int d) : divisor(d < 1 ? 1 : d) {
    while ((uint32_t(1) << shift) < uint32_t(divisor)) ++shift;  // ceil(log2 d) <= 31
    // floor(2^(32+l) / d) + 1 - 2^32 = floor(2^32 (2^l - d) / d) + 1; 2^l - d < d keeps it below 2^32.
    multiplier = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - uint64_t(divisor))) / uint64_t(divisor) + 1);
  }

  // n / d for 0 <= n < 2^31.
  __host__ __device__ int div(int n) const {
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(uint32_t(n), multiplier);
#else
    const uint32_t high = uint32_t((uint64_t(uint32_t(n)) * multiplier) >> 32);
#endif
    return int((high + uint32_t(n)) >> shift);
  }
  // n % d for 0 <= n < 2^31.
  __host__ __device__ int mod(int n) const { return n - div(n) * divisor; }
};

}  // namespace hattn
