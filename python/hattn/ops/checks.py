"""The ops' checks: what a call's arguments must be, from shapes, dtypes and host values (the
fake implementations make the same checks, so torch.compile fails where the GPU would), the
layout the kernels take without a copy, and the checking mode's reads of the promises the
device arrays make."""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Tuple

import torch

from .. import _C


# The 16-bit input dtypes of attention(), attention_varlen() and attention_paged().
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# attention_fp8's inputs; its out is bf16.
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_OUT_DTYPE = torch.bfloat16
# Every input dtype the binding takes, by the name it takes it.
_KERNEL_DTYPE_NAMES = {**_DTYPE_NAMES, _FP8_DTYPE: "e4m3"}
_ARG_NAMES = ("q", "k", "v")
_PAGED_NAMES = ("q", "k_cache", "v_cache")

# The most parts num_splits may ask for (hattn::kMaxSplits).
_MAX_SPLITS = 64

# Kernel rows must be 16-byte aligned: 8 elements of a 2-byte dtype, 16 of FP8.
_ALIGN_BYTES = 16


@functools.lru_cache(maxsize=None)
def kernel_names() -> Tuple[str, ...]:
    """The registered kernels' names in lineage order (the last is what "auto" prefers)."""
    return tuple(name for name, _ in _C.kernels())


