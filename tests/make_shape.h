// A harness::Shape from its dimensions, for the GPU tests' case lists.
#pragma once

#include "../tools/harness.h"

namespace hattn::testing {

inline harness::Shape make(int b, int sq, int sk, int hq, int hkv, int d, bool causal, DType dtype,
                           harness::Layout layout, bool lse = true) {
  harness::Shape s;
  s.batch = b;
  s.seqlen_q = sq;
  s.seqlen_k = sk;
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.head_dim = d;
  s.causal = causal;
  s.dtype = dtype;
  s.layout = layout;
  s.with_lse = lse;
  return s;
}

}  // namespace hattn::testing
