"""hattn.mla_with_kvcache: MLA decoding (576 query/key features, 512 value features, one latent
K/V head) over a paged cache, and hattn.mla_schedule.

The CPU tests run everywhere: exports, the op's schema, argument errors (Python's and the
library's own, through the binding), shape inference. The GPU tests (Hopper only) gather each
request's keys out of its pages, K = the rows and V = their first 512 columns, and compare with
an fp64 reference within FlashAttention's bound (twice the error of plain same-dtype torch).
"""

import math
import random

import hattn
import pytest
import torch
from hattn import _C
from helpers import INPUT_MEAN, error_bound, lse_bound, requires_hopper

DQK, DV = 576, 512


def mla_inputs(lens, seqlen_q=1, heads_q=16, page_size=64, dtype=torch.bfloat16, device="cuda", seed=0,
               spare_pages=3):  # fmt: skip
    """(q, kv_cache, block_table, cache_seqlens): each request's pages shuffled through the cache,
    the unused rows of the pages filled with NaN (they must never reach the output)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    batch = len(lens)
    pages_of = [max(1, -(-n // page_size)) for n in lens]
    max_pages = max(pages_of)
    num_pages = sum(pages_of) + spare_pages
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = order[at:at + n].to(torch.int32)
        at += n
    cache = torch.full((num_pages, page_size, 1, DQK), float("nan"), dtype=torch.float32)
    for b, n in enumerate(lens):
        rows = torch.randn(n, DQK, generator=g) + INPUT_MEAN
        for j in range(0, n, page_size):
            cache[table[b, j // page_size], : min(page_size, n - j), 0] = rows[j:j + page_size]
    q = torch.randn(batch, seqlen_q, heads_q, DQK, generator=g) + INPUT_MEAN
    seqlens = torch.tensor(lens, dtype=torch.int32)
    return (q.to(dtype).to(device), cache.to(dtype).to(device), table.to(device), seqlens.to(device))


def mla_ref(q, keys, scale, causal, upcast):
    """One request: q [Sq, Hq, 576], keys [n, 576] -> (out [Sq, Hq, 512], lse [Hq, Sq]); fp64 when
    upcast, else in q's dtype like plain torch code (fp32 softmax)."""
    seqlen_q, heads_q, _ = q.shape
    n = keys.shape[0]
    if upcast:
        q, keys = q.double(), keys.double()
    s = torch.einsum("shd,nd->hsn", q, keys).float() if not upcast else torch.einsum("shd,nd->hsn", q, keys)
    s = s * scale
    if causal:
        pos = torch.arange(seqlen_q, device=q.device)[:, None] + n - seqlen_q  # each token's key position
        visible = torch.arange(n, device=q.device)[None, :] <= pos
        s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Sq]
    dead = torch.isneginf(lse)
    p = torch.exp(s - lse[..., None]).masked_fill(dead[..., None], 0.0)
    v = keys[:, :DV]
    if not upcast:
        p = p.to(q.dtype)
    out = torch.einsum("hsn,nd->shd", p, v)
    return out, lse


