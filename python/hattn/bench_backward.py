"""python -m hattn.bench_backward: hattn's backward against torch SDPA's, on the same tensors, in one process.

For every shape of the grid (batch * seqlen = --tokens, heads * D = 2048) it makes BSHD q, k,
v and dout (randn + 0.5), runs the forward of each implementation with gradients on, and times
the backward alone: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) between CUDA
events, with the L2 flushed before each call and the implementations interleaved in rounds
(hattn.bench's Timer). The median counts.

  hattn            hattn.attention on the BSHD tensors, through autograd (the backward kernel "auto")
  hattn:NAME       with --kernels: backward kernel NAME alone, called through hattn._C (no autograd);
                   "-" where NAME refuses the shape (a line says why)
  sdpa_cudnn       torch SDPA, cuDNN backend, on contiguous BHSD copies (its best layout)
  sdpa_flash       torch SDPA, FLASH backend (FlashAttention-2), on the same BHSD copies
  fa3              FlashAttention-3's backward op on the BSHD tensors, after its forward, when its
                   library is given (--fa3 PATH or HATTN_FA3_LIB); else its rows say "not given"
  hattn_det        with --deterministic: hattn.attention(..., deterministic=True) through autograd
                   (gradients bitwise the same from run to run), checked like hattn
  fa3_det          with --deterministic and FA3 given: FA3's backward with deterministic=True

Check: the first anchor's dq, dk and dv are the reference (--anchors; cuDNN's by default). An
anchor that fails on a shape or whose gradients hold inf or NaN is not timed there (a line says
why) and the next is the reference. The second anchor's distance from the reference sets the
bound, as in hattn.bench: max |grad - ref| <= max(2 max |flash - ref| + eps/2 max |ref|,
4 eps max |ref|), per gradient (the second anchor: a torch one). NaN fails. FA3's gradients are
checked as hattn's are. The check column names each implementation that did not pass. The
tests check against float64 (python/tests).

FLOPs = 2.5 x the forward's (4 B H Sq Sk D, halved when causal): five matrix products where the
forward has two, FlashAttention's convention. Output: a table and pybench_backward.csv in --out.

--step: times one attention layer's training step instead, the forward and the backward of each
implementation in one call (hattn: attention then autograd.grad; SDPA's backends likewise; FA3:
its forward and backward ops); FLOPs = 3.5 x the forward's. Dense batches, not with --kernels;
the CSV name gains _step.

--gqa R: R query heads per K/V head on the grid (torch SDPA with enable_gqa); the CSV is then
pybench_backward_gqa<R>.csv.

--window L: the grid with a sliding window of L keys left of each row's diagonal (and L right of
it without the causal mask), hattn.attention(window_size=...) beside FlashAttention-3's windowed
backward; torch SDPA has no sliding window (a line says so; it is not timed). The reference is torch
SDPA's memory-efficient kernel in fp32 with the window as a boolean mask, through autograd; the
bound is 8 eps max |ref| (the kernels' own rounding against an fp32 reference). FLOPs count the
visible entries. The CSV is pybench_backward_window<L>.csv (_gqa<R> added with --gqa).

--varlen equal|mixed: the grid's shapes as variable-length batches (packed [total, H, D], the
sequences' lengths as in python -m hattn.bench --varlen), with torch's varlen kernels through
their aten ops and autograd (what torch.nn.attention.varlen.varlen_attn calls):
  hattn            hattn.attention_varlen through autograd ("auto")
  hattn:NAME       with --kernels: backward kernel NAME alone on the packed batch, through hattn._C
  varlen_flash     aten._flash_attention_forward with cum_seq_q/k (FlashAttention-2; the reference)
  fa3              FlashAttention-3's varlen backward (cu_seqlens_q/k), when given
  hattn_det, fa3_det  with --deterministic, as for dense batches
  varlen_cudnn     aten._cudnn_attention_forward with cum_seq_q/k, only with --anchors: on the
                   H200 (torch 2.11, cuDNN 9.19) its backward gave inf/NaN gradients on some
                   shapes and faulted on one (results/evidence/bwd_08_varlen/)
With one anchor the bound is 4 eps max |ref|. FLOPs sum the sequences'. Output:
pybench_backward_varlen_<mode>.csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import fa3
from .bench import (GRID_TOKENS, GRID_WIDTH, VARLEN_MODES, Timer, commit, environment, grid_shapes, make_inputs,
                    make_varlen_inputs, parse_int_list, varlen_shapes, window_visible)

ANCHORS = ("sdpa_cudnn", "sdpa_flash", "fa3")
VARLEN_ANCHORS = ("varlen_cudnn", "varlen_flash", "fa3")
# cuDNN's varlen backward is left out unless asked for: on the H200 with torch 2.11 and cuDNN
# 9.19 it gave inf/NaN dq and dk on a mixed-length batch at S = 4k (finite under memcheck) and
# an illegal memory access on the one-sequence batch at S = 16k
# (results/evidence/bwd_08_varlen/README.md).
VARLEN_DEFAULT_ANCHORS = ("varlen_flash", "fa3")
FA3_DET_256 = "not run at head dim 256: FA3's deterministic backward crashed there (segmentation fault)"
WINDOW_REFERENCE = "sdpa_efficient_fp32_masked"  # --window's reference (not timed)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hattn.bench_backward", description=__doc__.split("\n")[0])
    p.add_argument("--dims", default="128", help="head dims (default: 128, the anchors' backward table)")
    p.add_argument("--seqlens", default="1k,4k,16k", help="sequence lengths (default: 1k,4k,16k)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--tokens", type=int, default=GRID_TOKENS, help="batch * seqlen (default: 16384)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--gqa", type=int, default=1,
                   help="query heads per K/V head on the grid (default: 1; it must divide the heads)")  # fmt: skip
    p.add_argument("--kernels", default="", help="backward kernels to time by name too, comma-separated")
    p.add_argument("--reps", type=int, default=20, help="timed calls per implementation (default: 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=1.0, help="about this long per implementation and shape")
    p.add_argument("--out", default="results", help="output folder (default: results/)")
    p.add_argument("--varlen", choices=VARLEN_MODES, default=None,
                   help="the grid as variable-length batches beside torch's varlen kernels (equal or mixed lengths)")
    p.add_argument("--window", type=int, default=-1,
                   help="a sliding window of this many keys on the grid, beside FA3's (dense batches)")
    p.add_argument("--step", action="store_true",
                   help="time the forward and the backward together (one layer's training step)")
    p.add_argument("--deterministic", action="store_true",
                   help="also time hattn's and FA3's deterministic backwards (hattn_det, fa3_det)")
    p.add_argument("--anchors", default=None,
                   help=f"comma-separated anchors, the first the reference (default: {','.join(ANCHORS)}; "
                        f"with --varlen {','.join(VARLEN_DEFAULT_ANCHORS)}, known: {','.join(VARLEN_ANCHORS)})")
    fa3.add_argument(p)
    args = p.parse_args(argv)
    fa3.check_argument(p, args)
    if args.varlen and args.tokens != GRID_TOKENS:
        p.error("--varlen runs the grid's token count: no --tokens with it")
    try:
        args.dim_list = parse_int_list(args.dims)
    except ValueError as e:
        p.error(f"--dims: {e}")
    if args.gqa < 1 or any((GRID_WIDTH // d) % args.gqa for d in args.dim_list) or (args.gqa > 1 and args.varlen):
        p.error("--gqa must be >= 1, divide the heads of every --dims (2048 / D), and not come with --varlen")
    known = VARLEN_ANCHORS if args.varlen else ANCHORS
    default = VARLEN_DEFAULT_ANCHORS if args.varlen else ANCHORS
    args.anchor_list = [a for a in args.anchors.split(",") if a] if args.anchors is not None else list(default)
    bad = [a for a in args.anchor_list if a not in known]
    if bad or not args.anchor_list or len(set(args.anchor_list)) != len(args.anchor_list):
        mode = " with --varlen" if args.varlen else ""
        p.error(f"--anchors: some of {', '.join(known)}{mode}, each once (got {args.anchors!r})")
    if args.anchor_list == ["fa3"]:
        p.error("--anchors: fa3 with at least one torch anchor, the reference")
    if args.window < -1 or (args.window >= 0 and args.varlen):
        p.error("--window must be >= 0 (keys), and not with --varlen")
    if args.step and (args.varlen or args.kernels):
        p.error("--step: dense batches through each implementation's own API, without --varlen or --kernels")
    return args


def backward_fn(name: str, q, k, v, dout, causal: bool, step: bool = False,
                window: Tuple[int, int] = (-1, -1)) -> Callable[[], tuple]:
    """The backward of implementation `name` on BSHD q, k, v (its own leaf copies), as a call
    returning (dq, dk, dv) in BSHD; with step, the call runs the forward too. window: (left,
    right) keys of a sliding window, (-1, -1) for none (hattn and FA3 only)."""
    import hattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    deterministic = name.endswith("_det")
    if name in ("fa3", "fa3_det"):  # its backward op, given its forward's out and log-sum-exp
        if step:
            return lambda: fa3.backward(dout, q, k, v, *fa3.forward(q, k, v, causal, window=window), causal,
                                        deterministic=deterministic, window=window)  # fmt: skip
        out, lse = fa3.forward(q, k, v, causal, window=window)
        return lambda: fa3.backward(dout, q, k, v, out, lse, causal, deterministic=deterministic, window=window)
    if name in ("hattn", "hattn_det"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        grad_out = dout

        def forward():
            return hattn.attention(*leaves, causal=causal, deterministic=deterministic, window_size=window)
    else:
        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        grad_out = dout.transpose(1, 2).contiguous()

        def forward():
            with sdpa_kernel(backend):
                return sdpa(*leaves, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])

    out = None if step else forward()

    def call():
        grads = torch.autograd.grad(forward() if step else out, leaves, grad_out, retain_graph=not step)
        return grads if name.startswith("hattn") else tuple(g.transpose(1, 2) for g in grads)

    return call


def varlen_backward_fn(name: str, q, k, v, dout, cu, longest: int, causal: bool) -> Callable[[], tuple]:
    """The backward of `name` on packed q, k, v (its own leaf copies) through autograd, as a call
    returning packed (dq, dk, dv)."""
    import hattn

    if name in ("fa3", "fa3_det"):
        out, lse = fa3.forward_varlen(q, k, v, cu, cu, longest, longest, causal)
        return lambda: fa3.backward(dout, q, k, v, out, lse, causal, varlen=(cu, longest),
                                    deterministic=name == "fa3_det")  # fmt: skip
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if name in ("hattn", "hattn_det"):
        out = hattn.attention_varlen(*leaves, cu, cu, longest, longest, causal=causal,
                                     deterministic=name == "hattn_det")  # fmt: skip
    elif name == "varlen_flash":
        out = torch.ops.aten._flash_attention_forward(*leaves, cu, cu, longest, longest, 0.0, causal, False)[0]
    else:  # varlen_cudnn; the log-sum-exp is what its backward needs
        out = torch.ops.aten._cudnn_attention_forward(*leaves, None, cu, cu, longest, longest, True, 0.0, causal,
                                                      False)[0]  # fmt: skip

    def call():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return call


def kernel_backward_fn(kernel: str, q, k, v, dout, causal: bool, varlen=None,
                       window: Tuple[int, int] = (-1, -1)) -> Callable[[], tuple]:
    """Backward kernel `kernel` alone through hattn._C, after a forward that gives out and lse;
    returns (dq, dk, dv). q, k, v are BSHD, or packed [total, H, D] with varlen = (cu_seqlens,
    longest sequence), the same for queries and keys."""
    import hattn
    from hattn import _C
    from hattn.ops.runner import _backward_problem, _problem, _problem_kwargs

    with torch.no_grad():
        if varlen is None:
            out, lse = hattn.attention(q, k, v, causal=causal, return_lse=True, window_size=window)
        else:
            cu, longest = varlen
            out, lse = hattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    problem_varlen = None if varlen is None else (cu, cu, longest, longest)
    problem, kernel = _problem(_problem_kwargs(q, k, v, out, lse, causal, None, kernel, window, varlen=problem_varlen))
    grads = _backward_problem(problem, dout, dq, dk, dv)
    stream = torch.cuda.current_stream().cuda_stream

    def call():
        _C.backward(grads, kernel, stream)
        return dq, dk, dv

    # The problem holds only the addresses of out and lse (and cu_seqlens). Without a reference to
    # the tensors their memory went back to torch's caching allocator when this function
    # returned, and the kernel read whatever was allocated there next (the "dv far off" of
    # da02153 and e979dbf).
    call.keep_alive = (out, lse, varlen)
    return call


def window_reference_grads(q, k, v, dout, shape) -> tuple:
    """fp32 (dq, dk, dv), BSHD, of `shape`'s windowed attention from torch SDPA's memory-efficient
    kernel in fp32 through autograd, the window as a boolean mask (hattn.bench's window_visible); K
    and V repeat for each of a K/V head's query heads, so autograd sums over them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    visible = window_visible(shape, q.device)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)
    if group > 1:
        kh, vh = (t.repeat_interleave(group, dim=1) for t in (kh, vh))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):  # MATH where EFFICIENT refuses
        out = sdpa(qh, kh, vh, attn_mask=visible)
    return torch.autograd.grad(out, leaves, dout.transpose(1, 2).float())


