"""The FP8 (e4m3) forward: hattn::attention_fp8_fwd and hattn.attention_fp8 (no backward)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .checks import (
    _FP8_OUT_DTYPE, _as_kernel_input, _check_device, _check_fp8_inputs, _check_problem, _check_promises, _check_types,
    _needs_grad,
)
from .runner import _bshd_outputs_like, _call, _forward


def _attention_fp8_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    kernel: str,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_fp8_fwd: (out [B, Sq, Hq, D] bf16, lse [B, Hq, Sq] fp32, or empty when not return_lse)."""
    descales = (q_descale, k_descale, v_descale)
    _check_fp8_inputs(q, k, v, descales, kernel)
    _check_problem(q, kernel, causal, softmax_scale, features=("fp8",))
    _check_device(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _check_promises(descales=tuple(zip(("q_descale", "k_descale", "v_descale"), descales)))
    q, k, v = (_as_kernel_input(t) for t in (q, k, v))
    # The kernel reads plain fp32 [batch, Hkv] arrays (an expand()ed scale is copied here).
    descales = tuple(None if t is None else t.contiguous() for t in descales)
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=_FP8_OUT_DTYPE, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    _forward(q, k, v, out, lse if return_lse else None, causal, softmax_scale, kernel, descales=descales)
    return out, lse


# No autograd formula: the C++ backward has no e4m3 (attention_fp8 refuses inputs that require grad).
attention_fp8_fwd = torch.library.custom_op("hattn::attention_fp8_fwd", mutates_args=())(_attention_fp8_fwd)


@attention_fp8_fwd.register_fake
def _attention_fp8_fwd_fake(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, kernel, return_lse):
    _check_fp8_inputs(q, k, v, (q_descale, k_descale, v_descale), kernel)
    _check_problem(q, kernel, causal, softmax_scale, features=("fp8",))
    return _bshd_outputs_like(q, return_lse, _FP8_OUT_DTYPE)


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    kernel: str = "auto",
):
    """Forward attention on FP8 (float8 e4m3) BSHD tensors, with FlashAttention-3's
    per-(batch, K/V head) dequantization scales; the output is bf16.

    Args:
        q: [B, Sq, Hq, D] CUDA tensor, torch.float8_e4m3fn; D in {64, 128, 256}.
        k, v: [B, Sk, Hkv, D], torch.float8_e4m3fn on q's device; Hq % Hkv == 0 (GQA/MQA).
        q_descale, k_descale, v_descale: None (scale 1) or torch.float32 [B, Hkv] on q's
            device (copied when not contiguous). Query head h of batch b computes with
            q[b, :, h] * q_descale[b, h // (Hq // Hkv)], and its K/V head g = h // (Hq // Hkv)
            with k[b, :, g] * k_descale[b, g] and v[b, :, g] * v_descale[b, g]: the result is
            attention of those dequantized values.
        causal: bottom-right aligned causal mask, as in attention(). Rows that see no key give
            output 0 and LSE -inf.
        softmax_scale: default 1/sqrt(D), applied to the dequantized scores.
        return_lse: also return the row log-sum-exp (natural log) of the dequantized, scaled
            scores, fp32 [B, Hq, Sq].
        kernel: "auto" or a name from hattn.kernels(); only the production forward (what "auto" picks)
            has FP8 inputs, a lineage kernel raises NotImplementedError.

    Returns:
        out [B, Sq, Hq, D] contiguous torch.bfloat16; or (out, lse) when return_lse.

    Raises:
        TypeError / ValueError: malformed arguments (the message names the argument).
        NotImplementedError: what the FP8 path does not run (a lineage kernel; seqlen_k above
            2^30), or inputs that require grad: there is no FP8 backward, so rather than give
            no gradient this refuses them (call it under torch.no_grad() or on detached tensors).
        RuntimeError: no suitable GPU (none, or not Hopper sm_90), or a CUDA error.

    The softmax weights P enter the PV product in e4m3, as in FlashAttention-3, so the output
    carries e4m3 P's rounding (3 mantissa bits: up to 1/16 relative error a weight), more than
    a bf16 forward's.
    Each call first copies V transposed into a workspace about V's size (Sk rounded up to 128)
    taken from torch's caching allocator. Dense batches only: no sliding window, seqlens_k,
    variable-length or paged batches. Inputs are read in place when their layout allows (the
    module docstring's rule, with strides in multiples of 16 elements); otherwise copied. Runs
    on torch.cuda.current_stream() without host synchronization; registered as
    torch.ops.hattn.attention_fp8_fwd, it works under torch.compile(fullgraph=True) and
    CUDA-graph capture.
    """
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    _check_types(q, k, v, **{name: t for name, t in descales.items() if t is not None})
    if _needs_grad(q, k, v, *descales.values()):
        raise NotImplementedError(
            "hattn.attention_fp8: forward only (no FP8 backward), but an input requires grad; call it under "
            "torch.no_grad() or pass detached tensors"
        )
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    out, lse = _call(
        attention_fp8_fwd, _attention_fp8_fwd,
        q, k, v, q_descale, k_descale, v_descale, bool(causal), softmax_scale, kernel, bool(return_lse),
    )  # fmt: skip
    return (out, lse) if return_lse else out
