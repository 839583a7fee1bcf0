"""The runner under every op: a call's keyword arguments for hattn._C, the launch on torch's
current stream with scratch from torch's caching allocator, the launch cache for calls that
repeat a layout, and the eager call that skips the dispatcher where that changes nothing."""

from __future__ import annotations

import atexit
import copy
from typing import Optional, Tuple

import torch
import torch.autograd.profiler as _profiler  # _is_profiler_enabled: a plain module flag, set while one runs
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import _C
from .checks import (
    _ALIGN_BYTES, _ARG_NAMES, _KERNEL_DTYPE_NAMES, _as_kernel_input, _check_attention_inputs, _check_device,
    _check_inputs, _end_address, _kernel_layout_ok, _strides, _window,
)


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


def _problem_kwargs(
    q, k, v, out, lse, causal, softmax_scale, kernel, window=(-1, -1), varlen=None, *,
    seqlens_k=None, block_table=None, num_splits=0, descales=(None, None, None), kv_batch_idx=None, leftpad_k=None,
    softcap=0.0, k_descale=None, v_descale=None,
):  # fmt: skip
    """The fields of hattn._C.AttentionProblem for these tensors, and `kernel` (see _problem).

    varlen: None for BSHD tensors, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for packed [total, H, D] ones. seqlens_k: None, or int32 [batch], the keys in use per
    sequence. block_table: None, or the int32 [batch, max_pages_per_seq] page table of a paged
    cache k, v [num_pages, page_size, Hkv, D]; seqlen_k is then max_pages_per_seq * page_size,
    the most keys a sequence can have (the kernel plans by it; seqlens_k is not read here).
    kv_batch_idx: None, or int32 [batch], each sequence's cache entry: a batch entry of k and
    v, or a row of block_table. leftpad_k: None, or int32 [batch], each sequence's first key.
    softcap: > 0 caps the scores at softcap * tanh(s / softcap); 0 leaves them as they are.
    descales: FP8's (q_descale, k_descale, v_descale), each None (scale 1) or a contiguous
    fp32 [batch, Hkv] tensor. The dtype is q's; FP8 q's out must be bf16 (the caller's). k and v
    in e4m3 beside bf16/fp16 q are an FP8 KV cache (kv_dtype), whose k_descale and v_descale
    come by name (the launch cache's pointers, like the int32 arrays).
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
    if k_descale is not None or v_descale is not None:  # an FP8 KV cache's, passed by name
        descales = (None, k_descale, v_descale)
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        if t is not None:
            extra[name] = t.data_ptr()
    if k.dtype != q.dtype:  # an FP8 KV cache: e4m3 k and v beside bf16/fp16 q
        extra["kv_dtype"] = _KERNEL_DTYPE_NAMES[k.dtype]
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


def _problem(fields: dict) -> Tuple["_C.AttentionProblem", str]:
    """hattn._C.AttentionProblem with these fields (_problem_kwargs'), and the kernel named by the
    `kernel` entry ("auto" without one), which is the call's, not the problem's."""
    problem = _C.AttentionProblem()
    kernel = "auto"
    for name, value in fields.items():
        if name == "kernel":
            kernel = value
        else:
            setattr(problem, name, value)
    return problem, kernel


def _backward_problem(problem: "_C.AttentionProblem", dout, dq, dk, dv) -> "_C.BackwardProblem":
    """hattn._C.BackwardProblem: the forward `problem` and the gradients' tensors."""
    grads = _C.BackwardProblem()
    grads.forward = problem
    for name, t in (("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        setattr(grads, name, t.data_ptr())
        setattr(grads, f"{name}_strides", _strides(t))
    return grads


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


def _forward(q, k, v, out, lse, causal, softmax_scale, kernel, window=(-1, -1), varlen=None, remember=None, **extra):
    """Plans and runs on q's current stream; extra: _problem_kwargs' seqlens_k, block_table, num_splits, descales,
    kv_batch_idx, leftpad_k, softcap.
    remember: a _launch_key under which to keep this call's plan for _forward_again."""
    # The current device decides where the C++ side checks the GPU, plans and launches.
    with torch.cuda.device(q.device):
        problem, kernel = _problem(_problem_kwargs(q, k, v, out, lse, causal, softmax_scale, kernel, window, varlen,
                                                   **extra))  # fmt: skip
        plan = _C.plan(problem, kernel)
        buffers = _C.buffers_of(problem)
        template = copy.copy(buffers) if remember is not None else None  # before _run adds the workspace
        _run(plan, buffers, q.device)
    if remember is not None:  # after a run that passed every check
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[remember] = (plan, template)


def _backward(dout, q, k, v, out, lse, causal, softmax_scale, window, varlen=None, softcap=0.0, deterministic=False):
    """(dq, dk, dv) from _C.backward on q's current stream, the inputs in a layout the kernels take;
    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for a variable-length batch."""
    q, k, v, out, dout = (_as_kernel_input(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    with torch.cuda.device(q.device):
        problem, _ = _problem(_problem_kwargs(q, k, v, out, lse, causal, softmax_scale, "auto", window, varlen,
                                              softcap=softcap))  # fmt: skip
        grads = _backward_problem(problem, dout, dq, dk, dv)
        grads.deterministic = bool(deterministic)
        _C.backward(grads, "auto", _current_stream(q.device), _scratch, False)  # checks: checks._check_promises
    return dq, dk, dv


def _run(plan, buffers, device: torch.device) -> None:
    """_C.run with a workspace of the plan's bytes from torch's allocator (none when 0)."""
    # Split-KV's partial results and FP8's transposed V go to memory from torch's caching
    # allocator: stream-ordered like the launch, recorded by CUDA graph captures, and counted
    # in torch's memory stats.
    needed = plan.workspace_bytes
    workspace = None
    if needed:
        workspace = torch.empty(needed, dtype=torch.uint8, device=device)
        buffers.workspace, buffers.workspace_bytes = workspace.data_ptr(), needed
    _C.run(plan, buffers, _current_stream(device), _scratch, False)  # checks: checks._check_promises


def _scratch(nbytes: int, stream: int) -> torch.Tensor:
    """_C's `scratch`: memory a call needs beside its tensors (the backward's fp32 sums, the sign-flipped
    q of a negative scale) from torch's caching allocator on the current device, for the call's
    `stream` (torch's current one, as the ops launch; another is taken as an external stream): stream-
    ordered like the launch, recorded by CUDA graph captures, counted in torch's memory stats. _C keeps
    the tensor until the call has enqueued its work."""
    device = torch.cuda.current_device()
    if stream == _current_stream(torch.device("cuda", device)):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


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
# passed them and needed no copies keeps its _C.Plan (the checks of the problem, the kernel and its
# decisions, made once) and _C.Buffers under its layout (_launch_key: shapes, strides, dtypes,
# devices, the pointers' 16-byte alignment, the flags); a later call with the same layout only
# puts in the new pointers (_forward_again) and runs the plan. The C++ side still checks every
# call's pointers and device.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256
# Emptied at exit, before the extension is torn down: nanobind reports the problems a module
# global still holds then as leaks ("nanobind: leaked N instances!" after any program that ran
# an op).
atexit.register(_LAUNCHES.clear)


def _launch_key(flags: tuple, *tensors: Optional[torch.Tensor]) -> tuple:
    key = list(flags)
    for t in tensors:
        if t is None:
            key.append(None)
        else:
            key += (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % _ALIGN_BYTES)
    return tuple(key)


def _layout_checked(key: tuple, check, q, k, v, indices: dict, names=_ARG_NAMES):
    """A call's inputs ready for the kernels, and what the launch cache knows of their layout: the
    remembered launch under `key`, or (new layout) the op's argument checks `check()`, the device
    checks, and q, k, v and the int32 arrays `indices` in a layout the kernels read (copies where
    needed; then nothing is remembered: key None). Returns (remembered, key, q, k, v, indices)."""
    remembered = _LAUNCHES.get(key)
    if remembered is None:
        check()
        _check_device(q, k, v, names, **indices)
        if not all(_kernel_layout_ok(t) for t in (q, k, v)) or not all(
            t is None or t.is_contiguous() for t in indices.values()
        ):
            key = None  # copies below: nothing to remember
        q, k, v = (_as_kernel_input(t) for t in (q, k, v))
        # The kernel reads plain int32 arrays (a block table's rows max_pages_per_seq apart).
        indices = {name: None if t is None else t.contiguous() for name, t in indices.items()}
    return remembered, key, q, k, v, indices


def _launch_layout(remembered, key, q, k, v, out, lse, causal, softmax_scale, kernel, window, indices: dict,
                   **extra) -> None:
    """_forward_again for a remembered layout, else _forward, remembering it under `key`; extra:
    num_splits, softcap."""
    if remembered is not None:
        _forward_again(remembered, q, k, v, out, lse, **indices)
    else:
        _forward(q, k, v, out, lse, causal, softmax_scale, kernel, window, remember=key, **extra, **indices)


def _forward_again(remembered, q, k, v, out, lse, **pointers: Optional[torch.Tensor]) -> None:
    """_forward for a layout seen before: its plan run on these tensors' buffers (pointers:
    seqlens_k, block_table, kv_batch_idx, leftpad_k when the problem has them)."""
    plan, template = remembered
    buffers = copy.copy(template)  # the template stays as it is for the next call (and other threads)
    buffers.q, buffers.k, buffers.v, buffers.out = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    buffers.lse = 0 if lse is None else lse.data_ptr()
    for name, t in pointers.items():
        if t is not None:
            setattr(buffers, name, t.data_ptr())
    with torch.cuda.device(q.device):
        _run(plan, buffers, q.device)


def _bshd_outputs_like(
    q: torch.Tensor, return_lse: bool, out_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fake (meta) outputs of a BSHD op: out like q (in out_dtype, default q's), lse [B, Hq, Sq] fp32 or empty."""
    batch, seqlen_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen_q) if return_lse else (0,), dtype=torch.float32)
    return q.new_empty(q.shape, dtype=out_dtype or q.dtype), lse


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
    return _C.resolve_kernel(*_problem(kwargs))
