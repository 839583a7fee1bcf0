"""hattn.flash_attn_func, hattn.flash_attn_varlen_func and hattn.flash_attn_with_kvcache, the
drop-ins for FlashAttention-2's functions of those names: what they refuse (CPU; gradients only
for the KV-cache function), and that they are hattn.attention, hattn.attention_varlen and
hattn.attention_paged under FlashAttention's argument order (GPU), gradients of flash_attn_func
and flash_attn_varlen_func included."""

import hattn
import pytest
import torch
from helpers import (
    attention_ref,
    check_gradients,
    check_sequence,
    check_varlen_func_gradients,
    gpu_kvcache,
    gpu_varlen,
    gradients,
    make_qkv,
    requires_hopper,
)


def cpu_qkv():
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    return q, q.clone(), q.clone()


def cpu_varlen():
    """q, k, v [16, 2, 64] as two sequences of 10 and 6, with cu_seqlens and max_seqlen."""
    q = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    return q, q.clone(), q.clone(), cu, cu.clone(), 10, 10


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"alibi_slopes": torch.zeros(2)}, "alibi_slopes"),
    ],
)
def test_unsupported_arguments_are_named(kwargs, words):
    with pytest.raises(NotImplementedError, match=words):
        hattn.flash_attn_func(*cpu_qkv(), **kwargs)


def test_softcap_reaches_the_ops():
    """softcap reaches hattn.attention (here: the GPU check of CPU tensors), with gradients too,
    at every head dim; with FP8 inputs it is refused by name; a bad value is named by
    hattn.attention."""
    gpu = r"no suitable GPU|must be a CUDA tensor"
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_func(*cpu_qkv(), softcap=30.0)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_varlen_func(*cpu_varlen(), softcap=30.0)
    q, k, v = cpu_qkv()
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_func(q.requires_grad_(), k, v, softcap=30.0)
    q, k, v = (torch.randn(1, 16, 2, 256, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_func(q.requires_grad_(), k, v, softcap=30.0)
    args = [torch.randn(16, 2, 256, dtype=torch.bfloat16).requires_grad_()] + list(cpu_varlen())[1:]
    args[1], args[2] = args[0].detach(), args[0].detach()
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_varlen_func(*args, softcap=2.0)
    fp8 = [t.to(torch.float8_e4m3fn) for t in cpu_qkv()]
    with pytest.raises(NotImplementedError, match=r"softcap=5.0 with FP8 inputs"):
        hattn.flash_attn_func(*fp8, softcap=5.0)
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError)):
        with pytest.raises(error, match=r"softcap: must be"):
            hattn.attention(*cpu_qkv(), softcap=bad)


def test_inputs_that_need_grad_reach_the_op():
    # flash_attn_func is differentiable: a call with gradients goes on to hattn.attention like any other.
    q, k, v = cpu_qkv()
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(q.requires_grad_(), k, v, causal=True, window_size=(8, 0))


def test_deterministic_goes_on_to_the_backward():
    # With gradients the call goes on (the backward adds in a fixed order) and needs the GPU like
    # any other, at D = 256 with GQA too.
    q, k, v = cpu_qkv()
    q.requires_grad_()
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(q, k, v, deterministic=True)
    q, k, v = (torch.randn(1, 8, heads, 256, dtype=torch.bfloat16) for heads in (4, 2, 2))
    q.requires_grad_()
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(q, k, v, deterministic=True)
    with torch.no_grad(), pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(q, k, v, deterministic=True)  # no backward: nothing to order


def test_meta_gradients_have_the_inputs_shapes():
    """On meta tensors the ops' fake implementations answer: flash_attn_func's output has hattn's
    backward as grad_fn, and backward gives dq, dk, dv shaped like q, k, v (GQA 2)."""
    q = torch.empty(2, 5, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(2, 7, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = hattn.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    assert "hattn_attention_fwd" in type(out.grad_fn).__name__
    out.backward(torch.empty_like(out))
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_positional_order_is_flash_attn_s():
    # dropout_p comes fourth, as in flash_attn_func: a positional 0.5 there is a dropout, not a scale.
    with pytest.raises(NotImplementedError, match="dropout_p=0.5"):
        hattn.flash_attn_func(*cpu_qkv(), 0.5)


def test_supported_call_reaches_the_op():
    # With the defaults the call goes on to hattn.attention, which wants CUDA tensors: without a
    # GPU it says none is present (RuntimeError), with one that q is not on it (ValueError).
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(*cpu_qkv(), deterministic=True)


def test_return_attn_probs_asks_for_the_lse():
    """return_attn_probs=True is FlashAttention-2's (out, softmax_lse, S_dmask): the call asks the
    op for the LSE (here it gets as far as the GPU check of CPU tensors); with FP8 it is refused."""
    gpu = r"no suitable GPU|must be a CUDA tensor"
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_func(*cpu_qkv(), return_attn_probs=True)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_varlen_func(*cpu_varlen(), return_attn_probs=True)
    q8 = torch.zeros(1, 16, 2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"return_attn_probs=True with FP8 inputs"):
        hattn.flash_attn_func(q8, q8, q8, return_attn_probs=True)


def test_window_size_reaches_the_op():
    # A window is supported: the call gets as far as the device check, like a plain one.
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(*cpu_qkv(), window_size=(128, 0))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"alibi_slopes": torch.zeros(2)}, "alibi_slopes"),
        ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, r"block_table \(no paged KV with a variable-length"),
    ],
)
def test_varlen_unsupported_arguments_are_named(kwargs, words):
    with pytest.raises(NotImplementedError, match=r"hattn.flash_attn_varlen_func does not support .*" + words):
        hattn.flash_attn_varlen_func(*cpu_varlen(), **kwargs)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_varlen_inputs_that_need_grad_reach_the_op(which):
    # flash_attn_varlen_func is differentiable: a call with gradients goes on to hattn.attention_varlen.
    args = list(cpu_varlen())
    args[which].requires_grad_()
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_varlen_func(*args, causal=True)


def test_varlen_deterministic_goes_on_to_the_backward():
    args = list(cpu_varlen())
    args[0].requires_grad_()
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_varlen_func(*args, deterministic=True)