def _check_types(q, k, v, names=_ARG_NAMES, **more) -> None:
    # Before the op: its dispatcher would refuse a non-tensor with a less helpful message.
    for name, t in (*zip(names, (q, k, v)), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")


def _is_fp8_cache(q, k) -> bool:
    """k (and v) an e4m3 KV cache beside bf16/fp16 q."""
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and k.dtype == _FP8_DTYPE and (
        q.dtype in _DTYPE_NAMES
    )


def _check_inputs(
    q, k, v, kernel: str, varlen: bool = False, paged: bool = False, names=None, fp8: bool = False,
    kv_entries: bool = False, fp8_cache: bool = False,
) -> None:  # fmt: skip
    """Checks that need only shapes and dtypes (so they also run on fake and meta tensors).

    varlen: q, k, v are packed [total, heads, head_dim] rather than BSHD. paged: k and v are
    the pages of a cache, [num_pages, page_size, heads, head_dim]. kv_entries: k and v are a
    dense cache that kv_batch_idx indexes, whose batch need not be q's. names: what the messages
    call q, k and v (default: q, k, v; q, k_cache, v_cache when paged). fp8: q, k and v must
    be torch.float8_e4m3fn (attention_fp8) instead of bf16/fp16. fp8_cache: k and v may be
    torch.float8_e4m3fn beside bf16/fp16 q (an FP8 KV cache). The C++ library validates
    the rest (head_dim, sizes, strides, pointers, kernel support) and its messages name the
    argument too.
    """
    names = names or (_PAGED_NAMES if paged else _ARG_NAMES)
    kn, vn = names[1:]
    _check_types(q, k, v, names)
    for i, (name, t) in enumerate(zip(names, (q, k, v))):
        if varlen and t.dim() != 3:
            rows = "total_q" if i == 0 else "total_k"
            raise ValueError(
                f"{name}: must be 3-D [{rows}, heads, head_dim] (the sequences packed along dim 0), "
                f"got shape {tuple(t.shape)}"
            )
        if paged and i > 0 and t.dim() != 4:
            raise ValueError(
                f"{name}: must be 4-D [num_pages, page_size, heads_kv, head_dim] (a paged cache), "
                f"got shape {tuple(t.shape)}"
            )
        if not varlen and t.dim() != 4:
            raise ValueError(f"{name}: must be 4-D [batch, seqlen, heads, head_dim] (BSHD), got shape {tuple(t.shape)}")
        if fp8 and t.dtype != _FP8_DTYPE:
            raise ValueError(
                f"{name}: dtype must be torch.float8_e4m3fn (attention_fp8 takes FP8 q, k and v), got {t.dtype}"
            )
        cache_code = fp8_cache and i > 0 and t.dtype == _FP8_DTYPE and q.dtype in _DTYPE_NAMES
        if not fp8 and not cache_code and t.dtype not in _DTYPE_NAMES:
            hint = " (FP8 inputs: use hattn.attention_fp8)" if t.dtype == _FP8_DTYPE else ""
            raise ValueError(f"{name}: dtype must be torch.bfloat16 or torch.float16, got {t.dtype}{hint}")
    for name, t in ((kn, k), (vn, v)):
        if t.dtype != q.dtype and not (fp8_cache and t.dtype == _FP8_DTYPE):
            cache = " or torch.float8_e4m3fn (an FP8 KV cache)" if fp8_cache else ""
            raise ValueError(f"{name}: dtype {t.dtype} must match q's dtype {q.dtype}{cache}")
    if fp8_cache and k.dtype != v.dtype:
        raise ValueError(f"{vn}: dtype {v.dtype} must match {kn}'s dtype {k.dtype}")
    if v.shape != k.shape:
        if varlen:
            layout = "[total_k, heads_kv, head_dim]"
        elif paged:
            layout = "[num_pages, page_size, heads_kv, head_dim]"
        else:
            layout = "[batch, seqlen_k, heads_kv, head_dim]"
        raise ValueError(f"{vn}: shape {tuple(v.shape)} must equal {kn}'s shape {tuple(k.shape)} {layout}")
    if paged and (k.shape[0] < 1 or k.shape[1] < 1):
        raise ValueError(f"{kn}: num_pages and page_size (dims 0 and 1) must be >= 1, got shape {tuple(k.shape)}")
    if not varlen and not paged and not kv_entries and k.shape[0] != q.shape[0]:
        raise ValueError(f"{kn}: batch {k.shape[0]} must equal q's batch {q.shape[0]}")
    if kv_entries and k.shape[0] < 1:
        raise ValueError(f"{kn}: must have at least one batch entry (the entries kv_batch_idx indexes)")
    # Heads and head_dim are the last two dims in every layout.
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{kn}: head_dim {k.shape[-1]} must equal q's head_dim {q.shape[-1]}")
    if k.shape[-2] < 1 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(
            f"{kn}: q's heads ({q.shape[-2]}) must be a multiple of {kn}/{vn}'s heads ({k.shape[-2]}) (GQA/MQA)"
        )
    if kernel != "auto" and kernel not in kernel_names():
        raise ValueError(f"kernel: unknown kernel {kernel!r} (known: auto, {', '.join(kernel_names())})")


def _check_int32_tensor(name: str, t) -> None:
    """An int32 index tensor (offsets, lengths, page table): its type and dtype; the callers
    check its shape."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: dtype must be torch.int32, got {t.dtype}")


def _check_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """Shapes and dtypes of the offsets; their values are the caller's promise (reading them
    here would synchronize the host with the GPU)."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_int32_tensor(name, t)
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{name}: must be 1-D [batch + 1], got shape {tuple(t.shape)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_k: length {cu_seqlens_k.shape[0]} must equal cu_seqlens_q's length {cu_seqlens_q.shape[0]} "
            "(batch + 1)"
        )


def _check_max_seqlen(name: str, value) -> None:
    # An int or, under torch.compile, a SymInt; bool and tensors are refused (a tensor's value
    # would need a host synchronization).
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name}: must be an int (the longest sequence's length), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


def _check_seqlens_k(seqlens_k: torch.Tensor, batch: int, name: str = "seqlens_k") -> None:
    """Shape and dtype of the keys in use per sequence; the values stay on the GPU (clamped there)."""
    _check_int32_tensor(name, seqlens_k)
    if seqlens_k.dim() != 1 or seqlens_k.shape[0] != batch:
        raise ValueError(f"{name}: must be 1-D [batch] with q's batch {batch}, got shape {tuple(seqlens_k.shape)}")


def _check_block_table(block_table: torch.Tensor, batch: int, page_size: int, indexed: bool = False) -> None:
    """indexed: kv_batch_idx picks each sequence's row, so there may be any number of rows."""
    _check_int32_tensor("block_table", block_table)
    if indexed:
        if block_table.dim() != 2 or block_table.shape[0] < 1 or block_table.shape[1] < 1:
            raise ValueError(
                "block_table: must be 2-D [rows, max_pages_per_seq], both >= 1 (the rows kv_batch_idx picks from), "
                f"got shape {tuple(block_table.shape)}"
            )
    elif block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table: must be 2-D [batch, max_pages_per_seq] with q's batch {batch} and max_pages_per_seq >= 1, "
            f"got shape {tuple(block_table.shape)}"
        )
    # The kernel plans by max_pages_per_seq * page_size keys, an int on the C++ side.
    if block_table.shape[1] * page_size > 2**31 - 1:
        raise ValueError(
            f"block_table: max_pages_per_seq ({block_table.shape[1]}) * page_size ({page_size}) keys exceed 2^31 - 1"
        )