def check_mla(out, lse, q, cache, table, seqlens, causal, scale, label):
    page_size = cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        pages = table[b, : -(-n // page_size)].long()
        keys = cache[pages, :, 0].reshape(-1, DQK)[:n] if n > 0 else cache.new_zeros(0, DQK)
        where = f"{label} request {b} ({n} keys)"
        ref_out, ref_lse = mla_ref(q[b], keys, scale, causal, upcast=True)
        naive_out, naive_lse = mla_ref(q[b], keys, scale, causal, upcast=False)
        assert not torch.isnan(out[b]).any(), f"{where}: NaN in out"
        dead = torch.isneginf(ref_lse)  # [Hq, Sq]
        if dead.all():
            assert (out[b] == 0).all(), f"{where}: rows without keys must give out 0"
            if lse is not None:
                assert torch.isneginf(lse[b]).all(), f"{where}: rows without keys must give lse -inf"
            continue
        err = (out[b].double() - ref_out).abs().max().item()
        bound = error_bound(ref_out, naive_out, q.dtype)
        assert err <= bound, f"{where}: out max error {err:.3e} > bound {bound:.3e}"
        if lse is not None:
            live = ~dead
            assert torch.isneginf(lse[b][dead]).all(), f"{where}: rows without keys must give lse -inf"
            lerr = (lse[b][live].double() - ref_lse[live]).abs().max().item()
            lbound = lse_bound(ref_lse[live], naive_lse[live])
            assert lerr <= lbound, f"{where}: lse max error {lerr:.3e} > bound {lbound:.3e}"


# --- package (CPU) ---------------------------------------------------------------------------------


def test_exported():
    assert callable(hattn.mla_with_kvcache) and callable(hattn.mla_schedule)
    assert {"mla_with_kvcache", "mla_schedule"} <= set(hattn.__all__)
    assert hasattr(torch.ops.hattn, "mla_decode_fwd")


def test_op_schema():
    schema = str(torch.ops.hattn.mla_decode_fwd.default._schema)
    assert schema.startswith("hattn::mla_decode_fwd(Tensor q, Tensor kv_cache, Tensor block_table, Tensor "
                             "cache_seqlens, Tensor? schedule, float? softmax_scale, bool causal, bool return_lse)")


def meta_inputs(**kw):
    return mla_inputs([100, 7], device="meta", **kw)


def test_shape_inference_on_meta():
    q, cache, table, seqlens = meta_inputs(seqlen_q=2, heads_q=32)
    out, lse = torch.ops.hattn.mla_decode_fwd(q, cache, table, seqlens, None, None, True, True)
    assert out.shape == (2, 2, 32, DV) and out.dtype == q.dtype
    assert lse.shape == (2, 32, 2) and lse.dtype == torch.float32


def test_inputs_that_require_grad_are_refused():
    """Forward only: an input that requires grad is refused at the call, not at backward()."""
    q, cache, table, seqlens = meta_inputs()
    with pytest.raises(NotImplementedError, match="mla_with_kvcache: forward only"):
        hattn.mla_with_kvcache(q.requires_grad_(), cache, table, seqlens)
    with torch.no_grad():
        assert hattn.mla_with_kvcache(q, cache, table, seqlens).shape == (2, 1, 16, DV)


def test_compile_fullgraph_traces_without_breaks():
    """Dynamo traces mla_with_kvcache into one graph (the GPU runs: test_cuda_graph and the rest)."""
    torch._dynamo.reset()

    def f(q, cache, table, seqlens):
        out, lse = hattn.mla_with_kvcache(q * 2, cache, table, seqlens, causal=True, return_lse=True)
        return out.float().sum(-1), lse + 1

    args = meta_inputs(seqlen_q=2, heads_q=16)
    out, lse = torch.compile(f, backend="eager", fullgraph=True)(*args)
    assert out.shape == (2, 2, 16) and lse.shape == (2, 16, 2)
    explanation = torch._dynamo.explain(f)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][..., :512], *a[1:]), "q: must be"),
        (lambda a: (a[0].float(), *a[1:]), "q: must be bfloat16 or float16"),
        (lambda a: (a[0], a[1][:, :, :, :512], *a[2:]), "kv_cache: must be"),
        (lambda a: (a[0], a[1].half(), *a[2:]), "kv_cache: must have q's dtype"),
        (lambda a: (a[0], a[1][:, :32], *a[2:]), "page_size"),
        (lambda a: (a[0], a[1], a[2][:1], a[3]), "block_table: must be"),
        (lambda a: (a[0], a[1], a[2].long(), a[3]), "block_table: must be int32"),
        (lambda a: (*a[:3], a[3].long()), "cache_seqlens: must be int32"),
        (lambda a: (*a[:3], a[3][:1]), "cache_seqlens: must be"),
    ],
)
def test_argument_errors(change, message):
    args = change(meta_inputs())
    with pytest.raises(ValueError, match=message):
        torch.ops.hattn.mla_decode_fwd(*args, None, None, False, False)


def test_scale_errors():
    args = meta_inputs()
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softmax_scale"):
            torch.ops.hattn.mla_decode_fwd(*args, None, bad, False, False)


