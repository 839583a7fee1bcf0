"""The PyTorch ops: hattn::attention_fwd, hattn::attention_varlen_fwd,
hattn::attention_paged_fwd and hattn::attention_fp8_fwd over the raw-pointer binding
hattn._C.forward, and the backward ops hattn::attention_bwd and hattn::attention_varlen_bwd
(hattn._C.backward) behind the first two.

Layout rules (BSHD, [batch, seqlen, heads, head_dim]):
  * A q/k/v tensor is passed to the kernel as it is, without a copy, when its last dim is
    contiguous (stride 1), its data pointer is 16-byte aligned and every other stride is a
    positive multiple of 16 bytes (8 elements of bf16/fp16, 16 of FP8; dims of extent 1 are
    exempt). That covers contiguous tensors, transposed BHSD storage seen as BSHD, and slices
    of a packed qkv [B, S, 3, H, D].
  * Any other layout (last dim strided, odd strides, stride 0 from expand(), misaligned
    storage offset) is first copied to a contiguous tensor: correct, but one extra read and
    write of that input.
  * out is always allocated contiguous [B, Sq, Hq, D] in the input dtype (bf16 for FP8
    inputs); lse is contiguous fp32 [B, Hq, Sq] (an empty tensor when return_lse is False).

A variable-length batch (attention_varlen) packs the sequences along the rows: q and out are
[total_q, Hq, D], k and v [total_k, Hkv, D], and the same rules apply to the row and head
strides; lse is [Hq, total_q]. cu_seqlens_q and cu_seqlens_k are int32 [batch + 1] offsets on
the GPU (copied when not contiguous); only the kernel reads them.

A paged KV cache (attention_paged) holds the keys and values in pages: k_cache and v_cache are
[num_pages, page_size, Hkv, D], and the same rules apply to their page, row and head strides
(an odd layout copies the whole cache). block_table [batch, max_pages_per_seq] and seqlens_k
[batch] are int32 on the GPU (copied when not contiguous); only the kernel reads them, as it
reads attention's optional seqlens_k, kv_batch_idx and leftpad_k (a cache entry and a first
key per sequence) and attention_paged's kv_batch_idx (a block_table row per sequence).

The launch runs on torch.cuda.current_stream() of q's device, with no host synchronization, so
the op can be captured in a CUDA graph. The dense op with seqlens_k and the paged op remember
each checked launch by its tensors' layout (see _launch_key): a decoding loop's later calls
only fill in their pointers, which halves the host's time per call.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Tuple

import torch
import torch.autograd.profiler as _profiler  # _is_profiler_enabled: a plain module flag, set while one runs
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C

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


def _direct_call_ok(args) -> bool:
    """True when an op's Python body may run without the torch dispatcher around it: eager mode,
    no dispatch or torch-function mode, plain CUDA tensors and no gradient being recorded. The
    dispatcher's Python wrapper of a custom op costs tens of microseconds a call, as much as a
    decoding step's kernel; anything that needs the op itself (torch.compile, fake tensors,
    tensor subclasses, modes, autograd, a running torch.profiler, which then records the calls as
    hattn::... ops) still goes through it."""
    if _profiler._is_profiler_enabled or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor or not a.is_cuda or (grad and a.requires_grad)):
            return False
    return True


def _call(op, body, *args):
    """op(*args), or its body directly where that is the same (see _direct_call_ok)."""
    return body(*args) if _direct_call_ok(args) else op(*args)


def _check_types(q, k, v, names=_ARG_NAMES, **more) -> None:
    # Before the op: its dispatcher would refuse a non-tensor with a less helpful message.
    for name, t in (*zip(names, (q, k, v)), *more.items()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")


def _check_inputs(
    q, k, v, kernel: str, varlen: bool = False, paged: bool = False, names=None, fp8: bool = False,
    kv_entries: bool = False,
) -> None:  # fmt: skip
    """Checks that need only shapes and dtypes (so they also run on fake and meta tensors).

    varlen: q, k, v are packed [total, heads, head_dim] rather than BSHD. paged: k and v are
    the pages of a cache, [num_pages, page_size, heads, head_dim]. kv_entries: k and v are a
    dense cache that kv_batch_idx indexes, whose batch need not be q's. names: what the messages
    call q, k and v (default: q, k, v; q, k_cache, v_cache when paged). fp8: q, k and v must
    be torch.float8_e4m3fn (attention_fp8) instead of bf16/fp16. The C++ library validates
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
        if not fp8 and t.dtype not in _DTYPE_NAMES:
            hint = " (FP8 inputs: use hattn.attention_fp8)" if t.dtype == _FP8_DTYPE else ""
            raise ValueError(f"{name}: dtype must be torch.bfloat16 or torch.float16, got {t.dtype}{hint}")
    for name, t in ((kn, k), (vn, v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must match q's dtype {q.dtype}")
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


def _check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx=None) -> None:
    _check_inputs(q, k_cache, v_cache, kernel, paged=True)
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


def _problem_kwargs(
    q, k, v, out, lse, causal, softmax_scale, kernel, window=(-1, -1), varlen=None, *,
    seqlens_k=None, block_table=None, num_splits=0, descales=(None, None, None), kv_batch_idx=None, leftpad_k=None,
    softcap=0.0,
):  # fmt: skip
    """Keyword arguments of _C.forward / _C.resolve_kernel for these tensors.

    varlen: None for BSHD tensors, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for packed [total, H, D] ones. seqlens_k: None, or int32 [batch], the keys in use per
    sequence. block_table: None, or the int32 [batch, max_pages_per_seq] page table of a paged
    cache k, v [num_pages, page_size, Hkv, D]; seqlen_k is then max_pages_per_seq * page_size,
    the most keys a sequence can have (the kernel plans by it; seqlens_k is not read here).
    kv_batch_idx: None, or int32 [batch], each sequence's cache entry: a batch entry of k and
    v, or a row of block_table. leftpad_k: None, or int32 [batch], each sequence's first key.
    softcap: > 0 caps the scores at softcap * tanh(s / softcap); 0 leaves them as they are.
    descales: FP8's (q_descale, k_descale, v_descale), each None (scale 1) or a contiguous
    fp32 [batch, Hkv] tensor. The dtype is q's; FP8 q's out must be bf16 (the caller's).
    """
    heads_q, head_dim = q.shape[-2:]
    extra = {}
    if varlen is None:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    else:
        cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k = varlen
        batch = cu_seqlens_q.shape[0] - 1
        extra.update(
            cu_seqlens_q=cu_seqlens_q.data_ptr(),
            cu_seqlens_k=cu_seqlens_k.data_ptr(),
            total_q=q.shape[0],
            total_k=k.shape[0],
        )
    if seqlens_k is not None:
        extra.update(seqlens_k=seqlens_k.data_ptr())
    if kv_batch_idx is not None:
        entries = block_table.shape[0] if block_table is not None else k.shape[0]
        extra.update(kv_batch_idx=kv_batch_idx.data_ptr(), kv_batch=entries)
    if leftpad_k is not None:
        extra.update(leftpad_k=leftpad_k.data_ptr())
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is not None:
            extra[name] = t.data_ptr()
    if block_table is not None:
        num_pages, page_size = k.shape[0], k.shape[1]
        seqlen_k = block_table.shape[1] * page_size
        extra.update(
            block_table=block_table.data_ptr(),
            max_pages_per_seq=block_table.shape[1],
            num_pages=num_pages,
            page_size=page_size,
        )
    return dict(
        dtype=_KERNEL_DTYPE_NAMES[q.dtype],
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=k.shape[-2],
        head_dim=head_dim,
        q=q.data_ptr(),
        q_strides=_strides(q),
        k=k.data_ptr(),
        k_strides=_strides(k),
        v=v.data_ptr(),
        v_strides=_strides(v),
        out=out.data_ptr(),
        out_strides=_strides(out),
        lse=0 if lse is None else lse.data_ptr(),
        softmax_scale=softmax_scale,
        softcap=softcap,
        causal=causal,
        window_left=window[0],
        window_right=window[1],
        num_splits=num_splits,
        kernel=kernel,
        **extra,
    )


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    kernel: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
) -> None:
    """Runs a kernel into caller-provided `out` (and `lse`), without copies or allocation.

    Low level (the tests use it to poison outputs): q, k, v and out must already have a layout
    the kernels accept (stride 1 in the last dim, 16-byte aligned); lse, when given, is a
    contiguous fp32 [B, Hq, Sq] tensor. Not a torch op: torch.compile does not trace into it.
    """
    _check_inputs(q, k, v, kernel)
    _check_device(q, k, v)
    for name, t in (("out", out), ("lse", lse)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")
    if out.dtype != q.dtype or out.shape != q.shape:
        raise ValueError(f"out: must be {q.dtype} of q's shape {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    for name, t in zip(("q", "k", "v", "out"), (q, k, v, out)):
        if t.stride(3) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got stride {t.stride(3)}")
    if lse is not None:
        expected = (q.shape[0], q.shape[2], q.shape[1])
        if lse.dtype != torch.float32 or tuple(lse.shape) != expected or not lse.is_contiguous():
            raise ValueError(
                f"lse: must be a contiguous float32 tensor of shape {expected}, got {lse.dtype} {tuple(lse.shape)}"
            )
    window = _window(window_size)
    _forward(q, k, v, out, lse, causal, softmax_scale, kernel, window)


def _window(window_size) -> Tuple[int, int]:
    """FlashAttention's window_size=(left, right), -1 for an open side, as two ints."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: must be a pair (left, right) of ints, got {window_size!r}") from None
    return left, right


def _forward(q, k, v, out, lse, causal, softmax_scale, kernel, window=(-1, -1), varlen=None, remember=None, **extra):
    """Launches on q's current stream; extra: _problem_kwargs' seqlens_k, block_table, num_splits, descales,
    kv_batch_idx, leftpad_k, softcap.
    remember: a _launch_key under which to keep this call's arguments for _forward_again."""
    # The current device decides where the C++ side checks the GPU and launches.
    with torch.cuda.device(q.device):
        kwargs = _problem_kwargs(q, k, v, out, lse, causal, softmax_scale, kernel, window, varlen, **extra)
        # Split-KV's partial results and FP8's transposed V go to memory from torch's caching
        # allocator: stream-ordered like the launch, recorded by CUDA graph captures, and
        # counted in torch's memory stats.
        needed = _C.workspace_size(**kwargs)
        template = dict(kwargs) if remember is not None else None  # before _launch adds the workspace
        _launch(kwargs, needed, q.device)
    if remember is not None:  # after a launch that passed every check
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[remember] = (template, needed)


def _launch(kwargs, needed: int, device: torch.device) -> None:
    """_C.forward with a workspace of `needed` bytes from torch's allocator (none when 0)."""
    workspace = None
    if needed:
        workspace = torch.empty(needed, dtype=torch.uint8, device=device)
        kwargs.update(workspace=workspace.data_ptr(), workspace_bytes=needed)
    _C.forward(**kwargs, stream=_current_stream(device), scratch=_scratch)


def _scratch(nbytes: int) -> torch.Tensor:
    """_C's `scratch`: memory a call needs beside its tensors (the backward's fp32 sums, the sign-flipped
    q of a negative scale) from torch's caching allocator on the current device, used on the current
    stream: stream-ordered like the launch, recorded by CUDA graph captures, counted in torch's memory
    stats. _C keeps the tensor until the call has enqueued its work."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _current_stream(device: torch.device) -> int:
    """torch's current CUDA stream on `device` as an int (the raw query, without a Stream object)."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# --- calls that repeat a layout ------------------------------------------------------------------
#
# A decoding loop calls the same op on tensors of the same layout every step, where the checks
# and bookkeeping of a call cost the host more than the kernel takes on the GPU. A call that
# passed them and needed no copies keeps its _C.forward arguments and workspace size under its
# layout (_launch_key: shapes, strides, dtypes, devices, the pointers' 16-byte alignment, the
# flags); a later call with the same layout only puts in the new pointers (_forward_again). The
# C++ side still checks every call's pointers and device.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256


def _launch_key(flags: tuple, *tensors: Optional[torch.Tensor]) -> tuple:
    key = list(flags)
    for t in tensors:
        if t is None:
            key.append(None)
        else:
            key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % _ALIGN_BYTES)
    return tuple(key)


def _forward_again(remembered, q, k, v, out, lse, **pointers: Optional[torch.Tensor]) -> None:
    """_forward for a layout seen before: its arguments with the pointers of these tensors
    (pointers: seqlens_k, block_table, kv_batch_idx, leftpad_k when the problem has them)."""
    kwargs, needed = remembered
    kwargs = dict(kwargs, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                  lse=0 if lse is None else lse.data_ptr())  # fmt: skip
    for name, t in pointers.items():
        if t is not None:
            kwargs[name] = t.data_ptr()
    with torch.cuda.device(q.device):
        _launch(kwargs, needed, q.device)


def _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx=None, leftpad_k=None) -> None:
    _check_inputs(q, k, v, kernel, kv_entries=kv_batch_idx is not None)
    for name, t in (("seqlens_k", seqlens_k), ("kv_batch_idx", kv_batch_idx), ("leftpad_k", leftpad_k)):
        if t is not None:
            _check_seqlens_k(t, q.shape[0], name)
    _check_num_splits(num_splits)


