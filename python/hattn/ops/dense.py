"""Dense batches: hattn::attention_fwd and hattn.attention (with KV-cache lengths, cache
entries, left padding, windows and softcap), differentiable through hattn::attention_bwd."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .checks import (
    _cache_descale_features, _cache_features, _check_attention_inputs, _check_deterministic, _check_num_splits,
    _check_problem, _check_promises, _check_softcap, _check_types, _is_fp8_cache, _needs_grad, _window,
)
from .runner import _backward_needed, _bshd_outputs_like, _call, _launch_key, _launch_layout, _layout_checked


def _attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    kernel: str,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    seqlens_k: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_fwd: (out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32, or empty when not return_lse).
    deterministic is the backward's (hattn::attention_bwd); the forward is deterministic anyway.
    k_descale, v_descale: an FP8 KV cache's (e4m3 k and v)."""
    key = _launch_key(
        ("fwd", causal, softmax_scale, kernel, return_lse, window_left, window_right, num_splits, softcap),
        q, k, v, seqlens_k, kv_batch_idx, leftpad_k, k_descale, v_descale,
    )  # fmt: skip
    indices = {"seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx, "leftpad_k": leftpad_k}
    descales = {"k_descale": k_descale, "v_descale": v_descale}

    def check():
        _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx, leftpad_k, k_descale, v_descale)
        _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                       _cache_features(seqlens_k, kv_batch_idx, leftpad_k) + _cache_descale_features(q, k))  # fmt: skip

    remembered, key, q, k, v, indices = _layout_checked(key, check, q, k, v, {**indices, **descales})
    _check_promises(capacity=k.shape[1], kv_batch=k.shape[0], descales=tuple(descales.items()),
                    **{name: indices[name] for name in ("seqlens_k", "kv_batch_idx", "leftpad_k")})  # fmt: skip
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k.shape[1] == 0:
        # Empty tensors, as torch's SDPA treats them: no batch or no queries give empty outputs;
        # no keys give out 0 and LSE -inf (no kernel runs).
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    _launch_layout(remembered, key, q, k, v, out, lse if return_lse else None, causal, softmax_scale, kernel,
                   (window_left, window_right), indices, num_splits=num_splits, softcap=softcap)  # fmt: skip
    return out, lse


attention_fwd = torch.library.custom_op("hattn::attention_fwd", mutates_args=())(_attention_fwd)

@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, causal, softmax_scale, kernel, return_lse, window_left=-1, window_right=-1, seqlens_k=None, num_splits=0,
    kv_batch_idx=None, leftpad_k=None, softcap=0.0, deterministic=False, k_descale=None, v_descale=None,
):  # fmt: skip
    _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx, leftpad_k, k_descale, v_descale)
    _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                   _cache_features(seqlens_k, kv_batch_idx, leftpad_k) + _cache_descale_features(q, k))  # fmt: skip
    return _bshd_outputs_like(q, return_lse)


def _attention_fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale, _kernel, return_lse, window_left, window_right, *cache = inputs
    seqlens_k, _splits, kv_batch_idx, leftpad_k, softcap, deterministic, *_descales = cache
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.window = causal, softmax_scale, (window_left, window_right)
    ctx.has_lse = return_lse
    ctx.has_cache = any(t is not None for t in (seqlens_k, kv_batch_idx, leftpad_k))
    ctx.softcap, ctx.deterministic = softcap, deterministic
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros


