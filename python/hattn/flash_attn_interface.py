"""Drop-in for FlashAttention-3's Python interface, the module flash_attn_interface of the
hopper/ directory of the FlashAttention repository:

    from hattn import flash_attn_interface        # in place of: import flash_attn_interface
    out = flash_attn_interface.flash_attn_func(q, k, v, causal=True)                  # [B, S, H, D]
    out, lse = flash_attn_interface.flash_attn_func(q, k, v, return_attn_probs=True)  # lse [B, H, S]
    out = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      max_seqlen_q, max_seqlen_k)    # [total_q, H, D]
    out = flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                       page_table=table)             # decoding

The names, parameters (order and defaults) and results are FlashAttention-3's as its
hopper/flash_attn_interface.py has them since late 2025 (checked against its commits c082294e
and 01afd16d, whose public signatures agree; the FA3 build the project measures against,
0251105a, has the operator schemas of that interface): flash_attn_func and
flash_attn_varlen_func return out, or (out, softmax_lse) with return_attn_probs=True, and
flash_attn_with_kvcache returns out, or (out, softmax_lse, out_accum, softmax_lse_accum) with
return_softmax_lse=True. Its conventions are FlashAttention-2's too: the causal mask and the
window align to the bottom-right corner (of each sequence), causal sets the window's right side
to 0, GQA comes from fewer K/V heads, and the default scale is 1/sqrt(D).

They run hattn's ops: flash_attn_func and flash_attn_qkvpacked_func hattn.attention (or
hattn.attention_fp8 for float8_e4m3fn inputs), flash_attn_varlen_func hattn.attention_varlen,
flash_attn_with_kvcache hattn.attention_paged (with page_table) or hattn.attention with
seqlens_k (a dense cache), after the append of hattn.flash_attn_with_kvcache. The first three
are differentiable (dq, dk and dv through hattn's backward), except with FP8 inputs.

Arguments hattn cannot honour raise NotImplementedError naming each of them (all in one
message) when they differ from their defaults: qv (except flash_attn_with_kvcache's MLA call,
see there), attention_chunk != 0, sm_margin != 0 (hattn's
persistent kernels take every SM), seqused_q and seqused_k (varlen), cu_seqlens_q,
cu_seqlens_k_new, rotary_seqlens and scheduler_metadata (KV cache), FP8 inputs or descales
with a variable-length batch or a KV cache, and with FP8 inputs a window or softcap. Two are
hints that change no result beyond rounding, accepted and described where they are taken:
pack_gqa (hattn decides GQA packing itself) and num_splits. Nothing falls back to another
library. FA3's flash_attn_combine and get_scheduler_metadata are not provided: hattn plans its
split-KV and combines the parts inside one call.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from .flash_attn import (
    _check_no_descales, _flash_window, _fp8_unsupported, _unpack,
    flash_attn_with_kvcache as _flash_attn_with_kvcache,
)  # fmt: skip
from .ops import attention, attention_fp8, attention_varlen
from .ops.checks import _FP8_DTYPE, _MAX_SPLITS, _check_int32_tensor, _needs_grad

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _refuse(function: str, unsupported: List[str]) -> None:
    if unsupported:
        raise NotImplementedError(f"hattn.flash_attn_interface.{function} does not support " + "; ".join(unsupported))


def _unsupported(qv, attention_chunk, sm_margin) -> List[str]:
    """What FA3's three functions share that hattn lacks, one entry per argument."""
    unsupported = []
    if qv is not None:
        unsupported.append("qv (no second query-value product: hattn computes softmax(scale q k^T) v)")
    if attention_chunk != 0:
        unsupported.append(f"attention_chunk={attention_chunk} (no chunked attention mask)")
    if sm_margin != 0:
        unsupported.append(f"sm_margin={sm_margin} (hattn's persistent kernels take every SM; none can be left free)")
    return unsupported


def _fp8_batch_unsupported(q, descales, batch: str) -> List[str]:
    """FP8 inputs or descales where hattn's FP8 forward does not go (it takes dense batches only)."""
    why = "hattn's FP8 forward takes dense batches: flash_attn_func"
    unsupported = []
    if isinstance(q, torch.Tensor) and q.dtype == _FP8_DTYPE:
        unsupported.append(f"float8_e4m3fn inputs with {batch} ({why})")
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is not None:
            unsupported.append(f"{name} with {batch} ({why})")
    return unsupported


