"""python -m hattn.bench: hattn's kernels against torch SDPA, on the same tensors, in one process.

For every shape it makes BSHD q, k, v (randn + 0.5: never zeros), runs each implementation once
and checks its output against the reference (SDPA's cuDNN result on contiguous BHSD copies), then
times the correct ones together: CUDA events around each call, warm-up first, a write of a
>= 256 MB buffer before every call so that no call finds its inputs in L2, the median of --reps
calls (fewer, at least 5, where a round of all of them would take more than --budget-s per
implementation; the count is recorded). The calls are interleaved, one of each implementation
per round, in a different order each round, so that all of them run at the same clocks and
temperature and none always follows the same neighbour. hattn kernels are timed
through hattn.attention (the torch op, as users call it).

Anchors (torch.nn.attention.sdpa_kernel picks the backend; SDPA takes BHSD):
  fa3              FlashAttention-3's forward on the BSHD tensors, when its library is given
                   (--fa3 PATH or HATTN_FA3_LIB; hattn.fa3 says how); else its rows say "not given"
  sdpa_cudnn       cuDNN on contiguous BHSD copies (its best layout; the reference output)
  sdpa_cudnn_bshd  cuDNN on q.transpose(1, 2) views of the BSHD tensors (what a BSHD caller gets)
  sdpa_flash       the FLASH backend (FlashAttention-2) on the same views

Correctness bound: max |out - reference| <= max(2 * max |sdpa_flash - reference| + eps(dtype)/2 * max |reference|,
4 * eps(dtype) * max |reference|): the tests' rule with FlashAttention-2 as the independent
same-precision baseline, and a floor of 4 ulps at the largest output. It catches broken kernels;
the fp64-referenced bounds are the tests' job (python/tests). NaN always fails.

FLOPs = 4 * B * Hq * Sq * Sk * D, halved when causal. Output: a table on stdout (with progress
lines while it runs) and pybench.csv, pybench.json, pybench_lineage.png, pybench_vs_anchors.png in --out.

--varlen equal|mixed: the grid's shapes as variable-length batches (packed [total, H, D] tensors
and int32 cu_seqlens) of B sequences, all of length S or of lengths drawn from [S/4, 7S/4]
(seeded), timed with hattn.attention_varlen beside torch's varlen kernels, called through their
aten ops (what torch.nn.attention.varlen.varlen_attn calls):
  varlen_cudnn     aten._cudnn_attention_forward with cum_seq_q/cum_seq_k (the reference)
  varlen_flash     aten._flash_attention_forward with cum_seq_q/cum_seq_k (FlashAttention-2)
  fa3              FlashAttention-3's varlen forward (cu_seqlens_q/k), when given
Only the production forward runs varlen batches, so it is the default --kernels there. FLOPs sum the
sequences'. Output: pybench_varlen_<mode>.csv and .json, no plots. --varlen short: many short
sequences instead, lengths drawn from [50, 2000] (seeded) up to 65,536 tokens a head dim.

--window L: the grid with a sliding window of L keys left of each row's diagonal (and L right of it
without the causal mask), timed with hattn.attention(window_size=...) beside
FlashAttention-3's windowed forward (torch SDPA has no sliding window: its anchors say so). The
reference is SDPA's memory-efficient kernel in fp32 with the window as a boolean mask. FLOPs count
the visible entries. Output: pybench_window<L>.csv and .json, no plots.

--paged P: k and v in a paged cache of P-key pages (shuffled, a block table), timed with
hattn.attention_paged beside FA3's paged forward (page_table, seqused_k); SDPA only gives the
reference, on the dense tensors. Output: pybench_paged<P>.csv and .json, no plots.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import fa3, report

GRID_TOKENS = 16384  # batch * seqlen
GRID_WIDTH = 2048  # heads * head_dim
GRID_DIMS = (64, 128, 256)
GRID_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
CAPSTONE_SEQLENS = (32760, 75600)
CAPSTONE_HEADS = (12, 40)
CAPSTONE_DIM = 128
CROSS_KEYS = 512  # the capstone's cross-attention: the video tokens' queries against a prompt's keys
ANCHORS = ("fa3", "sdpa_cudnn", "sdpa_cudnn_bshd", "sdpa_flash")
VARLEN_ANCHORS = ("fa3", "varlen_cudnn", "varlen_flash")
VARLEN_MODES = ("equal", "mixed", "short")
SHORT_LENGTHS = (50, 2000)  # --varlen short: each sequence's length drawn from this range
SHORT_TOKENS = 65536  # --varlen short: the tokens of a batch
SLOW_PREFIXES = ("01_", "02_")  # the CUDA-core steps of the lineage
INPUT_MEAN = 0.5


@dataclass(frozen=True)
class Shape:
    tag: str  # "grid" or "capstone"
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    # A variable-length batch: the sequences' lengths (queries and keys alike), packed along the
    # rows; seqlen_q and seqlen_k are then the longest. Empty for a dense [B, S, H, D] batch.
    lengths: Tuple[int, ...] = ()
    # A sliding window: the keys at most this far left of each row's (bottom-right aligned)
    # diagonal, and as far right of it without the causal mask. -1: none.
    window: int = -1
    # A paged KV cache: the keys and values in pages of this many rows, in a shuffled order that a
    # block table maps (hattn.attention_paged, FA3's page_table). 0: dense k and v.
    page_size: int = 0

    @property
    def window_size(self) -> Tuple[int, int]:
        """hattn's window_size (left, right) for this shape."""
        if self.window < 0:
            return (-1, -1)
        return (self.window, 0 if self.causal else self.window)

    @property
    def flops(self) -> float:
        if self.window >= 0:  # the visible entries, row by row
            left, right = self.window_size
            offset, visible = self.seqlen_k - self.seqlen_q, 0
            for i in range(self.seqlen_q):
                diagonal = i + offset
                visible += max(0, min(self.seqlen_k - 1, diagonal + right) - max(0, diagonal - left) + 1)
            return 4.0 * self.heads_q * self.head_dim * self.batch * visible
        per_entry = 4.0 * self.heads_q * self.head_dim / (2 if self.causal else 1)
        if self.lengths:
            return per_entry * sum(n * n for n in self.lengths)
        if self.causal and self.seqlen_q < self.seqlen_k:  # the visible entries, bottom-right aligned
            q, k = self.seqlen_q, self.seqlen_k
            return 4.0 * self.heads_q * self.head_dim * self.batch * (q * k - q * (q - 1) / 2)
        return per_entry * self.batch * self.seqlen_q * self.seqlen_k


