"""A randomized test over the forward's contract (issue 55): each case draws a problem from
everything hattn.attention takes, runs "auto" and checks it against the fp64 reference with
FlashAttention's criterion (at most twice the error of a plain same-precision implementation,
plus half an ulp at the largest output; helpers.error_bound). NaN fails.

The draw covers batch 1-3, lengths 1-300 (equal or not), D 64/128/256, bf16 and fp16, GQA 1-8,
causal or not, sliding windows, softcap, keys in use per sequence (seqlens_k, some sequences
with none), split counts, input magnitudes 1-10 and three layouts: contiguous, a strided view
of a wider buffer, and BHSD storage. GPU only: it skips with the reason elsewhere.

    HATTN_CONTRACT_SEED=N    the seed (printed in each case's id; default fixed)
    HATTN_CONTRACT_CASES=N   how many cases (default 96: the quick part; the long part: 10000)
"""

import math
import os
import random

import hattn
import pytest
import torch
from helpers import attention_ref, error_bound, lse_bound, requires_hopper, row_sum_atol

pytestmark = requires_hopper

SEED = int(os.environ.get("HATTN_CONTRACT_SEED", "20261204"))
CASES = int(os.environ.get("HATTN_CONTRACT_CASES", "96"))


def draw(rng: random.Random) -> dict:
    """One problem: shapes, options and the layout of its inputs."""
    head_dim = rng.choice((64, 128, 256))
    heads_kv = rng.choice((1, 2, 4))
    group = rng.choice((1, 1, 2, 4, 8))
    seqlen_q = rng.randint(1, 300)
    seqlen_k = seqlen_q if rng.random() < 0.4 else rng.randint(1, 300)
    causal = rng.random() < 0.5
    window = (-1, -1)
    if rng.random() < 0.3:
        left = rng.choice((-1, rng.randint(0, 128)))
        right = 0 if causal else rng.choice((-1, rng.randint(0, 128)))
        window = (left, right) if (left, right) != (-1, -1) else (rng.randint(0, 64), -1)
    return dict(
        batch=rng.randint(1, 3), seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_kv * group, heads_kv=heads_kv,
        head_dim=head_dim, dtype=rng.choice((torch.bfloat16, torch.float16)), causal=causal, window=window,
        softcap=rng.choice((0.0, 0.0, rng.uniform(5.0, 50.0))), magnitude=rng.choice((1.0, 3.0, 10.0)),
        layout=rng.choice(("contiguous", "strided", "bhsd")), seqlens_k=rng.random() < 0.25,
        num_splits=rng.choice((0, 0, 1, 3)), seed=rng.randrange(1 << 30),
    )  # fmt: skip


def make(seqlen, heads, p, gen):
    """A [B, seqlen, heads, D] input in the drawn layout, values ~ magnitude * (randn + 0.5)."""
    b, d = p["batch"], p["head_dim"]

    def values(*size):
        return (torch.randn(*size, device="cuda", generator=gen) + 0.5).mul_(p["magnitude"]).to(p["dtype"])

    if p["layout"] == "strided":  # the first heads of a wider buffer: strided, not contiguous
        return values(b, seqlen, heads + 3, d)[:, :, :heads]
    if p["layout"] == "bhsd":
        return values(b, heads, seqlen, d).transpose(1, 2)
    return values(b, seqlen, heads, d)


CASE_PARAMS = [draw(random.Random(SEED * 100003 + i)) for i in range(CASES)]


def case_id(p) -> str:
    dtype = "bf16" if p["dtype"] == torch.bfloat16 else "fp16"
    extras = [f"w{p['window'][0]}x{p['window'][1]}"] if p["window"] != (-1, -1) else []
    extras += ["causal"] if p["causal"] else []
    extras += [f"cap{p['softcap']:.0f}"] if p["softcap"] else []
    extras += ["seqlensk"] if p["seqlens_k"] else []
    extras += ["det"] if p.get("deterministic") else []
    return (f"seed{SEED}-B{p['batch']}-Sq{p['seqlen_q']}-Sk{p['seqlen_k']}-H{p['heads_q']}x{p['heads_kv']}"
            f"-D{p['head_dim']}-{dtype}-{p['layout']}-m{p['magnitude']:g}-" + "-".join(extras))  # fmt: skip


