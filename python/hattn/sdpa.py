"""A drop-in for torch.nn.functional.scaled_dot_product_attention.

hattn.scaled_dot_product_attention takes SDPA's arguments and its [B, H, L, E] tensors. It
runs a hattn kernel where one applies and torch's own SDPA everywhere else, so it can stand in
for the torch function wholesale:

    with hattn.patch_sdpa():          # torch.nn.functional.scaled_dot_product_attention is hattn's
        video = pipeline(prompt)      # e.g. a diffusers model, which calls F.scaled_dot_product_attention

hattn runs a call when all of these hold (sdpa_fallback_reason says which one fails):
  * query, key and value are 4-D [B, H, L, E] CUDA tensors on a Hopper GPU (sm_90), all
    bf16 or all fp16, with no dimension of size 0;
  * E is 64, 128 or 256, the same for query, key and value;
  * attn_mask is None and dropout_p is 0;
  * is_causal is False, or L == S. SDPA's causal mask is aligned to the top-left corner,
    hattn's to the bottom-right; they agree only when L == S;
  * the heads match, or enable_gqa is True and query's heads are a multiple of key's;
  * torch.use_deterministic_algorithms is off, or no input requires grad (with grad mode on).

A call hattn runs is differentiable: when query, key or value requires grad, backward gives
their gradients through hattn's backward (hattn.attention's). Its fp32 sums use atomic adds,
so the gradients may differ in their last bits from run to run; hence the last rule.

The output is a [B, H, L, E] view of a [B, L, H, E] tensor, as torch's own flash and cuDNN
backends return it, so `out.transpose(1, 2).reshape(B, L, H * E)` needs no copy.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from .ops import _DTYPE_NAMES, _needs_grad, attention

# torch's function, taken before anything can patch it: the fallback, and what patch_sdpa restores.
_torch_sdpa = F.scaled_dot_product_attention

_HEAD_DIMS = (64, 128, 256)


# Cached, and a constant to torch.compile (evaluated while tracing, not traced into the graph).
@torch.compiler.assume_constant_result
@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _on_hopper(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    return _is_hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())


def sdpa_fallback_reason(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
    check_device: bool = True,
) -> Optional[str]:
    """Why scaled_dot_product_attention would hand this call to torch's SDPA; None if hattn runs it.

    check_device=False skips the device rule (the tensors' device and the GPU's architecture).
    """
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D; hattn takes 4-D [B, H, L, E]"
    if check_device and not all(_on_hopper(t) for t in tensors.values()):
        return "the inputs are not all CUDA tensors on a Hopper GPU (sm_90)"
    if query.dtype not in _DTYPE_NAMES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}; hattn takes all bf16 or all fp16"
    if any(size == 0 for t in tensors.values() for size in t.shape):
        return "an input has a dimension of size 0"
    head_dim = query.shape[-1]
    if head_dim not in _HEAD_DIMS or key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        return f"head dims {head_dim}, {key.shape[-1]}, {value.shape[-1]}; hattn takes one of {_HEAD_DIMS}"
    if attn_mask is not None:
        return "attn_mask is given; hattn has only the causal mask"
    if dropout_p != 0.0:
        return f"dropout_p is {dropout_p}; hattn has no dropout"
    batch, heads_q, seqlen_q, _ = query.shape
    if key.shape[0] != batch or value.shape[0] != batch or key.shape[1] != value.shape[1]:
        return "batch or K/V head counts differ between the inputs"
    if key.shape[2] != value.shape[2]:
        return "key and value have different sequence lengths"
    heads_kv, seqlen_k = key.shape[1], key.shape[2]
    if heads_kv != heads_q and not (enable_gqa and heads_q % heads_kv == 0):
        return f"{heads_q} query heads and {heads_kv} key/value heads without enable_gqa=True"
    if is_causal and seqlen_q != seqlen_k:
        return (f"is_causal with L = {seqlen_q} != S = {seqlen_k}: SDPA's mask is top-left aligned, "
                "hattn's bottom-right")
    if _needs_grad(*tensors.values()) and torch.are_deterministic_algorithms_enabled():
        return "an input requires grad under torch.use_deterministic_algorithms; hattn's backward uses atomic adds"
    return None


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, run by hattn where it applies.

    Same arguments and result as torch's function, gradients included; see the module
    docstring for when hattn runs the call. Every other call goes to torch's SDPA unchanged,
    errors and autograd included.
    """
    if sdpa_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) is not None:
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    # [B, H, L, E] -> [B, L, H, E] views: the kernels take strided BSHD without a copy.
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=is_causal,
                    softmax_scale=scale)
    return out.transpose(1, 2)


@contextlib.contextmanager
def patch_sdpa() -> Iterator[None]:
    """Within the block, torch.nn.functional.scaled_dot_product_attention is hattn's.

    Code that looks the function up on torch.nn.functional when it calls (F.scaled_dot_product_attention,
    as diffusers and most models do) gets hattn's; a reference taken before the block (from
    torch.nn.functional import scaled_dot_product_attention) keeps torch's. The previous
    function comes back when the block ends, also on an exception.
    """
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
