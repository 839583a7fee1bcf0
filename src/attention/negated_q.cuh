// A negative softmax scale: scale q.k = |scale| ((-q).k). The kernels take the softmax's running
// max on raw scores, which works only for a positive scale (max(c s) = c max(s) needs c > 0), so
// a call with scale < 0 first writes q with every sign bit flipped into a contiguous copy and
// runs with |scale|. One extra pass over q, for a case users rarely ask for.
#pragma once

#include <cstdint>

#include "../common/params.h"

namespace hattn::fwd {

#ifdef __CUDACC__
// q [B, Sq, Hq, D] (any strides; [1, total_q, Hq, D] in a varlen batch) -> `out`, contiguous,
// signs flipped: one thread per 16 bytes of a row (rows are 16-byte aligned: the API checks).
// `elem_bytes` is 2 (bf16, fp16: sign bit 0x8000) or 1 (e4m3: 0x80).
__global__ void __launch_bounds__(256) negate_q_kernel(const AttentionParams p, int batch, int rows, int elem_bytes,
                                                       uint4* out) {
  const int chunks = p.head_dim * elem_bytes / 16;  // 16-byte pieces of a row
  const int64_t total = int64_t(batch) * rows * p.heads_q * chunks;
  const uint32_t sign = elem_bytes == 2 ? 0x80008000u : 0x80808080u;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % chunks);
    const int64_t r = i / chunks;  // (b, s, h), h fastest
    const int h = int(r % p.heads_q), s = int(r / p.heads_q % rows), b = int(r / p.heads_q / rows);
    const int64_t element = int64_t(b) * p.q_batch_stride + int64_t(s) * p.q_seq_stride + int64_t(h) * p.q_head_stride;
    uint4 x = *reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.q) + element * elem_bytes + c * 16);
    x.x ^= sign, x.y ^= sign, x.z ^= sign, x.w ^= sign;
    out[i] = x;
  }
}
#endif

}  // namespace hattn::fwd
