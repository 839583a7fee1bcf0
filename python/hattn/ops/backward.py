"""The backward ops behind the forwards' autograd: hattn::attention_bwd (dense batches) and
hattn::attention_varlen_bwd (variable-length ones), over hattn._C.backward."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .checks import _check_device, _check_inputs, _check_problem, _check_varlen_inputs, _varlen_empty
from .runner import _backward


@torch.library.custom_op("hattn::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hattn::attention_bwd: (dq, dk, dv) of hattn::attention_fwd's q, k, v given dL/d out, from the
    forward's out and lse (dense batches; dk and dv sum over a K/V head's query heads);
    deterministic: bitwise the same from run to run."""
    _check_inputs(q, k, v, "auto")
    _check_problem(q, "auto", causal, softmax_scale, (window_left, window_right), softcap)
    _check_device(q, k, v, out=out, lse=lse, dout=dout)
    if q.numel() == 0 or k.numel() == 0:  # empty tensors (see attention_fwd): every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _backward(dout, q, k, v, out, lse, causal, softmax_scale, (window_left, window_right), softcap=softcap,
                     deterministic=deterministic)  # fmt: skip


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                        deterministic=False):  # fmt: skip
    _check_inputs(q, k, v, "auto")
    _check_problem(q, "auto", causal, softmax_scale, (window_left, window_right), softcap)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("hattn::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hattn::attention_varlen_bwd: (dq [total_q, Hq, D], dk, dv [total_k, Hkv, D]) of
    hattn::attention_varlen_fwd's q, k, v given dL/d out, from the forward's out and lse [Hq, total_q]
    (dk and dv sum over a K/V head's query heads; rows in no sequence get 0)."""
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "auto")
    _check_problem(q, "auto", causal, softmax_scale, (window_left, window_right), softcap, ("varlen",))
    _check_device(q, k, v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if _varlen_empty(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):  # see attention_varlen_fwd: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # The kernel reads the offsets as plain int32 arrays.
    varlen = (cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k)
    return _backward(dout, q, k, v, out, lse, causal, softmax_scale, (window_left, window_right), varlen, softcap,
                     deterministic)  # fmt: skip


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    window_left=-1, window_right=-1, softcap=0.0, deterministic=False,
):  # fmt: skip
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "auto")
    _check_problem(q, "auto", causal, softmax_scale, (window_left, window_right), softcap, ("varlen",))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
