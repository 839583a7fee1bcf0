"""hattn.attention_fp8 (op torch.ops.hattn.attention_fp8_fwd), the FP8 forward.

CPU (no GPU needed): argument errors, shape inference on meta tensors, torch.compile tracing,
the binding's e4m3 dtype and descales, the layout rule in bytes, flash_attn_func's FP8 route.
GPU (Hopper only, else skipped with the reason): the output against a float64 reference on the
dequantized inputs, within twice the error of a plain implementation that rounds the softmax
weights to e4m3 and out to bf16, plus 1e-3 (the C++ tests' rule, tests/test_fp8.cpp).
"""

import math

import hattn
import pytest
import torch
from hattn import _C
from hattn.ops.checks import _kernel_layout_ok
from helpers import attention_ref, binding, hopper_skip_reason, masked_rows, requires_hopper, visible_mask

FP8 = torch.float8_e4m3fn
D = 128
LAST = hattn.kernels()[-1].name  # the only kernel with FP8 inputs


def fp8_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim=D, device="cpu", seed=0):
    """e4m3 q, k, v with codes drawn from N(0.3, 1) (v: 4 N(0.3, 1)), as tests/test_fp8.cpp draws them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(seqlen, heads, spread=1.0):
        x = torch.randn(batch, seqlen, heads, head_dim, device=device, generator=gen) + 0.3
        return (x * spread).to(FP8)

    return rand(seqlen_q, heads_q), rand(seqlen_k, heads_kv), rand(seqlen_k, heads_kv, 4.0)


def random_descales(batch, heads_kv, device="cpu", seed=1):
    """(q_descale, k_descale, v_descale), fp32 [batch, heads_kv] in [0.25, 2]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.rand(batch, heads_kv, device=device, generator=gen) * 1.75 + 0.25 for _ in range(3))


def dequantize(q, k, v, descales):
    """float64 q, k, v times their scales: q's head h by q_descale[:, h // (Hq // Hkv)]."""
    group = q.shape[2] // k.shape[2]
    scaled = []
    for t, d, per_head in ((q, descales[0], group), (k, descales[1], 1), (v, descales[2], 1)):
        x = t.float().double()
        if d is not None:
            x = x * d.double().repeat_interleave(per_head, dim=1)[:, None, :, None]
        scaled.append(x)
    return tuple(scaled)