def _check_softcap(softcap) -> float:
    """softcap as a float: finite and >= 0 (0: off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: must be a float, got {type(softcap).__name__}")
    if not 0 <= softcap < math.inf:  # NaN fails both comparisons (comparisons also trace under torch.compile)
        raise ValueError(f"softcap: must be finite and >= 0 (0: off), got {softcap}")
    return float(softcap)


def _check_num_splits(num_splits) -> None:
    # An int or, under torch.compile, a SymInt, as max_seqlen.
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, torch.SymInt)):
        raise TypeError(f"num_splits: must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits: must be 0 (automatic), 1 (off) or up to {_MAX_SPLITS}, got {num_splits}")


def _check_paged_inputs(
    q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx=None, k_descale=None, v_descale=None,
) -> None:  # fmt: skip
    _check_inputs(q, k_cache, v_cache, kernel, paged=True, fp8_cache=True)
    _check_cache_descales(q, k_cache, k_descale, v_descale)
    _check_block_table(block_table, q.shape[0], k_cache.shape[1], indexed=kv_batch_idx is not None)
    _check_seqlens_k(seqlens_k, q.shape[0])
    if kv_batch_idx is not None:
        _check_seqlens_k(kv_batch_idx, q.shape[0], "kv_batch_idx")
    _check_num_splits(num_splits)


def _check_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names=_ARG_NAMES, **more: torch.Tensor) -> None:
    tensors = (*zip(names, (q, k, v)), *((name, t) for name, t in more.items() if t is not None))
    for name, t in tensors:
        if t.device.type != "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "hattn: no suitable GPU is present: torch sees no CUDA device, and hattn runs only on an "
                    f"NVIDIA Hopper GPU (sm_90, H100/H200); {name} is on {t.device}"
                )
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
    for name, t in tensors[1:]:
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")


def _kernel_layout_ok(t: torch.Tensor) -> bool:
    """True when the kernels can read `t` (BSHD, packed [total, H, D] or a cache's pages) in place (see the
    module docstring)."""
    if t.stride(-1) != 1 or t.data_ptr() % _ALIGN_BYTES != 0:
        return False
    align = _ALIGN_BYTES // t.element_size()  # in elements: 8 of bf16/fp16, 16 of FP8
    return all(
        size == 1 or (stride > 0 and stride % align == 0) for size, stride in zip(t.shape[:-1], t.stride()[:-1])
    )


def _as_kernel_input(t: torch.Tensor) -> torch.Tensor:
    # clone() rather than contiguous(): a contiguous tensor at a misaligned offset needs a copy too.
    return t if _kernel_layout_ok(t) else t.clone(memory_format=torch.contiguous_format)


def _end_address(t: torch.Tensor) -> int:
    """One past the last byte a strided tensor can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
    return t.data_ptr() + (last + 1) * t.element_size()


def _strides(t: torch.Tensor) -> Tuple[int, int, int]:
    """(batch, seq, head) element strides; a packed [total, H, D] tensor has no batch stride (unused: 0);
    a paged cache [num_pages, page_size, H, D] gives (page, row, head)."""
    if t.dim() == 3:
        return (0, t.stride(0), t.stride(1))
    return (t.stride(0), t.stride(1), t.stride(2))


