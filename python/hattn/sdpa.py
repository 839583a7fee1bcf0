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

A call hattn runs is differentiable: when query, key or value requires grad, backward gives
their gradients through hattn's backward (hattn.attention's). By default its fp32 sums use
atomic adds, so the gradients may differ in their last bits from run to run; under
torch.use_deterministic_algorithms it runs hattn.attention's deterministic=True instead, whose
gradients are bitwise the same from run to run.

The output is a [B, H, L, E] view of a [B, L, H, E] tensor, as torch's own flash and cuDNN
backends return it, so `out.transpose(1, 2).reshape(B, L, H * E)` needs no copy.

With torch 2.10 or newer, hattn is also a flash-attention implementation in torch's registry
(torch.nn.attention.register_flash_attention_impl), registered as "hattn" when hattn is imported:

    import hattn
    torch.nn.attention.activate_flash_attention_impl("hattn")   # the user's choice, never hattn's
    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # runs hattn
    torch.nn.attention.restore_flash_attention_impl()           # torch's FlashAttention-2 again

Activation puts hattn's kernels in torch's dispatcher in place of the CUDA kernels of the four
ops of SDPA's flash backend (aten._scaled_dot_product_flash_attention, its _backward, and
aten._flash_attention_forward / _backward, which torch's varlen_attn and nested tensors call).
Only calls that torch sends to its flash backend reach them; flash_fallback_reason says which of
those hattn hands back to torch's own flash kernel (taken before the override). See
register_flash_impl and python/README.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import warnings
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from .ops import attention, attention_bwd
from .ops.checks import _DTYPE_NAMES, _as_kernel_input, _kernel_layout_ok, _needs_grad
from .ops.runner import _forward

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
    """Why scaled_dot_product_attention would hand this call ([B, H, L, E] tensors) to torch's SDPA;
    None if hattn runs it.

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
    # Under torch.use_deterministic_algorithms the backward runs in a fixed order (the forward has one anyway).
    deterministic = torch.are_deterministic_algorithms_enabled() and _needs_grad(query, key, value)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=is_causal,
                    softmax_scale=scale, deterministic=deterministic)
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


# --- hattn as a flash-attention implementation in torch's registry (torch >= 2.10) -------------------
#
# torch.nn.attention keeps a registry of flash-attention implementations: a provider registers a
# function under a name, and torch.nn.attention.activate_flash_attention_impl(name) calls it. That
# function puts the provider's kernels in the dispatcher in place of torch's CUDA kernels of the
# flash backend's ops and returns a handle whose remove() takes them out again
# (torch.nn.attention.restore_flash_attention_impl calls it). torch's FA3 and FA4 providers
# (torch/nn/attention/_fa3.py, _fa4.py) override the same four ops as hattn does below.
#
# SDPA's flash path runs aten._scaled_dot_product_flash_attention ([B, H, L, E] tensors), whose
# autograd formula calls aten._scaled_dot_product_flash_attention_backward; torch's CUDA kernels of
# the two transpose to [B, L, H, E] and call aten._flash_attention_forward / _backward, which
# torch.nn.attention.varlen and nested tensors call directly. hattn overrides all four, so a call
# reaches it whichever entry it comes in by, and a call hattn hands back at the upper level meets
# the same rules at the lower one. A call hattn does not run goes to torch's own kernel for that op
# and dispatch key, taken with torch.library.get_kernel before the override.
#
# The semantics are those of torch's flash kernels (FlashAttention-2), which hattn's match: a
# causal mask aligned to the bottom-right corner at every level (SDPA sends flash no causal call
# with L != S), GQA when the query heads are a multiple of the K/V heads, FlashAttention's
# window (a negative side is open; causal makes the right side 0), and the row log-sum-exp as fp32
# [B, Hq, Lq] in natural log of the scaled scores. The backward decides by the same rules as the
# forward, from the same arguments; the LSE of either forward serves either backward.

FLASH_IMPL = "hattn"  # the name in torch's registry

_FLASH_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
)

# Calls of the overridden ops since import, by who ran them: "hattn_forward", "hattn_backward",
# "torch_forward", "torch_backward". A call hattn hands back at the SDPA level counts once there
# and once at the level below, where torch's kernel calls _flash_attention_forward / _backward.
_CALLS: collections.Counter = collections.Counter()


def flash_impl_calls() -> Dict[str, int]:
    """How many calls of the overridden flash ops hattn ran and handed to torch since import.

    Keys "hattn_forward", "hattn_backward", "torch_forward", "torch_backward". Counted only while
    the implementation is active (torch.nn.attention.activate_flash_attention_impl("hattn")).
    """
    return {key: _CALLS[key] for key in ("hattn_forward", "hattn_backward", "torch_forward", "torch_backward")}


def flash_fallback_reason(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    *,
    return_debug_mask: bool = False,
    scale: Optional[float] = None,
    cum_seq_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    check_device: bool = True,
) -> Optional[str]:
    """Why the active "hattn" flash implementation hands a call to torch's flash kernel; None if hattn runs it.

    query, key, value are [B, L, H, E], as aten._flash_attention_forward takes them (the SDPA-level
    op's [B, H, L, E] tensors transposed). The rules are scaled_dot_product_attention's
    (sdpa_fallback_reason), with GQA always allowed and no rule on causal L != S (at this level
    torch's causal mask is bottom-right aligned, as hattn's), plus those of the op's extra
    arguments: no varlen batch (cum_seq_q), no seqused_k, no ALiBi, no debug mask, a finite scale.
    Under torch.use_deterministic_algorithms the backward runs hattn's deterministic backward.
    check_device=False skips the device rule.
    """
    if cum_seq_q is not None:
        return "a variable-length batch (cum_seq_q); hattn's flash implementation runs dense batches"
    if seqused_k is not None:
        return "seqused_k is given; hattn's flash implementation takes every key"
    if alibi_slopes is not None:
        return "alibi_slopes is given; hattn has no ALiBi"
    if return_debug_mask:
        return "return_debug_mask is set; hattn returns no attention probabilities"
    if scale is not None and not math.isfinite(scale):
        return f"scale is {scale}; hattn takes a finite scale"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D; hattn takes 4-D [B, L, H, E]"
    return sdpa_fallback_reason(*_transposed(query, key, value), None, dropout_p, False, True, check_device)


def _transposed(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """[B, H, L, E] <-> [B, L, H, E] views (SDPA's layout and the flash kernels')."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _backward_reason(query, key, value, dropout_p, scale, cum_seq_q) -> Optional[str]:
    """Why the backward of a [B, L, H, E] call goes to torch: the forward's rules."""
    if query.dim() != 4:
        return f"query is {query.dim()}-D; hattn takes 4-D [B, L, H, E]"
    return flash_fallback_reason(query, key, value, dropout_p, scale=scale, cum_seq_q=cum_seq_q)


def _flash_window(is_causal: bool, left: Optional[int], right: Optional[int]) -> Tuple[int, int]:
    """FlashAttention-2's window (None or a negative value: that side open; causal: right side 0) as hattn's."""
    left = -1 if left is None or left < 0 else int(left)
    right = 0 if is_causal else -1 if right is None or right < 0 else int(right)
    return left, right


def _run_hattn_forward(q, k, v, out, causal, scale, window) -> torch.Tensor:
    """hattn's forward of [B, L, H, E] q, k, v into out (a [B, L, H, E] view of any layout); returns
    the LSE, fp32 [B, Hq, Lq]. Inputs the kernels cannot read in place are copied, as by hattn.attention."""
    batch, seqlen_q, heads_q, _ = q.shape
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    q, k, v = (_as_kernel_input(t) for t in (q, k, v))
    target = out if _kernel_layout_ok(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    _forward(q, k, v, target, lse, causal, scale, "auto", window)
    if target is not out:
        out.copy_(target)
    return lse


def _run_hattn_backward(dout, q, k, v, out, lse, causal, scale, window) -> Tuple[torch.Tensor, ...]:
    """(dq, dk, dv), contiguous [B, L, H, E], of [B, L, H, E] tensors: the op hattn::attention_bwd,
    hattn.attention's backward; its deterministic one under torch.use_deterministic_algorithms."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    return attention_bwd(dout, q, k, v, out, lse, causal, scale, *window, deterministic=deterministic)


def _laid_out_like(grads, inputs) -> Tuple[torch.Tensor, ...]:
    """Each gradient with the strides of empty_like(its input), as torch's flash kernels and their
    meta functions give it (torch.compile's code checks them): as it is where they already match
    (inputs that are [B, L, H, E] storage, as a projection's views are), else copied."""
    laid_out = []
    for g, t in zip(grads, inputs):
        if g.stride() != torch.empty_like(t, device="meta").stride():
            g = torch.empty_like(t).copy_(g)
        laid_out.append(g)
    return tuple(laid_out)


def _no_dropout_outputs(query: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's rng_state, unused and debug_attn_mask outputs without dropout, shaped and typed as
    torch's meta functions give them (torch/_meta_registrations.py)."""
    rng_state = torch.empty((2,), dtype=torch.uint64, device=query.device)
    unused = torch.empty((), dtype=torch.uint64, device=query.device)
    return rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


class _FlashImpl:
    """An active "hattn" flash implementation: hattn's kernels for _FLASH_OPS on one dispatch key,
    and torch's kernels they hand calls to. remove() takes hattn's out of the dispatcher.

    dispatch_key and torch_kernels are for the CPU tests, which put stand-ins on "CPU"; activation
    takes "CUDA" and torch's kernels as get_kernel finds them before the override.
    """

    def __init__(self, dispatch_key: str = "CUDA", torch_kernels: Optional[dict] = None) -> None:
        if torch_kernels is None:
            torch_kernels = {name: torch.library.get_kernel(f"aten::{name}", dispatch_key) for name in _FLASH_OPS}
        self.torch_kernels = torch_kernels
        self.library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (an aten op's kernel, on purpose)
        kernels = (self._sdpa_forward, self._sdpa_backward, self._flash_forward, self._flash_backward)
        with warnings.catch_warnings():
            # The dispatcher's "Overriding a previously registered kernel": here that is the point.
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for name, kernel in zip(_FLASH_OPS, kernels):
                self.library.impl(name, kernel, dispatch_key, with_keyset=True)

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None

    def _torch(self, name: str, counter: str, keyset, *args, **kwargs):
        _CALLS[counter] += 1
        return self.torch_kernels[name].call_boxed(keyset, *args, **kwargs)

    # aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0.,
    #     bool is_causal=False, bool return_debug_mask=False, *, float? scale=None)
    #   -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
    #       Tensor rng_state, Tensor unused, Tensor debug_attn_mask)
    def _sdpa_forward(self, keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                      scale=None):  # fmt: skip
        if query.dim() != 4 or flash_fallback_reason(
            *_transposed(query, key, value), dropout_p, return_debug_mask=return_debug_mask, scale=scale
        ) is not None:  # fmt: skip
            return self._torch(_FLASH_OPS[0], "torch_forward", keyset, query, key, value, dropout_p, is_causal,
                               return_debug_mask, scale=scale)  # fmt: skip
        _CALLS["hattn_forward"] += 1
        out = torch.empty_like(query)  # [B, H, L, E] with query's strides, as torch's kernel and meta give it
        lse = _run_hattn_forward(*_transposed(query, key, value, out), is_causal, scale,
                                 _flash_window(is_causal, None, None))  # fmt: skip
        return (out, lse, None, None, query.shape[2], key.shape[2], *_no_dropout_outputs(query))

    # aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value,
    #     Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
    #     float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset, *, float? scale=None)
    #   -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)
    def _sdpa_backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):  # fmt: skip
        why = _backward_reason(*_transposed(query, key, value), dropout_p, scale, cum_seq_q)
        if why is not None:
            return self._torch(_FLASH_OPS[1], "torch_backward", keyset, grad_out, query, key, value, out, logsumexp,
                               cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                               scale=scale)  # fmt: skip
        _CALLS["hattn_backward"] += 1
        grads = _run_hattn_backward(*_transposed(grad_out, query, key, value, out), logsumexp, is_causal, scale,
                                    _flash_window(is_causal, None, None))  # fmt: skip
        return _laid_out_like(_transposed(*grads), (query, key, value))

    # aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, Tensor? cum_seq_k,
    #     SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, bool return_debug_mask, *, float? scale=None,
    #     SymInt? window_size_left=None, SymInt? window_size_right=None, Tensor? seqused_k=None,
    #     Tensor? alibi_slopes=None)
    #   -> (Tensor output, Tensor softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)
    def _flash_forward(self, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                       return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None,
                       alibi_slopes=None):  # fmt: skip
        if flash_fallback_reason(query, key, value, dropout_p, return_debug_mask=return_debug_mask, scale=scale,
                                 cum_seq_q=cum_seq_q, seqused_k=seqused_k, alibi_slopes=alibi_slopes) is not None:
            return self._torch(_FLASH_OPS[2], "torch_forward", keyset, query, key, value, cum_seq_q, cum_seq_k, max_q,
                               max_k, dropout_p, is_causal, return_debug_mask, scale=scale,
                               window_size_left=window_size_left, window_size_right=window_size_right,
                               seqused_k=seqused_k, alibi_slopes=alibi_slopes)  # fmt: skip
        _CALLS["hattn_forward"] += 1
        out = torch.empty_like(query)  # [B, L, H, E] with query's strides, as torch's kernel and meta give it
        lse = _run_hattn_forward(query, key, value, out, is_causal, scale,
                                 _flash_window(is_causal, window_size_left, window_size_right))  # fmt: skip
        return (out, lse, *_no_dropout_outputs(query))

    # aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out,
    #     Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p,
    #     bool is_causal, Tensor rng_state, Tensor unused, *, float? scale=None, SymInt? window_size_left=None,
    #     SymInt? window_size_right=None)
    #   -> (Tensor, Tensor, Tensor)
    def _flash_backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                        dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                        window_size_right=None):  # fmt: skip
        why = _backward_reason(query, key, value, dropout_p, scale, cum_seq_q)
        if why is not None:
            return self._torch(_FLASH_OPS[3], "torch_backward", keyset, grad_out, query, key, value, out, logsumexp,
                               cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused,
                               scale=scale, window_size_left=window_size_left,
                               window_size_right=window_size_right)  # fmt: skip
        _CALLS["hattn_backward"] += 1
        grads = _run_hattn_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                                    _flash_window(is_causal, window_size_left, window_size_right))  # fmt: skip
        return _laid_out_like(grads, (query, key, value))


def _activate() -> _FlashImpl:
    """The register_fn of "hattn": torch.nn.attention.activate_flash_attention_impl("hattn") calls it,
    and torch's registry keeps the handle until restore_flash_attention_impl() calls its remove()."""
    return _FlashImpl()


def _torch_registry():
    """torch.nn.attention where it has the flash-attention registry and torch.library.get_kernel; else None."""
    try:
        import torch.nn.attention as attention
    except ImportError:  # pragma: no cover (torch < 2.2)
        return None
    if not hasattr(attention, "register_flash_attention_impl") or not hasattr(torch.library, "get_kernel"):
        return None
    return attention


def register_flash_impl() -> bool:
    """Registers hattn as flash-attention implementation "hattn" in torch's registry; False where torch has none.

    `import hattn` calls it; a second call changes nothing. Registering only names hattn in
    torch.nn.attention.list_flash_attention_impls(): nothing in the dispatcher changes until the
    user calls torch.nn.attention.activate_flash_attention_impl("hattn"), and
    torch.nn.attention.restore_flash_attention_impl() (torch >= 2.11) puts torch's kernels back.
    torch's registry and torch.library.get_kernel came with torch 2.10 (get_kernel with 2.9);
    older torch keeps hattn.patch_sdpa.
    """
    attention = _torch_registry()
    if attention is None:
        return False
    if FLASH_IMPL not in attention.list_flash_attention_impls():
        attention.register_flash_attention_impl(FLASH_IMPL, register_fn=_activate)
    return True


register_flash_impl()
