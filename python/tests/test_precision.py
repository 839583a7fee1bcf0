"""The backward's precision (issue 53): precision.py's same-precision emulation of hattn's
backward checked on the CPU, and a randomized GPU test of hattn's gradients against the fp64
reference with FlashAttention's criterion, beside the emulation's.

CPU part: the emulation against the fp64 reference's autograd. With rounding off and fp64
arithmetic it is the exact algorithm (softcap's derivative, masks, rows without keys, GQA's
sums: equal to 1e-10); with rounding off in fp32, within 1e-5; with the kernels' roundings,
within a few ulps of the dtype; and each rounding feeds the product the kernel feeds.

GPU part (skips without a Hopper GPU): random backward cases over the contract (batch 1-2,
lengths from 1 to 300, often under 8, Sq != Sk, D 64/128/256, bf16 and fp16, GQA up to 8,
causal, sliding windows, softcap 5-50, input magnitudes 1-10). For each case, hattn's dq, dk,
dv through autograd, the emulation's from hattn's own out and lse, and the plain same-dtype
torch implementation's, each against fp64's: a gradient misses when its max error exceeds
helpers.error_bound (twice the plain implementation's error plus half an ulp at the largest
reference value, test_contract.py's rule). A case fails on NaN, or when hattn misses where the
emulation does not explain it: hattn's error above the bound and above (1 + TOLERANCE) times
the emulation's. Ablations of the emulation (P or dS kept in fp32, delta from the unrounded O,
tanh with an error of tanh.approx's measured size) go into the table to find the causes of a
miss. With HATTN_FA3_LIB (hattn.fa3), FlashAttention-3 runs bf16 cases without softcap too, and
the summary test asks that hattn miss no more of them than FA3.

    HATTN_PRECISION_SEED=N    the seed (in every case's id; default fixed)
    HATTN_PRECISION_CASES=N   how many cases (default 64; issue 53's run: 2000)
    HATTN_PRECISION_OUT=PATH  write the per-case table there (CSV) at the end
"""

from __future__ import annotations

import csv
import math
import os
import random

import pytest
import torch
from helpers import attention_ref, check_gradients, error_bound, gradients, hopper_skip_reason, requires_hopper
from precision import (
    TANH_APPROX_PROFILE,
    _Constants,
    _tanh,
    emulate_backward,
    emulate_forward,
    emulate_gradients,
    fp32_order_slack,
)

# ---------------------------------------------------------------------------------------------
# CPU: the emulation against the fp64 reference


def cpu_inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, magnitude=1.0, seed=0):
    """q, k, v, dout in dtype on the CPU: magnitude * (randn + 0.5), dout randn + 0.5."""
    gen = torch.Generator().manual_seed(seed)

    def rand(seqlen, heads, m):
        return ((torch.randn(batch, seqlen, heads, head_dim, generator=gen) + 0.5) * m).to(dtype)

    q, k, v = rand(seqlen_q, heads_q, magnitude), rand(seqlen_k, heads_kv, magnitude), rand(seqlen_k, heads_kv, magnitude)
    return q, k, v, rand(seqlen_q, heads_q, 1.0)


def reference_gradients(q, k, v, dout, causal, window, softcap, softmax_scale=None):
    """fp64 autograd of helpers.attention_ref."""
    fn = lambda q, k, v: attention_ref(q, k, v, causal, softmax_scale, True, window, softcap)[0]  # noqa: E731
    return gradients(fn, q.double(), k.double(), v.double(), dout.double())


# (Sq, Sk, Hq, Hkv, causal, window, softcap): rows without keys (causal Sq > Sk, a window), Sq != Sk, GQA, softcap
CPU_CASES = [
    (37, 53, 2, 2, False, (-1, -1), 0.0),
    (53, 37, 4, 1, True, (-1, -1), 0.0),
    (40, 40, 4, 2, False, (5, 3), 0.0),
    (29, 45, 2, 1, False, (-1, -1), 7.5),
    (45, 29, 8, 2, True, (-1, -1), 30.0),
    (33, 33, 2, 2, False, (4, -1), 12.0),
    (1, 1, 2, 1, False, (-1, -1), 0.0),
    (1, 70, 2, 2, True, (-1, -1), 5.0),
]