def _window(window_size) -> Tuple[int, int]:
    """FlashAttention's window_size=(left, right), -1 for an open side, as two ints."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: must be a pair (left, right) of ints, got {window_size!r}") from None
    return left, right


def _check_attention_inputs(
    q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx=None, leftpad_k=None, k_descale=None, v_descale=None,
) -> None:  # fmt: skip
    _check_inputs(q, k, v, kernel, kv_entries=kv_batch_idx is not None, fp8_cache=True)
    _check_cache_descales(q, k, k_descale, v_descale)
    for name, t in (("seqlens_k", seqlens_k), ("kv_batch_idx", kv_batch_idx), ("leftpad_k", leftpad_k)):
        if t is not None:
            _check_seqlens_k(t, q.shape[0], name)
    _check_num_splits(num_splits)


_HEAD_DIMS = (64, 128, 256)
_FLT_MAX = 3.4028234663852886e38

# The checking mode: the promises the kernels take on trust (offsets, lengths, page and cache
# indices, descales live on the GPU and are never read on the host) are read back and checked
# before each launch, and a broken one raises ValueError naming the argument. Each check costs
# a device-to-host copy and its synchronization (tens of microseconds a call), so it is off by
# default: HATTN_CHECK=1 in the environment, or hattn.set_checking(True).
_CHECKING = os.environ.get("HATTN_CHECK", "0") not in ("", "0")


def set_checking(on: bool) -> None:
    """Turns the checking mode on or off (see HATTN_CHECK)."""
    global _CHECKING
    _CHECKING = bool(on)


def checking() -> bool:
    """Whether the checking mode is on."""
    return _CHECKING


def _broken(message: str) -> ValueError:
    return ValueError(f"invalid_argument: {message} (checking mode)")


def _check_offsets(name: str, cu: torch.Tensor, rows: int, max_name: str, longest: int) -> None:
    """cu_seqlens: from 0, never decreasing, within the tensor's rows; every length within max_seqlen."""
    c = cu.to("cpu", torch.int64)
    if int(c[0]) != 0:
        raise _broken(f"{name}: must start at 0, got {int(c[0])}")
    lengths = c[1:] - c[:-1]
    if (lengths < 0).any():
        i = int(torch.nonzero(lengths < 0)[0])
        raise _broken(f"{name}: must not decrease (entry {i + 1}: {int(c[i + 1])} after {int(c[i])})")
    if int(c[-1]) > rows:
        raise _broken(f"{name}: ends at {int(c[-1])}, past the tensor's {rows} rows")
    if lengths.numel() and int(lengths.max()) > longest:
        i = int(torch.argmax(lengths))
        raise _broken(f"{max_name}: {longest} is below sequence {i}'s length {int(lengths[i])}")


def _check_in_range(name: str, t: Optional[torch.Tensor], low: int, high: int, what: str) -> None:
    """Every entry of t in [low, high)."""
    if t is None or t.numel() == 0:
        return
    c = t.to("cpu", torch.int64)
    bad = (c < low) | (c >= high)
    if bad.any():
        i = tuple(int(x) for x in torch.nonzero(bad)[0])
        raise _broken(f"{name}: entry {i[0] if len(i) == 1 else i} is {int(c[i])}, outside [{low}, {high}) ({what})")


