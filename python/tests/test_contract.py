"""A randomized test over the contract (issue 55): each case draws a problem from everything
the ops take, runs "auto" and checks it against the fp64 reference with FlashAttention's
criterion (at most twice the error of a plain same-precision implementation, plus half an ulp at
the largest output; helpers.error_bound). NaN fails, and so does an output element left
unwritten (the output's memory holds NaN before the call).

hattn.attention, forward and backward: batch 1-3, lengths 1-300 (equal or not), D 64/128/256,
bf16 and fp16, GQA 1-8, causal or not, sliding windows, softcap, keys in use per sequence
(seqlens_k, some sequences with none), split counts, input magnitudes 1-10 and three layouts:
contiguous, a strided view of a wider buffer, and BHSD storage; a quarter of the backward cases
deterministic. Then CASES // 4 cases each of: KV caches (paged with shuffled block tables,
kv_batch_idx, dense cache entries with left padding, NaN outside the keys), variable-length
batches with empty sequences (attention_varlen), and FP8 (attention_fp8, with or without
descales). GPU only: it skips with the reason elsewhere.

    HATTN_CONTRACT_SEED=N       the seed (printed in each case's id; default fixed)
    HATTN_CONTRACT_CASES=N      dense forward cases (default 96: the quick part; the long part:
                                10000), and N // 4 of each of the three others
    HATTN_CONTRACT_BWD_CASES=N  backward cases (default 32; the long part: 2000)
"""

import functools
import math
import os
import random

import hattn
import pytest
import torch
from helpers import (INPUT_MEAN, attention_ref, check_sequence, error_bound, gpu_varlen, lse_bound, requires_hopper,
                     row_sum_atol)
from test_fp8 import run_and_check as fp8_run_and_check
from test_paged import cache_entries, check_paged, check_sequences, make_paged

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


def nan_where_the_output_goes(q: torch.Tensor) -> None:
    """Frees a block of q's size filled with NaN: torch's caching allocator hands it to the op's
    output (800 of 800 calls on an H100: results/evidence/sanitize_contract_270ac8d/), so an
    element the kernels leave unwritten stays NaN and fails the test's NaN check."""
    poison = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    del poison


def dtype_id(p) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p["dtype"], "e4m3")


def options_id(p) -> list:
    """The id's words for the window, the causal mask and softcapping."""
    options = [f"w{p['window'][0]}x{p['window'][1]}"] if p["window"] != (-1, -1) else []
    options += ["causal"] if p["causal"] else []
    options += [f"cap{p['softcap']:.0f}"] if p["softcap"] else []
    return options


def case_id(p) -> str:
    dtype = dtype_id(p)
    extras = options_id(p)
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
    nan_where_the_output_goes(q)
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
    and a quarter of them with the deterministic backward; the draw itself is unchanged, so earlier
    cases stay the same."""
    p = dict(draw(rng), seqlens_k=False, num_splits=0)
    p["deterministic"] = p["seed"] % 4 == 0
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


# --- the rest of the contract: KV caches, variable-length batches, FP8 ---------------------------
#
# CASES // 4 problems each (the quick part: 24; the long part's 10,000: 2,500), checked with the
# helpers of the features' own tests: each sequence against the fp64 reference on its keys alone
# (check_sequence: FlashAttention's criterion; rows that see no key give 0 and -inf), FP8 against
# its dequantized inputs (test_fp8.run_and_check).

FEATURE_CASES = max(1, CASES // 4)


def draw_lengths(rng: random.Random, batch: int, longest: int) -> list:
    """Lengths 1 .. longest, about one in six of them 0 instead."""
    return [0 if rng.random() < 1 / 6 else rng.randint(1, longest) for _ in range(batch)]


def feature_id(p, *parts) -> str:
    """A case's id: the seed, the problem's heads, D, dtype and options, then `parts`."""
    return "-".join([f"seed{SEED}", f"H{p['heads_q']}x{p['heads_kv']}", f"D{p['head_dim']}", dtype_id(p),
                     *options_id(p), *parts])  # fmt: skip


def lengths_id(lens) -> str:
    return "x".join(map(str, lens))


def draw_cache(rng: random.Random) -> dict:
    """A decoding or chunked-prefill problem over a KV cache of 1-4 sequences (0-1000 keys):
    paged (a shuffled block table; with kv_batch_idx, its rows at shuffled places of a table with
    two spare rows), or dense cache entries (bf16; with kv_batch_idx, 0-2 spare entries; left
    padding of 0 .. the length), NaN everywhere outside the sequences' keys."""
    p = draw(rng)
    batch = rng.randint(1, 4)
    lens = draw_lengths(rng, batch, 1000)
    p.update(batch=batch, seqlen_q=rng.choice((1, 1, 2, 4, rng.randint(1, 64))), lens=lens,
             paged=rng.random() < 0.5, page_size=rng.choice((128, 256)), entries=rng.random() < 0.5)  # fmt: skip
    if not p["paged"]:
        p.update(dtype=torch.bfloat16, pads=[rng.randint(0, n) if rng.random() < 0.5 else 0 for n in lens],
                 spare=rng.randint(0, 2) if p["entries"] else 0)  # fmt: skip
    return p


