"""hattn.distributed: sequence-parallel attention (Ulysses, ring, both) over torch.distributed.

On the CPU: the LSE merge (rows without keys included), the sharding helpers, the refusals, and
real multi-process runs over gloo (one spawn of 4 processes: world 4, and two world-2 groups at
once) comparing each strategy's output, LSE and gradients on every rank with fp64 attention of
the full tensors. The ranks run an injected CPU attention (ref_forward / ref_backward below,
fp64 math) with the signatures of hattn's ops, so the distributed logic is tested without a GPU.
On a Hopper GPU: a group of one through the same code with hattn's kernels, against hattn.attention.
Several GPUs: python/hattn/distributed_check.py under torchrun.
"""

from __future__ import annotations

import datetime
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hattn
from hattn import distributed as hd
from helpers import attention_ref, hopper_skip_reason, requires_hopper, visible_mask

# ---------------------------------------------------------------------------------------------
# The injected attention: fp64 math in torch with the signatures of hattn's ops
# ---------------------------------------------------------------------------------------------


def ref_forward(q, k, v, causal, softmax_scale, window_left, window_right, softcap):
    """(out in q's dtype, lse [B, Hq, Sq]) of attention_ref (fp64); lse fp32, fp64 for fp64 inputs."""
    with torch.no_grad():
        out, lse = attention_ref(q, k, v, causal, softmax_scale, True, (window_left, window_right), softcap)
    return out.to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def ref_backward(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap):
    """(dq, dk, dv) from the given out and lse, as the kernels compute them: P = exp(s - lse),
    delta = rowsum(dout * out), dS = P (dP - delta) (times the softcap's tanh derivative)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    f64 = torch.float64
    qh = q.to(f64).transpose(1, 2)  # [B, Hq, Sq, D]
    kh = k.to(f64).transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.to(f64).transpose(1, 2).repeat_interleave(group, dim=1)
    do, o = dout.to(f64).transpose(1, 2), out.to(f64).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap > 0:
        tanh = torch.tanh(s / softcap)
        s = softcap * tanh
    lse = lse.to(f64)[..., None]
    visible = visible_mask(seqlen_q, seqlen_k, causal, (window_left, window_right)) & torch.isfinite(lse)
    p = torch.where(visible, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), 0.0)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vh.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    if softcap > 0:
        ds = ds * (1 - tanh * tanh)
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale

    def per_kv_head(t):  # [B, Hq, Sk, D] -> [B, Sk, Hkv, D], summed over each K/V head's query heads
        return t.reshape(batch, heads_kv, group, seqlen_k, head_dim).sum(2).transpose(1, 2)

    return dq.transpose(1, 2).to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


REF = hd.LocalAttention(ref_forward, ref_backward)


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype) + 0.5

    q = rand(batch, seqlen_q, heads_q, head_dim)
    k, v = rand(batch, seqlen_k, heads_kv, head_dim), rand(batch, seqlen_k, heads_kv, head_dim)
    return q, k, v, rand(batch, seqlen_q, heads_q, head_dim)


# ---------------------------------------------------------------------------------------------
# In one process: merge, sharding, refusals
# ---------------------------------------------------------------------------------------------


def test_ref_backward_matches_autograd():
    """The injected backward (from out and lse) equals autograd through the fp64 reference."""
    q, k, v, dout = _inputs(2, 7, 9, 4, 2, 8)
    for causal, window, softcap in ((True, (3, -1), 0.0), (False, (2, 1), 1.5), (True, (-1, -1), 2.0)):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = attention_ref(qg, kg, vg, causal, None, True, window, softcap)
        out.backward(dout)
        got = ref_backward(dout, q, k, v, out.detach(), lse.detach(), causal, None, *window, softcap)
        for g, w in zip(got, (qg.grad, kg.grad, vg.grad)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_merge_equals_attention_over_all_keys():
    """Attention over key blocks merged by LSE equals attention over all keys; rows that see no
    key in a block (lse -inf, out 0), and rows that see none at all, stay finite and exact."""
    q, k, v, _ = _inputs(2, 6, 12, 4, 2, 8)
    # Causal with Sk > Sq and a window: early blocks are invisible to some rows, and rows 0..1 see
    # no key in the first block; window (0, 0) with Sq > Sk leaves whole rows without keys.
    for seqlen_k, causal, window in ((12, True, (2, -1)), (4, False, (0, 0))):
        kk, vv = k[:, :seqlen_k], v[:, :seqlen_k]
        want_out, want_lse = attention_ref(q, kk, vv, causal, None, True, window)
        blocks = [slice(0, seqlen_k // 2), slice(seqlen_k // 2, seqlen_k)]
        vis = visible_mask(q.shape[1], seqlen_k, causal, window)
        parts = []
        for b in blocks:  # each block's own (out, lse) under the full problem's mask
            s = torch.einsum("bqhd,bkhd->bhqk", q, kk.repeat_interleave(2, 2)[:, b]) / math.sqrt(8)
            s = s.masked_fill(~vis[:, b], float("-inf"))
            lse = torch.logsumexp(s, -1)
            p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
            parts.append((torch.einsum("bhqk,bkhd->bqhd", p, vv.repeat_interleave(2, 2)[:, b]), lse))
        assert any(torch.isneginf(lse).any() for _, lse in parts), "the case must have rows without keys in a block"
        out, lse = hd.merge_attention(parts)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)  # -inf where want has it
    # All -inf: out stays 0, lse -inf; fp32 parts merge in fp32.
    zero = torch.zeros(1, 3, 2, 4)
    none = torch.full((1, 2, 3), float("-inf"))
    out, lse = hd.merge_attention([(zero, none), (zero, none)])
    assert out.dtype == torch.float32 and (out == 0).all() and torch.isneginf(lse).all()


def test_zigzag_round_trip_and_layout():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3, 4):
        parts = [hd.zigzag_shard(x, r, world) for r in range(world)]
        chunk = 24 // (2 * world)
        for r, p in enumerate(parts):  # rank r: chunks r and 2W-1-r
            want = torch.cat([x[:, r * chunk : (r + 1) * chunk], x[:, (2 * world - 1 - r) * chunk : (2 * world - r) * chunk]], 1)
            assert torch.equal(p, want)
        assert torch.equal(hd.zigzag_unshard(parts), x)
    y = x.transpose(1, 2)  # the sequence in dim 2
    assert torch.equal(hd.zigzag_unshard([hd.zigzag_shard(y, r, 3, dim=2) for r in range(3)], dim=2), y)
    with pytest.raises(ValueError, match="multiple of 2 \\* world"):
        hd.zigzag_shard(x, 0, 5)


@pytest.mark.parametrize("layout", hd.LAYOUTS)
def test_ring_blocks_are_the_causal_mask(layout):
    """Each ring step's one call (rows, keys, causal or not) covers exactly the query-key pairs the
    global causal mask allows between this rank's and the source rank's tokens: the zigzag reasoning,
    checked on the positions for worlds 1 to 6."""
    for world in range(1, 7):
        seqlen = 2 * world * 3
        positions = [hd.usp_shard(torch.arange(seqlen), 0, 1, r, world, layout, dim=0) for r in range(world)]
        for rank in range(world):
            for src in range(world):
                want = positions[src][None, :] <= positions[rank][:, None]  # [local q, local k]
                got = torch.zeros_like(want)
                blk = hd._block(layout, True, rank, src, len(positions[rank]), len(positions[src]))
                if blk is not None:
                    rows = torch.arange(len(positions[rank]))[blk.q_rows]
                    cols = torch.arange(len(positions[src]))[blk.kv_rows]
                    shift = len(cols) - len(rows)  # bottom-right alignment of the call's causal mask
                    seen = cols[None, :] - cols[0] <= rows[:, None] - rows[0] + shift if blk.causal else True
                    got[rows[:, None], cols[None, :]] = seen
                assert torch.equal(got, want), f"{layout} world {world}: rank {rank}, block of rank {src}"


@pytest.mark.parametrize("layout", hd.LAYOUTS)
def test_usp_shard_round_trip(layout):
    x = torch.randn(1, 48, 2, 4)
    for ulysses, ring in ((1, 4), (4, 1), (2, 2), (2, 3), (3, 2)):
        parts = [hd.usp_shard(x, rank % ulysses, ulysses, rank // ulysses, ring, layout) for rank in range(ulysses * ring)]
        assert torch.equal(hd.usp_unshard(parts, ulysses, ring, layout), x)
        if ring == 1:  # Ulysses alone: contiguous shards
            assert torch.equal(torch.cat(parts, 1), x)
    # Ulysses' contiguous shards inside zigzag ring pieces:
    parts = [hd.usp_shard(x, rank % 2, 2, rank // 2, 2, "zigzag") for rank in range(4)]
    assert torch.equal(torch.cat(parts[:2], 1), hd.zigzag_shard(x, 0, 2))


def test_ulysses_head_rules():
    assert hd._ulysses_kv_repeats(8, 8, 4) == 1  # K/V heads split
    assert hd._ulysses_kv_repeats(8, 2, 4) == 2  # replicated twice
    assert hd._ulysses_kv_repeats(8, 1, 8) == 8  # MQA
    with pytest.raises(ValueError, match=r"query heads \(6\).*world size \(4\)"):
        hd._ulysses_kv_repeats(6, 6, 4)
    with pytest.raises(ValueError, match=r"K/V heads \(3\).*world size \(4\)"):
        hd._ulysses_kv_repeats(12, 3, 4)


def test_ring_refusals():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8)
    with pytest.raises(NotImplementedError, match="no sliding window"):
        hd.ring_attention(q, k, v, window_size=(4, 0), causal=True, local_attention=REF)
    with pytest.raises(NotImplementedError, match="no sliding window"):
        hd.usp_attention(q, k, v, None, None, window_size=(4, 4), local_attention=REF)
    with pytest.raises(ValueError, match="layout"):
        hd.ring_attention(q, k, v, layout="striped", local_attention=REF)
    with pytest.raises(ValueError, match="same length"):
        hd.ring_attention(q, k[:, :4], v[:, :4], causal=True, local_attention=REF)


def test_exported():
    assert hattn.distributed is hd
    for name in hd.__all__:
        assert hasattr(hd, name), name


# ---------------------------------------------------------------------------------------------
# Several processes over gloo
# ---------------------------------------------------------------------------------------------

B, D, HQ = 2, 8, 4
SEQ = 16  # a multiple of 2 * 4 (zigzag over 4 ranks) and of 2 * 2 * 2 (usp 2 x 2 zigzag)

# name: (world, strategy, layout, causal, Hkv, window, softcap, Sk) ; Sk != SEQ: cross-attention
CASES = {
    "w2_ulysses_causal_gqa_split": (2, "ulysses", "contiguous", True, 2, (-1, -1), 0.0, SEQ),
    "w2_ulysses_window_softcap_mqa_replicate": (2, "ulysses", "contiguous", False, 1, (3, 1), 2.0, SEQ),
    "w2_ring_zigzag_causal_gqa": (2, "ring", "zigzag", True, 2, (-1, -1), 0.0, SEQ),
    "w2_ring_contiguous_cross_softcap_mqa": (2, "ring", "contiguous", False, 1, (-1, -1), 2.0, 24),
    "w4_ulysses_causal_window_gqa_replicate": (4, "ulysses", "contiguous", True, 2, (5, -1), 0.0, SEQ),
    "w4_ulysses_noncausal_mha": (4, "ulysses", "contiguous", False, 4, (-1, -1), 0.0, SEQ),
    "w4_ring_zigzag_causal_softcap_mqa": (4, "ring", "zigzag", True, 1, (-1, -1), 2.0, SEQ),
    "w4_ring_contiguous_causal_gqa": (4, "ring", "contiguous", True, 2, (-1, -1), 0.0, SEQ),
    "w4_ring_zigzag_noncausal_mha": (4, "ring", "zigzag", False, 4, (-1, -1), 0.0, SEQ),
    "w4_usp2x2_zigzag_causal_gqa": (4, "usp", "zigzag", True, 2, (-1, -1), 0.0, SEQ),
    "w4_usp2x2_contiguous_softcap_mqa": (4, "usp", "contiguous", False, 1, (-1, -1), 2.0, SEQ),
}
TOL = 1e-9  # fp64 throughout: only the order of the sums differs from the one-process reference


def _run_case(case, groups):
    """This rank's largest errors (out, lse, dq, dk, dv) against fp64 attention of the full tensors."""
    world, strategy, layout, causal, heads_kv, window, softcap, seqlen_k = case
    q, k, v, dout = _inputs(B, SEQ, seqlen_k, HQ, heads_kv, D, seed=len(str(case)))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = attention_ref(*full, causal, None, True, window, softcap)
    want_out.backward(dout)
    wants = {"out": want_out.detach(), "lse": want_lse, "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}

    if strategy == "usp":
        ulysses_group, ring_group = groups["usp"]
        u, r = dist.get_rank(ulysses_group), dist.get_rank(ring_group)

        def shard(t, dim=1):
            return hd.usp_shard(t, u, 2, r, 2, layout, dim)
    else:
        group = groups[world]
        rank = dist.get_rank(group)

        def shard(t, dim=1):
            return hd.usp_shard(t, 0, 1, rank, world, layout, dim)

    mine = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(causal=causal, softcap=softcap, return_lse=True, local_attention=REF)
    if strategy == "ulysses":
        out, lse = hd.ulysses_attention(*mine, group=group, window_size=window, **kwargs)
    elif strategy == "ring":
        out, lse = hd.ring_attention(*mine, group=group, layout=layout, **kwargs)
    else:
        out, lse = hd.usp_attention(*mine, ulysses_group, ring_group, layout=layout, **kwargs)
    out.backward(shard(dout))
    got = {"out": out, "lse": lse, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    errors = {}
    for name, g in got.items():
        w = shard(wants[name], dim=2 if name == "lse" else 1)
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)}"
        errors[name] = (g.detach() - w).abs().max().item()
    return errors


