"""Test helpers: which GPU tests can run here, reference attention in torch, the error bounds."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import pytest
import torch


def hopper_skip_reason() -> Optional[str]:
    """None when an sm_90 GPU is present, else why the GPU tests skip."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False); GPU tests need an NVIDIA Hopper GPU (sm_90)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"GPU tests need a Hopper GPU (sm_90); found {torch.cuda.get_device_name()} (sm_{major}{minor})"
    return None


requires_hopper = pytest.mark.skipif(hopper_skip_reason() is not None, reason=hopper_skip_reason() or "")

# Inputs have a non-zero mean (all-positive offsets make scores and outputs non-trivial).
INPUT_MEAN = 0.5


def binding(function, **fields):
    """hattn._C `function` (forward, workspace_size or resolve_kernel) on an AttentionProblem with
    these fields (hattn.ops.runner._problem_kwargs' names); a `kernel` entry names the kernel."""
    from hattn.ops.runner import _problem

    return function(*_problem(fields))


def make_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(seqlen, heads):
        return torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype, generator=gen) + INPUT_MEAN

    return rand(seqlen_q, heads_q), rand(seqlen_k, heads_kv), rand(seqlen_k, heads_kv)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1), device=None) -> torch.Tensor:
    """[Sq, Sk] bool: which keys each query sees (bottom-right aligned causal mask and window)."""
    i = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)  # each row's diagonal
    j = torch.arange(seqlen_k, device=device)[None, :]
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    return visible


