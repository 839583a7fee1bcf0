"""hattn.flash_attn_interface, the drop-in for FlashAttention-3's module of that name: its
signatures against FA3's (written down here), what it refuses and which hints it accepts (CPU),
the structure of its results on meta tensors (the ops' fake implementations answer), and on a
Hopper GPU that it is hattn's ops under FA3's argument order: the same results as the ops and
as hattn's FlashAttention-2 forms, within the fp64 reference's bound, gradients included."""

import inspect

import hattn
import pytest
import torch
from hattn import flash_attn_interface as fa3
from helpers import (
    INPUT_MEAN,
    attention_ref,
    check_gradients,
    check_varlen_func_gradients,
    error_bound,
    gpu_kvcache,
    gpu_varlen,
    gradients,
    make_qkv,
    requires_hopper,
)

# --- the signatures: FlashAttention-3's hopper/flash_attn_interface.py (commits c082294e and
# 01afd16d agree), every parameter positional-or-keyword, in this order, with these defaults ---

_ = inspect.Parameter.empty
FA3_SIGNATURES = {
    "flash_attn_func": [
        ("q", _), ("k", _), ("v", _), ("softmax_scale", None), ("causal", False), ("qv", None),
        ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
        ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
        ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", _), ("k", _), ("v", _), ("cu_seqlens_q", _), ("cu_seqlens_k", _), ("max_seqlen_q", _),
        ("max_seqlen_k", _), ("seqused_q", None), ("seqused_k", None), ("softmax_scale", None), ("causal", False),
        ("qv", None), ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
        ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
        ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_with_kvcache": [
        ("q", _), ("k_cache", _), ("v_cache", _), ("k", None), ("v", None), ("qv", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("max_seqlen_q", None),
        ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("attention_chunk", 0),
        ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
        ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False),
    ],
    "flash_attn_qkvpacked_func": [
        ("qkv", _), ("softmax_scale", None), ("causal", False), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
        ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False),
    ],
}  # fmt: skip

GPU = r"no suitable GPU|must be a CUDA tensor"  # how a supported call on CPU tensors ends: at the op's device check


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_signature_is_fa3s(name):
    params = list(inspect.signature(getattr(fa3, name)).parameters.values())
    assert [(p.name, p.default) for p in params] == FA3_SIGNATURES[name]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), name


def test_module_is_importable_both_ways():
    import hattn.flash_attn_interface as by_path

    assert by_path is fa3 is hattn.flash_attn_interface
    assert set(fa3.__all__) == set(FA3_SIGNATURES)
    # hattn plans and combines its split-KV parts inside a call: FA3's two helpers for that are absent,
    # so code that probes for them with an ImportError sees that.
    assert not hasattr(fa3, "flash_attn_combine") and not hasattr(fa3, "get_scheduler_metadata")


# --- CPU tensors: refusals, hints, argument errors ----------------------------------------------------


def cpu_qkv(dtype=torch.bfloat16, head_dim=64):
    q = torch.randn(1, 16, 2, head_dim).to(dtype)
    return q, q.clone(), q.clone()


def cpu_varlen(dtype=torch.bfloat16):
    """q, k, v [16, 2, 64] as two sequences of 10 and 6, with cu_seqlens and max_seqlen."""
    q = torch.randn(16, 2, 64).to(dtype)
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    return q, q.clone(), q.clone(), cu, cu.clone(), 10, 10


def cpu_kvcache(device="cpu"):
    """q [2, 4, 8, 64]; a dense cache [2, 300, 2, 64]; a paged one [6, 128, 2, 64] with table [2, 3]."""
    q = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16, device=device)
    dense = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16, device=device)
    pages = torch.randn(6, 128, 2, 64, dtype=torch.bfloat16, device=device)
    table = torch.arange(6, dtype=torch.int32, device=device).view(2, 3)
    return q, dense, pages, table


LENS = torch.zeros(2, dtype=torch.int32)
REFUSED_EVERYWHERE = [
    ({"qv": torch.zeros(1)}, r"qv \(no second query-value product"),
    ({"attention_chunk": 128}, r"attention_chunk=128 \(no chunked attention mask\)"),
    ({"sm_margin": 8}, r"sm_margin=8 \(hattn's persistent kernels take every SM"),
]


