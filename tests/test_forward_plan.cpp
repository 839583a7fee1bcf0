// CPU tests of the production forward's host plan (src/attention/plan.h): the decisions it
// makes for the FlashAttention-3 grid, decoding, varlen, GQA, windows, paged caches and FP8,
// on an H200's 132 SMs. No GPU: the plan is plain host code.
#include <gtest/gtest.h>

#include <string>

#include "../src/attention/plan.h"
#include "../src/attention/work_order.h"
#include "../src/common/tile_scheduler.cuh"
#include "fake_problem.h"

namespace hattn::fwd {
namespace {

using hattn::testing::fake_ptr;
constexpr int kH200Sms = 132;

// A dense bf16 problem, contiguous.
AttentionProblem dense(int b, int sq, int sk, int hq, int hkv, int d, bool causal) {
  AttentionProblem p = hattn::testing::valid_problem();
  p.batch = b;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.heads_q = hq;
  p.heads_kv = hkv;
  p.head_dim = d;
  p.causal = causal;
  p.q_strides = p.out_strides = contiguous_bshd(sq, hq, d);
  p.k_strides = p.v_strides = contiguous_bshd(sk, hkv, d);
  return p;
}

// The FlashAttention-3 grid: batch * seqlen = 16384, heads * D = 2048.
AttentionProblem grid_point(int d, int s, bool causal) { return dense(16384 / s, s, s, 2048 / d, 2048 / d, d, causal); }

ForwardPlan plan_of(const AttentionProblem& p, int sms = kH200Sms) {
  ForwardPlan plan;
  const Status s = make_plan(p, sms, &plan);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return plan;
}

std::string describe(int d, int s, bool causal) {
  return "D=" + std::to_string(d) + " S=" + std::to_string(s) + (causal ? " causal" : "");
}

TEST(ForwardPlan, GridTakesTheDenseKernelsWithoutSplitKv) {
  for (int d : {64, 128, 256})
    for (int s : {512, 1024, 2048, 4096, 8192, 16384})
      for (bool causal : {false, true}) {
        SCOPED_TRACE(describe(d, s, causal));
        const ForwardPlan plan = plan_of(grid_point(d, s, causal));
        EXPECT_TRUE(plan.dense);  // no sequence bounds, no packing: the kernels without run-time bounds
        EXPECT_FALSE(plan.window);
        EXPECT_EQ(plan.params.pack_shift, 0);
        EXPECT_EQ(plan.split.splits, 1);  // at least 128 items: the SMs are full without split-KV
        EXPECT_EQ(plan.block_m, 64 * plan.consumers);
        // Causal items differ in cost, so only the unmasked last round is cut.
        if (causal) EXPECT_EQ(plan.split.tail_parts, 1);
      }
}

TEST(ForwardPlan, ThreeConsumersAtD64UnlessCausalAndShort) {
  // Mean keys per 128-row block under the causal mask reach 1024 from S = 2k.
  for (int s : {512, 1024, 2048, 4096, 8192, 16384}) {
    EXPECT_EQ(plan_of(grid_point(64, s, false)).consumers, 3) << s;
    EXPECT_EQ(plan_of(grid_point(64, s, true)).consumers, s >= 2048 ? 3 : 2) << s;
    EXPECT_EQ(plan_of(grid_point(128, s, false)).consumers, 2) << s;
    EXPECT_EQ(plan_of(grid_point(256, s, true)).consumers, 2) << s;
  }
}

TEST(ForwardPlan, WideTilesForLongSweeps) {
  for (int s : {512, 1024, 2048, 4096, 8192, 16384})
    for (bool causal : {false, true}) {
      SCOPED_TRACE(describe(0, s, causal));
      const double keys128 = mean_keys_per_block(128, s, s, causal);
      const ForwardPlan p128 = plan_of(grid_point(128, s, causal));
      EXPECT_EQ(p128.wide, keys128 >= 4096);
      EXPECT_EQ(p128.block_n, p128.wide ? 176 : 128);
      const ForwardPlan p256 = plan_of(grid_point(256, s, causal));
      EXPECT_EQ(p256.wide, keys128 >= 1024);
      EXPECT_EQ(p256.block_n, p256.wide ? 80 : 64);
      const ForwardPlan p64 = plan_of(grid_point(64, s, causal));
      EXPECT_FALSE(p64.wide);
      EXPECT_EQ(p64.block_n, 128);
    }
}

TEST(ForwardPlan, TailSplitCutsAPartialLastRoundOfUnmaskedItems) {
  // D = 128, S = 1k, no mask: 16 x 16 heads x 8 blocks = 2048 items, 68 past 15 whole rounds;
  // 132 / 68 gives each one part: nothing to cut.
  ASSERT_EQ(work_items(16, 16, 1024, 128) % kH200Sms, 68);
  const ForwardPlan plan = plan_of(grid_point(128, 1024, false));
  EXPECT_EQ(plan.split.tail_parts, 1);
  EXPECT_EQ(plan.workspace_bytes, 0u);
  // 136 items: 4 past a whole round, each cut into 33 parts, capped by its tiles / 4.
  const AttentionProblem p = dense(1, 1000, 3000, 17, 17, 128, false);
  const ForwardPlan cut = plan_of(p);
  EXPECT_EQ(cut.split.tail_start, 132);
  EXPECT_EQ(cut.split.tail_parts, (3000 + 127) / 128 / kMinTilesPerSplit);
  EXPECT_EQ(cut.workspace_bytes, size_t(4) * cut.split.tail_parts * 128 * (128 + 1) * sizeof(float));
  // num_splits = 1 turns the tail split off too.
  AttentionProblem off = p;
  off.num_splits = 1;
  EXPECT_EQ(plan_of(off).split.tail_parts, 1);
  EXPECT_EQ(plan_of(off).workspace_bytes, 0u);
}

TEST(ForwardPlan, DecodingSplitsTheKeysAcrossTheSms) {
  // 4 sequences x 32 heads, one query each, 4k keys: 128 items fill the SMs already.
  EXPECT_EQ(plan_of(dense(4, 1, 4096, 32, 32, 128, false)).split.splits, 1);
  // 2 x 16 heads: 32 items, 132 / 32 = 4 parts (each 8 of the 32 tiles).
  const ForwardPlan plan = plan_of(dense(2, 1, 4096, 16, 16, 128, false));
  EXPECT_EQ(plan.split.splits, 4);
  EXPECT_FALSE(plan.dense);  // split-KV runs in the run-time bounds kernels
  EXPECT_EQ(plan.split.rows_all, int64_t(2) * 16 * 1);
  EXPECT_EQ(plan.workspace_bytes, size_t(4) * 2 * 16 * (128 + 1) * sizeof(float));
  // Few tiles: each part keeps at least kMinTilesPerSplit of them.
  EXPECT_EQ(plan_of(dense(1, 1, 1024, 8, 8, 128, false)).split.splits, 1024 / 128 / kMinTilesPerSplit);
  // At most kMaxSplits parts.
  EXPECT_EQ(plan_of(dense(1, 1, 1 << 20, 1, 1, 128, false)).split.splits, kMaxSplits);
  // num_splits asks for a number.
  AttentionProblem asked = dense(2, 1, 4096, 16, 16, 128, false);
  asked.num_splits = 7;
  EXPECT_EQ(plan_of(asked).split.splits, 7);
}

TEST(ForwardPlan, DecodingAtD64RunsTheRunTimeBoundsKernels) {
  // Two of three consumers have no rows: only the run-time bounds kernels skip their tiles.
  EXPECT_FALSE(plan_of(dense(32, 1, 4096, 32, 32, 64, false)).dense);
  EXPECT_TRUE(plan_of(dense(32, 1, 4096, 32, 32, 128, false)).dense);
  EXPECT_TRUE(plan_of(dense(4, 100, 4096, 32, 32, 64, false)).dense);  // more than 64 rows per block
}

TEST(ForwardPlan, GqaPackingWhenItAtLeastHalvesTheBlocks) {
  // Decoding with 8 query heads per K/V head: all 8 share one block.
  const ForwardPlan plan = plan_of(dense(4, 1, 4096, 32, 4, 128, false));
  EXPECT_EQ(plan.params.pack_shift, 3);
  EXPECT_FALSE(plan.dense);
  // Prefill: packing would not save blocks.
  EXPECT_EQ(plan_of(dense(2, 2048, 2048, 32, 4, 128, true)).params.pack_shift, 0);
  // pack_gqa forces it either way; a group that is not a power of two never packs.
  AttentionProblem forced = dense(2, 2048, 2048, 32, 4, 128, true);
  forced.pack_gqa = true;
  EXPECT_EQ(plan_of(forced).params.pack_shift, 3);
  AttentionProblem off = dense(4, 1, 4096, 32, 4, 128, false);
  off.pack_gqa = false;
  EXPECT_EQ(plan_of(off).params.pack_shift, 0);
  EXPECT_EQ(pack_gqa_shift(dense(4, 1, 4096, 24, 4, 128, false)), 0);  // group 6
}

TEST(ForwardPlan, PlansThePersistentGridOnItsOwnTiles) {
  // Causal D = 64 at 1k: two consumers, 128-row blocks; 16 x 32 pairs of 8 blocks fill the grid.
  const ForwardPlan grid = plan_of(grid_point(64, 1024, true));
  EXPECT_EQ(grid.launch.sched.m_blocks, 1024 / grid.block_m);
  EXPECT_EQ(grid.launch.sched.pairs, 16 * 32);
  EXPECT_EQ(grid.launch.ctas, kH200Sms);
  // Without a mask D = 64 takes three consumers: 192-row blocks, 6 of them at 1k.
  const ForwardPlan full = plan_of(grid_point(64, 1024, false));
  EXPECT_EQ(full.block_m, 192);
  EXPECT_EQ(full.launch.sched.m_blocks, 6);
  EXPECT_FALSE(full.launch.sched.by_rank);  // by rank only under a mask
  // Packed decoding: items per K/V head, a block of 128 rows holds 16 positions of 8 heads.
  const ForwardPlan packed = plan_of(dense(4, 1, 4096, 32, 4, 128, false));
  EXPECT_EQ(packed.launch.sched.heads_q, 4);
  EXPECT_EQ(packed.launch.sched.m_blocks, 1);
  EXPECT_EQ(packed.launch.ctas, 16);  // one item a CTA before split-KV's parts
  // Two long causal sequences: the order by rank evens out the few pairs' blocks.
  EXPECT_TRUE(plan_of(dense(1, 16384, 16384, 4, 4, 128, true)).launch.sched.by_rank);
}

TEST(ForwardPlan, WindowTakesTheWindowKernelsWithoutPackingOrTail) {
  AttentionProblem p = dense(4, 1, 4096, 32, 4, 128, false);
  p.window_left = 256;
  const ForwardPlan plan = plan_of(p);
  EXPECT_TRUE(plan.window);
  EXPECT_EQ(plan.params.pack_shift, 0);
  AttentionProblem prefill = dense(1, 1000, 3000, 17, 17, 128, false);
  prefill.window_left = prefill.window_right = 512;
  const ForwardPlan wide = plan_of(prefill);
  EXPECT_TRUE(wide.window);
  EXPECT_EQ(wide.split.tail_parts, 1);
  // A causal window (-1, 0) is plain causal: no window kernel.
  AttentionProblem causal = dense(2, 512, 512, 8, 8, 128, true);
  causal.window_right = 0;
  EXPECT_FALSE(plan_of(causal).window);
  // A window wider than the sequence binds no row.
  AttentionProblem loose = dense(2, 512, 512, 8, 8, 128, false);
  loose.window_left = 600;
  EXPECT_FALSE(plan_of(loose).window);
}

TEST(ForwardPlan, VarlenAndPagedTakeRunTimeBoundsAndKeepNarrowPagedTiles) {
  AttentionProblem varlen = dense(3, 4096, 4096, 16, 16, 128, true);
  varlen.cu_seqlens_q = static_cast<const int32_t*>(fake_ptr(5));
  varlen.cu_seqlens_k = static_cast<const int32_t*>(fake_ptr(6));
  varlen.total_q = varlen.total_k = 9000;
  const ForwardPlan v = plan_of(varlen);
  EXPECT_FALSE(v.dense);
  EXPECT_FALSE(v.dense_batch);
  EXPECT_EQ(v.split.tail_parts, 1);
  AttentionProblem paged = dense(2, 1, 16384, 16, 16, 128, false);
  paged.seqlens_k = static_cast<const int32_t*>(fake_ptr(7));
  paged.block_table = static_cast<const int32_t*>(fake_ptr(8));
  paged.page_size = 256;
  paged.max_pages_per_seq = 64;
  paged.num_pages = 128;
  const ForwardPlan pg = plan_of(paged);
  EXPECT_FALSE(pg.wide);  // a tile never spans two pages
  EXPECT_EQ(kPageMultiple % pg.block_n, 0);
  EXPECT_GT(pg.split.splits, 1);
}

// Under the causal mask a varlen batch of several sequences picks its consumers by its mean
// lengths, not by its longest sequence: at D = 64, 61 sequences of 50..2000 (65,536 tokens, the
// longest 1,995) keep two, sorted and taken from the counter; four sequences of 8k keep three.
TEST(ForwardPlan, CausalVarlenPicksConsumersByItsMeanLength) {
  auto varlen = [](int b, int max_len, int total) {
    AttentionProblem p = dense(b, max_len, max_len, 32, 32, 64, true);
    p.cu_seqlens_q = static_cast<const int32_t*>(fake_ptr(5));
    p.cu_seqlens_k = static_cast<const int32_t*>(fake_ptr(6));
    p.total_q = p.total_k = total;
    return p;
  };
  const ForwardPlan many_short = plan_of(varlen(61, 1995, 65536));
  EXPECT_EQ(many_short.consumers, 2);
  EXPECT_TRUE(many_short.sorted_order);
  EXPECT_TRUE(many_short.dynamic_order);
  EXPECT_EQ(plan_of(varlen(4, 8192, 32768)).consumers, 3);
  AttentionProblem no_mask = varlen(61, 1995, 65536);
  no_mask.causal = false;
  EXPECT_EQ(plan_of(no_mask).consumers, 3);
  EXPECT_EQ(plan_of(varlen(1, 1995, 1995)).consumers, 3);  // one sequence: its own length
}

// A varlen batch whose items fill more than one round of the SMs sorts its work list by cost
// (work_order.cuh): one int an item of workspace, and the trailer. Its CTAs take the items
// from a counter at D = 128 and under the causal mask. Not with a window, three consumers
// (D = 64, whose kernels do not read the order), split-KV, a single round or one sequence.
TEST(ForwardPlan, VarlenSortsItsWorkListBeyondOneRound) {
  auto varlen = [](int b, int s, int h, int d, bool causal) {
    AttentionProblem p = dense(b, s, s, h, h, d, causal);
    p.cu_seqlens_q = static_cast<const int32_t*>(fake_ptr(5));
    p.cu_seqlens_k = static_cast<const int32_t*>(fake_ptr(6));
    p.total_q = p.total_k = b * s / 2;
    return p;
  };
  const ForwardPlan sorted = plan_of(varlen(8, 4096, 16, 128, false));
  EXPECT_TRUE(sorted.sorted_order);
  EXPECT_TRUE(sorted.dynamic_order);
  EXPECT_EQ(sorted.consumers, 2);
  EXPECT_EQ(sorted.workspace_bytes, (size_t(8) * 16 * (4096 / sorted.block_m) + fwd::kOrderTrailer) * sizeof(int));
  const ForwardPlan d256 = plan_of(varlen(32, 512, 8, 256, false));
  EXPECT_TRUE(d256.sorted_order);
  EXPECT_FALSE(d256.dynamic_order);  // D = 256 without a mask: the snake's turns
  for (int d : {128, 256}) {
    const ForwardPlan causal = plan_of(varlen(8, 4096, 16, d, true));
    EXPECT_TRUE(causal.sorted_order) << "D=" << d;
    EXPECT_TRUE(causal.dynamic_order) << "D=" << d;
  }
  EXPECT_FALSE(plan_of(varlen(1, 65536, 16, 128, true)).sorted_order);  // one sequence
  const ForwardPlan three = plan_of(varlen(8, 4096, 32, 64, false));
  EXPECT_EQ(three.consumers, 3);
  EXPECT_FALSE(three.sorted_order);
  EXPECT_EQ(three.workspace_bytes, 0u);
  EXPECT_FALSE(plan_of(varlen(2, 1024, 8, 128, false)).sorted_order);  // 2 x 8 x 8 items: one round
  AttentionProblem window = varlen(8, 4096, 16, 128, false);
  window.window_left = 512;
  EXPECT_FALSE(plan_of(window).sorted_order);
  AttentionProblem split = varlen(8, 4096, 16, 128, false);
  split.num_splits = 2;
  EXPECT_FALSE(plan_of(split).sorted_order);
  EXPECT_FALSE(plan_of(dense(8, 4096, 4096, 16, 16, 128, true)).sorted_order);  // dense: the snake's order
  // An FP8 KV cache's widening warps walk the list in the snake's turns: sorted without a
  // mask, never taken from the counter; under the causal mask not sorted.
  AttentionProblem fp8_cache = varlen(8, 4096, 16, 128, false);
  fp8_cache.kv_dtype = DType::e4m3;
  const ForwardPlan fp8_sorted = plan_of(fp8_cache);
  EXPECT_TRUE(fp8_sorted.fp8_cache);
  EXPECT_TRUE(fp8_sorted.sorted_order);
  EXPECT_FALSE(fp8_sorted.dynamic_order);
  fp8_cache.causal = true;
  EXPECT_FALSE(plan_of(fp8_cache).sorted_order);
}

TEST(ForwardPlan, OwnSweepsOnShortCausalSweepsWithThreeConsumers) {
  EXPECT_TRUE(plan_of(grid_point(64, 2048, true)).own_sweeps);
  EXPECT_TRUE(plan_of(grid_point(64, 4096, true)).own_sweeps);
  EXPECT_FALSE(plan_of(grid_point(64, 8192, true)).own_sweeps);
  EXPECT_FALSE(plan_of(grid_point(64, 1024, true)).own_sweeps);  // two consumers
  EXPECT_FALSE(plan_of(grid_point(64, 4096, false)).own_sweeps);
  EXPECT_FALSE(plan_of(grid_point(128, 2048, true)).own_sweeps);
}

TEST(ForwardPlan, Fp8RunsOneDenseShapeWithTheTransposedV) {
  AttentionProblem p = grid_point(128, 4096, false);
  p.dtype = DType::e4m3;
  const ForwardPlan plan = plan_of(p);
  EXPECT_TRUE(plan.fp8);
  EXPECT_TRUE(plan.dense);
  EXPECT_EQ(plan.split.splits, 1);
  EXPECT_EQ(plan.split.tail_parts, 1);
  EXPECT_EQ(plan.workspace_bytes, size_t(4) * 16 * 128 * 4096);  // V^T, keys padded to 128
  p.seqlen_k = 4097;
  EXPECT_EQ(plan_of(p).workspace_bytes, size_t(4) * 16 * 128 * (4096 + 128));
}

TEST(ForwardPlan, Fp8CacheRunsTheRunTimeBoundsKernelWithNarrowTilesAndTwoConsumers) {
  for (int d : {64, 128, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    // Decoding a long cache with GQA: packed, split, and never the wide tiles or three consumers.
    AttentionProblem p = dense(2, 1, 32768, 32, 4, d, false);
    p.kv_dtype = DType::e4m3;
    ForwardPlan plan = plan_of(p);
    EXPECT_TRUE(plan.fp8_cache);
    EXPECT_FALSE(plan.fp8);
    EXPECT_FALSE(plan.dense);
    EXPECT_FALSE(plan.wide);
    EXPECT_EQ(plan.consumers, 2);
    EXPECT_EQ(plan.block_n, d == 256 ? 64 : 128);
    EXPECT_EQ(plan.params.pack_shift, 3);
    EXPECT_GT(plan.split.splits, 1);
    // A dense prefill grid point, which a 16-bit cache runs in the dense kernels.
    p = grid_point(d, 4096, true);
    p.kv_dtype = DType::e4m3;
    plan = plan_of(p);
    EXPECT_FALSE(plan.dense);
    EXPECT_FALSE(plan.wide);
    EXPECT_EQ(plan.consumers, 2);
    // The cache's dtype as q's is no FP8 cache.
    p.kv_dtype = DType::bf16;
    EXPECT_FALSE(plan_of(p).fp8_cache);
  }
}

TEST(ForwardPlan, NoSmsIsAnErrorNotAPlan) {
  ForwardPlan plan;
  const Status s = make_plan(grid_point(128, 4096, false), 0, &plan);
  EXPECT_EQ(s.code(), StatusCode::cuda_error);
}

}  // namespace
}  // namespace hattn::fwd