_HEAD_DIMS = (64, 128, 256)

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
                    kv_batch_idx=None, kv_batch=None, leftpad_k=None, descales=()) -> None:
    """The checking mode's checks of one call (nothing when it is off). varlen: (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) with totals (total_q, total_k); capacity: the keys
    a sequence can have (a dense cache's Sk, a paged one's max_pages_per_seq * page_size)."""
    if not _CHECKING:
        return
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        _check_offsets("cu_seqlens_q", cu_q, totals[0], "max_seqlen_q", max_q)
        _check_offsets("cu_seqlens_k", cu_k, totals[1], "max_seqlen_k", max_k)
    _check_in_range("seqlens_k", seqlens_k, 0, (capacity or 0) + 1, f"keys in use, at most the cache's {capacity}")
    _check_in_range("block_table", block_table, 0, num_pages or 0, f"pages of a cache of {num_pages}")
    _check_in_range("kv_batch_idx", kv_batch_idx, 0, kv_batch or 0, f"entries of a cache of {kv_batch}")
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
            bad = ~(torch.isfinite(c) & (c > 0))
            if bad.any():
                i = tuple(int(x) for x in torch.nonzero(bad)[0])
                raise _broken(f"{name}: entry {i} is {float(c[i])}; descales must be finite and > 0")


