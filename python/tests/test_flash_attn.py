"""hattn.flash_attn_func, the drop-in for FlashAttention-2's flash_attn_func: what it refuses
(CPU), and that it is hattn.attention under FlashAttention's argument order (GPU)."""

import hattn
import pytest
import torch
from helpers import make_qkv, requires_hopper


def cpu_qkv():
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    return q, q.clone(), q.clone()


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
