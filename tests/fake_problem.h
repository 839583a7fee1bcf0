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

// A variable-length batch of 3 sequences: 500 query rows and 700 key rows in all.
inline AttentionProblem varlen_problem() {
  AttentionProblem p = valid_problem();
  p.batch = 3;
  p.cu_seqlens_q = static_cast<const int32_t*>(fake_ptr(5));
  p.cu_seqlens_k = static_cast<const int32_t*>(fake_ptr(6));
  p.total_q = 500;
  p.total_k = 700;
  p.q_strides.batch = p.k_strides.batch = p.v_strides.batch = p.out_strides.batch = 0;  // not used
  return p;
}

// A paged cache of 40 pages of 128 keys, 4 pages per sequence.
inline AttentionProblem paged_problem() {
  AttentionProblem p = valid_problem();
  p.seqlens_k = static_cast<const int32_t*>(fake_ptr(7));
  p.block_table = static_cast<const int32_t*>(fake_ptr(8));
  p.page_size = 128;
  p.num_pages = 40;
  p.max_pages_per_seq = 4;  // 512 keys >= seqlen_k 130
  p.k_strides = p.v_strides = contiguous_bshd(128, p.heads_kv, p.head_dim);
  return p;
}

}  // namespace hattn::testing
