"""A same-precision emulation of hattn's backward (issue 53): the kernels' arithmetic in torch,
fp32 with the bf16/fp16 roundings exactly where the kernels convert, so that a precision test
can tell a miss that belongs to the dtype and the algorithm (the emulation misses too) from one
that belongs to the kernel (it does not).

The backward emulated is what "auto" runs: `bwd_sm90` (src/attention/backward/), one pass at
D = 64 and 128 and two at D = 256 (two_pass/, B12's). Both round at the same points; they
differ only in the order of fp32 sums. Given the forward's out (in the input dtype T) and lse
(fp32, natural log), per query head h, query i, key j:

  1. delta_i = rowsum(dO_i * O_i) in fp32 from O and dO in T, the O the forward wrote (rounded
     to T): delta_kernel in src/common/backward_common.cuh (`sum = fmaf(a.x, b.x, ...)` over
     unpack2<T> of both). The products are exact in fp32; only the order of the sum differs.
  2. The LSE in log2 units, fp32(lse * kLog2e): consumer.cuh's fetch_row_stat (D = 256: the
     passes' lse_log2 loads).
  3. S = Q K^T and dP = dO V^T with fp32 accumulation of T products (the wgmmas of
     consumer.cuh, S^T = K Q^T and dP^T = V dO^T): exact products, fp32 sums.
  4. Softcapping (backward_common.cuh's softcap_score_and_dp): t = tanh(fp32(s *
     softcap_scale)), then dP' = fmaf(dP - delta, fmaf(-t, t, 1), delta), so that the step below
     computes dS = P (dP' - delta) = P (dP - delta) (1 - t^2) with the fp32 roundings of dP' at
     delta's magnitude. softcap_scale = fp32(scale / softcap) (make_feature_params in
     src/common/params.h), the exponent's scale is then the softcap (the same function). The
     kernels' tanh is tanh.approx.f32 (MUFU.TANH; src/ptx/ex2.cuh), which this module cannot
     reproduce bit for bit: tanh="exact" (the default) uses torch's fp32 tanh; tanh="profile"
     adds a seeded random error of the size measured on the H200 per band of |x|
     (results/evidence/softcap/tanh_approx/tanh_profile.txt: up to 7.9e-6 absolute at
     1 <= |x| < 2), a stress model of its size, not its values.
  5. P = ex2.approx.ftz(fmaf(s, scale_log2, -lse_log2)), scale_log2 = fp32(scale * kLog2e)
     (consume's scale_log2; scores.cuh's two loops, and the passes' at D = 256): the fma
     emulated exactly (fp64 product and sum, rounded to fp32), 2^x exact then rounded to fp32
     (ex2.approx errs by about 2 fp32 ulps, not emulated), results below 2^-126 flushed to 0
     (.ftz). Keys a query does not see (the causal mask, a window, past Sk), and every key of a
     query that sees none, get P = 0.
  6. dS = P (dP - delta) in fp32, from the fp32 P (not the rounded one): the same loops.
  7. P^T and dS^T rounded to T, round to nearest even (frag::pack2<T>: __floats2bfloat162_rn,
     __floats2half2_rn; fp16 keeps its subnormals): consumer.cuh's p_frag and ds_frag
     (D = 256: two_pass/dkdv_pass.cuh's p_frag and ds_frag, two_pass/dq_pass.cuh's ds_frag).
     round_p and round_ds switch each off (kept fp32): P^T feeds only dV, dS^T only dK and dQ.
     flush_subnormals=True flushes the rounded P^T and dS^T below the dtype's smallest normal
     (fp16: 6.1e-5) to 0, an ablation for the case that the tensor cores did so (not known).
  8. dV = P^T dO, dK = dS^T Q and dQ = dS K with fp32 accumulation of T products; dK and dQ
     times grad_scale in fp32, grad_scale = fp32(softcap_scale * softcap) with softcapping, else
     the softmax scale (score_grad_scale in backward_common.cuh): consume's store_dq (dQ),
     epilogue.cuh's store_dk_dv and add_dk_dv (dK); at D = 256 the passes' stores. With GQA
     each query head's fp32 dK and dV are summed in fp32 (the TMA reductions into
     run_backward's sums; at D = 256 atomics).
  9. dQ, dK and dV rounded to T once (convert_kernel in backward_common.cuh, or the kernels'
     own pack2 stores: epilogue.cuh, the passes' stores at D = 256): round_grads.

Not emulated (fp32-level, far below T's rounding): the order of every fp32 sum (the wgmmas'
k order, bwd_sm90's dQ summed over 128-key blocks each scaled by grad_scale before the sum, the
nondeterministic order of the TMA reductions and atomics), ex2.approx's error, and tanh.approx's
exact values (see 4).

rounding=False turns every T rounding off (7 and 9, and in emulate_forward P and O); compute=
torch.float64 runs every fp32 step in fp64 (the constants then exact too): with both, the
emulation is the exact algorithm, equal to the fp64 reference up to fp64 rounding.

emulate_forward does the same for the production forward (fwd_sm90, one split): the online
softmax over key tiles of block_n keys, P rounded to T relative to the running max before PV
(src/attention/consumer.cuh), O * (1 / sum) rounded to T (src/attention/epilogue.cuh), lse =
max * scale + ln(sum) (src/attention/softmax.cuh). The precision test feeds the backward
emulation hattn's own out and lse, so that only the backward is compared.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
from helpers import visible_mask

KLOG2E = 1.4426950408889634  # kLog2e, a float constant in the kernels
FTZ_MIN = 2.0**-126  # ex2.approx.ftz flushes results below the smallest normal float to 0

# tanh.approx.f32's largest absolute error per band of |x| on the H200 (upper band edges):
# results/evidence/softcap/tanh_approx/tanh_profile.txt (tools/tanh_approx_profile.cu).
TANH_APPROX_PROFILE = ((0.01, 3.97e-08), (0.1, 5.29e-07), (0.5, 2.42e-06), (1.0, 7.1e-06), (2.0, 7.91e-06),
                       (4.0, 2.65e-06), (8.0, 2.27e-06), (math.inf, 2.25e-07))  # fmt: skip


@contextlib.contextmanager
def exact_fp32_matmuls():
    """fp32 matmuls in fp32 (no TF32) on CUDA for the duration; nothing to do on the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _Constants:
    """The kernels' scalars as they compute them: fp32 (make_feature_params in params.h, api.cpp's
    scale(), consume's scale_log2, score_grad_scale), or exact with compute = float64."""

    def __init__(self, head_dim: int, softmax_scale: Optional[float], softcap: float, compute: torch.dtype):
        capped = softcap > 0
        if compute == torch.float64:
            scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
            self.softcap_scale = scale / softcap if capped else 0.0
            self.exp_scale = softcap if capped else scale  # AttentionParams::scale: the exponent's scale
            self.scale_log2 = self.exp_scale / math.log(2.0)
            self.log2e = 1.0 / math.log(2.0)
            self.grad_scale = scale
        else:
            f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
            # AttentionProblem::scale(): 1.0f / std::sqrt(float(head_dim)), or the given scale as a float
            scale = f32(softmax_scale) if softmax_scale is not None else 1.0 / f32(float(head_dim)).sqrt()
            cap = f32(softcap)
            self.softcap_scale = (scale / cap).item() if capped else 0.0
            exp_scale = cap if capped else scale
            self.exp_scale = exp_scale.item()
            self.log2e = f32(KLOG2E).item()
            self.scale_log2 = (exp_scale * f32(KLOG2E)).item()
            self.grad_scale = (f32(self.softcap_scale) * cap).item() if capped else scale.item()