@pytest.mark.parametrize(
    "kwargs, words",
    REFUSED_EVERYWHERE + [
        ({"window_size": (8, 0)}, r"window_size=\(8, 0\) with FP8 inputs"),
        ({"softcap": 5.0}, r"softcap=5.0 with FP8 inputs"),
    ],
)  # fmt: skip
def test_func_refusals_are_named(kwargs, words):
    fp8 = "FP8" in words
    qkv = cpu_qkv(torch.float8_e4m3fn, 128) if fp8 else cpu_qkv()
    with pytest.raises(NotImplementedError, match=r"flash_attn_interface.flash_attn_func does not support " + words):
        fa3.flash_attn_func(*qkv, **kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    REFUSED_EVERYWHERE + [
        ({"seqused_q": LENS}, r"seqused_q \(no lengths in use apart from cu_seqlens_q and cu_seqlens_k\)"),
        ({"seqused_k": LENS}, r"seqused_k \(no lengths in use"),
        ({"q_descale": torch.ones(2, 2)}, r"q_descale with a variable-length batch \(hattn's FP8 forward takes dense"),
        ({"v_descale": torch.ones(2, 2)}, r"v_descale with a variable-length batch"),
    ],
)  # fmt: skip
def test_varlen_refusals_are_named(kwargs, words):
    with pytest.raises(NotImplementedError, match=r"flash_attn_varlen_func does not support " + words):
        fa3.flash_attn_varlen_func(*cpu_varlen(), **kwargs)


def test_varlen_refuses_fp8_inputs_by_name():
    with pytest.raises(NotImplementedError, match=r"float8_e4m3fn inputs with a variable-length batch"):
        fa3.flash_attn_varlen_func(*cpu_varlen(torch.float8_e4m3fn))


@pytest.mark.parametrize(
    "kwargs, words",
    REFUSED_EVERYWHERE + [
        ({"cu_seqlens_q": LENS}, r"cu_seqlens_q \(no variable-length queries or new keys with a KV cache\)"),
        ({"cu_seqlens_k_new": LENS}, r"cu_seqlens_k_new \(no variable-length"),
        ({"rotary_seqlens": LENS}, r"rotary_seqlens \(the rotary positions are cache_seqlens\[b\] \+ i\)"),
        ({"scheduler_metadata": LENS}, r"scheduler_metadata \(hattn plans its own split-KV schedule"),
        ({"k_descale": torch.ones(2, 2)}, r"k_descale with a KV cache \(hattn's FP8 forward takes dense batches"),
        ({"cache_leftpad": LENS, "page_table": torch.zeros(2, 3, dtype=torch.int32)},
         r"cache_leftpad with page_table"),
    ],
)  # fmt: skip
def test_kvcache_refusals_are_named(kwargs, words):
    q, dense, _, _ = cpu_kvcache()
    with pytest.raises(NotImplementedError, match=r"flash_attn_with_kvcache does not support " + words):
        fa3.flash_attn_with_kvcache(q, dense, dense, cache_seqlens=10, **kwargs)


def test_kvcache_names_every_refusal_at_once_and_writes_nothing():
    """All refused arguments in one message, before the append writes anything."""
    q, dense, _, _ = cpu_kvcache()
    new = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    before = dense.clone()
    every = r"does not support qv .*attention_chunk=4 .*sm_margin=2 .*rotary_seqlens .*require grad"
    with pytest.raises(NotImplementedError, match=every):
        fa3.flash_attn_with_kvcache(
            q.requires_grad_(), dense, dense, new, new, q, cache_seqlens=10, rotary_seqlens=LENS, attention_chunk=4,
            sm_margin=2,
        )  # fmt: skip
    assert torch.equal(dense, before)


@pytest.mark.parametrize("which", ["q", "k_cache", "k"])
def test_kvcache_refuses_inputs_that_need_grad(which):
    q, dense, _, _ = cpu_kvcache()
    args = {"q": q, "k_cache": dense, "v_cache": dense.clone(), "k": torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)}
    args["v"] = args["k"].clone()
    args[which].requires_grad_()
    with pytest.raises(NotImplementedError, match=r"inputs that require grad \(no backward with a KV cache"):
        fa3.flash_attn_with_kvcache(**args, cache_seqlens=10)