def attention_lowp_fp8(q, k, v, causal=False, softmax_scale=None):
    """(out bf16 [B, Sq, Hq, D], lse fp32 [B, Hq, Sq]) of dequantized float64 q, k, v the way a
    plain FP8 implementation computes them: the unnormalized weights exp(s - rowmax) rounded to
    e4m3 before P V as 2^8 exp(s - rowmax) (the kernel's scaling, which keeps small weights out of
    e4m3's subnormals), their sum unrounded, out rounded to bf16 (ref::attention_row_lowp for e4m3)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(heads_q // heads_kv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(heads_q // heads_kv, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~visible_mask(seqlen_q, seqlen_k, causal, device=q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see no key: all weights 0
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    p8 = (p * 256).float().to(FP8).float().double() / 256
    out = torch.matmul(p8, vh) / total
    out = torch.nan_to_num(out, nan=0.0).to(torch.bfloat16).transpose(1, 2)  # 0 / 0 in dead rows -> 0
    lse = (m + torch.log(total)).squeeze(-1).float()
    return out, lse


# --- CPU: argument checks before any CUDA call ----------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda q, k, v: (q.to(torch.bfloat16), k, v), ValueError, r"q: dtype must be torch.float8_e4m3fn"),
        (lambda q, k, v: (q, k.to(torch.bfloat16), v), ValueError,
         r"k: dtype must be torch.float8_e4m3fn .*got torch.bfloat16"),
        (lambda q, k, v: (q, k, v.to(torch.float16)), ValueError, r"v: dtype must be torch.float8_e4m3fn"),
        (lambda q, k, v: (q, k, v[:, :7]), ValueError, r"v: shape \(2, 7, 2, 128\) must equal k's shape"),
        (lambda q, k, v: (q[:, :, :5], k, v), ValueError, r"k: q's heads \(5\) must be a multiple of k/v's heads"),
        (lambda q, k, v: (q[0], k, v), ValueError, r"q: must be 4-D"),
        (lambda q, k, v: ("q", k, v), TypeError, r"q: must be a torch.Tensor, got str"),
    ],
)  # fmt: skip
def test_argument_errors_name_the_argument(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention_fp8(*mutate(*fp8_qkv(2, 10, 12, 8, 2)))


@pytest.mark.parametrize(
    "name, bad, error, pattern",
    [
        ("q_descale", torch.ones(2, 2, dtype=torch.float16), ValueError, r"q_descale: dtype must be torch.float32"),
        ("k_descale", torch.ones(2, 8), ValueError, r"k_descale: shape must be \(batch, heads_kv\) = \(2, 2\)"),
        ("v_descale", torch.ones(2), ValueError, r"v_descale: shape must be \(batch, heads_kv\) = \(2, 2\)"),
        ("v_descale", torch.ones(1, 2), ValueError, r"v_descale: shape must be"),
        ("q_descale", 2.0, TypeError, r"q_descale: must be a torch.Tensor, got float"),
    ],
)
def test_descale_errors_name_the_argument(name, bad, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention_fp8(*fp8_qkv(2, 10, 12, 8, 2), **{name: bad})


def test_inputs_that_require_grad_are_refused():
    q, k, v = fp8_qkv(1, 10, 12, 2, 2)
    with pytest.raises(NotImplementedError, match=r"attention_fp8: forward only"):
        hattn.attention_fp8(q.requires_grad_(), k, v)
    q, k, v = fp8_qkv(1, 10, 12, 2, 2)
    with pytest.raises(NotImplementedError, match=r"forward only"):
        hattn.attention_fp8(q, k, v, v_descale=torch.ones(1, 2, requires_grad=True))


def test_attention_points_fp8_inputs_to_attention_fp8():
    with pytest.raises(ValueError, match=r"q: dtype must be torch.bfloat16 or torch.float16, got "
                                         r"torch.float8_e4m3fn \(FP8 inputs: use hattn.attention_fp8\)"):  # fmt: skip
        hattn.attention(*fp8_qkv(1, 10, 12, 2, 2))


def test_cpu_tensors_are_refused_clearly():
    q, k, v = fp8_qkv(1, 10, 12, 2, 2)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"q: must be a CUDA tensor, got device cpu"):
            hattn.attention_fp8(q, k, v)
    else:
        with pytest.raises(RuntimeError, match=r"no suitable GPU is present"):
            hattn.attention_fp8(q, k, v)


# --- CPU: the op on meta tensors, torch.compile tracing ------------------------------------------------


def test_op_schema():
    schema = str(torch.ops.hattn.attention_fp8_fwd.default._schema)
    args = (
        "Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, bool causal, "
        "float? softmax_scale, str kernel, bool return_lse"
    )
    assert schema.startswith(f"hattn::attention_fp8_fwd({args})")
    assert schema.endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("return_lse", [False, True])
def test_meta_shapes(return_lse):
    q, k, v = (t.to("meta") for t in fp8_qkv(2, 10, 12, 8, 2))
    scale = torch.empty(2, 2, device="meta")
    out, lse = torch.ops.hattn.attention_fp8_fwd(q, k, v, scale, None, scale, True, None, "auto", return_lse)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.dtype == torch.float32 and lse.shape == ((2, 8, 10) if return_lse else (0,))
    with pytest.raises(ValueError, match=r"k_descale: shape must be"):
        torch.ops.hattn.attention_fp8_fwd(q, k, v, None, scale[:1], None, True, None, "auto", False)


def test_compile_fullgraph_traces_without_breaks():
    torch._dynamo.reset()

    def f(q, k, v, qd, kd, vd):
        out, lse = hattn.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                       return_lse=True)  # fmt: skip
        return out.float().sum(-1), lse + 1

    q, k, v = (t.to("meta") for t in fp8_qkv(2, 10, 12, 8, 2))
    scales = tuple(torch.empty(2, 2, device="meta") for _ in range(3))
    out, lse = torch.compile(f, backend="eager", fullgraph=True)(q, k, v, *scales)
    assert out.shape == (2, 10, 8) and lse.shape == (2, 8, 10)
    explanation = torch._dynamo.explain(f)(q, k, v, *scales)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# --- CPU: the binding and the layout rule -----------------------------------------------------------------


def fp8_problem(**overrides):
    """_C keyword arguments of a valid FP8 problem with stand-in (aligned, non-null) pointers."""
    B, SQ, SK, HQ, HKV = 2, 100, 130, 8, 2
    strides = lambda s, h: (s * h * D, h * D, D)  # noqa: E731
    kwargs = dict(
        dtype="e4m3", batch=B, seqlen_q=SQ, seqlen_k=SK, heads_q=HQ, heads_kv=HKV, head_dim=D,
        q=1 << 20, q_strides=strides(SQ, HQ), k=2 << 20, k_strides=strides(SK, HKV),
        v=3 << 20, v_strides=strides(SK, HKV), out=4 << 20, out_strides=strides(SQ, HQ),
        q_descale=5 << 20, k_descale=6 << 20, v_descale=7 << 20,
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


def test_binding_resolves_e4m3_to_the_final_kernel():
    assert binding(_C.resolve_kernel, **fp8_problem()) == LAST
    assert binding(_C.resolve_kernel, **fp8_problem(dtype="float8_e4m3fn")) == LAST
    earlier = hattn.kernels()[-2].name
    with pytest.raises(NotImplementedError, match=rf"{earlier}: no e4m3"):
        binding(_C.resolve_kernel, **fp8_problem(kernel=earlier))


def test_binding_refuses_what_fp8_does_not_run():
    with pytest.raises(NotImplementedError, match=r"dense batches only"):
        binding(_C.resolve_kernel, **fp8_problem(window_left=16))


def test_binding_descales_and_strides():
    with pytest.raises(ValueError, match=r"^invalid_argument: q_descale: "):
        binding(_C.resolve_kernel, **fp8_problem(dtype="bf16"))
    with pytest.raises(ValueError, match=r"^invalid_argument: v_descale: pointer must be 4-byte aligned"):
        binding(_C.resolve_kernel, **fp8_problem(v_descale=(7 << 20) + 2))
    # 16 bytes are 16 e4m3 elements: a seq stride of 2 * 128 + 8 is not a multiple.
    with pytest.raises(ValueError, match=r"^invalid_argument: k: seq stride 264"):
        binding(_C.resolve_kernel, **fp8_problem(k_strides=(130 * 264, 264, 128)))
    # out is bf16: 8 elements are 16 bytes.
    assert binding(_C.resolve_kernel, **fp8_problem(out_strides=(100 * 8 * 136, 8 * 136, 136))) == LAST


def test_binding_dtype_names():
    with pytest.raises(ValueError, match=r"dtype: must be 'bf16', 'fp16' or 'e4m3' \(got 'fp8'\)"):
        binding(_C.resolve_kernel, **fp8_problem(dtype="fp8"))


def test_binding_without_a_usable_gpu():
    if hopper_skip_reason() is None:
        pytest.skip("a Hopper GPU is present (the GPU tests below run the op)")
    with pytest.raises(RuntimeError, match=r"^no_device: "):
        binding(_C.workspace_size, **fp8_problem())


def test_layout_rule_counts_bytes():
    assert _kernel_layout_ok(torch.empty(2, 64, 4, 128, dtype=FP8))
    assert _kernel_layout_ok(torch.empty(2, 64, 3, 4, 128, dtype=FP8)[:, :, 1])  # packed qkv slice
    # A head stride of 136 elements: 272 bytes in bf16 (in place), 136 bytes in FP8 (copied).
    assert _kernel_layout_ok(torch.empty(2, 64, 4, 136, dtype=torch.bfloat16)[..., :128])
    assert not _kernel_layout_ok(torch.empty(2, 64, 4, 136, dtype=FP8)[..., :128])
    assert _kernel_layout_ok(torch.empty(2, 64, 4, 144, dtype=FP8)[..., :128])


# --- CPU: flash_attn_func's FP8 route ------------------------------------------------------------------


def test_flash_attn_func_routes_fp8_to_attention_fp8():
    q, k, v = fp8_qkv(1, 10, 12, 2, 2)
    # attention_fp8's own check answers: the call went there.
    with pytest.raises(ValueError, match=r"k: dtype must be torch.float8_e4m3fn \(attention_fp8"):
        hattn.flash_attn_func(q, k.to(torch.bfloat16), v, q_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"v_descale: shape must be"):
        hattn.flash_attn_func(q, k, v, causal=True, v_descale=torch.ones(2, 2))
    with pytest.raises(NotImplementedError, match=r"window_size=\(8, 0\) with FP8 inputs"):
        hattn.flash_attn_func(q, k, v, window_size=(8, 0))
    with pytest.raises(NotImplementedError, match=r"dropout_p"):
        hattn.flash_attn_func(q, k, v, dropout_p=0.1)


def test_flash_attn_func_refuses_descales_without_fp8():
    q = torch.randn(1, 10, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k_descale: only with torch.float8_e4m3fn q, k and v"):
        hattn.flash_attn_func(q, q, q, k_descale=torch.ones(1, 2))


# --- GPU: correctness ------------------------------------------------------------------------------------


def run_and_check(batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales, seed=0, head_dim=D):
    """attention_fp8 on random inputs against the float64 reference; returns (out, lse)."""
    q, k, v = fp8_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim=head_dim, device="cuda", seed=seed)
    descales = random_descales(batch, heads_kv, "cuda", seed + 1) if with_descales else (None, None, None)
    out, lse = hattn.attention_fp8(q, k, v, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                   causal=causal, return_lse=True)  # fmt: skip
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (batch, heads_q, seqlen_q)
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"

    qf, kf, vf = dequantize(q, k, v, descales)
    ref_out, ref_lse = attention_ref(qf, kf, vf, causal)
    lowp_out, lowp_lse = attention_lowp_fp8(qf, kf, vf, causal)
    err = (out.double() - ref_out).abs().max().item()
    lowp_err = (lowp_out.double() - ref_out).abs().max().item()
    # At D = 256 P V adds into O inside the tensor cores, whose adds keep about 14 bits of O's sum:
    # up to 2^-14 max |v| a k32 step of the keys (ref::fp8_pv_sum_error, the C++ test's allowance).
    pv_sum_error = 2.0**-14 * -(-seqlen_k // 32) * vf.abs().max().item() if head_dim == 256 else 0.0
    bound = 2 * lowp_err + 1e-3 + pv_sum_error
    label = f"B={batch} Sq={seqlen_q} Sk={seqlen_k} Hq={heads_q} Hkv={heads_kv} causal={causal}"
    assert err <= bound, f"{label}: out max error {err:.3e} > bound {bound:.3e} (e4m3-P reference's {lowp_err:.3e})"

    dead = masked_rows(seqlen_q, seqlen_k, causal).to(q.device)
    if dead.any():
        assert (out[:, dead] == 0).all(), "rows that see no key must give output 0"
        assert torch.isneginf(lse[:, :, dead]).all(), "rows that see no key must give lse -inf"
    live = ~dead
    assert torch.isfinite(lse[:, :, live]).all(), "lse must be finite on rows that see a key"
    lerr = (lse[:, :, live].double() - ref_lse[:, :, live]).abs().max().item()
    lowp_lerr = (lowp_lse[:, :, live].double() - ref_lse[:, :, live]).abs().max().item()
    # Hopper's FP8 wgmma keeps about 14 bits while it sums q.k (DeepSeek-V3's report): each k32
    # step of the head dimension may lose 2^-13 of scale |q| |k|, and so may the LSE
    # (ref::fp8_score_error, the C++ test's allowance too).
    scale = qf.shape[-1] ** -0.5
    steps = (qf.shape[-1] + 31) // 32
    score_error = steps * 2.0**-13 * scale * qf.norm(dim=-1).max().item() * kf.norm(dim=-1).max().item()
    lbound = 2 * lowp_lerr + 2e-4 + score_error
    assert lerr <= lbound, f"{label}: lse max error {lerr:.3e} > bound {lbound:.3e} (lowp: {lowp_lerr:.3e})"
    return out, lse


@requires_hopper
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales",
    [
        (1, 128, 128, 2, 2, False, False),  # one tile, no descales
        (2, 200, 333, 8, 2, False, True),  # lengths no tile multiple, GQA 4
        (2, 200, 333, 8, 2, True, True),  # causal, Sq < Sk
        (1, 333, 200, 4, 4, True, True),  # causal, Sq > Sk: rows that see no key
        (2, 257, 640, 8, 2, True, False),
        (1, 77, 1500, 4, 1, False, True),  # MQA, a long sweep
        (2, 1000, 1000, 8, 2, True, True),  # several tiles each way
        (1, 64, 16384, 2, 2, False, True),  # 128 tiles summed into O
    ],
)  # fmt: skip
def test_matches_reference(batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales):
    run_and_check(batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales)


@requires_hopper
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: P V summed in O inside the tensor cores
@pytest.mark.parametrize(
    "batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales",
    [
        (1, 128, 128, 2, 2, False, False),
        (2, 200, 333, 8, 2, True, True),
        (1, 333, 200, 4, 4, True, True),
        (1, 64, 8192, 2, 2, False, True),
    ],
)  # fmt: skip
def test_matches_reference_other_head_dims(batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales,
                                           head_dim):
    run_and_check(batch, seqlen_q, seqlen_k, heads_q, heads_kv, causal, with_descales, head_dim=head_dim)


@requires_hopper
def test_no_descales_are_ones_and_v_descale_scales_out():
    q, k, v = fp8_qkv(2, 200, 333, 8, 2, device="cuda")
    ones = torch.ones(2, 2, device="cuda")
    plain = hattn.attention_fp8(q, k, v, causal=True)
    torch.testing.assert_close(hattn.attention_fp8(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones,
                                                   causal=True), plain, rtol=0, atol=0)  # fmt: skip
    # The kernel scales O's normalizer by v_descale in fp32: a factor of 2 is exact through bf16.
    twice = hattn.attention_fp8(q, k, v, v_descale=2 * ones, causal=True)
    torch.testing.assert_close(twice.float(), 2 * plain.float(), rtol=0, atol=0)
    # A broadcast (expanded) scale is copied to the [B, Hkv] array the kernel reads.
    expanded = torch.tensor(2.0, device="cuda").expand(2, 2)
    torch.testing.assert_close(hattn.attention_fp8(q, k, v, v_descale=expanded, causal=True), twice, rtol=0, atol=0)


@requires_hopper
def test_strided_views_and_odd_layouts():
    """Slices of a packed FP8 qkv are read in place; a 136-byte head stride is copied first."""
    B, S, H = 2, 300, 4
    qkv = (torch.randn(B, S, 3, H, D, device="cuda") + 0.3).to(FP8)
    q, k, v = qkv.unbind(2)
    assert all(_kernel_layout_ok(t) for t in (q, k, v))
    expected = hattn.attention_fp8(*(t.contiguous() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(hattn.attention_fp8(q, k, v, causal=True), expected, rtol=0, atol=0)
    wide = torch.empty(B, S, H, D + 8, device="cuda", dtype=FP8)
    wide[..., :D] = q
    odd = wide[..., :D]
    assert not _kernel_layout_ok(odd)
    torch.testing.assert_close(hattn.attention_fp8(odd, k, v, causal=True), expected, rtol=0, atol=0)


@requires_hopper
def test_gpu_errors():
    q, k, v = fp8_qkv(2, 64, 64, 4, 2, device="cuda")
    with pytest.raises(ValueError, match=r"k: dtype must be torch.float8_e4m3fn"):
        hattn.attention_fp8(q, k.to(torch.bfloat16), v)
    with pytest.raises(ValueError, match=r"q_descale: shape must be \(batch, heads_kv\) = \(2, 2\)"):
        hattn.attention_fp8(q, k, v, q_descale=torch.ones(2, 4, device="cuda"))
    with pytest.raises(ValueError, match=r"k_descale: must be a CUDA tensor, got device cpu"):
        hattn.attention_fp8(q, k, v, k_descale=torch.ones(2, 2))
    earlier = hattn.kernels()[-2].name
    with pytest.raises(NotImplementedError, match=r"no e4m3"):
        hattn.attention_fp8(q, k, v, kernel=earlier)


@requires_hopper
def test_flash_attn_func_fp8_is_attention_fp8():
    q, k, v = fp8_qkv(2, 200, 333, 8, 2, device="cuda")
    qd, kd, vd = random_descales(2, 2, "cuda")
    expected = hattn.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    got = hattn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got = hattn.flash_attn_func(q, k, v, window_size=(-1, 0), q_descale=qd, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)  # (-1, 0) is the causal mask


# --- GPU: the op in torch.compile, CUDA graphs, opcheck ------------------------------------------------------


@requires_hopper
def test_compile_fullgraph():
    torch._dynamo.reset()

    def f(q, k, v, qd, kd, vd):
        out, lse = hattn.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                                       return_lse=True)  # fmt: skip
        return out * 2, lse

    q, k, v = fp8_qkv(2, 300, 300, 8, 2, device="cuda")
    scales = random_descales(2, 2, "cuda")
    out, lse = torch.compile(f, fullgraph=True)(q, k, v, *scales)
    expected, expected_lse = f(q, k, v, *scales)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)


@requires_hopper
def test_cuda_graph_capture_and_replay():
    q, k, v = fp8_qkv(2, 300, 300, 8, 2, device="cuda", seed=1)
    scales = list(random_descales(2, 2, "cuda", seed=2))
    kw = lambda: dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2], causal=True)  # noqa: E731
    hattn.attention_fp8(q, k, v, **kw())  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hattn.attention_fp8(q, k, v, **kw())
    for seed in (3, 4):  # new inputs and scales copied into the captured buffers, then replay
        q2, k2, v2 = fp8_qkv(2, 300, 300, 8, 2, device="cuda", seed=seed)
        s2 = random_descales(2, 2, "cuda", seed=seed + 10)
        for dst, src in zip((q, k, v, *scales), (q2, k2, v2, *s2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = hattn.attention_fp8(q2, k2, v2, q_descale=s2[0], k_descale=s2[1], v_descale=s2[2], causal=True)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@requires_hopper
def test_opcheck():
    q, k, v = fp8_qkv(2, 130, 200, 4, 2, device="cuda")
    qd, kd, vd = random_descales(2, 2, "cuda")
    # Not test_schema: its mutation check compares inputs with allclose, which float8 lacks.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    for args in ((q, k, v, qd, kd, vd, False, None, "auto", True), (q, k, v, None, None, vd, True, 0.2, "auto", False)):
        torch.library.opcheck(torch.ops.hattn.attention_fp8_fwd.default, args, test_utils=utils)
