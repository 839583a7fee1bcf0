"""hattn.scaled_dot_product_attention, the drop-in for torch's SDPA, and hattn.patch_sdpa.

The CPU tests run everywhere: which calls hattn takes and which it hands to torch, and that a
handed-over call is torch's own. The GPU tests (Hopper only) check the calls hattn runs, and
their gradients, against the fp64 reference, and the drop-in under torch.compile.
"""

import math

import hattn
import pytest
import torch
import torch.nn.functional as F
from helpers import INPUT_MEAN, attention_ref, check_gradients, error_bound, gradients, make_qkv, requires_hopper
from hattn.sdpa import _torch_sdpa, sdpa_fallback_reason

B, H, L, E = 2, 4, 64, 64


def bhsd(batch=B, heads=H, seqlen=L, head_dim=E, dtype=torch.bfloat16, device="cpu", requires_grad=False):
    t = torch.randn(batch, heads, seqlen, head_dim, dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


def reason(q, k, v, **kwargs):
    return sdpa_fallback_reason(q, k, v, check_device=False, **kwargs)


# --- which calls hattn takes (CPU) -------------------------------------------------------------------


def test_supported_call_has_no_fallback_reason():
    q, k, v = bhsd(), bhsd(), bhsd()
    assert reason(q, k, v) is None
    assert reason(q, k, v, is_causal=True) is None
    assert reason(bhsd(heads=8), k, v, enable_gqa=True) is None  # GQA 2
    assert reason(bhsd(seqlen=100), bhsd(seqlen=37), bhsd(seqlen=37)) is None  # L != S without a mask


@pytest.mark.parametrize(
    "why, make, kwargs, words",
    [
        ("3-D", lambda: (bhsd()[0], bhsd()[0], bhsd()[0]), {}, "3-D"),
        ("fp32", lambda: (bhsd(dtype=torch.float32),) * 3, {}, "dtypes"),
        ("mixed dtypes", lambda: (bhsd(), bhsd(dtype=torch.float16), bhsd()), {}, "dtypes"),
        ("head dim 96", lambda: (bhsd(head_dim=96),) * 3, {}, "head dims"),
        ("value head dim", lambda: (bhsd(), bhsd(), bhsd(head_dim=128)), {}, "head dims"),
        ("empty", lambda: (bhsd(seqlen=0),) * 3, {}, "size 0"),
        ("mask", lambda: (bhsd(), bhsd(), bhsd()), {"attn_mask": torch.ones(L, L, dtype=torch.bool)}, "attn_mask"),
        ("dropout", lambda: (bhsd(), bhsd(), bhsd()), {"dropout_p": 0.1}, "dropout"),
        ("gqa without flag", lambda: (bhsd(heads=8), bhsd(), bhsd()), {}, "enable_gqa"),
        ("gqa not a multiple", lambda: (bhsd(heads=6), bhsd(), bhsd()), {"enable_gqa": True}, "enable_gqa"),
        ("causal L != S", lambda: (bhsd(seqlen=100), bhsd(seqlen=37), bhsd(seqlen=37)), {"is_causal": True}, "top-left"),
    ],
)
def test_unsupported_calls_say_why(why, make, kwargs, words):
    q, k, v = make()
    r = reason(q, k, v, **kwargs)
    assert r is not None and words in r, (why, r)


def test_inputs_that_need_grad_have_no_fallback_reason():
    # hattn has a backward: training calls run on it like inference ones.
    q, k, v = (bhsd(requires_grad=True) for _ in range(3))
    assert reason(q, k, v) is None
    assert reason(q, bhsd(), bhsd(), is_causal=True) is None
    assert reason(bhsd(heads=8, requires_grad=True), k, v, enable_gqa=True) is None


def test_deterministic_mode_never_falls_back():
    # Under torch.use_deterministic_algorithms the backward is hattn's deterministic one, which has
    # a fixed order at every head dim, with GQA too.
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert reason(bhsd(requires_grad=True), bhsd(), bhsd()) is None
        q256 = bhsd(heads=8, head_dim=256, requires_grad=True)
        k256, v256 = bhsd(head_dim=256), bhsd(head_dim=256)
        assert reason(bhsd(head_dim=256, requires_grad=True), k256, v256) is None  # no GQA
        assert reason(q256, k256, v256, enable_gqa=True) is None
    finally:
        torch.use_deterministic_algorithms(previous)


def test_cpu_tensors_fall_back_on_the_device_rule():
    q, k, v = bhsd(), bhsd(), bhsd()
    assert "Hopper" in sdpa_fallback_reason(q, k, v)


# --- handed-over calls are torch's own (CPU) ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"scale": 0.3},
        {"attn_mask": torch.randn(L, L, dtype=torch.float32).to(torch.bfloat16)},
        {"enable_gqa": True},
    ],
    ids=["plain", "causal", "scale", "mask", "gqa"],
)
def test_fallback_matches_torch_exactly(kwargs):
    torch.manual_seed(0)
    heads_q = 8 if kwargs.get("enable_gqa") else H
    q, k, v = bhsd(heads=heads_q), bhsd(), bhsd()
    out = hattn.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, _torch_sdpa(q, k, v, **kwargs), rtol=0, atol=0)


