"""Drop-ins for flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func and
flash_attn.flash_attn_with_kvcache (FlashAttention-2's Python entry points).

    from hattn import flash_attn_func, flash_attn_varlen_func   # in place of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)   # [B, S, H, D] in, [B, S, H, D] out
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                          # [total_q, H, D] in and out, sequences packed by rows
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
                                          # decoding against a dense or paged KV cache

The signatures and layouts are FlashAttention-2's, and so are its conventions: the causal
mask is aligned to the bottom-right corner (of each sequence, for varlen), GQA comes from
fewer K/V heads, window_size=(left, right) is a sliding window aligned the same way, and the
default scale is 1/sqrt(D). flash_attn_func and flash_attn_varlen_func are differentiable
(hattn.attention's and hattn.attention_varlen's backward: dq, dk and dv); the KV-cache function
is forward only, and appends new keys and values to the cache (with rotary embedding) as
FlashAttention does; softcap works in all three (with gradients in the first two). What
hattn does not have (dropout, ALiBi, the attention
probabilities, gradients through the KV-cache function, paged KV with varlen, left padding of a
paged cache) raises NotImplementedError naming the argument. deterministic=True gives a
backward bitwise the same from run to run (hattn.attention's deterministic).
Nothing falls back to another library.

flash_attn_func also takes FlashAttention-3's FP8 call: float8_e4m3fn q, k, v with the keywords
q_descale, k_descale, v_descale run hattn.attention_fp8 (bf16 out, forward only).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .ops import append_kv, attention, attention_fp8, attention_paged, attention_varlen
from .ops.checks import (
    _FP8_DTYPE, _PAGED_NAMES, _check_block_table, _check_cache_descales, _check_device, _check_inputs, _check_seqlens_k,
    _is_fp8_cache, _needs_grad, _window,
)  # fmt: skip
from .ops.kvcache import _append_kv
from .ops.runner import _call, _launch_key


def _unsupported(dropout_p, alibi_slopes) -> List[str]:
    """What a call asks for that hattn lacks, one entry per argument."""
    unsupported = []
    if dropout_p != 0.0:
        unsupported.append(f"dropout_p={dropout_p} (no dropout)")
    if alibi_slopes is not None:
        unsupported.append("alibi_slopes (no ALiBi)")
    return unsupported


def _flash_window(window_size, causal) -> Tuple[int, int]:
    left, right = _window(window_size)
    if causal:
        right = 0  # flash_attn: causal=True is window_size[1] = 0
    return left, right


def _fp8_unsupported(window_size, causal, softcap) -> List[str]:
    """What an FP8 call asks for that hattn.attention_fp8 lacks: a window other than the causal
    mask's (-1, 0), softcapping."""
    unsupported = []
    left, right = _flash_window(window_size, causal)
    if left != -1 or right not in (-1, 0):
        unsupported.append(f"window_size={tuple(window_size)} with FP8 inputs (hattn.attention_fp8 has no window)")
    if softcap != 0.0:
        unsupported.append(f"softcap={softcap} with FP8 inputs (hattn.attention_fp8 has no softcapping)")
    return unsupported


