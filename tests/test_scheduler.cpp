// CPU tests of the persistent kernels' work order (src/common/tile_scheduler.cuh).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <vector>

#include "../src/common/tile_scheduler.cuh"
#include "hattn/reference.h"

namespace hattn {
namespace {

constexpr int kBlockM = 128, kBlockN = 128;

auto causal_tiles(int seqlen_q, int seqlen_k) {
  return [=](int m_block) { return causal_kv_tiles(m_block, kBlockM, kBlockN, seqlen_q, seqlen_k); };
}

// Tiles up to the diagonal (bottom-right aligned), none for blocks whose rows see no key.
TEST(TileScheduler, CausalKvTiles) {
  EXPECT_EQ(causal_kv_tiles(0, 128, 128, 1024, 1024), 1);
  EXPECT_EQ(causal_kv_tiles(7, 128, 128, 1024, 1024), 8);
  EXPECT_EQ(causal_kv_tiles(0, 128, 128, 100, 1000), 8);   // Sq < Sk: row 99 sees keys 0..999
  EXPECT_EQ(causal_kv_tiles(0, 128, 128, 300, 100), 0);    // Sq > Sk: rows 0..127 see nothing
  EXPECT_EQ(causal_kv_tiles(2, 128, 128, 300, 100), 1);    // rows 256..299 see keys 0..99
  EXPECT_EQ(causal_kv_tiles(1, 128, 64, 130, 130), 3);     // the tail block: rows 128, 129
}

// masked_kv_tiles covers exactly the tiles holding a key that some row of the block sees
// (checked against the reference's per-row ranges), and is causal_kv_tiles under causal alone.
TEST(TileScheduler, MaskedKvTilesMatchTheRowsKeys) {
  EXPECT_EQ(masked_kv_tiles(0, 128, 128, 1000, 1000, -1, -1).last, 8);  // no mask: every tile
  const int cases[][4] = {{300, 300, 64, 64}, {257, 400, 100, 0},   {200, 130, 0, 0},  {150, 1000, -1, 40},
                          {130, 130, 7, 0},   {90, 500, 20, 0},     {1000, 1000, -1, 0}, {300, 37, -1, 0},
                          {500, 700, 1, -1},  {64, 2000, 500, 500}, {700, 100, 5, 3}};
  for (const auto& c : cases)
    for (int block_n : {64, 80, 128, 176}) {
      ref::HostProblem h;
      h.seqlen_q = c[0];
      h.seqlen_k = c[1];
      h.window_left = c[2];
      h.window_right = c[3];
      for (int m_block = 0; m_block * kBlockM < h.seqlen_q; ++m_block) {
        int first_key = h.seqlen_k, last_key = 0;  // union of the block's rows' ranges
        for (int i = m_block * kBlockM; i < std::min(h.seqlen_q, (m_block + 1) * kBlockM); ++i) {
          int first = 0, last = 0;
          ref::visible_key_range(h, i, &first, &last);
          if (first < last) first_key = std::min(first_key, first), last_key = std::max(last_key, last);
        }
        const KvTileRange r = masked_kv_tiles(m_block, kBlockM, block_n, h.seqlen_q, h.seqlen_k, h.window_left,
                                              h.window_right);
        SCOPED_TRACE(testing::Message() << "Sq=" << c[0] << " Sk=" << c[1] << " window=(" << c[2] << "," << c[3]
                                        << ") block_n=" << block_n << " m_block=" << m_block);
        if (first_key >= last_key) {
          EXPECT_EQ(r.last - r.first, 0);
        } else {
          EXPECT_EQ(r.first, first_key / block_n);
          EXPECT_EQ(r.last, (last_key + block_n - 1) / block_n);
        }
        if (c[2] < 0 && c[3] == 0) {
          const KvTileRange causal = masked_kv_tiles(m_block, kBlockM, block_n, h.seqlen_q, h.seqlen_k, -1, 0);
          EXPECT_EQ(causal.first, 0);
          EXPECT_EQ(causal.last, causal_kv_tiles(m_block, kBlockM, block_n, h.seqlen_q, h.seqlen_k));
        }
      }
    }
}

// The persistent grid: one CTA per SM, fewer when there are fewer items; the list covers them all.
TEST(TileScheduler, PersistentLaunchPlan) {
  const PersistentLaunch few = plan_persistent_launch(1, 2, 300, 300, false, 128, 128, 132);
  EXPECT_EQ(few.ctas, 6);  // 2 heads x 3 query blocks
  EXPECT_EQ(few.sched.total(), 6);
  const PersistentLaunch many = plan_persistent_launch(32, 16, 512, 512, true, 128, 128, 132);
  EXPECT_EQ(many.ctas, 132);
  EXPECT_EQ(many.sched.total(), 32 * 16 * 4);
  EXPECT_EQ(work_items(32, 16, 512, 128), 2048);
  EXPECT_GT(work_items(1 << 20, 64, 1 << 20, 128), kMaxWorkItems);  // refused by supports()
}

// A remembered plan is the plan: asked again (after others pushed it toward the end of the
// thread's list, and after it fell out), the same grid and order.
TEST(TileScheduler, RememberedPlansMatch) {
  struct Shape {
    int batch, heads, seqlen;
    bool causal;
    int window_left;
  };
  const std::vector<Shape> shapes{{16, 16, 1024, true, -1}, {1, 16, 16384, true, -1}, {32, 16, 512, true, -1},
                                  {2, 3, 300, false, -1},   {4, 8, 2000, false, 100}, {8, 4, 700, true, 50},
                                  {1, 1, 1, false, -1},     {3, 5, 1000, true, -1},   {2, 16, 4096, true, -1},
                                  {16, 32, 1024, true, -1}};
  for (int pass = 0; pass < 3; ++pass)
    for (const Shape& s : shapes) {
      const PersistentLaunch got =
          plan_persistent_launch(s.batch, s.heads, s.seqlen, s.seqlen, s.causal, 128, 128, 132, s.window_left);
      const PersistentLaunch want =
          compute_persistent_launch(s.batch, s.heads, s.seqlen, s.seqlen, s.causal, 128, 128, 132, s.window_left, -1);
      EXPECT_EQ(got.ctas, want.ctas);
      EXPECT_EQ(got.sched.m_blocks, want.sched.m_blocks);
      EXPECT_EQ(got.sched.heads_q, want.sched.heads_q);
      EXPECT_EQ(got.sched.pairs, want.sched.pairs);
      EXPECT_EQ(got.sched.by_rank, want.sched.by_rank) << s.batch << "x" << s.heads << " S=" << s.seqlen;
    }
  // Any argument is part of the key: another SM count is another grid.
  EXPECT_EQ(plan_persistent_launch(16, 16, 1024, 1024, true, 128, 128, 132).ctas, 132);
  EXPECT_EQ(plan_persistent_launch(16, 16, 1024, 1024, true, 128, 128, 114).ctas, 114);
}

// 13's tile-shape choice: the mean keys per query block, after the causal mask.
TEST(TileScheduler, MeanKeysPerBlock) {
  EXPECT_EQ(mean_keys_per_block(128, 100, 9000, false), 9000.0);
  EXPECT_EQ(mean_keys_per_block(128, 256, 256, true), (128.0 + 256.0) / 2);
  EXPECT_EQ(mean_keys_per_block(128, 200, 8400, true), (8328.0 + 8400.0) / 2);  // Sq < Sk
  EXPECT_EQ(mean_keys_per_block(128, 300, 100, true), (0.0 + 56.0 + 100.0) / 3);  // Sq > Sk
  // The FlashAttention grid at 16k keys: causal sweeps average just over 8k, full ones 16k.
  EXPECT_GE(mean_keys_per_block(128, 16384, 16384, true), 8192.0);
  EXPECT_LT(mean_keys_per_block(128, 8192, 8192, true), 8192.0);
}

// Every (batch, head, query block) is taken by exactly one CTA, whatever the order and grid.
TEST(TileScheduler, EveryItemOnce) {
  for (const auto& [batch, heads, seqlen, causal, ctas] :
       std::vector<std::tuple<int, int, int, bool, int>>{{1, 1, 1, false, 1},       {2, 3, 300, false, 5},
                                                        {2, 3, 300, true, 7},       {1, 16, 16384, true, 132},
                                                        {32, 16, 512, true, 132},   {4, 5, 1000, true, 13},
                                                        {1, 2, 129, true, 132}}) {
    const TileScheduler s =
        make_tile_scheduler(batch, heads, seqlen, kBlockM, causal, ctas, causal_tiles(seqlen, seqlen));
    std::set<std::tuple<int, int, int>> seen;
    int taken = 0;
    for (int c = 0; c < ctas; ++c)
      for (int round = 0, w = TileScheduler::position(0, c, ctas); w < s.total();
           w = TileScheduler::position(++round, c, ctas)) {
        const WorkItem it = s.item(w);
        ASSERT_GE(it.m_block, 0);
        ASSERT_LT(it.m_block, s.m_blocks);
        ASSERT_LT(it.head_q, heads);
        ASSERT_LT(it.batch, batch);
        seen.insert({it.m_block, it.head_q, it.batch});
        ++taken;
      }
    EXPECT_EQ(taken, s.total()) << "batch " << batch << " heads " << heads << " seqlen " << seqlen;
    EXPECT_EQ(int(seen.size()), s.total());
  }
}

// The causal order by rank is chosen where the order by pair leaves one CTA with far more work
// (few pairs of many blocks) and not where the order by pair balances (many short pairs).
TEST(TileScheduler, PicksTheCausalOrder) {
  EXPECT_TRUE(make_tile_scheduler(1, 16, 16384, kBlockM, true, 132, causal_tiles(16384, 16384)).by_rank);
  EXPECT_FALSE(make_tile_scheduler(32, 16, 512, kBlockM, true, 132, causal_tiles(512, 512)).by_rank);
  EXPECT_FALSE(make_tile_scheduler(1, 16, 16384, kBlockM, false, 132, causal_tiles(16384, 16384)).by_rank);
}

// FastDivisor's quotient and remainder are the division's, for every divisor up to 4096 on
// numerators near 0, near multiples of the divisor and near 2^31, and for large divisors.
TEST(FastDivisor, MatchesIntegerDivision) {
  constexpr int kMaxInt = 2147483647;
  std::vector<int> divisors;
  for (int d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int d : {6007, 65535, 65536, 65537, 1000003, 1 << 20, (1 << 30) - 1, 1 << 30, (1 << 30) + 1, kMaxInt - 1,
                kMaxInt})
    divisors.push_back(d);
  for (int d : divisors) {
    const FastDivisor f(d);
    std::vector<int> numerators;
    for (int n = 0; n < 300; ++n) numerators.push_back(n);
    for (int k : {1, 2, 3, 1000, 65536})
      for (int delta : {-1, 0, 1}) {
        const int64_t n = int64_t(d) * k + delta;
        if (n >= 0 && n <= kMaxInt) numerators.push_back(int(n));
      }
    for (int n = kMaxInt; n > kMaxInt - 300; --n) numerators.push_back(n);
    numerators.push_back(kMaxInt / d * d);
    numerators.push_back(kMaxInt / d * d - 1);
    for (int n : numerators) {
      ASSERT_EQ(f.div(n), n / d) << n << " / " << d;
      ASSERT_EQ(f.mod(n), n % d) << n << " % " << d;
    }
  }
  EXPECT_EQ(FastDivisor(0).divisor, 1);  // not a count: taken as 1
}

// FastItemOrder gives every position the scheduler's item, in both orders.
TEST(TileScheduler, FastItemOrderMatches) {
  for (auto [batch, heads, seqlen] : {std::tuple{1, 1, 100}, {3, 5, 1000}, {32, 16, 512}, {1, 16, 16384}, {7, 40, 3000}})
    for (bool by_rank : {false, true}) {
      TileScheduler s{(seqlen + kBlockM - 1) / kBlockM, heads, batch * heads, by_rank};
      const FastItemOrder order(s);
      for (int w = 0; w < s.total(); ++w) {
        const WorkItem a = s.item(w), b = order.item(w);
        ASSERT_EQ(std::tie(a.m_block, a.head_q, a.batch), std::tie(b.m_block, b.head_q, b.batch))
            << "item " << w << " of " << batch << " x " << heads << " x " << seqlen << (by_rank ? " by rank" : "");
      }
    }
}

}  // namespace
}  // namespace hattn
