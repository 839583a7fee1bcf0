// One-off check at 8173581: the production forward's host plan (src/attention/plan.cpp) against
// step 16's own host code (its anonymous namespace, included whole), on 200,000 random problems.
// Build (repo root): nvcc -std=c++20 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
//   -Iinclude -Isrc -Isrc/kernels results/evidence/production_forward/plan_equiv.cu
//   src/attention/plan.cpp build/libhattn.a -lcuda -o plan_equiv && ./plan_equiv
// Output then: "checked 200000, mismatches 0".
#include "../../../src/kernels/16_coalesced_store.cu"
#include "../../../src/attention/plan.h"
#include <random>
#include <cstdio>
using namespace hattn;
int main() {
  std::mt19937 rng(1);
  auto pick = [&](int a, int b) { return std::uniform_int_distribution<int>(a, b)(rng); };
  int checked = 0, bad = 0;
  for (int it = 0; it < 200000; ++it) {
    AttentionProblem p;
    p.dtype = pick(0, 5) == 0 ? DType::e4m3 : DType::bf16;
    const int dims[3] = {64, 128, 256};
    p.head_dim = dims[pick(0, 2)];
    if (p.dtype == DType::e4m3 && p.head_dim == 256) p.head_dim = 128;
    p.batch = pick(1, 40);
    p.seqlen_q = pick(0, 3) == 0 ? pick(1, 8) : pick(1, 20000);
    p.seqlen_k = pick(1, 40000);
    p.heads_kv = pick(1, 16);
    p.heads_q = p.heads_kv * (1 << pick(0, 4)) * (pick(0, 4) == 0 ? 3 : 1);
    p.causal = pick(0, 1);
    if (p.dtype != DType::e4m3 && pick(0, 4) == 0) { p.window_left = pick(-1, 3000); p.window_right = p.causal ? pick(-1, 0) : pick(-1, 3000); }
    if (p.dtype != DType::e4m3 && pick(0, 4) == 0) { p.seqlens_k = (const int32_t*)0x1000; }
    if (p.dtype != DType::e4m3 && pick(0, 6) == 0) { p.seqlens_k = (const int32_t*)0x1000; p.block_table = (const int32_t*)0x2000; p.page_size = 256; p.max_pages_per_seq = 200; p.num_pages = 1000; }
    if (p.dtype != DType::e4m3 && pick(0, 6) == 0) { p.cu_seqlens_q = (const int32_t*)0x3000; p.cu_seqlens_k = (const int32_t*)0x4000; p.total_q = p.seqlen_q * 2; p.total_k = p.seqlen_k * 2; }
    if (p.dtype != DType::e4m3 && pick(0, 6) == 0) p.softcap = 30.f;
    if (pick(0, 5) == 0) p.num_splits = pick(0, 10);
    if (pick(0, 5) == 0) p.pack_gqa = pick(0, 1) == 1;
    const int sms = pick(0, 3) == 0 ? pick(1, 200) : 132;
    // old
    TileChoice c; c.params = make_params(p);
    c.window = c.params.window_left >= 0 || (!p.causal && c.params.window_right >= 0);
    c.params.pack_shift = c.window ? 0 : pack_gqa_shift(p);
    c.mean_keys = mean_keys_per_block(128 >> c.params.pack_shift, p.seqlen_q, p.seqlen_k, p.causal, c.params.window_left, c.params.window_right);
    c.dense_batch = !c.window && !p.has_sequence_bounds() && c.params.pack_shift == 0 && p.softcap == 0.f;
    c.dense = c.dense_batch;
    c.wide = !p.is_paged() && c.mean_keys >= wide_tile_min_keys(p.head_dim, c.dense);
    if (p.head_dim == 64 && !c.window && p.dtype != DType::e4m3 && (int64_t(p.seqlen_q) << c.params.pack_shift) <= 64) c.dense = false;
    c.three = !(p.causal || c.window) || c.mean_keys >= kThreeConsumerMinCausalKeys;
    c.sms = sms;
    fwd::ForwardPlan n;
    if (!fwd::make_plan(p, sms, &n).ok()) { printf("plan failed\n"); return 1; }
    ++checked;
    bool ok = true;
    if (p.dtype == DType::e4m3) {
      ok = n.fp8 && n.params.pack_shift == 0 && n.dense && !n.window && n.block_n == 128 && n.consumers == 2 && n.split.splits == 1 && n.split.tail_parts == 1 && n.workspace_bytes == vt_bytes(p);
    } else {
      int bm, bn, consumers; bool wide;
      if (p.head_dim == 64) { consumers = c.three ? 3 : 2; bm = 64 * consumers; bn = 128; wide = false; }
      else { consumers = 2; bm = 128; wide = c.wide; bn = p.head_dim == 128 ? (wide ? 176 : 128) : (wide ? 80 : 64); }
      SplitPlan s = split_plan(p, c, bm, bn);
      const int variant = c.window ? 2 : (!c.dense || s.splits > 1) ? 1 : 0;
      const int nvariant = n.window ? 2 : !n.dense ? 1 : 0;
      const bool own = consumers == 3 && !c.window && p.causal && mean_keys_per_block(bm >> c.params.pack_shift, p.seqlen_q, p.seqlen_k, true) < kOwnSweepMaxKeys;
      ok = n.consumers == consumers && n.block_m == bm && n.block_n == bn && (p.head_dim == 64 || n.wide == wide) && variant == nvariant &&
           s.splits == n.split.splits && s.rows_all == n.split.rows_all && s.tail_start == n.split.tail_start && s.tail_parts == n.split.tail_parts &&
           s.bytes == n.split.bytes && n.workspace_bytes == s.bytes && own == n.own_sweeps && n.params.pack_shift == c.params.pack_shift &&
           n.params.window_left == c.params.window_left && n.params.window_right == c.params.window_right;
    }
    if (!ok && bad++ < 10) printf("mismatch at it %d: D=%d B=%d Sq=%d Sk=%d Hq=%d Hkv=%d causal=%d\n", it, p.head_dim, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.causal);
  }
  printf("checked %d, mismatches %d\n", checked, bad);
  return bad != 0;
}
