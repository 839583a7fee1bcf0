// Which (batch, head, query block) a persistent CTA computes next: the work order of the
// persistent kernels (11 onward).
//
// A persistent kernel launches G CTAs (one per SM) that share a list of work items. The list
// is cut into rounds of G items; in round k, CTA c takes item k G + c when k is even and
// k G + (G - 1 - c) when k is odd (a "snake"), so a CTA that got an expensive item in one
// round tends to get a cheap one in the next. Two orders of the list:
//   - by pair: query blocks fastest, then heads, then batches. The CTAs of a round work on
//     one or a few (batch, head) pairs and share their K/V in L2. Without a mask every item
//     costs the same and this order is always used.
//   - by rank (causal only): the highest query block of every pair, then the next highest,
//     ... Query block m reads about m + 1 K/V tiles, so the list runs longest first and the
//     cheap blocks fill in at the end. A round now spans up to G pairs, which costs L2 reuse
//     when the sequences are short and the pairs many.
// Under the causal mask the host estimates each CTA's load under both orders (the sum of its
// items' K/V tiles) and keeps the order by pair unless the order by rank finishes clearly
// sooner: with few pairs of many blocks, a round by pair holds one pair's blocks from the
// most to the least expensive and the snake cannot even that out.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>

#include "fast_divisor.cuh"

namespace hattn {

struct WorkItem {
  int m_block;  // query block index (rows m_block * kBlockM ...)
  int head_q;
  int batch;
};

struct TileScheduler {
  int m_blocks;   // query blocks per (batch, head)
  int heads_q;    // heads per batch
  int pairs;      // batch * heads_q
  bool by_rank;   // causal order: highest query blocks of all pairs first

  __host__ __device__ int total() const { return m_blocks * pairs; }

  // The list position of CTA c's `round`-th item among G CTAs (>= total(): no more work).
  __host__ __device__ static int position(int round, int c, int g) {
    return round * g + (round % 2 == 0 ? c : g - 1 - c);
  }
#ifdef __CUDACC__
  __device__ int position(int round) const { return position(round, int(blockIdx.x), int(gridDim.x)); }
#endif

  __host__ __device__ WorkItem item(int w) const {
    int m_block, pair;
    if (by_rank) {
      m_block = m_blocks - 1 - w / pairs;
      pair = w % pairs;
    } else {
      m_block = w % m_blocks;
      pair = w / m_blocks;
    }
    return {m_block, pair % heads_q, pair / heads_q};
  }
};

// A scheduler's item(w), its divisions done by FastDivisor: for a kernel that works out an
// item on its producer's critical path (the final kernel's first item). Built from the
// scheduler as launched.
struct FastItemOrder {
  FastDivisor m_blocks, pairs, heads_q;
  bool by_rank = false;

  FastItemOrder() = default;
  explicit FastItemOrder(const TileScheduler& s)
      : m_blocks(s.m_blocks), pairs(s.pairs), heads_q(s.heads_q), by_rank(s.by_rank) {}

  // The same item as TileScheduler::item(w), for 0 <= w < 2^31.
  __host__ __device__ WorkItem item(int w) const {
    int m_block, pair;
    if (by_rank) {
      const int rank = pairs.div(w);
      m_block = m_blocks.divisor - 1 - rank;
      pair = w - rank * pairs.divisor;
    } else {
      pair = m_blocks.div(w);
      m_block = w - pair * m_blocks.divisor;
    }
    const int batch = heads_q.div(pair);
    return {m_block, pair - batch * heads_q.divisor, batch};
  }
};

// The number of SMs of the current device (the persistent grid); 0 when the query fails.
inline int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller reports its own error
    return 0;
  }
  return count;
}

// K/V tiles of `block_n` keys that query block `m_block` (rows of `block_m`) reads under the
// causal mask: those up to the diagonal of its last row, 0 when no row sees a key. The host
// plans the work order with it and the persistent kernels size each item's sweep with it.
__host__ __device__ inline int causal_kv_tiles(int m_block, int block_m, int block_n, int seqlen_q, int seqlen_k) {
  const int last_row_end = (m_block + 1) * block_m < seqlen_q ? (m_block + 1) * block_m : seqlen_q;
  int n_end = last_row_end + seqlen_k - seqlen_q;  // keys up to the last row's diagonal
  n_end = n_end < seqlen_k ? n_end : seqlen_k;
  n_end = n_end > 0 ? n_end : 0;
  return (n_end + block_n - 1) / block_n;
}

// K/V tiles [first, last) of `block_n` keys that query block `m_block` (rows of `block_m`)
// reads under a mask whose edges lie window_left keys before and window_right keys after each
// row's diagonal (-1: that side open; causal is window_right = 0). Empty when no row of the
// block sees a key. The final kernel sizes each item's sweep with it.
struct KvTileRange {
  int first, last;
};
__host__ __device__ inline KvTileRange masked_kv_tiles(int m_block, int block_m, int block_n, int seqlen_q,
                                                       int seqlen_k, int window_left, int window_right) {
  const int64_t offset = int64_t(seqlen_k) - seqlen_q;
  const int64_t first_row = int64_t(m_block) * block_m;
  const int64_t last_row = ((m_block + 1) * int64_t(block_m) < seqlen_q ? (m_block + 1) * int64_t(block_m) : seqlen_q) - 1;
  int64_t lo = window_left >= 0 ? first_row + offset - window_left : 0;
  int64_t hi = window_right >= 0 ? last_row + offset + window_right + 1 : seqlen_k;
  lo = lo < 0 ? 0 : lo;
  hi = hi > seqlen_k ? seqlen_k : hi;
  if (hi <= lo) return {0, 0};
  return {int(lo / block_n), int((hi + block_n - 1) / block_n)};
}

