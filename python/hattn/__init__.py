"""hattn: FlashAttention-class forward attention for NVIDIA Hopper GPUs (sm_90a).

    import torch, hattn
    q = torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)  # [B, S, H, D]
    k = torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)   # GQA: 4 K/V heads
    v = torch.randn_like(k)
    out = hattn.attention(q, k, v, causal=True)                              # [B, S, H, D]
    out, lse = hattn.attention(q, k, v, return_lse=True)                     # lse [B, H, S] fp32

The op is registered as torch.ops.hattn.attention_fwd (works with torch.compile and CUDA graphs).
hattn.attention_varlen (op torch.ops.hattn.attention_varlen_fwd) takes a variable-length batch:
sequences packed along the rows ([total, H, D]) with FlashAttention's int32 cu_seqlens offsets.
hattn.attention_paged (op torch.ops.hattn.attention_paged_fwd) reads a paged KV cache through an
int32 block table, with the keys in use per sequence (seqlens_k); hattn.attention takes seqlens_k
for a dense cache too. hattn.attention_fp8 (op torch.ops.hattn.attention_fp8_fwd) is the FP8
forward: float8_e4m3fn q, k, v with FlashAttention-3's q/k/v_descale, bf16 out, D = 64, 128 and 256.
hattn.scaled_dot_product_attention takes torch SDPA's arguments ([B, H, L, E] tensors) and runs
the calls hattn supports, handing the others to torch; `with hattn.patch_sdpa():` puts it in
place of torch.nn.functional.scaled_dot_product_attention. hattn.flash_attn_func,
hattn.flash_attn_varlen_func and hattn.flash_attn_with_kvcache take the arguments of
FlashAttention-2's functions of those names; hattn.flash_attn_interface is FlashAttention-3's
module of that name (`from hattn import flash_attn_interface`). hattn.mla_with_kvcache (op
torch.ops.hattn.mla_decode_fwd) is MLA decoding (DeepSeek's latent attention, 576/512 features)
over a paged cache, with hattn.mla_schedule's split-KV schedule made once per decoding step.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import List, NamedTuple

# torch first: it loads the CUDA runtime that the extension module shares with it.
import torch  # noqa: F401

from . import _C, flash_attn_interface
from . import distributed  # noqa: F401  sequence-parallel attention over torch.distributed (hattn.distributed)
from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .ops import (attention, attention_fp8, attention_paged, attention_varlen, checking, launch, mla_schedule,
                  mla_with_kvcache, resolve_kernel, set_checking)
from .sdpa import patch_sdpa, scaled_dot_product_attention, sdpa_fallback_reason
from .diffusers_backend import register_diffusers_backend  # imports diffusers only when called

__all__ = [
    "attention",
    "attention_fp8",
    "attention_paged",
    "attention_varlen",
    "checking",
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "kernels",
    "KernelInfo",
    "launch",
    "mla_schedule",
    "mla_with_kvcache",
    "patch_sdpa",
    "register_diffusers_backend",
    "resolve_kernel",
    "scaled_dot_product_attention",
    "set_checking",
    "sdpa_fallback_reason",
    "__version__",
]

try:
    __version__ = version("hattn")
except PackageNotFoundError:  # a build tree on PYTHONPATH rather than an installed package
    __version__ = "0.0.0+local"


class KernelInfo(NamedTuple):
    name: str  # e.g. "01_naive"; pass it as attention(..., kernel=name)
    description: str  # the lineage step's main idea


def kernels() -> List[KernelInfo]:
    """The registered kernels in lineage order; "auto" prefers the last one that supports a problem."""
    return [KernelInfo(name, description) for name, description in _C.kernels()]