def test_kvcache_refuses_fp8_inputs_by_name():
    q, dense, _, _ = cpu_kvcache()
    q8, cache8 = q.to(torch.float8_e4m3fn), dense.to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"float8_e4m3fn inputs with a KV cache"):
        fa3.flash_attn_with_kvcache(q8, cache8, cache8, cache_seqlens=10)


def test_deterministic_goes_on_to_the_backward():
    # With gradients the call goes on to hattn's ordered backward (and needs the GPU).
    for fn, args in ((fa3.flash_attn_func, cpu_qkv()), (fa3.flash_attn_varlen_func, cpu_varlen())):
        args[0].requires_grad_()
        with pytest.raises((RuntimeError, ValueError), match=GPU):
            fn(*args, deterministic=True)
    qkv = torch.randn(1, 16, 3, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_qkvpacked_func(qkv, deterministic=True)


@pytest.mark.parametrize("num_splits", [-1, 0, 1, 3, 64, 1000])
@pytest.mark.parametrize("pack_gqa", [None, True, False])
def test_hints_are_accepted(num_splits, pack_gqa):
    """num_splits (any int) and pack_gqa (None, True, False) never refuse a call: each one gets
    as far as the op's device check of these CPU tensors."""
    hints = {"num_splits": num_splits, "pack_gqa": pack_gqa}
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_func(*cpu_qkv(), causal=True, **hints)
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_varlen_func(*cpu_varlen(), **hints)
    q, dense, pages, table = cpu_kvcache()
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=10, page_table=table, **hints)


def test_num_splits_maps_onto_hattns():
    # FA3's <= 0 is its heuristic, hattn's 0; 1 is no split in both; more than hattn's 64 counts as 64.
    assert [fa3._num_splits(n) for n in (-3, 0, 1, 2, 64, 65, 1000)] == [0, 0, 1, 2, 64, 64, 64]


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"num_splits": 1.5}, TypeError, r"num_splits: must be an int, got float"),
        ({"num_splits": True}, TypeError, r"num_splits: must be an int, got bool"),
        ({"pack_gqa": "yes"}, TypeError, r"pack_gqa: must be None, True or False, got str"),
        ({"window_size": 3}, ValueError, r"window_size: must be a pair"),
        ({"q_descale": torch.ones(1, 2)}, ValueError, r"q_descale: only with torch.float8_e4m3fn q, k and v"),
        ({"softcap": -1.0}, ValueError, r"softcap: must be finite and >= 0"),
    ],
)
def test_func_argument_errors_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        fa3.flash_attn_func(*cpu_qkv(), **kwargs)


def test_positional_order_is_fa3s():
    """FA3's order, not FA2's: the fourth argument is softmax_scale (FA2's dropout_p), the sixth qv;
    varlen's eighth is seqused_q; the KV cache's sixth is qv."""
    q, k, v = cpu_qkv()
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_func(q, k, v, 0.5, True)
    with pytest.raises(NotImplementedError, match=r"does not support qv"):
        fa3.flash_attn_func(q, k, v, None, False, q)
    with pytest.raises(NotImplementedError, match=r"does not support seqused_q"):
        fa3.flash_attn_varlen_func(*cpu_varlen(), LENS)
    qc, dense, _, _ = cpu_kvcache()
    with pytest.raises(NotImplementedError, match=r"does not support qv"):
        fa3.flash_attn_with_kvcache(qc, dense, dense, None, None, qc)


def test_kvcache_page_table_errors_name_it():
    q, _, pages, table = cpu_kvcache()
    with pytest.raises(ValueError, match=r"page_table: dtype must be torch.int32, got torch.int64"):
        fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=10, page_table=table.long())
    with pytest.raises(ValueError, match=r"page_table: must be 2-D \[batch, max_pages_per_seq\]"):
        fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=10, page_table=table.flatten())
    with pytest.raises(TypeError, match=r"page_table: must be a torch.Tensor, got list"):
        fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=10, page_table=[[0, 1, 2]])
    # Appending needs to know where: cache_seqlens is required then, as in hattn's FA2 form.
    new = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"cache_seqlens: required with k and v"):
        fa3.flash_attn_with_kvcache(q, pages, pages, new, new, page_table=table)


