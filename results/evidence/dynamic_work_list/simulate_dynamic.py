#!/usr/bin/env python3
"""The varlen forward's work list as e867e52 plans it, simulated on the CPU beside the snake's.

For each causal point of the mixed-lengths grid (the lengths of ../varlen_balance_sim/simulate.py,
whose plan and costs it reuses), the items inside their sequences are sorted as work_order.cuh
sorts them: by the pair's K/V tiles, most first, ties in order_item's order (each pair's blocks
from the last, or by rank where the host's estimate on the longest length picks the order by
rank); then each goes to the first CTA free (the counter). Printed: the busiest CTA over the
ideal, for the snake of 2cf3951 ("today") and for this list ("counter").
Usage: simulate_dynamic.py   (from this folder)
"""
import heapq
import math
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "varlen_balance_sim"))
import simulate as S  # noqa: E402


def counter(d, lengths):
    longest, heads = max(lengths), 2048 // d
    m_all = math.ceil(longest / 128)
    mean_keys = sum(S.causal_tiles(m, 128, 1, longest, longest) for m in range(m_all)) / m_all
    consumers = 3 if d == 64 and mean_keys >= 1024 else 2
    bm = 64 * consumers
    wide = d != 64 and mean_keys >= (1024 if d == 256 else 8192)
    bn = {64: 128, 128: 176 if wide else 128, 256: 80 if wide else 64}[d]
    m_blocks, pairs = math.ceil(longest / bm), len(lengths) * heads
    total, ctas0 = m_blocks * pairs, min(m_blocks * pairs, S.SMS)
    tiles = lambda m, n: S.causal_tiles(m, bm, bn, n, n)

    def snake(costs):
        loads = [0.0] * ctas0
        for c in range(ctas0):
            r, w = 0, S.position(0, c, ctas0)
            while w < len(costs):
                loads[c] += costs[w]
                r += 1
                w = S.position(r, c, ctas0)
        return max(loads)

    rank_item = lambda w: (m_blocks - 1 - w // pairs, w % pairs)
    by_rank = False
    if m_blocks > 1 and total <= 1 << 14:  # make_tile_scheduler's estimate on the longest length
        by_pair = snake([tiles(w % m_blocks, longest) + S.ITEM_COST for w in range(total)])
        by_rank = snake([tiles(rank_item(w)[0], longest) + S.ITEM_COST for w in range(total)]) * 100 < by_pair * 95
    items = []
    for v in range(total):  # order_item
        m, pair = rank_item(v) if by_rank else (m_blocks - 1 - v % m_blocks, v // m_blocks)
        n = lengths[pair // heads]
        if m * bm < n:
            items.append((math.ceil(n / bn), tiles(m, n) + S.ITEM_COST))
    items.sort(key=lambda x: -x[0])  # stable: ties keep order_item's order
    ctas = min(len(items), S.SMS)
    loads = [0.0] * ctas
    for _, cost in items:
        heapq.heappush(loads, heapq.heappop(loads) + cost)
    return max(loads) / (sum(c for _, c in items) / ctas), consumers


def main():
    print(" D  B longest  consumers   today counter")
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            batch = max(1, 16384 // s)
            rng = random.Random(s * 131 + d)
            lengths = [rng.randint(max(1, s // 4), s * 7 // 4) for _ in range(batch)]
            today = S.point(d, lengths, True)[0]
            load, consumers = counter(d, lengths)
            print(f"{d:3} {batch:2} {max(lengths):7} {consumers:10} {today:7.3f} {load:7.3f}")


if __name__ == "__main__":
    main()
