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

TEST(BackwardTurns, AQueryBlocksKeyBlocksRunDownFromItsLastQuerysLastKeyWithoutGaps) {
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
            problem.head_dim = 64;
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
              const bwd::QueryBlocks blocks = bwd::blocks_holding(q_first, q_last, /*keys_in_sequence=*/true);
              for (int s = 0; s < blocks.steps; ++s) adders[blocks.m_begin / bwd::kBlockM + s].push_back(n);
            }
            for (const auto& [m, key_blocks] : adders) {
              int first_key, last_key;  // the keys the block's last query sees
              visible_keys(f, std::min((m + 1) * bwd::kBlockM, seqlen_q) - 1, &first_key, &last_key);
              // key_blocks ascend: the last adds first.
              for (size_t i = 0; i < key_blocks.size(); ++i)
                ASSERT_EQ(bwd::dq_turn(key_blocks[i] * bwd::kBlockN, last_key), int(key_blocks.size() - 1 - i))
                    << where << ": query block " << m << ", adder " << i << " (key block " << key_blocks[i] << ")";
              ++checked;
            }
          }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace hattn