def test_qkvpacked_layouts_and_errors():
    qkv5 = torch.randn(2, 16, 3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_qkvpacked_func(qkv5, causal=True)
    qkv4 = torch.randn(2, 16, 8, 64, dtype=torch.bfloat16)  # 4 query heads, 2 K/V heads
    with pytest.raises((RuntimeError, ValueError), match=GPU):
        fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=4)
    with pytest.raises(TypeError, match=r"num_heads_q: must be an int \(the query heads of qkv"):
        fa3.flash_attn_qkvpacked_func(qkv4)
    with pytest.raises(ValueError, match=r"num_heads_q: qkv's 8 heads \(dim 2\) must be num_heads_q \(5\) \+ 2"):
        fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=5)
    with pytest.raises(ValueError, match=r"qkv: must be \[batch, seqlen, 3, heads, head_dim\]"):
        fa3.flash_attn_qkvpacked_func(qkv5[:, :, :2])
    with pytest.raises(NotImplementedError, match=r"flash_attn_qkvpacked_func does not support sm_margin=1"):
        fa3.flash_attn_qkvpacked_func(qkv5, sm_margin=1)


# --- meta tensors: the results' structure, shapes and dtypes, and gradients ----------------------------


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def test_func_results_on_meta():
    q, k, v = meta(2, 5, 4, 64), meta(2, 7, 2, 64), meta(2, 7, 2, 64)
    out = fa3.flash_attn_func(q, k, v, causal=True, window_size=(3, 3), softcap=10.0)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    result = fa3.flash_attn_func(q, k, v, return_attn_probs=True, num_splits=0)
    assert isinstance(result, tuple) and len(result) == 2  # (out, softmax_lse): no S_dmask, unlike FA2
    out, lse = result
    assert out.shape == q.shape and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_fp8_results_on_meta():
    q, k = meta(2, 5, 4, 128, dtype=torch.float8_e4m3fn), meta(2, 7, 2, 128, dtype=torch.float8_e4m3fn)
    descale = torch.empty(2, 2, device="meta")
    out = fa3.flash_attn_func(q, k, k, causal=True, q_descale=descale, k_descale=descale, v_descale=descale)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    out, lse = fa3.flash_attn_func(q, k, k, window_size=(-1, 0), return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_varlen_results_on_meta():
    q, k = meta(16, 4, 64), meta(20, 2, 64)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    out = fa3.flash_attn_varlen_func(q, k, k, cu, cu, 10, 12, causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    result = fa3.flash_attn_varlen_func(q, k, k, cu, cu, 10, 12, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 2
    assert result[1].shape == (4, 16) and result[1].dtype == torch.float32


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_results_on_meta(paged):
    q, dense, pages, table = cpu_kvcache("meta")
    cache, extra = (pages, {"page_table": table}) if paged else (dense, {})
    out = fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=10, causal=True, num_splits=3, **extra)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    result = fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=10, return_softmax_lse=True, **extra)
    # FA3's four: out, softmax_lse, and its split-KV partials (empty here: hattn combines them inside the call).
    assert isinstance(result, tuple) and len(result) == 4
    out, lse, out_accum, lse_accum = result
    assert out.shape == q.shape and lse.shape == (2, 8, 4) and lse.dtype == torch.float32
    assert out_accum.numel() == 0 and lse_accum.numel() == 0 and out_accum.dtype == torch.float32


def test_kvcache_page_table_without_cache_seqlens_on_meta():
    # FA3 reads every key of the table's pages; hattn's FA2 form would want cache_seqlens.
    q, _, pages, table = cpu_kvcache("meta")
    assert fa3.flash_attn_with_kvcache(q, pages, pages, page_table=table).shape == q.shape
    with pytest.raises(ValueError, match=r"cache_seqlens: required with block_table"):
        hattn.flash_attn_with_kvcache(q, pages, pages, block_table=table)


def test_gradients_on_meta():
    """The outputs carry hattn's backward; backward gives gradients shaped like the inputs (GQA 2),
    and the packed forms' reach the packed tensor."""
    q, k, v = meta(2, 5, 4, 64, grad=True), meta(2, 7, 2, 64, grad=True), meta(2, 7, 2, 64, grad=True)
    out = fa3.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=5.0)
    assert "hattn_attention_fwd" in type(out.grad_fn).__name__
    out.backward(torch.empty_like(out))
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    q, k, v = meta(16, 4, 64, grad=True), meta(20, 2, 64, grad=True), meta(20, 2, 64, grad=True)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    out, _ = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 10, 12, causal=True, return_attn_probs=True)
    assert "hattn_attention_varlen_fwd" in type(out.grad_fn).__name__
    out.backward(torch.empty_like(out))
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    for qkv, heads_q in ((meta(2, 5, 3, 4, 64, grad=True), None), (meta(2, 5, 8, 64, grad=True), 4)):
        out = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=heads_q)
        assert out.shape == (2, 5, 4, 64)
        out.backward(torch.empty_like(out))
        assert qkv.grad.shape == qkv.shape