def masked_rows(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """[Sq] bool: rows that see no key (bottom-right causal with Sq > Sk, or a window)."""
    return ~visible_mask(seqlen_q, seqlen_k, causal, window).any(dim=1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    upcast: bool = True,
    window=(-1, -1),
    softcap: float = 0.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) of BSHD inputs; softcap > 0 caps the scores s at
    softcap * tanh(s / softcap) before the mask.

    upcast=True: everything in float64, the reference. upcast=False: the straightforward
    implementation in the inputs' dtype (scores, softmax and P rounded to it, as a plain torch
    program computes them): the baseline whose error sets the bound.
    GQA by repeat_interleave of the K/V heads; causal aligned to the bottom-right corner; a
    fully masked row gives out 0 and lse -inf.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    dtype = torch.float64 if upcast else q.dtype
    qh = q.to(dtype).transpose(1, 2)  # [B, Hq, Sq, D]
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(heads_q // heads_kv, dim=1)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(heads_q // heads_kv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or tuple(window) != (-1, -1):
        visible = visible_mask(seqlen_q, seqlen_k, causal, window, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.to(torch.float64 if upcast else torch.float32), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    dead = masked_rows(seqlen_q, seqlen_k, causal, window).to(q.device)
    probs = probs.masked_fill(dead[:, None], 0.0)  # softmax of an all -inf row is NaN
    out = torch.matmul(probs, vh).transpose(1, 2)
    return out, lse


def error_bound(ref: torch.Tensor, naive: torch.Tensor, dtype: torch.dtype) -> float:
    """max |out - ref| allowed: 2 * max |naive - ref| + atol.

    The rule of FlashAttention's tests: a kernel may be at most about twice as far from the fp64
    reference as a straightforward implementation in the same precision. The atol covers the one
    rounding every correct result goes through, that of the output to its dtype: half an ulp at the
    largest output magnitude (bf16: 2^-8 * max|ref| ~ 2e-3 here; fp16: 2^-11 * max|ref| ~ 2.4e-4),
    which matters only where the baseline happens to be nearly exact (e.g. rows that see one key).
    """
    atol = 0.5 * torch.finfo(dtype).eps * ref.abs().max().item() + 1e-6
    return 2 * (naive.double() - ref).abs().max().item() + atol


def row_sum_atol(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, out_ref: torch.Tensor) -> Tuple[float, float]:
    """(dq, dk) slack for the backward's dS = P * (dP - rowsum(dO * O)) cancelling in fp32.

    Where a row sees one key (causal row 0, a window of 0, one key in all), P is exactly 1 and dP
    equals the row sum, so the fp64 gradient and the plain same-precision one (softmax's own
    backward) are exactly 0. A FlashAttention backward forms dP with a GEMM and the row sum
    apart, both in fp32 over D products: their difference is rounding noise, not 0, of up to
    about 2 * sqrt(D) * eps32 * sum |dO * O| per row. It reaches dq through scale * K, and dk
    through scale * Q summed over the rows and the query heads that share a key head (root of the
    sum of squares: the rows round independently).
    """
    d = q.shape[-1]
    scale = d**-0.5
    noise = 2 * math.sqrt(d) * torch.finfo(torch.float32).eps * (dout.double() * out_ref).abs().sum(-1)  # [B, Sq, Hq]
    b, sq, hq = noise.shape
    hkv = k.shape[2]
    into_dk = (noise[..., None] * q.double()).square().reshape(b, sq, hkv, hq // hkv, d).sum((1, 3)).sqrt()
    return scale * k.abs().max().item() * noise.max().item(), scale * into_dk.max().item()


def lse_bound(ref: torch.Tensor, naive: torch.Tensor) -> float:
    """The same rule for the fp32 LSE; the atol is a few fp32 ulps at |lse| ~ 10."""
    finite = torch.isfinite(ref)
    if not finite.any():
        return 1e-4
    return 2 * (naive.double() - ref)[finite].abs().max().item() + 1e-4


def check_sequence(o, lse_b, q, k, v, causal, softmax_scale, window, label, softcap=0.0):
    """One sequence's out o [Sq, Hq, D] and lse_b [Hq, Sq] against attention_ref on that
    sequence alone (q [Sq, Hq, D], k and v [Sk, Hkv, D]), within twice the error of plain
    same-dtype torch (test_gpu.py's bound); rows that see no key must give 0 and -inf."""
    if k.shape[0] == 0:  # no keys: every row sees none
        assert (o == 0).all(), f"{label}: rows without keys must give output 0"
        assert torch.isneginf(lse_b).all(), f"{label}: rows without keys must give lse -inf"
        return
    qb, kb, vb = q[None], k[None], v[None]
    options = dict(window=window, softcap=softcap)
    ref_out, ref_lse = attention_ref(qb, kb, vb, causal, softmax_scale, upcast=True, **options)
    naive_out, naive_lse = attention_ref(qb, kb, vb, causal, softmax_scale, upcast=False, **options)
    ref_out, naive_out, ref_lse, naive_lse = ref_out[0], naive_out[0], ref_lse[0], naive_lse[0]
    err = (o.double() - ref_out).abs().max().item()
    bound = error_bound(ref_out, naive_out, q.dtype)
    assert err <= bound, f"{label} ({q.shape[0]}x{k.shape[0]}): out max error {err:.3e} > bound {bound:.3e}"
    dead = torch.isneginf(ref_lse[0])  # rows that see no key, the same for every head
    if dead.any():
        assert (o[dead] == 0).all(), f"{label}: fully masked rows must give output 0"
        assert torch.isneginf(lse_b[:, dead]).all(), f"{label}: fully masked rows must give lse -inf"
    live = ~dead
    if live.any():
        assert torch.isfinite(lse_b[:, live]).all(), f"{label}: lse must be finite on rows that see a key"
        lerr = (lse_b[:, live].double() - ref_lse[:, live]).abs().max().item()
        lbound = lse_bound(ref_lse[:, live], naive_lse[:, live])
        assert lerr <= lbound, f"{label}: lse max error {lerr:.3e} > bound {lbound:.3e}"


def varlen_attention_ref(
    q, k, v, lens_q, lens_k, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0
) -> torch.Tensor:
    """out [total_q, Hq, D] of packed q [total_q, Hq, D], k and v [total_k, Hkv, D] whose sequences
    have these lengths (Python ints): attention_ref (fp64) on each sequence alone; a sequence
    without keys gives 0. Differentiable, for the reference gradients."""
    pieces, q0, k0 = [], 0, 0
    for sq, sk in zip(lens_q, lens_k):
        qb, kb, vb = q[q0 : q0 + sq], k[k0 : k0 + sk], v[k0 : k0 + sk]
        if sq > 0 and sk > 0:
            pieces.append(
                attention_ref(qb[None], kb[None], vb[None], causal, softmax_scale, window=window, softcap=softcap)[0][0]
            )
        else:
            pieces.append(torch.zeros_like(qb, dtype=torch.float64))
        q0, k0 = q0 + sq, k0 + sk
    return torch.cat(pieces)


def cu_seqlens_of(lens, device="cuda") -> torch.Tensor:
    """int32 [batch + 1] offsets of these sequence lengths."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def gradients(fn, q, k, v, dout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of fn(q, k, v) given dL/d out = dout, on new leaves (detach) of q, k and v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def check_gradients(got, want, dtype: torch.dtype, label: str = "") -> None:
    """got (dq, dk, dv) against want, the fp64 reference's: max error at most 3 eps(dtype)
    max|want| + 1e-6 for each (the C++ tests' harness::backward_error_budget), in dtype and
    want's shape, no NaN or inf."""
    eps = torch.finfo(dtype).eps
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, f"{label} {name}: {g.dtype} {tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{label} {name}: not finite"
        err = (g.double() - w).abs().max().item()
        bound = 3 * eps * w.abs().max().item() + 1e-6
        assert err <= bound, f"{label} {name}: max error {err:.3e} > bound {bound:.3e}"


def gpu_kvcache(lens, seqlen_q=4, page_size=128, heads_q=8, heads_kv=2, head_dim=128, seed=0):
    """q; a paged cache with a random page table (block table); the same keys in a dense cache; int32 lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = max(1, max(-(-n // page_size) for n in lens))
    num_pages = len(lens) * max_pages
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).view(len(lens), max_pages)
    table = table.to(torch.int32).cuda()

    def rand(*shape):
        return torch.randn(*shape, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) + INPUT_MEAN

    q = rand(len(lens), seqlen_q, heads_q)
    k_pages, v_pages = rand(num_pages, page_size, heads_kv), rand(num_pages, page_size, heads_kv)
    k_dense, v_dense = (c[table.long()].flatten(1, 2) for c in (k_pages, v_pages))  # [B, max_pages * page_size, ...]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_pages, v_pages, table, k_dense, v_dense, seqlens


def gpu_varlen(lens_q, lens_k, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16):
    """Packed q, k, v (randn + INPUT_MEAN) of sequences of these lengths on the GPU, their cu_seqlens
    and longest lengths: the arguments of a flash_attn_varlen_func call, in its order."""
    q = torch.randn(sum(lens_q), heads_q, head_dim, device="cuda", dtype=dtype) + INPUT_MEAN
    k = torch.randn(sum(lens_k), heads_kv, head_dim, device="cuda", dtype=dtype) + INPUT_MEAN
    v = torch.randn_like(k) + INPUT_MEAN
    return q, k, v, cu_seqlens_of(lens_q), cu_seqlens_of(lens_k), max(lens_q), max(lens_k)


def check_varlen_func_gradients(varlen_func, causal: bool) -> None:
    """dq, dk, dv through a flash_attn_varlen_func drop-in (FlashAttention-2's or -3's form) with a
    left window of 90 keys, against the fp64 reference per sequence, on sequences with no keys or
    no queries among them."""
    lens_q, lens_k = [300, 0, 129, 17], [200, 50, 0, 400]
    q, k, v, cu_q, cu_k, max_q, max_k = gpu_varlen(lens_q, lens_k)
    dout = torch.randn_like(q) + INPUT_MEAN
    got = gradients(
        lambda q, k, v: varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=(90, -1)),
        q, k, v, dout,
    )  # fmt: skip
    window = (90, 0 if causal else -1)
    want = gradients(
        lambda q, k, v: varlen_attention_ref(q, k, v, lens_q, lens_k, causal=causal, window=window),
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, torch.bfloat16, f"varlen causal={causal}")