def _check_no_descales(q, q_descale, k_descale, v_descale) -> None:
    """FP8's dequantization scales with bf16/fp16 inputs: a ValueError naming the first."""
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None and isinstance(q, torch.Tensor):
            raise ValueError(f"{name}: only with torch.float8_e4m3fn q, k and v, got q of dtype {q.dtype}")


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
    *,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash_attn_func's arguments and result, run by hattn.attention.

    Differentiable like hattn.attention: with q, k or v requiring grad, backward gives dq, dk
    and dv; deterministic=True makes them bitwise the same from run to run. softcap (> 0:
    scores capped at softcap * tanh(s / softcap)) runs with gradients at every head dim.
    Everything else beyond q, k, v, softmax_scale, causal and window_size must keep its
    default. As in FlashAttention, causal sets the window's right side to 0.

    FP8, as FlashAttention-3's flash_attn_func takes it: with torch.float8_e4m3fn q, k and v
    (D = 128), the keyword-only q_descale, k_descale, v_descale (None or fp32 [B, Hkv]) go with
    them to hattn.attention_fp8, which returns bf16 out and has no backward (inputs that require
    grad are refused).

    return_attn_probs=True returns FlashAttention-2's (out, softmax_lse, S_dmask): the LSE
    (fp32 [B, Hq, Sq], no gradient through it) and None for S_dmask, which exists only with
    dropout. No sliding window then: window_size must be (-1, -1), or (-1, 0), which
    is the causal mask. Descales with bf16/fp16 inputs raise ValueError.
    """
    unsupported = _unsupported(dropout_p, alibi_slopes)
    fp8 = isinstance(q, torch.Tensor) and q.dtype == _FP8_DTYPE
    window = _flash_window(window_size, causal)
    if fp8:
        unsupported += _fp8_unsupported(window_size, causal, softcap)
    if fp8 and return_attn_probs:
        unsupported.append("return_attn_probs=True with FP8 inputs (hattn.attention_fp8 returns out only)")
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_func does not support " + "; ".join(unsupported))
    if fp8:
        # (-1, 0) is the causal mask, whether causal says so or not.
        return attention_fp8(
            q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=window[1] == 0,
            softmax_scale=softmax_scale,
        )  # fmt: skip
    _check_no_descales(q, q_descale, k_descale, v_descale)
    if return_attn_probs:  # FlashAttention-2's (out, softmax_lse, S_dmask); no dropout, so no S_dmask
        out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window,
                             softcap=softcap, return_lse=True, deterministic=bool(deterministic))  # fmt: skip
        return out, lse, None
    return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=softcap,
                     deterministic=bool(deterministic))  # fmt: skip


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
    not read on the host: they are the caller's promise, as in FlashAttention. Differentiable
    like hattn.attention_varlen: with q, k or v requiring grad, backward gives dq, dk and dv,
    bitwise the same from run to run with deterministic=True. softcap runs as in flash_attn_func. Everything else
    beyond those and softmax_scale, causal and window_size must keep its default. As in
    FlashAttention, causal sets the window's right side to 0.
    """
    unsupported = _unsupported(dropout_p, alibi_slopes)
    if block_table is not None:
        unsupported.append("block_table (no paged KV with a variable-length batch; flash_attn_with_kvcache has it)")
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_varlen_func does not support " + "; ".join(unsupported))
    window = _flash_window(window_size, causal)
    result = attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=softcap,
        return_lse=return_attn_probs, deterministic=bool(deterministic),
    )  # fmt: skip
    if return_attn_probs:  # FlashAttention-2's (out, softmax_lse [Hq, total_q], S_dmask); no S_dmask
        out, lse = result
        return out, lse, None
    return result


