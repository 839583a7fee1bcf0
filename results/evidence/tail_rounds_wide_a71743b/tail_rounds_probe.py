"""EXPERIMENT (branch x-tail-rounds): paired A/B of the tail split over several rounds and of
wide tiles from shorter sweeps at D = 128, on the pybench grid's shapes (16384 tokens, 2048
hidden: 32/16/8 heads at D = 64/128/256), beside cuDNN. Each step times one call of each in a
shuffled order (the card's drifts fall on all alike); medians per round, 3 rounds."""
import os, random, statistics, subprocess
import torch
import hattn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import sys
CAUSAL = len(sys.argv) > 1 and sys.argv[1] == "causal"
shapes = [(128, 1024), (128, 2048), (128, 4096), (128, 8192), (128, 16384)] if CAUSAL else [(128, 2048), (128, 4096), (128, 8192), (128, 16384), (256, 4096), (256, 16384), (64, 4096)]
tokens, hidden = 16384, 2048

def make(d, s):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens // s, s, hidden // d, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    return q, k, v, tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))

def with_env(env, fn):
    def call():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return call

def fns(d, s, t):
    q, k, v, bhsd = t
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(*bhsd, is_causal=CAUSAL)
    if CAUSAL:
        return {"rounds4": lambda: hattn.attention(q, k, v, causal=True), "rounds1": lambda: hattn.attention(q, k, v, causal=True),
                "off": lambda: hattn.attention(q, k, v, causal=True, num_splits=1), "cudnn": cudnn,
                "wide": with_env({"HATTN_X_WIDE_MIN_KEYS": "256"}, lambda: hattn.attention(q, k, v, causal=True))}
    f = {"rounds4": with_env({"HATTN_X_TAIL_ROUNDS": "4"}, lambda: hattn.attention(q, k, v)),
         "rounds1": with_env({"HATTN_X_TAIL_ROUNDS": "1"}, lambda: hattn.attention(q, k, v)),
         "off": lambda: hattn.attention(q, k, v, num_splits=1), "cudnn": cudnn}
    if d == 128 and s < 8192:
        f["wide"] = with_env({"HATTN_X_WIDE_MIN_KEYS": "1024", "HATTN_X_TAIL_ROUNDS": "4"}, lambda: hattn.attention(q, k, v))
    return f

def paired(fs, calls=30):
    rng = random.Random(0)
    for f in fs.values():
        f()
    torch.cuda.synchronize()
    marks = []
    for _ in range(calls):
        names = list(fs)
        rng.shuffle(names)
        for n in names:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fs[n](); b.record()
            marks.append((n, a, b))
    torch.cuda.synchronize()
    times = {}
    for n, a, b in marks:
        times.setdefault(n, []).append(a.elapsed_time(b))
    return {n: statistics.median(t) for n, t in times.items()}

res = {}
for d, s in shapes:
    t = make(d, s)
    f = fns(d, s, t)
    ref = f["off"]().float()
    for n in ("rounds4", "rounds1", "wide"):
        if n in f:
            print(f"# D={d} S={s} max|{n} - off| = {(f[n]().float() - ref).abs().max().item():.3g}")
    for rnd in range(3):
        for n, ms in paired(f).items():
            res.setdefault((d, s, n), []).append((2 if CAUSAL else 4) * tokens * s * hidden / ms / 1e9)
    del t, f, ref
    torch.cuda.empty_cache()
print("# clock/power/temp:", subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())
names = ["rounds4", "rounds1", "off", "wide", "cudnn"]
print("  D     S  " + "".join(f"{n:>22}" for n in names) + "   r4/r1  r4/cudnn  wide/r4")
for d, s in shapes:
    med = {n: statistics.median(res[(d, s, n)]) for n in names if (d, s, n) in res}
    cells = "".join(f"{' '.join(f'{x:6.1f}' for x in res[(d, s, n)]):>22}" if n in med else f"{'-':>22}" for n in names)
    wide = f"{med['wide'] / med['rounds4']:.3f}" if "wide" in med else "-"
    print(f"{d:3d} {s:5d}  {cells}   {med['rounds4'] / med['rounds1']:.3f}  {med['rounds4'] / med['cudnn']:.3f}  {wide}")