// Mean number of keys a query block of `block_m` rows sweeps: Sk, or under the causal mask
// or a sliding window those between the edges of the block's first and last rows. 13 onward
// pick their tile shape by it.
inline double mean_keys_per_block(int block_m, int seqlen_q, int seqlen_k, bool causal, int window_left = -1,
                                  int window_right = -1) {
  const int right = causal ? 0 : window_right;
  if (window_left < 0 && right < 0) return seqlen_k;
  const int m_blocks = (seqlen_q + block_m - 1) / block_m;
  double keys = 0;
  for (int m_block = 0; m_block < m_blocks; ++m_block) {
    const KvTileRange r = masked_kv_tiles(m_block, block_m, 1, seqlen_q, seqlen_k, window_left, right);
    keys += r.last - r.first;
  }
  return keys / m_blocks;
}

// The busiest CTA's load (sum of tiles_of(m_block) + 1 per item) when `ctas` CTAs take the
// list of `s` in snake order.
template <typename TilesOf>
int64_t max_cta_load(const TileScheduler& s, int ctas, TilesOf tiles_of) {
  int64_t busiest = 0;
  for (int c = 0; c < ctas; ++c) {
    int64_t load = 0;
    for (int round = 0, w = TileScheduler::position(0, c, ctas); w < s.total();
         w = TileScheduler::position(++round, c, ctas))
      load += tiles_of(s.item(w).m_block) + 1;  // + 1: an item's fixed cost, about one tile
    busiest = std::max(busiest, load);
  }
  return busiest;
}

// The order for a problem run by `ctas` CTAs. tiles_of(m_block): K/V tiles that query block
// reads. The estimate walks the whole list twice; past kMaxItemsToEstimate items (a long
// run, where the host time would show) it keeps the order by pair.
template <typename TilesOf>
TileScheduler make_tile_scheduler(int batch, int heads_q, int seqlen_q, int block_m, bool causal, int ctas,
                                  TilesOf tiles_of) {
  constexpr int64_t kMaxItemsToEstimate = 1 << 14;
  TileScheduler s;
  s.m_blocks = (seqlen_q + block_m - 1) / block_m;
  s.heads_q = heads_q;
  s.pairs = batch * heads_q;
  s.by_rank = false;
  if (causal && s.m_blocks > 1 && int64_t(s.m_blocks) * s.pairs <= kMaxItemsToEstimate) {
    const int64_t by_pair = max_cta_load(s, ctas, tiles_of);
    TileScheduler r = s;
    r.by_rank = true;
    const int64_t by_rank = max_cta_load(r, ctas, tiles_of);
    s.by_rank = by_rank * 100 < by_pair * 95;  // clearly sooner: by more than 5%
  }
  return s;
}

// Work items of a persistent kernel: (batch, head, query block) triples. Positions in the
// snake order overshoot the list by up to one round, so the list must stay well inside an int.
inline int64_t work_items(int batch, int heads_q, int seqlen_q, int block_m) {
  return int64_t(batch) * heads_q * ((int64_t(seqlen_q) + block_m - 1) / block_m);
}
constexpr int64_t kMaxWorkItems = INT32_MAX / 2;

// A persistent launch: the grid (one CTA per SM, fewer when there are fewer items) and the
// work order, from the problem's sizes and the device's SM count.
struct PersistentLaunch {
  int ctas;
  TileScheduler sched;
};

// With a sliding window (the final kernel), the items' costs vary as under the causal mask,
// and the order is estimated the same way.
inline PersistentLaunch compute_persistent_launch(int batch, int heads_q, int seqlen_q, int seqlen_k, bool causal,
                                                  int block_m, int block_n, int sms, int window_left,
                                                  int window_right) {
  PersistentLaunch plan;
  plan.ctas = int(std::min<int64_t>(work_items(batch, heads_q, seqlen_q, block_m), sms));
  const int right = causal ? 0 : window_right;
  auto tiles_of = [&](int m_block) {  // the estimate runs only under a mask
    const KvTileRange r = masked_kv_tiles(m_block, block_m, block_n, seqlen_q, seqlen_k, window_left, right);
    return r.last - r.first;
  };
  plan.sched = make_tile_scheduler(batch, heads_q, seqlen_q, block_m, causal || window_left >= 0 || right >= 0,
                                   plan.ctas, tiles_of);
  return plan;
}

// The same, remembered: under a mask the estimate walks the work list twice, tens of us of
// host time a call at a few thousand items (results/evidence/plan_host_time/), and a model
// calls the same few shapes over and over. Each host thread keeps its last kPlansKept plans
// (no lock), keyed on every argument.
inline PersistentLaunch plan_persistent_launch(int batch, int heads_q, int seqlen_q, int seqlen_k, bool causal,
                                               int block_m, int block_n, int sms, int window_left = -1,
                                               int window_right = -1) {
  struct Kept {
    std::array<int, 10> key;
    PersistentLaunch plan;
  };
  constexpr int kPlansKept = 8;
  thread_local std::array<Kept, kPlansKept> kept{};
  thread_local int kept_count = 0, next_slot = 0;
  const std::array<int, 10> key{batch, heads_q, seqlen_q, seqlen_k, int(causal), block_m, block_n, sms, window_left,
                                window_right};
  for (int i = 0; i < kept_count; ++i)
    if (kept[i].key == key) return kept[i].plan;
  const PersistentLaunch plan = compute_persistent_launch(batch, heads_q, seqlen_q, seqlen_k, causal, block_m, block_n,
                                                          sms, window_left, window_right);
  kept[next_slot] = {key, plan};
  next_slot = (next_slot + 1) % kPlansKept;
  kept_count = std::min(kept_count + 1, kPlansKept);
  return plan;
}

}  // namespace hattn