def _unpack(packed: torch.Tensor, dim: int, parts: int, name: str, layout: str):
    """The views of a packed tensor's `parts` slices along `dim` (no copy: the ops read such
    strided slices in place)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() <= dim or packed.shape[dim] != parts:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"{name}: must be {layout}, got {shape}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_qkvpacked_func's arguments and result: qkv [B, S, 3, H, D], run as
    flash_attn_func on its q, k and v slices (gradients flow back into qkv)."""
    q, k, v = _unpack(qkv, 2, 3, "qkv", "[batch, seqlen, 3, heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_kvpacked_func's arguments and result: q [B, Sq, Hq, D], kv [B, Sk, 2, Hkv, D],
    run as flash_attn_func."""
    k, v = _unpack(kv, 2, 2, "kv", "[batch, seqlen_k, 2, heads_kv, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_qkvpacked_func's arguments and result: qkv [total, 3, H, D] with one
    cu_seqlens and max_seqlen for queries and keys, run as flash_attn_varlen_func."""
    q, k, v = _unpack(qkv, 1, 3, "qkv", "[total, 3, heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_kvpacked_func's arguments and result: q [total_q, Hq, D], kv
    [total_k, 2, Hkv, D], run as flash_attn_varlen_func."""
    k, v = _unpack(kv, 1, 2, "kv", "[total_k, 2, heads_kv, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def _cache_seqlens(cache_seqlens, q: torch.Tensor) -> Optional[torch.Tensor]:
    """cache_seqlens (None, an int, or int32 [B]) as hattn's seqlens_k: None or int32 [B] on q's device."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, torch.Tensor):
        _check_seqlens_k(cache_seqlens, q.shape[0], "cache_seqlens")
        return cache_seqlens
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(
            f"cache_seqlens: must be an int or a torch.int32 tensor [batch], got {type(cache_seqlens).__name__}"
        )
    if cache_seqlens < 0:
        raise ValueError(f"cache_seqlens: must be >= 0, got {cache_seqlens}")
    # Every sequence has that many keys; filled on the GPU, no host synchronization.
    return torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)


# --- appending to a KV cache and rotary embedding (flash_attn_with_kvcache's k, v, rotary_*) ---------


def _check_new_kv(k, v, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """k and v (the rows to append): both or neither, [B, seqlen_new, Hkv, D] like the cache's rows."""
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both (the new keys and values to append) or neither")
    fp8_cache = _is_fp8_cache(q, k_cache)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
        expect = (q.shape[0], t.shape[1] if t.dim() == 4 else -1, k_cache.shape[2], k_cache.shape[3])
        if t.dim() != 4 or t.shape != expect:
            raise ValueError(
                f"{name}: must be 4-D [batch, seqlen_new, heads_kv, head_dim] with q's batch {q.shape[0]} and "
                f"k_cache's heads_kv {k_cache.shape[2]} and head_dim {k_cache.shape[3]}, got shape {tuple(t.shape)}"
            )
        if fp8_cache and t.dtype != q.dtype:
            raise ValueError(
                f"{name}: dtype {t.dtype} must be q's, {q.dtype}: the append quantizes it into k_cache's e4m3 codes"
            )
        if not fp8_cache and t.dtype != k_cache.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must match k_cache's dtype {k_cache.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: must be on k_cache's device {k_cache.device}, got {t.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k's shape {tuple(k.shape)}")


def _check_rotary(rotary_cos, rotary_sin, q: torch.Tensor, capacity: int) -> None:
    """cos and sin [seqlen_ro, rotary_dim / 2], rotary_dim even and <= head_dim, seqlen_ro >= the cache's keys."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: pass both or neither")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or not 1 <= 2 * t.shape[1] <= q.shape[-1]:
            raise ValueError(
                f"{name}: must be 2-D [seqlen_ro, rotary_dim / 2] with 2 <= rotary_dim <= head_dim "
                f"({q.shape[-1]}), got shape {tuple(t.shape)}"
            )
        if t.shape[0] < capacity:
            raise ValueError(
                f"{name}: seqlen_ro ({t.shape[0]}, dim 0) must be at least the cache's keys per sequence ({capacity})"
            )
        if not t.dtype.is_floating_point or t.dtype == _FP8_DTYPE:
            raise ValueError(f"{name}: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin: shape {tuple(rotary_sin.shape)} must equal rotary_cos's shape")


# Layouts of flash_attn_with_kvcache calls whose checks passed (_kvcache_key): a decoding loop's
# later calls skip them, as the ops skip theirs for a launch they remember (ops._launch_key).
_CHECKED: set = set()
_MAX_CHECKED = 256


def _kvcache_key(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    causal, window_size, softmax_scale, num_splits, return_softmax_lse, rotary_interleaved, k_descale=None,
    v_descale=None,
) -> Optional[tuple]:  # fmt: skip
    """The call's layout: its tensors' shapes, strides, dtypes, devices and alignments and its
    flags, what every check of _check_kvcache_call depends on; None for arguments no layout
    describes (a non-tensor where a tensor goes, a window that is no sequence), and for calls
    that are traced rather than run (torch.compile, a dispatch mode such as fake tensors, tensor
    subclasses): those run every check, as their first call would."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return None
    seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    tensors = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad, block_table,
               k_descale, v_descale)
    if not all(t is None or type(t) is torch.Tensor for t in tensors) or not isinstance(window_size, (tuple, list)):
        return None
    flags = (
        "kvcache", type(cache_seqlens).__name__, bool(causal), tuple(window_size), softmax_scale, num_splits,
        bool(return_softmax_lse), bool(rotary_interleaved),
    )  # fmt: skip
    return _launch_key(flags, *tensors)


def _check_kvcache_call(
    q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    causal, window_size, k_descale=None, v_descale=None,
) -> Tuple[Optional[torch.Tensor], Tuple[int, int]]:  # fmt: skip
    """flash_attn_with_kvcache's checks before anything is written; returns (seqlens_k, window)."""
    paged, appending, indexed = block_table is not None, k is not None or v is not None, cache_batch_idx is not None
    # First, so that errors call the caches by these names (hattn.attention calls them k and v).
    _check_inputs(q, k_cache, v_cache, "auto", paged=paged, names=_PAGED_NAMES, kv_entries=indexed, fp8_cache=True)
    _check_cache_descales(q, k_cache, k_descale, v_descale)  # before the append reads them
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _check_seqlens_k(t, q.shape[0], name)
    seqlens_k = _cache_seqlens(cache_seqlens, q)
    window = _flash_window(window_size, causal)
    if _is_fp8_cache(q, k_cache) and (window[0] >= 0 or (window[1] >= 0 and not causal)):
        # Before the append writes anything (the attention's own check comes after it).
        raise NotImplementedError(
            "fwd_sm90: an e4m3 KV cache (kv_dtype) runs without a sliding window (window_left / window_right)"
        )
    if paged and seqlens_k is None:
        raise ValueError("cache_seqlens: required with block_table (the keys in each sequence's pages)")
    if paged and (appending or rotary_cos is not None or rotary_sin is not None):
        # Here, not only in attention_paged: its width sizes the rotary tables and the append writes through it.
        _check_block_table(block_table, q.shape[0], k_cache.shape[1], indexed=indexed)
    if rotary_cos is not None or rotary_sin is not None:
        if not appending:
            raise ValueError("rotary_cos, rotary_sin: only with k and v (the rotation applies to the keys appended)")
        capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        _check_rotary(rotary_cos, rotary_sin, q, capacity)
    if appending:
        _check_new_kv(k, v, q, k_cache)
        if seqlens_k is None:
            raise ValueError("cache_seqlens: required with k and v (where the new keys go in each sequence)")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the last dim must be contiguous (stride 1) to append to it in place")
        if q.device.type != "meta":  # before anything is written (k, v and rotary are on the caches' device)
            _check_device(
                q, k_cache, v_cache, _PAGED_NAMES, block_table=block_table, seqlens_k=seqlens_k,
                cache_batch_idx=cache_batch_idx, k_descale=k_descale, v_descale=v_descale,
            )  # fmt: skip
    return seqlens_k, window


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """flash_attn_with_kvcache's arguments and result, run by hattn.attention_paged (with a
    block_table) or hattn.attention with seqlens_k (a dense cache).

    q [B, Sq, Hq, D]; k_cache, v_cache [B, S_cache, Hkv, D] (dense) or [num_pages, page_size,
    Hkv, D] with block_table int32 [B, max_pages_per_seq] (paged; page_size a multiple of 128).
    cache_seqlens: the keys in each sequence's cache, an int (the same for all) or int32 [B] on
    q's device; None uses every key of a dense cache and is an error with a block_table. As in
    FlashAttention, causal and window_size align to each sequence's last key and causal sets
    the window's right side to 0; num_splits is the split-KV hint (0 automatic, 1 off).
    Returns out [B, Sq, Hq, D], or (out, softmax_lse [B, Hq, Sq] fp32) when return_softmax_lse.

    Appending, as in FlashAttention: k and v [B, seqlen_new, Hkv, D] are written into the caches
    in place at keys cache_seqlens[b], cache_seqlens[b] + 1, ... (dense rows, or the pages
    block_table maps them to), and the attention runs over cache_seqlens[b] + seqlen_new keys;
    cache_seqlens itself is not changed. Rows that do not fit in the cache (S_cache, or
    max_pages_per_seq * page_size keys) are not written and the length is clamped to the cache,
    like the kernels' own clamping, since the lengths are never read on the host. With
    rotary_cos and rotary_sin [seqlen_ro, rotary_dim / 2] (seqlen_ro at least the cache's keys
    per sequence), the new keys are rotated at their positions before they are written, and q
    (a rotated copy) at positions cache_seqlens[b] + i when causal or windowed, else all at
    cache_seqlens[b]; rotary_interleaved picks GPT-J pairs (2i, 2i + 1) over GPT-NeoX halves.
    The tables are read in q's dtype (as FlashAttention requires them; others are converted),
    the rotation runs in fp32. The append is one kernel (the op hattn::append_kv) on the current
    stream before the attention: no host synchronization, CUDA-graph capture works. The caches'
    last dim must be contiguous. An error raised by the attention itself (an unsupported
    head_dim or page_size) comes after the write.

    cache_batch_idx: int32 [B] on q's device, sequence b's cache entry: batch entry
    cache_batch_idx[b] of a dense cache [B_cache, S_cache, Hkv, D] (B_cache need not be B), or
    row cache_batch_idx[b] of a block_table [rows, max_pages_per_seq]; the append writes there
    too. Sequences that share an entry also share where they append (which one's rows land is
    not defined, as in FlashAttention). cache_leftpad: int32 [B] on q's device (dense caches
    only), sequence b's first key: it attends to keys cache_leftpad[b] .. cache_seqlens[b] +
    seqlen_new - 1, and the masks align as for a sequence of that many keys; the append and the
    rotary positions stay absolute (key cache_seqlens[b] + i), as in FlashAttention. Both are
    read by the kernels only, and clamped there (to the entries, and to the sequence's keys).

    softcap caps the scores as in hattn.attention. alibi_slopes, cache_leftpad with block_table
    and inputs that require grad (no backward with a KV cache yet) raise NotImplementedError
    naming them. Unused cache rows may hold anything (see hattn.attention_paged).

    An FP8 cache (hattn's addition): k_cache and v_cache torch.float8_e4m3fn beside bf16/fp16
    q, with k_descale and v_descale (keyword only; None or fp32 [B, Hkv], as in
    hattn.attention). The cache is read at 1 byte an element; no window. k and v to append are
    in q's dtype, and each value (a key rotated first) is written as the e4m3 code of value /
    descale of its sequence and K/V head (nearest, saturated to +-448; a zero descale writes 0).
    """
    unsupported = []
    if cache_leftpad is not None and block_table is not None:
        unsupported.append("cache_leftpad with block_table (a paged cache's K/V tiles start on its pages)")
    # alibi_slopes as in flash_attn_func (no dropout or probabilities here; no grad, see below).
    unsupported += _unsupported(0.0, alibi_slopes)
    if _needs_grad(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin):
        unsupported.append("inputs that require grad (hattn has no backward with a KV cache yet; use torch.no_grad())")
    paged, appending = block_table is not None, k is not None or v is not None
    if unsupported:
        raise NotImplementedError("hattn.flash_attn_with_kvcache does not support " + "; ".join(unsupported))
    key = _kvcache_key(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        causal, window_size, softmax_scale, num_splits, return_softmax_lse, rotary_interleaved, k_descale, v_descale,
    )  # fmt: skip
    if key is not None and key in _CHECKED:  # a layout whose checks passed before: the values' alone
        seqlens_k, window = _cache_seqlens(cache_seqlens, q), _flash_window(window_size, causal)
    else:
        seqlens_k, window = _check_kvcache_call(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, causal, window_size, k_descale, v_descale,
        )  # fmt: skip
        if key is not None:
            if len(_CHECKED) >= _MAX_CHECKED:
                _CHECKED.clear()
            _CHECKED.add(key)
    if appending:
        if rotary_cos is not None:  # the kernel reads the tables in q's dtype, rows contiguous
            rotary_cos, rotary_sin = (t.to(q.dtype).contiguous() for t in (rotary_cos, rotary_sin))
        table = None if block_table is None else block_table.contiguous()
        entries = None if cache_batch_idx is None else cache_batch_idx.contiguous()
        scales = tuple(None if t is None else t.contiguous() for t in (k_descale, v_descale))
        args = (
            q, k_cache, v_cache, k, v, seqlens_k.contiguous(), table, rotary_cos, rotary_sin, bool(rotary_interleaved),
            window != (-1, -1), entries, *scales,
        )  # fmt: skip
        seqlens_k, q_rotated = _call(append_kv, _append_kv, *args)
        if rotary_cos is not None:
            q = q_rotated
    if paged:
        result = attention_paged(
            q, k_cache, v_cache, block_table, seqlens_k, causal=causal, softmax_scale=softmax_scale,
            return_lse=return_softmax_lse, window_size=window, num_splits=num_splits, kv_batch_idx=cache_batch_idx,
            softcap=softcap, k_descale=k_descale, v_descale=v_descale,
        )  # fmt: skip
    else:
        result = attention(
            q, k_cache, v_cache, causal=causal, softmax_scale=softmax_scale, return_lse=return_softmax_lse,
            window_size=window, seqlens_k=seqlens_k, num_splits=num_splits, kv_batch_idx=cache_batch_idx,
            leftpad_k=cache_leftpad, softcap=softcap, k_descale=k_descale, v_descale=v_descale,
        )  # fmt: skip
    return result