def _check_promises(*, varlen=None, totals=(0, 0), seqlens_k=None, capacity=None, block_table=None, num_pages=None,
                    page_size=None, kv_batch_idx=None, kv_batch=None, leftpad_k=None, descales=(),
                    seqlens_name="seqlens_k") -> None:  # fmt: skip
    """The checking mode's checks of one call (nothing when it is off). varlen: (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) with totals (total_q, total_k); capacity: the keys
    a sequence can have (a dense cache's Sk, a paged one's max_pages_per_seq * page_size). With
    page_size, block_table's checked entries are the pages each sequence uses (those holding its
    keys in use, in row kv_batch_idx[b] with cache entries), as the C++ checking mode checks them;
    without, every entry. seqlens_name: the caller's name for seqlens_k (MLA's cache_seqlens)."""
    if not _CHECKING:
        return
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        _check_offsets("cu_seqlens_q", cu_q, totals[0], "max_seqlen_q", max_q)
        _check_offsets("cu_seqlens_k", cu_k, totals[1], "max_seqlen_k", max_k)
    _check_in_range(seqlens_name, seqlens_k, 0, (capacity or 0) + 1, f"keys in use, at most the cache's {capacity}")
    _check_in_range("kv_batch_idx", kv_batch_idx, 0, kv_batch or 0, f"entries of a cache of {kv_batch}")
    if block_table is not None and page_size and seqlens_k is not None:
        table = block_table.to("cpu", torch.int64)
        used = seqlens_k.to("cpu", torch.int64).clamp(0, capacity or 0)
        rows = kv_batch_idx.to("cpu", torch.int64) if kv_batch_idx is not None else torch.arange(used.numel())
        for b in range(used.numel()):
            row = int(rows[b])
            pages = table[row, : (int(used[b]) + page_size - 1) // page_size]
            bad = (pages < 0) | (pages >= (num_pages or 0))
            if bad.any():
                j = int(torch.nonzero(bad)[0])
                raise _broken(f"block_table: entry ({row}, {j}) is {int(pages[j])}, outside [0, {num_pages}) "
                              f"(pages of a cache of {num_pages}; sequence {b} reads it)")  # fmt: skip
    else:
        _check_in_range("block_table", block_table, 0, num_pages or 0, f"pages of a cache of {num_pages}")
    if leftpad_k is not None:
        _check_in_range("leftpad_k", leftpad_k, 0, (capacity or 0) + 1, f"a first key within the cache's {capacity}")
        if seqlens_k is not None:
            over = leftpad_k.to("cpu", torch.int64) > seqlens_k.to("cpu", torch.int64)
            if over.any():
                b = int(torch.nonzero(over)[0])
                raise _broken(f"leftpad_k: sequence {b} starts at key {int(leftpad_k[b])}, past its "
                              f"{int(seqlens_k[b])} keys in use")  # fmt: skip
    for name, t in descales:
        if t is not None:
            c = t.to("cpu", torch.float32)
            bad = ~(torch.isfinite(c) & (c >= 0))  # 0 is fine: its rows weigh their keys alike
            if bad.any():
                i = tuple(int(x) for x in torch.nonzero(bad)[0])
                raise _broken(f"{name}: entry {i} is {float(c[i])}; descales must be finite and >= 0")


def _cache_features(seqlens_k, kv_batch_idx, leftpad_k) -> Tuple[str, ...]:
    """The KV-cache features a dense call uses, by their argument names."""
    return tuple(name for name, t in (("seqlens_k", seqlens_k), ("kv_batch_idx", kv_batch_idx),
                                      ("leftpad_k", leftpad_k)) if t is not None)  # fmt: skip


def _check_problem(
    q, kernel: str, causal: bool, softmax_scale, window=(-1, -1), softcap=0.0, features=(),
) -> None:  # fmt: skip
    """The library's checks that need only shapes and arguments, in Python, so that the fake (meta)
    implementations make them too and torch.compile fails where the GPU would: the head dim, the
    scale, the softcap, the window, and a named lineage kernel asked for a feature only the production
    forward has (or, from step 07 on, a scale <= 0). `features`: the names of the features the call
    uses beyond the window and softcap ("varlen", "seqlens_k", "kv_batch_idx", "leftpad_k", "fp8",
    "fp8_cache").
    The messages are the library's (ValueError for invalid arguments, NotImplementedError for what a
    kernel does not run)."""
    head_dim = q.shape[-1]
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"invalid_argument: head_dim: must be 64, 128 or 256 (got {head_dim})")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError("invalid_argument: softmax_scale: must be finite")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    if not 0 <= softcap < math.inf:  # NaN fails both comparisons
        raise ValueError(f"invalid_argument: softcap: must be finite and >= 0 (0: off), got {softcap:.6f}")
    if softcap > 0 and abs(scale) / softcap > _FLT_MAX:  # the kernels' tanh argument, s * scale / softcap
        raise ValueError(f"invalid_argument: softcap: {softcap:.6f} is too small for the softmax scale "
                         "(scale / softcap overflows fp32)")
    left, right = window
    if left < -1 or right < -1:
        side = "window_left" if left < -1 else "window_right"
        raise ValueError(f"invalid_argument: {side}: must be >= 0, or -1 for no edge (got {left if left < -1 else right})")
    if causal and right > 0:
        raise ValueError(
            f"invalid_argument: window_right: must be -1 or 0 with causal, whose right edge is the diagonal (got {right})"
        )
    production = kernel_names()[-1]
    if kernel in ("auto", production):
        why = None
        if "fp8_cache" in features and (left >= 0 or (right >= 0 and not causal)):
            why = f"{production}: an e4m3 KV cache (kv_dtype) runs without a sliding window (window_left / window_right)"
        if why is not None:
            raise NotImplementedError(why if kernel == production else f"kernel: no kernel supports this problem: {why}")
        return
    # The library's refusals, in its order (registry.h's supports()).
    refusals = [
        ((left, right) != (-1, -1), "no sliding window (window_left / window_right); the production forward {} has it"),
        ("varlen" in features,
         "no variable-length batch (cu_seqlens_q / cu_seqlens_k); the production forward {} has it"),
        ("seqlens_k" in features, "no seqlens_k or paged KV cache (block_table); the production forward {} has them"),
        ("kv_batch_idx" in features or "leftpad_k" in features,
         "no kv_batch_idx or leftpad_k (KV cache entries, left padding); the production forward {} has them"),
        (bool(softcap), "no softcap; the production forward {} has it"),
        ("fp8" in features, "no e4m3 (FP8) inputs; the production forward {} has them"),
        ("fp8_cache" in features, "no e4m3 KV cache (kv_dtype); the production forward {} has it"),
    ]  # fmt: skip
    for used, message in refusals:
        if used:
            raise NotImplementedError(f"{kernel}: " + message.format(production))
    # Steps 07 on take the running max on unscaled scores and fold the scale into the exponent.
    if kernel[:2].isdigit() and int(kernel[:2]) >= 7 and not scale > 0:
        raise NotImplementedError(f"{kernel}: softmax_scale must be > 0 (the running max is taken on unscaled scores); "
                                  f"got {scale:.6f}")