def test_compiles_without_breaks():
    """Dynamo traces the functions into one graph each (meta tensors), hints included."""
    torch._dynamo.reset()
    q, k = meta(2, 5, 4, 64), meta(2, 7, 2, 64)

    def dense(q, k, v):
        return fa3.flash_attn_func(q, k, v, causal=True, num_splits=0, pack_gqa=True, return_attn_probs=True)

    out, lse = torch.compile(dense, backend="eager", fullgraph=True)(q, k, k.clone())
    assert out.shape == q.shape and lse.shape == (2, 4, 5)
    qc, _, pages, table = cpu_kvcache("meta")

    def decode(q, k_cache, v_cache, table):
        return fa3.flash_attn_with_kvcache(q, k_cache, v_cache, page_table=table, return_softmax_lse=True)

    out, lse, *_ = torch.compile(decode, backend="eager", fullgraph=True)(qc, pages, pages.clone(), table)
    assert out.shape == qc.shape and lse.shape == (2, 8, 4)


# --- GPU: hattn's ops under FA3's argument order -------------------------------------------------------


def same(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (50, 30), 0.0),
                                (True, (50, 30), 0.0), (False, (-1, -1), 30.0), (True, (40, -1), 5.0)],
)  # fmt: skip
@pytest.mark.parametrize("num_splits", [1, 0])
def test_func_same_as_attention(causal, window, softcap, dtype, num_splits):
    """out and the LSE of hattn.attention with the same arguments (causal makes the window's right
    side 0), bit for bit; GQA 4, lengths not tile multiples."""
    q, k, v = make_qkv(2, 300, 200, 8, 2, 128, dtype)
    out, lse = fa3.flash_attn_func(
        q, k, v, 0.1, causal, window_size=window, softcap=softcap, num_splits=num_splits, pack_gqa=True,
        return_attn_probs=True,
    )  # fmt: skip
    expect, expect_lse = hattn.attention(
        q, k, v, causal=causal, softmax_scale=0.1, window_size=(window[0], 0 if causal else window[1]),
        softcap=softcap, num_splits=num_splits, return_lse=True,
    )  # fmt: skip
    same(out, expect)
    same(lse, expect_lse)
    if num_splits == 0:  # hattn's FA2 form runs hattn.attention with its default, 0
        same(fa3.flash_attn_func(q, k, v, 0.1, causal, window_size=window, softcap=softcap, num_splits=0),
             hattn.flash_attn_func(q, k, v, 0.0, 0.1, causal, window, softcap))  # fmt: skip