@pytest.mark.parametrize("p", CASE_PARAMS, ids=[case_id(p) for p in CASE_PARAMS])
def test_forward_matches_fp64_reference(p):
    gen = torch.Generator(device="cuda").manual_seed(p["seed"])
    q = make(p["seqlen_q"], p["heads_q"], p, gen)
    k = make(p["seqlen_k"], p["heads_kv"], p, gen)
    v = make(p["seqlen_k"], p["heads_kv"], p, gen)
    used = None
    if p["seqlens_k"]:  # keys in use per sequence, some with none
        lens = [random.Random(p["seed"] + b).randint(0, p["seqlen_k"]) for b in range(p["batch"])]
        used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    # NaN where the output will be: torch's caching allocator hands the freed block to the
    # output (800 of 800 calls on an H100: results/evidence/sanitize_contract_270ac8d/), so an
    # element the kernels leave unwritten stays NaN and fails below.
    poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    del poison
    out, lse = hattn.attention(q, k, v, causal=p["causal"], window_size=p["window"], softcap=p["softcap"],
                               return_lse=True, seqlens_k=used, num_splits=p["num_splits"])  # fmt: skip
    assert out.shape == q.shape and lse.shape == (p["batch"], p["heads_q"], p["seqlen_q"])
    assert not torch.isnan(out).any(), "NaN in the output (an element left unwritten, or computed as NaN)"
    for b in range(p["batch"]):
        keys = p["seqlen_k"] if used is None else int(used[b])
        ob, lb = out[b], lse[b]
        if keys == 0:  # no keys in use: every row gives 0 and -inf
            assert (ob == 0).all() and torch.isneginf(lb).all(), f"batch {b}: a sequence without keys"
            continue
        qb, kb, vb = q[b : b + 1], k[b : b + 1, :keys], v[b : b + 1, :keys]
        args = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
        ref_out, ref_lse = attention_ref(qb, kb, vb, upcast=True, **args)
        naive_out, naive_lse = attention_ref(qb, kb, vb, upcast=False, **args)
        err = (ob.double() - ref_out[0]).abs().max().item()
        bound = error_bound(ref_out[0], naive_out[0], p["dtype"])
        assert err <= bound, f"batch {b} ({keys} keys): out max error {err:.3e} > bound {bound:.3e}"
        dead = torch.isneginf(ref_lse[0])
        assert torch.equal(torch.isneginf(lb), dead), f"batch {b}: rows without keys must be exactly the -inf ones"
        if (~dead).any():
            lerr = (lb.double() - ref_lse[0])[~dead].abs().max().item()
            lbound = lse_bound(ref_lse[0][~dead], naive_lse[0][~dead])
            assert lerr <= lbound, f"batch {b}: lse max error {lerr:.3e} > bound {lbound:.3e}"
        assert math.isfinite(err)


BWD_CASES = int(os.environ.get("HATTN_CONTRACT_BWD_CASES", "32"))


def draw_backward(rng: random.Random) -> dict:
    """draw()'s problem without what the backward lacks (seqlens_k; num_splits is the forward's),
    and a quarter of them with the deterministic backward (not at D = 256 with GQA, which it
    refuses); the draw itself is unchanged, so earlier cases stay the same."""
    p = dict(draw(rng), seqlens_k=False, num_splits=0)
    p["deterministic"] = p["seed"] % 4 == 0 and not (p["head_dim"] == 256 and p["heads_q"] != p["heads_kv"])
    return p


BWD_PARAMS = [draw_backward(random.Random(SEED * 100019 + i)) for i in range(BWD_CASES)]


@pytest.mark.parametrize("p", BWD_PARAMS, ids=[case_id(p) for p in BWD_PARAMS])
def test_backward_matches_fp64_reference(p):
    """dq, dk, dv through autograd ("auto"; some cases with deterministic=True), each within twice
    the error of the same-precision implementation's gradients plus half an ulp at the largest
    (error_bound), against fp64's; dq and dk also get the fp32 noise of dP - rowsum(dO * O),
    which the other two never see where a row has one key (row_sum_atol)."""
    gen = torch.Generator(device="cuda").manual_seed(p["seed"])
    q = make(p["seqlen_q"], p["heads_q"], p, gen)
    k = make(p["seqlen_k"], p["heads_kv"], p, gen)
    v = make(p["seqlen_k"], p["heads_kv"], p, gen)
    dout = make(p["seqlen_q"], p["heads_q"], dict(p, layout="contiguous", magnitude=1.0), gen)
    args = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])

    def grads(fn, *inputs):
        """fn's output and the gradients of q, k and v."""
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(dout.to(leaves[0].dtype))
        return out.detach(), [t.grad for t in leaves]

    _, got = grads(lambda q, k, v: hattn.attention(q, k, v, causal=p["causal"], window_size=p["window"],
                                                    softcap=p["softcap"], deterministic=p["deterministic"]),
                   q, k, v)  # fmt: skip
    out_ref, ref = grads(lambda q, k, v: attention_ref(q, k, v, upcast=True, **args)[0],
                         q.double(), k.double(), v.double())  # fmt: skip
    _, naive = grads(lambda q, k, v: attention_ref(q, k, v, upcast=False, **args)[0], q, k, v)
    slack = (*row_sum_atol(q, k, dout, out_ref), 0.0)
    for name, g, r, n, extra in zip(("dq", "dk", "dv"), got, ref, naive, slack):
        assert g.shape == r.shape and torch.isfinite(g).all(), f"{name}: shape or not finite"
        err = (g.double() - r).abs().max().item()
        bound = error_bound(r, n, p["dtype"]) + extra
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
