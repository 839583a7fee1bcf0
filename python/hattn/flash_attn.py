"""Drop-ins for flash_attn.flash_attn_func and flash_attn.flash_attn_varlen_func
(FlashAttention-2's Python entry points).

    from hattn import flash_attn_func, flash_attn_varlen_func   # in place of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)   # [B, S, H, D] in, [B, S, H, D] out
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                          # [total_q, H, D] in and out, sequences packed by rows

The signatures and layouts are FlashAttention-2's, and so are its conventions: the causal
mask is aligned to the bottom-right corner (of each sequence, for varlen), GQA comes from
fewer K/V heads, window_size=(left, right) is a sliding window aligned the same way, and the
default scale is 1/sqrt(D). What hattn does not have (dropout, softcapping, ALiBi, the
attention probabilities, gradients, paged KV) raises NotImplementedError naming the argument.
Nothing falls back to another library.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .ops import _window, attention, attention_varlen


def _unsupported(q, k, v, dropout_p, softcap, alibi_slopes, return_attn_probs, lse_from: str) -> List[str]:
    """What a call asks for that hattn lacks, one entry per argument; lse_from: the hattn function that has the LSE."""
    unsupported = []
    if dropout_p != 0.0:
        unsupported.append(f"dropout_p={dropout_p} (no dropout)")
    if softcap != 0.0:
        unsupported.append(f"softcap={softcap} (no softcapping)")
    if alibi_slopes is not None:
        unsupported.append("alibi_slopes (no ALiBi)")
    if return_attn_probs:
        unsupported.append(f"return_attn_probs=True (use hattn.{lse_from}(..., return_lse=True) for the LSE)")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)):
        unsupported.append("inputs that require grad (hattn is forward-only; use torch.no_grad())")
    return unsupported


def _flash_window(window_size, causal) -> Tuple[int, int]:
    left, right = _window(window_size)
    if causal:
        right = 0  # flash_attn: causal=True is window_size[1] = 0
    return left, right


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
    unsupported = _unsupported(q, k, v, dropout_p, softcap, alibi_slopes, return_attn_probs, "attention")
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_func does not support " + "; ".join(unsupported))
    window = _flash_window(window_size, causal)
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash_attn_varlen_func's arguments and result, run by hattn.attention_varlen.

    q [total_q, Hq, D], k and v [total_k, Hkv, D], cu_seqlens_q/k int32 [batch + 1] on q's
    device, max_seqlen_q/k the longest lengths; returns out [total_q, Hq, D]. The offsets are
    not read on the host: they are the caller's promise, as in FlashAttention. deterministic
    is accepted either way; everything else beyond those and softmax_scale, causal and
    window_size must keep its default. As in FlashAttention, causal sets the window's right
    side to 0.
    """
    unsupported = _unsupported(q, k, v, dropout_p, softcap, alibi_slopes, return_attn_probs, "attention_varlen")
    if block_table is not None:
        unsupported.append("block_table (no paged KV)")
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_varlen_func does not support " + "; ".join(unsupported))
    window = _flash_window(window_size, causal)
    return attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window,
    )  # fmt: skip