@requires_hopper
@pytest.mark.parametrize(
    "shape, causal, window, num_splits",
    [
        ((2, 37, 53, 4, 2, 64), False, (-1, -1), 1),  # GQA 2, lengths not multiples of 64
        ((1, 130, 130, 4, 4, 256), True, (-1, -1), 1),
        ((2, 100, 100, 8, 1, 128), False, (30, 20), 1),  # MQA, a two-sided window
        ((4, 1, 4000, 16, 2, 128), False, (-1, -1), 3),  # decoding shape, three split-KV parts asked for
        ((4, 1, 4000, 16, 2, 128), True, (-1, -1), 0),  # hattn decides
    ],
)
def test_func_against_reference(shape, causal, window, num_splits):
    """Within twice the error of plain same-dtype torch of the fp64 reference (test_gpu.py's bound)."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, torch.bfloat16, seed=seqlen_k)
    out = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, num_splits=num_splits)
    ref = attention_ref(q, k, v, causal, window=window)[0]
    naive = attention_ref(q, k, v, causal, window=window, upcast=False)[0]
    err = (out.double() - ref).abs().max().item()
    assert err <= error_bound(ref, naive, q.dtype), f"{shape}: max error {err:.3e}"


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, causal, window, softcap",
    [
        ((2, 37, 53, 4, 2, 64), False, (-1, -1), 0.0),  # GQA 2
        ((1, 130, 130, 4, 4, 128), True, (-1, -1), 0.0),
        ((2, 100, 100, 8, 1, 128), False, (30, 20), 0.0),  # MQA, a two-sided window
        ((1, 70, 150, 4, 2, 64), True, (40, 7), 0.0),  # causal makes the window (40, 0)
        ((2, 90, 120, 4, 2, 128), True, (-1, -1), 10.0),  # softcap
        ((1, 64, 80, 2, 1, 256), False, (-1, -1), 0.0),
    ],
)
def test_func_gradients_match_reference(shape, causal, window, softcap, dtype):
    """dq, dk, dv through autograd of flash_attn_func against the fp64 reference's (test_backward.py's bound)."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, seed=seqlen_q)
    dout = make_qkv(batch, seqlen_q, seqlen_q, heads_q, heads_q, head_dim, dtype, seed=seqlen_q + 1)[0]
    got = gradients(
        lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap),
        q, k, v, dout,
    )  # fmt: skip
    ref_window = (window[0], 0 if causal else window[1])
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=causal, window=ref_window, softcap=softcap)[0],
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, dtype, f"{shape} causal={causal} window={window} softcap={softcap}")


@requires_hopper
def test_func_gradients_with_return_attn_probs():
    """With the LSE returned too, a loss on out alone still gets hattn's gradients."""
    q, k, v = make_qkv(2, 100, 130, 4, 2, 128, torch.bfloat16, seed=9)
    dout = torch.randn_like(q)
    got = gradients(
        lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[0], q, k, v, dout
    )  # fmt: skip
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=True)[0], q.double(), k.double(), v.double(), dout.double()
    )  # fmt: skip
    check_gradients(got, want, torch.bfloat16, "return_attn_probs")