def test_fallback_keeps_torch_errors():
    q, k, v = bhsd(heads=8), bhsd(), bhsd()  # GQA without enable_gqa: torch refuses it
    with pytest.raises(RuntimeError) as ours:
        hattn.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as theirs:
        _torch_sdpa(q, k, v)
    assert str(ours.value) == str(theirs.value)


def test_fallback_keeps_autograd():
    q, k, v = bhsd(dtype=torch.float32, requires_grad=True), bhsd(dtype=torch.float32), bhsd(dtype=torch.float32)
    hattn.scaled_dot_product_attention(q, k, v).sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_patch_sdpa_swaps_and_restores():
    assert F.scaled_dot_product_attention is _torch_sdpa
    with hattn.patch_sdpa():
        assert F.scaled_dot_product_attention is hattn.scaled_dot_product_attention
        q, k, v = bhsd(), bhsd(), bhsd()
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), _torch_sdpa(q, k, v), rtol=0, atol=0)
    assert F.scaled_dot_product_attention is _torch_sdpa


def test_patch_sdpa_restores_after_an_exception():
    with pytest.raises(KeyError):
        with hattn.patch_sdpa():
            raise KeyError("inside the block")
    assert F.scaled_dot_product_attention is _torch_sdpa


def test_traces_without_graph_breaks():
    # Dynamo follows the rules and the fallback in one graph (backend="eager": tracing only).
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: hattn.scaled_dot_product_attention(q, k, v, is_causal=True) * 2,
                      fullgraph=True, backend="eager")
    q = bhsd()
    torch.testing.assert_close(f(q, q, q), _torch_sdpa(q, q, q, is_causal=True) * 2, rtol=0, atol=0)


# --- calls hattn runs (GPU) ---------------------------------------------------------------------------


def check_against_reference(q, k, v, out, causal=False, scale=None):
    """out [B, H, L, E] of BHSD inputs against the fp64 reference (helpers take BSHD)."""
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    ref, _ = attention_ref(qs, ks, vs, causal, scale, upcast=True)
    naive, _ = attention_ref(qs, ks, vs, causal, scale, upcast=False)
    got = out.transpose(1, 2)
    assert not torch.isnan(got).any()
    err = (got.double() - ref).abs().max().item()
    bound = error_bound(ref, naive, q.dtype)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"


def cuda_bhsd(batch, heads, seqlen, head_dim, dtype, seed):
    q, _, _ = make_qkv(batch, seqlen, seqlen, heads, heads, head_dim, dtype, seed=seed)  # BSHD
    return q.transpose(1, 2).contiguous()


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hattn_runs_supported_calls(dtype, head_dim, causal):
    q = cuda_bhsd(2, 8, 300, head_dim, dtype, seed=1)
    k = cuda_bhsd(2, 2, 300, head_dim, dtype, seed=2)
    v = cuda_bhsd(2, 2, 300, head_dim, dtype, seed=3)
    assert sdpa_fallback_reason(q, k, v, is_causal=causal, enable_gqa=True) is None
    out = hattn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # [B, L, H, E] storage, as torch's flash backend gives
    check_against_reference(q, k, v, out, causal)