def test_varlen_meta_gradients_have_the_inputs_shapes():
    """On meta tensors: flash_attn_varlen_func's output has hattn's varlen backward as grad_fn, and
    backward gives dq [total_q, Hq, D], dk and dv [total_k, Hkv, D] (GQA 2)."""
    q = torch.empty(16, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(20, 2, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.empty(3, device="meta", dtype=torch.int32) for _ in range(2))
    out = hattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 12, causal=True)
    assert "hattn_attention_varlen_fwd" in type(out.grad_fn).__name__
    out.backward(torch.empty_like(out))
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_varlen_positional_order_is_flash_attn_s():
    # dropout_p comes right after max_seqlen_k, as in flash_attn_varlen_func.
    with pytest.raises(NotImplementedError, match="dropout_p=0.5"):
        hattn.flash_attn_varlen_func(*cpu_varlen(), 0.5)


def test_varlen_supported_call_reaches_the_op():
    # Arguments are checked by hattn.attention_varlen first, then the device as for flash_attn_func.
    q, k, v, cu_q, cu_k, max_q, max_k = cpu_varlen()
    with pytest.raises(ValueError, match=r"cu_seqlens_q: dtype must be torch.int32"):
        hattn.flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_varlen_func(*cpu_varlen(), deterministic=True, window_size=(4, 0), causal=True)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_same_as_attention(causal):
    q, k, v = make_qkv(2, 300, 200, 8, 2, 128, torch.bfloat16)
    out = hattn.flash_attn_func(q, k, v, 0.0, 0.1, causal)
    torch.testing.assert_close(out, hattn.attention(q, k, v, causal=causal, softmax_scale=0.1), rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_same_as_attention(causal):
    # flash_attn's convention: causal=True makes the window's right side 0, whatever was passed.
    q, k, v = make_qkv(2, 300, 200, 8, 2, 128, torch.bfloat16)
    out = hattn.flash_attn_func(q, k, v, causal=causal, window_size=(50, 30))
    expect = hattn.attention(q, k, v, causal=causal, window_size=(50, 0 if causal else 30))
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, causal, window, scale",
    [
        ((2, 37, 53, 4, 2, 64), False, (-1, -1), None),  # GQA 2, lengths not multiples of 64
        ((1, 130, 130, 4, 4, 128), True, (-1, -1), 0.1),
        ((2, 100, 100, 8, 1, 128), False, (30, 20), None),  # MQA, a two-sided window
        ((1, 70, 150, 4, 2, 64), True, (40, 7), None),  # causal makes the window (40, 0)
    ],
)
def test_gradients_match_reference(shape, causal, window, scale, dtype):
    """dq, dk, dv through flash_attn_func against the fp64 reference's autograd (test_backward.py's bound)."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, seed=seqlen_q)
    dout = make_qkv(batch, seqlen_q, seqlen_q, heads_q, heads_q, head_dim, dtype, seed=seqlen_q + 1)[0]
    got = gradients(
        lambda q, k, v: hattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window),
        q, k, v, dout,
    )  # fmt: skip
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=causal, softmax_scale=scale, window=window)[0],
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, dtype, f"{shape} causal={causal} window={window}")


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gradients_match_reference(causal):
    """dq, dk, dv through flash_attn_varlen_func against the fp64 reference per sequence."""
    check_varlen_func_gradients(hattn.flash_attn_varlen_func, causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_same_as_attention_varlen(causal):
    args = gpu_varlen([300, 0, 129, 17], [200, 50, 0, 400])
    out = hattn.flash_attn_varlen_func(*args, 0.0, 0.1, causal)
    expect = hattn.attention_varlen(*args, causal=causal, softmax_scale=0.1)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_window_same_as_attention_varlen(causal):
    # flash_attn's convention: causal=True makes the window's right side 0, whatever was passed.
    args = gpu_varlen([300, 0, 129, 17], [200, 50, 0, 400])
    out = hattn.flash_attn_varlen_func(*args, causal=causal, window_size=(50, 30), deterministic=True)
    expect = hattn.attention_varlen(*args, causal=causal, window_size=(50, 0 if causal else 30))
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


# --- flash_attn_with_kvcache ------------------------------------------------------------------------------


def cpu_kvcache(device="cpu"):
    """q [2, 4, 8, 64]; a dense cache [2, 300, 2, 64]; a paged one [6, 128, 2, 64] with table [2, 3]."""
    q = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16, device=device)
    dense = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16, device=device)
    pages = torch.randn(6, 128, 2, 64, dtype=torch.bfloat16, device=device)
    table = torch.arange(6, dtype=torch.int32, device=device).view(2, 3)
    return q, dense, pages, table


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"alibi_slopes": torch.zeros(8)}, r"alibi_slopes"),
    ],
)
def test_kvcache_unsupported_arguments_are_named(kwargs, words):
    q, dense, _, _ = cpu_kvcache()
    with pytest.raises(NotImplementedError, match=r"hattn.flash_attn_with_kvcache does not support .*" + words):
        hattn.flash_attn_with_kvcache(q, dense, dense, cache_seqlens=10, **kwargs)


def test_kvcache_names_every_unsupported_argument_and_grad():
    q, _, pages, table = cpu_kvcache()
    with pytest.raises(
        NotImplementedError, match=r"cache_leftpad with block_table .*alibi_slopes .*no backward with a KV cache yet"
    ):
        hattn.flash_attn_with_kvcache(
            q.requires_grad_(), pages, pages, cache_seqlens=10, cache_leftpad=torch.zeros(2, dtype=torch.int32),
            block_table=table, softcap=1.0, alibi_slopes=torch.zeros(8),
        )  # fmt: skip


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
def test_kvcache_index_argument_errors(name):
    q, dense, _, _ = cpu_kvcache()
    for bad, error, pattern in (
        (torch.zeros(2, dtype=torch.int64), ValueError, rf"{name}: dtype must be torch.int32, got torch.int64"),
        (torch.zeros(3, dtype=torch.int32), ValueError, rf"{name}: must be 1-D \[batch\] with q's batch 2"),
        ([0, 1], TypeError, rf"{name}: must be a torch.Tensor, got list"),
    ):
        with pytest.raises(error, match=pattern):
            hattn.flash_attn_with_kvcache(q, dense, dense, cache_seqlens=10, **{name: bad})


def test_kvcache_cache_batch_idx_frees_the_cache_batch():
    """With cache_batch_idx the dense cache and the block table may have more entries than q has
    sequences (the call gets past every shape check to the device check)."""
    q, dense, pages, table, new, rotary = cpu_append_args()
    index = torch.tensor([3, 0], dtype=torch.int32)
    big = dense[:1].expand(4, -1, -1, -1)
    gpu = r"no suitable GPU|must be a CUDA tensor"
    with pytest.raises(ValueError, match=r"k_cache: batch 4 must equal q's batch 2"):
        hattn.flash_attn_with_kvcache(q, big, big, cache_seqlens=10)
    for extra in ({}, {"k": new, "v": new.clone(), **rotary}):
        with pytest.raises((RuntimeError, ValueError), match=gpu):
            hattn.flash_attn_with_kvcache(q, big, big, cache_seqlens=10, cache_batch_idx=index, **extra)
        with pytest.raises((RuntimeError, ValueError), match=gpu):
            hattn.flash_attn_with_kvcache(
                q, pages, pages, cache_seqlens=10, cache_batch_idx=index, block_table=table.repeat(2, 1), **extra
            )  # fmt: skip
        with pytest.raises((RuntimeError, ValueError), match=gpu):
            hattn.flash_attn_with_kvcache(
                q, dense, dense, cache_seqlens=10, cache_leftpad=torch.zeros(2, dtype=torch.int32), **extra
            )  # fmt: skip


def test_kvcache_index_meta_shapes():
    q, dense, pages, table, new, rotary = cpu_append_args()
    q, dense, pages, table, new = (t.to("meta") for t in (q, dense, pages, table, new))
    index = torch.zeros(2, dtype=torch.int32, device="meta")
    big = dense[:1].expand(5, -1, -1, -1)
    out = hattn.flash_attn_with_kvcache(q, big, big, new, new, cache_seqlens=10, cache_batch_idx=index,
                                        cache_leftpad=index, causal=True)  # fmt: skip
    assert out.shape == q.shape and out.device.type == "meta"
    out = hattn.flash_attn_with_kvcache(q, pages, pages, new, new, cache_seqlens=10, cache_batch_idx=index,
                                        block_table=table.repeat(3, 1))  # fmt: skip
    assert out.shape == q.shape


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("which", ["q", "k_cache", "v_cache"])
def test_kvcache_inputs_that_need_grad_are_refused(paged, which):
    q, dense, pages, table = cpu_kvcache()
    cache, extra = (pages, {"block_table": table}) if paged else (dense, {})
    args = {"q": q, "k_cache": cache, "v_cache": cache.clone()}
    args[which].requires_grad_()
    with pytest.raises(NotImplementedError, match=r"require grad \(hattn has no backward with a KV cache yet"):
        hattn.flash_attn_with_kvcache(**args, cache_seqlens=10, **extra)


def test_kvcache_positional_order_is_flash_attn_s():
    # k comes fourth and cache_seqlens eighth, as in flash_attn_with_kvcache.
    q, dense, _, _ = cpu_kvcache()
    with pytest.raises(ValueError, match=r"k, v: pass both"):
        hattn.flash_attn_with_kvcache(q, dense, dense, q[:, :, :2])
    with pytest.raises(ValueError, match=r"cache_seqlens: dtype must be torch.int32, got torch.int64"):
        hattn.flash_attn_with_kvcache(q, dense, dense, None, None, None, None, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize(
    "cache_seqlens, error, pattern",
    [
        (torch.zeros(2, dtype=torch.int64), ValueError, r"cache_seqlens: dtype must be torch.int32"),
        (torch.zeros(3, dtype=torch.int32), ValueError, r"cache_seqlens: must be 1-D \[batch\] with q's batch 2"),
        (-1, ValueError, r"cache_seqlens: must be >= 0, got -1"),
        (10.0, TypeError, r"cache_seqlens: must be an int or a torch.int32 tensor \[batch\], got float"),
        (True, TypeError, r"cache_seqlens: must be an int or a torch.int32 tensor \[batch\], got bool"),
    ],
)
def test_kvcache_cache_seqlens_errors(cache_seqlens, error, pattern):
    q, dense, pages, table = cpu_kvcache()
    with pytest.raises(error, match=pattern):
        hattn.flash_attn_with_kvcache(q, dense, dense, cache_seqlens=cache_seqlens)
    with pytest.raises(error, match=pattern):
        hattn.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=cache_seqlens, block_table=table)


def test_kvcache_errors_name_the_caches():
    q, dense, pages, table = cpu_kvcache()
    with pytest.raises(ValueError, match=r"cache_seqlens: required with block_table"):
        hattn.flash_attn_with_kvcache(q, pages, pages, block_table=table)
    with pytest.raises(ValueError, match=r"k_cache: batch 1 must equal q's batch 2"):
        hattn.flash_attn_with_kvcache(q, dense[:1], dense[:1], cache_seqlens=10)
    with pytest.raises(ValueError, match=r"v_cache: shape \(2, 299, 2, 64\) must equal k_cache's shape"):
        hattn.flash_attn_with_kvcache(q, dense, dense[:, 1:], cache_seqlens=10)
    with pytest.raises(ValueError, match=r"k_cache: must be 4-D \[num_pages, page_size, heads_kv, head_dim\]"):
        hattn.flash_attn_with_kvcache(q, pages[0], pages[0], cache_seqlens=10, block_table=table)
    with pytest.raises(ValueError, match=r"block_table: dtype must be torch.int32"):
        hattn.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=10, block_table=table.long())
    with pytest.raises(ValueError, match=r"num_splits: must be 0 \(automatic\), 1 \(off\) or up to 64, got 99"):
        hattn.flash_attn_with_kvcache(q, dense, dense, num_splits=99)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_supported_call_reaches_the_op(paged):
    q, dense, pages, table = cpu_kvcache()
    cache, extra = (pages, {"block_table": table}) if paged else (dense, {})
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_with_kvcache(
            q, cache, cache, cache_seqlens=torch.full((2,), 7, dtype=torch.int32), causal=True, window_size=(50, 3),
            num_splits=2, rotary_interleaved=False, **extra,
        )  # fmt: skip


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_meta_shapes(paged):
    """On meta tensors the ops' fake implementations answer: the drop-in's result shapes."""
    q, dense, pages, table = cpu_kvcache("meta")
    cache, extra = (pages, {"block_table": table}) if paged else (dense, {})
    out = hattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=100, **extra)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.device.type == "meta"
    out, lse = hattn.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=100, return_softmax_lse=True, **extra)
    assert out.shape == q.shape and lse.shape == (2, 8, 4) and lse.dtype == torch.float32


# Appending k, v and rotary embedding: argument errors, and the helpers on CPU tensors against loops.


def cpu_append_args():
    q, dense, pages, table = cpu_kvcache()
    new = torch.randn(2, 3, 2, 64, dtype=torch.bfloat16)
    rotary = {"rotary_cos": torch.randn(384, 16), "rotary_sin": torch.randn(384, 16)}
    return q, dense, pages, table, new, rotary


@pytest.mark.parametrize(
    "change, error, pattern",
    [
        ({"v": None}, ValueError, r"k, v: pass both"),
        ({"k": "x"}, TypeError, r"k: must be a torch.Tensor, got str"),
        ({"k": torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16)}, ValueError, r"k: must be 4-D \[batch, seqlen_new, .*heads_kv 2"),
        ({"v": torch.zeros(1, 3, 2, 64, dtype=torch.bfloat16)}, ValueError, r"v: must be 4-D .*q's batch 2"),
        ({"v": torch.zeros(2, 4, 2, 64, dtype=torch.bfloat16)}, ValueError, r"v: shape \(2, 4, 2, 64\) must equal k's"),
        ({"k": torch.zeros(2, 3, 2, 64, dtype=torch.float16)}, ValueError, r"k: dtype torch.float16 must match k_cache's"),
        ({"cache_seqlens": None}, ValueError, r"cache_seqlens: required with k and v"),
        ({"rotary_sin": None}, ValueError, r"rotary_cos, rotary_sin: pass both"),
        ({"rotary_cos": torch.randn(384, 40), "rotary_sin": torch.randn(384, 40)}, ValueError,
         r"rotary_cos: must be 2-D \[seqlen_ro, rotary_dim / 2\] with 2 <= rotary_dim <= head_dim \(64\)"),
        ({"rotary_cos": torch.randn(299, 16), "rotary_sin": torch.randn(299, 16)}, ValueError,
         r"rotary_cos: seqlen_ro \(299, dim 0\) must be at least the cache's keys per sequence \(300\)"),
        ({"rotary_sin": torch.randn(384, 8)}, ValueError, r"rotary_sin: shape \(384, 8\) must equal rotary_cos's"),
        ({"rotary_cos": torch.randn(384, 16, dtype=torch.float64)}, None, None),  # any float dtype is fine
        ({"rotary_sin": torch.zeros(384, 16, dtype=torch.int32)}, ValueError, r"rotary_sin: dtype must be"),
        ({"k": None, "v": None}, ValueError, r"rotary_cos, rotary_sin: only with k and v"),
    ],
)  # fmt: skip
def test_kvcache_append_argument_errors(change, error, pattern):
    q, dense, _, _, new, rotary = cpu_append_args()
    args = {"k": new, "v": new.clone(), "cache_seqlens": 10, **rotary, **change}
    before = dense.clone()
    # The checks come before the GPU check (CPU tensors here), and nothing is written.
    with pytest.raises(error or (RuntimeError, ValueError), match=pattern or r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_with_kvcache(q, dense, dense, **args)
    assert torch.equal(dense, before)


def test_kvcache_append_paged_checks_the_table_and_rotary_covers_it():
    q, _, pages, table, new, _ = cpu_append_args()
    # 3 pages of 128 keys: the rotary table must cover 384 positions.
    cos = torch.randn(300, 16)
    with pytest.raises(ValueError, match=r"rotary_cos: seqlen_ro \(300, dim 0\) must be at least .*\(384\)"):
        hattn.flash_attn_with_kvcache(
            q, pages, pages, new, new, cos, cos, cache_seqlens=10, block_table=table
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"block_table: dtype must be torch.int32"):
        hattn.flash_attn_with_kvcache(q, pages, pages, new, new, cache_seqlens=10, block_table=table.long())


def test_kvcache_append_refuses_new_rows_that_need_grad():
    q, dense, _, _, new, _ = cpu_append_args()
    with pytest.raises(NotImplementedError, match=r"require grad \(hattn has no backward with a KV cache yet"):
        hattn.flash_attn_with_kvcache(q, dense, dense, new.requires_grad_(), new.clone(), cache_seqlens=10)


def test_kvcache_append_meta_shapes():
    q, dense, pages, table, new, rotary = cpu_append_args()
    q, dense, pages, table, new = (t.to("meta") for t in (q, dense, pages, table, new))
    rotary = {name: t.to("meta") for name, t in rotary.items()}
    out = hattn.flash_attn_with_kvcache(q, dense, dense, new, new, cache_seqlens=10, causal=True, **rotary)
    assert out.shape == q.shape and out.device.type == "meta"
    out = hattn.flash_attn_with_kvcache(q, pages, pages, new, new, cache_seqlens=10, block_table=table, **rotary)
    assert out.shape == q.shape


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_compiles_without_breaks(paged):
    """Dynamo traces the append (a mutating op) and the attention into one graph (meta tensors)."""
    torch._dynamo.reset()
    q, dense, pages, table, new, rotary = cpu_append_args()
    q, dense, pages, table, new = (t.to("meta") for t in (q, dense, pages, table, new))
    rotary = {name: t.to("meta") for name, t in rotary.items()}
    cache, extra = (pages, {"block_table": table}) if paged else (dense, {})
    lens = torch.zeros(2, dtype=torch.int32, device="meta")

    def step(q, k_cache, v_cache, k, v, lens):
        return hattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, **rotary, **extra
        )  # fmt: skip

    out = torch.compile(step, backend="eager", fullgraph=True)(q, cache, cache.clone(), new, new.clone(), lens)
    assert out.shape == q.shape


def appended_by_loop(cache, new, starts, table=None):
    """The cache after writing new [B, n, H, D] at keys starts[b] + i that fit (a Python loop)."""
    cache = cache.clone()
    page_size = cache.shape[1]
    capacity = table.shape[1] * page_size if table is not None else cache.shape[1]
    for b, start in enumerate(starts):
        for i in range(new.shape[1]):
            key = max(start, 0) + i
            if key >= capacity:
                continue
            if table is None:
                cache[b, key] = new[b, i]
            else:
                cache[int(table[b, key // page_size]), key % page_size] = new[b, i]
    return cache


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_append_kv_op_against_a_loop(paged):
    """hattn::append_kv on sequences that start empty, in the middle, across a page edge, right at
    the end, past it, and with a negative length (read as 0): the rows that fit are written,
    nothing else, and the lengths after are max(start, 0) + n."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    starts = [0, 5, 126, 380, 383, 384, 500, -3]
    batch, n = len(starts), 4

    def rand(*shape):
        return torch.randn(*shape, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    new_k, new_v = rand(batch, n), rand(batch, n)
    if paged:
        table = torch.randperm(3 * batch, device="cuda", generator=gen).to(torch.int32).view(batch, 3)
        k_cache, v_cache = rand(3 * batch, 128), rand(3 * batch, 128)
    else:
        table = None
        k_cache, v_cache = rand(batch, 384), rand(batch, 384)
    want_k, want_v = appended_by_loop(k_cache, new_k, starts, table), appended_by_loop(v_cache, new_v, starts, table)
    q = rand(batch, 1)
    seqlens = torch.tensor(starts, dtype=torch.int32, device="cuda")
    after, q_rotated = hattn.ops.append_kv(q, k_cache, v_cache, new_k, new_v, seqlens, table, None, None, True, False)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert after.tolist() == [max(s, 0) + n for s in starts] and seqlens.tolist() == starts
    assert q_rotated.numel() == 0


def rotated_by_reference(x, cos, sin, positions, interleaved):
    """x [B, S, H, D] rotated at positions [B, S] (clamped to the tables) in float64 as complex
    pairs, rounded to x's dtype; the features past rotary_dim unchanged."""
    half = cos.shape[1]
    rot = x[..., : 2 * half].double()
    first, second = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    turn = torch.complex(cos.double(), sin.double())[positions.clamp(max=cos.shape[0] - 1)].unsqueeze(2)
    turned = torch.complex(first, second) * turn
    if interleaved:
        rot = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    else:
        rot = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half :]), dim=-1)


