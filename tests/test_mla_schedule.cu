// MLA decoding's split-KV schedule (src/mla/schedule.cuh), run on the host: every key tile of
// every request is swept by exactly one run, every request (an empty one too) gets at least
// one segment, the slots of a request's parts are its own and distinct, and no run costs much
// more than an even share. No GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "mla/schedule.cuh"

namespace {

using hattn::mla::kRunInts;
using hattn::mla::Run;

struct Walk {
  std::vector<std::vector<int>> tile_runs;  // per request, per tile: how many runs swept it
  std::vector<int> segments;                // per request: the segments that touched it
  std::set<int> slots;                      // the partial-result slots of split requests
  int slot_errors = 0;
  int64_t max_run_cost = 0;                 // tiles + kSegmentCost per segment, the costliest run
};

Walk walk(const std::vector<int32_t>& lens, int parts) {
  const int batch = int(lens.size());
  std::vector<int32_t> schedule(size_t(hattn::mla::schedule_ints(batch, parts)), -7);
  hattn::mla::make_schedule(lens.data(), batch, parts, schedule.data());
  const int32_t* split_begin = schedule.data() + int64_t(parts) * kRunInts;
  Walk w;
  w.segments.assign(batch, 0);
  for (int b = 0; b < batch; ++b) w.tile_runs.emplace_back(size_t((std::max(lens[b], 0) + 63) / 64), 0);
  for (int p = 0; p < parts; ++p) {
    const int32_t* r = schedule.data() + int64_t(p) * kRunInts;
    const Run run{r[0], r[1], r[2], r[3], r[4]};
    int64_t cost = 0;
    for (int b = run.begin_batch; hattn::mla::run_covers(run, b); ++b) {
      EXPECT_LT(b, batch) << "run " << p << " walks past the batch";
      if (b >= batch) break;
      const auto seg = hattn::mla::segment_of(run, b, std::max(lens[b], 0));
      ++w.segments[b];
      for (int t = seg.lo; t < seg.hi; ++t) ++w.tile_runs[b][size_t(t)];
      cost += hattn::mla::kSegmentCost + (seg.hi - seg.lo);
      const int parts_of_b = split_begin[b + 1] - split_begin[b];
      if (seg.split < 0 || seg.split >= parts_of_b) ++w.slot_errors;
      if (parts_of_b > 1 && !w.slots.insert(split_begin[b] + seg.split).second) ++w.slot_errors;
    }
    w.max_run_cost = std::max(w.max_run_cost, cost);
  }
  for (int b = 0; b < batch; ++b)
    EXPECT_EQ(w.segments[b], split_begin[b + 1] - split_begin[b]) << "request " << b << "'s parts";
  EXPECT_LE(split_begin[batch], batch + parts) << "slots beyond mla_workspace_size()'s bound";
  return w;
}

void expect_each_tile_once(const Walk& w, const std::vector<int32_t>& lens) {
  for (size_t b = 0; b < lens.size(); ++b) {
    EXPECT_GE(w.segments[b], 1) << "request " << b << " (" << lens[b] << " keys) has no segment: its out is never written";
    for (size_t t = 0; t < w.tile_runs[b].size(); ++t)
      ASSERT_EQ(w.tile_runs[b][t], 1) << "request " << b << " tile " << t << " swept " << w.tile_runs[b][t] << " times";
  }
  EXPECT_EQ(w.slot_errors, 0);
}

// No run is longer than an even share of the work (tiles + a segment per request) by more
// than one segment: the split adds at most a segment per run.
void expect_balanced(const Walk& w, const std::vector<int32_t>& lens, int parts) {
  constexpr int64_t kSeg = hattn::mla::kSegmentCost;
  int64_t work = 0;
  for (int32_t n : lens) work += (std::max(n, 0) + 63) / 64 + kSeg;
  const int64_t bound = std::max(kSeg + 1, (work + parts - 1) / parts + kSeg);
  EXPECT_LE(w.max_run_cost, bound) << "the costliest run of " << parts;
}

TEST(MlaSchedule, OneLongRequestIsSplitAcrossTheRuns) {
  const std::vector<int32_t> lens{65536};
  const Walk w = walk(lens, 132);
  expect_each_tile_once(w, lens);
  EXPECT_GT(w.segments[0], 100);
  expect_balanced(w, lens, 132);
  // The first measurement's case: 512 tiles over 132 runs (each run had taken one tile, the
  // last 381).
  const std::vector<int32_t> one{32768};
  expect_balanced(walk(one, 132), one, 132);
}

TEST(MlaSchedule, ManyEqualRequestsGetAboutARunEach) {
  for (int keys : {1024, 4096, 32768}) {
    const std::vector<int32_t> lens(128, keys);
    for (int parts : {33, 66, 132}) expect_balanced(walk(lens, parts), lens, parts);
  }
}

TEST(MlaSchedule, EmptyAndNegativeLengthsStillGetASegment) {
  const std::vector<int32_t> lens{0, -5, 1, 0, 64, 65, 0};
  for (int parts : {1, 2, 7, 132}) expect_each_tile_once(walk(lens, parts), lens);
}

TEST(MlaSchedule, RandomBatchesCoverEveryTileOnce) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 400; ++trial) {
    const int batch = 1 + int(rng() % 300);
    const int parts = 1 + int(rng() % 200);
    std::vector<int32_t> lens(static_cast<size_t>(batch));
    for (auto& n : lens) {
      const int pick = int(rng() % 10);
      n = pick == 0 ? 0 : pick == 1 ? int32_t(rng() % 130) : int32_t(rng() % (pick < 9 ? 9000 : 70000));
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ": batch " + std::to_string(batch) + ", parts " +
                 std::to_string(parts));
    const Walk w = walk(lens, parts);
    expect_each_tile_once(w, lens);
    expect_balanced(w, lens, parts);
  }
}

}  // namespace
