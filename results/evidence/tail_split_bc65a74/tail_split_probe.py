"""Tail split A/B: hattn "auto" with num_splits=0 (the tail split may cut the last round) and
num_splits=1 (off), beside cuDNN, in interleaved rounds. No mask, 16384 tokens, 32 heads."""
import statistics, subprocess
import torch
import hattn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

shapes = [(d, s) for d in (128, 64, 256) for s in ((4096, 8192, 16384) if d == 128 else (4096, 16384))]
tokens, heads = 16384, 32
inputs = {}
for d, s in shapes:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens // s, s, heads, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    inputs[(d, s)] = (q, k, v, tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)))

def fns(key):
    q, k, v, bhsd = inputs[key]
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(*bhsd)
    return {"tail": lambda: hattn.attention(q, k, v, num_splits=0),
            "off": lambda: hattn.attention(q, k, v, num_splits=1), "cudnn": cudnn}

def paired(fs, calls=40):
    """Times each implementation's calls one by one, in a shuffled order per step, so that the
    card's slow drifts (clock, temperature) fall on all of them alike. Median ms per name."""
    import random
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
for rnd in range(3):
    for key in shapes:
        d, s = key
        for name, ms in paired(fns(key)).items():
            res.setdefault((key, name), []).append(4 * (tokens // s) * heads * s * s * d / ms / 1e9)
    clk = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print("# round", rnd, "clock/power/temp:", clk, flush=True)
print("  D     S   tail (3 rounds)              off (3 rounds)               cudnn (3 rounds)             tail/off tail/cudnn off/cudnn")
for key in shapes:
    t, o, c = (res[(key, n)] for n in ("tail", "off", "cudnn"))
    mt, mo, mc = (statistics.median(x) for x in (t, o, c))
    print(f"{key[0]:3d} {key[1]:5d}  " + "  ".join(" ".join(f"{x:6.1f}" for x in v) for v in (t, o, c)) +
          f"   {mt/mo:.3f}  {mt/mc:.3f}  {mo/mc:.3f}")
