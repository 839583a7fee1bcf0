#!/usr/bin/env python3
"""The production forward's persistent work order on the varlen-mixed grid, simulated on the CPU.

For each point of `python -m hattn.bench --varlen mixed` (its lengths: random.Random(S * 131 + D),
drawn from [S/4, 7S/4]), it plans as src/attention/plan.cpp and src/common/tile_scheduler.cuh
do (block shapes, the order by pair or by rank chosen on the longest length), then charges
every item its real cost in K/V tiles (+1 an item; 0.05 for an item past its sequence, which
reads its bounds and skips) and sums each CTA's items in the snake order. Printed beside the
measured ours/FA3 ratio of results/pybench_production_varlen_mixed.csv:
  today    the busiest CTA over the ideal (all CTAs equally loaded);
  dynamic  the same list, each item to the first CTA free (FA3's atomic counter);
  sorted   a static snake over the items sorted by their real cost, longest first (a list a
           small kernel could build from cu_seqlens before the attention kernel).
Usage: simulate.py results/pybench_production_varlen_mixed.csv
"""
import csv
import heapq
import math
import random
import statistics
import sys

SMS = 132
ITEM_COST, SKIP_COST = 1.0, 0.05


def position(rnd, c, g):  # TileScheduler::position
    return rnd * g + (c if rnd % 2 == 0 else g - 1 - c)


def causal_tiles(m, bm, bn, sq, sk):  # causal_kv_tiles
    last = min((m + 1) * bm, sq)
    return (max(0, min(last + sk - sq, sk)) + bn - 1) // bn


def point(d, lengths, causal):
    longest, heads = max(lengths), 2048 // d
    m_all = math.ceil(longest / 128)
    mean_keys = sum(causal_tiles(m, 128, 1, longest, longest) for m in range(m_all)) / m_all if causal else longest
    consumers = 3 if d == 64 and (not causal or mean_keys >= 1024) else 2  # plan.cpp
    bm = 64 * consumers
    wide = d != 64 and mean_keys >= (1024 if d == 256 else 8192)  # wide_tile_min_keys, not dense
    bn = {64: 128, 128: 176 if wide else 128, 256: 80 if wide else 64}[d]
    m_blocks, pairs = math.ceil(longest / bm), len(lengths) * heads
    total = m_blocks * pairs
    ctas = min(total, SMS)

    def item(w, by_rank):
        m, pair = (m_blocks - 1 - w // pairs, w % pairs) if by_rank else (w % m_blocks, w // m_blocks)
        return m, pair // heads

    def tiles(m, n):
        return causal_tiles(m, bm, bn, n, n) if causal else math.ceil(n / bn)

    def snake(costs):
        loads = [0.0] * ctas
        for c in range(ctas):
            rnd, w = 0, position(0, c, ctas)
            while w < len(costs):
                loads[c] += costs[w]
                rnd += 1
                w = position(rnd, c, ctas)
        return max(loads)

    by_rank = False
    if causal and m_blocks > 1 and total <= 1 << 14:  # make_tile_scheduler: the estimate on the longest length
        est = lambda r: snake([tiles(item(w, r)[0], longest) + ITEM_COST for w in range(total)])
        by_rank = est(True) * 100 < est(False) * 95
    real = [SKIP_COST if m * bm >= lengths[b] else tiles(m, lengths[b]) + ITEM_COST
            for m, b in (item(w, by_rank) for w in range(total))]
    ideal = sum(real) / ctas
    heap = [0.0] * ctas
    for cost in real:
        heapq.heappush(heap, heapq.heappop(heap) + cost)
    return snake(real) / ideal, max(heap) / ideal, snake(sorted(real, reverse=True)) / ideal


def main():
    measured = {(int(r["head_dim"]), r["causal"] == "True", int(r["seqlen_k"])): float(r["ratio"])
                for r in csv.DictReader(open(sys.argv[1])) if r["name"] == "fwd_sm90"}
    print(" D causal  B longest   today dynamic  sorted   measured ours/FA3")
    xs, ys = [], []
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            batch = max(1, 16384 // s)
            rng = random.Random(s * 131 + d)
            lengths = [rng.randint(max(1, s // 4), s * 7 // 4) for _ in range(batch)]
            for causal in (False, True):
                today, dynamic, by_cost = point(d, lengths, causal)
                m = measured[(d, causal, max(lengths))]
                xs.append(math.log(today))
                ys.append(math.log(m))
                print(f"{d:3} {str(causal):6} {batch:2} {max(lengths):7} {today:7.3f} {dynamic:7.3f} {by_cost:7.3f}   {m:.3f}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    corr = cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))
    print(f"correlation of log(today) with log(measured) over the 36 points: {corr:.2f}")


if __name__ == "__main__":
    main()
