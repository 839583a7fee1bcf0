"""python -m hattn.bench_mla: MLA decoding (hattn.mla_with_kvcache) beside the torch formulation, in one process.

For every batch x cache length x (heads_q, seqlen_q) it fills a paged latent cache ([pages, 64,
1, 576] bf16, randn + 0.5, each request's pages shuffled through the cache) with every request at
the same length, and times:

  hattn_mla     hattn.mla_with_kvcache with a schedule made once (as a decoding step reuses it
                across layers), causal over the seqlen_q new tokens
  torch_mla     the best torch formulation: bmm(q, K^T), fp32 softmax, bmm(P, V) on the cache
                already materialized per request ([B, L, 576]; the gather is not timed)
  fa3_mla       FlashAttention-3's d_qk != d_v mode (q and k the 64 rope features, q_v and v the 512
                latent ones) on the materialized cache, when its library is given (--fa3 PATH or
                HATTN_FA3_LIB) and built with that mode; the prebuilt here has neither that mode's
                kernel (results/evidence/fa3_no_dv512/) nor paged caches
  hattn_gqa     hattn.attention_paged on a GQA cache of about the same bytes per token (2 K/V
                heads of D = 128: 1024 bytes, MLA's 1152) with heads_q query heads: our own
                decoding path over the same traffic

The outputs of hattn_mla (and FA3's) are checked first against the fp32 formulation: within twice
torch_mla's own error, or 2^-6 of the largest output (reference(); a broken kernel's guard,
python/tests/test_mla.py holds the fp64 bound). Timing: hattn.bench's
Timer (CUDA events, an L2 flush before each call, interleaved rounds, the median).

Bytes = the cache rows read (B x L x 576 x 2) plus q and out; GB/s over the H200's 4.8 TB/s is
the memory-bound figure. FLOPs = 2 x B x rows x L x (576 + 512) with rows = heads_q x seqlen_q
(the compute-bound figure, FlashMLA's count). The run first measures two ceilings with the same
timer, as rows of the CSV: ceiling_copy (a 2 GiB device-to-device copy, GB/s counting bytes read
and written) and ceiling_cublas (an 8192^3 bf16 matrix product through torch.matmul, TFLOP/s).
Output: a table on stdout and pybench_mla.csv in --out; exit status 1 when an output was wrong or
a call failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

from . import fa3
from .bench import Timer, environment, parse_int_list, sm_clock_mhz

HBM_GBPS = 4800.0  # the H200's HBM3e
DQK, DV, PAGE = 576, 512, 64
FIELDS = (
    "commit", "gpu", "sm_clock_mhz", "name", "batch", "seqlen_k", "heads_q", "seqlen_q", "rows", "ms", "reps",
    "gbps", "hbm_fraction", "tflops", "max_err", "tol", "status",
)  # fmt: skip


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hattn.bench_mla", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=parse_int_list, default=[1, 8, 32, 64, 128])
    ap.add_argument("--seqlens", type=parse_int_list, default=[1024, 4096, 16384, 32768],
                    help="keys per request (the cache length)")
    ap.add_argument("--heads", default="16x1,32x1,64x1,128x1,128x2",
                    help="heads_q x seqlen_q pairs, comma-separated (default: rows 16 to 256)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch formulation (saves memory)")
    ap.add_argument("--no-gqa", action="store_true", help="skip hattn_gqa")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed calls per implementation and point")
    ap.add_argument("--out", default=".", help="folder for pybench_mla.csv")
    fa3.add_argument(ap)
    args = ap.parse_args(argv)
    fa3.check_argument(ap, args)
    try:
        args.heads = [tuple(int(x) for x in pair.split("x")) for pair in args.heads.split(",")]
    except ValueError:
        ap.error(f"--heads: expected pairs like 128x1, got '{args.heads}'")
    return args


def make_cache(batch: int, seqlen: int, heads_q: int, seqlen_q: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = -(-seqlen // PAGE)
    num_pages = batch * pages_per
    cache = torch.randn(num_pages, PAGE, 1, DQK, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    table = torch.randperm(num_pages, device="cuda", generator=g).to(torch.int32).view(batch, pages_per)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, seqlen_q, heads_q, DQK, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
    return q, cache, table, seqlens


def torch_mla(q, keys, scale: float, causal: bool):
    """q [B, Sq, Hq, 576], keys [B, L, 576] -> out [B, Sq, Hq, 512]: two bmm and an fp32 softmax."""
    batch, seqlen_q, heads_q, _ = q.shape
    rows = q.reshape(batch, seqlen_q * heads_q, DQK)
    s = torch.bmm(rows, keys.transpose(1, 2)).float() * scale
    if causal and seqlen_q > 1:
        length = keys.shape[1]
        pos = torch.arange(seqlen_q, device=q.device).repeat_interleave(heads_q) + length - seqlen_q
        s = s.masked_fill(torch.arange(length, device=q.device)[None, None] > pos[None, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.bmm(p, keys[..., :DV]).view(batch, seqlen_q, heads_q, DV)


def reference(q, keys, scale: float):
    """(the fp32 formulation's out, the tolerance the outputs are held to): twice the error of
    torch's own bf16 formulation, and at least 2^-6 of the output's largest magnitude (a bf16
    formulation rounds P differently from ours, so one bf16 output against another disagrees by
    a few units in the last place)."""
    ref = torch_mla(q.float(), keys.float(), scale, True)
    err_torch = (torch_mla(q, keys, scale, True).float() - ref).abs().max().item()
    return ref, max(2.0 * err_torch, 2.0**-6 * ref.abs().max().item())


def bench_point(batch, seqlen, heads_q, seqlen_q, args, timer, env) -> List[Dict]:
    import hattn

    q, cache, table, seqlens = make_cache(batch, seqlen, heads_q, seqlen_q, seed=batch * 7 + seqlen)
    scale = 1.0 / math.sqrt(DQK)
    rows = heads_q * seqlen_q
    schedule = hattn.mla_schedule(seqlens, seqlen_q=seqlen_q, heads_q=heads_q)
    fns, names, checks = [], [], {}

    def ours():
        return hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=schedule, causal=True)

    fns.append(ours), names.append("hattn_mla")
    # Each request's keys, materialized: torch's formulation, FA3's inputs and the guard read them.
    keys = cache[table.long()].reshape(batch, -1, DQK)[:, :seqlen].contiguous()
    if not args.no_torch:
        fns.append(lambda: torch_mla(q, keys, scale, True)), names.append("torch_mla")
    base = dict(commit=env["commit"], gpu=env["gpu"], batch=batch, seqlen_k=seqlen, heads_q=heads_q,
                seqlen_q=seqlen_q, rows=rows)  # fmt: skip
    # The guard: our output against the fp32 formulation, its reference computed once per point.
    try:
        ref, tol = reference(q, keys, scale)
        err = (ours().float() - ref).abs().max().item()
        checks["hattn_mla"] = (err, tol)
        if not (err <= tol):
            return [{**base, "name": "hattn_mla", "max_err": err, "tol": tol, "status": "wrong"}]
    except Exception as e:  # noqa: BLE001  a refused or failed call is a row, not the end of the run
        return [{**base, "name": "hattn_mla", "status": f"failed: {e}"}]
    def timed_if_right(name, fn) -> Optional[float]:
        """fn joins the timed calls when its output is within tol of the reference; else its error."""
        err = (fn().float() - ref).abs().max().item()
        checks[name] = (err, tol)
        if err <= tol:
            fns.append(fn), names.append(name)
            return None
        return err

    records = []
    if args.fa3_ready:
        # Separate contiguous caches, as FA3's own MLA benchmark lays them out (views into the
        # 576-wide rows disagreed with the fp32 formulation in the first H200 run).
        k_rope, v_latent = keys[:, :, None, DV:].contiguous(), keys[:, :, None, :DV].contiguous()
        q_rope, q_latent = q[..., DV:].contiguous(), q[..., :DV].contiguous()

        def theirs():
            return fa3.forward_mla(q_rope, k_rope, v_latent, q_latent, seqlens, True, scale)

        try:
            if (err := timed_if_right("fa3_mla", theirs)) is not None:  # a line that says so, no time for it
                print(f"bench_mla: fa3_mla differs from the fp32 formulation (max error {err:.3g} > {tol:.3g}); "
                      "not timed", flush=True)
        except Exception as e:  # noqa: BLE001  FA3 built without the mode: a note, not a failure
            args.fa3_ready = False
            args.fa3_note = f"fa3_mla: {str(e).splitlines()[0][:120]}"
            print(f"bench_mla: FA3's MLA mode did not run ({args.fa3_note}); left out", flush=True)
    del ref
    if not args.no_gqa:
        gq = torch.randn(batch, seqlen_q, heads_q, 128, device="cuda", dtype=torch.bfloat16)
        pages = -(-seqlen // 128)
        gk = torch.randn(batch * pages, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
        gv = torch.randn_like(gk)
        gtable = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        fns.append(lambda: hattn.attention_paged(gq, gk, gv, gtable, seqlens, causal=True)), names.append("hattn_gqa")
    times = timer.interleaved(fns)
    clock = sm_clock_mhz()
    cache_bytes = batch * seqlen * DQK * 2 + q.numel() * 2 + batch * rows * DV * 2
    gqa_bytes = batch * seqlen * 2 * 2 * 128 * 2 + batch * rows * 128 * 4
    flops = 2.0 * batch * rows * seqlen * (DQK + DV)
    for name, (ms, reps) in zip(names, times):
        nbytes = gqa_bytes if name == "hattn_gqa" else cache_bytes
        err, tol = checks.get(name, (None, None))
        records.append({**base, "name": name, "sm_clock_mhz": clock, "ms": ms, "reps": reps,
                        "gbps": nbytes / ms / 1e6, "hbm_fraction": nbytes / ms / 1e6 / HBM_GBPS,
                        "tflops": (flops / ms / 1e9) if name != "hattn_gqa" else None, "max_err": err, "tol": tol,
                        "status": "ok"})  # fmt: skip
    return records


def ceilings(timer, env) -> List[Dict]:
    """The copy bandwidth and cuBLAS's bf16 matrix rate on this GPU, timed like the points."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    (copy_ms, copy_reps), (mm_ms, mm_reps) = timer.interleaved([lambda: dst.copy_(src), lambda: a @ b])
    clock = sm_clock_mhz()
    base = dict(commit=env["commit"], gpu=env["gpu"], sm_clock_mhz=clock, status="ok")
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    return [{**base, "name": "ceiling_copy", "ms": copy_ms, "reps": copy_reps, "gbps": copy_gbps,
             "hbm_fraction": copy_gbps / HBM_GBPS},
            {**base, "name": "ceiling_cublas", "ms": mm_ms, "reps": mm_reps, "tflops": 2 * 8192**3 / mm_ms / 1e9}]


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla: no CUDA GPU here; it needs a Hopper GPU")
        return 2
    why = fa3.load_for("bench_mla", args.fa3)
    args.fa3_ready, args.fa3_note = why is None, why
    env = environment()
    timer = Timer(flush_mb=256, warmup=5, reps=50, budget_s=args.budget)
    records: List[Dict] = []
    print(f"{env['gpu']}, commit {env['commit'][:12]}, SM clock {env['sm_clock_mhz_start']} MHz; "
          f"FA3: {'given' if args.fa3_ready else args.fa3_note}")
    for r in ceilings(timer, env):
        records.append(r)
        print(f"{r['name']}: {fmt(r.get('gbps'), '.0f')} GB/s, {fmt(r.get('tflops'), '.0f')} TFLOP/s", flush=True)
    torch.cuda.empty_cache()
    print(f"{'batch':>5} {'L':>6} {'heads':>7} {'name':>10} {'ms':>9} {'GB/s':>7} {'of HBM':>6} {'TFLOP/s':>7}  status")
    for batch in args.batches:
        for seqlen in args.seqlens:
            for heads_q, seqlen_q in args.heads:
                for r in bench_point(batch, seqlen, heads_q, seqlen_q, args, timer, env):
                    records.append(r)
                    print(f"{batch:>5} {seqlen:>6} {heads_q:>4}x{seqlen_q:<2} {r['name']:>10} {fmt(r.get('ms'), '9.4f')} "
                          f"{fmt(r.get('gbps'), '7.0f')} {fmt(r.get('hbm_fraction'), '6.2f')} "
                          f"{fmt(r.get('tflops'), '7.1f')}  {r['status']}", flush=True)  # fmt: skip
                torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pybench_mla.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow(r)
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