CACHE_PARAMS = [draw_cache(random.Random(SEED * 100043 + i)) for i in range(FEATURE_CASES)]


def cache_id(p) -> str:
    kind = f"paged{p['page_size']}" if p["paged"] else f"entries-pad{lengths_id(p['pads'])}"
    splits = [f"splits{p['num_splits']}"] if p["num_splits"] else []
    return feature_id(p, f"Sq{p['seqlen_q']}", f"lens{lengths_id(p['lens'])}", kind,
                      *(["idx"] if p["entries"] else []), *splits)  # fmt: skip


@pytest.mark.parametrize("p", CACHE_PARAMS, ids=[cache_id(p) for p in CACHE_PARAMS])
def test_kv_cache_matches_fp64_reference(p):
    lens, seed = p["lens"], p["seed"]
    options = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
    if p["paged"]:
        q, k_cache, v_cache, table, seqlens_k = make_paged(
            lens, p["seqlen_q"], p["heads_q"], p["heads_kv"], p["head_dim"], p["dtype"], p["page_size"], seed=seed
        )  # fmt: skip
        rows, index = table, None
        if p["entries"]:
            order = torch.randperm(len(lens) + 2, generator=torch.Generator().manual_seed(seed))[: len(lens)]
            rows = torch.zeros(len(lens) + 2, table.shape[1], dtype=torch.int32, device="cuda")
            rows[order.cuda()] = table
            index = order.to(torch.int32).cuda()
        nan_where_the_output_goes(q)
        out, lse = hattn.attention_paged(q, k_cache, v_cache, rows, seqlens_k, causal=p["causal"], return_lse=True,
                                         window_size=p["window"], num_splits=p["num_splits"], kv_batch_idx=index,
                                         softcap=p["softcap"])  # fmt: skip
        torch.cuda.synchronize()
        check_paged(q, k_cache, v_cache, table, lens, out, lse, **options)
        return
    entries = len(lens) + p["spare"]
    index = random.Random(seed).sample(range(entries), len(lens)) if p["entries"] else list(range(len(lens)))
    k, v = cache_entries(entries, max(max(lens), 1), lens, p["pads"], index, p["heads_kv"], p["head_dim"], seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(len(lens), p["seqlen_q"], p["heads_q"], p["head_dim"], device="cuda", dtype=torch.bfloat16,
                    generator=gen) + INPUT_MEAN  # fmt: skip
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device="cuda")
    seqlens_k, entry_index, pads = i32(lens), i32(index) if p["entries"] else None, i32(p["pads"])
    nan_where_the_output_goes(q)  # after every allocation before the call's own
    out, lse = hattn.attention(q, k, v, causal=p["causal"], return_lse=True, window_size=p["window"],
                               softcap=p["softcap"], seqlens_k=seqlens_k, num_splits=p["num_splits"],
                               kv_batch_idx=entry_index, leftpad_k=pads)  # fmt: skip
    torch.cuda.synchronize()
    keys = [k[e, pad:n] for e, pad, n in zip(index, p["pads"], lens)]
    values = [v[e, pad:n] for e, pad, n in zip(index, p["pads"], lens)]
    check_sequences(q, keys, values, out, lse, **options)


