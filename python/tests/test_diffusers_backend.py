"""hattn as diffusers' attention backend "hattn" (hattn.register_diffusers_backend).

CPU: registration (the name in diffusers' enum and registry, idempotent), and the backend's
plumbing with hattn's kernels replaced by the fp64 reference (layouts, return_lse, the fallback to
diffusers' "native" backend, the context-parallel ops, a small Wan transformer set to "hattn").
GPU: the same small transformer with hattn's kernels, against the "native" backend, forward and
gradients. All skip without diffusers.
"""

import functools

import pytest
import torch
from helpers import attention_ref, requires_hopper

pytest.importorskip("diffusers", reason="the diffusers backend needs diffusers; pip install diffusers")
from diffusers.models import attention_dispatch as dispatch  # noqa: E402

import hattn  # noqa: E402
import hattn.diffusers_backend as backend  # noqa: E402

hattn.register_diffusers_backend()


@pytest.fixture
def active_backend_restored():
    """set_attention_backend and attention_backend change diffusers' process-wide active backend."""
    before = dispatch._AttentionBackendRegistry._active_backend
    yield
    dispatch._AttentionBackendRegistry.set_active_backend(before)


def reference_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """hattn.attention's contract (BSHD, bottom-right causal, GQA, lse [B, H, S]) in fp64, in the inputs' dtype."""
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


@pytest.fixture
def kernels_on_the_cpu(monkeypatch):
    """hattn's kernels replaced by the reference, and the fallback rules without the device rule, so
    that the backend's own logic runs on CPU tensors."""
    monkeypatch.setattr(backend, "attention", reference_attention)
    monkeypatch.setattr(backend, "sdpa_fallback_reason", functools.partial(hattn.sdpa_fallback_reason, check_device=False))


def bshd(batch, seqlen, heads, head_dim=64, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, heads, head_dim, generator=gen, dtype=dtype)


def test_registered_as_a_backend():
    name = dispatch.AttentionBackendName("hattn")
    assert name.value == "hattn" and name is dispatch.AttentionBackendName.HATTN
    assert name in dispatch._AttentionBackendRegistry.list_backends()
    assert "hattn" in {x.value for x in dispatch.AttentionBackendName.__members__.values()}  # set_attention_backend's check
    assert dispatch._AttentionBackendRegistry._is_context_parallel_available(name)
    function = dispatch._AttentionBackendRegistry._backends[name]
    assert hattn.register_diffusers_backend() == "hattn"  # again: nothing changes
    assert dispatch._AttentionBackendRegistry._backends[name] is function
    assert {"query", "key", "value", "attn_mask", "is_causal", "scale", "enable_gqa", "return_lse",
            "_parallel_config"} <= dispatch._AttentionBackendRegistry._supported_arg_names[name]


@pytest.mark.parametrize("causal", [False, True])
def test_runs_hattn_in_diffusers_layout(kernels_on_the_cpu, active_backend_restored, causal):
    q, k, v = bshd(2, 33, 4, seed=1), bshd(2, 33, 2, seed=2), bshd(2, 33, 2, seed=3)  # GQA 2
    before = backend.backend_calls()["hattn"]
    with dispatch.attention_backend("hattn"):
        out, lse = dispatch.dispatch_attention_fn(q, k, v, is_causal=causal, enable_gqa=True,
                                                  attention_kwargs={"return_lse": True})
        plain = dispatch.dispatch_attention_fn(q, k, v, is_causal=causal, enable_gqa=True)
    want_out, want_lse = attention_ref(q, k, v, causal=causal)
    assert backend.backend_calls()["hattn"] == before + 2
    assert out.shape == q.shape and lse.shape == (2, 33, 4)  # lse [B, S, H], diffusers' layout
    torch.testing.assert_close(out.double(), want_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, out)
    # The same as diffusers' native backend (torch SDPA), whose causal mask agrees at equal lengths.
    with dispatch.attention_backend("native"):
        native = dispatch.dispatch_attention_fn(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, native, atol=2e-2, rtol=2e-2)


def test_what_hattn_cannot_run_goes_to_native(kernels_on_the_cpu, active_backend_restored):
    q, k, v = bshd(1, 16, 2, seed=4), bshd(1, 24, 2, seed=5), bshd(1, 24, 2, seed=6)
    mask = torch.rand(1, 2, 16, 24) > 0.3
    counts = backend.backend_calls()
    with dispatch.attention_backend("hattn"):
        out = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask)  # a mask: hattn has none
        causal = dispatch.dispatch_attention_fn(q, k, v, is_causal=True)  # L != S: SDPA's mask is top-left
        with pytest.raises(ValueError, match=r"return_lse=True, but hattn cannot run this call \(attn_mask is given"):
            dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, attention_kwargs={"return_lse": True})
    assert backend.backend_calls() == {"hattn": counts["hattn"], "native": counts["native"] + 2}
    with dispatch.attention_backend("native"):
        torch.testing.assert_close(out, dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask))
        torch.testing.assert_close(causal, dispatch.dispatch_attention_fn(q, k, v, is_causal=True))