def _fma(a: torch.Tensor, b, c, compute: torch.dtype) -> torch.Tensor:
    """fmaf(a, b, c) rounded once to `compute`: the fp64 product of two fp32 values is exact."""
    a64 = a.double()
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    return (a64 * b64 + c64).to(compute)


def _exp2(x: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """ex2.approx.ftz.f32: 2^x rounded to fp32 (its ~2 ulp error not modelled), results below
    2^-126 flushed to 0."""
    y = torch.exp2(x.double()).to(compute)
    return y.masked_fill(y < FTZ_MIN, 0.0) if compute == torch.float32 else y


def _tanh(x: torch.Tensor, mode: str, seed: int) -> torch.Tensor:
    """The kernels' tanh.approx.f32 of x: exact (torch's tanh in x's dtype) or, mode "profile",
    with a seeded uniform error up to the H200's measured bound for each |x| band."""
    t = torch.tanh(x)
    if mode == "exact":
        return t
    if mode != "profile":
        raise ValueError(f"tanh: 'exact' or 'profile', not {mode!r}")
    bound = torch.zeros_like(x)
    ax = x.abs()
    for upper, err in reversed(TANH_APPROX_PROFILE):
        bound = torch.where(ax < upper, torch.full_like(x, err), bound)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    u = (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1).to(x.device)
    return (t.double() + u * bound.double()).clamp(-1.0, 1.0).to(x.dtype)


def _heads_first(t: torch.Tensor, compute: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """[B, S, H, D] -> [B, H * repeat, S, D] in `compute` (GQA: query head h reads K/V head
    h // repeat, the kernels' head / heads_per_kv)."""
    t = t.transpose(1, 2).to(compute)
    return t.repeat_interleave(repeat, dim=1) if repeat > 1 else t


def _round(t: torch.Tensor, dtype: torch.dtype, on: bool) -> torch.Tensor:
    """t rounded to dtype (round to nearest even, as __floats2*_rn) and back, or t."""
    return t.to(dtype).to(t.dtype) if on else t


def _scores(qh, kh, consts: _Constants, softcap: float, tanh: str, seed: int, compute):
    """S = Q K^T (fp32 sums of exact products) and, with softcapping, t = tanh(s softcap_scale)."""
    s = torch.matmul(qh, kh.transpose(-1, -2))
    if softcap > 0:
        s = _tanh((s * consts.softcap_scale).to(compute), tanh, seed)
    return s


class _BackwardTerms:
    """The backward's per-head tensors before the products (steps 1-6), [B, Hq, Sq, Sk] or
    [B, Hq, S, D] in `compute`: qh, kh (K per query head), vh, doh, oh, delta [B, Hq, Sq, 1],
    t (the capped scores, softcap only), slope (1 - t^2, or None), p and ds (fp32, unrounded)."""

    def __init__(self, q, k, v, out, lse, dout, causal, softmax_scale, window, softcap, compute, tanh, tanh_seed):
        seqlen_q, heads_q, head_dim = q.shape[1], q.shape[2], q.shape[3]
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
        c = compute
        self.group = heads_q // heads_kv
        self.consts = consts = _Constants(head_dim, softmax_scale, softcap, c)
        self.qh, self.doh, self.oh = (_heads_first(t, c) for t in (q, dout, out))  # [B, Hq, Sq, D]
        self.kh, self.vh = (_heads_first(t, c, self.group) for t in (k, v))  # [B, Hq, Sk, D]
        self.visible = visible_mask(seqlen_q, seqlen_k, causal, window, device=q.device)  # [Sq, Sk]
        with exact_fp32_matmuls():
            self.delta = delta = (self.oh * self.doh).sum(-1, keepdim=True)  # 1.
            lse_log2 = (lse.to(c) * consts.log2e)[..., None]  # 2. (-inf stays -inf)
            s = _scores(self.qh, self.kh, consts, softcap, tanh, tanh_seed, c)  # 3., 4.
            dp = torch.matmul(self.doh, self.vh.transpose(-1, -2))  # 3.
            self.slope = None
            if softcap > 0:  # 4.: dP' = fmaf(dP - delta, fmaf(-t, t, 1), delta)
                self.slope = _fma(-s, s, 1.0, c)
                dp = _fma(dp - delta, self.slope, delta, c)
            self.t = s if softcap > 0 else None
            p = _exp2(_fma(s, consts.scale_log2, -lse_log2, c), c)  # 5.
            self.p = torch.where(self.visible, p, torch.zeros((), dtype=c, device=p.device))
            self.dp = dp
            self.ds = self.p * (dp - delta)  # 6.


def emulate_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window=(-1, -1),
    softcap: float = 0.0,
    *,
    rounding: bool = True,
    round_p: Optional[bool] = None,
    round_ds: Optional[bool] = None,
    round_grads: Optional[bool] = None,
    compute: torch.dtype = torch.float32,
    tanh: str = "exact",
    tanh_seed: int = 0,
    flush_subnormals: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as hattn's backward computes them (the module's steps 1-9) from BSHD q, k, v,
    dout in bf16/fp16, the forward's out (in that dtype) and lse [B, Hq, Sq] (fp32; -inf for a
    row that sees no key). round_p, round_ds, round_grads default to `rounding`; the gradients
    come back in the inputs' dtype when round_grads, else in `compute`. Runs where the inputs are
    (TF32 off on CUDA)."""
    dtype = q.dtype
    round_p = rounding if round_p is None else round_p
    round_ds = rounding if round_ds is None else round_ds
    round_grads = rounding if round_grads is None else round_grads
    batch, seqlen_k, heads_kv, head_dim = k.shape
    x = _BackwardTerms(q, k, v, out, lse, dout, causal, softmax_scale, window, softcap, compute, tanh, tanh_seed)
    with exact_fp32_matmuls():
        p_op, ds_op = _round(x.p, dtype, round_p), _round(x.ds, dtype, round_ds)  # 7.
        if flush_subnormals:
            tiny = torch.finfo(dtype).tiny
            p_op, ds_op = (t.masked_fill(t.abs() < tiny, 0.0) for t in (p_op, ds_op))
        dv_h = torch.matmul(p_op.transpose(-1, -2), x.doh)  # 8. [B, Hq, Sk, D]
        dk_h = torch.matmul(ds_op.transpose(-1, -2), x.qh) * x.consts.grad_scale
        dq = torch.matmul(ds_op, x.kh) * x.consts.grad_scale
    dk = dk_h.view(batch, heads_kv, x.group, seqlen_k, head_dim).sum(2)  # GQA: the fp32 sums over the group
    dv = dv_h.view(batch, heads_kv, x.group, seqlen_k, head_dim).sum(2)
    grads = tuple(g.transpose(1, 2) for g in (dq, dk, dv))
    return tuple(g.to(dtype) if round_grads else g.contiguous() for g in grads)  # 9.


def fp32_sum_ulps(terms: int) -> float:
    """The allowance for one fp32 sum of `terms` products in another order: 2 sqrt(terms) fp32
    ulps of the sum of the products' absolute values (a random walk of the roundings, about 7
    standard deviations; the worst case is `terms` ulps)."""
    return 2.0 * math.sqrt(terms) * 2.0**-24


def fp32_order_slack(q, k, v, out, lse, dout, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv): how far two fp32 evaluations of the backward (the module's steps) that
    differ only in the order of their fp32 sums may be apart, max over each gradient's elements,
    to first order. It comes from S = Q K^T (P's exponent: scale times the slope 1 - t^2 times
    S's error) and from dP - delta (P times their errors; with softcapping, dP' rounded at
    delta's magnitude), whose cancellation leaves dS, and so dQ and dK, with errors that are not
    small against them: e.g. a query that sees one key has dS = 0 exactly, and an fp32 residue
    in any order. The rounding of the products to the dtype and of the results are not in it."""
    head_dim = q.shape[3]
    batch, seqlen_k, heads_kv, _ = k.shape
    x = _BackwardTerms(q, k, v, out, lse, dout, causal, softmax_scale, window, softcap, torch.float32, "exact", 0)
    n = fp32_sum_ulps(head_dim)
    with exact_fp32_matmuls():
        s_abs = torch.matmul(x.qh.abs(), x.kh.abs().transpose(-1, -2))  # sum |q_d k_d|
        dp_abs = torch.matmul(x.doh.abs(), x.vh.abs().transpose(-1, -2))
        delta_abs = torch.matmul(x.doh.abs()[..., None, :], x.oh.abs()[..., :, None])[..., 0]  # [B, Hq, Sq, 1]
        score_scale = x.consts.grad_scale  # d(exponent, natural log) / d(q.k), times the slope below
        slope = x.slope.abs() if x.slope is not None else 1.0
        p_rel = score_scale * slope * n * s_abs  # P's relative error from S's
        e_ds = x.p * (p_rel * (x.dp - x.delta).abs() + n * (dp_abs * slope + delta_abs))
        if x.slope is not None:  # dP' = fmaf(...) rounded at |delta|, then dP' - delta
            e_ds = e_ds + x.p * 2.0**-23 * x.delta.abs()
        e_dq = torch.matmul(e_ds, x.kh.abs()) * score_scale
        e_dk = torch.matmul(e_ds.transpose(-1, -2), x.qh.abs()) * score_scale
        e_dv = torch.matmul((x.p * p_rel).transpose(-1, -2), x.doh.abs())
    e_dk = e_dk.view(batch, heads_kv, x.group, seqlen_k, head_dim).sum(2)
    e_dv = e_dv.view(batch, heads_kv, x.group, seqlen_k, head_dim).sum(2)
    return tuple(e.max().item() if e.numel() else 0.0 for e in (e_dq, e_dk, e_dv))