def cpu_id(c):
    sq, sk, hq, hkv, causal, window, softcap = c
    return f"{sq}x{sk}-H{hq}x{hkv}" + ("-causal" if causal else "") + (f"-w{window[0]}x{window[1]}" if window != (-1, -1) else "") + (f"-cap{softcap:g}" if softcap else "")  # fmt: skip


def relative_error(got, want) -> float:
    """max |got - want| / max |want|."""
    return (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


@pytest.mark.parametrize("case", CPU_CASES, ids=[cpu_id(c) for c in CPU_CASES])
def test_exact_algorithm_is_the_reference(case):
    """Rounding off and fp64 arithmetic: the emulated forward and backward are attention's exact
    gradients (the softcap slope folded into dP, delta, the masks, GQA's sums over the group)."""
    sq, sk, hq, hkv, causal, window, softcap = case
    q, k, v, dout = cpu_inputs(1, sq, sk, hq, hkv, 64, torch.bfloat16, magnitude=2.0, seed=1)
    want = reference_gradients(q, k, v, dout, causal, window, softcap)
    got = emulate_gradients(q, k, v, dout, causal, None, window, softcap, rounding=False, compute=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape
        assert relative_error(g, w) < 1e-10, f"{name}: {relative_error(g, w):.2e}"


@pytest.mark.parametrize("case", CPU_CASES, ids=[cpu_id(c) for c in CPU_CASES])
def test_fp32_without_rounding_matches_fp64(case):
    """Rounding off, fp32 arithmetic as the kernels do it: within 1e-5 of the fp64 gradients
    (relative to their largest), forward out and lse too; and within fp32_order_slack of them
    plus 1e-6, also where a gradient is 0 in exact arithmetic (one key: dS = 0) and fp32 leaves a
    residue of dP - delta."""
    sq, sk, hq, hkv, causal, window, softcap = case
    q, k, v, dout = cpu_inputs(1, sq, sk, hq, hkv, 64, torch.float16, seed=2)
    want = reference_gradients(q, k, v, dout, causal, window, softcap)
    got = emulate_gradients(q, k, v, dout, causal, None, window, softcap, rounding=False)
    out, lse = emulate_forward(q, k, v, causal, None, window, softcap, rounding=False)
    slack = fp32_order_slack(q, k, v, out, lse, dout, causal, None, window, softcap)
    largest = max(w.abs().max().item() for w in want)
    for name, g, w, e in zip(("dq", "dk", "dv"), got, want, slack):
        assert g.dtype == torch.float32
        err = (g.double() - w).abs().max().item()
        assert err <= 1e-5 * largest, f"{name}: {err:.2e} against gradients up to {largest:.2e}"
        assert err <= e + 1e-6 * w.abs().max().item(), f"{name}: {err:.2e} > fp32 slack {e:.2e}"
    ref_out, ref_lse = attention_ref(q, k, v, causal, None, True, window, softcap)
    assert relative_error(out, ref_out) < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without keys: lse -inf"
    live = torch.isfinite(ref_lse)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("case", CPU_CASES, ids=[cpu_id(c) for c in CPU_CASES])
def test_rounded_emulation_within_a_few_ulps(case, dtype):
    """With the kernels' roundings: within 3 ulps of the dtype at each gradient's largest value
    (helpers.check_gradients' budget, the C++ tests'), plus the fp32 slack, which matters only
    where the exact gradient is about 0 (one key: 1x1 gives dq = dk = 0 exactly, and the
    algorithm an fp32 residue of dP - delta that exceeds check_gradients' 1e-6)."""
    sq, sk, hq, hkv, causal, window, softcap = case
    q, k, v, dout = cpu_inputs(1, sq, sk, hq, hkv, 64, dtype, seed=3)
    want = reference_gradients(q, k, v, dout, causal, window, softcap)
    out, lse = emulate_forward(q, k, v, causal, None, window, softcap)
    got = emulate_backward(q, k, v, out, lse, dout, causal, None, window, softcap)
    slack = fp32_order_slack(q, k, v, out, lse, dout, causal, None, window, softcap)
    eps = torch.finfo(dtype).eps
    for name, g, w, e in zip(("dq", "dk", "dv"), got, want, slack):
        assert g.dtype == dtype and g.shape == w.shape and torch.isfinite(g).all()
        err = (g.double() - w).abs().max().item()
        bound = 3 * eps * w.abs().max().item() + e + 1e-6
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (fp32 slack {e:.2e})"
    if sk > 1:  # no cancellation to speak of: check_gradients' budget as it is
        check_gradients(got, want, dtype, cpu_id(case))


def test_each_rounding_feeds_the_products_the_kernel_feeds():
    """P^T (rounded) feeds only dV, dS^T only dK and dQ, and dS is made from the fp32 P: turning
    one rounding off changes only its gradients; the gradients' own rounding is the last step."""
    q, k, v, dout = cpu_inputs(2, 45, 61, 4, 2, 64, torch.float16, magnitude=3.0, seed=4)
    args = (True, None, (-1, -1), 20.0)
    out, lse = emulate_forward(q, k, v, *args)
    full = emulate_backward(q, k, v, out, lse, dout, *args, round_grads=False)
    p32 = emulate_backward(q, k, v, out, lse, dout, *args, round_p=False, round_grads=False)
    ds32 = emulate_backward(q, k, v, out, lse, dout, *args, round_ds=False, round_grads=False)
    assert torch.equal(full[0], p32[0]) and torch.equal(full[1], p32[1]), "P's rounding reaches dQ or dK"
    assert not torch.equal(full[2], p32[2]), "P's rounding does not reach dV"
    assert torch.equal(full[2], ds32[2]), "dS's rounding reaches dV"
    assert not torch.equal(full[0], ds32[0]) and not torch.equal(full[1], ds32[1])
    rounded = emulate_backward(q, k, v, out, lse, dout, *args)
    for r, f in zip(rounded, full):
        assert r.dtype == torch.float16 and torch.equal(r, f.to(torch.float16))
    flushed = emulate_backward(q, k, v, out, lse, dout, *args, round_grads=False, flush_subnormals=True)
    assert not torch.equal(flushed[2], full[2]), "no P below fp16's smallest normal here"


def test_rows_without_keys_get_zero_gradients():
    """A causal Sq > Sk: the first Sq - Sk queries see no key (lse -inf, out 0): their dQ is 0,
    and they add nothing to dK and dV."""
    q, k, v, dout = cpu_inputs(1, 20, 8, 2, 2, 64, torch.bfloat16, seed=5)
    out, lse = emulate_forward(q, k, v, True)
    assert torch.isneginf(lse[:, :, :12]).all() and (out[:, :12] == 0).all()
    dq, dk, dv = emulate_backward(q, k, v, out, lse, dout, True)
    assert (dq[:, :12] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    dq2, dk2, dv2 = emulate_backward(q[:, 12:], k, v, out[:, 12:], lse[:, :, 12:], dout[:, 12:], True)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


def test_constants_are_the_kernels_fp32():
    """The scale as api.cpp computes it (1.0f / sqrtf(D)), softcap_scale = scale / softcap and
    grad_scale = softcap_scale * softcap in fp32 (params.h, score_grad_scale)."""
    c = _Constants(128, None, 30.0, torch.float32)
    scale = 1.0 / torch.tensor(128.0).sqrt()  # fp32
    assert c.softcap_scale == (scale / torch.tensor(30.0)).item()
    assert c.grad_scale == (torch.tensor(c.softcap_scale) * torch.tensor(30.0)).item()
    assert abs(c.grad_scale - 1 / math.sqrt(128)) < 2 * 2.0**-24 / math.sqrt(128)
    assert c.exp_scale == 30.0 and c.scale_log2 == (torch.tensor(30.0) * torch.tensor(1.4426950408889634)).item()
    plain = _Constants(64, None, 0.0, torch.float32)
    assert plain.grad_scale == plain.exp_scale == 0.125 and plain.softcap_scale == 0.0


def test_tanh_profile_stays_within_the_measured_error():
    x = torch.linspace(-12, 12, 20001)
    exact = _tanh(x, "exact", 0)
    noisy = _tanh(x, "profile", 7)
    bound = torch.tensor([next(e for upper, e in TANH_APPROX_PROFILE if abs(v) < upper) for v in x.tolist()])
    diff = (noisy.double() - exact.double()).abs()
    assert (diff <= bound.double() + 1e-7).all() and diff.max() > 1e-6
    assert noisy.abs().max() <= 1.0
    with pytest.raises(ValueError):
        _tanh(x, "fast", 0)


# ---------------------------------------------------------------------------------------------
# GPU: hattn's gradients, the emulation's and the plain implementation's against fp64

SEED = int(os.environ.get("HATTN_PRECISION_SEED", "20260530"))
CASES = int(os.environ.get("HATTN_PRECISION_CASES", "64"))
OUT = os.environ.get("HATTN_PRECISION_OUT")
# How far above the bound hattn may go where the emulation does not reach it: hattn's error
# within (1 + TOLERANCE) times the emulation's plus the fp32 slack (precision.fp32_order_slack:
# the two differ in the order of their fp32 sums, in tanh.approx's and ex2.approx's values, and
# in the forward's tiles).
TOLERANCE = 0.25
GRADS = ("dq", "dk", "dv")
# The emulation and its variants, each a column per gradient: "emu" the whole algorithm
# (emulate_gradients); "emu_given" the backward alone from hattn's out and lse; the ablations
# keep P or dS in fp32 in the backward, take delta from the unrounded O (fp64 O, read in fp32),
# flush P^T's and dS^T's subnormals to 0 after their rounding (fp16: below 6.1e-5), or give
# tanh an error of tanh.approx's measured size (softcap only).
VARIANTS = ("emu", "emu_given", "emu_p32", "emu_ds32", "emu_o32", "emu_ftz", "emu_tanh")


def draw(rng: random.Random) -> dict:
    """One backward problem from the contract; short lengths (1-8) often."""

    def length():
        return rng.randint(1, 8) if rng.random() < 0.25 else rng.randint(1, 300)

    seqlen_q = length()
    seqlen_k = seqlen_q if rng.random() < 0.4 else length()
    causal = rng.random() < 0.4
    window = (-1, -1)
    if rng.random() < 0.3:
        left = rng.choice((-1, rng.randint(0, 128)))
        right = 0 if causal else rng.choice((-1, rng.randint(0, 128)))
        window = (left, right) if (left, right) != (-1, -1) else (rng.randint(0, 64), -1)
    heads_kv = rng.choice((1, 2))
    return dict(
        batch=rng.randint(1, 2), seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_kv=heads_kv,
        heads_q=heads_kv * rng.choice((1, 1, 2, 4, 8)), head_dim=rng.choice((64, 128, 256)),
        dtype=rng.choice((torch.bfloat16, torch.float16)), causal=causal, window=window,
        softcap=rng.choice((0.0, 0.0, round(rng.uniform(5.0, 50.0), 2))), magnitude=rng.choice((1.0, 3.0, 10.0)),
        seed=rng.randrange(1 << 30),
    )  # fmt: skip


def case_params(seed: int, count: int):
    return [dict(draw(random.Random(seed * 100043 + i)), index=i) for i in range(count)]


CASE_PARAMS = case_params(SEED, CASES)


def dtype_name(dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def case_id(p) -> str:
    extras = [f"w{p['window'][0]}x{p['window'][1]}"] if p["window"] != (-1, -1) else []
    extras += ["causal"] if p["causal"] else []
    extras += [f"cap{p['softcap']:g}"] if p["softcap"] else []
    return (f"seed{SEED}-{p['index']}-B{p['batch']}-Sq{p['seqlen_q']}-Sk{p['seqlen_k']}-H{p['heads_q']}x{p['heads_kv']}"
            f"-D{p['head_dim']}-{dtype_name(p['dtype'])}-m{p['magnitude']:g}" + "".join("-" + e for e in extras))  # fmt: skip


def fa3_atol(ref: torch.Tensor, dtype: torch.dtype, softcap: float) -> float:
    """FlashAttention-3's test atol: twice the dtype's rounding at the reference values,
    2 max|(r + 0.3 - 0.3) - r| with r the reference in the dtype, plus 3e-4 with softcap."""
    r = ref.to(dtype)
    return 2 * ((r + 0.3 - 0.3) - r).abs().max().item() + (3e-4 if softcap > 0 else 0.0)


_fa3_state = {}


def fa3_ready() -> bool:
    """FlashAttention-3 loaded from HATTN_FA3_LIB (hattn.fa3), once."""
    if "ready" not in _fa3_state:
        from hattn import fa3

        _fa3_state["ready"] = fa3.load(None) is None
    return _fa3_state["ready"]


def fa3_gradients(q, k, v, dout, p):
    """FA3's (dq, dk, dv): its forward, then its backward from that forward's out and lse (the
    call hattn.fa3.backward makes, with the window)."""
    from hattn import fa3

    window = dict(is_causal=p["causal"], window_size_left=p["window"][0], window_size_right=p["window"][1])
    out, lse = fa3.forward(q, k, v, p["causal"], p["window"])
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **window)
    return dq, dk, dv


def hattn_attention(q, k, v, p):
    """(out, lse) of hattn.attention through autograd (q, k, v require grad)."""
    import hattn

    return hattn.attention(q, k, v, causal=p["causal"], window_size=p["window"], softcap=p["softcap"], return_lse=True)


def make_inputs(p, device="cuda"):
    """q, k, v ~ magnitude * (randn + 0.5) and dout ~ randn + 0.5, in the case's dtype."""
    gen = torch.Generator(device=device).manual_seed(p["seed"])

    def values(s, h, magnitude):
        x = torch.randn(p["batch"], s, h, p["head_dim"], device=device, generator=gen)
        return ((x + 0.5) * magnitude).to(p["dtype"])

    q = values(p["seqlen_q"], p["heads_q"], p["magnitude"])
    k = values(p["seqlen_k"], p["heads_kv"], p["magnitude"])
    v = values(p["seqlen_k"], p["heads_kv"], p["magnitude"])
    return q, k, v, values(p["seqlen_q"], p["heads_q"], 1.0)


def run_case(p, attention=hattn_attention, device="cuda", with_fa3=True) -> dict:
    """One case's row of the table: the errors against fp64 of the kernel's gradients (`attention`:
    (out, lse) through autograd), the plain implementation's, the emulation's and its variants'
    (and FA3's where it runs), the bounds, the fp32 slack, and which gradients miss."""
    q, k, v, dout = make_inputs(p, device)
    args = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
    pos = (p["causal"], None, p["window"], p["softcap"])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, p)
    out.backward(dout)
    got = [t.grad for t in leaves]
    out, lse = out.detach(), lse.detach()
    ref_fn = lambda q, k, v: attention_ref(q, k, v, upcast=True, **args)[0]  # noqa: E731
    ref = gradients(ref_fn, q.double(), k.double(), v.double(), dout.double())
    naive = gradients(lambda q, k, v: attention_ref(q, k, v, upcast=False, **args)[0], q, k, v, dout)
    emu_out, emu_lse = emulate_forward(q, k, v, *pos)
    emulated = {
        "emu": emulate_backward(q, k, v, emu_out, emu_lse, dout, *pos),
        "emu_given": emulate_backward(q, k, v, out, lse, dout, *pos),
        "emu_p32": emulate_backward(q, k, v, emu_out, emu_lse, dout, *pos, round_p=False),
        "emu_ds32": emulate_backward(q, k, v, emu_out, emu_lse, dout, *pos, round_ds=False),
        "emu_o32": emulate_backward(q, k, v, attention_ref(q, k, v, upcast=True, **args)[0], emu_lse, dout, *pos),
        "emu_ftz": emulate_backward(q, k, v, emu_out, emu_lse, dout, *pos, flush_subnormals=True),
    }
    if p["softcap"]:
        emulated["emu_tanh"] = emulate_gradients(q, k, v, dout, *pos, tanh="profile", tanh_seed=p["seed"])
    slack = fp32_order_slack(q, k, v, out, lse, dout, *pos)
    fa3 = None
    if with_fa3 and p["dtype"] == torch.bfloat16 and not p["softcap"] and fa3_ready():
        try:
            fa3 = fa3_gradients(q, k, v, dout, p)
        except (RuntimeError, TypeError) as e:  # a case this FA3 build refuses
            print(f"{case_id(p)}: FA3 refused it: {str(e).splitlines()[0]}")
    row = dict(index=p["index"], seed=SEED, case_seed=p["seed"], batch=p["batch"], seqlen_q=p["seqlen_q"],
               seqlen_k=p["seqlen_k"], heads_q=p["heads_q"], heads_kv=p["heads_kv"], head_dim=p["head_dim"],
               dtype=dtype_name(p["dtype"]), causal=int(p["causal"]), window_left=p["window"][0],
               window_right=p["window"][1], softcap=p["softcap"], magnitude=p["magnitude"])  # fmt: skip
    misses = {name: [] for name in ("hattn", "emu", "fa3", "unexplained", "nan")}
    for i, g in enumerate(GRADS):
        err = lambda t: (t.double() - ref[i]).abs().max().item()  # noqa: E731
        naive_err = err(naive[i])
        bound = error_bound(ref[i], naive[i], p["dtype"])
        fa3_bound = 2 * naive_err + fa3_atol(ref[i], p["dtype"], p["softcap"])
        row.update({f"{g}_ref_max": ref[i].abs().max().item(), f"{g}_naive": naive_err, f"{g}_bound": bound,
                    f"{g}_fa3_bound": fa3_bound, f"{g}_slack": slack[i], f"{g}_hattn": err(got[i])})  # fmt: skip
        for name in VARIANTS:
            row[f"{g}_{name}"] = err(emulated[name][i]) if name in emulated else ""
        row[f"{g}_fa3"] = err(fa3[i]) if fa3 is not None else ""
        if not torch.isfinite(got[i]).all():
            misses["nan"].append(g)
        if row[f"{g}_hattn"] > bound:
            misses["hattn"].append(g)
            if row[f"{g}_hattn"] > (1 + TOLERANCE) * row[f"{g}_emu"] + slack[i]:
                misses["unexplained"].append(g)
        if row[f"{g}_emu"] > bound:
            misses["emu"].append(g)
        if fa3 is not None and row[f"{g}_fa3"] > bound:
            misses["fa3"].append(g)
        row[f"{g}_hattn_miss_fa3_bound"] = int(row[f"{g}_hattn"] > fa3_bound)
        row[f"{g}_emu_miss_fa3_bound"] = int(row[f"{g}_emu"] > fa3_bound)
    row.update(hattn_miss=int(bool(misses["hattn"])), emu_miss=int(bool(misses["emu"])),
               unexplained=int(bool(misses["unexplained"])), fa3_miss=int(bool(misses["fa3"])) if fa3 else "",
               missed=" ".join(misses["hattn"]), unexplained_grads=" ".join(misses["unexplained"]),
               nan=" ".join(misses["nan"]))  # fmt: skip
    return row


def check_row(row) -> None:
    """A case fails on NaN or inf, or on a miss the emulation does not explain."""
    assert not row["nan"], f"{row['nan']}: NaN or inf in hattn's gradients"
    assert not row["unexplained"], "; ".join(
        f"{g}: hattn's error {row[f'{g}_hattn']:.3e} > bound {row[f'{g}_bound']:.3e}, and > {1 + TOLERANCE:g} x the "
        f"emulation's {row[f'{g}_emu']:.3e} + fp32 slack {row[f'{g}_slack']:.2e} (the emulation with dS in fp32: "
        f"{row[f'{g}_emu_ds32']:.3e}, P in fp32: {row[f'{g}_emu_p32']:.3e}, from hattn's out and lse: "
        f"{row[f'{g}_emu_given']:.3e})"
        for g in row["unexplained_grads"].split()
    )


def write_table(rows, path) -> None:
    """The rows as CSV at path (its folder made)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)


def summary(rows) -> str:
    """Misses per dtype and softcap: hattn's, the emulation's, the unexplained; FA3's where it ran."""
    parts = []
    for dtype in ("bf16", "fp16"):
        for capped in (False, True):
            sel = [r for r in rows if r["dtype"] == dtype and bool(r["softcap"]) == capped]
            parts.append(f"{dtype}{' softcap' if capped else ''}: {len(sel)} cases, hattn missed "
                         f"{sum(r['hattn_miss'] for r in sel)}, the emulation {sum(r['emu_miss'] for r in sel)}, "
                         f"unexplained {sum(r['unexplained'] for r in sel)}")  # fmt: skip
    fa3_rows = [r for r in rows if r["fa3_miss"] != ""]
    if fa3_rows:
        parts.append(f"FA3 ran {len(fa3_rows)}: FA3 missed {sum(r['fa3_miss'] for r in fa3_rows)}, hattn "
                     f"{sum(r['hattn_miss'] for r in fa3_rows)}")  # fmt: skip
    return "; ".join(parts)


@pytest.fixture(scope="module")
def table():
    """The cases' rows; at the end, a summary and the CSV at HATTN_PRECISION_OUT."""
    rows = []
    yield rows
    if rows:
        print(f"\nprecision (seed {SEED}, {len(rows)} cases): {summary(rows)}")
        if OUT:
            write_table(rows, OUT)


@requires_hopper
@pytest.mark.parametrize("p", CASE_PARAMS, ids=[case_id(p) for p in CASE_PARAMS])
def test_backward_precision(p, table):
    row = run_case(p)
    table.append(row)
    check_row(row)


@pytest.mark.skipif(hopper_skip_reason() is not None, reason=hopper_skip_reason() or "")
def test_no_more_misses_than_fa3(table):
    """bf16 without softcap, where FA3 ran (HATTN_FA3_LIB): hattn misses no more cases than FA3."""
    fa3_rows = [r for r in table if r["fa3_miss"] != ""]
    if not fa3_rows:
        pytest.skip("FlashAttention-3 not given (HATTN_FA3_LIB), or no bf16 case without softcap ran")
    hattn_misses = sum(r["hattn_miss"] for r in fa3_rows)
    fa3_misses = sum(r["fa3_miss"] for r in fa3_rows)
    assert hattn_misses <= fa3_misses, f"{len(fa3_rows)} cases: hattn missed {hattn_misses}, FA3 {fa3_misses}"


# ---------------------------------------------------------------------------------------------
# CPU: the GPU test's pipeline, with the emulation standing in for the kernel


class _EmulatedAttention(torch.autograd.Function):
    """(out, lse) of emulate_forward, gradients of emulate_backward: the kernel's stand-in."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, softcap):
        out, lse = emulate_forward(q, k, v, causal, None, window, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, None, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*emulate_backward(q, k, v, out, lse, dout.contiguous(), *ctx.args), None, None, None)


def emulated_attention(q, k, v, p):
    return _EmulatedAttention.apply(q, k, v, p["causal"], p["window"], p["softcap"])


def test_pipeline_on_the_cpu_with_the_emulation_as_kernel(tmp_path):
    """run_case, check_row, summary and write_table on small drawn cases (lengths up to 40, D 64)
    with the emulation in the kernel's place: no unexplained miss, a row per case, the CSV."""
    rows = []
    for p in case_params(7, 40):
        p = dict(p, head_dim=64, seqlen_q=min(p["seqlen_q"], 40), seqlen_k=min(p["seqlen_k"], 40))
        row = run_case(p, emulated_attention, device="cpu", with_fa3=False)
        check_row(row)
        assert row["dq_hattn"] == row["dq_emu"] and row["dv_hattn"] == row["dv_emu"]  # the same computation
        assert all(row[f"{g}_bound"] > 0 and row[f"{g}_slack"] >= 0 for g in GRADS)
        assert (row["dq_emu_tanh"] == "") == (not p["softcap"])
        rows.append(row)
    assert "bf16:" in summary(rows) and "fp16 softcap:" in summary(rows)
    write_table(rows, tmp_path / "sub" / "precision.csv")
    with open(tmp_path / "sub" / "precision.csv") as f:
        read = list(csv.DictReader(f))
    assert len(read) == len(rows) and float(read[0]["dq_bound"]) == rows[0]["dq_bound"]
