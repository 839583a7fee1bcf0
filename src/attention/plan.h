// The production forward's host plan: every decision made from the problem's shape before a
// kernel is launched (tile shape, consumers, kernel variant, GQA packing, split-KV parts, the
// tail split, own sweeps, workspace), as plain functions of the problem and the SM count, so
// that CPU tests can check them (tests/test_forward_plan.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/params.h"
#include "../common/tile_scheduler.cuh"
#include "config.h"
#include "hattn/hattn.h"
#include "work_order.h"

namespace hattn::fwd {

// Sweeps at least this long (mean keys per query block) take the wide tiles at D = 128 and
// 256, as in lineage step 13 (chapter 13 has the measurements). At D = 128 the dense problems
// take them from 4096 keys: with 16-byte O stores they gained 2.5% without a mask at S = 4k
// and 3% causal at S = 8k (results/evidence/tail_rounds_wide_a71743b/). Problems with a
// window, sequence bounds or GQA packing keep 13's 8192, where they were measured.
constexpr double wide_tile_min_keys(int head_dim, bool dense) {
  return head_dim == 256 ? 1024 : head_dim == 128 && dense ? 4096 : 8192;
}

// At D = 64 three consumers run unless the sweep is causal and short: measured on the H200
// (results/evidence/bench_x16_three_consumers_d64.log), they win by 2-23% without a mask at
// every S and with it from S = 2k (mean 1,088 keys per block), and lose 10-13% at causal
// S = 512 and 1k. Softcapped problems follow the same rule: 1.05-1.09x from S = 4k, 0.97x
// without a mask at S = 1k (results/evidence/softcap/run5/).
constexpr double kThreeConsumerMinCausalKeys = 1024;

// Three consumers on causal sweeps shorter than this (mean keys per block) each sweep only
// the tiles their own rows see (Consumer::kOwnSweeps). On the H200 at D = 64, on every
// causal sweep, that ran 1.048x at S = 2k and 1.022x at 4k, and 0.983x at 8k and 16k; below
// this, 1.04x at 2k and 1.01x at 4k, level elsewhere (results/evidence/wg_sweep/).
constexpr double kOwnSweepMaxKeys = 4096;

// K/V tiles each split-KV part (or tail part) sweeps at least, when the parts are automatic.
constexpr int kMinTilesPerSplit = 4;

// Pages of a paged cache hold a whole number of the K/V tiles paged problems run with (128
// keys, 64 at D = 256; paged problems never take the wide tiles).
constexpr int kPageMultiple = 128;

// The split plan of a problem: split-KV's parts (run-time bounds kernels), or the tail split
// (the others), and the size of their partial results.
struct SplitPlan {
  int splits = 1;        // split-KV parts; 1: unsplit
  int64_t rows_all = 0;  // rows of split-KV's partial layout, [B][Hq][rows]
  int tail_start = 0;    // tail split: the first cut item and the parts of each (1: none cut)
  int tail_parts = 1;
  size_t bytes = 0;      // workspace: fp32 partial outputs, then fp32 partial LSEs
};

// Everything launch() runs a problem with.
struct ForwardPlan {
  FeatureParams params{};  // the window's edges, normalized; varlen offsets; GQA packing
  int sms = 0;               // the persistent grid's bound
  double mean_keys = 0;      // keys per 128-row query block, on average
  bool fp8 = false;          // e4m3 inputs: one shape per head dim, dense kernel
  bool fp8_cache = false;    // an e4m3 KV cache: the run-time bounds kernel, narrow tiles, two consumers
  bool wide = false;         // the wide K/V tiles (D = 128, 256)
  bool window = false;       // the window's kernels (a window edge binds beyond causal)
  // No window, sequence bounds, GQA packing or softcap: every item sweeps all keys of its
  // sequence, so the tail split may cut the last round.
  bool dense_batch = false;
  // The kernels without run-time bounds: a dense batch, not decoding at D = 64, not split-KV.
  bool dense = false;
  int consumers = 2;         // consumer warpgroups: 3 at D = 64 unless causal and short
  int block_m = 128, block_n = 128;
  SplitPlan split;
  bool own_sweeps = false;   // three consumers on short causal sweeps sweep their own keys
  // A variable-length batch of several sequences and more than one round of items, unsplit,
  // no window: the work list sorted by cost (work_order.cuh), one int an item (and
  // kOrderTrailer) in the workspace.
  bool sorted_order = false;
  // The CTAs take the sorted list's items from a counter as they finish (WorkList::next_item,
  // the kernels of Config::kDynamic), not in the snake's turns: D = 128, or causal. Not with an
  // FP8 KV cache, whose widening warps walk the list too.
  bool dynamic_order = false;
  size_t workspace_bytes = 0;  // split partials, FP8's V^T, or the sorted order
  // The persistent grid and the work order by pair or by rank (tile_scheduler.cuh), as the
  // problem's items are planned; the launch then numbers split-KV's parts inside the blocks,
  // or hands a sorted list positions of the order by pair.
  PersistentLaunch launch{};
  // With sorted_order: what order_items_kernel needs of this plan (work_order.h).
  OrderPlan order{};
};

// log2 of the query heads per K/V head when a work item takes all of them as rows (GQA
// packing), else 0.
int pack_gqa_shift(const AttentionProblem& problem);

// Split-KV parts for the tiles (block_m x block_n) and the mean sweep: num_splits, or automatic.
int split_parts(const AttentionProblem& problem, int pack_shift, int block_m, int block_n, double mean_keys, int sms);

// The tail split of a dense batch without a mask (writes tail_start, tail_parts, bytes).
void plan_tail_split(const AttentionProblem& problem, int block_m, int block_n, int sms, SplitPlan* plan);

// The whole plan of a validated problem the forward supports, on a GPU with `sms` SMs.
Status make_plan(const AttentionProblem& problem, int sms, ForwardPlan* plan);

// plan->params made again from `problem` (its addresses, strides and scale), keeping the plan's
// GQA packing: a plan's decisions hold for every call of its shape (hattn::run()), and for the
// sign-flipped copy of q a negative scale runs on.
void bind_params(const AttentionProblem& problem, ForwardPlan* plan);

}  // namespace hattn::fwd