def test_context_parallel_ops(monkeypatch):
    """The ops diffusers' templated ring/Ulysses attention calls: lse in [B, S, H] out of the forward,
    back to [B, H, S] into the backward, which takes the merged out and lse it is given."""
    calls = {}

    def fwd(q, k, v, causal, scale, kernel, return_lse):
        calls["fwd"] = (causal, scale, kernel, return_lse)
        return reference_attention(q, k, v, causal, scale, return_lse=True)

    def bwd(dout, q, k, v, out, lse, causal, scale):
        calls["bwd"] = (out, lse, causal, scale)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(backend, "attention_fwd", fwd)
    monkeypatch.setattr(backend, "attention_bwd", bwd)
    monkeypatch.setattr(backend, "sdpa_fallback_reason", functools.partial(hattn.sdpa_fallback_reason, check_device=False))

    class Ctx:
        def save_for_backward(self, *tensors):
            self.saved_tensors = tensors

    ctx = Ctx()
    q, k, v = bshd(1, 20, 2, seed=7), bshd(1, 20, 2, seed=8), bshd(1, 20, 2, seed=9)
    out, lse = backend._forward_op(ctx, q, k, v, scale=0.2, return_lse=True)
    assert calls["fwd"] == (False, 0.2, "auto", True)
    assert lse.shape == (1, 20, 2)
    merged_out, merged_lse = out + 1, lse + 1  # what the ring hands the backward: the merged result
    dq, dk, dv = backend._backward_op(ctx, torch.ones_like(out), out=merged_out, lse=merged_lse)
    got_out, got_lse, causal, scale = calls["bwd"]
    assert got_out is merged_out and (causal, scale) == (False, 0.2)
    torch.testing.assert_close(got_lse, merged_lse.transpose(1, 2))
    assert got_lse.is_contiguous() and dq.shape == q.shape
    with pytest.raises(ValueError, match="context parallel.*attn_mask is given"):
        backend._forward_op(ctx, q, k, v, attn_mask=torch.ones(1, 2, 20, 20, dtype=torch.bool))


def tiny_wan(device, dtype):
    from hattn import capstone

    model, config = capstone.build_model("tiny", device, dtype, 0)
    latents, timestep, text = capstone.make_inputs("tiny", "tiny", config, device, dtype, 0)
    return model, (latents, timestep, text)


def run_wan(model, inputs, backend_name):
    model.set_attention_backend(backend_name)
    with torch.no_grad():
        return model(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2], return_dict=False)[0]


def test_a_wan_transformer_set_to_hattn(kernels_on_the_cpu, active_backend_restored):
    model, inputs = tiny_wan("cpu", torch.bfloat16)
    native = run_wan(model, inputs, "native")
    before = backend.backend_calls()["hattn"]
    got = run_wan(model, inputs, "hattn")
    assert backend.backend_calls()["hattn"] > before  # self and cross attention of both layers
    torch.testing.assert_close(got.float(), native.float(), atol=3e-2, rtol=3e-2)


@requires_hopper
def test_a_wan_transformer_on_hattns_kernels(active_backend_restored):
    model, inputs = tiny_wan("cuda", torch.bfloat16)
    native = run_wan(model, inputs, "native")
    before = backend.backend_calls()
    got = run_wan(model, inputs, "hattn")
    after = backend.backend_calls()
    assert after["hattn"] > before["hattn"] and after["native"] == before["native"]
    torch.testing.assert_close(got.float(), native.float(), atol=3e-2, rtol=3e-2)


@requires_hopper
def test_lse_and_gradients_on_hattns_kernels(active_backend_restored):
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 300, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (8, 2, 2))
    with dispatch.attention_backend("hattn"):
        out, lse = dispatch.dispatch_attention_fn(q, k, v, is_causal=True, enable_gqa=True,
                                                  attention_kwargs={"return_lse": True})
    want_out, want_lse = hattn.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse.transpose(1, 2))
    grads = []
    for name in ("hattn", "native"):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        with dispatch.attention_backend(name):
            dispatch.dispatch_attention_fn(qq, kk, vv, is_causal=True, enable_gqa=True).float().square().sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
