// The production forward's host plan (plan.h).
#include "plan.h"

#include <algorithm>
#include <string>

#include "../common/tile_scheduler.cuh"
#include "config.h"
#include "fp8_transpose.cuh"

namespace hattn::fwd {

// The group must be a power of two that divides a consumer's 64 rows (a Q box holds whole
// groups). Automatic: when it at least halves the 128-row blocks (few queries per sequence,
// as in decoding); pack_gqa forces it on or off. Never with a sliding window (make_plan).
int pack_gqa_shift(const AttentionProblem& problem) {
  const int group = problem.heads_q / problem.heads_kv;
  if (group < 2 || group > 64 || (group & (group - 1)) != 0) return 0;
  int shift = 0;
  while ((1 << shift) < group) ++shift;
  if (problem.pack_gqa.has_value()) return *problem.pack_gqa ? shift : 0;
  const int64_t blocks = (int64_t(problem.seqlen_q) + 127) / 128 * group;
  const int64_t packed_blocks = (int64_t(problem.seqlen_q) * group + 127) / 128;
  return packed_blocks * 2 <= blocks ? shift : 0;
}

// num_splits when the caller gives it (1: off), else, when the query blocks alone would leave
// more than half of the SMs idle, as many parts as fit in one round of the SMs (rounding up
// left a second round with most SMs idle: 1.1-1.6x slower on the H200,
// results/evidence/split_rounds_397bfab/), as long as each part keeps kMinTilesPerSplit tiles
// of the mean sweep. Capped so that the work list still fits an int.
int split_parts(const AttentionProblem& problem, int pack_shift, int block_m, int block_n, double mean_keys, int sms) {
  const int64_t items = work_items(problem.batch, pack_shift > 0 ? problem.heads_kv : problem.heads_q, problem.seqlen_q,
                                   block_m >> pack_shift);
  int parts = problem.num_splits;
  if (parts == 0) {
    if (items * 2 > sms) return 1;
    const int64_t by_sms = sms / items;  // items <= sms / 2 here: at least 2
    const int64_t by_tiles = int64_t(mean_keys / block_n) / kMinTilesPerSplit;
    parts = int(std::min<int64_t>({by_sms, by_tiles, kMaxSplits}));
  }
  if (parts < 2 || items * parts > kMaxWorkItems) return 1;
  return parts;
}

// Without a mask, when the items are not a whole number of rounds of the persistent grid, each
// item of the last round is cut into as many parts as fill the grid's CTAs, as long as each
// part keeps kMinTilesPerSplit tiles. Automatic only (num_splits = 0), and only in dense
// batches: the kernels without run-time bounds, and decoding at D = 64 in the run-time bounds
// kernels.
void plan_tail_split(const AttentionProblem& problem, int block_m, int block_n, int sms, SplitPlan* plan) {
  const int64_t items = work_items(problem.batch, problem.heads_q, problem.seqlen_q, block_m);
  const int64_t ctas = std::min<int64_t>(items, sms);
  const int64_t left = ctas > 0 ? items % ctas : 0;  // items of the last, partial round
  if (left == 0) return;
  const int64_t by_ctas = ctas / left;
  const int64_t by_tiles = (int64_t(problem.seqlen_k) + block_n - 1) / block_n / kMinTilesPerSplit;
  const int parts = int(std::min<int64_t>({by_ctas, by_tiles, kMaxSplits}));
  if (parts < 2 || items - left + left * parts > kMaxWorkItems) return;
  plan->tail_start = int(items - left);
  plan->tail_parts = parts;
  plan->bytes = size_t(left) * parts * block_m * (problem.head_dim + 1) * sizeof(float);
}

namespace {

// The K/V tile's keys for head dim d and the wide flag (Config's kBlockN).
int block_n_of(int d, bool wide) {
  switch (d) {
    case 64: return Config<64, false, 2>::kBlockN;  // D = 64 never takes the wide tiles
    case 128: return wide ? Config<128, true, 2>::kBlockN : Config<128, false, 2>::kBlockN;
    default: return wide ? Config<256, true, 2>::kBlockN : Config<256, false, 2>::kBlockN;
  }
}

}  // namespace

void bind_params(const AttentionProblem& problem, ForwardPlan* plan) {
  const int pack_shift = plan->params.pack_shift;
  plan->params = make_feature_params(problem);
  plan->params.pack_shift = pack_shift;
  if (problem.scale() == 0.f) {
    // Every weight is equal (softcapped too: softcap * tanh(0) = 0). The kernels fold the scale
    // into exp2, where a masked score times 0 would be NaN, so they run with a scale so small
    // that every 2^(s c) rounds to exactly 1 and the LSE's scale * max to 0 (launch() flips
    // q's signs for a negative scale).
    plan->params.scale = kZeroScale;
    plan->params.softcap_scale = 0.f;
  }
}

Status make_plan(const AttentionProblem& problem, int sms, ForwardPlan* plan) {
  ForwardPlan& c = *plan;
  c = ForwardPlan{};
  if (sms <= 0)
    return {StatusCode::cuda_error, "fwd_sm90: cannot query the number of SMs of the current device"};
  c.sms = sms;
  bind_params(problem, &c);
  c.fp8 = problem.dtype == DType::e4m3;
  c.fp8_cache = problem.has_fp8_cache();
  // The window's kernels only where a window edge binds beyond what causal already does.
  c.window = c.params.window_left >= 0 || (!problem.causal && c.params.window_right >= 0);
  c.params.pack_shift = c.window || c.fp8 ? 0 : pack_gqa_shift(problem);  // the window's kernels do not pack
  const int sweep_block = Config<128, false, 2>::kBlockM >> c.params.pack_shift;  // the block the sweeps are judged on
  c.mean_keys = mean_keys_per_block(sweep_block, problem.seqlen_q, problem.seqlen_k, problem.causal,
                                    c.params.window_left, c.params.window_right);
  // Packed items are per K/V head, and their blocks hold block_m / group query positions.
  auto plan_launch = [&] {
    c.launch = plan_persistent_launch(problem.batch, c.params.pack_shift > 0 ? problem.heads_kv : problem.heads_q,
                                      problem.seqlen_q, problem.seqlen_k, problem.causal,
                                      c.block_m >> c.params.pack_shift, c.block_n, sms, c.params.window_left,
                                      c.params.window_right);
  };
  if (c.fp8) {  // one shape per head dim (64, 128, 256): 128-key tiles, two consumers, the dense kernel
    c.dense_batch = c.dense = true;
    c.block_n = 128;
    c.workspace_bytes = vt_bytes(problem);  // V^T's copy
    plan_launch();
    return Status::Ok();
  }
  // A paged cache keeps the 128- (D = 256: 64-) key tiles, so that a tile never spans two pages.
  c.dense_batch = !c.window && !problem.has_sequence_bounds() && c.params.pack_shift == 0 && problem.softcap == 0.f;
  c.dense = c.dense_batch;
  c.wide = problem.head_dim != 64 && !problem.is_paged() && !c.fp8_cache &&
           c.mean_keys >= wide_tile_min_keys(problem.head_dim, c.dense);
  // Decoding at D = 64 (a query block of at most one consumer's 64 rows) runs in the run-time
  // bounds kernels also when dense: there its consumers without rows (two of three) skip
  // their tiles, which the dense kernels compute (4 x 4k keys: 55 us in the dense kernel,
  // 47.6 here; 32 x 4k: 371 and 272). At D = 128 and 256 (one idle consumer of two) they ran
  // 0.5% slower at 32 x 4k (results/evidence/deep_ring_tail_rounds/run2/). The tail split
  // still cuts its last round (dense_batch): 5 x 4k, 76.5 us without it, 62.9 with
  // (results/evidence/decode_d64_tail/).
  if (problem.head_dim == 64 && !c.window && (int64_t(problem.seqlen_q) << c.params.pack_shift) <= 64)
    c.dense = false;
  // A sliding window is treated like the causal mask: its sweeps are as long as the window.
  // A causal varlen batch of several sequences judges its sweeps by its mean lengths (its
  // rows and keys over its sequences), not by the longest sequence that sized every pair's
  // blocks: many short sequences then keep two consumers, whose kernels sort the list and take
  // it from the counter. 61 sequences of 50..2000 at D = 64: 0.82 of three consumers' time;
  // the mixed lengths 5..7000 0.995-1.002 (results/evidence/varlen_mean_sweep/).
  double sweep_keys = c.mean_keys;
  if (problem.is_varlen() && problem.batch > 1 && problem.causal && !c.window)
    sweep_keys = mean_keys_per_block(sweep_block, std::max(1, problem.total_q / problem.batch),
                                     std::max(1, problem.total_k / problem.batch), true);
  const bool three = !(problem.causal || c.window) || sweep_keys >= kThreeConsumerMinCausalKeys;
  c.consumers = problem.head_dim == 64 && three && !c.fp8_cache ? 3 : 2;
  c.block_m = 64 * c.consumers;
  c.block_n = block_n_of(problem.head_dim, c.wide);
  // Split-KV runs in the run-time bounds kernels (their items already read their bounds).
  c.split.splits = split_parts(problem, c.params.pack_shift, c.block_m, c.block_n, c.mean_keys, sms);
  if (c.split.splits < 2) {
    if (c.dense_batch && !problem.causal && problem.num_splits == 0)
      plan_tail_split(problem, c.block_m, c.block_n, sms, &c.split);
  } else {
    c.split.rows_all = int64_t(problem.tensor_batch()) * problem.heads_q * problem.tensor_rows_q();
    c.split.bytes = size_t(c.split.splits) * size_t(c.split.rows_all) * (problem.head_dim + 1) * sizeof(float);
    c.dense = false;
  }
  // An FP8 KV cache has one kernel per head dim: the run-time bounds kernel (its tiles widen
  // the cache through the staging ring; Config::kFp8Cache).
  if (c.fp8_cache) c.dense = false;
  c.workspace_bytes = c.split.bytes;
  const int64_t items = work_items(problem.batch, c.params.pack_shift > 0 ? problem.heads_kv : problem.heads_q,
                                   problem.seqlen_q, c.block_m >> c.params.pack_shift);
  // Two consumers only (ItemSweep::kOrdered). Varlen never takes the tail split. A single
  // sequence has no lengths to balance. Taken from the counter (dynamic_order, kernels of
  // their own) at D = 128 and under the causal mask: on the mixed-lengths grid the causal
  // points took 0.76-0.96 of the snake's time with eight or more sequences (but 1.03 with four
  // at D = 256), D = 128 without a mask 0.97. Without a mask D = 256 took 1.03-1.06 from the
  // counter, so it keeps the sorted list in the snake's turns (0.84-1.00 of the unsorted one's
  // time), which under the causal mask took up to 1.39x (results/evidence/trials_0bf69c9/,
  // results/evidence/dynamic_work_list/).
  if (problem.is_varlen() && problem.batch > 1 && !c.window && c.consumers == 2 && c.split.splits < 2 &&
      items > sms && !(problem.causal && c.fp8_cache)) {
    c.sorted_order = true;
    c.dynamic_order = !c.fp8_cache && (problem.causal || problem.head_dim == 128);
    c.workspace_bytes = size_t(items + kOrderTrailer) * sizeof(int);
  }
  c.own_sweeps = c.consumers == 3 && !c.window && problem.causal &&
                 mean_keys_per_block(c.block_m >> c.params.pack_shift, problem.seqlen_q, problem.seqlen_k, true) <
                     kOwnSweepMaxKeys;
  plan_launch();
  if (c.sorted_order)  // the list as launched: by pair (or by rank), never split
    c.order = OrderPlan{c.launch.sched.total(), c.launch.sched.m_blocks, c.launch.sched.heads_q, c.block_m,
                        c.params.pack_shift, c.block_n, problem.causal, c.launch.sched.by_rank};
  return Status::Ok();
}

}  // namespace hattn::fwd