def _check_pack_gqa(pack_gqa) -> None:
    """pack_gqa: None, True or False, a hint (see flash_attn_func)."""
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa: must be None, True or False, got {type(pack_gqa).__name__}")


def _num_splits(num_splits) -> int:
    """FA3's num_splits as hattn's: <= 0 lets the library decide (0), 1 is no split, n > 1 asks
    for n parts, at most hattn's 64 (a hint: more parts would change only the rounding)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, torch.SymInt)):
        raise TypeError(f"num_splits: must be an int, got {type(num_splits).__name__}")
    return max(0, min(num_splits, _MAX_SPLITS))


def _dense(
    function, q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size, attention_chunk,
    softcap, num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs,
):  # fmt: skip
    """flash_attn_func's body; function names the caller in refusals."""
    unsupported = _unsupported(qv, attention_chunk, sm_margin)
    fp8 = isinstance(q, torch.Tensor) and q.dtype == _FP8_DTYPE
    window = _flash_window(window_size, causal)
    if fp8:
        unsupported += _fp8_unsupported(window_size, causal, softcap)
    _refuse(function, unsupported)
    _check_pack_gqa(pack_gqa)
    splits = _num_splits(num_splits)
    if fp8:
        # (-1, 0) is the causal mask, whether causal says so or not; attention_fp8 plans its own work.
        return attention_fp8(
            q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, causal=window[1] == 0,
            softmax_scale=softmax_scale, return_lse=return_attn_probs,
        )  # fmt: skip
    _check_no_descales(q, q_descale, k_descale, v_descale)
    return attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_attn_probs, window_size=window,
        num_splits=splits, softcap=softcap, deterministic=bool(deterministic),
    )  # fmt: skip


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """FlashAttention-3's flash_attn_func, run by hattn.attention.

    q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D] (bf16 or fp16, D in {64, 128, 256}); returns out
    [B, Sq, Hq, D], or (out, softmax_lse fp32 [B, Hq, Sq]) when return_attn_probs (FA3 returns
    the LSE there, not probabilities). Differentiable: with q, k or v requiring grad, backward
    gives dq, dk and dv (causal, window, softcap and GQA included; no gradient through the LSE).

    softmax_scale, causal, window_size and softcap are hattn.attention's (causal sets the
    window's right side to 0, as in FlashAttention). num_splits is FA3's split-KV count and
    hattn's: 1 (the default) computes each query block's keys in one part, 0 or less lets hattn
    decide (split-KV, and the tail split of its last round), n > 1 asks for n parts, more than
    64 counts as 64; it changes the result only by rounding. pack_gqa is a hint that hattn does
    not take (it packs the query heads of a K/V head when that pays, with the same result up to
    rounding); None, True and False are all accepted. deterministic=True makes the backward's
    dq, dk and dv bitwise the same from run to run (at D = 256 not with GQA: NotImplementedError).

    FP8: with torch.float8_e4m3fn q, k and v (D = 64, 128 or 256), q_descale, k_descale and v_descale
    (None or fp32 [B, Hkv]) go with them to hattn.attention_fp8, which returns bf16 out (and
    the LSE with return_attn_probs) and has no backward; window_size must then be (-1, -1) or
    the causal mask's (-1, 0), softcap 0, and num_splits is not used. Descales with bf16/fp16
    inputs raise ValueError.

    qv, attention_chunk != 0 and sm_margin != 0 raise NotImplementedError naming them.
    """
    return _dense(
        "flash_attn_func", q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
        attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin, return_attn_probs,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: bool = False,
    num_heads_q: Optional[int] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """FlashAttention-3's flash_attn_qkvpacked_func: qkv [B, S, 3, H, D], or [B, S, Hq + 2 Hkv, D]
    with num_heads_q = Hq (the query heads first, then the keys', then the values'), run as
    flash_attn_func on its q, k and v views (no copy; gradients flow back into qkv). num_heads_q
    is not used with the 5-D form; the rest is flash_attn_func's (with num_splits 1)."""
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 4:
        if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int):
            raise TypeError(
                "num_heads_q: must be an int (the query heads of qkv [batch, seqlen, heads_q + 2 * heads_kv, "
                f"head_dim]), got {type(num_heads_q).__name__}"
            )
        heads = qkv.shape[2]
        heads_kv = (heads - num_heads_q) // 2
        if num_heads_q < 1 or heads_kv < 1 or num_heads_q + 2 * heads_kv != heads:
            raise ValueError(
                f"num_heads_q: qkv's {heads} heads (dim 2) must be num_heads_q ({num_heads_q}) + 2 * heads_kv with "
                "heads_kv >= 1"
            )
        q, k, v = qkv.split([num_heads_q, heads_kv, heads_kv], dim=2)
    else:
        q, k, v = _unpack(
            qkv, 2, 3, "qkv", "[batch, seqlen, 3, heads, head_dim], or [batch, seqlen, heads_q + 2 * heads_kv, "
            "head_dim] with num_heads_q",
        )  # fmt: skip
    return _dense(
        "flash_attn_qkvpacked_func", q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale,
        window_size, attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """FlashAttention-3's flash_attn_varlen_func, run by hattn.attention_varlen.

    q [total_q, Hq, D], k and v [total_k, Hkv, D], cu_seqlens_q/k int32 [batch + 1] on q's
    device, max_seqlen_q/k ints (the longest lengths); returns out [total_q, Hq, D], or (out,
    softmax_lse fp32 [Hq, total_q]) when return_attn_probs. The offsets are the caller's promise,
    never read on the host. Differentiable like flash_attn_func (dq, dk and dv per sequence).
    softmax_scale, causal, window_size and softcap as in flash_attn_func, aligned to each
    sequence's own bottom-right corner.

    Hints, accepted and not used: num_splits (hattn's variable-length forward plans its own
    work; any int) and pack_gqa (None, True or False). deterministic=True as in flash_attn_func.
    seqused_q, seqused_k, qv, attention_chunk != 0, sm_margin != 0, FP8 inputs and descales
    (hattn's FP8 forward takes dense batches) raise NotImplementedError naming them.
    """
    unsupported = []
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            unsupported.append(f"{name} (no lengths in use apart from cu_seqlens_q and cu_seqlens_k)")
    unsupported += _unsupported(qv, attention_chunk, sm_margin)
    unsupported += _fp8_batch_unsupported(q, (q_descale, k_descale, v_descale), "a variable-length batch")
    _refuse("flash_attn_varlen_func", unsupported)
    _check_pack_gqa(pack_gqa)
    _num_splits(num_splits)
    return attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_attn_probs, window_size=_flash_window(window_size, causal), softcap=softcap,
        deterministic=bool(deterministic),
    )  # fmt: skip


