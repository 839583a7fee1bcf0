// The deterministic backward's turns (src/attention/backward/consumer.cuh, reduce_dq): the CTA
// of key block n adds into query block m when m's counter reads work.cuh's dq_turn, the key
// block of the last key that m's last query sees minus n. That is right only if the key blocks
// adding into m, those whose query blocks (work.cuh's query_blocks) include m, take turns 0, 1,
// ... from the last key block down without a gap: each turn is then taken exactly once, no CTA
// waits for a turn no one passes, and each waits only on a higher key block, whose CTA the
// kernel launches first (kernel.cuh: key blocks from the last). Checked here on the host, with
// the kernel's own mask and block helpers, over lengths that are and are not block multiples,
// causal or not, windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
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

// The masks from either side (scores.cuh's KeyViewers): query i sees key j (keys_seen_by, what
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

}  // namespace
}  // namespace hattn
