"""Decoding's occasional slow state from Python: the tensors' placement, the GPU, or the host?

Run 1 (before the Timer's head start): each trial allocated fresh q, k, v (after a padding
tensor of a random size, so the addresses moved) and timed hattn and SDPA cuDNN on the first
trial's tensors and on the fresh ones; both flipped together, so placement is not the cause.
Run 2 (--head-start): each trial times hattn and SDPA cuDNN (BSHD) on fresh tensors with the
benchmark's Timer twice, without and with the GPU's head start (Timer(head_start=...)), and
the host's time to queue one hattn call (20 calls back to back, no flush).

    python3 alloc_probe.py [--dim 128] [--batch 4] [--seqlen-k 4096] [--trials 12] [--head-start]
"""

import argparse
import random
import time

import torch


def main() -> None:
    import hattn
    from hattn.bench import Timer, anchor_fn

    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen-k", type=int, default=4096)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--head-start", action="store_true")
    a = p.parse_args()
    heads = 2048 // a.dim
    rng = random.Random(0)
    keep = []

    def inputs():
        keep.append(torch.empty(rng.randrange(1, 64) << 20, dtype=torch.uint8, device="cuda"))
        q = torch.randn(a.batch, 1, heads, a.dim, device="cuda", dtype=torch.bfloat16) + 0.5
        k, v = (torch.randn(a.batch, a.seqlen_k, heads, a.dim, device="cuda", dtype=torch.bfloat16) + 0.5
                for _ in range(2))
        keep.append((q, k, v))
        return q, k, v

    def fns(q, k, v):
        return [lambda: hattn.attention(q, k, v), anchor_fn("sdpa_cudnn_bshd", q, k, v, False, None)]

    def host_us(q, k, v) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            hattn.attention(q, k, v)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / 20 * 1e6

    print(f"D={a.dim} B={a.batch} Sk={a.seqlen_k} H={heads}; us")
    if not a.head_start:
        timer = Timer(256, 5, 30, 2.0, head_start=False)
        fixed = inputs()
        for t in range(a.trials):
            fresh = inputs()
            us = [f"{ms * 1e3:7.1f}" for ms, _ in timer.interleaved(fns(*fixed) + fns(*fresh))]
            print(f"trial {t:2d}  k at {fresh[1].data_ptr():#014x}  hattn, cuDNN: fixed {us[0]} {us[1]}  "
                  f"fresh {us[2]} {us[3]}", flush=True)
        return
    plain, ahead = Timer(256, 5, 30, 2.0, head_start=False), Timer(256, 5, 30, 2.0, head_start=True)
    for t in range(a.trials):
        x = inputs()
        u = [f"{ms * 1e3:7.1f}" for ms, _ in plain.interleaved(fns(*x))]
        w = [f"{ms * 1e3:7.1f}" for ms, _ in ahead.interleaved(fns(*x))]
        print(f"trial {t:2d}  hattn, cuDNN: no head start {u[0]} {u[1]}  head start {w[0]} {w[1]}  "
              f"host per hattn call {host_us(*x):6.1f}", flush=True)


if __name__ == "__main__":
    main()