def mla_problem(**fields):
    p = _C.MlaDecodeProblem()
    p.dtype = "bf16"
    p.batch, p.seqlen_q, p.heads_q = 2, 1, 16
    p.q = p.kv_cache = p.block_table = p.cache_seqlens = 256
    p.out = 1 << 20
    p.q_strides, p.out_strides = (16 * DQK, 16 * DQK, DQK), (16 * DV, 16 * DV, DV)
    p.num_pages, p.page_size, p.max_pages_per_seq = 8, 64, 4
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def test_library_accepts_a_good_problem():
    _C.validate_mla_arguments(mla_problem())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": "e4m3"}, "dtype: must be bf16 or fp16"),
        ({"batch": 0}, "batch: must be >= 1"),
        ({"seqlen_q": 0}, "seqlen_q: must be >= 1"),
        ({"heads_q": 0}, "heads_q: must be >= 1"),
        ({"q": 0}, "q: pointer is null"),
        ({"kv_cache": 0}, "kv_cache: pointer is null"),
        ({"block_table": 0}, "block_table: pointer is null"),
        ({"cache_seqlens": 0}, "cache_seqlens: pointer is null"),
        ({"out": 0}, "out: pointer is null"),
        ({"q": 264}, "q: pointer must be 16-byte aligned"),
        ({"q_strides": (16 * DQK, 16 * DQK, 577)}, "q: strides must be multiples of 8"),
        ({"out_strides": (16 * DV, 16 * DV, 513)}, "out: strides must be even"),
        ({"out": 256}, "out: must not alias q"),
        ({"page_size": 96}, "page_size: must be a positive multiple of 64"),
        ({"num_pages": 0}, "num_pages: must be >= 1"),
        ({"max_pages_per_seq": 0}, "max_pages_per_seq: must be >= 1"),
        ({"row_stride": 512}, "kv_cache: row stride must be >= 576"),
        ({"page_stride": 64 * 576 - 8}, "kv_cache: page stride must hold page_size rows"),
        ({"softmax_scale": -1.0}, "softmax_scale: must be > 0"),
    ],
)
def test_library_errors_name_the_argument(fields, message):
    with pytest.raises(ValueError, match=message):
        _C.validate_mla_arguments(mla_problem(**fields))


def test_schedule_checks_only_what_it_reads():
    """mla_schedule's problem carries only the lengths: its checks pass and, without a GPU, the
    call stops at the device, not at an argument; a missing cache_seqlens is named."""
    from hattn.ops.mla import _schedule_problem

    lengths = torch.zeros(3, dtype=torch.int32)
    problem = _schedule_problem(lengths, 2, 16)
    if torch.cuda.is_available():
        assert _C.mla_schedule_ints(problem) > 0
    else:
        with pytest.raises(Exception) as error:
            _C.mla_schedule_ints(problem)
        assert "invalid_argument" not in str(error.value), str(error.value)
    problem.cache_seqlens = 0
    with pytest.raises(ValueError, match="cache_seqlens: pointer is null"):
        _C.mla_schedule_ints(problem)


# --- GPU -------------------------------------------------------------------------------------------


def random_lengths(rng, batch, longest):
    """Lengths across the range: tile multiples and not, a single key, some empty requests."""
    picks = [0, 1, 63, 64, 65, 127, 128, 129, longest]
    return [rng.choice(picks) if rng.random() < 0.4 else rng.randint(1, longest) for _ in range(batch)]