def forward_block_n(head_dim: int) -> int:
    """The production forward's keys per tile without wide tiles (src/attention/config.h)."""
    return 64 if head_dim == 256 else 128


def emulate_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window=(-1, -1),
    softcap: float = 0.0,
    *,
    rounding: bool = True,
    compute: torch.dtype = torch.float32,
    block_n: Optional[int] = None,
    tanh: str = "exact",
    tanh_seed: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) as fwd_sm90 computes them in one split: the online
    softmax over tiles of block_n keys (default forward_block_n), P rounded to the inputs' dtype
    relative to the running max before P V, O rescaled by alpha = 2^(old max - new max), out =
    O * (1 / sum) rounded to that dtype, lse = max * scale + ln(sum) in fp32. rounding=False
    keeps P and out in `compute`."""
    dtype = q.dtype
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    c = compute
    consts = _Constants(head_dim, softmax_scale, softcap, c)
    block_n = block_n or forward_block_n(head_dim)
    qh = _heads_first(q, c)
    kh, vh = (_heads_first(t, c, group) for t in (k, v))
    visible = visible_mask(seqlen_q, seqlen_k, causal, window, device=q.device)
    zero = torch.zeros((), dtype=c, device=q.device)
    with exact_fp32_matmuls():
        s = _scores(qh, kh, consts, softcap, tanh, tanh_seed, c).masked_fill(~visible, -math.inf)
        row_max = torch.full((batch, heads_q, seqlen_q), -math.inf, dtype=c, device=q.device)
        row_sum = torch.zeros_like(row_max)
        o = torch.zeros(batch, heads_q, seqlen_q, head_dim, dtype=c, device=q.device)
        for n0 in range(0, seqlen_k, block_n):
            tile = s[..., n0 : n0 + block_n]
            m = torch.maximum(row_max, tile.amax(-1))
            m_scaled = torch.where(m == -math.inf, zero, m * consts.scale_log2)  # softmax.cuh: 0 for no key yet
            alpha = torch.where(m == row_max, torch.ones_like(m), _exp2(row_max * consts.scale_log2 - m_scaled, c))
            p = _exp2(_fma(tile, consts.scale_log2, -m_scaled[..., None], c), c)
            row_sum = row_sum * alpha + p.sum(-1)
            o = o * alpha[..., None] + torch.matmul(_round(p, dtype, rounding), vh[..., n0 : n0 + block_n, :])
            row_max = m
        inv_sum = torch.where(row_sum > 0, 1.0 / row_sum, zero)
        out = o * inv_sum[..., None]
        lse = torch.where(row_sum > 0, row_max * consts.exp_scale + torch.log(row_sum), -math.inf)
    out = out.transpose(1, 2)
    return (out.to(dtype) if rounding else out.contiguous()), lse.to(torch.float32 if c == torch.float32 else c)


def emulate_gradients(q, k, v, dout, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, **options):
    """(dq, dk, dv) of the whole emulated algorithm: emulate_forward, then emulate_backward from
    its out and lse (options: rounding, compute, tanh, tanh_seed, and the backward's round_*)."""
    fwd_options = {name: options[name] for name in ("rounding", "compute", "tanh", "tanh_seed") if name in options}
    out, lse = emulate_forward(q, k, v, causal, softmax_scale, window, softcap, **fwd_options)
    if out.dtype != q.dtype:  # rounding off: the backward reads the unrounded O
        out = out.to(options.get("compute", torch.float32))
    return emulate_backward(q, k, v, out, lse, dout, causal, softmax_scale, window, softcap, **options)