def _latent_cache(k_cache, v_cache) -> Optional[torch.Tensor]:
    """FA3's MLA call keeps the rope keys (k_cache [P, page, 1, 64]) and the latent
    (v_cache [P, page, 1, 512]) apart; hattn's MLA kernel reads both from one 576-feature row,
    latent first. When they are such views of one buffer (as inference engines lay out their MLA
    caches), that buffer as [P, page, 1, 576]; None otherwise."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k_cache, v_cache)):
        return None
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != 64 or v_cache.shape[3] != 512:
        return None
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device or k_cache.stride() != v_cache.stride():
        return None
    if (k_cache.stride(-1) != 1 or k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr()
            or k_cache.data_ptr() != v_cache.data_ptr() + 512 * v_cache.element_size()):
        return None
    return v_cache.as_strided((*v_cache.shape[:3], 576), v_cache.stride())


def _mla_kvcache(q, k_cache, v_cache, qv, cache_seqlens, page_table, softmax_scale, causal, return_softmax_lse,
                 extras: List[str]):  # fmt: skip
    """FA3's MLA decoding (qv with headdim 64 and headdim_v 512 over a paged cache) on
    hattn.mla_with_kvcache; extras: what else the call asks for, which this path refuses."""
    from .ops.mla import mla_with_kvcache

    unsupported = []
    shapes_ok = (all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, qv)) and q.shape[-1] == 64
                 and qv.shape[-1] == 512 and qv.shape[:3] == q.shape[:3])  # fmt: skip
    if not shapes_ok:
        unsupported.append("qv (no second query-value product: hattn computes softmax(scale q k^T) v, and with a "
                           "KV cache FA3's MLA call, q [B, Sq, H, 64] with qv [B, Sq, H, 512])")  # fmt: skip
    if page_table is None:
        unsupported.append("qv without page_table (MLA decoding reads a paged latent cache)")
    if not isinstance(cache_seqlens, torch.Tensor):
        unsupported.append("qv without an int32 cache_seqlens tensor")
    cache = _latent_cache(k_cache, v_cache)
    if cache is None:
        unsupported.append("qv with k_cache and v_cache that are not views of one [num_pages, page_size, 1, 576] "
                           "buffer (the latent v_cache its first 512 features, the rope k_cache its last 64): "
                           "hattn's MLA kernel reads both from one row")  # fmt: skip
    _refuse("flash_attn_with_kvcache", unsupported + extras)
    out, lse = mla_with_kvcache(torch.cat([qv, q], dim=-1), cache, page_table, cache_seqlens,
                                softmax_scale=softmax_scale, causal=causal, return_lse=True)  # fmt: skip
    if not return_softmax_lse:
        return out
    return out, lse, *(torch.empty(0, dtype=torch.float32, device=out.device) for _ in range(2))


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    qv: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    pack_gqa: Optional[bool] = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
):
    """FlashAttention-3's flash_attn_with_kvcache, run as hattn.flash_attn_with_kvcache (the
    FlashAttention-2 form) with page_table as its block_table.

    q [B, Sq, Hq, D]; k_cache, v_cache [B_cache, S_cache, Hkv, D] (dense) or [num_pages,
    page_size, Hkv, D] with page_table int32 [B, max_pages_per_seq] (paged; page_size must be a
    multiple of 128, others raise NotImplementedError). cache_seqlens: an int or int32 [B], the
    keys in each sequence's cache; None uses every key of a dense cache, and with a page_table
    (and nothing to append) every key of the table's pages, as FA3 does. k and v [B, seqlen_new,
    Hkv, D] are appended in place at cache_seqlens[b] (rotated first with rotary_cos,
    rotary_sin and rotary_interleaved); cache_batch_idx and cache_leftpad (dense caches) pick
    each sequence's cache entry and first key; softmax_scale, causal, window_size and softcap as
    in flash_attn_func. hattn.flash_attn_with_kvcache describes all of it; its later argument
    checks call page_table block_table.

    Returns out [B, Sq, Hq, D], or with return_softmax_lse FA3's four results (out, softmax_lse
    fp32 [B, Hq, Sq], out_accum, softmax_lse_accum), the last two empty fp32 tensors: hattn
    combines its split-KV parts inside the call and returns none of them.

    Hints: num_splits as in flash_attn_func (FA3's default here, 0, lets hattn decide), pack_gqa
    (accepted, not used), max_seqlen_q (FA3 reads it only with cu_seqlens_q; not used).
    MLA (FA3's qv mode): with q [B, Sq, H, 64] (the rope part), qv [B, Sq, H, 512] (the latent
    part), a page_table, an int32 cache_seqlens, and k_cache [P, page, 1, 64] and v_cache
    [P, page, 1, 512] that are views of one [P, page, 1, 576] buffer (latent first, as inference
    engines keep it), the call runs hattn.mla_with_kvcache (page a multiple of 64; the default
    scale 1/sqrt(64 + 512), as FA3's); out is [B, Sq, H, 512]. Any other qv call, or qv with
    anything to append, rotary, cache entries, a window or softcap, raises NotImplementedError.

    cu_seqlens_q, cu_seqlens_k_new (no variable-length queries or new keys), rotary_seqlens
    (the rotary positions are cache_seqlens[b] + i), scheduler_metadata (hattn plans its own
    schedule), attention_chunk != 0, sm_margin != 0, FP8 inputs and descales, cache_leftpad with
    page_table, and inputs that require grad (no backward with a KV cache, as in FA3) raise
    NotImplementedError naming them. An FP8 cache beside bf16/fp16 q (k_cache and v_cache
    torch.float8_e4m3fn, with k_descale and v_descale [B, Hkv]) is hattn's own: FA3 takes e4m3
    q with it; see hattn.flash_attn_with_kvcache (appending quantizes into it).
    """
    if qv is not None:  # FA3's MLA mode: hattn.mla_with_kvcache, when the cache is one latent buffer
        extras = _unsupported(None, attention_chunk, sm_margin)
        for name, given in (("k", k is not None), ("v", v is not None), ("rotary_cos", rotary_cos is not None),
                            ("rotary_sin", rotary_sin is not None), ("cache_batch_idx", cache_batch_idx is not None),
                            ("cache_leftpad", cache_leftpad is not None), ("cu_seqlens_q", cu_seqlens_q is not None),
                            ("cu_seqlens_k_new", cu_seqlens_k_new is not None),
                            ("rotary_seqlens", rotary_seqlens is not None),
                            ("scheduler_metadata", scheduler_metadata is not None),
                            ("descales", any(t is not None for t in (q_descale, k_descale, v_descale))),
                            ("window_size", tuple(window_size) != (-1, -1)), ("softcap", softcap != 0.0)):
            if given:
                extras.append(f"{name} with qv (hattn's MLA decoding takes none)")
        if _needs_grad(q, qv, k_cache, v_cache):
            extras.append("inputs that require grad (no backward with a KV cache; use torch.no_grad())")
        _check_pack_gqa(pack_gqa)
        _num_splits(num_splits)
        return _mla_kvcache(q, k_cache, v_cache, qv, cache_seqlens, page_table, softmax_scale, causal,
                            return_softmax_lse, extras)  # fmt: skip
    unsupported = _unsupported(qv, attention_chunk, sm_margin)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new)):
        if t is not None:
            unsupported.append(f"{name} (no variable-length queries or new keys with a KV cache)")
    if rotary_seqlens is not None:
        unsupported.append("rotary_seqlens (the rotary positions are cache_seqlens[b] + i)")
    if scheduler_metadata is not None:
        unsupported.append("scheduler_metadata (hattn plans its own split-KV schedule; num_splits is its hint)")
    fp8_cache = isinstance(k_cache, torch.Tensor) and k_cache.dtype == _FP8_DTYPE and isinstance(q, torch.Tensor) and (
        q.dtype != _FP8_DTYPE
    )
    if fp8_cache:  # an e4m3 cache beside bf16/fp16 q: k_descale and v_descale go with it, q has none
        if q_descale is not None:
            unsupported.append(f"q_descale with {q.dtype} q (an e4m3 cache's scales are k_descale and v_descale)")
    else:
        unsupported += _fp8_batch_unsupported(q, (q_descale, k_descale, v_descale), "a KV cache")
    if cache_leftpad is not None and page_table is not None:
        unsupported.append("cache_leftpad with page_table (a paged cache's K/V tiles start on its pages)")
    if _needs_grad(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin):
        unsupported.append("inputs that require grad (no backward with a KV cache; use torch.no_grad())")
    _refuse("flash_attn_with_kvcache", unsupported)
    _check_pack_gqa(pack_gqa)
    splits = _num_splits(num_splits)
    if page_table is not None:
        _check_int32_tensor("page_table", page_table)
        if page_table.dim() != 2:
            raise ValueError(f"page_table: must be 2-D [batch, max_pages_per_seq], got shape {tuple(page_table.shape)}")
        if cache_seqlens is None and (k is not None or v is not None):
            raise ValueError("cache_seqlens: required with k and v (where the new keys go in each sequence)")
        if cache_seqlens is None and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k_cache)):
            # FA3 reads every key of the table's pages then; filled on the GPU, no host synchronization.
            keys = page_table.shape[1] * k_cache.shape[1]
            cache_seqlens = torch.full((q.shape[0],), keys, dtype=torch.int32, device=q.device)
    result = _flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        softmax_scale, causal, window_size, softcap, rotary_interleaved, None, splits, return_softmax_lse,
        k_descale=k_descale if fp8_cache else None, v_descale=v_descale if fp8_cache else None,
    )  # fmt: skip
    if not return_softmax_lse:
        return result
    out, lse = result
    return (out, lse, *(torch.empty(0, dtype=torch.float32, device=out.device) for _ in range(2)))