@requires_hopper
@pytest.mark.parametrize("per_row", [False, True], ids=["q_at_start", "q_per_row"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gpt_j", "gpt_neox"])
@pytest.mark.parametrize("rotary_dim", [64, 32, 2])
def test_append_kv_op_rotary(rotary_dim, interleaved, per_row):
    """The new keys (in the cache) and q (returned) rotated at their positions, against complex
    rotation in float64; q's positions past the tables clamp to the last row."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    starts, n, seqlen_q = [0, 7, 36], 3, 5

    def rand(*shape):
        return torch.randn(*shape, 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, new_k, new_v = rand(3, seqlen_q, 4), rand(3, n, 2), rand(3, n, 2)
    k_cache, v_cache = rand(3, 40, 2), rand(3, 40, 2)
    angles = torch.rand(40, rotary_dim // 2, device="cuda", dtype=torch.float64, generator=gen) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    seqlens = torch.tensor(starts, dtype=torch.int32, device="cuda")
    _, q_rotated = hattn.ops.append_kv(q, k_cache, v_cache, new_k, new_v, seqlens, None, cos, sin, interleaved, per_row)
    start = seqlens.long().unsqueeze(1)
    k_want = rotated_by_reference(new_k, cos, sin, start + torch.arange(n, device="cuda"), interleaved)
    steps = torch.arange(seqlen_q, device="cuda") if per_row else torch.zeros(seqlen_q, dtype=torch.long, device="cuda")
    q_want = rotated_by_reference(q, cos, sin, start + steps, interleaved)
    for b, s0 in enumerate(starts):
        fits = min(n, 40 - s0)
        torch.testing.assert_close(k_cache[b, s0 : s0 + fits], k_want[b, :fits], rtol=2**-7, atol=1e-6)
        assert torch.equal(v_cache[b, s0 : s0 + fits], new_v[b, :fits])
    torch.testing.assert_close(q_rotated, q_want, rtol=2**-7, atol=1e-6)
    assert torch.equal(q_rotated[..., rotary_dim:], q[..., rotary_dim:])


@requires_hopper
def test_append_kv_op_errors_name_the_argument():
    """The C++ checks behind the op (hattn::validate_append_kv_arguments), reached directly."""
    q = torch.zeros(1, 1, 2, 96, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(1, 8, 2, 96, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"invalid_argument: head_dim: must be 64, 128 or 256, got 96"):
        hattn.ops.append_kv(q, cache, cache.clone(), q[:, :, :2], q[:, :, :2].clone(), seqlens, None, None, None,
                            True, False)  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvcache_paged_same_as_attention_paged(causal):
    q, k_pages, v_pages, table, _, _, seqlens = gpu_kvcache([0, 1, 300, 129, 512])
    out, lse = hattn.flash_attn_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, softmax_scale=0.1, causal=causal,
        window_size=(50, 30), num_splits=3, return_softmax_lse=True,
    )  # fmt: skip
    expect, expect_lse = hattn.attention_paged(
        q, k_pages, v_pages, table, seqlens, causal=causal, softmax_scale=0.1, return_lse=True,
        window_size=(50, 0 if causal else 30), num_splits=3,
    )  # fmt: skip
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvcache_dense_same_as_attention_with_seqlens_k(causal):
    q, _, _, _, k_dense, v_dense, seqlens = gpu_kvcache([0, 1, 300, 129, 512])
    out = hattn.flash_attn_with_kvcache(q, k_dense, v_dense, cache_seqlens=seqlens, causal=causal)
    expect = hattn.attention(q, k_dense, v_dense, causal=causal, seqlens_k=seqlens)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    # No cache_seqlens: every key of the dense cache.
    out = hattn.flash_attn_with_kvcache(q, k_dense, v_dense, causal=causal)
    torch.testing.assert_close(out, hattn.attention(q, k_dense, v_dense, causal=causal), rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_int_cache_seqlens_is_every_sequence(paged):
    q, k_pages, v_pages, table, k_dense, v_dense, _ = gpu_kvcache([300, 300, 300], seqlen_q=1)
    full = torch.full((3,), 200, dtype=torch.int32, device="cuda")
    if paged:
        out = hattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=200, block_table=table)
        expect = hattn.attention_paged(q, k_pages, v_pages, table, full)
    else:
        out = hattn.flash_attn_with_kvcache(q, k_dense, v_dense, cache_seqlens=200)
        expect = hattn.attention(q, k_dense, v_dense, seqlens_k=full)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


@requires_hopper
def test_kvcache_paged_and_dense_agree():
    """The same keys in pages and in a dense cache: the two paths of the drop-in agree."""
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache([0, 1, 300, 129, 512], seqlen_q=64)
    paged = hattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, causal=True)
    dense = hattn.flash_attn_with_kvcache(q, k_dense, v_dense, cache_seqlens=seqlens, causal=True)
    torch.testing.assert_close(paged, dense, rtol=0, atol=2e-2)


def sequence_keys(cache, b, length, table=None):
    """Sequence b's first `length` keys [length, Hkv, D] of a dense or paged cache."""
    if table is None:
        return cache[b, :length]
    return cache[table[b].long()].flatten(0, 1)[:length]


@requires_hopper
@pytest.mark.parametrize("rotary", [None, "gpt_j", "gpt_neox"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append(paged, causal, rotary):
    """k, v appended at cache_seqlens (rotated first with rotary), the rest of the cache kept,
    and the attention over cache_seqlens + seqlen_new keys against the fp64 reference, with q
    rotated at cache_seqlens + i (causal) or cache_seqlens (full). The last sequence fills the
    cache exactly."""
    lens, seqlen_new, head_dim = [0, 1, 300, 126, 381], 3, 128
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache(lens, seqlen_q=seqlen_new, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    new_k, new_v = (
        torch.randn(len(lens), seqlen_new, 2, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    k_cache, v_cache, extra = (k_pages, v_pages, {"block_table": table}) if paged else (k_dense, v_dense, {})
    before_k, before_v = k_cache.clone(), v_cache.clone()
    capacity = k_dense.shape[1]  # 384: three pages of 128
    if rotary:
        angles = torch.rand(capacity, 48, device="cuda", dtype=torch.float64, generator=gen) * 6.3  # rotary_dim 96
        extra.update(rotary_cos=angles.cos().bfloat16(), rotary_sin=angles.sin().bfloat16())
        extra["rotary_interleaved"] = rotary == "gpt_j"
    out, lse = hattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, new_k, new_v, cache_seqlens=seqlens, causal=causal, return_softmax_lse=True, **extra
    )
    assert torch.equal(seqlens.cpu(), torch.tensor(lens, dtype=torch.int32)), "cache_seqlens must not change"
    starts = torch.tensor(lens, device="cuda").unsqueeze(1)
    steps = torch.arange(seqlen_new, device="cuda")
    q_ref, k_new_ref = q, new_k
    if rotary:
        cos, sin, interleaved = extra["rotary_cos"], extra["rotary_sin"], extra["rotary_interleaved"]
        k_new_ref = rotated_by_reference(new_k, cos, sin, starts + steps, interleaved)
        q_positions = starts + (steps if causal else 0 * steps)
        q_ref = rotated_by_reference(q, cos, sin, q_positions.expand(-1, seqlen_new), interleaved)
    for b, n in enumerate(lens):
        # The new rows (within one rounding of the fp64 rotation), and the cache's other rows untouched.
        got_k = sequence_keys(k_cache, b, capacity, table if paged else None)
        got_v = sequence_keys(v_cache, b, capacity, table if paged else None)
        old_k = sequence_keys(before_k, b, capacity, table if paged else None)
        old_v = sequence_keys(before_v, b, capacity, table if paged else None)
        torch.testing.assert_close(got_k[n : n + seqlen_new], k_new_ref[b], rtol=2**-7, atol=1e-6)
        assert torch.equal(got_v[n : n + seqlen_new], new_v[b])
        keep = torch.ones(capacity, dtype=torch.bool, device="cuda")
        keep[n : n + seqlen_new] = False
        assert torch.equal(got_k[keep], old_k[keep]) and torch.equal(got_v[keep], old_v[keep])
        keys = torch.cat((old_k[:n], got_k[n : n + seqlen_new]))
        values = torch.cat((old_v[:n], new_v[b]))
        check_sequence(out[b], lse[b], q_ref[b], keys, values, causal, None, (-1, -1), f"b={b} cache {n}")


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_past_the_cache_end(paged):
    """Rows that do not fit are not written and the length is clamped to the cache: 382 + 4
    writes 2 rows, 384 and 400 write none; every sequence then attends to its 384 keys."""
    lens, seqlen_new = [382, 384, 400], 4
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache(
        [384] * 3, seqlen_q=seqlen_new, seed=5
    )  # fmt: skip
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    new = torch.randn(3, seqlen_new, 2, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache, extra = (k_pages, v_pages, {"block_table": table}) if paged else (k_dense, v_dense, {})
    before = k_cache.clone()
    out, lse = hattn.flash_attn_with_kvcache(
        q, k_cache, v_cache, new, new, cache_seqlens=seqlens, return_softmax_lse=True, **extra
    )  # fmt: skip
    for b, n in enumerate(lens):
        got = sequence_keys(k_cache, b, 384, table if paged else None)
        old = sequence_keys(before, b, 384, table if paged else None)
        written = max(0, 384 - n)
        assert torch.equal(got[:n], old[:n]) and torch.equal(got[n : n + written], new[b, :written])
        values = sequence_keys(v_cache, b, 384, table if paged else None)
        check_sequence(out[b], lse[b], q[b], got, values, False, None, (-1, -1), f"b={b} cache {n}")


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_cuda_graph(paged):
    """The append reads nothing on the host: one captured decoding step replays with new keys,
    new lengths and (paged) a new table, as eager calls on copies do."""
    lens = [10, 200, 0]
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache(lens, seqlen_q=1, seed=6)
    new = torch.randn(3, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(384, 64, device="cuda")
    rotary = {"rotary_cos": angles.cos(), "rotary_sin": angles.sin()}
    k_cache, v_cache, extra = (k_pages, v_pages, {"block_table": table}) if paged else (k_dense, v_dense, {})

    def step():
        return hattn.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens, **rotary, **extra)

    step()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens.copy_(torch.tensor([300, 5, 128], dtype=torch.int32))
    new.copy_(torch.randn_like(new))
    if paged:
        table.copy_(table.flip(0))
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    graph.replay()
    expect = hattn.flash_attn_with_kvcache(q, k_copy, v_copy, new, new, cache_seqlens=seqlens, **rotary, **extra)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_compiled(paged):
    """torch.compile(fullgraph=True) of a decoding step with the append: the caches and the out
    as eager calls on copies give them."""
    torch._dynamo.reset()
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache([10, 200, 0], seqlen_q=1, seed=8)
    new_k, new_v = (torch.randn(3, 1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    angles = torch.rand(384, 64, device="cuda")
    rotary = {"rotary_cos": angles.cos().bfloat16(), "rotary_sin": angles.sin().bfloat16()}
    k_cache, v_cache, extra = (k_pages, v_pages, {"block_table": table}) if paged else (k_dense, v_dense, {})

    def step(q, k_cache, v_cache, k, v, lens):
        return hattn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, **rotary, **extra
        )  # fmt: skip

    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    out = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, new_k, new_v, seqlens)
    expect = step(q, k_copy, v_copy, new_k, new_v, seqlens)
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


# --- cache_batch_idx and cache_leftpad ----------------------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_cache_batch_idx(paged, causal):
    """Sequence b appends to and attends to entry index[b] of a cache of 7 entries (block table
    rows when paged): the same caches, out and lse as a call on the entries gathered in order;
    the two unused entries stay as they were."""
    lens, seqlen_new = [0, 1, 300, 126, 381], 3
    q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache(lens, seqlen_q=seqlen_new, seed=9)
    index = torch.tensor([4, 0, 6, 2, 5], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(10)
    new_k, new_v = (torch.randn(5, seqlen_new, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))  # fmt: skip
    angles = torch.rand(384, 32, device="cuda", generator=gen) * 6.3
    rotary = {"rotary_cos": angles.cos().bfloat16(), "rotary_sin": angles.sin().bfloat16()}
    if paged:  # a table of 7 rows, sequence b's pages in row index[b]; k_cache, v_cache the pages
        wide = torch.zeros(7, table.shape[1], dtype=torch.int32, device="cuda")
        wide[index.long()] = table
        caches, gathered, extra = (k_pages, v_pages), (k_pages.clone(), v_pages.clone()), {"block_table": wide}
        extra_gathered = {"block_table": table}
    else:  # a dense cache of 7 entries, sequence b's keys in entry index[b]
        big = [torch.randn(7, *c.shape[1:], device="cuda", dtype=c.dtype, generator=gen) for c in (k_dense, v_dense)]
        for c, small in zip(big, (k_dense, v_dense)):
            c[index.long()] = small
        caches, gathered, extra, extra_gathered = big, (k_dense.clone(), v_dense.clone()), {}, {}
    before = [c.clone() for c in caches]
    out, lse = hattn.flash_attn_with_kvcache(
        q, *caches, new_k, new_v, cache_seqlens=seqlens, cache_batch_idx=index, causal=causal,
        return_softmax_lse=True, **rotary, **extra,
    )  # fmt: skip
    expect, expect_lse = hattn.flash_attn_with_kvcache(
        q, *gathered, new_k, new_v, cache_seqlens=seqlens, causal=causal, return_softmax_lse=True, **rotary,
        **extra_gathered,
    )  # fmt: skip
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    torch.testing.assert_close(lse, expect_lse, rtol=0, atol=0)
    if paged:  # the same pages, written the same way
        assert torch.equal(caches[0], gathered[0]) and torch.equal(caches[1], gathered[1])
    else:
        unused = [e for e in range(7) if e not in index.tolist()]
        for c, g, b in zip(caches, gathered, before):
            assert torch.equal(c[index.long()], g) and torch.equal(c[unused], b[unused])


@requires_hopper
@pytest.mark.parametrize("rotary", [None, "gpt_neox"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kvcache_cache_leftpad(causal, rotary):
    """Sequence b attends to keys pads[b] .. cache_seqlens[b] + seqlen_new - 1 of its dense cache
    (the rows before pads[b] are NaN), against the fp64 reference; the new rows land at
    cache_seqlens[b] and rotate at those absolute positions, as in FlashAttention."""
    lens, pads, seqlen_new = [0, 5, 300, 126, 381], [0, 5, 17, 126, 380], 2
    q, _, _, _, k_dense, v_dense, seqlens = gpu_kvcache(lens, seqlen_q=seqlen_new, seed=11)
    for b, pad in enumerate(pads):
        k_dense[b, :pad] = v_dense[b, :pad] = float("nan")
    gen = torch.Generator(device="cuda").manual_seed(12)
    new_k, new_v = (torch.randn(5, seqlen_new, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))  # fmt: skip
    extra = {}
    if rotary:
        angles = torch.rand(384, 64, device="cuda", dtype=torch.float64, generator=gen) * 6.3
        extra = {"rotary_cos": angles.cos().bfloat16(), "rotary_sin": angles.sin().bfloat16(),
                 "rotary_interleaved": False}  # fmt: skip
    before_k, before_v = k_dense.clone(), v_dense.clone()
    pad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    out, lse = hattn.flash_attn_with_kvcache(
        q, k_dense, v_dense, new_k, new_v, cache_seqlens=seqlens, cache_leftpad=pad, causal=causal,
        return_softmax_lse=True, **extra,
    )  # fmt: skip
    starts = torch.tensor(lens, device="cuda").unsqueeze(1)
    steps = torch.arange(seqlen_new, device="cuda")
    q_ref, k_new_ref = q, new_k
    if rotary:
        cos, sin = extra["rotary_cos"], extra["rotary_sin"]
        k_new_ref = rotated_by_reference(new_k, cos, sin, starts + steps, False)
        q_positions = starts + (steps if causal else 0 * steps)
        q_ref = rotated_by_reference(q, cos, sin, q_positions.expand(-1, seqlen_new), False)
    for b, (n, p) in enumerate(zip(lens, pads)):
        torch.testing.assert_close(k_dense[b, n : n + seqlen_new], k_new_ref[b], rtol=2**-7, atol=1e-6)
        assert torch.equal(v_dense[b, n : n + seqlen_new], new_v[b])
        keys = torch.cat((before_k[b, p:n], k_dense[b, n : n + seqlen_new]))
        values = torch.cat((before_v[b, p:n], new_v[b]))
        check_sequence(out[b], lse[b], q_ref[b], keys, values, causal, None, (-1, -1), f"b={b} pad {p} cache {n}")


# --- repeated calls of one layout ---------------------------------------------------------------------


def test_kvcache_checks_are_skipped_only_for_a_layout_that_passed_them():
    from hattn.flash_attn import _CHECKED

    q, dense, pages, table, new, rotary = cpu_append_args()
    q, dense, new = (t.to("meta") for t in (q, dense, new))
    rotary = {name: t.to("meta") for name, t in rotary.items()}
    _CHECKED.clear()
    short = {name: t[:299] for name, t in rotary.items()}  # fewer rows than the cache's 300 keys
    for _ in range(2):  # refused each time: a failed layout is not remembered
        with pytest.raises(ValueError, match=r"rotary_cos: seqlen_ro \(299, dim 0\)"):
            hattn.flash_attn_with_kvcache(q, dense, dense, new, new, cache_seqlens=10, **short)
    assert not _CHECKED
    for _ in range(2):
        out = hattn.flash_attn_with_kvcache(q, dense, dense, new, new, cache_seqlens=10, causal=True, **rotary)
        assert out.shape == q.shape
    assert len(_CHECKED) == 1
    # The same layout with values the checks read each call, and another layout.
    with pytest.raises(ValueError, match=r"cache_seqlens: must be >= 0, got -1"):
        hattn.flash_attn_with_kvcache(q, dense, dense, new, new, cache_seqlens=-1, causal=True, **rotary)
    with pytest.raises(ValueError, match=r"window_size"):
        hattn.flash_attn_with_kvcache(q, dense, dense, new, new, cache_seqlens=10, window_size=(1, 2, 3), **rotary)
    with pytest.raises(ValueError, match=r"k: must be 4-D"):
        hattn.flash_attn_with_kvcache(q, dense, dense, new[0], new[0], cache_seqlens=10, causal=True, **rotary)
    with pytest.raises(TypeError, match=r"k: must be a torch.Tensor, got list"):
        hattn.flash_attn_with_kvcache(q, dense, dense, [new], new, cache_seqlens=10, causal=True, **rotary)


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_append_repeated_layout_reads_the_new_tensors(paged):
    """The second decoding step of one layout skips the Python checks and launches the append
    and the attention from remembered arguments with the new tensors' pointers: the caches,
    out and lse equal those of a step with every check, bit for bit."""
    from hattn.flash_attn import _CHECKED
    from hattn.ops.runner import _LAUNCHES

    def inputs(seed):
        q, k_pages, v_pages, table, k_dense, v_dense, seqlens = gpu_kvcache([10, 200, 0], seqlen_q=1, seed=seed)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        new_k, new_v = (torch.randn(3, 1, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
        angles = torch.rand(384, 48, device="cuda", generator=gen)
        rotary = {"rotary_cos": angles.cos().bfloat16(), "rotary_sin": angles.sin().bfloat16()}
        if paged:
            return (q, k_pages, v_pages, new_k, new_v), {"cache_seqlens": seqlens, "block_table": table, **rotary}
        index = torch.tensor([2, 0, 1], dtype=torch.int32, device="cuda")
        return (q, k_dense, v_dense, new_k, new_v), {"cache_seqlens": seqlens, "cache_batch_idx": index, **rotary}

    def step(args, kwargs):
        return hattn.flash_attn_with_kvcache(*args, causal=True, return_softmax_lse=True, **kwargs)

    _LAUNCHES.clear()
    _CHECKED.clear()
    step(*inputs(1))
    remembered = (len(_CHECKED), len(_LAUNCHES))
    args, kwargs = inputs(2)
    fresh_args = tuple(t.clone() for t in args)
    again = step(args, kwargs)  # skips the checks; remembered launches with new pointers
    assert (len(_CHECKED), len(_LAUNCHES)) == remembered == (1, 2)
    _LAUNCHES.clear()
    _CHECKED.clear()
    fresh = step(fresh_args, kwargs)  # every check, new entries
    for got, want in zip(again, fresh):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(args[1:3], fresh_args[1:3]):  # the caches, appended to the same way
        assert torch.equal(got, want)


@requires_hopper
def test_softcap_reaches_hattn():
    """softcap in the drop-ins is hattn's softcap: the same results as the hattn calls (the
    capped results themselves are checked against the reference in test_gpu.py)."""
    q, k, v = make_qkv(2, 100, 300, 8, 2, 128, torch.bfloat16)
    out = hattn.flash_attn_func(q, k, v, causal=True, softcap=4.0)
    torch.testing.assert_close(out, hattn.attention(q, k, v, causal=True, softcap=4.0), rtol=0, atol=0)
    assert not torch.equal(out, hattn.attention(q, k, v, causal=True))
    q, k_pages, v_pages, table, _, _, seqlens = gpu_kvcache([0, 1, 300, 129, 512])
    out = hattn.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, softcap=2.0)
    expect = hattn.attention_paged(q, k_pages, v_pages, table, seqlens, softcap=2.0)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    args = gpu_varlen([300, 0, 129], [200, 50, 400])
    out = hattn.flash_attn_varlen_func(*args, causal=True, softcap=3.0)
    torch.testing.assert_close(out, hattn.attention_varlen(*args, causal=True, softcap=3.0), rtol=0, atol=0)


def test_packed_variants_unpack_and_check_their_layout():
    """The qkv- and kv-packed forms hand their slices to flash_attn_func / flash_attn_varlen_func
    (here as far as the GPU check of CPU tensors); a packed tensor of the wrong layout is named."""
    gpu = r"no suitable GPU|must be a CUDA tensor"
    qkv = torch.randn(2, 16, 3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_qkvpacked_func(qkv, causal=True)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:])
    packed = torch.randn(16, 3, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_varlen_qkvpacked_func(packed, cu, 10)
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.flash_attn_varlen_kvpacked_func(packed[:, 0], packed[:, 1:], cu, cu, 10, 10)
    with pytest.raises(ValueError, match=r"qkv: must be \[batch, seqlen, 3, heads, head_dim\]"):
        hattn.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv: must be \[total_k, 2, heads_kv, head_dim\]"):
        hattn.flash_attn_varlen_kvpacked_func(packed[:, 0], packed, cu, cu, 10, 10)


@requires_hopper
def test_packed_variants_match_the_unpacked_call():
    """Same output as flash_attn_func on the slices, and gradients back into the packed tensor."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(2, 100, 3, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    out = hattn.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.detach().unbind(2)
    assert torch.equal(out, hattn.flash_attn_func(q, k, v, causal=True))
    out.float().sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    kv = qkv.detach()[:, :, 1:]
    assert torch.equal(hattn.flash_attn_kvpacked_func(q, kv, causal=True), out.detach())
