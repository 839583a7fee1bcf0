// The deterministic backward's turns (src/attention/backward/consumer.cuh, reduce_dq): the CTA
// of key block n adds into query block m when m's counter reads work.cuh's dq_turn, the key
// block of the last key that m's last query sees minus n. That is right only if the key blocks
// adding into m, those whose query blocks (work.cuh's query_blocks) include m, take turns 0, 1,
// ... from the last key block down without a gap: each turn is then taken exactly once, no CTA
// waits for a turn no one passes, and each waits only on a higher key block, whose CTA the
// kernel launches first (kernel.cuh: key blocks from the last). Checked here on the host, with
// the kernel's own mask and block helpers, over lengths that are and are not block multiples,
// causal or not, windows. And the causal launch order (work.cuh's cta_coordinates_in).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "attention/backward/work.cuh"
#include "common/backward_common.cuh"

namespace hattn {
namespace {

// The checks for the blocks of head dim D (kBlockM<D> query rows); returns how many query
// blocks were checked.
template <int D>
int check_turns() {
  constexpr int kRows = bwd::kBlockM<D>;
  int checked = 0;
  for (int seqlen_q : {1, 5, 64, 65, 200, 333, 1000})
    for (int seqlen_k : {1, 64, 127, 128, 129, 500, 1000})
      for (bool causal : {false, true})
        for (int window_left : {-1, 0, 3, 100, 300})
          for (int window_right : {-1, 0, 5, 200}) {
            if (causal && window_right > 0) continue;  // causal is window_right = 0
            AttentionProblem problem;
            problem.batch = 1;
            problem.seqlen_q = seqlen_q;
            problem.seqlen_k = seqlen_k;
            problem.heads_q = problem.heads_kv = 1;
            problem.head_dim = D;
            problem.causal = causal;
            problem.window_left = window_left;
            problem.window_right = window_right;
            const FeatureParams f = make_feature_params(problem);
            const std::string where = "Sq " + std::to_string(seqlen_q) + " Sk " + std::to_string(seqlen_k) +
                                      (causal ? " causal" : "") + " window (" + std::to_string(window_left) + ", " +
                                      std::to_string(window_right) + ")";
            // Who adds into each query block: work.cuh's query_blocks for every key block.
            std::map<int, std::vector<int>> adders;
            for (int n = 0; n * bwd::kBlockN < seqlen_k; ++n) {
              const int n0 = n * bwd::kBlockN;
              int q_first, q_last;
              queries_seeing(f, n0, n0 + bwd::kBlockN, &q_first, &q_last);
              const bwd::QueryBlocks<kRows> blocks =
                  bwd::blocks_holding<kRows>(q_first, q_last, /*keys_in_sequence=*/true);
              for (int s = 0; s < blocks.steps; ++s) adders[blocks.m_begin / kRows + s].push_back(n);
            }
            for (const auto& [m, key_blocks] : adders) {
              int first_key, last_key;  // the keys the block's last query sees
              visible_keys(f, std::min((m + 1) * kRows, seqlen_q) - 1, &first_key, &last_key);
              // key_blocks ascend: the last adds first.
              for (size_t i = 0; i < key_blocks.size(); ++i)
                EXPECT_EQ(bwd::dq_turn(key_blocks[i] * bwd::kBlockN, last_key), int(key_blocks.size() - 1 - i))
                    << "D " << D << ", " << where << ": query block " << m << ", adder " << i << " (key block "
                    << key_blocks[i] << ")";
              ++checked;
            }
          }
  return checked;
}

// The masks from either side (work.cuh's KeyViewers): query i sees key j (keys_seen_by, what
// the forward and the reference use) exactly when i lies in the queries that see key j
// (queries_seeing_keys over [j, j + 1)), over lengths, causal or not, windows and offsets.
TEST(BackwardMasks, AKeysViewersAreTheQueriesWhoseKeysHoldIt) {
  int pairs = 0;
  for (int seqlen_q : {1, 7, 64, 130})
    for (int seqlen_k : {1, 9, 64, 200})
      for (bool causal : {false, true})
        for (int window_left : {-1, 0, 3, 50})
          for (int window_right : {-1, 0, 5}) {
            if (causal && window_right > 0) continue;
            AttentionProblem problem;
            problem.batch = problem.heads_q = problem.heads_kv = 1;
            problem.seqlen_q = seqlen_q;
            problem.seqlen_k = seqlen_k;
            problem.head_dim = 64;
            problem.causal = causal;
            problem.window_left = window_left;
            problem.window_right = window_right;
            const FeatureParams f = make_feature_params(problem);
            for (int j = 0; j < seqlen_k; ++j) {
              int first_q, last_q;
              queries_seeing_keys(f, f.causal_offset, seqlen_q, j, j + 1, &first_q, &last_q);
              for (int i = 0; i < seqlen_q; ++i) {
                int first_k, last_k;
                keys_seen_by(f, f.causal_offset, seqlen_k, i, &first_k, &last_k);
                ASSERT_EQ(j >= first_k && j < last_k, i >= first_q && i < last_q)
                    << "Sq " << seqlen_q << " Sk " << seqlen_k << (causal ? " causal" : "") << " window ("
                    << window_left << ", " << window_right << "): query " << i << ", key " << j;
                ++pairs;
              }
            }
          }
  EXPECT_GT(pairs, 100000);
}

TEST(BackwardTurns, AQueryBlocksKeyBlocksRunDownFromItsLastQuerysLastKeyWithoutGaps) {
  EXPECT_GT(check_turns<64>(), 1000);   // 128-query blocks
  EXPECT_GT(check_turns<128>(), 1000);  // 64-query blocks
}

// The launch order (work.cuh's cta_coordinates_in) over grids of (blocks, heads, entries):
// every CTA of the grid gets a distinct (block, head, entry) and all of them are covered; a
// dense causal grid of kMinGroupedRows or more runs by groups of (head, entry) pairs, each
// group's CTAs in launch order taking block 0 of every pair, then block 1, ... (from the last
// block with heaviest_last); the deterministic mode reverses the blocks; other grids keep theirs.
// In every order the heads of an entry's block are launched in head order.
template <int kBlockRows>
void check_launch_order(int blocks, int heads, int entries, bool varlen, bool causal, bool deterministic,
                        bool heaviest_last) {
  struct HostGrid {
    int bx, by, bz, gx, gy, gz;
    __host__ __device__ int x() const { return bx; }
    __host__ __device__ int y() const { return by; }
    __host__ __device__ int z() const { return bz; }
    __host__ __device__ int blocks() const { return gx; }
    __host__ __device__ int heads() const { return gy; }
    __host__ __device__ int entries() const { return gz; }
  };
  const std::string where = std::to_string(blocks) + " blocks of " + std::to_string(kBlockRows) + " x " +
                            std::to_string(heads) + " heads x " + std::to_string(entries) + (varlen ? " varlen" : "") +
                            (causal ? " causal" : "") + (deterministic ? " deterministic" : "") +
                            (heaviest_last ? " heaviest last" : "");
  const bool grouped = !varlen && causal && !deterministic && blocks * kBlockRows >= bwd::kMinGroupedRows;
  const int group = std::max(1, bwd::kWaveCtas / blocks);  // pairs a group
  std::vector<int> seen(size_t(blocks) * heads * entries, 0);
  std::vector<bwd::CtaCoordinates> launched;  // in launch order (blockIdx.x fastest)
  // The last head launched so far for each (entry, block): the deterministic backward at D = 256
  // with GQA lets a group's heads add in head order, so head h's CTA of a block must be launched
  // after head h - 1's.
  std::vector<int> last_head(size_t(entries) * blocks, -1);
  for (int z = 0; z < entries; ++z)
    for (int y = 0; y < heads; ++y)
      for (int x = 0; x < blocks; ++x) {
        const HostGrid g{x, y, z, blocks, heads, entries};
        const bwd::CtaCoordinates c =
            varlen ? bwd::cta_coordinates_in<true, kBlockRows>(g, causal, deterministic, heaviest_last)
                   : bwd::cta_coordinates_in<false, kBlockRows>(g, causal, deterministic, heaviest_last);
        ASSERT_TRUE(c.block >= 0 && c.block < blocks && c.head >= 0 && c.head < heads && c.batch >= 0 &&
                    c.batch < entries)
            << where << ": CTA (" << x << ", " << y << ", " << z << ")";
        ++seen[(size_t(c.batch) * heads + c.head) * blocks + c.block];
        int& before = last_head[size_t(c.batch) * blocks + c.block];
        EXPECT_EQ(c.head, before + 1) << where << ": CTA (" << x << ", " << y << ", " << z << ")";
        before = c.head;
        if (grouped) {
          launched.push_back(c);
        } else if (deterministic) {
          EXPECT_TRUE(c.block == blocks - 1 - x && c.head == y && c.batch == z) << where;
        } else {
          EXPECT_TRUE(c.block == x && c.head == y && c.batch == z) << where;
        }
      }
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << where << ": CTA coordinates " << i;
  // Grouped: launch positions [k group blocks, (k + 1) group blocks) hold pairs k group ..
  // (k + 1) group - 1 (fewer in the last group), and inside a group the blocks go from the
  // heaviest, never back.
  for (size_t at = 0; at < launched.size(); ++at) {
    const int first_pair = int(at) / (group * blocks) * group;
    const int pair = launched[at].batch * heads + launched[at].head;
    EXPECT_TRUE(pair >= first_pair && pair < first_pair + group) << where << ": launch position " << at;
    const auto rank = [&](size_t i) { return heaviest_last ? blocks - 1 - launched[i].block : launched[i].block; };
    if (at % (size_t(group) * blocks) != 0) EXPECT_LE(rank(at - 1), rank(at)) << where << ": launch position " << at;
  }
}

TEST(BackwardLaunchOrder, EveryCtaOnceAndHeaviestFirstByGroups) {
  for (int blocks : {1, 8, 15, 16, 17, 64, 128, 129})
    for (int heads : {1, 3, 16})
      for (int entries : {1, 2, 5})
        for (bool causal : {false, true})
          for (bool deterministic : {false, true}) {
            check_launch_order<128>(blocks, heads, entries, false, causal, deterministic, false);
            check_launch_order<64>(blocks, heads, entries, false, causal, deterministic, false);
            check_launch_order<128>(blocks, heads, entries, false, causal, deterministic, true);
            check_launch_order<128>(blocks, heads, entries, true, causal, deterministic, false);
          }
}

// The dQ sum's tiles (backward_common.cuh): in a packed batch every sequence's 64-row blocks,
// from dq_tile_first_block for as many blocks as its rows need, lie after the sequence before's
// and inside dq_tile_blocks, over random lengths (empty ones too).
TEST(BackwardDqTiles, SequencesGetTheirOwnTiles) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int batch = 1 + int(rng() % 9);
    std::vector<int> cu(batch + 1, 0);
    for (int b = 0; b < batch; ++b) cu[b + 1] = cu[b] + int(rng() % 4 == 0 ? 0 : rng() % 300);
    const int total = cu[batch], blocks = dq_tile_blocks(total, batch, true);
    int next_free = 0;
    for (int b = 0; b < batch; ++b) {
      const int first = dq_tile_first_block(cu[b], b, true), used = (cu[b + 1] - cu[b] + 63) / 64;
      ASSERT_GE(first, next_free) << "sequence " << b << " of " << batch << ", trial " << trial;
      ASSERT_LE(first + used, blocks) << "sequence " << b << " of " << batch << ", trial " << trial;
      next_free = first + used;
    }
  }
  EXPECT_EQ(dq_tile_blocks(100, 3, false), 2);  // a dense entry: ceil(Sq / 64)
  EXPECT_EQ(dq_tile_first_block(500, 3, false), 0);
}

}  // namespace
}  // namespace hattn