def _needs_grad(*tensors) -> bool:
    """True when autograd records a call on these tensors (grad mode on and one requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _check_deterministic(deterministic) -> None:
    """deterministic: a bool (the backward has a deterministic mode at every head dim, GQA too)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: must be a bool, got {type(deterministic).__name__}")


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel) -> None:
    _check_inputs(q, k, v, kernel, varlen=True)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)


def _varlen_empty(q, k, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """A variable-length batch with nothing to compute: no sequence, no query or no key in any."""
    return cu_seqlens_q.shape[0] == 1 or max_seqlen_q == 0 or max_seqlen_k == 0 or q.shape[0] == 0 or k.shape[0] == 0


# --- FP8 forward ------------------------------------------------------------------------------------

_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def _check_descales(q: torch.Tensor, k: torch.Tensor, descales) -> None:
    """Each of FP8's dequantization scales is None or fp32 [batch, Hkv] (shape and dtype only:
    they also run on fake tensors; _check_device checks the device)."""
    batch, heads_kv = q.shape[0], k.shape[2]
    for name, t in zip(_DESCALE_NAMES, descales):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be None or a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: dtype must be torch.float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] != batch or t.shape[1] != heads_kv:
            raise ValueError(
                f"{name}: shape must be (batch, heads_kv) = ({batch}, {heads_kv}), one scale per sequence and "
                f"K/V head, got {tuple(t.shape)}"
            )


def _check_cache_descales(q, k, k_descale, v_descale) -> None:
    """An FP8 KV cache's k_descale and v_descale: None or fp32 [batch, Hkv]; given only with one."""
    if not _is_fp8_cache(q, k):
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                raise ValueError(
                    f"{name}: dequantization scales are for an e4m3 KV cache (k and v torch.float8_e4m3fn), but k is "
                    f"{k.dtype}"
                )
        return
    _check_descales(q, k, (None, k_descale, v_descale))


def _cache_descale_features(q, k) -> Tuple[str, ...]:
    """("fp8_cache",) for an FP8 KV cache (_check_problem's feature), else nothing."""
    return ("fp8_cache",) if _is_fp8_cache(q, k) else ()


def _check_fp8_inputs(q, k, v, descales, kernel) -> None:
    _check_inputs(q, k, v, kernel, fp8=True)
    _check_descales(q, k, descales)
