"""python -m hattn.bench_fp8: hattn's FP8 forward beside bf16 attention, on the same values, in one process.

For every shape (D = 128 by default, --dims 64,128 for both; heads x D = 2048 and batch *
seqlen = --tokens, as the FlashAttention-3 grid) it makes bf16 BSHD q, k, v (randn + 0.5, as
hattn.bench), quantizes each to e4m3 with one scale per (batch, head) (the largest |value| maps
to 448; the scale is the descale), and gives the bf16 implementations the dequantized values
(codes x descale, rounded to bf16), so that every implementation computes the same attention:

  hattn_fp8     hattn.attention_fp8 on the e4m3 codes with q_descale, k_descale, v_descale
  hattn_bf16    hattn.attention ("auto") on the dequantized bf16 values
  fa3_fp8       FlashAttention-3's FP8 forward on the same e4m3 codes and descales, when its
                library is given (--fa3 PATH or HATTN_FA3_LIB); else "not given"
  fa3_bf16      FlashAttention-3's bf16 forward on the dequantized values, when given
  sdpa_cudnn    torch SDPA, cuDNN backend, on contiguous BHSD copies (its best layout; the reference)
  sdpa_flash    torch SDPA, FLASH backend (FlashAttention-2), on BHSD views of the BSHD tensors

With --fp64-errors every output is also compared with the attention of the e4m3 inputs' exact
values (codes x descale) in float64: err64_max and err64_rms, the accuracy table's columns
(ours beside FA3's FP8 on the same codes). This reference costs about a second a shape.

Each output is checked against the reference first (cuDNN's, or FLASH's where cuDNN refuses the
shape): max |out - ref| within the bf16 bound of hattn.bench (2x FLASH's distance + half a bf16
ulp, at least 4 ulps, at max |ref|), and for the FP8 kernels at least 2^-4 max |ref| on top:
their softmax weights enter P V in e4m3 (3 mantissa bits). These catch broken outputs; the float64
bounds are the tests' (python/tests/test_fp8.py). Those that pass are timed together with
hattn.bench's Timer: CUDA events, an L2 flush before each call, interleaved rounds, the median.

FLOPs = 4 * B * H * S * S * D, halved when causal (FlashAttention's convention; the same count
for FP8 and bf16). Ratios: each implementation over the best anchor of any dtype
(ratio_to_best_anchor: FA3's FP8 forward when given) and over the best bf16 anchor. Output: a
table on stdout and pybench_fp8.csv in --out; the exit status is 1
when an output was wrong or a call failed, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import fa3
from .bench import (GRID_TOKENS, Shape, Timer, anchor_fn, environment, grid_shapes, make_inputs, max_error,
                    parse_int_list, sm_clock_mhz)  # fmt: skip

HEAD_DIMS = (64, 128, 256)  # the FP8 path's head dims
REFERENCES = ("sdpa_cudnn", "sdpa_flash")  # the reference output: the first that runs
BF16_ANCHORS = ("fa3_bf16",) + REFERENCES
ANCHORS = ("fa3_fp8",) + BF16_ANCHORS
FP8_NAMES = ("hattn_fp8", "fa3_fp8")  # their P V runs in e4m3: the looser bound
NAMES = ("hattn_fp8", "hattn_bf16") + ANCHORS
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_REL_TOL = 2.0**-4  # e4m3 P: a weight's rounding is at most 2^-4 of it
FIELDS = (
    "commit", "gpu", "sm_clock_mhz", "name", "dtype", "head_dim", "causal", "batch", "seqlen", "heads",
    "ms", "reps", "tflops", "ratio_to_best_anchor", "ratio_to_best_bf16_anchor", "max_err", "tol", "err64_max",
    "err64_rms", "status", "note",
)  # fmt: skip
FP64_ROWS = 2048  # query rows per block of the float64 reference (S x 2048 doubles of scores at a time)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hattn.bench_fp8", description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", default="1k,4k,16k", help="sequence lengths (default: 1k,4k,16k)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="masks (default: both)")
    p.add_argument("--dims", default="128", help="head dims, of 64, 128 and 256 (default: 128)")
    p.add_argument("--tokens", type=int, default=GRID_TOKENS, help=f"batch * seqlen (default: {GRID_TOKENS})")
    p.add_argument("--reps", type=int, default=30,
                   help="timed calls per implementation; the median counts (default: 30)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default: 5)")
    p.add_argument("--budget-s", type=float, default=2.0,
                   help="fewer reps (at least 5) where --reps calls take longer (default: 2)")  # fmt: skip
    p.add_argument("--flush-mb", type=int, default=256, help="L2 flush buffer written before every call, MB")
    p.add_argument("--out", default="results", help="output folder (default: results/)")
    p.add_argument("--fp64-errors", action="store_true",
                   help="also each output's error against a float64 reference on the e4m3 inputs' exact values")
    fa3.add_argument(p)
    args = p.parse_args(argv)
    fa3.check_argument(p, args)
    try:
        args.seqlen_list = parse_int_list(args.seqlens)
    except ValueError as e:
        p.error(f"--seqlens: {e}")
    if not args.seqlen_list or any(s < 1 for s in args.seqlen_list):
        p.error(f"--seqlens: one or more lengths >= 1 (got {args.seqlens!r})")
    if args.reps < 1 or args.warmup < 0 or args.tokens < 1:
        p.error("--reps and --tokens must be >= 1, --warmup >= 0")
    try:
        args.dim_list = parse_int_list(args.dims)
    except ValueError as e:
        p.error(f"--dims: {e}")
    if not args.dim_list or any(d not in HEAD_DIMS for d in args.dim_list):
        p.error(f"--dims: head dims of the FP8 path, {', '.join(map(str, HEAD_DIMS))} (got {args.dims!r})")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.shapes = grid_shapes(args.dim_list, args.seqlen_list, causal, tokens=args.tokens)
    return args


def quantize(t: torch.Tensor, heads_kv: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes like t, fp32 descale [B, heads_kv]) of a BSHD tensor t: the heads of each
    (batch, K/V head) share a scale that maps their largest |value| to 448."""
    batch, seqlen, heads, dim = t.shape
    group = heads // heads_kv
    amax = t.abs().view(batch, seqlen, heads_kv, group, dim).amax(dim=(1, 3, 4)).float()
    descale = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (t.float() / descale.repeat_interleave(group, dim=1)[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes, descale


def dequantize(codes: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes x descale (per (batch, K/V head), as attention_fp8 applies it), in dtype."""
    group = codes.shape[2] // descale.shape[1]
    return (codes.float() * descale.repeat_interleave(group, dim=1)[:, None, :, None]).to(dtype)


def quantized_inputs(shape: Shape) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
    """((q codes, descale), (k ...), (v ...)) of one shape: hattn.bench's inputs, quantized (the
    same every call)."""
    return tuple(quantize(t, shape.heads_kv) for t in make_inputs(shape, torch.bfloat16))


def attention_fp64(q8, qd, k8, kd, v8, vd, causal: bool) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V in float64 of e4m3 BSHD codes times their descales ([B, heads_kv]),
    BSHD; causal aligned to the bottom right. By (batch, head) and FP64_ROWS query rows at a time."""
    batch, seqlen_q, heads_q, dim = q8.shape
    seqlen_k, heads_kv = k8.shape[1], k8.shape[2]
    group = heads_q // heads_kv
    out = torch.empty(q8.shape, dtype=torch.float64, device=q8.device)
    scale = 1.0 / math.sqrt(dim)
    for b in range(batch):
        for h in range(heads_q):
            kv = h // group
            q = q8[b, :, h].double() * qd[b, kv].double()
            k = k8[b, :, kv].double() * kd[b, kv].double()
            v = v8[b, :, kv].double() * vd[b, kv].double()
            for r0 in range(0, seqlen_q, FP64_ROWS):
                s = (q[r0:r0 + FP64_ROWS] @ k.T) * scale
                if causal:  # row i sees the keys up to i + seqlen_k - seqlen_q
                    rows = torch.arange(r0, r0 + s.shape[0], device=s.device)[:, None] + (seqlen_k - seqlen_q)
                    s.masked_fill_(torch.arange(seqlen_k, device=s.device)[None, :] > rows, float("-inf"))
                out[b, r0:r0 + s.shape[0], h] = torch.softmax(s, dim=-1) @ v
    return out


def fp64_reference(shape: Shape) -> torch.Tensor:
    """--fp64-errors' reference of one shape: attention_fp64 of its quantized inputs."""
    (q8, qd), (k8, kd), (v8, vd) = quantized_inputs(shape)
    return attention_fp64(q8, qd, k8, kd, v8, vd, shape.causal)


def fp64_errors(out: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(max, root mean square) of |out - ref| in float64, head by head; NaN anywhere gives NaN."""
    worst, squares = 0.0, 0.0
    for h in range(out.shape[-2]):
        diff = (out[..., h, :].double() - ref[..., h, :]).abs()
        if torch.isnan(diff).any():
            return float("nan"), float("nan")
        worst = max(worst, diff.max().item())
        squares += diff.square().sum().item()
    return worst, math.sqrt(squares / max(out.numel(), 1))


def implementations(shape: Shape) -> Dict[str, Tuple[str, Callable[[], torch.Tensor]]]:
    """name -> (dtype, call returning BSHD out) for one shape, all on the same values (FA3's
    calls need its library loaded: hattn.fa3.load)."""
    import hattn

    (q8, qd), (k8, kd), (v8, vd) = quantized_inputs(shape)
    qb, kb, vb = (dequantize(c, d) for c, d in ((q8, qd), (k8, kd), (v8, vd)))
    bhsd = tuple(t.transpose(1, 2).contiguous() for t in (qb, kb, vb))
    c = shape.causal
    calls = {
        "hattn_fp8": ("e4m3", lambda: hattn.attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                                          causal=c)),
        "hattn_bf16": ("bf16", lambda: hattn.attention(qb, kb, vb, causal=c)),
    }  # fmt: skip
    calls["fa3_fp8"] = ("e4m3", lambda: fa3.forward_fp8(q8, k8, v8, qd, kd, vd, c))
    calls["fa3_bf16"] = ("bf16", anchor_fn("fa3", qb, kb, vb, c, bhsd))
    for name in REFERENCES:
        calls[name] = ("bf16", anchor_fn(name, qb, kb, vb, c, bhsd))
    return calls


def bench_shape(shape: Shape, timer: Timer, env: Dict, fa3_missing: Optional[str] = fa3.NOT_GIVEN,
                fp64: bool = False) -> List[Dict]:
    """One row per implementation of NAMES; fa3_missing: why FA3 is not timed (None: it is);
    fp64: their errors against fp64_reference too."""
    calls = implementations(shape)
    ref64 = fp64_reference(shape) if fp64 else None
    rows: Dict[str, Dict] = {}
    for name, (dtype, _) in calls.items():
        rows[name] = {
            "commit": env["commit"], "gpu": env["gpu"], "sm_clock_mhz": env["sm_clock_mhz_start"], "name": name,
            "dtype": dtype, "head_dim": shape.head_dim, "causal": shape.causal, "batch": shape.batch,
            "seqlen": shape.seqlen_q, "heads": shape.heads_q, "ms": None, "reps": None, "tflops": None,
            "ratio_to_best_anchor": None, "ratio_to_best_bf16_anchor": None, "max_err": None, "tol": None,
            "err64_max": None, "err64_rms": None, "status": "ok", "note": "",
        }  # fmt: skip

    def fail(name: str, status: str, why: str) -> None:
        rows[name].update(status=status, note=why.splitlines()[0][:160] if why else "")

    if fa3_missing:
        for name in ("fa3_fp8", "fa3_bf16"):
            fail(name, "not given", fa3_missing)

    # The reference: cuDNN, or FLASH where cuDNN refuses the shape.
    ref = ref_name = None
    for name in REFERENCES:
        try:
            ref, ref_name = calls[name][1]().clone(), name
            break
        except RuntimeError as e:
            fail(name, "unsupported", str(e))
    eps = torch.finfo(torch.bfloat16).eps
    ref_max = ref.abs().max().item() if ref is not None else 0.0
    tol = 4 * eps * ref_max
    if ref_name == "sdpa_cudnn":
        try:
            flash_err = max_error(calls["sdpa_flash"][1](), ref)
            if math.isfinite(flash_err):
                tol = max(tol, 2 * flash_err + 0.5 * eps * ref_max)
        except RuntimeError:
            pass  # recorded below when its own check runs

    to_time = []
    for name, (_, call) in calls.items():
        if rows[name]["status"] != "ok":
            continue
        try:
            out = call()
            torch.cuda.synchronize()
        except NotImplementedError as e:
            fail(name, "unsupported", str(e))
            continue
        except (RuntimeError, ValueError) as e:
            fail(name, "unsupported" if name in ANCHORS else "error", str(e))
            continue
        if ref is None:
            rows[name]["note"] = "no reference ran: not checked"
            to_time.append(name)
            continue
        bound = max(tol, FP8_REL_TOL * ref_max) if name in FP8_NAMES else tol
        err = max_error(out, ref)
        if ref64 is not None:
            rows[name]["err64_max"], rows[name]["err64_rms"] = fp64_errors(out, ref64)
        del out
        rows[name].update(max_err=err, tol=None if name == ref_name else bound)
        if math.isnan(err):
            fail(name, "FAIL", "NaN in the output")
        elif name != ref_name and err > bound:
            fail(name, "FAIL", f"max err {err:.3g} > tol {bound:.3g} vs {ref_name}")
        else:
            to_time.append(name)
    del ref, ref64

    for name, (ms, reps) in zip(to_time, timer.interleaved([calls[n][1] for n in to_time])):
        rows[name].update(ms=ms, reps=reps, tflops=shape.flops / (ms * 1e9))
    best = max((rows[a]["tflops"] for a in ANCHORS if rows[a]["tflops"]), default=None)
    best_bf16 = max((rows[a]["tflops"] for a in BF16_ANCHORS if rows[a]["tflops"]), default=None)
    for r in rows.values():
        if best and r["tflops"]:
            r["ratio_to_best_anchor"] = r["tflops"] / best
        if best_bf16 and r["tflops"]:
            r["ratio_to_best_bf16_anchor"] = r["tflops"] / best_bf16
    return [rows[n] for n in NAMES]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m hattn.bench_fp8: no CUDA GPU is available; the benchmark needs an NVIDIA Hopper GPU (sm_90).",
              file=sys.stderr)  # fmt: skip
        return 2
    fa3_missing = fa3.load_for("python -m hattn.bench_fp8", args.fa3)
    env = environment()
    timer = Timer(args.flush_mb, args.warmup, args.reps, args.budget_s)
    print(f"# FP8 forward on {env['gpu']} | SM clock {env['sm_clock_mhz_start']} MHz | torch {env['torch']} "
          f"| cuDNN {env['cudnn']} | commit {env['commit']}")  # fmt: skip
    print(f"# D={','.join(map(str, args.dim_list))}, B*S={args.tokens}; TFLOP/s (4 B H S^2 D, halved when causal); "
          f"median of up to {args.reps} after {args.warmup} warm-up, {args.flush_mb} MB L2 flush")  # fmt: skip
    print(f"{'D':>4} {'mask':6} {'S':>6} {'BxH':>6} " + " ".join(f"{n:>11}" for n in NAMES) + "  fp8/best  check")
    if fa3_missing:
        print(f"# fa3_fp8, fa3_bf16: {fa3_missing}")
    rows: List[Dict] = []
    for shape in args.shapes:
        try:
            shape_rows = bench_shape(shape, timer, env, fa3_missing, args.fp64_errors)
        except torch.cuda.OutOfMemoryError as e:
            print(f"# {shape}: out of memory: {str(e).splitlines()[0]}")
            torch.cuda.empty_cache()
            continue
        rows += shape_rows
        by = {r["name"]: r for r in shape_rows}
        ratio = by["hattn_fp8"]["ratio_to_best_anchor"]
        checks = "; ".join(f"{r['name']}: {r['status']} {r['note']}".rstrip() for r in shape_rows
                           if r["status"] not in ("ok", "not given")) or "ok"  # fmt: skip
        tflops = " ".join(f"{r['tflops']:11.1f}" if r["tflops"] else f"{'-':>11}" for r in shape_rows)
        ratio_text = f"{ratio:8.3f}" if ratio else f"{'-':>8}"
        ours, theirs = by["hattn_fp8"]["err64_max"], by["fa3_fp8"]["err64_max"]
        errors = f"  err64 {ours:.3g}" if ours is not None else ""
        if ours is not None and theirs:
            errors += f" (fa3_fp8 {theirs:.3g}: x{ours / theirs:.2f})"
        print(f"{shape.head_dim:>4} {'causal' if shape.causal else 'full':6} {shape.seqlen_q:>6} {shape.batch:>2}x{shape.heads_q:<3} "
              f"{tflops}  {ratio_text}  {checks}{errors}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    print(f"# SM clock at the end: {sm_clock_mhz()} MHz")
    if not rows:
        print("# no shape ran", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "pybench_fp8.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {path}")
    return 1 if any(r["status"] in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