def draw_varlen(rng: random.Random) -> dict:
    """A packed batch of 1-6 sequences of 0-400 queries and 0-400 keys (about two in five with
    as many keys as queries)."""
    p = draw(rng)
    batch = rng.randint(1, 6)
    lens_q = draw_lengths(rng, batch, 400)
    lens_k = [n if rng.random() < 0.4 else m for n, m in zip(lens_q, draw_lengths(rng, batch, 400))]
    return dict(p, batch=batch, lens_q=lens_q, lens_k=lens_k)


VARLEN_PARAMS = [draw_varlen(random.Random(SEED * 100057 + i)) for i in range(FEATURE_CASES)]


@pytest.mark.parametrize(
    "p", VARLEN_PARAMS, ids=[feature_id(p, f"q{lengths_id(p['lens_q'])}", f"k{lengths_id(p['lens_k'])}")
                             for p in VARLEN_PARAMS])  # fmt: skip
def test_varlen_matches_fp64_reference(p):
    lens_q, lens_k = p["lens_q"], p["lens_k"]
    torch.manual_seed(p["seed"])  # gpu_varlen draws from the global generator
    q, k, v, cu_q, cu_k, max_q, max_k = gpu_varlen(lens_q, lens_k, p["heads_q"], p["heads_kv"], p["head_dim"],
                                                   p["dtype"])  # fmt: skip
    nan_where_the_output_goes(q)
    out, lse = hattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=p["causal"], return_lse=True,
                                      window_size=p["window"], softcap=p["softcap"])  # fmt: skip
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (p["heads_q"], sum(lens_q))
    assert not torch.isnan(out).any(), "NaN in the output (an element left unwritten, or computed as NaN)"
    q0 = k0 = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq:
            check_sequence(out[q0 : q0 + sq], lse[:, q0 : q0 + sq], q[q0 : q0 + sq], k[k0 : k0 + sk],
                           v[k0 : k0 + sk], p["causal"], None, p["window"], f"sequence {b}", p["softcap"])  # fmt: skip
        q0, k0 = q0 + sq, k0 + sk


def draw_fp8(rng: random.Random) -> dict:
    """An e4m3 problem: 1-2 sequences, 1-300 queries, 1-600 keys, causal or not, descales or none
    (FP8 has no window or softcap)."""
    p = draw(rng)
    return dict(p, batch=rng.randint(1, 2), seqlen_k=rng.randint(1, 600), with_descales=rng.random() < 0.7,
                window=(-1, -1), softcap=0.0)  # fmt: skip


FP8_PARAMS = [draw_fp8(random.Random(SEED * 100069 + i)) for i in range(FEATURE_CASES)]


@pytest.mark.parametrize(
    "p", FP8_PARAMS, ids=[feature_id(dict(p, dtype=None), f"B{p['batch']}", f"Sq{p['seqlen_q']}",
                                     f"Sk{p['seqlen_k']}", *(["descales"] if p["with_descales"] else []))
                          for p in FP8_PARAMS])  # fmt: skip
def test_fp8_matches_fp64_reference(p):
    fp8_run_and_check(p["batch"], p["seqlen_q"], p["seqlen_k"], p["heads_q"], p["heads_kv"], p["causal"],
                      p["with_descales"], seed=p["seed"], head_dim=p["head_dim"])  # fmt: skip