@requires_hopper
@pytest.mark.parametrize("heads_q", [None, 8])
def test_qkvpacked_matches_the_unpacked_call(heads_q):
    """The 5-D form (MHA) and the 4-D form (8 query heads, 2 K/V heads): flash_attn_func's output on
    the slices, and gradients back into qkv: the fp64 reference's on the slices (hattn's backward
    sums with atomic adds, so two runs may differ in the last bits)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    shape = (2, 100, 3, 4, 128) if heads_q is None else (2, 100, 12, 128)
    qkv = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) + INPUT_MEAN).requires_grad_()
    out = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=heads_q)
    dout = torch.randn_like(out)
    out.backward(dout)
    q, k, v = qkv.detach().unbind(2) if heads_q is None else qkv.detach().split([8, 2, 2], dim=2)
    same(out, fa3.flash_attn_func(q, k, v, causal=True))
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=True)[0], q.double(), k.double(), v.double(), dout.double()
    )  # fmt: skip
    got = qkv.grad.unbind(2) if heads_q is None else qkv.grad.split([8, 2, 2], dim=2)
    check_gradients(got, want, torch.bfloat16, f"qkvpacked num_heads_q={heads_q}")


@requires_hopper
@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (50, 30), 0.0), (True, (50, 30), 5.0)])  # fmt: skip
def test_varlen_same_as_attention_varlen(causal, window, softcap):
    """hattn.attention_varlen's out and LSE bit for bit (empty sequences on either side, GQA 4);
    the hints change nothing; hattn's FA2 form gives the same out."""
    args = gpu_varlen([300, 0, 129, 17], [200, 50, 0, 400])
    out, lse = fa3.flash_attn_varlen_func(
        *args, None, None, 0.1, causal, window_size=window, softcap=softcap, return_attn_probs=True
    )  # fmt: skip
    expect, expect_lse = hattn.attention_varlen(
        *args, causal=causal, softmax_scale=0.1, window_size=(window[0], 0 if causal else window[1]),
        softcap=softcap, return_lse=True,
    )  # fmt: skip
    same(out, expect)
    same(lse, expect_lse)
    hinted = fa3.flash_attn_varlen_func(
        *args, softmax_scale=0.1, causal=causal, window_size=window, softcap=softcap, num_splits=7, pack_gqa=False
    )  # fmt: skip
    same(hinted, expect)
    same(hattn.flash_attn_varlen_func(*args, 0.0, 0.1, causal, window, softcap), expect)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gradients_match_reference(causal):
    """dq, dk, dv through flash_attn_varlen_func against the fp64 reference per sequence."""
    check_varlen_func_gradients(fa3.flash_attn_varlen_func, causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_same_as_the_ops(paged, causal):
    """hattn.attention_paged (page_table) or hattn.attention with seqlens_k (dense) bit for bit,
    out and LSE, with FA3's four results; GQA 4, a window, num_splits 3."""
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache([0, 1, 300, 129, 512])
    window, expect_window = (50, 30), (50, 0 if causal else 30)
    if paged:
        result = fa3.flash_attn_with_kvcache(
            q, k_pages, v_pages, cache_seqlens=seqlens, page_table=table, softmax_scale=0.1, causal=causal,
            window_size=window, num_splits=3, pack_gqa=True, return_softmax_lse=True,
        )  # fmt: skip
        expect = hattn.attention_paged(
            q, k_pages, v_pages, table, seqlens, causal=causal, softmax_scale=0.1, return_lse=True,
            window_size=expect_window, num_splits=3,
        )  # fmt: skip
    else:
        result = fa3.flash_attn_with_kvcache(
            q, k_dense, v_dense, cache_seqlens=seqlens, softmax_scale=0.1, causal=causal, window_size=window,
            num_splits=3, return_softmax_lse=True,
        )  # fmt: skip
        expect = hattn.attention(
            q, k_dense, v_dense, causal=causal, softmax_scale=0.1, return_lse=True, window_size=expect_window,
            seqlens_k=seqlens, num_splits=3,
        )  # fmt: skip
    out, lse, out_accum, lse_accum = result
    same(out, expect[0])
    same(lse, expect[1])
    assert out_accum.numel() == 0 and lse_accum.numel() == 0 and out_accum.device == q.device


@requires_hopper
def test_kvcache_page_table_without_cache_seqlens_reads_every_page():
    q, k_pages, v_pages, table, _, _, _ = gpu_kvcache([300, 256, 10], seqlen_q=1)
    out = fa3.flash_attn_with_kvcache(q, k_pages, v_pages, page_table=table, causal=True)
    full = torch.full((3,), table.shape[1] * 128, dtype=torch.int32, device="cuda")
    same(out, hattn.attention_paged(q, k_pages, v_pages, table, full, causal=True))


@requires_hopper
@pytest.mark.parametrize("rotary", [None, "gpt_j", "gpt_neox"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_same_as_fa2_form(paged, rotary):
    """Appending k, v (rotated with rotary), cache_batch_idx and softcap: the caches and the
    result of hattn's FA2 form run on copies of the caches, bit for bit."""
    lens, seqlen_new = [0, 1, 300, 126], 3
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache(lens, seqlen_q=seqlen_new, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    new_k, new_v = (
        torch.randn(len(lens), seqlen_new, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    entries = torch.tensor([3, 2, 1, 0], dtype=torch.int32, device="cuda")
    k_cache, v_cache = (k_pages, v_pages) if paged else (k_dense, v_dense)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    extra = {"cache_batch_idx": entries, "softcap": 20.0, "causal": True}
    if rotary:
        angles = torch.rand(k_dense.shape[1], 48, device="cuda", generator=gen) * 6.3  # rotary_dim 96
        extra.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=rotary == "gpt_j")
    out, lse, *_ = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, new_k, new_v, cache_seqlens=seqlens, page_table=table if paged else None,
        return_softmax_lse=True, **extra,
    )  # fmt: skip
    expect, expect_lse = hattn.flash_attn_with_kvcache(
        q, k_copy, v_copy, new_k, new_v, cache_seqlens=seqlens, block_table=table if paged else None,
        return_softmax_lse=True, **extra,
    )  # fmt: skip
    same(k_cache, k_copy)
    same(v_cache, v_copy)
    same(out, expect)
    same(lse, expect_lse)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_same_as_attention_fp8(causal):
    """FA3's FP8 call: hattn.attention_fp8's bf16 out and LSE, with descales [B, Hkv]; the causal
    mask also as window_size=(-1, 0)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (
        (torch.randn(2, s, h, 128, device="cuda", generator=gen) + INPUT_MEAN).to(torch.float8_e4m3fn)
        for s, h in ((300, 8), (200, 2), (200, 2))
    )
    qd, kd, vd = (torch.rand(2, 2, device="cuda", generator=gen) + 0.25 for _ in range(3))
    out, lse = fa3.flash_attn_func(
        q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
    )  # fmt: skip
    expect, expect_lse = hattn.attention_fp8(
        q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, return_lse=True
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    same(out, expect)
    same(lse, expect_lse)
    if causal:
        same(fa3.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, window_size=(-1, 0)), expect)


# --- FA3's MLA call (qv) -------------------------------------------------------------------------


def mla_call_inputs(device="cpu", lens=(100, 7), pages_per_seq=2):
    """FA3's MLA inputs over one latent buffer [P, 64, 1, 576]: q (rope, 64), qv (latent, 512),
    k_cache (its last 64 features), v_cache (its first 512), a page table and the lengths."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    batch = len(lens)
    buffer = torch.randn(batch * pages_per_seq, 64, 1, 576, generator=gen).to(torch.bfloat16).to(device)
    q_full = torch.randn(batch, 1, 16, 576, generator=gen).to(torch.bfloat16).to(device)
    table = torch.arange(batch * pages_per_seq, dtype=torch.int32, device=device).view(batch, pages_per_seq)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q_full[..., 512:], q_full[..., :512], buffer[..., 512:], buffer[..., :512], table, seqlens, q_full, buffer


def test_mla_call_goes_to_mla_with_kvcache():
    """Views of one latent buffer reach hattn's MLA path (on the CPU it then asks for a GPU)."""
    q, qv, k_cache, v_cache, table, seqlens, _, _ = mla_call_inputs()
    with pytest.raises(ValueError, match="q: must be a CUDA tensor"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, page_table=table, cache_seqlens=seqlens)


def test_mla_call_refusals_are_named():
    q, qv, k_cache, v_cache, table, seqlens, _, _ = mla_call_inputs()
    with pytest.raises(NotImplementedError, match=r"qv with k_cache and v_cache that are not views of one"):
        fa3.flash_attn_with_kvcache(q, k_cache.clone(), v_cache, qv=qv, page_table=table, cache_seqlens=seqlens)
    with pytest.raises(NotImplementedError, match=r"qv without page_table .*window_size with qv .*softcap with qv"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=seqlens, window_size=(8, 0),
                                    softcap=5.0)  # fmt: skip
    with pytest.raises(NotImplementedError, match=r"qv \(no second query-value product"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv[..., :64], page_table=table, cache_seqlens=seqlens)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_mla_call_same_as_mla_with_kvcache(causal):
    """FA3's MLA call on views of one latent buffer: hattn.mla_with_kvcache's out and LSE, bit for
    bit (its default scale, 1/sqrt(64 + 512), is FA3's with qv)."""
    q, qv, k_cache, v_cache, table, seqlens, q_full, buffer = mla_call_inputs("cuda", lens=(100, 7, 128))
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, page_table=table, cache_seqlens=seqlens,
                                               causal=causal, return_softmax_lse=True)  # fmt: skip
    expect, expect_lse = hattn.mla_with_kvcache(q_full, buffer, table, seqlens, causal=causal, return_lse=True)
    same(out, expect)
    same(lse, expect_lse)
    assert torch.equal(fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, page_table=table,
                                                   cache_seqlens=seqlens, causal=causal), expect)  # fmt: skip
