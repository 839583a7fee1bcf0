"""Variable-length batches, packed along the rows: hattn::attention_varlen_fwd and
hattn.attention_varlen, differentiable through hattn::attention_varlen_bwd."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .checks import (
    _as_kernel_input, _check_deterministic, _check_device, _check_max_seqlen, _check_problem, _check_promises,
    _check_softcap, _check_types, _check_varlen_inputs, _needs_grad, _varlen_empty, _window,
)
from .runner import _backward_needed, _call, _forward


def _attention_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    kernel: str,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_varlen_fwd: (out [total_q, Hq, D], lse [Hq, total_q] fp32, or empty when not return_lse).
    deterministic is the backward's (hattn::attention_varlen_bwd)."""
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel)
    _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap, ("varlen",))
    _check_device(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_promises(varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), totals=(q.shape[0], k.shape[0]))
    q, k, v = (_as_kernel_input(t) for t in (q, k, v))
    # The kernel reads the offsets as plain int32 arrays.
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    total_q, heads_q, head_dim = q.shape
    out = torch.empty((total_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((heads_q, total_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if _varlen_empty(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        out.zero_()  # rows that see no key (or belong to no sequence): out 0, LSE -inf; no kernel
        lse.fill_(float("-inf"))
        return out, lse
    window, varlen = (window_left, window_right), (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _forward(q, k, v, out, lse if return_lse else None, causal, softmax_scale, kernel, window, varlen, softcap=softcap)
    return out, lse


attention_varlen_fwd = torch.library.custom_op("hattn::attention_varlen_fwd", mutates_args=())(_attention_varlen_fwd)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, kernel, return_lse,
    window_left=-1, window_right=-1, softcap=0.0, deterministic=False,
):  # fmt: skip
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel)
    _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap, ("varlen",))
    total_q, heads_q, head_dim = q.shape
    out = q.new_empty((total_q, heads_q, head_dim))
    lse = q.new_empty((heads_q, total_q) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _attention_varlen_fwd_setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, _kernel, return_lse,
     window_left, window_right, softcap, deterministic) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.causal, ctx.softmax_scale, ctx.window = causal, softmax_scale, (window_left, window_right)
    ctx.has_lse, ctx.softcap, ctx.deterministic = return_lse, softcap, deterministic
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros


def _attention_varlen_fwd_backward(ctx, dout, dlse):
    if not _backward_needed(ctx, dout, dlse, "attention_varlen"):
        return (None,) * 15
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.hattn.attention_varlen_bwd(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen, ctx.causal, ctx.softmax_scale,
        *ctx.window, ctx.softcap, ctx.deterministic,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 12


attention_varlen_fwd.register_autograd(
    _attention_varlen_fwd_backward, setup_context=_attention_varlen_fwd_setup_context
)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    kernel: str = "auto",
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    *,
    deterministic: bool = False,
):
    """Forward attention over a variable-length batch: sequences packed one after another along
    the rows, as FlashAttention's varlen functions take them (cu_seqlens).

    Args:
        q: [total_q, Hq, D] CUDA tensor, torch.bfloat16 or torch.float16; D in {64, 128, 256}.
        k, v: [total_k, Hkv, D], same dtype and device; Hq % Hkv == 0 (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: torch.int32 [batch + 1] on q's device, batch >= 0. Sequence
            b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, its keys the
            rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v. Non-decreasing from 0 to
            total_q (total_k); a sequence may be empty on either side (no keys: its rows give
            output 0 and LSE -inf).
        max_seqlen_q, max_seqlen_k: ints >= 0, the longest sequence's query and key lengths
            (FlashAttention's max_seqlen_q/k); the kernel plans its work by them. A batch with
            nothing to compute (batch 0, or either one 0) gives out 0 and LSE -inf (gradients 0)
            without a kernel.
        causal: bottom-right aligned within each sequence: its query i sees its key j iff
            j <= i + Sk_b - Sq_b. Rows that see no key give output 0 and LSE -inf.
        softmax_scale: default 1/sqrt(D).
        kernel: "auto" or a name from hattn.kernels(); only the production forward (what "auto"
            picks) has a variable-length batch, a lineage kernel raises NotImplementedError.
        return_lse: also return the row log-sum-exp (natural log), fp32 [Hq, total_q].
        window_size: (left, right), the sliding window of attention(), aligned like the causal
            mask to each sequence's own bottom-right corner; -1 leaves a side open.
        softcap: > 0 caps the scores at softcap * tanh(s / softcap), as in attention() (with a
            backward too).
        deterministic: a backward bitwise the same from run to run, as in attention().

    Returns:
        out [total_q, Hq, D] contiguous, in q's dtype; or (out, lse) when return_lse.

    Raises:
        TypeError / ValueError: malformed arguments (the message names the argument).
        NotImplementedError: the chosen kernel (or every kernel, for "auto") does not support the problem.
        RuntimeError: no suitable GPU (none, or not Hopper sm_90), or a CUDA error.

    The offsets' values are never read on the host (that would synchronize it with the GPU):
    as in FlashAttention they are the caller's promise, as is that no sequence is longer than
    max_seqlen_q/k. Offsets that break it give wrong results, but the kernel clamps them to
    the tensors' rows, so it touches no memory outside them. Runs on
    torch.cuda.current_stream(); works under torch.compile(fullgraph=True) and CUDA-graph
    capture. With autograd (q, k or v requiring grad) the backward computes dq, dk and dv per
    sequence (no gradient through the LSE output); the forward then keeps the LSE it needs.
    """
    _check_types(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    softcap = _check_softcap(softcap)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    left, right = _window(window_size)
    needs_grad = _needs_grad(q, k, v)
    if needs_grad:
        _check_deterministic(deterministic)
    out, lse = _call(
        attention_varlen_fwd, _attention_varlen_fwd,
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        bool(causal), softmax_scale, kernel, bool(return_lse) or needs_grad, left, right, softcap, bool(deterministic),
    )  # fmt: skip
    return (out, lse) if return_lse else out
