"""KV caches: the paged forward (hattn::attention_paged_fwd, hattn.attention_paged) and appending
a step's keys and values to a cache (hattn::append_kv)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _C
from .checks import (
    _DTYPE_NAMES, _KERNEL_DTYPE_NAMES, _PAGED_NAMES, _cache_descale_features, _cache_features, _check_num_splits,
    _check_paged_inputs, _check_problem, _check_promises, _check_softcap, _check_types, _strides, _window,
)
from .runner import (
    _LAUNCHES, _MAX_LAUNCHES, _bshd_outputs_like, _call, _current_stream, _launch_key, _launch_layout,
    _layout_checked,
)


def _attention_paged_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    kernel: str,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    num_splits: int = 0,
    kv_batch_idx: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_paged_fwd: (out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32, or empty when not return_lse).
    k_descale, v_descale: an FP8 cache's (e4m3 k_cache and v_cache)."""
    key = _launch_key(
        ("paged", causal, softmax_scale, kernel, return_lse, window_left, window_right, num_splits, softcap),
        q, k_cache, v_cache, block_table, seqlens_k, kv_batch_idx, k_descale, v_descale,
    )  # fmt: skip
    indices = {"block_table": block_table, "seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx}
    descales = {"k_descale": k_descale, "v_descale": v_descale}

    def check():
        _check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx, k_descale,
                            v_descale)  # fmt: skip
        _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                       _cache_features(seqlens_k, kv_batch_idx, None) + _cache_descale_features(q, k_cache))  # fmt: skip

    remembered, key, q, k_cache, v_cache, indices = _layout_checked(key, check, q, k_cache, v_cache,
                                                                    {**indices, **descales}, _PAGED_NAMES)  # fmt: skip
    _check_promises(capacity=block_table.shape[-1] * k_cache.shape[1], num_pages=k_cache.shape[0],
                    page_size=k_cache.shape[1], kv_batch=block_table.shape[0], descales=tuple(descales.items()),
                    **{name: indices[name] for name in ("block_table", "seqlens_k", "kv_batch_idx")})  # fmt: skip
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0:  # no batch or no queries: empty outputs, no kernel
        return out, lse
    _launch_layout(remembered, key, q, k_cache, v_cache, out, lse if return_lse else None, causal, softmax_scale,
                   kernel, (window_left, window_right), indices, num_splits=num_splits, softcap=softcap)  # fmt: skip
    return out, lse


attention_paged_fwd = torch.library.custom_op("hattn::attention_paged_fwd", mutates_args=())(_attention_paged_fwd)


