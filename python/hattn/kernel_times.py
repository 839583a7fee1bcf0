"""python -m hattn.kernel_times: the GPU kernels of one backward call, and how long each ran.

For each shape of the grid (as in python -m hattn.bench_backward) and each implementation
(hattn through autograd, torch SDPA's cuDNN and FLASH backends), one backward call is profiled
with torch.profiler after two warmup calls; every kernel, memset and copy of it is listed with
its duration from CUPTI's activity records, and their sum (gaps between them not counted). It answers where a backward's
time goes (the main kernel against the preparation and conversion kernels around it), not how
fast it is: hattn.bench_backward times that. Output: a table on stdout and kernel_times.csv in
--out.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import List, Optional, Sequence

import torch

from .bench import grid_shapes, make_inputs, parse_int_list
from .bench_backward import backward_fn

IMPLEMENTATIONS = ("hattn", "sdpa_cudnn", "sdpa_flash")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hattn.kernel_times", description=__doc__.split("\n")[0])
    p.add_argument("--dims", default="128", help="head dims (default: 128)")
    p.add_argument("--seqlens", default="1k,16k", help="sequence lengths (default: 1k,16k)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--impls", default=",".join(IMPLEMENTATIONS), help="implementations, comma-separated")
    p.add_argument("--out", default="results", help="output folder (default: results/)")
    args = p.parse_args(argv)
    args.impls = [x for x in args.impls.split(",") if x]
    unknown = [x for x in args.impls if x not in IMPLEMENTATIONS]
    if unknown:
        p.error(f"--impls: unknown {', '.join(unknown)} (known: {', '.join(IMPLEMENTATIONS)})")
    return args


def one_call_kernels(call) -> List[tuple]:
    """(name, microseconds) of every GPU kernel, memset and copy of one call, in the order they
    started. Two calls before it warm up the allocator, cuDNN's plan and module loading."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    rows = [(e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(name, us) for _, name, us in sorted(rows)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m hattn.kernel_times: no CUDA GPU here; nothing to profile", file=sys.stderr)
        return 2
    dims = parse_int_list(args.dims)
    seqlens = parse_int_list(args.seqlens)
    causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel_times.csv")
    with open(path, "w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["gpu", "head_dim", "causal", "batch", "seqlen", "heads", "impl", "kernel", "us"])
        gpu = torch.cuda.get_device_name()
        for shape in grid_shapes(dims, seqlens, causal):
            q, k, v, dout = make_inputs(shape, torch.bfloat16, with_dout=True)
            for impl in args.impls:
                label = f"D={shape.head_dim} {'causal' if shape.causal else 'full'} S={shape.seqlen_k} {impl}"
                try:
                    kernels = one_call_kernels(backward_fn(impl, q, k, v, dout, shape.causal))
                except RuntimeError as err:  # a backend that refuses the shape
                    print(f"{label}: not run ({str(err).splitlines()[0]})")
                    continue
                total = sum(us for _, us in kernels)
                print(f"{label}: {len(kernels)} GPU activities, {total:.1f} us")
                for name, us in kernels:
                    print(f"    {us:9.1f} us  {name[:110]}")
                    out.writerow([gpu, shape.head_dim, int(shape.causal), shape.batch, shape.seqlen_k, shape.heads_q,
                                  impl, name, f"{us:.2f}"])
            del q, k, v, dout
            torch.cuda.empty_cache()
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