def grid_shapes(
    dims: Sequence[int],
    seqlens: Sequence[int],
    causal: Sequence[bool],
    seqlen_q: Optional[int] = None,
    gqa: int = 1,
    tokens: int = GRID_TOKENS,
    window: int = -1,
    page_size: int = 0,
) -> List[Shape]:
    """The FlashAttention-3 benchmark grid: batch*seqlen = tokens (16384), heads*D = 2048.
    seqlen_q: as many queries per sequence instead of S (decoding: 1), against S keys. gqa:
    query heads per K/V head (at least one K/V head). window >= 0: a sliding window of that many
    keys (tag "window<L>"). page_size > 0: k and v in a paged cache (tag "paged<P>")."""
    tag = f"window{window}" if window >= 0 else f"paged{page_size}" if page_size else "grid"
    return [
        Shape(tag, max(1, tokens // s), seqlen_q or s, s, GRID_WIDTH // d, max(1, GRID_WIDTH // d // gqa), d, c,
              window=window, page_size=page_size)  # fmt: skip
        for d in dims
        for s in seqlens
        for c in causal
    ]


def varlen_shapes(dims: Sequence[int], seqlens: Sequence[int], causal: Sequence[bool], mode: str) -> List[Shape]:
    """The grid as variable-length batches of B = 16384 / S sequences: all of length S ("equal",
    the same work as the dense grid point) or of lengths drawn from [S/4, 7S/4] ("mixed", seeded
    by S and D)."""
    shapes = []
    if mode == "short":  # one batch a head dim: lengths from SHORT_LENGTHS up to SHORT_TOKENS tokens
        for d in dims:
            rng, lengths = random.Random(7919 + d), []
            while sum(lengths) < SHORT_TOKENS:
                lengths.append(rng.randint(*SHORT_LENGTHS))
            for c in causal:
                longest = max(lengths)
                shapes.append(Shape("varlen-short", len(lengths), longest, longest, GRID_WIDTH // d, GRID_WIDTH // d,
                                    d, c, tuple(lengths)))  # fmt: skip
        return shapes
    for d in dims:
        for s in seqlens:
            batch = max(1, GRID_TOKENS // s)
            lengths = [s] * batch
            if mode == "mixed":
                rng = random.Random(s * 131 + d)
                lengths = [rng.randint(max(1, s // 4), s * 7 // 4) for _ in range(batch)]
            for c in causal:
                longest = max(lengths)
                shapes.append(Shape(f"varlen-{mode}", batch, longest, longest, GRID_WIDTH // d, GRID_WIDTH // d, d, c,
                                    tuple(lengths)))  # fmt: skip
    return shapes


def capstone_shapes() -> List[Shape]:
    """The video-transformer shapes: B=1, 32,760 or 75,600 tokens, 12 or 40 heads of D=128, no mask;
    their self-attention (tag "capstone") and their cross-attention to CROSS_KEYS keys ("capstone-cross")."""
    self_attention = [Shape("capstone", 1, s, s, h, h, CAPSTONE_DIM, False) for s in CAPSTONE_SEQLENS
                      for h in CAPSTONE_HEADS]  # fmt: skip
    cross = [Shape("capstone-cross", 1, s, CROSS_KEYS, h, h, CAPSTONE_DIM, False) for s in CAPSTONE_SEQLENS
             for h in CAPSTONE_HEADS]  # fmt: skip
    return self_attention + cross


def parse_int_list(text: str) -> List[int]:
    """ "512,1k,16k" -> [512, 1024, 16384]."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def is_slow(name: str) -> bool:
    return name.startswith(SLOW_PREFIXES)


def parse_args(argv: Optional[Sequence[str]] = None, kernel_names: Sequence[str] = ()) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hattn.bench",
        description="Time hattn kernels against torch SDPA (cuDNN, FLASH) on the FlashAttention-3 grid "
        "and the capstone shapes.",
    )
    p.add_argument("--kernels", default=None,
                   help="comma-separated hattn kernels (from hattn.kernels(), or auto); default: all")  # fmt: skip
    p.add_argument(
        "--anchors", default=",".join(ANCHORS), help=f"comma-separated anchors (default: {','.join(ANCHORS)})"
    )
    p.add_argument("--dims", default=",".join(map(str, GRID_DIMS)), help="head dims of the grid (default: 64,128,256)")
    p.add_argument(
        "--seqlens", default="512,1k,2k,4k,8k,16k", help="sequence lengths of the grid (default: 512,1k,2k,4k,8k,16k)"
    )
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="grid masks (default: both)")
    p.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True, help="run the grid (default: yes)")
    p.add_argument("--capstone", action=argparse.BooleanOptionalAction, default=True,
                   help="add the capstone shapes, self- and cross-attention (default: yes)")  # fmt: skip
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--reps", type=int, default=30, help="timed calls per measurement; the median counts (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default: 5)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=2.0,
        help="fewer reps (at least 5) where --reps calls take longer (default: 2)",
    )
    p.add_argument(
        "--flush-mb", type=int, default=256, help="L2 flush buffer written before every call, MB (default: 256)"
    )
    p.add_argument("--slow-flop-budget", type=float, default=5e11,
                   help="kernels 01_*/02_* skip shapes above this many FLOPs (default: 5e11)")  # fmt: skip
    p.add_argument("--all", action="store_true", help="run slow kernels on every shape")
    p.add_argument("--out", default="results", help="output folder (default: results/)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw PNG plots (default: yes)")
    p.add_argument("--seqlen-q", type=int, default=None,
                   help="queries per sequence on the grid (default: S, as many as keys; 1 for decoding)")  # fmt: skip
    p.add_argument("--gqa", type=int, default=1,
                   help="query heads per K/V head on the grid (default: 1; it must divide the heads)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=GRID_TOKENS,
                   help=f"batch * seqlen of the grid (default: {GRID_TOKENS}; more for decoding batches)")  # fmt: skip
    p.add_argument("--varlen", choices=VARLEN_MODES, default=None,
                   help="the grid as variable-length batches beside torch's varlen kernels "
                   "(no capstone, no plots); short: many sequences of 50..2000 tokens")  # fmt: skip
    p.add_argument("--paged", type=int, default=0, metavar="PAGE",
                   help="k and v in a paged cache of PAGE-key pages (a multiple of 128), beside FA3's paged "
                   "forward (no capstone, no plots)")  # fmt: skip
    p.add_argument("--window", type=int, default=-1,
                   help="a sliding window of this many keys on the grid, beside FA3's (no capstone, no plots)")  # fmt: skip
    fa3.add_argument(p)
    args = p.parse_args(argv)
    fa3.check_argument(p, args)

    anchors = VARLEN_ANCHORS if args.varlen else ANCHORS
    if args.varlen and args.anchors == ",".join(ANCHORS):  # the default list: the varlen anchors instead
        args.anchors = ",".join(VARLEN_ANCHORS)
    default_kernels = kernel_names[-1:] if args.varlen else kernel_names  # only the production forward has varlen
    args.kernel_list = [k for k in (args.kernels.split(",") if args.kernels else default_kernels) if k]
    unknown = [k for k in args.kernel_list if k != "auto" and kernel_names and k not in kernel_names]
    if unknown:
        p.error(f"--kernels: unknown {', '.join(unknown)} (known: auto, {', '.join(kernel_names)})")
    args.anchor_list = [a for a in args.anchors.split(",") if a]
    bad = [a for a in args.anchor_list if a not in anchors]
    if bad:
        mode = " with --varlen" if args.varlen else ""
        p.error(f"--anchors: unknown{mode} {', '.join(bad)} (known{mode}: {', '.join(anchors)})")
    try:
        args.dim_list = parse_int_list(args.dims)
        args.seqlen_list = parse_int_list(args.seqlens)
    except ValueError as e:
        p.error(f"--dims/--seqlens: {e}")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    if args.seqlen_q is not None and (args.seqlen_q < 1 or args.varlen):
        p.error("--seqlen-q must be >= 1, and not with --varlen")
    if args.seqlen_q is not None and args.causal != "no":
        p.error(
            "--seqlen-q needs --causal no: with fewer queries than keys torch SDPA aligns the causal mask "
            "top-left and hattn bottom-right (for one query, bottom-right causal is no mask)"
        )
    if args.gqa < 1 or any((GRID_WIDTH // d) % args.gqa for d in args.dim_list) or (args.gqa > 1 and args.varlen):
        p.error("--gqa must be >= 1, divide the heads of every --dims (2048 / D), and not come with --varlen")
    if args.tokens < 1:
        p.error("--tokens must be >= 1")
    if args.window < -1 or (args.window >= 0 and (args.varlen or args.seqlen_q is not None)):
        p.error("--window must be >= 0 (keys), and not with --varlen or --seqlen-q")
    if args.paged < 0 or args.paged % 128 or (args.paged and (args.varlen or args.window >= 0)):
        p.error("--paged must be a multiple of 128 (keys a page), and not with --varlen or --window")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.varlen:
        args.shapes = varlen_shapes(args.dim_list, args.seqlen_list, causal, args.varlen) if args.grid else []
        args.plots = False
    else:
        grid = grid_shapes(args.dim_list, args.seqlen_list, causal, args.seqlen_q, args.gqa, args.tokens, args.window,
                           args.paged)  # fmt: skip
        if args.window >= 0 or args.paged:  # their own tables: the capstone shapes have neither
            args.capstone = args.plots = False
        args.shapes = (grid if args.grid else []) + (capstone_shapes() if args.capstone else [])
    return args


# --- environment -----------------------------------------------------------------------------------


def _run(cmd: Sequence[str]) -> Optional[str]:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def sm_clock_mhz() -> Optional[str]:
    """The current SM clock of each GPU, from nvidia-smi (comma-separated when several)."""
    out = _run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"])
    return ",".join(out.split()) if out else None


def commit() -> str:
    return os.environ.get("HATTN_COMMIT") or _run(["git", "rev-parse", "HEAD"]) or "unknown"


def environment() -> Dict:
    import hattn

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "sm_clock_mhz_start": sm_clock_mhz(),
        "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "hattn": hattn.__version__,
        "commit": commit(),
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernels": {k.name: k.description for k in hattn.kernels()},
    }


# --- measuring -------------------------------------------------------------------------------------


def round_order(n: int, r: int) -> List[int]:
    """The order of n calls in round r: a permutation drawn from a generator seeded with r, so
    that over the rounds each call comes after each of the others (and runs first) about
    equally often, and a run is repeatable."""
    order = list(range(n))
    random.Random(r).shuffle(order)
    return order


class Timer:
    """Median CUDA-event times of calls, with the L2 flushed before each call.

    The calls are timed in rounds, one of each per round, so that all of them see the same
    clocks: timed one after another, the ones timed last measured well below their stand-alone
    times on the longest shapes (results/evidence/pybench_order_effect_708a992.log). A first
    call of each is timed to size the rest: warm-up and timed rounds take about budget_s per
    call (the remaining warm-ups at most a tenth of it), with at least MIN_REPS timed rounds,
    so slow lineage steps on the large shapes do not dominate the run.
    """

    MIN_REPS = 5
    # Host time per timed call that the GPU's head start covers (see _timed), and its cap; the
    # calls of a round take the head start only when their mean GPU time is below the last.
    HEAD_START_US_PER_CALL = 200
    HEAD_START_MAX_US = 100_000
    HEAD_START_BELOW_MS = 1.0

    def __init__(self, flush_mb: int, warmup: int, reps: int, budget_s: float, head_start: bool = True):
        self.flush = torch.empty(flush_mb * (1 << 20), dtype=torch.uint8, device="cuda")
        self.warmup, self.reps, self.budget_ms = warmup, reps, budget_s * 1e3
        self.head_start = head_start

    def _timed(self, fns: Sequence[Callable[[], object]], rounds: int, head_start: bool) -> List[List[float]]:
        """CUDA-event times (ms) of each call over `rounds` rounds, one call of each per round.

        Each round runs the calls in its own order (round_order): a long call timed right
        after a slow, cooler one (SDPA FLASH) ran several percent faster than right after a
        fast one, because the clocks carry over from one call to the next
        (results/evidence/pybench_neighbour_effect_3d6787d/).

        head_start: the GPU first sleeps long enough for the host to queue every timed call.
        Otherwise a call shorter than the host's time to prepare it (decoding: about 50 us of
        GPU time, 42-99 us of host time in Python on the H200's virtual machine) is timed with
        the host's stalls inside it: such calls read up to 2x slower for seconds at a time
        (results/evidence/decode_python_685b869/). Calls of a millisecond and more skip it and
        keep the clocks of the warm-up calls right before them."""
        n = len(fns)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
                  for _ in range(rounds)]  # fmt: skip
        if head_start:
            sleep_us = min(self.HEAD_START_MAX_US, self.HEAD_START_US_PER_CALL * n * rounds)
            torch.cuda._sleep(sleep_us * 2000)  # cycles; 2000 per us lasts at least sleep_us up to 2 GHz
        for r, round_events in enumerate(events):
            for j in round_order(n, r):
                start, end = round_events[j]
                self.flush.zero_()  # evicts q, k, v and out from L2
                start.record()
                fns[j]()
                end.record()
        torch.cuda.synchronize()
        return [[start.elapsed_time(end) for start, end in calls] for calls in zip(*events)]

    def interleaved(self, fns: Sequence[Callable[[], object]]) -> List[Tuple[float, int]]:
        """(median ms, number of timed calls) of each call, timed in rounds over all of them."""
        if not fns:
            return []
        reps, head_start = self.reps, self.head_start
        if self.warmup > 0:
            per_round = max(sum(times[0] for times in self._timed(fns, 1, self.head_start)), 1e-3)
            for _ in range(min(self.warmup - 1, int(self.budget_ms * len(fns) / 10 / per_round))):
                for fn in fns:
                    fn()
            reps = max(min(self.reps, self.MIN_REPS), min(self.reps, int(self.budget_ms * len(fns) / per_round)))
            head_start = head_start and per_round / len(fns) < self.HEAD_START_BELOW_MS
        return [(statistics.median(times), reps) for times in self._timed(fns, reps, head_start)]


def make_inputs(shape: Shape, dtype: torch.dtype, seed: int = 0, with_dout: bool = False):
    """BSHD q, k, v (randn + INPUT_MEAN) from one generator seeded by `seed`; with_dout: and a
    dout shaped like q, drawn next (the backward benchmark's)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(seqlen, heads):
        t = torch.randn(shape.batch, seqlen, heads, shape.head_dim, device="cuda", dtype=dtype, generator=gen)
        return t.add_(INPUT_MEAN)

    tensors = (
        rand(shape.seqlen_q, shape.heads_q),
        rand(shape.seqlen_k, shape.heads_kv),
        rand(shape.seqlen_k, shape.heads_kv),
    )
    return tensors + (rand(shape.seqlen_q, shape.heads_q),) if with_dout else tensors


def make_varlen_inputs(shape: Shape, dtype: torch.dtype, seed: int = 0, with_dout: bool = False):
    """Packed q [total, Hq, D], k, v [total, Hkv, D] and the int32 offsets of shape.lengths; with_dout:
    and a dout shaped like q, drawn next from the same generator (the backward benchmark's)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(shape.lengths)

    def rand(heads):
        t = torch.randn(total, heads, shape.head_dim, device="cuda", dtype=dtype, generator=gen)
        return t.add_(INPUT_MEAN)

    offsets = [0]
    for n in shape.lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    tensors = (rand(shape.heads_q), rand(shape.heads_kv), rand(shape.heads_kv), cu)
    return tensors + (rand(shape.heads_q),) if with_dout else tensors


def varlen_anchor_fn(name: str, q, k, v, cu, longest: int, causal: bool) -> Callable[[], torch.Tensor]:
    """A call of varlen anchor `name` (torch's through its aten op, or FA3), returning [total, Hq, D]."""
    if name == "fa3":
        return lambda: fa3.forward_varlen(q, k, v, cu, cu, longest, longest, causal)[0]
    if name == "varlen_flash":
        return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False)[0]
    return lambda: torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, longest, longest, False, 0.0, causal, False
    )[0]  # fmt: skip


def anchor_fn(name: str, q, k, v, causal: bool, bhsd) -> Callable[[], torch.Tensor]:
    """A call of anchor `name` returning BSHD output: torch SDPA (`bhsd` holds contiguous BHSD
    copies of q, k, v for sdpa_cudnn) or FA3 on the BSHD tensors."""
    if name == "fa3":
        return lambda: fa3.forward(q, k, v, causal)[0]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
    args = bhsd if name == "sdpa_cudnn" else tuple(t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def call():
        with sdpa_kernel(backend):
            kwargs = {"enable_gqa": True} if gqa else {}
            return sdpa(*args, is_causal=causal, **kwargs).transpose(1, 2)

    return call


def paged_cache(k, v, page_size: int):
    """k and v [B, S, Hkv, D] as a paged cache: pages of page_size keys in a shuffled order (seeded),
    the block table [B, pages] that maps them back, and the keys in use (S each, int32 [B])."""
    batch, seqlen, heads, dim = k.shape
    pages = -(-seqlen // page_size)
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seqlen)).to(k.device)
    table = order.view(batch, pages).to(torch.int32)

    def paged(t):
        padded = torch.zeros(batch, pages * page_size, heads, dim, dtype=t.dtype, device=t.device)
        padded[:, :seqlen] = t
        cache = torch.empty(batch * pages, page_size, heads, dim, dtype=t.dtype, device=t.device)
        cache[order] = padded.view(batch * pages, page_size, heads, dim)
        return cache

    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=k.device)
    return paged(k), paged(v), table, lens


def window_visible(shape: Shape, device) -> torch.Tensor:
    """[Sq, Sk] bool: the keys each query of `shape`'s sliding window sees (bottom-right aligned, as
    hattn's and FA3's)."""
    left, right = shape.window_size
    rows = torch.arange(shape.seqlen_q, device=device)[:, None] + (shape.seqlen_k - shape.seqlen_q)
    cols = torch.arange(shape.seqlen_k, device=device)[None, :]
    return (cols >= rows - left) & (cols <= rows + right)


def window_reference(q, k, v, shape: Shape) -> torch.Tensor:
    """BSHD output of `shape`'s windowed attention from torch SDPA's memory-efficient kernel in fp32,
    the window as a boolean mask (window_visible)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    visible = window_visible(shape, q.device)
    args = (t.transpose(1, 2).float() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):  # MATH where EFFICIENT refuses
        out = sdpa(*args, attn_mask=visible, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).to(q.dtype)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in fp32, head by head (bounded memory); NaN anywhere gives NaN. The head
    dim is the second last ([B, S, H, D] or packed [total, H, D])."""
    err = 0.0
    for h in range(out.shape[-2]):
        diff = (out[..., h, :].float() - ref[..., h, :].float()).abs()
        if torch.isnan(diff).any():
            return float("nan")
        err = max(err, diff.max().item())
    return err


def bench_shape(shape: Shape, args, timer: Timer, dtype: torch.dtype, progress: Callable[[Dict], None]) -> List[Dict]:
    import hattn

    base = dict(asdict(shape), dtype=args.dtype, flops=shape.flops)
    records: List[Dict] = []

    def record(name, kind, status, ms=None, reps=None, err=None, tol=None, note=""):
        r = dict(base, name=name, kind=kind, status=status, ms=ms, reps=reps, max_err=err, tol=tol, note=note,
                 tflops=shape.flops / (ms * 1e9) if ms else None, ratio=None, best_anchor=None)  # fmt: skip
        records.append(r)
        progress(r)

    if shape.lengths:
        q, k, v, cu = make_varlen_inputs(shape, dtype)
        longest = shape.seqlen_q
        calls: Dict[str, Callable[[], torch.Tensor]] = {
            a: varlen_anchor_fn(a, q, k, v, cu, longest, shape.causal) for a in VARLEN_ANCHORS
        }
        cudnn, flash = "varlen_cudnn", "varlen_flash"
    elif shape.window >= 0:
        q, k, v = make_inputs(shape, dtype)
        calls = {"fa3": lambda: fa3.forward(q, k, v, shape.causal, window=shape.window_size)[0]}
        cudnn = flash = None
    else:
        q, k, v = make_inputs(shape, dtype)
        bhsd = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
        calls = {a: anchor_fn(a, q, k, v, shape.causal, bhsd) for a in ANCHORS}
        cudnn, flash = "sdpa_cudnn", "sdpa_flash"
        if shape.page_size:  # the same keys and values in a paged cache; SDPA (dense) gives the reference only
            k_cache, v_cache, table, lens = paged_cache(k, v, shape.page_size)
            calls["fa3"] = lambda: fa3.forward(q, k_cache, v_cache, shape.causal, seqused_k=lens, page_table=table)[0]

    # Reference first: cuDNN (on BHSD copies when dense); FLASH when cuDNN refuses the shape; with
    # a window, the fp32 masked reference.
    ref = ref_name = None
    if shape.window >= 0:
        ref, ref_name = window_reference(q, k, v, shape), "sdpa_efficient_fp32_masked"
    for name in (cudnn, flash) if cudnn else ():
        try:
            ref, ref_name = calls[name]().clone(), name
            break
        except RuntimeError:
            continue
    ref_max = ref.abs().max().item() if ref is not None else None
    eps = torch.finfo(dtype).eps

    def check(out: torch.Tensor, tol: Optional[float]):
        if ref is None:
            return None, "reference unavailable"
        err = max_error(out, ref)
        if math.isnan(err):
            return err, "NaN in the output"
        if tol is not None and err > tol:
            return err, f"max err {err:.3g} > tol {tol:.3g} vs {ref_name}"
        return err, None

    # The FLASH anchor's distance from the reference sets the bound for everyone else, with a
    # floor of 4 ulps at the largest output (two implementations that both round P to the input
    # dtype differ by a few ulps; a broken kernel is off by far more).
    tol = 4 * eps * ref_max if ref_max is not None else None
    if shape.window >= 0 and tol is not None:  # an fp32 reference: the bf16/fp16 kernels' own rounding, 8 ulps
        tol *= 2
    if ref_name == cudnn:
        try:
            flash_err = max_error(calls[flash](), ref)
            if math.isfinite(flash_err):
                tol = max(tol, 2 * flash_err + 0.5 * eps * ref_max)
        except RuntimeError:
            pass

    # Every implementation is checked first; those that pass are then timed together
    # (Timer.interleaved) and recorded in this order.
    to_time: List[Tuple[str, str, Callable[[], object], Optional[float], str]] = []
    fa3_missing = fa3.load(args.fa3) if "fa3" in args.anchor_list else None
    for name in args.anchor_list:
        if name == "fa3" and fa3_missing:  # no FA3 library: the column says why
            record(name, "anchor", "not given", note=fa3_missing)
            continue
        if name not in calls:  # torch SDPA with a sliding window
            record(name, "anchor", "unsupported", note="no sliding window")
            continue
        if shape.page_size and name != "fa3":  # SDPA reads dense tensors only
            record(name, "anchor", "unsupported", note="no paged cache")
            continue
        try:
            err, why = check(calls[name](), None if name == ref_name else tol)
            if why and why != "reference unavailable":
                record(name, "anchor", "FAIL", err=err, tol=tol, note=why)
                continue
            to_time.append((name, "anchor", calls[name], err, ""))
        except RuntimeError as e:  # SDPA: no kernel for this shape
            record(name, "anchor", "unsupported", note=str(e).splitlines()[0][:160])

    for name in args.kernel_list:
        if is_slow(name) and shape.flops > args.slow_flop_budget and not args.all:
            record(name, "hattn", "skipped", note=f"over --slow-flop-budget {args.slow_flop_budget:.3g}")
            continue

        if shape.lengths:

            def call(name=name):
                return hattn.attention_varlen(q, k, v, cu, cu, longest, longest, causal=shape.causal, kernel=name)

        elif shape.page_size:

            def call(name=name):
                return hattn.attention_paged(q, k_cache, v_cache, table, lens, shape.causal, kernel=name)

        else:

            def call(name=name):
                return hattn.attention(q, k, v, causal=shape.causal, kernel=name, window_size=shape.window_size)

        try:
            out = call()
            torch.cuda.synchronize()
        except NotImplementedError as e:
            record(name, "hattn", "unsupported", note=str(e).splitlines()[0][:160])
            continue
        except (RuntimeError, ValueError) as e:
            record(name, "hattn", "error", note=str(e).splitlines()[0][:160])
            continue
        err, why = check(out, tol)
        del out
        if why and why != "reference unavailable":
            record(name, "hattn", "FAIL", err=err, tol=tol, note=why)
            continue
        resolved = hattn.kernels()[-1].name if shape.lengths else None  # varlen: only the production forward
        label = name if name != "auto" else f"auto={resolved or hattn.resolve_kernel(q, k, v, shape.causal)}"
        to_time.append((label, "hattn", call, err, why or ""))

    for (name, kind, _, err, note), (ms, reps) in zip(to_time, timer.interleaved([c[2] for c in to_time])):
        record(name, kind, "ok", ms, reps, err=err, tol=tol, note=note)

    report.fill_ratios(records)
    return records


def main(argv: Optional[Sequence[str]] = None) -> int:
    import hattn

    args = parse_args(argv, [k.name for k in hattn.kernels()])
    if not torch.cuda.is_available():
        print(
            "hattn.bench: no CUDA GPU is available; the benchmark needs an NVIDIA Hopper GPU (sm_90).", file=sys.stderr
        )
        return 2
    os.makedirs(args.out, exist_ok=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    fa3_missing = fa3.load_for("hattn.bench", args.fa3) if "fa3" in args.anchor_list else fa3.NOT_GIVEN
    meta = environment()
    meta["fa3_library"] = None if fa3_missing else fa3.library_path(args.fa3)
    meta["args"] = {k: v for k, v in vars(args).items() if k != "shapes"}
    meta.update(
        dtype=args.dtype, reps=args.reps, warmup=args.warmup, budget_s=args.budget_s, flush_mb=args.flush_mb,
        input_mean=INPUT_MEAN,
    )  # fmt: skip
    print(f"# {meta['gpu']} | SM clock {meta['sm_clock_mhz_start']} MHz | torch {meta['torch']} "
          f"| cuDNN {meta['cudnn']} | commit {meta['commit']}")  # fmt: skip
    print(f"# {len(args.shapes)} shapes x ({', '.join(args.anchor_list + args.kernel_list)}), {args.dtype}, "
          f"median of {args.reps} after {args.warmup} warm-up (at least 5 within {args.budget_s} s), "
          f"{args.flush_mb} MB L2 flush")  # fmt: skip

    timer = Timer(args.flush_mb, args.warmup, args.reps, args.budget_s)
    records: List[Dict] = []
    started = time.time()
    for i, shape in enumerate(args.shapes):
        prefix = f"[{i + 1}/{len(args.shapes)}] {report.shape_label(asdict(shape))}"

        def progress(r, prefix=prefix):
            ms = f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s" if r["ms"] else f"{'':28s}"
            err = f"err {r['max_err']:.2e}" if r["max_err"] is not None else ""
            print(f"{prefix}  {r['name']:24s} {ms}  {err:13s} {r['status']} {r['note']}".rstrip(), flush=True)

        try:
            records += bench_shape(shape, args, timer, dtype, progress)
        except torch.cuda.OutOfMemoryError as e:
            print(f"{prefix}  out of memory: {str(e).splitlines()[0]}", flush=True)
        torch.cuda.empty_cache()

    meta["sm_clock_mhz_end"] = sm_clock_mhz()
    meta["seconds"] = round(time.time() - started, 1)
    stem = (f"pybench_varlen_{args.varlen}" if args.varlen else f"pybench_window{args.window}" if args.window >= 0
            else f"pybench_paged{args.paged}" if args.paged else "pybench")  # fmt: skip
    csv_path, json_path = (os.path.join(args.out, f"{stem}.{ext}") for ext in ("csv", "json"))
    report.write_csv(records, csv_path)
    report.write_json(meta, records, json_path)
    written = [csv_path, json_path]
    if args.plots:
        order = [k.name for k in hattn.kernels()]
        for name, fn in (("lineage", lambda p: report.plot_lineage(records, order, p)),
                         ("vs_anchors", lambda p: report.plot_vs_anchors(records, p))):  # fmt: skip
            path = os.path.join(args.out, f"pybench_{name}.png")
            try:
                if fn(path):
                    written.append(path)
            except Exception as e:  # a plot must not cost the measurements, already written above
                print(f"plot {path} failed: {type(e).__name__}: {e}", file=sys.stderr)
    print()
    print(report.format_table(records))
    print()
    print(f"# TFLOP/s summary ({args.dtype}; ratio = best hattn kernel / best anchor; SM clock "
          f"{meta['sm_clock_mhz_start']} -> {meta['sm_clock_mhz_end']} MHz)")  # fmt: skip
    print(report.format_summary(records))
    print("wrote " + ", ".join(written))
    return 1 if any(r["status"] in ("FAIL", "error") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
