// A well-formed problem over fake device pointers, for the CPU tests of validation and dispatch.
#pragma once

#include <cstdint>

#include "hattn/hattn.h"

namespace hattn::testing {

// Aligned addresses that are never dereferenced: validation must not touch memory.
// 16 TiB apart, so that the tensors of a test problem never share memory (validation checks),
// even with 2^30 keys.
inline const void* fake_ptr(uintptr_t n) { return reinterpret_cast<const void*>((n + 1) << 44); }

// bf16, B = 2, Sq = 100, Sk = 130, Hq = 8, Hkv = 2, D = 128, contiguous, pointers 1 to 4.
inline AttentionProblem valid_problem() {
  AttentionProblem p;
  p.dtype = DType::bf16;
  p.batch = 2;
  p.seqlen_q = 100;
  p.seqlen_k = 130;
  p.heads_q = 8;
  p.heads_kv = 2;
  p.head_dim = 128;
  p.q = fake_ptr(1);
  p.q_strides = contiguous_bshd(p.seqlen_q, p.heads_q, p.head_dim);
  p.k = fake_ptr(2);
  p.k_strides = contiguous_bshd(p.seqlen_k, p.heads_kv, p.head_dim);
  p.v = fake_ptr(3);
  p.v_strides = p.k_strides;
  p.out = const_cast<void*>(fake_ptr(4));
  p.out_strides = p.q_strides;
  return p;
}

}  // namespace hattn::testing