def _cache_features(seqlens_k, kv_batch_idx, leftpad_k) -> Tuple[str, ...]:
    """The KV-cache features a dense call uses, by their argument names."""
    return tuple(name for name, t in (("seqlens_k", seqlens_k), ("kv_batch_idx", kv_batch_idx),
                                      ("leftpad_k", leftpad_k)) if t is not None)  # fmt: skip


def _check_problem(
    q, kernel: str, causal: bool, softmax_scale, window=(-1, -1), softcap=0.0, features=(),
) -> None:  # fmt: skip
    """The library's checks that need only shapes and arguments, in Python, so that the fake (meta)
    implementations make them too and torch.compile fails where the GPU would: the head dim, the
    scale, the window, and a named lineage kernel asked for a feature only the production forward
    has. `features`: the names of the features the call uses beyond the window and softcap
    (e.g. "seqlens_k"). The messages are the library's (ValueError for invalid arguments,
    NotImplementedError for what a kernel does not run)."""
    head_dim = q.shape[-1]
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"invalid_argument: head_dim: must be 64, 128 or 256 (got {head_dim})")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError("invalid_argument: softmax_scale: must be finite")
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
        return
    # The library's refusals, in its order (registry.h's supports()).
    refusals = [
        ((left, right) != (-1, -1), "no sliding window (window_left / window_right); the production forward {} has it"),
        ("seqlens_k" in features, "no seqlens_k or paged KV cache (block_table); the production forward {} has them"),
        ("kv_batch_idx" in features or "leftpad_k" in features,
         "no kv_batch_idx or leftpad_k (KV cache entries, left padding); the production forward {} has them"),
        (bool(softcap), "no softcap; the production forward {} has it"),
    ]  # fmt: skip
    for used, message in refusals:
        if used:
            raise NotImplementedError(f"{kernel}: " + message.format(production))


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_fwd: (out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32, or empty when not return_lse)."""
    key = _launch_key(
        ("fwd", causal, softmax_scale, kernel, return_lse, window_left, window_right, num_splits, softcap),
        q, k, v, seqlens_k, kv_batch_idx, leftpad_k,
    )  # fmt: skip
    remembered = _LAUNCHES.get(key)
    indices = {"seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx, "leftpad_k": leftpad_k}
    if remembered is None:
        _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx, leftpad_k)
        _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                       _cache_features(seqlens_k, kv_batch_idx, leftpad_k))  # fmt: skip
        _check_device(q, k, v, **indices)
        if not all(_kernel_layout_ok(t) for t in (q, k, v)) or not all(
            t is None or t.is_contiguous() for t in indices.values()
        ):
            key = None  # copies below: nothing to remember
        q, k, v = (_as_kernel_input(t) for t in (q, k, v))
        # The kernel reads plain int32 arrays.
        indices = {name: None if t is None else t.contiguous() for name, t in indices.items()}
    _check_promises(capacity=k.shape[1], kv_batch=k.shape[0], **indices)
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or k.shape[1] == 0:
        # Empty tensors, as torch's SDPA treats them: no batch or no queries give empty outputs;
        # no keys give out 0 and LSE -inf (no kernel runs).
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if remembered is not None:
        _forward_again(remembered, q, k, v, out, lse if return_lse else None, **indices)
        return out, lse
    _forward(
        q, k, v, out, lse if return_lse else None, causal, softmax_scale, kernel, (window_left, window_right),
        remember=key, num_splits=num_splits, softcap=softcap, **indices,
    )  # fmt: skip
    return out, lse


attention_fwd = torch.library.custom_op("hattn::attention_fwd", mutates_args=())(_attention_fwd)



def _bshd_outputs_like(
    q: torch.Tensor, return_lse: bool, out_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fake (meta) outputs of a BSHD op: out like q (in out_dtype, default q's), lse [B, Hq, Sq] fp32 or empty."""
    batch, seqlen_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape, dtype=out_dtype or q.dtype), lse