def _attention_fwd_backward(ctx, dout, dlse):
    if not _backward_needed(ctx, dout, dlse, "attention"):
        return (None,) * 17
    if ctx.has_cache:
        raise NotImplementedError("hattn: no backward with seqlens_k, kv_batch_idx or leftpad_k (a KV cache) yet")
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.hattn.attention_bwd(
        dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, *ctx.window, ctx.softcap, ctx.deterministic
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 14


attention_fwd.register_autograd(_attention_fwd_backward, setup_context=_attention_fwd_setup_context)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    kernel: str = "auto",
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    *,
    seqlens_k: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    kv_batch_idx: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Forward attention O = softmax(scale * Q K^T + mask) V on BSHD tensors.

    Args:
        q: [B, Sq, Hq, D] CUDA tensor, torch.bfloat16 or torch.float16; D in {64, 128, 256}.
            (FP8 inputs with their descales go to attention_fp8; this refuses them.)
        k, v: [B, Sk, Hkv, D], same dtype and device; Hq % Hkv == 0 (GQA/MQA). Or an FP8 KV
            cache: k and v torch.float8_e4m3fn beside bf16/fp16 q, with k_descale and v_descale
            (below); forward only, no sliding window, production forward only.
        causal: bottom-right aligned causal mask: query i sees key j iff j <= i + Sk - Sq.
            Rows that see no key give output 0 and LSE -inf.
        softmax_scale: default 1/sqrt(D).
        kernel: "auto" (the newest kernel that supports the problem) or a name from hattn.kernels().
        return_lse: also return the row log-sum-exp (natural log), fp32 [B, Hq, Sq].
        window_size: (left, right), FlashAttention's sliding window (local attention), aligned
            like the causal mask: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right;
            -1 leaves a side open. With causal, right must be -1 or 0. Only the production forward
            (what "auto" picks) has it; a lineage kernel raises NotImplementedError.
        seqlens_k: None (every key), or torch.int32 [B] on q's device: sequence b attends to its
            first seqlens_k[b] keys only (clamped to [0, Sk]; FlashAttention's cache_seqlens /
            seqused_k, e.g. a KV cache of capacity Sk), and the causal mask and window align to
            that length (Sk above becomes seqlens_k[b]). A sequence with no keys gives output 0
            and LSE -inf. The keys past seqlens_k[b] may hold anything (NaN included): the
            kernel zeroes their V rows in shared memory before they meet their zero weights.
            Only the production forward has it; a lineage kernel raises NotImplementedError.
        num_splits: split-KV (flash-decoding) parts per query block: 0 lets the production forward
            decide (it may also cut the items of its last round, the tail split), 1 turns both
            off, n <= 64 asks for n. A performance hint: the result is the same up to rounding,
            and the lineage kernels ignore it.
        kv_batch_idx: None, or torch.int32 [B] on q's device (FlashAttention's cache_batch_idx):
            sequence b reads batch entry kv_batch_idx[b] of k and v, which are then a cache of
            any number of entries [B_cache, Sk, Hkv, D] (indices clamped to [0, B_cache)).
            Final kernel only.
        leftpad_k: None, or torch.int32 [B] on q's device (FlashAttention's cache_leftpad):
            sequence b's keys start at key leftpad_k[b]: it attends to keys leftpad_k[b] ..
            seqlens_k[b] - 1 (.. Sk - 1 without seqlens_k), and the masks align as for a
            sequence of that many keys. The keys before it may hold anything (NaN included).
            Clamped to [0, the sequence's keys]. Final kernel only.
        softcap: > 0 caps the scores (FlashAttention's softcap, as in Gemma 2): each score
            s = scale * q.k becomes softcap * tanh(s / softcap) before the mask and softmax; the
            LSE is that of the capped scores. 0 (the default) leaves them as they are. Final
            kernel only; the backward has it too.
        deterministic: a backward whose dq, dk and dv are bitwise the same from run to run (its
            fp32 sums add in a fixed order, at some cost in speed). At D = 256 only without GQA
            (Hq == Hkv); with GQA there it raises NotImplementedError. The forward is
            deterministic either way.
        k_descale, v_descale: an FP8 KV cache's dequantization scales, None (1) or
            torch.float32 [B, Hkv] on q's device: K/V head g of sequence b computes with
            k[b, :, g] * k_descale[b, g] and v[b, :, g] * v_descale[b, g] (FlashAttention-3's
            descales). The kernel widens the codes to q's dtype in shared memory, exactly, so a
            decoding step reads the cache at 1 byte an element.

    Returns:
        out [B, Sq, Hq, D] contiguous, in q's dtype; or (out, lse) when return_lse.

    Raises:
        TypeError / ValueError: malformed arguments (the message names the argument).
        NotImplementedError: the chosen kernel (or every kernel, for "auto") does not support the problem.
        RuntimeError: no suitable GPU (none, or not Hopper sm_90), or a CUDA error.

    Runs on torch.cuda.current_stream() without host synchronization (seqlens_k, kv_batch_idx
    and leftpad_k are read by the kernel only); works under torch.compile(fullgraph=True) and
    CUDA-graph capture. With autograd (q, k or v requiring grad) the backward computes dq, dk
    and dv (no seqlens_k, kv_batch_idx or leftpad_k; no gradient through the LSE output); the
    forward then keeps the LSE it needs.
    """
    indices = {"seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx, "leftpad_k": leftpad_k,
               "k_descale": k_descale, "v_descale": v_descale}  # fmt: skip
    _check_types(q, k, v, **{name: t for name, t in indices.items() if t is not None})
    _check_num_splits(num_splits)
    softcap = _check_softcap(softcap)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    left, right = _window(window_size)
    needs_grad = _needs_grad(q, k, v)
    if needs_grad and _is_fp8_cache(q, k):
        raise NotImplementedError(
            "hattn.attention: an e4m3 KV cache is forward only, but an input requires grad; call it under "
            "torch.no_grad() or pass detached tensors"
        )
    if needs_grad:
        _check_deterministic(deterministic)
    out, lse = _call(
        attention_fwd, _attention_fwd,
        q, k, v, bool(causal), softmax_scale, kernel, bool(return_lse) or needs_grad, left, right, seqlens_k,
        num_splits, kv_batch_idx, leftpad_k, softcap, bool(deterministic), k_descale, v_descale,
    )  # fmt: skip
    return (out, lse) if return_lse else out
