// The deterministic backward's turns (src/attention/backward/consumer.cuh, reduce_dq): the CTA
// of key block n adds into query block m when m's counter reads n - n_first(m), n_first(m) being
// the key block of the first key that m's first query sees. That is right only if the key blocks
// adding into m, those whose query blocks (work.cuh's query_blocks) include m, are n_first(m),
// n_first(m) + 1, ... without a gap: each turn is then taken exactly once, in key order, and no
// CTA waits for a turn no one passes. Checked here on the host, with the kernel's own mask
// helpers, over lengths that are and are not block multiples, causal or not, windows.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "attention/backward/config.h"
#include "common/backward_common.cuh"

namespace hattn {
namespace {

TEST(BackwardTurns, AQueryBlocksKeyBlocksRunFromItsFirstQuerysFirstKeyWithoutGaps) {
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
            const AttentionParams f = make_params(problem);
            const std::string where = "Sq " + std::to_string(seqlen_q) + " Sk " + std::to_string(seqlen_k) +
                                      (causal ? " causal" : "") + " window (" + std::to_string(window_left) + ", " +
                                      std::to_string(window_right) + ")";
            // Who adds into each query block: work.cuh's query_blocks for every key block.
            std::map<int, std::vector<int>> adders;
            for (int n = 0; n * bwd::kBlockN < seqlen_k; ++n) {
              const int n0 = n * bwd::kBlockN;
              int q_first, q_last;
              queries_seeing(f, n0, n0 + bwd::kBlockN, &q_first, &q_last);
              const int m_begin = q_first / bwd::kBlockM * bwd::kBlockM;
              const int steps = q_last > m_begin ? (q_last - m_begin + bwd::kBlockM - 1) / bwd::kBlockM : 0;
              for (int s = 0; s < steps; ++s) adders[m_begin / bwd::kBlockM + s].push_back(n);
            }
            for (const auto& [m, blocks] : adders) {
              int first_key, last_key;
              visible_keys(f, m * bwd::kBlockM, &first_key, &last_key);
              const int n_first = first_key / bwd::kBlockN;
              for (size_t i = 0; i < blocks.size(); ++i)
                ASSERT_EQ(blocks[i], n_first + int(i)) << where << ": query block " << m << ", adder " << i;
              ++checked;
            }
          }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace hattn