@attention_paged_fwd.register_fake
def _attention_paged_fwd_fake(
    q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, kernel, return_lse,
    window_left=-1, window_right=-1, num_splits=0, kv_batch_idx=None, softcap=0.0, k_descale=None, v_descale=None,
):  # fmt: skip
    _check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx, k_descale,
                        v_descale)  # fmt: skip
    _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                   _cache_features(seqlens_k, kv_batch_idx, None) + _cache_descale_features(q, k_cache))  # fmt: skip
    return _bshd_outputs_like(q, return_lse)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    kernel: str = "auto",
    return_lse: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    num_splits: int = 0,
    kv_batch_idx: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Forward attention over a paged KV cache, as FlashAttention's flash_attn_with_kvcache and
    vLLM keep it: keys and values in fixed-size pages that a block table maps to each sequence.

    Args:
        q: [B, Sq, Hq, D] CUDA tensor, torch.bfloat16 or torch.float16; D in {64, 128, 256}.
        k_cache, v_cache: [num_pages, page_size, Hkv, D], same dtype and device; Hq % Hkv == 0
            (GQA/MQA). Or an FP8 cache: both torch.float8_e4m3fn beside bf16/fp16 q, with
            k_descale and v_descale (below); no sliding window then. bf16 q over an FP8 cache
            is multiplied in fp16 as q * 2^-8: exact for |q| from 2^-9 to 1.6e7, rounded to
            steps of 2^-16 below, saturated above.
            page_size must be a multiple of 128 (a K/V tile never spans two pages); other
            sizes raise NotImplementedError.
        block_table: torch.int32 [B, max_pages_per_seq] on q's device: sequence b's key j is
            row j % page_size of page block_table[b, j // page_size]. Entries past a sequence's
            last page are not used (the kernel clamps indices to the cache).
        seqlens_k: torch.int32 [B] on q's device, the keys in each sequence (FlashAttention's
            cache_seqlens), from 0 to max_pages_per_seq * page_size (clamped to that range).
            The rows past them in a sequence's last page may hold anything (NaN included): the
            kernel zeroes their V rows in shared memory before they meet their zero weights.
        causal: bottom-right aligned to each sequence's length: query i sees key j iff
            j <= i + seqlens_k[b] - Sq. Rows that see no key give output 0 and LSE -inf.
        softmax_scale: default 1/sqrt(D).
        kernel: "auto" or a name from hattn.kernels(); only the production forward (what "auto"
            picks) has a paged cache, a lineage kernel raises NotImplementedError.
        return_lse: also return the row log-sum-exp (natural log), fp32 [B, Hq, Sq].
        window_size: (left, right), the sliding window of attention(), aligned like the causal
            mask to seqlens_k[b]; -1 leaves a side open.
        num_splits: split-KV (flash-decoding) parts: 0 automatic, 1 off, n <= 64 (see attention()).
        kv_batch_idx: None, or torch.int32 [B] on q's device (FlashAttention's cache_batch_idx):
            sequence b's pages are row kv_batch_idx[b] of block_table, which may then have any
            number of rows (indices clamped to them).
        softcap: > 0 caps the scores at softcap * tanh(s / softcap), as in attention().
        k_descale, v_descale: an FP8 cache's dequantization scales, None (1) or torch.float32
            [B, Hkv] on q's device, as in attention(): sequence b's K/V head g reads
            k * k_descale[b, g] and v * v_descale[b, g]. The cache is read at 1 byte an element
            and widened to q's dtype in shared memory, exactly.

    Returns:
        out [B, Sq, Hq, D] contiguous, in q's dtype; or (out, lse) when return_lse.

    Raises:
        TypeError / ValueError: malformed arguments (the message names the argument).
        NotImplementedError: the chosen kernel (or every kernel, for "auto") does not support the
            problem, e.g. a page_size that is not a multiple of 128.
        RuntimeError: no suitable GPU (none, or not Hopper sm_90), or a CUDA error.

    The kernel plans its work for max_pages_per_seq * page_size keys per sequence (block_table's
    width, not seqlens_k's values, which are never read on the host: that would synchronize it
    with the GPU), so a block table no wider than the longest sequence needs is cheapest. The
    caches are read in place when their layout allows (see the module docstring; otherwise the
    whole cache is copied). Runs on torch.cuda.current_stream(); works under
    torch.compile(fullgraph=True) and CUDA-graph capture, where new seqlens_k and block_table
    values of the same shapes need no new capture. Forward only (no autograd).
    """
    more = {"block_table": block_table, "seqlens_k": seqlens_k}
    for name, t in (("kv_batch_idx", kv_batch_idx), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            more[name] = t
    _check_types(q, k_cache, v_cache, _PAGED_NAMES, **more)
    _check_num_splits(num_splits)
    softcap = _check_softcap(softcap)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    left, right = _window(window_size)
    out, lse = _call(
        attention_paged_fwd, _attention_paged_fwd,
        q, k_cache, v_cache, block_table, seqlens_k, bool(causal), softmax_scale, kernel, bool(return_lse),
        left, right, num_splits, kv_batch_idx, softcap, k_descale, v_descale,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# --- appending to a KV cache -----------------------------------------------------------------------


def _append_kv(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor],
    rotary_interleaved: bool,
    q_positions_per_row: bool,
    kv_batch_idx: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::append_kv (hattn._C.append_kv, one kernel): writes k and v [B, n, Hkv, D] into the
    caches in place at keys seqlens[b] + i (rotated first with rotary_cos/rotary_sin, which
    are in q's dtype and contiguous), into cache entry kv_batch_idx[b] when given (a batch
    entry of a dense cache, or a row of block_table); returns (seqlens + n, int32 [B]; q
    rotated at its positions, or an empty tensor without rotary). An e4m3 cache gets the codes
    of value / descale (k_descale, v_descale: contiguous fp32 [B, Hkv] or None). The caller has
    checked the arguments (hattn.flash_attn_with_kvcache); the C++ side checks them again."""
    rotary = rotary_cos is not None
    seqlens_out = torch.empty_like(seqlens)
    q_rotated = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary else q.new_empty(0)
    # Remembered by layout like the attention's launches (_launch_key): a call of a layout seen
    # before only fills in its pointers.
    key = _launch_key(
        ("append", rotary_interleaved, q_positions_per_row),
        q, k_cache, v_cache, k, v, seqlens, block_table, rotary_cos, rotary_sin, kv_batch_idx, k_descale, v_descale,
    )  # fmt: skip
    layout = _LAUNCHES.get(key)
    if layout is None:
        # The kernel reads rows with a contiguous last dim (the caches' were checked).
        if k.stride(-1) != 1 or v.stride(-1) != 1 or (rotary and q.stride(-1) != 1):
            key = None  # copies: nothing to remember
            k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
            q = q if q.stride(-1) == 1 else q.contiguous()
        layout = dict(
            dtype=_DTYPE_NAMES[k.dtype], batch=q.shape[0], seqlen_new=k.shape[1], heads_kv=k.shape[2],
            head_dim=k.shape[3], k_new_strides=_strides(k), v_new_strides=_strides(v),
            k_cache_strides=_strides(k_cache), v_cache_strides=_strides(v_cache),
        )  # fmt: skip
        if block_table is not None:
            layout.update(
                max_pages_per_seq=block_table.shape[1], num_pages=k_cache.shape[0], page_size=k_cache.shape[1]
            )  # fmt: skip
        else:
            layout.update(cache_seqlen=k_cache.shape[1])
        if kv_batch_idx is not None:
            layout.update(kv_batch=block_table.shape[0] if block_table is not None else k_cache.shape[0])
        if k_cache.dtype != k.dtype:  # an e4m3 cache
            layout.update(cache_dtype=_KERNEL_DTYPE_NAMES[k_cache.dtype])
        if rotary:
            layout.update(
                rotary_dim=2 * rotary_cos.shape[1], rotary_seqlen=rotary_cos.shape[0],
                rotary_interleaved=rotary_interleaved, q_strides=_strides(q), q_rotated_strides=_strides(q_rotated),
                seqlen_q=q.shape[1], heads_q=q.shape[2], q_positions_per_row=q_positions_per_row,
            )  # fmt: skip
        if key is not None:
            if len(_LAUNCHES) >= _MAX_LAUNCHES:
                _LAUNCHES.clear()
            _LAUNCHES[key] = layout  # the C++ side checks every call's arguments, this one's included
    pointers = {
        "k_new": k, "v_new": v, "k_cache": k_cache, "v_cache": v_cache, "seqlens": seqlens,
        "seqlens_out": seqlens_out, "block_table": block_table, "kv_batch_idx": kv_batch_idx,
        "k_descale": k_descale, "v_descale": v_descale,
    }  # fmt: skip
    if rotary:
        pointers.update(rotary_cos=rotary_cos, rotary_sin=rotary_sin, q=q, q_rotated=q_rotated)
    kwargs = dict(layout, **{name: t.data_ptr() for name, t in pointers.items() if t is not None})
    with torch.cuda.device(q.device):
        _C.append_kv(**kwargs, stream=_current_stream(q.device))
    return seqlens_out, q_rotated


append_kv = torch.library.custom_op("hattn::append_kv", mutates_args=("k_cache", "v_cache"))(_append_kv)


@append_kv.register_fake
def _append_kv_fake(
    q, k_cache, v_cache, k, v, seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved, q_positions_per_row,
    kv_batch_idx=None, k_descale=None, v_descale=None,
):  # fmt: skip
    q_rotated = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary_cos is not None else q.new_empty(0)
    return torch.empty_like(seqlens), q_rotated
