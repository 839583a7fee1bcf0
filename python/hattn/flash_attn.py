"""A drop-in for flash_attn.flash_attn_func (FlashAttention-2's Python entry point).

    from hattn import flash_attn_func     # in place of: from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)   # [B, S, H, D] in, [B, S, H, D] out

The signature and the [B, S, H, D] layout are FlashAttention-2's, and so are its
conventions: the causal mask is aligned to the bottom-right corner, GQA comes from fewer K/V
heads, window_size=(left, right) is a sliding window aligned the same way, and the default
scale is 1/sqrt(D). What hattn does not have (dropout, softcapping, ALiBi, the attention
probabilities, gradients) raises NotImplementedError naming the argument. Nothing falls back
to another library.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ops import _window, attention


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor:
    """flash_attn_func's arguments and result, run by hattn.attention.

    deterministic is accepted either way: hattn's forward always is. Everything else beyond
    q, k, v, softmax_scale, causal and window_size must keep its default. As in FlashAttention,
    causal sets the window's right side to 0.
    """
    unsupported = []
    if dropout_p != 0.0:
        unsupported.append(f"dropout_p={dropout_p} (no dropout)")
    if softcap != 0.0:
        unsupported.append(f"softcap={softcap} (no softcapping)")
    if alibi_slopes is not None:
        unsupported.append("alibi_slopes (no ALiBi)")
    if return_attn_probs:
        unsupported.append("return_attn_probs=True (use hattn.attention(..., return_lse=True) for the LSE)")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        unsupported.append("inputs that require grad (hattn is forward-only; use torch.no_grad())")
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_func does not support " + "; ".join(unsupported))
    left, right = _window(window_size)
    if causal:
        right = 0  # flash_attn: causal=True is window_size[1] = 0
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(left, right))