def _worker(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups = {4: None, 2: pairs[rank // 2], "usp": hd.make_usp_groups(2, 2)}
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = _run_case(case, groups)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    try:  # a head count Ulysses cannot split: every rank refuses before communicating
        q, k, v, _ = _inputs(1, 4, 4, 12, 3, D)
        hd.ulysses_attention(q, k, v, local_attention=REF)
        results["refusal"] = {"error": "no error"}
    except ValueError as e:
        results["refusal"] = {"message": str(e)}
    # The multi-GPU check script's own logic (sharding, gathering, bounds), on the CPU: hattn's
    # kernels replaced by the fp64 reference rounded to bf16.
    from hattn import distributed_check

    def cpu_attention(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, return_lse=False):
        out, lse = attention_ref(q, k, v, causal, None, True, window_size, softcap)
        return out.to(q.dtype), lse.float()

    hattn.attention = cpu_attention
    hd.hattn_local_attention = lambda: REF
    args = distributed_check._parse(["--seqlen", "64", "--heads", "8", "--backend", "gloo"])
    try:
        results["check_script"] = {"ok": distributed_check._check(args, torch.device("cpu"))}
    except Exception as e:  # noqa: BLE001
        results["check_script"] = {"error": f"{type(e).__name__}: {e}"}
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """Every case on 4 gloo processes (world-2 cases on ranks {0, 1} and {2, 3} at once), spawned once."""
    tmp = tmp_path_factory.mktemp("gloo")
    mp.spawn(_worker, args=(4, str(tmp / "store"), str(tmp)), nprocs=4, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("name", list(CASES))
def test_gloo_matches_one_process(gloo_results, name):
    for rank, results in enumerate(gloo_results):
        errors = results[name]
        assert "error" not in errors, f"rank {rank}: {errors.get('error')}"
        for what, err in errors.items():
            assert err <= TOL, f"rank {rank} {what}: max error {err:.3e} > {TOL}"


def test_gloo_ulysses_refuses_heads(gloo_results):
    for results in gloo_results:
        assert "message" in results["refusal"], results["refusal"]
        assert "K/V heads (3)" in results["refusal"]["message"] and "(4)" in results["refusal"]["message"]


def test_gloo_check_script(gloo_results):
    """distributed_check.py's check (every strategy; U x R = 2 x 2) passes on 4 CPU processes."""
    for results in gloo_results:
        assert results["check_script"] == {"ok": True}, results["check_script"]


# ---------------------------------------------------------------------------------------------
# A group of one in this process (CPU: the injected attention; GPU: hattn's kernels)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def group_of_one(tmp_path):
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _strategies():
    return {
        "ulysses": lambda q, k, v, **kw: hd.ulysses_attention(q, k, v, **kw),
        "ring_zigzag": lambda q, k, v, **kw: hd.ring_attention(q, k, v, layout="zigzag", **kw),
        "ring_contiguous": lambda q, k, v, **kw: hd.ring_attention(q, k, v, layout="contiguous", **kw),
        "usp": lambda q, k, v, **kw: hd.usp_attention(q, k, v, None, None, **kw),
    }


def test_world_one_cpu(group_of_one):
    q, k, v, dout = _inputs(1, 10, 10, 4, 2, 8)
    for causal in (False, True):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want, _ = attention_ref(*full, causal)
        want.backward(dout)
        for name, fn in _strategies().items():
            mine = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*mine, causal=causal, local_attention=REF)
            out.backward(dout)
            torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12, msg=name)
            for g, w in zip(mine, full):
                torch.testing.assert_close(g.grad, w.grad, rtol=1e-12, atol=1e-12, msg=name)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_world_one_gpu_hattn_kernels(group_of_one, causal):
    """hattn's kernels through the distributed code (a gloo group of one: no communication) against
    hattn.attention: the same kernels on the same rows, so equal up to the fp32 merge's rounding."""
    assert hopper_skip_reason() is None
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 1000, 8, 128), (2, 1000, 2, 128)
    q = torch.randn(*shape_q, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    k = torch.randn(*shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    v = torch.randn(*shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen) + 0.5
    dout = torch.randn(*shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = hattn.attention(*full, causal=causal)
    want.backward(dout)
    eps = torch.finfo(torch.bfloat16).eps
    for name, fn in _strategies().items():
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*mine, causal=causal)
        out.backward(dout)
        for what, g, w in [("out", out, want)] + [(n, a.grad, b.grad) for n, a, b in zip("qkv", mine, full)]:
            err = (g.float() - w.float()).abs().max().item()
            bound = 2 * eps * w.float().abs().max().item()
            assert err <= bound, f"{name} {what}: max error {err:.3e} > {bound:.3e}"
