"""hattn as an attention backend of diffusers' attention dispatcher.

diffusers chooses the attention its models run through a dispatcher: a model's
set_attention_backend(name), or the attention_backend(name) context, picks one of the backends
named in diffusers' AttentionBackendName. register_diffusers_backend() adds "hattn" to them:

    import hattn
    hattn.register_diffusers_backend()
    pipe.transformer.set_attention_backend("hattn")   # or: with attention_backend("hattn"): ...
    video = pipe(prompt).frames

What the backend does with a call (diffusers passes [B, S, H, D] tensors):
  * hattn runs it when hattn.sdpa_fallback_reason allows (CUDA tensors on a Hopper GPU, bf16 or
    fp16, head dim 64/128/256, no attn_mask, no dropout, causal only with equal lengths, GQA with
    enable_gqa): forward and backward, GQA without copies;
  * return_lse=True (diffusers' context parallel and some pipelines ask for it) also returns
    hattn's LSE, in diffusers' layout [B, S, H] fp32;
  * every other call goes to diffusers' "native" backend (torch SDPA), unchanged; with
    return_lse=True, which "native" cannot give, it raises ValueError saying why hattn could not
    run it;
  * with a context-parallel config (ring and/or Ulysses), diffusers' templated ring/Ulysses
    attention runs hattn's forward and backward ops on each piece, as for its "flash" backend.

diffusers' AttentionBackendName is a closed Enum, so registration adds a member HATTN = "hattn"
to it; nothing else of diffusers changes. Checked with diffusers 0.42.1 (the project's pinned
version): with another version, registration raises RuntimeError naming what it did not find.
diffusers is imported only by register_diffusers_backend().
"""

from __future__ import annotations

import collections
from typing import Dict, Optional

import torch

from .ops import attention, attention_bwd, attention_fwd
from .sdpa import sdpa_fallback_reason

NAME = "hattn"
_calls: collections.Counter = collections.Counter()  # "hattn" / "native": calls of the backend by who ran them


def backend_calls() -> Dict[str, int]:
    """How many calls the "hattn" backend ran with hattn's kernels ("hattn") and handed to diffusers'
    "native" backend ("native") since import."""
    return {"hattn": _calls["hattn"], "native": _calls["native"]}


def _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """sdpa_fallback_reason on diffusers' [B, S, H, D] tensors: None when hattn runs the call."""
    views = (t.transpose(1, 2) for t in (query, key, value))
    return sdpa_fallback_reason(*views, attn_mask, dropout_p, is_causal, enable_gqa)


def _run(query, key, value, is_causal, scale, return_lse):
    """hattn.attention on [B, S, H, D] tensors: out, or (out, lse [B, S, H])."""
    if not return_lse:
        return attention(query, key, value, causal=is_causal, softmax_scale=scale)
    out, lse = attention(query, key, value, causal=is_causal, softmax_scale=scale, return_lse=True)
    return out, lse.transpose(1, 2)


# diffusers' templated ring and Ulysses attention (context parallel) call these with an autograd
# context of their own, once per piece; the backward gets the merged out and lse of the whole
# sequence in place of the piece's (P = exp(scale S - lse) and rowsum(dO * O) are then those of
# the full softmax), which hattn's backward op takes as they come.
def _forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    why = _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, True)
    if why is not None:
        raise ValueError(f"hattn backend (context parallel): hattn cannot run this call: {why}")
    out, lse = attention_fwd(query, key, value, is_causal, scale, "auto", True)
    lse = lse.transpose(1, 2)  # [B, S, H], diffusers' layout
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.is_causal = is_causal
        ctx.scale = scale
    return (out, lse) if return_lse else out


def _backward_op(ctx, grad_out, *args, query=None, key=None, value=None, out=None, lse=None, **kwargs):
    saved_query, saved_key, saved_value, saved_out, saved_lse = ctx.saved_tensors
    query = saved_query if query is None else query
    key = saved_key if key is None else key
    value = saved_value if value is None else value
    out = saved_out if out is None else out
    lse = saved_lse if lse is None else lse
    return attention_bwd(grad_out, query, key, value, out, lse.transpose(1, 2).contiguous(), ctx.is_causal, ctx.scale)


def _add_enum_member(enum_cls, name: str, value: str):
    """Adds member `name` = `value` to a str-valued Enum after its creation (diffusers'
    AttentionBackendName is closed); returns the member, or the existing one."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = str.__new__(enum_cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)  # the Enum metaclass refuses setattr of members
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register_diffusers_backend() -> str:
    """Registers hattn as diffusers' attention backend "hattn" (idempotent); returns the name.

    Then model.set_attention_backend("hattn") or diffusers' attention_backend("hattn") context select
    it. Needs diffusers; see the module docstring for what the backend does with each call.
    """
    try:
        from diffusers.models import attention_dispatch as dispatch
    except ImportError as e:
        raise ImportError("register_diffusers_backend: diffusers is not installed (pip install diffusers)") from e
    needed = ("AttentionBackendName", "_AttentionBackendRegistry", "_templated_context_parallel_attention",
              "_check_device", "_check_shape")
    missing = [n for n in needed if not hasattr(dispatch, n)]
    if missing:
        raise RuntimeError(f"register_diffusers_backend: diffusers.models.attention_dispatch has no {', '.join(missing)} "
                           "(checked with diffusers 0.42.1)")
    names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
    member = _add_enum_member(names, NAME.upper(), NAME)
    if member in registry._backends:
        return NAME
    native = registry._backends[names.NATIVE]

    def _hattn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                         scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
                         _parallel_config=None):
        if _parallel_config is not None:  # diffusers' ring / Ulysses, hattn on each piece
            _calls["hattn"] += 1
            out = dispatch._templated_context_parallel_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                forward_op=_forward_op, backward_op=_backward_op, _parallel_config=_parallel_config,
            )  # fmt: skip
            return out
        why = _fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if why is None:
            _calls["hattn"] += 1
            return _run(query, key, value, is_causal, scale, return_lse)
        if return_lse:
            raise ValueError(f"hattn backend: return_lse=True, but hattn cannot run this call ({why}) and "
                             "diffusers' native backend returns no LSE")
        _calls["native"] += 1
        return native(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa)

    registry.register(member, constraints=[dispatch._check_device, dispatch._check_shape],
                      supports_context_parallel=True)(_hattn_attention)
    return NAME
