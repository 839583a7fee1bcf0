"""hattn.flash_attn_func and hattn.flash_attn_varlen_func, the drop-ins for FlashAttention-2's
flash_attn_func and flash_attn_varlen_func: what they refuse (CPU), and that they are
hattn.attention and hattn.attention_varlen under FlashAttention's argument order (GPU)."""

import hattn
import pytest
import torch
from helpers import make_qkv, requires_hopper


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
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.zeros(2)}, "alibi_slopes"),
        ({"return_attn_probs": True}, "return_attn_probs"),
    ],
)
def test_unsupported_arguments_are_named(kwargs, words):
    with pytest.raises(NotImplementedError, match=words):
        hattn.flash_attn_func(*cpu_qkv(), **kwargs)


def test_inputs_that_need_grad_are_refused():
    q, k, v = cpu_qkv()
    with pytest.raises(NotImplementedError, match="forward-only"):
        hattn.flash_attn_func(q.requires_grad_(), k, v)


def test_positional_order_is_flash_attn_s():
    # dropout_p comes fourth, as in flash_attn_func: a positional 0.5 there is a dropout, not a scale.
    with pytest.raises(NotImplementedError, match="dropout_p=0.5"):
        hattn.flash_attn_func(*cpu_qkv(), 0.5)


def test_supported_call_reaches_the_op():
    # With the defaults the call goes on to hattn.attention, which wants CUDA tensors: without a
    # GPU it says none is present (RuntimeError), with one that q is not on it (ValueError).
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(*cpu_qkv(), deterministic=True)


def test_window_size_reaches_the_op():
    # A window is supported: the call gets as far as the device check, like a plain one.
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.flash_attn_func(*cpu_qkv(), window_size=(128, 0))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dropout_p": 0.1}, "dropout_p"),
        ({"softcap": 30.0}, "softcap"),
        ({"alibi_slopes": torch.zeros(2)}, "alibi_slopes"),
        ({"return_attn_probs": True}, r"return_attn_probs=True \(use hattn.attention_varlen"),
        ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, r"block_table \(no paged KV\)"),
    ],
)
def test_varlen_unsupported_arguments_are_named(kwargs, words):
    with pytest.raises(NotImplementedError, match=r"hattn.flash_attn_varlen_func does not support .*" + words):
        hattn.flash_attn_varlen_func(*cpu_varlen(), **kwargs)


def test_varlen_inputs_that_need_grad_are_refused():
    q, *rest = cpu_varlen()
    with pytest.raises(NotImplementedError, match="forward-only"):
        hattn.flash_attn_varlen_func(q.requires_grad_(), *rest)


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


def gpu_varlen(lens_q, lens_k, heads_q=8, heads_kv=2, head_dim=128):
    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    q = torch.randn(sum(lens_q), heads_q, head_dim, device="cuda", dtype=torch.bfloat16) + 0.5
    k = torch.randn(sum(lens_k), heads_kv, head_dim, device="cuda", dtype=torch.bfloat16) + 0.5
    return q, k, torch.randn_like(k) + 0.5, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


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