@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, causal, softmax_scale, kernel, return_lse, window_left=-1, window_right=-1, seqlens_k=None, num_splits=0,
    kv_batch_idx=None, leftpad_k=None, softcap=0.0,
):  # fmt: skip
    _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits, kv_batch_idx, leftpad_k)
    _check_problem(q, kernel, causal, softmax_scale, (window_left, window_right), softcap,
                   _cache_features(seqlens_k, kv_batch_idx, leftpad_k))  # fmt: skip
    return _bshd_outputs_like(q, return_lse)


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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hattn::attention_bwd: (dq, dk, dv) of hattn::attention_fwd's q, k, v given dL/d out, from the
    forward's out and lse (dense batches; dk and dv sum over a K/V head's query heads)."""
    _check_inputs(q, k, v, "auto")
    _check_device(q, k, v, out=out, lse=lse, dout=dout)
    if q.numel() == 0 or k.numel() == 0:  # empty tensors (see attention_fwd): every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, out, dout = (_as_kernel_input(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    with torch.cuda.device(q.device):
        kwargs = _problem_kwargs(
            q, k, v, out, lse, causal, softmax_scale, "auto", (window_left, window_right), softcap=softcap
        )  # fmt: skip
        grads = tuple(x for t in (dout, dq, dk, dv) for x in (t.data_ptr(), _strides(t)))
        _C.backward(**kwargs, grads=grads, stream=_current_stream(q.device), scratch=_scratch)
    return dq, dk, dv


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0):
    _check_inputs(q, k, v, "auto")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale, _kernel, return_lse, window_left, window_right, *cache = inputs
    seqlens_k, _splits, kv_batch_idx, leftpad_k, softcap = cache
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.window = causal, softmax_scale, (window_left, window_right)
    ctx.has_lse = return_lse
    ctx.has_cache = any(t is not None for t in (seqlens_k, kv_batch_idx, leftpad_k))
    ctx.softcap = softcap
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros


def _backward_needed(ctx, dout, dlse, entry: str) -> bool:
    """The checks both autograd backwards make first; False when out gets no gradient."""
    if dlse is not None:
        raise NotImplementedError("hattn: no gradient through the LSE output; use only out in the loss")
    if dout is None:
        return False
    if not ctx.has_lse:
        raise RuntimeError(
            f"hattn: the backward needs the forward's LSE: call hattn.{entry} (it keeps the LSE when a gradient "
            "is needed), or the op with return_lse=True"
        )
    return True


def _attention_fwd_backward(ctx, dout, dlse):
    if not _backward_needed(ctx, dout, dlse, "attention"):
        return (None,) * 14
    if ctx.has_cache:
        raise NotImplementedError("hattn: no backward with seqlens_k, kv_batch_idx or leftpad_k (a KV cache) yet")
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.hattn.attention_bwd(
        dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, *ctx.window, ctx.softcap
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 11


attention_fwd.register_autograd(_attention_fwd_backward, setup_context=_attention_fwd_setup_context)


def _needs_grad(*tensors) -> bool:
    """True when autograd records a call on these tensors (grad mode on and one requires grad)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


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
):
    """Forward attention O = softmax(scale * Q K^T + mask) V on BSHD tensors.

    Args:
        q: [B, Sq, Hq, D] CUDA tensor, torch.bfloat16 or torch.float16; D in {64, 128, 256}.
            (FP8 inputs with their descales go to attention_fp8; this refuses them.)
        k, v: [B, Sk, Hkv, D], same dtype and device; Hq % Hkv == 0 (GQA/MQA).
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
    indices = {"seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx, "leftpad_k": leftpad_k}
    _check_types(q, k, v, **{name: t for name, t in indices.items() if t is not None})
    _check_num_splits(num_splits)
    softcap = _check_softcap(softcap)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    left, right = _window(window_size)
    needs_grad = _needs_grad(q, k, v)
    out, lse = _call(
        attention_fwd, _attention_fwd,
        q, k, v, bool(causal), softmax_scale, kernel, bool(return_lse) or needs_grad, left, right, seqlens_k,
        num_splits, kv_batch_idx, leftpad_k, softcap,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel) -> None:
    _check_inputs(q, k, v, kernel, varlen=True)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)


def _varlen_empty(q, k, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int) -> bool:
    """A variable-length batch with nothing to compute: no sequence, no query or no key in any."""
    return cu_seqlens_q.shape[0] == 1 or max_seqlen_q == 0 or max_seqlen_k == 0 or q.shape[0] == 0 or k.shape[0] == 0


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_varlen_fwd: (out [total_q, Hq, D], lse [Hq, total_q] fp32, or empty when not return_lse)."""
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel)
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
    window_left=-1, window_right=-1, softcap=0.0,
):  # fmt: skip
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kernel)
    total_q, heads_q, head_dim = q.shape
    out = q.new_empty((total_q, heads_q, head_dim))
    lse = q.new_empty((heads_q, total_q) if return_lse else (0,), dtype=torch.float32)
    return out, lse


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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hattn::attention_varlen_bwd: (dq [total_q, Hq, D], dk, dv [total_k, Hkv, D]) of
    hattn::attention_varlen_fwd's q, k, v given dL/d out, from the forward's out and lse [Hq, total_q]
    (dk and dv sum over a K/V head's query heads; rows in no sequence get 0)."""
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "auto")
    _check_device(q, k, v, out=out, lse=lse, dout=dout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if _varlen_empty(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):  # see attention_varlen_fwd: every gradient is 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, out, dout = (_as_kernel_input(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    with torch.cuda.device(q.device):
        kwargs = _problem_kwargs(
            q, k, v, out, lse, causal, softmax_scale, "auto", (window_left, window_right), varlen, softcap=softcap
        )  # fmt: skip
        grads = tuple(x for t in (dout, dq, dk, dv) for x in (t.data_ptr(), _strides(t)))
        _C.backward(**kwargs, grads=grads, stream=_current_stream(q.device), scratch=_scratch)
    return dq, dk, dv


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
    window_left=-1, window_right=-1, softcap=0.0,
):  # fmt: skip
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "auto")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_varlen_fwd_setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, _kernel, return_lse,
     window_left, window_right, softcap) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
    ctx.causal, ctx.softmax_scale, ctx.window = causal, softmax_scale, (window_left, window_right)
    ctx.has_lse, ctx.softcap = return_lse, softcap
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros


