"""The causal backward's grid dispatched greedily over 132 SMs (each CTA to the SM that frees
first, in launch order): the end of the last CTA in the grid's order (head by head) and in the
grouped order of src/attention/backward/work.cuh (pairs by groups of 128 // key blocks, key
block 0 of each first). A CTA costs its query blocks plus `--overhead` (its K/V load and
epilogue, in steps). A model only: it leaves out L2 and the dQ adds.

    python3 simulate.py [--overhead 3]
"""

import argparse
import heapq


def makespan(costs, sms=132):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--overhead", type=float, default=3.0)
    args = p.parse_args()
    print("D rows | S | pairs | key blocks | group | grouped / grid order")
    for rows in (128, 64):  # query rows a step: D = 64, D = 128
        for s, pairs in ((1024, 256), (2048, 128), (4096, 64), (8192, 32), (16384, 16), (4096, 16), (2048, 32)):
            blocks = (s + 127) // 128
            cost = [(s - 128 * n + rows - 1) // rows + args.overhead for n in range(blocks)]
            grid = [cost[n] for _ in range(pairs) for n in range(blocks)]
            group = max(1, 128 // blocks)
            grouped = [cost[n] for g in range(0, pairs, group) for n in range(blocks)
                       for _ in range(g, min(pairs, g + group))]
            print(f"{rows} | {s} | {pairs} | {blocks} | {group} | {makespan(grouped) / makespan(grid):.3f}")


if __name__ == "__main__":
    main()
