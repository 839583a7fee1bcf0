// CPU tests of the test and benchmark harness's bookkeeping: for variable-length batches which
// rows exist and how many FLOPs a batch does; how many bytes a forward moves.
#include <gtest/gtest.h>

#include <string>

#include "../tools/harness.h"
#include "make_shape.h"

namespace hattn::harness {
namespace {

Shape varlen_shape(bool causal) {
  Shape s;
  s.heads_q = 4;
  s.heads_kv = 2;
  s.head_dim = 64;
  s.causal = causal;
  set_varlen(&s, {100, 0, 37}, {120, 5, 0});  // an empty query side and an empty key side
  return s;
}

TEST(Harness, SetVarlenTakesTheLongestLengths) {
  const Shape s = varlen_shape(false);
  EXPECT_TRUE(s.varlen());
  EXPECT_EQ(s.batch, 3);
  EXPECT_EQ(s.seqlen_q, 100);
  EXPECT_EQ(s.seqlen_k, 120);
  EXPECT_NE(describe(s).find("varlen q/k=100/120,0/5,37/0"), std::string::npos) << describe(s);
}

TEST(Harness, VarlenRowsAreTheSequencesRows) {
  const Shape s = varlen_shape(false);
  const auto rows = all_rows(s);
  EXPECT_EQ(rows.size(), size_t(100 + 0 + 37) * 4);
  for (const RowId& r : rows) EXPECT_LT(r.i, s.seqlens_q[r.b]);
  for (const RowId& r : sample_rows(s, 64, 3)) {
    EXPECT_NE(r.b, 1) << "sequence 1 has no queries";
    EXPECT_LT(r.i, s.seqlens_q[r.b]);
  }
}

TEST(Harness, VarlenFlopsSumTheSequences) {
  const double per_entry = 4.0 * 4 * 64;
  // Without a mask: 100 x 120 entries, then none (no queries), then none (no keys).
  EXPECT_DOUBLE_EQ(forward_flops(varlen_shape(false)), per_entry * 100 * 120);
  // Causal, bottom-right: query i of the first sequence sees keys 0 .. i + 20.
  double visible = 0;
  for (int i = 0; i < 100; ++i) visible += i + 21;
  EXPECT_DOUBLE_EQ(forward_flops(varlen_shape(true)), per_entry * visible);
}

// The bytes a forward must move: 2 an element of 16-bit tensors, 1 of e4m3 ones (an FP8 cache's
// k and v; the FP8 forward's q, k and v), out 2 either way.
TEST(Harness, ForwardBytesCountE4m3InputsAtOneByte) {
  Shape s = testing::make(2, 100, 300, 8, 2, 128, false, DType::bf16, Layout::contiguous);
  const double q_rows = 2.0 * 100 * 8 * 128, kv_rows = 2.0 * 300 * 2 * 128;
  EXPECT_DOUBLE_EQ(forward_bytes(s), 2 * (2 * q_rows) + 2 * (2 * kv_rows));
  s.fp8_cache = true;
  EXPECT_DOUBLE_EQ(forward_bytes(s), 2 * (2 * q_rows) + 1 * (2 * kv_rows));
  s.fp8_cache = false;
  s.dtype = DType::e4m3;
  EXPECT_DOUBLE_EQ(forward_bytes(s), (1 + 2) * q_rows + 1 * (2 * kv_rows));
}

}  // namespace
}  // namespace hattn::harness
