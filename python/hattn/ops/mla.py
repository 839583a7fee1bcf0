"""MLA decoding (DeepSeek's multi-head latent attention): hattn.mla_with_kvcache (op
hattn::mla_decode_fwd) over hattn::mla_decode, and hattn.mla_schedule, its split-KV schedule.

Every query head reads one latent K/V head from a paged cache whose rows hold 576 features (a
512-wide latent and a 64-wide rope part): K is the whole row, V its first 512 columns.

    schedule = hattn.mla_schedule(cache_seqlens, seqlen_q=1, heads_q=128)   # once per decoding step
    for layer in layers:                                                     # reused by every layer
        out, lse = hattn.mla_with_kvcache(q, kv_cache, block_table, cache_seqlens, schedule=schedule,
                                          causal=True, return_lse=True)
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import _C
from .checks import _check_promises, _needs_grad
from .runner import _call, _current_stream, _scratch

DIM_QK = 576
DIM_V = 512
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _check_int32_vector(name: str, t: torch.Tensor, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: must be int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: must be on {device} (q's device), got {t.device}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: must be [{length}], got {list(t.shape)}")


def _schedule_problem(cache_seqlens: torch.Tensor, seqlen_q: int, heads_q: int) -> "_C.MlaDecodeProblem":
    """A problem that mla_schedule_ints and mla_schedule accept: only the lengths and the rows count."""
    p = _C.MlaDecodeProblem()
    p.batch, p.seqlen_q, p.heads_q = cache_seqlens.shape[0], seqlen_q, heads_q
    p.cache_seqlens = cache_seqlens.data_ptr()
    return p


def mla_schedule(cache_seqlens: torch.Tensor, seqlen_q: int, heads_q: int) -> torch.Tensor:
    """The split-KV schedule of an MLA decoding step: int32 on cache_seqlens' GPU, made there from
    the lengths (no host sync; CUDA-graph safe). Pass it as `schedule=` to every layer's
    mla_with_kvcache call of the step (the same lengths, seqlen_q and heads_q)."""
    if (not isinstance(cache_seqlens, torch.Tensor) or not cache_seqlens.is_cuda or cache_seqlens.dtype != torch.int32
            or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] < 1):
        raise ValueError("cache_seqlens: must be an int32 CUDA tensor [batch], batch >= 1")
    if seqlen_q < 1 or heads_q < 1:
        raise ValueError(f"seqlen_q, heads_q: must be >= 1, got {seqlen_q}, {heads_q}")
    cache_seqlens = cache_seqlens.contiguous()
    with torch.cuda.device(cache_seqlens.device):
        problem = _schedule_problem(cache_seqlens, seqlen_q, heads_q)
        schedule = torch.empty(_C.mla_schedule_ints(problem), dtype=torch.int32, device=cache_seqlens.device)
        _C.mla_schedule(problem, schedule.data_ptr(), _current_stream(cache_seqlens.device))
    return schedule


def _check_mla_inputs(q, kv_cache, block_table, cache_seqlens, schedule, softmax_scale) -> None:
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or q.shape[-1] != DIM_QK:
        raise ValueError(f"q: must be [batch, seqlen_q, heads_q, {DIM_QK}], got {list(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: must be bfloat16 or float16, got {q.dtype}")
    if q.device.type == "cpu":
        raise ValueError("q: must be a CUDA tensor")
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != DIM_QK:
        raise ValueError(f"kv_cache: must be [num_pages, page_size, 1, {DIM_QK}], got {list(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache: must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache: must be on {q.device} (q's device), got {kv_cache.device}")
    if kv_cache.shape[1] % 64 != 0 or kv_cache.shape[1] == 0:
        raise ValueError(f"kv_cache: page_size (dim 1) must be a positive multiple of 64, got {kv_cache.shape[1]}")
    batch = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table: must be [{batch}, max_pages_per_seq >= 1], got {list(block_table.shape)}")
    if block_table.dtype != torch.int32 or block_table.device != q.device:
        raise ValueError(f"block_table: must be int32 on {q.device}, got {block_table.dtype} on {block_table.device}")
    _check_int32_vector("cache_seqlens", cache_seqlens, batch, q.device)
    if schedule is not None:
        if not isinstance(schedule, torch.Tensor) or schedule.dtype != torch.int32 or schedule.device != q.device:
            raise ValueError(f"schedule: must be the int32 tensor on {q.device} that hattn.mla_schedule returns")
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale: must be a finite number > 0, got {softmax_scale}")


def _mla_decode_fwd(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    schedule: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::mla_decode_fwd: (out [B, Sq, Hq, 512], lse [B, Hq, Sq] fp32, or empty when not return_lse)."""
    _check_mla_inputs(q, kv_cache, block_table, cache_seqlens, schedule, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, DIM_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    # The kernel reads rows of 16-byte pieces: q's and the cache's last dim contiguous, other strides aligned.
    if q.stride(-1) != 1 or any(s % 8 for s in q.stride()[:-1]) or q.data_ptr() % 16:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1 or kv_cache.stride(1) % 8 or kv_cache.stride(0) % 8 or kv_cache.data_ptr() % 16:
        kv_cache = kv_cache.contiguous()
    block_table = block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    # The checking mode: lengths within the pages, and the pages each request reads within the cache.
    _check_promises(seqlens_k=cache_seqlens, capacity=block_table.shape[1] * kv_cache.shape[1],
                    block_table=block_table, num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
                    seqlens_name="cache_seqlens")  # fmt: skip
    p = _C.MlaDecodeProblem()
    p.dtype = _DTYPES[q.dtype]
    p.batch, p.seqlen_q, p.heads_q = batch, seqlen_q, heads_q
    p.q, p.q_strides = q.data_ptr(), tuple(q.stride()[:3])
    p.kv_cache = kv_cache.data_ptr()
    p.page_stride, p.row_stride = kv_cache.stride(0), kv_cache.stride(1)
    p.num_pages, p.page_size = kv_cache.shape[0], kv_cache.shape[1]
    p.block_table, p.max_pages_per_seq = block_table.data_ptr(), block_table.shape[1]
    p.cache_seqlens = cache_seqlens.data_ptr()
    p.out, p.out_strides = out.data_ptr(), tuple(out.stride()[:3])
    p.lse = lse.data_ptr() if return_lse else 0
    p.softmax_scale = 0.0 if softmax_scale is None else float(softmax_scale)
    p.causal = bool(causal)
    p.check = False  # the checking mode ran above (_check_promises), with the Python names
    with torch.cuda.device(q.device):
        if schedule is not None:
            expected = _C.mla_schedule_ints(p)
            if schedule.numel() != expected:
                raise ValueError(f"schedule: has {schedule.numel()} entries, but this call's needs {expected}: make it "
                                 f"with hattn.mla_schedule(cache_seqlens, seqlen_q={seqlen_q}, heads_q={heads_q})")
            p.schedule = schedule.contiguous().data_ptr()
        _C.mla_decode(p, _current_stream(q.device), _scratch)
    return out, lse


mla_decode_fwd = torch.library.custom_op("hattn::mla_decode_fwd", mutates_args=())(_mla_decode_fwd)


@mla_decode_fwd.register_fake
def _mla_decode_fwd_fake(q, kv_cache, block_table, cache_seqlens, schedule, softmax_scale, causal, return_lse):
    _check_mla_inputs(q, kv_cache, block_table, cache_seqlens, schedule, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, DIM_V))
    lse = q.new_empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def mla_with_kvcache(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    schedule: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
):
    """MLA decoding over a paged latent cache.

    q [B, seqlen_q, heads_q, 576] (bf16 or fp16); kv_cache [num_pages, page_size, 1, 576] (q's dtype,
    page_size a multiple of 64); block_table int32 [B, max_pages_per_seq]: key j of request b is row
    j % page_size of page block_table[b, j // page_size]; cache_seqlens int32 [B]: keys per request,
    the new tokens' included. K is a cache row, V its first 512 columns. causal: new token i sits at
    key cache_seqlens[b] - seqlen_q + i and sees the keys up to it. softmax_scale: default
    1 / sqrt(576). schedule: from hattn.mla_schedule (made in the call when None).

    Returns out [B, seqlen_q, heads_q, 512] in q's dtype, and with return_lse (out, lse) with lse
    [B, heads_q, seqlen_q] fp32 (natural log; -inf for a row that sees no key, whose out is 0).
    Forward only: inputs that require grad raise NotImplementedError.
    """
    if _needs_grad(q, kv_cache):
        raise NotImplementedError(
            "hattn.mla_with_kvcache: forward only (decoding has no backward), but an input requires grad; call it "
            "under torch.no_grad() or pass detached tensors"
        )
    # Eager calls skip the dispatcher's tens of microseconds where that changes nothing (runner._call).
    out, lse = _call(mla_decode_fwd, _mla_decode_fwd, q, kv_cache, block_table, cache_seqlens, schedule, softmax_scale,
                     causal, return_lse)  # fmt: skip
    return (out, lse) if return_lse else out
