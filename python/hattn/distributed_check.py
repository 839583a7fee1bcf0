"""Check and time hattn.distributed on several GPUs, one process per GPU:

    torchrun --nproc-per-node 8 -m hattn.distributed_check                 # correctness (default)
    torchrun --nproc-per-node 8 -m hattn.distributed_check --mode bench    # step times
    torchrun --nproc-per-node 8 python/hattn/distributed_check.py --ulysses-size 2 --seqlen 8192

check: every strategy (Ulysses, ring zigzag causal, ring contiguous, usp U x R) on full bf16
tensors made alike on every rank, sharded, run forward and backward with hattn's kernels,
gathered and unsharded, against one-GPU hattn.attention on the full tensors. Both are measured
against fp64 attention; the distributed error may be at most twice the one-GPU error plus the
roundings it adds (out: each block's bf16 partial output, one half-ulp; dq/dk/dv: each rank's bf16
partial gradient before the fp32 sum, up to W half-ulps). Rank 0 prints one row per tensor; the
exit status is 1 on any mismatch, on every rank.

bench: forward and forward+backward step times (CUDA events, median over --reps after --warmup,
the slowest rank's) for a Wan-2.1-14B-720p-like shape (75,600 tokens, 40 heads, D 128, no mask)
and a long causal GQA prefill (131,072 tokens, 32 query heads, 8 K/V heads, D 128), with one-GPU
hattn.attention on the whole problem beside them (rank 0; --no-single skips it). The numbers are
this run's; nothing in the docs quotes them. --csv writes them.

Needs one Hopper GPU per process and NCCL (gloo with --backend gloo: correctness only, slow).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import hattn
from hattn import distributed as hd

# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("check", "bench"), default="check")
    p.add_argument("--backend", default="nccl")
    p.add_argument("--ulysses-size", type=int, default=0,
                   help="U of usp's U x R (default: 2 when the world is even and >= 4, else no usp)")  # fmt: skip
    p.add_argument("--seqlen", type=int, default=4096, help="check: the full sequence (a multiple of 2 * world)")
    p.add_argument("--heads", type=int, default=16, help="check: query heads (a multiple of the world for Ulysses)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-single", action="store_true", help="bench: skip one-GPU attention on the whole problem")
    p.add_argument("--csv", default="", help="bench: also write the rows to this CSV (rank 0)")
    return p.parse_args(argv)


def _init(backend: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5),
                            device_id=device if backend == "nccl" else None)  # fmt: skip
    return device


def _usp_size(args, world: int) -> Optional[Tuple[int, int]]:
    """(U, R) of the usp runs, or None."""
    u = args.ulysses_size or (2 if world >= 4 and world % 2 == 0 else 0)
    if u < 2 or world % u or world // u < 2:
        return None
    return u, world // u


def _say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def _attention_fp64(q, k, v, causal, window, softcap):
    """(out, lse) in fp64 on q's device: the reference (bottom-right causal, window, softcap, GQA)."""
    sq, sk, hq, hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    vh = v.double().transpose(1, 2).repeat_interleave(hq // hkv, 1)
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return (p @ vh).transpose(1, 2), lse


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    out.backward(dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _gather_unshard(x: torch.Tensor, dim: int, layout: str, usp: Tuple[int, int]) -> torch.Tensor:
    """The full tensor from every rank's shard (global rank = ring rank * U + Ulysses rank)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return hd.usp_unshard(parts, usp[0], usp[1], layout, dim)


def _check(args, device) -> bool:
    world, rank = dist.get_world_size(), dist.get_rank()
    usp = _usp_size(args, world)
    usp_groups = hd.make_usp_groups(*usp) if usp else None
    seqlen, heads, dim = args.seqlen, args.heads, 128
    # name, strategy, layout, causal, Hkv, window, softcap
    configs = [
        ("ulysses", "ulysses", "contiguous", False, heads, (-1, -1), 0.0),
        ("ulysses causal gqa", "ulysses", "contiguous", True, max(heads // 4, 1), (-1, -1), 0.0),
        ("ulysses window softcap", "ulysses", "contiguous", True, heads, (seqlen // 8, 0), 30.0),
        ("ring zigzag causal", "ring", "zigzag", True, heads, (-1, -1), 0.0),
        ("ring zigzag causal gqa softcap", "ring", "zigzag", True, max(heads // 4, 1), (-1, -1), 30.0),
        ("ring contiguous", "ring", "contiguous", False, max(heads // 4, 1), (-1, -1), 0.0),
        ("ring contiguous causal", "ring", "contiguous", True, heads, (-1, -1), 0.0),
    ]
    if usp:
        configs += [
            (f"usp {usp[0]}x{usp[1]} zigzag causal gqa", "usp", "zigzag", True, max(heads // 4, 1), (-1, -1), 0.0),
            (f"usp {usp[0]}x{usp[1]} contiguous", "usp", "contiguous", False, heads, (-1, -1), 0.0),
        ]
    eps = torch.finfo(torch.bfloat16).eps
    ok = True
    _say(f"hattn.distributed check: world {world}, B {args.batch}, S {seqlen}, Hq {heads}, D {dim}, bf16")
    _say(f"{'config':34} {'tensor':6} {'dist err':>10} {'1-GPU err':>10} {'bound':>10}  result")
    for name, strategy, layout, causal, heads_kv, window, softcap in configs:
        if strategy == "ulysses" and (heads % world or (heads_kv % world and world % heads_kv)):
            _say(f"{name:34} skipped: heads {heads}/{heads_kv} do not split over {world} ranks")
            continue
        gen = torch.Generator().manual_seed(len(name))  # alike on every rank

        def rand(h, mean=0.5):
            return (torch.randn(args.batch, seqlen, h, dim, generator=gen) + mean).to(device, torch.bfloat16)

        q, k, v, dout = rand(heads), rand(heads_kv), rand(heads_kv), rand(heads, 0.0)
        want = _grads(lambda a, b, c: _attention_fp64(a, b, c, causal, window, softcap),
                      q.double(), k.double(), v.double(), dout.double())  # fmt: skip
        single = _grads(lambda a, b, c: hattn.attention(a, b, c, causal=causal, window_size=window, softcap=softcap,
                                                          return_lse=True), q, k, v, dout)  # fmt: skip
        if strategy == "usp":
            (ug, rg), shape = usp_groups, usp
            u_rank, r_rank = dist.get_rank(ug), dist.get_rank(rg)
        else:
            shape, u_rank, r_rank = (1, world), 0, rank

        def shard(t, d=1):
            return hd.usp_shard(t, u_rank, shape[0], r_rank, shape[1], layout, d)

        kw = dict(causal=causal, softcap=softcap, return_lse=True)
        if strategy == "ulysses":
            fn = lambda a, b, c: hd.ulysses_attention(a, b, c, window_size=window, **kw)  # noqa: E731
        elif strategy == "ring":
            fn = lambda a, b, c: hd.ring_attention(a, b, c, layout=layout, **kw)  # noqa: E731
        else:
            fn = lambda a, b, c: hd.usp_attention(a, b, c, ug, rg, layout=layout, **kw)  # noqa: E731
        mine = _grads(fn, shard(q), shard(k), shard(v), shard(dout))
        for what in ("out", "lse", "dq", "dk", "dv"):
            d = 2 if what == "lse" else 1
            got = _gather_unshard(mine[what], d, layout, shape)
            ref, one = want[what], single[what]
            finite = torch.isfinite(ref)
            err = (got.double() - ref)[finite].abs().max().item()
            err1 = (one.double() - ref)[finite].abs().max().item()
            half_ulp = 0.5 * eps * ref[finite].abs().max().item()
            added = 1e-4 if what == "lse" else (2 * half_ulp if what == "out" else (1 + world) * half_ulp)
            bound = 2 * err1 + added
            good = bool(torch.isfinite(got).eq(finite).all()) and err <= bound
            ok &= good
            _say(f"{name:34} {what:6} {err:10.3e} {err1:10.3e} {bound:10.3e}  {'ok' if good else 'MISMATCH'}")
        del want, single, mine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    _say("all match" if flag.item() == 0 else "MISMATCH")
    return flag.item() == 0


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------

# name: (B, S, Hq, Hkv, D, causal)
BENCH_SHAPES = {
    "wan14b-720p": (1, 75600, 40, 40, 128, False),  # 21 x 45 x 80 latent patches, 40 heads of 128
    "prefill-128k-gqa": (1, 131072, 32, 8, 128, True),
}


def _time(fn, warmup: int, reps: int, collective: bool = True) -> float:
    """Median ms of fn() over reps; collective: the slowest rank's, each rep started together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if collective:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(times)], device="cuda")
    if collective:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _step(fn, q, k, v, dout, backward: bool):
    def run():
        if backward:
            fn(q, k, v).backward(dout)
        else:
            with torch.no_grad():
                fn(q, k, v)

    return run


def _bench(args, device) -> bool:
    world = dist.get_world_size()
    usp = _usp_size(args, world)
    usp_groups = hd.make_usp_groups(*usp) if usp else None
    rows: List[Dict] = []
    _say(f"hattn.distributed bench: world {world}, bf16; median of {args.reps} after {args.warmup}, the slowest rank; "
         "numbers from this run only")  # fmt: skip
    _say(f"{'shape':18} {'strategy':28} {'fwd ms':>9} {'fwd+bwd ms':>11} {'1-GPU fwd':>10} {'1-GPU f+b':>10} "
         f"{'fwd eff':>8} {'f+b eff':>8}")  # fmt: skip
    for shape_name, (batch, seqlen, hq, hkv, dim, causal) in BENCH_SHAPES.items():
        single = (float("nan"), float("nan"))
        if not args.no_single and dist.get_rank() == 0:
            q = torch.randn(batch, seqlen, hq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(batch, seqlen, hkv, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            fn = lambda a, b, c: hattn.attention(a, b, c, causal=causal)  # noqa: E731
            dout = torch.randn_like(q)
            single = tuple(_time(_step(fn, q, k, v, dout, bwd), args.warmup, args.reps, collective=False)
                           for bwd in (False, True))  # fmt: skip
            del q, k, v, dout
            torch.cuda.empty_cache()
        strategies = []
        if hq % world == 0 and (hkv % world == 0 or world % hkv == 0):
            strategies.append(("ulysses", lambda a, b, c: hd.ulysses_attention(a, b, c, causal=causal)))
        layout = "zigzag" if causal else "contiguous"
        if seqlen % (2 * world if causal else world) == 0:
            strategies.append((f"ring {layout}", lambda a, b, c: hd.ring_attention(a, b, c, causal=causal, layout=layout)))
        if usp and hq % usp[0] == 0 and (hkv % usp[0] == 0 or usp[0] % hkv == 0):
            strategies.append((f"usp {usp[0]}x{usp[1]} {layout}",
                               lambda a, b, c: hd.usp_attention(a, b, c, *usp_groups, causal=causal, layout=layout)))  # fmt: skip
        if seqlen % world:
            _say(f"{shape_name:18} skipped: {seqlen} tokens do not split over {world} ranks")
            continue
        local = seqlen // world
        for name, fn in strategies:
            q = torch.randn(batch, local, hq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(batch, local, hkv, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            dout = torch.randn_like(q)
            fwd, fb = (_time(_step(fn, q, k, v, dout, bwd), args.warmup, args.reps) for bwd in (False, True))
            eff = [s / (world * t) for s, t in zip(single, (fwd, fb))]  # one GPU's time / (W x this one's)
            _say(f"{shape_name:18} {name:28} {fwd:9.2f} {fb:11.2f} {single[0]:10.2f} {single[1]:10.2f} "
                 f"{eff[0]:8.2f} {eff[1]:8.2f}")  # fmt: skip
            rows.append(dict(shape=shape_name, batch=batch, seqlen=seqlen, heads_q=hq, heads_kv=hkv, head_dim=dim,
                             causal=causal, strategy=name, world=world, fwd_ms=fwd, fwd_bwd_ms=fb,
                             single_fwd_ms=single[0], single_fwd_bwd_ms=single[1], gpu=torch.cuda.get_device_name()))  # fmt: skip
            del q, k, v, dout
            torch.cuda.empty_cache()
    if args.csv and dist.get_rank() == 0 and rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return True


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("hattn.distributed_check: needs CUDA GPUs (one per process, under torchrun)", file=sys.stderr)
        return 2
    device = _init(args.backend)
    try:
        ok = _check(args, device) if args.mode == "check" else _bench(args, device)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
