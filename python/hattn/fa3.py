"""FlashAttention-3 as a benchmark anchor, when the caller gives its library.

The benchmarks (hattn.bench, bench_fp8, bench_backward, capstone) time FlashAttention-3 beside
hattn when they are given a build of it: `--fa3 PATH`, or the environment variable
HATTN_FA3_LIB. The library is a compiled FA3 `hopper/` extension that registers the
torch.ops.flash_attn_3 operators (fwd, bwd); the project never links, ships or needs it, and
no test depends on it. Without it the benchmarks keep an FA3 column that says so.

The calls here take hattn's layouts: BSHD q, k, v (the last dim contiguous), or packed
[total, H, D] with int32 cu_seqlens for variable-length batches, as FA3 itself does.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Tuple

import torch

ENV_VAR = "HATTN_FA3_LIB"
NOT_GIVEN = f"FlashAttention-3 not given (--fa3 PATH or {ENV_VAR})"
HELP = (f"a FlashAttention-3 library (a build of its hopper/ extension) to time beside hattn; default: "
        f"${ENV_VAR}, else its column says it was not given")  # fmt: skip

_loaded: Optional[str] = None  # the path loaded into this process


def library_path(given: Optional[str]) -> Optional[str]:
    """The library to load: `given` (--fa3), else $HATTN_FA3_LIB, else None."""
    return given or os.environ.get(ENV_VAR) or None


def check_path(given: Optional[str]) -> Optional[str]:
    """Why the library named by --fa3 or $HATTN_FA3_LIB cannot be used, or None (also when none
    is named). For a benchmark's argument parser: a wrong path is the caller's error."""
    path = library_path(given)
    if path is None or os.path.isfile(path):
        return None
    source = "--fa3" if given else ENV_VAR
    return f"{source}: no such file: {path}"


def add_argument(parser) -> None:
    """--fa3 PATH on a benchmark's argument parser."""
    parser.add_argument("--fa3", metavar="PATH", default=None, help=HELP)


def check_argument(parser, args) -> None:
    """A library named by --fa3 or $HATTN_FA3_LIB that does not exist: the parser's error."""
    why = check_path(args.fa3)
    if why:
        parser.error(why)


def load_for(prog: str, given: Optional[str]) -> Optional[str]:
    """load(), in a benchmark's main: None when FA3 is ready, NOT_GIVEN when no library was named.
    A named library that does not load ends the program (status 2), saying why."""
    why = load(given)
    if why and why != NOT_GIVEN:
        print(f"{prog}: {why}", file=sys.stderr)
        raise SystemExit(2)
    return why


def load(given: Optional[str]) -> Optional[str]:
    """Loads the library (once per process). Returns None when FA3's operators are ready, or why
    not: NOT_GIVEN when no library was named, else the loader's error."""
    global _loaded
    path = library_path(given)
    if path is None:
        return NOT_GIVEN
    if _loaded == path:
        return None
    why = check_path(given)
    if why:
        return why
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:
        return f"FlashAttention-3 library {path} did not load: {str(e).splitlines()[0]}"
    if not hasattr(torch.ops, "flash_attn_3") or not hasattr(torch.ops.flash_attn_3, "fwd"):
        return f"{path} loaded, but it registers no torch.ops.flash_attn_3.fwd"
    _loaded = path
    return None


def _window(causal: bool, window: Optional[Tuple[int, int]]):
    left, right = window if window is not None else (-1, -1)
    return dict(is_causal=causal, window_size_left=left, window_size_right=right)


def forward(q, k, v, causal: bool, window: Optional[Tuple[int, int]] = None, seqused_k=None,
            scale: Optional[float] = None, page_table=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out BSHD, lse) of BSHD q, k, v; seqused_k (int32 [B]): the keys each sequence uses, as
    a KV cache's lengths. window = (left, right), -1 for unlimited. page_table (int32 [B, pages]):
    k and v are a paged cache [num_pages, page_size, Hkv, D] (with seqused_k)."""
    out, lse, *_ = torch.ops.flash_attn_3.fwd(q, k, v, seqused_k=seqused_k, softmax_scale=scale,
                                              page_table=page_table, **_window(causal, window))  # fmt: skip
    return out, lse


def forward_mla(q_rope, k_rope, v_latent, q_latent, seqused_k, causal: bool, scale: float) -> torch.Tensor:
    """MLA decoding in FA3's d_qk != d_v mode: scores q_rope k_rope^T + q_latent v_latent^T (its `q_v`
    argument), out [B, Sq, H, 512] from v_latent; k_rope [B, L, 1, 64], v_latent [B, L, 1, 512]."""
    out, *_ = torch.ops.flash_attn_3.fwd(q_rope, k_rope, v_latent, q_v=q_latent, seqused_k=seqused_k,
                                         softmax_scale=scale, **_window(causal, None))  # fmt: skip
    return out


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                   causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [total_q, H, D], lse) of a packed variable-length batch."""
    out, lse, *_ = torch.ops.flash_attn_3.fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                              **_window(causal, None))  # fmt: skip
    return out, lse


def forward_fp8(q, k, v, q_descale, k_descale, v_descale, causal: bool) -> torch.Tensor:
    """BSHD out (bf16) of e4m3 q, k, v with fp32 descales [B, Hkv]."""
    out, *_ = torch.ops.flash_attn_3.fwd(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                         **_window(causal, None))  # fmt: skip
    return out


def backward(dout, q, k, v, out, lse, causal: bool, varlen=None, deterministic: bool = False,
             window: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from FA3's backward, given its forward's out and lse. varlen: (cu_seqlens,
    longest) of a packed batch, the same for queries and keys; deterministic: FA3's deterministic
    mode; window = (left, right) as the forward's. The op writes the gradients into the dq, dk,
    dv it is given (it returns only its own scratch: softmax_d, the LSE in log2 units, the fp32
    accumulators), so they are allocated here, as its Python interface does."""
    extra = {}
    if varlen is not None:
        cu, longest = varlen
        extra = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **extra, **_window(causal, window),
                               deterministic=deterministic)  # fmt: skip
    return dq, dk, dv