def _attention_varlen_fwd_backward(ctx, dout, dlse):
    if not _backward_needed(ctx, dout, dlse, "attention_varlen"):
        return (None,) * 14
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.hattn.attention_varlen_bwd(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlen, ctx.causal, ctx.softmax_scale,
        *ctx.window, ctx.softcap,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 11


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
    out, lse = _call(
        attention_varlen_fwd, _attention_varlen_fwd,
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        bool(causal), softmax_scale, kernel, bool(return_lse) or needs_grad, left, right, softcap,
    )  # fmt: skip
    return (out, lse) if return_lse else out


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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::attention_paged_fwd: (out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32, or empty when not return_lse)."""
    key = _launch_key(
        ("paged", causal, softmax_scale, kernel, return_lse, window_left, window_right, num_splits, softcap),
        q, k_cache, v_cache, block_table, seqlens_k, kv_batch_idx,
    )  # fmt: skip
    remembered = _LAUNCHES.get(key)
    indices = {"block_table": block_table, "seqlens_k": seqlens_k, "kv_batch_idx": kv_batch_idx}
    if remembered is None:
        _check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx)
        _check_device(q, k_cache, v_cache, _PAGED_NAMES, **indices)
        if not all(_kernel_layout_ok(t) for t in (q, k_cache, v_cache)) or not all(
            t is None or t.is_contiguous() for t in indices.values()
        ):
            key = None  # copies below: nothing to remember
        q, k_cache, v_cache = (_as_kernel_input(t) for t in (q, k_cache, v_cache))
        # The kernel reads plain int32 arrays: block_table's rows max_pages_per_seq apart.
        indices = {name: None if t is None else t.contiguous() for name, t in indices.items()}
    _check_promises(capacity=block_table.shape[-1] * k_cache.shape[1], num_pages=k_cache.shape[0],
                    kv_batch=block_table.shape[0], **indices)  # fmt: skip
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty((batch, seqlen_q, heads_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32, device=q.device)
    if out.numel() == 0:  # no batch or no queries: empty outputs, no kernel
        return out, lse
    if remembered is not None:
        _forward_again(remembered, q, k_cache, v_cache, out, lse if return_lse else None, **indices)
        return out, lse
    _forward(
        q, k_cache, v_cache, out, lse if return_lse else None, causal, softmax_scale, kernel,
        (window_left, window_right), remember=key, num_splits=num_splits, softcap=softcap, **indices,
    )  # fmt: skip
    return out, lse


attention_paged_fwd = torch.library.custom_op("hattn::attention_paged_fwd", mutates_args=())(_attention_paged_fwd)


@attention_paged_fwd.register_fake
def _attention_paged_fwd_fake(
    q, k_cache, v_cache, block_table, seqlens_k, causal, softmax_scale, kernel, return_lse,
    window_left=-1, window_right=-1, num_splits=0, kv_batch_idx=None, softcap=0.0,
):  # fmt: skip
    _check_paged_inputs(q, k_cache, v_cache, block_table, seqlens_k, kernel, num_splits, kv_batch_idx)
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
):
    """Forward attention over a paged KV cache, as FlashAttention's flash_attn_with_kvcache and
    vLLM keep it: keys and values in fixed-size pages that a block table maps to each sequence.

    Args:
        q: [B, Sq, Hq, D] CUDA tensor, torch.bfloat16 or torch.float16; D in {64, 128, 256}.
        k_cache, v_cache: [num_pages, page_size, Hkv, D], same dtype and device; Hq % Hkv == 0
            (GQA/MQA). page_size must be a multiple of 128 (a K/V tile never spans two pages);
            other sizes raise NotImplementedError.
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
    if kv_batch_idx is not None:
        more["kv_batch_idx"] = kv_batch_idx
    _check_types(q, k_cache, v_cache, _PAGED_NAMES, **more)
    _check_num_splits(num_splits)
    softcap = _check_softcap(softcap)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    left, right = _window(window_size)
    out, lse = _call(
        attention_paged_fwd, _attention_paged_fwd,
        q, k_cache, v_cache, block_table, seqlens_k, bool(causal), softmax_scale, kernel, bool(return_lse),
        left, right, num_splits, kv_batch_idx, softcap,
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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """hattn::append_kv (hattn._C.append_kv, one kernel): writes k and v [B, n, Hkv, D] into the
    caches in place at keys seqlens[b] + i (rotated first with rotary_cos/rotary_sin, which
    are in q's dtype and contiguous), into cache entry kv_batch_idx[b] when given (a batch
    entry of a dense cache, or a row of block_table); returns (seqlens + n, int32 [B]; q
    rotated at its positions, or an empty tensor without rotary). The caller has checked the arguments
    (hattn.flash_attn_with_kvcache); the C++ side checks them again."""
    rotary = rotary_cos is not None
    seqlens_out = torch.empty_like(seqlens)
    q_rotated = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary else q.new_empty(0)
    # Remembered by layout like the attention's launches (_launch_key): a call of a layout seen
    # before only fills in its pointers.
    key = _launch_key(
        ("append", rotary_interleaved, q_positions_per_row),
        q, k_cache, v_cache, k, v, seqlens, block_table, rotary_cos, rotary_sin, kv_batch_idx,
    )  # fmt: skip
    layout = _LAUNCHES.get(key)
    if layout is None:
        # The kernel reads rows with a contiguous last dim (the caches' were checked).
        if k.stride(-1) != 1 or v.stride(-1) != 1 or (rotary and q.stride(-1) != 1):
            key = None  # copies: nothing to remember
            k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
            q = q if q.stride(-1) == 1 else q.contiguous()
        layout = dict(
            dtype=_DTYPE_NAMES[k_cache.dtype], batch=q.shape[0], seqlen_new=k.shape[1], heads_kv=k.shape[2],
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
    kv_batch_idx=None,
):  # fmt: skip
    q_rotated = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary_cos is not None else q.new_empty(0)
    return torch.empty_like(seqlens), q_rotated


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


def _check_fp8_inputs(q, k, v, descales, kernel) -> None:
    _check_inputs(q, k, v, kernel, fp8=True)
    _check_descales(q, k, descales)


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
        q: [B, Sq, Hq, D] CUDA tensor, torch.float8_e4m3fn; D in {64, 128}.
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
        NotImplementedError: what the FP8 path does not run (head_dim 256, a lineage
            kernel), or inputs that require grad: there is no FP8 backward, so rather than give
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


def resolve_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    kernel: str = "auto",
    window_size: Tuple[int, int] = (-1, -1),
    *,
    seqlens_k: Optional[torch.Tensor] = None,
    num_splits: int = 0,
) -> str:
    """The kernel that `kernel` ("auto" or a name) resolves to for these tensors (with
    attention()'s seqlens_k and num_splits); launches nothing.

    Raises NotImplementedError when no kernel (or not the named one) supports the problem.
    Needs no GPU.
    """
    _check_attention_inputs(q, k, v, kernel, seqlens_k, num_splits)
    q, k, v = (_as_kernel_input(t) for t in (q, k, v))
    # Resolution looks at shapes, not memory: q's pointer stands in for a contiguous output.
    batch, seqlen_q, heads_q, head_dim = q.shape
    out_strides = (seqlen_q * heads_q * head_dim, heads_q * head_dim, head_dim)
    window = _window(window_size)
    kwargs = _problem_kwargs(q, k, v, q, None, causal, None, kernel, window, seqlens_k=seqlens_k, num_splits=num_splits)
    # An address past every input's bytes (16-byte aligned, never dereferenced), so that the
    # check that an output shares no memory with the inputs passes as it would for a real out.
    kwargs["out"] = (max(_end_address(t) for t in (q, k, v)) + 15) // 16 * 16
    kwargs["out_strides"] = out_strides
    return _C.resolve_kernel(**kwargs)