@requires_hopper
@pytest.mark.parametrize("heads_q", [16, 32, 64, 128])
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(heads_q, seqlen_q, causal):
    rng = random.Random(heads_q * 10 + seqlen_q + 7 * causal)
    for case, page_size in enumerate((64, 128, 256)):
        lens = random_lengths(rng, rng.choice([1, 3, 9]), 3000)
        args = mla_inputs(lens, seqlen_q, heads_q, page_size, seed=case)
        scale = 1.0 / math.sqrt(DQK)
        out, lse = hattn.mla_with_kvcache(*args, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        check_mla(out, lse, *args, causal, scale, f"h{heads_q} s{seqlen_q} page {page_size} lens {lens}")


@requires_hopper
def test_long_and_empty_requests():
    lens = [65536, 0, 40000, 5, 0, 17]
    args = mla_inputs(lens, 2, 64, 64, seed=3)
    out, lse = hattn.mla_with_kvcache(*args, causal=True, return_lse=True)
    torch.cuda.synchronize()
    check_mla(out, lse, *args, True, 1.0 / math.sqrt(DQK), "long/empty")


@requires_hopper
@pytest.mark.parametrize("heads_q, seqlen_q", [(16, 1), (64, 1), (128, 2)])
def test_one_request_in_many_parts(heads_q, seqlen_q):
    """One long request takes about a part per SM: the combine merges them in batches."""
    args = mla_inputs([20000], seqlen_q, heads_q, 64, seed=9)
    out, lse = hattn.mla_with_kvcache(*args, causal=True, return_lse=True)
    torch.cuda.synchronize()
    check_mla(out, lse, *args, True, 1.0 / math.sqrt(DQK), f"one request, h{heads_q} s{seqlen_q}")


@requires_hopper
def test_many_requests_split_and_whole():
    rng = random.Random(5)
    lens = [rng.randint(0, 9000) for _ in range(128)]
    args = mla_inputs(lens, 1, 16, 64, seed=4)
    out, lse = hattn.mla_with_kvcache(*args, return_lse=True)
    torch.cuda.synchronize()
    check_mla(out, lse, *args, False, 1.0 / math.sqrt(DQK), "128 requests")


@requires_hopper
def test_fp16_and_scale():
    lens = [700, 64, 1]
    args = mla_inputs(lens, 2, 32, 128, dtype=torch.float16, seed=6)
    out, lse = hattn.mla_with_kvcache(*args, softmax_scale=0.03, causal=True, return_lse=True)
    torch.cuda.synchronize()
    check_mla(out, lse, *args, True, 0.03, "fp16")


@requires_hopper
def test_schedule_reused_gives_the_same_result():
    lens = [5000, 300, 2048]
    q, cache, table, seqlens = mla_inputs(lens, 1, 128, 64, seed=7)
    schedule = hattn.mla_schedule(seqlens, seqlen_q=1, heads_q=128)
    first = hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=schedule)
    again = hattn.mla_with_kvcache(q, cache, table, seqlens)
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="schedule: has"):
        hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=schedule[:-1])


@requires_hopper
def test_cuda_graph():
    lens = [3000, 100]
    q, cache, table, seqlens = mla_inputs(lens, 1, 64, 64, seed=8)
    schedule = hattn.mla_schedule(seqlens, seqlen_q=1, heads_q=64)
    hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=schedule)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s = hattn.mla_schedule(seqlens, seqlen_q=1, heads_q=64)
        out = hattn.mla_with_kvcache(q, cache, table, seqlens, schedule=s)
    seqlens.copy_(torch.tensor([1000, 90], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    check_mla(out, None, q, cache, table, seqlens, False, 1.0 / math.sqrt(DQK), "graph replay")


@requires_hopper
def test_checking_mode_names_broken_lengths_and_pages():
    """HATTN_CHECK=1 / hattn.set_checking: a length past the request's pages and a page outside
    the cache are refused by name (without it, the kernel clamps the one and reads zeros for the
    other); the pages no request reads may hold anything."""
    lens = [200, 70]
    q, cache, table, seqlens = mla_inputs(lens, 1, 16, 64, seed=9)
    before = hattn.checking()
    hattn.set_checking(True)
    try:
        second = int(table[1, 1])
        table[1, 1:] = -1  # request 1's 70 keys use two pages: the second is now outside the cache
        with pytest.raises(ValueError, match=r"block_table: entry \(1, 1\) is -1"):
            hattn.mla_with_kvcache(q, cache, table, seqlens)
        table[1, 1] = second  # the pages past it stay -1: no request reads them
        out = hattn.mla_with_kvcache(q, cache, table, seqlens)
        torch.cuda.synchronize()
        check_mla(out, None, q, cache, table, seqlens, False, 1.0 / math.sqrt(DQK), "checked")
        capacity = table.shape[1] * cache.shape[1]
        with pytest.raises(ValueError, match=rf"cache_seqlens: entry 0 is {capacity + 1}"):
            hattn.mla_with_kvcache(q, cache, table, torch.tensor([capacity + 1, 70], dtype=torch.int32, device="cuda"))
    finally:
        hattn.set_checking(before)