@requires_hopper
def test_hattn_runs_cross_attention_and_scale():
    q = cuda_bhsd(1, 4, 200, 128, torch.bfloat16, seed=4)
    kv = cuda_bhsd(1, 4, 77, 128, torch.bfloat16, seed=5)
    out = hattn.scaled_dot_product_attention(q, kv, kv, scale=0.05)
    check_against_reference(q, kv, kv, out, scale=0.05)


def sdpa_ref(q, k, v, is_causal=False, scale=None):
    """attention_ref on BHSD tensors (it takes BSHD); with is_causal, L == S, where SDPA's
    top-left mask and the reference's bottom-right one agree."""
    out, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, scale)
    return out.transpose(1, 2)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, scale",
    [
        (4, 2, 37, 53, 64, False, None),  # GQA 2 (enable_gqa), lengths not multiples of 64
        (4, 4, 130, 130, 128, True, None),
        (8, 1, 100, 100, 128, False, 0.05),  # MQA
        (2, 2, 70, 70, 64, True, 0.2),
    ],
)
def test_gradients_match_reference(heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, scale, dtype):
    """query, key and value grads through the drop-in (run by hattn, not torch) against the fp64 reference."""
    q = cuda_bhsd(2, heads_q, seqlen_q, head_dim, dtype, seed=11)
    k = cuda_bhsd(2, heads_kv, seqlen_k, head_dim, dtype, seed=12)
    v = cuda_bhsd(2, heads_kv, seqlen_k, head_dim, dtype, seed=13)
    dout = cuda_bhsd(2, heads_q, seqlen_q, head_dim, dtype, seed=14)
    gqa = heads_q != heads_kv
    q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
    assert sdpa_fallback_reason(q_, k_, v_, is_causal=causal, enable_gqa=gqa) is None
    got = gradients(
        lambda q, k, v: hattn.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa),
        q, k, v, dout,
    )  # fmt: skip
    want = gradients(
        lambda q, k, v: sdpa_ref(q, k, v, causal, scale), q.double(), k.double(), v.double(), dout.double()
    )
    check_gradients(got, want, dtype, f"H {heads_q}/{heads_kv} L {seqlen_q} S {seqlen_k} E {head_dim} causal={causal}")


@requires_hopper
def test_gradients_through_packed_views():
    """q, k, v as [B, H, L, E] views of one [B, L, 3, H, E] projection, as a transformer block makes
    them: the gradient reaches the packed tensor, each third within the reference bound."""
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(15)
    qkv = torch.randn(2, 200, 3, 4, 128, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN
    dout = torch.randn(2, 4, 200, 128, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    def grad_of_packed(packed, attend):
        packed = packed.detach().requires_grad_()
        q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, L, E] views
        attend(q, k, v).backward(dout.to(packed.dtype))
        return packed.grad.unbind(2)  # (dq, dk, dv), each [B, L, H, E]

    got = grad_of_packed(qkv, lambda q, k, v: hattn.scaled_dot_product_attention(q, k, v, is_causal=True))
    want = grad_of_packed(qkv.double(), lambda q, k, v: sdpa_ref(q, k, v, is_causal=True))
    check_gradients(got, want, dtype, "packed")


@requires_hopper
def test_unsupported_cuda_calls_run_torch():
    q = cuda_bhsd(1, 4, 128, 128, torch.bfloat16, seed=6)
    mask = torch.rand(128, 128, device="cuda") > 0.5
    out = hattn.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch.testing.assert_close(out, _torch_sdpa(q, q, q, attn_mask=mask), rtol=0, atol=0)


@requires_hopper
def test_patched_model_uses_hattn():
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 3 * 512, device="cuda", dtype=torch.bfloat16) / math.sqrt(512)

    def block(x):  # how a transformer block calls SDPA: [B, H, L, E] views of one projection
        q, k, v = (x @ w).view(2, 256, 3, 4, 128).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 256, 512)

    expected = block(x)
    with hattn.patch_sdpa():
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@requires_hopper
def test_compile_fullgraph():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: hattn.scaled_dot_product_attention(q, k, v, is_causal=True) * 2, fullgraph=True)
    q = cuda_bhsd(1, 8, 512, 128, torch.bfloat16, seed=7)
    torch.testing.assert_close(f(q, q, q), hattn.scaled_dot_product_attention(q, q, q, is_causal=True) * 2,
                               rtol=0, atol=0)
