"""One forward of hattn and one of FlashAttention-3 on the same tensors, inside a profiler range,
for ncu to compare (the guide's "where the time goes"); with --backward, one backward of each.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats ... \
        python3 tools/ncu_vs_fa3.py --fa3 .anchors/flash_attn_3_sm90.so --dim 128 --seqlen 4096 --causal

Both are warmed up outside the range, so ncu sees each library's launches of one call (ours: the
forward kernel and any planning kernel it launches; FA3: its kernel and its scheduler's). The
shape is the benchmark grid's: batch = tokens / seqlen, 16 heads of D=128 (2048 / D heads
otherwise), bf16. Without ncu it times both (CUDA events, median of --reps) as a sanity check.

With --backward each side's backward runs on its own forward's out and LSE: ours is the
backward kernel "auto" alone through hattn._C (hattn.bench_backward's kernel_backward_fn: the
fp32 sums' zeroing, delta, the kernel and dQ's conversion), FA3's its bwd op.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hattn
from hattn import fa3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    fa3.add_argument(p)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default: 16384)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true", help="profile the backward instead of the forward")
    p.add_argument("--reps", type=int, default=20, help="timed calls of each outside the range")
    args = p.parse_args()
    fa3.check_argument(p, args)
    if fa3.load_for("ncu_vs_fa3", args.fa3):
        p.error("give FlashAttention-3's library: " + fa3.NOT_GIVEN)

    batch, heads = max(1, args.tokens // args.seqlen), 2048 // args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    if args.backward:
        from hattn.bench_backward import kernel_backward_fn

        dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
        out_fa3, lse_fa3 = fa3.forward(q, k, v, causal=args.causal)
        calls = {
            "hattn": kernel_backward_fn("auto", q, k, v, dout, args.causal),
            "fa3": lambda: fa3.backward(dout, q, k, v, out_fa3, lse_fa3, args.causal),
        }
        outs = {name: torch.cat([t.flatten() for t in call()]) for name, call in calls.items()}  # dq, dk, dv
    else:
        calls = {
            "hattn": lambda: hattn.attention(q, k, v, causal=args.causal),
            "fa3": lambda: fa3.forward(q, k, v, causal=args.causal)[0],
        }
        outs = {name: call() for name, call in calls.items()}
    diff = (outs["hattn"].float() - outs["fa3"].float()).abs().max().item()
    # The backward's five products against the forward's two.
    flops = (10 if args.backward else 4) * batch * heads * args.seqlen * args.seqlen * args.dim / (2 if args.causal else 1)
    for name, call in calls.items():
        times = []
        for _ in range(args.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        ms = statistics.median(times)
        print(f"{name:6s} D={args.dim} S={args.seqlen} B={batch} H={heads} causal={args.causal}: "
              f"{ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s")  # fmt: skip
    print(f"max |hattn - fa3| = {diff:.2e}")

    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls.values():  # ncu profiles these launches only
        call()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
