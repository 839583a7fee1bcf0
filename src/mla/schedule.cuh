// MLA decoding's split-KV schedule: which CTA sweeps which keys of which requests.
//
// The key tiles of all requests, in request order, are cut into `parts` runs of about equal
// cost (a tile costs 1, and each request a run touches kSegmentCost more: loading Q, the
// epilogue). A run may start or end inside a request; such a request is split, and its parts
// meet in the combine kernel. Made on the GPU from cache_seqlens, so a decoding step under a
// CUDA graph needs no host sync; one schedule serves every layer of the step.
#pragma once

#include <cstdint>

namespace hattn::mla {

constexpr int kBlockM = 64;  // query rows (heads x new tokens) per CTA
constexpr int kBlockN = 64;  // keys per tile: one 64-row box of a page
constexpr int kSegmentCost = 5;  // a request's fixed cost in tiles

// The schedule's int32 layout: `parts` runs of kRunInts, then the first split slot of each
// request (batch + 1 prefix sums: request b's parts are slots split_begin[b] ..
// split_begin[b + 1] - 1 of the partial results).
constexpr int kRunInts = 8;
struct Run {
  int begin_batch, begin_tile;  // the first key tile swept
  int end_batch, end_tile;      // one past the last: (end_batch, end_tile), end_tile 0 at a request boundary
  int begin_split;              // the slot index within begin_batch's parts of its first segment
};

inline int64_t schedule_ints(int batch, int parts) { return int64_t(parts) * kRunInts + batch + 1; }

// Key tiles of request b. Lengths past the cache's pages are not clamped here (the schedule
// does not know the cache): the kernel clamps each segment to the request's pages.
__host__ __device__ __forceinline__ int request_tiles(const int32_t* cache_seqlens, int b) {
  const int64_t keys = cache_seqlens[b] > 0 ? cache_seqlens[b] : 0;
  return int((keys + kBlockN - 1) / kBlockN);
}

// The requests a run touches: b from begin_batch while this is true.
__host__ __device__ __forceinline__ bool run_covers(const Run& run, int b) {
  return b < run.end_batch || (b == run.end_batch && run.end_tile > 0);
}

// A run's share of request b (of `keys` keys, already clamped to its pages): key tiles lo ..
// hi - 1, and its slot among the request's parts.
struct Segment {
  int keys, lo, hi, split;
};
__host__ __device__ __forceinline__ Segment segment_of(const Run& run, int b, int keys) {
  const int tiles = (keys + kBlockN - 1) / kBlockN;
  const int hi = b == run.end_batch ? (run.end_tile < tiles ? run.end_tile : tiles) : tiles;
  const int lo = b == run.begin_batch ? (run.begin_tile < hi ? run.begin_tile : hi) : 0;
  return {keys, lo, hi, b == run.begin_batch ? run.begin_split : 0};
}

// One thread walks the requests (a decoding batch is at most a few thousand): two passes, the
// total cost, then the cut. The host runs it too (tests/test_mla_schedule.cu).
__host__ __device__ inline void make_schedule(const int32_t* cache_seqlens, int batch, int parts, int32_t* schedule) {
  int64_t total = 0;
  for (int b = 0; b < batch; ++b) total += request_tiles(cache_seqlens, b) + kSegmentCost;
  // Every run but the last ends either by cutting a request (one more segment) or by leaving
  // less than a segment's cost of its budget unused: kSegmentCost a run at most. The quota pays
  // for that, so the runs before the last take all the work and the last is no longer than
  // the others (without it, one long request gave each run a single tile and the last the rest).
  total += int64_t(kSegmentCost) * parts;
  // Each run can afford one segment and a tile, so every run makes progress.
  const int64_t even = (total + parts - 1) / parts;
  const int64_t quota = even > kSegmentCost + 1 ? even : int64_t(kSegmentCost + 1);
  int32_t* split_begin = schedule + int64_t(parts) * kRunInts;
  int b = 0, tile = 0;       // where the next run starts
  int splits_of_b = 0;       // segments of request b so far
  int slot = 0;              // slots handed out to requests before b
  int b_tiles = batch > 0 ? request_tiles(cache_seqlens, 0) : 0;
  for (int p = 0; p < parts; ++p) {
    int32_t* run = schedule + int64_t(p) * kRunInts;
    run[0] = b, run[1] = tile, run[4] = splits_of_b;
    int64_t budget = quota;
    while (b < batch) {
      const int64_t cost = kSegmentCost + (b_tiles - tile);
      if (p == parts - 1 || cost <= budget) {  // the rest of request b: its last segment
        budget -= cost;
        split_begin[b] = slot;
        slot += splits_of_b + 1;
        splits_of_b = 0;
        tile = 0;
        if (++b < batch) b_tiles = request_tiles(cache_seqlens, b);
        continue;
      }
      const int64_t take = budget - kSegmentCost;  // a segment that stops inside request b
      if (take >= 1) {
        tile += int(take);
        ++splits_of_b;
      }
      break;
    }
    run[2] = b, run[3] = tile;
    run[5] = run[6] = run[7] = 0;
  }
  split_begin[batch] = slot;
}

}  // namespace hattn::mla