def all_finite(grads: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads)


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.float() - ref.float()).abs()
    return float("nan") if torch.isnan(diff).any() else diff.max().item()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m hattn.bench_backward: no CUDA GPU here; it runs on an H100/H200", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    eps = torch.finfo(dtype).eps
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    fa3_missing = None
    if "fa3" in args.anchor_list:
        fa3_missing = fa3.load_for("python -m hattn.bench_backward", args.fa3)
    # Without its library FA3 is not timed; its rows in the CSV say so.
    anchors = tuple(a for a in args.anchor_list if not (a == "fa3" and fa3_missing))
    deterministic = ["hattn_det"] + (["fa3_det"] if "fa3" in anchors else []) if args.deterministic else []
    names = ["hattn"] + [f"hattn:{k}" for k in args.kernels.split(",") if k] + deterministic + list(anchors)
    if args.varlen:
        shapes = varlen_shapes(args.dim_list, parse_int_list(args.seqlens), causal, args.varlen)
    else:
        shapes = grid_shapes(args.dim_list, parse_int_list(args.seqlens), causal, gqa=args.gqa, tokens=args.tokens,
                             window=args.window)  # fmt: skip
    timer = Timer(256, args.warmup, args.reps, args.budget_s)
    env = environment()
    rows: List[Dict] = []
    print(f"# backward on {env['gpu']}, torch {env['torch']}, cuDNN {env['cudnn']}, commit {commit()}")
    if fa3_missing:
        print(f"# fa3: {fa3_missing}")
    print(f"{'D':>4} {'mask':6} {'S':>6} {'BxH':>6} " + " ".join(f"{n[-12:]:>12}" for n in names) + "   hattn/best   check")
    for shape in shapes:
        seed = shape.seqlen_q * 131 + shape.head_dim
        status, errs = {}, {}
        # FA3's deterministic backward at D = 256 killed the process (a segmentation fault inside
        # its library, results/evidence/h200_065e737/): a crash cannot be caught, so it is not called.
        skip_fa3_det = shape.head_dim == 256 and "fa3_det" in names

        def drop_anchor(name: str, why: str, state: str = "failed") -> None:  # not timed on this shape; a line says why
            status[name] = state
            fns.pop(name, None)
            print(f"# {name}: {why}")

        if args.varlen:
            q, k, v, cu, dout = make_varlen_inputs(shape, dtype, seed=seed, with_dout=True)
            fns = {"hattn": varlen_backward_fn("hattn", q, k, v, dout, cu, shape.seqlen_q, shape.causal)}
            for name in names:
                if name.startswith("hattn:"):
                    fns[name] = kernel_backward_fn(name[6:], q, k, v, dout, shape.causal, (cu, shape.seqlen_q))
                elif name == "fa3_det" and skip_fa3_det:
                    drop_anchor(name, FA3_DET_256, "not run")
                elif name in deterministic:
                    try:
                        fns[name] = varlen_backward_fn(name, q, k, v, dout, cu, shape.seqlen_q, shape.causal)
                    except RuntimeError as e:
                        drop_anchor(name, str(e).splitlines()[0])
            for name in anchors:
                try:
                    fns[name] = varlen_backward_fn(name, q, k, v, dout, cu, shape.seqlen_q, shape.causal)
                except RuntimeError as e:  # an anchor that does not take this shape
                    drop_anchor(name, str(e).splitlines()[0])
        else:
            q, k, v, dout = make_inputs(shape, dtype, seed=seed, with_dout=True)
            windowed = {"window": shape.window_size} if shape.window >= 0 else {}
            fns = {
                name: kernel_backward_fn(name[6:], q, k, v, dout, shape.causal, **windowed) if name.startswith("hattn:")
                else backward_fn(name, q, k, v, dout, shape.causal, args.step, **windowed)
                for name in names if name not in anchors and name != "fa3_det"
            }  # fmt: skip
            if skip_fa3_det:
                drop_anchor("fa3_det", FA3_DET_256, "not run")
            for name in list(anchors) + (["fa3_det"] if "fa3_det" in names and not skip_fa3_det else []):
                if windowed and name not in ("fa3", "fa3_det"):
                    drop_anchor(name, "torch SDPA has no sliding window", "unsupported")
                    continue
                try:  # FA3's forward runs here: where it does not take the shape, it is dropped
                    fns[name] = backward_fn(name, q, k, v, dout, shape.causal, args.step, **windowed)
                except RuntimeError as e:
                    drop_anchor(name, str(e).splitlines()[0])

        # The anchors' gradients, in --anchors order, without those that failed or hold inf/NaN:
        # the first is the reference, the second's distance from it sets the bound.
        anchor_grads = {}
        for name in anchors:
            if name not in fns:
                continue
            try:
                grads = fns[name]()
            except RuntimeError as e:
                drop_anchor(name, str(e).splitlines()[0])
                continue
            if all_finite(grads):
                anchor_grads[name] = grads
            else:
                drop_anchor(name, "its gradients hold inf or NaN")
        if shape.window >= 0:  # no torch anchor takes the window: the fp32 masked reference
            used, reference, other = WINDOW_REFERENCE, window_reference_grads(q, k, v, dout, shape), None
        elif not anchor_grads:  # no anchor ran: nothing to check or compare against
            print(f"# {shape}: no anchor ran, shape skipped")
            continue
        else:
            used, reference = next(iter(anchor_grads.items()))
            # The bound's second opinion: a torch anchor (FA3's gradients are checked, not trusted).
            torch_grads = [g for n, g in anchor_grads.items() if n != "fa3"]
            other = torch_grads[1] if len(torch_grads) > 1 and used != "fa3" else None
        for name in names:  # hattn's, and FA3's: a library called wrongly must not pass unseen
            if name not in fns or (name in anchors and name != "fa3"):
                continue
            try:
                got = fns[name]()
            except NotImplementedError as e:  # a named kernel that refuses this shape
                status[name], errs[name] = "unsupported", {}
                print(f"# {name}: {e}")
                continue
            status[name], errs[name] = "ok", {}
            for i, g in enumerate(("dq", "dk", "dv")):
                ref = reference[i]
                scale = ref.float().abs().max().item()
                tol = (8 if shape.window >= 0 else 4) * eps * scale  # 8 ulps against an fp32 reference
                if other is not None:
                    tol = max(2 * max_error(other[i], ref) + eps / 2 * scale, tol)
                errs[name][g] = max_error(got[i], ref)
                if not errs[name][g] <= tol:  # NaN fails too
                    status[name] = f"FAIL {g} err {errs[name][g]:.3g} > {tol:.3g}"
        del reference, other, anchor_grads
        timed = [n for n in names if n in fns and status.get(n) != "unsupported"]
        times = dict(zip(timed, timer.interleaved([fns[n] for n in timed])))
        flops = (3.5 if args.step else 2.5) * shape.flops
        tflops = {n: flops / (ms * 1e-3) / 1e12 for n, (ms, _) in times.items()}
        anchor_tflops = [tflops[a] for a in anchors if a in tflops]
        best = max(anchor_tflops) if anchor_tflops else None  # none: a window without FA3
        mask = "causal" if shape.causal else "full"
        checks = "; ".join(f"{n}: {st}" for n, st in status.items() if st != "ok") or "ok"
        heads = f"{shape.heads_q}" + (f":{shape.heads_kv}" if shape.heads_kv != shape.heads_q else "")
        print(f"{shape.head_dim:>4} {mask:6} {shape.seqlen_q:>6} {shape.batch:>2}x{heads:<3} "
              + " ".join(f"{tflops[n]:12.1f}" if n in tflops else f"{'-':>12}" for n in names)
              + (f"   {tflops['hattn'] / best:10.3f}" if best and "hattn" in tflops else f"   {'-':>10}")
              + f"   {checks}")  # fmt: skip
        if fa3_missing:
            times["fa3"] = (None, None)
            status["fa3"] = "not given"
        for n, (ms, reps) in times.items():
            rows.append({
                "commit": env["commit"], "gpu": env["gpu"], "sm_clock_mhz": env["sm_clock_mhz_start"],
                "name": n, "dtype": args.dtype, "head_dim": shape.head_dim, "causal": shape.causal,
                "batch": shape.batch, "seqlen": shape.seqlen_q, "heads_q": shape.heads_q, "heads_kv": shape.heads_kv,
                "tokens": sum(shape.lengths) if shape.lengths else shape.batch * shape.seqlen_q,
                "ms": "" if ms is None else ms, "reps": "" if reps is None else reps,
                "tflops": tflops.get(n, ""), "ratio_to_best_anchor": tflops[n] / best if n in tflops and best else "",
                "max_err_dq": errs.get(n, {}).get("dq", ""), "max_err_dk": errs.get(n, {}).get("dk", ""),
                "max_err_dv": errs.get(n, {}).get("dv", ""),
                "status": status.get(n, "reference" if n == used else "ok"),
            })  # fmt: skip
        del fns
        torch.cuda.empty_cache()
    if not rows:
        print("# no shape ran", file=sys.stderr)
        return 3
    os.makedirs(args.out, exist_ok=True)
    if args.varlen:
        file_name = f"pybench_backward_varlen_{args.varlen}.csv"
    elif args.window >= 0:
        file_name = f"pybench_backward_window{args.window}" + (f"_gqa{args.gqa}" if args.gqa > 1 else "")
        file_name += "_step.csv" if args.step else ".csv"
    else:
        file_name = f"pybench_backward_gqa{args.gqa}" if args.gqa > 1 else "pybench_backward"
        file_name += "_step.csv" if args.step else ".csv"
    path = os.path.join(args.out, file_name)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"# wrote {path}")
    return 0 if all(r["status"] in ("ok", "reference", "not given") for r in rows) else 3


if __name__ == "__main__":
    raise SystemExit(main())
