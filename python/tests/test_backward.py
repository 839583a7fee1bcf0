"""The backward through hattn.attention and hattn.attention_varlen (torch.autograd): dq, dk and dv
against the fp64 reference's autograd gradients (GPU; per sequence for varlen), and the ops'
schemas, fakes and refusals (CPU)."""

import hattn
import pytest
import torch
from helpers import (
    INPUT_MEAN,
    attention_ref,
    check_gradients,
    cu_seqlens_of,
    gradients,
    requires_hopper,
    varlen_attention_ref,
)


def test_backward_op_schema():
    schema = str(torch.ops.hattn.attention_bwd.default._schema)
    assert schema.startswith(
        "hattn::attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float? softmax_scale, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., bool deterministic=False) "
        "-> (Tensor, Tensor, Tensor)"
    )


def test_backward_fake_shapes():
    q = torch.empty(2, 5, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 5, device="meta")
    dq, dk, dv = torch.ops.hattn.attention_bwd(q, q, k, k, q, lse, False, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_varlen_backward_op_schema():
    schema = str(torch.ops.hattn.attention_varlen_bwd.default._schema)
    assert schema.startswith(
        "hattn::attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, "
        "float? softmax_scale, SymInt window_left=-1, SymInt window_right=-1, float softcap=0., bool deterministic=False) "
        "-> (Tensor, Tensor, Tensor)"
    )


def test_varlen_backward_fake_shapes():
    q = torch.empty(15, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(21, 2, 64, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(4, 15, device="meta")
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    dq, dk, dv = torch.ops.hattn.attention_varlen_bwd(q, q, k, k, q, lse, cu, cu, 10, 12, True, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_varlen_gradients_reach_the_op():
    # attention_varlen is differentiable: a call with gradients goes on to the device check.
    q = torch.randn(16, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 10, 16], dtype=torch.int32)
    with pytest.raises((RuntimeError, ValueError), match=r"no suitable GPU|must be a CUDA tensor"):
        hattn.attention_varlen(q, q.detach(), q.detach(), cu, cu, 10, 10, causal=True)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "lens_q, lens_k, heads, head_dim, causal, window",
    [
        ([100, 257, 1, 128], [100, 257, 1, 128], (4, 2), 128, False, (-1, -1)),  # tails, one row, GQA 2
        ([60, 50, 40], [60, 0, 45], (4, 2), 64, True, (-1, -1)),  # a sequence without keys
        ([300, 0, 77], [300, 5, 130], (2, 1), 64, True, (-1, -1)),  # a sequence without queries, MQA
        ([130, 8, 300], [200, 500, 9], (2, 1), 128, False, (40, -1)),  # a window; Sq > Sk and Sq < Sk
        ([190, 64, 1], [190, 64, 1], (2, 2), 256, True, (-1, -1)),  # D = 256 (two passes)
    ],
)
def test_varlen_backward_matches_reference(lens_q, lens_k, heads, head_dim, causal, window, dtype):
    """dq, dk, dv through hattn.attention_varlen against the fp64 reference run on each sequence alone."""
    heads_q, heads_kv = heads
    gen = torch.Generator(device="cuda").manual_seed(sum(lens_q) * 31 + head_dim)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    total_q, total_k = sum(lens_q), sum(lens_k)
    q, k, v, dout = rand(total_q, heads_q), rand(total_k, heads_kv), rand(total_k, heads_kv), rand(total_q, heads_q)
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)
    got = gradients(
        lambda q, k, v: hattn.attention_varlen(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window
        ),
        q, k, v, dout,
    )  # fmt: skip
    want = gradients(
        lambda q, k, v: varlen_attention_ref(q, k, v, lens_q, lens_k, causal=causal, window=window),
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, dtype, f"varlen {lens_q}/{lens_k} causal={causal} window={window}")


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, causal, window",
    [
        ((2, 37, 53, 4, 2, 64), False, (-1, -1)),
        ((1, 70, 70, 2, 2, 128), True, (-1, -1)),
        ((1, 40, 130, 8, 2, 256), True, (30, 0)),
        ((2, 129, 129, 3, 3, 64), False, (20, 10)),
    ],
)
def test_backward_matches_reference(shape, causal, window, dtype):
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 31 + head_dim)

    def rand(seqlen, heads):
        return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    q, k, v, dout = rand(seqlen_q, heads_q), rand(seqlen_k, heads_kv), rand(seqlen_k, heads_kv), rand(seqlen_q, heads_q)
    got = gradients(lambda q, k, v: hattn.attention(q, k, v, causal=causal, window_size=window), q, k, v, dout)
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window)[0],
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, dtype)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape, causal, window, softcap",
    [
        ((2, 37, 53, 4, 2, 64), False, (-1, -1), 2.0),  # a cap inside the scores' range: tanh bends
        ((1, 200, 300, 4, 2, 128), True, (-1, -1), 1.5),
        ((1, 192, 256, 2, 1, 64), False, (70, -1), 30.0),  # a loose cap, a window
        ((2, 150, 200, 4, 2, 256), True, (-1, -1), 5.0),  # D = 256 (two passes): causal, GQA
    ],
)
def test_softcap_backward_matches_reference(shape, causal, window, softcap, dtype):
    """dq, dk, dv through hattn.attention with softcap (bwd_sm90: one pass up to D = 128, two at
    256) against the capped fp64 reference's autograd
    gradients; the same sequences as a variable-length batch too."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 37 + head_dim)

    def rand(*size):
        return torch.randn(*size, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    q, k, v = rand(batch, seqlen_q, heads_q), rand(batch, seqlen_k, heads_kv), rand(batch, seqlen_k, heads_kv)
    dout = rand(batch, seqlen_q, heads_q)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    got = gradients(lambda q, k, v: hattn.attention(q, k, v, **kwargs), q, k, v, dout)
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window, softcap=softcap)[0],
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(got, want, dtype, f"softcap={softcap}")
    # The same sequences packed as a variable-length batch.
    lens_q, lens_k = [seqlen_q] * batch, [seqlen_k] * batch
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)
    packed = [t.flatten(0, 1) for t in (q, k, v, dout)]
    got = gradients(
        lambda q, k, v: hattn.attention_varlen(q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, **kwargs), *packed
    )  # fmt: skip
    want = gradients(
        lambda q, k, v: varlen_attention_ref(q, k, v, lens_q, lens_k, causal=causal, window=window, softcap=softcap),
        *(t.double() for t in packed),
    )  # fmt: skip
    check_gradients(got, want, dtype, f"varlen softcap={softcap}")


def test_deterministic_must_be_a_bool():
    q = torch.randn(1, 8, 4, 256, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, 2, 256, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="deterministic: must be a bool"):
        hattn.attention(q, k, k, deterministic=1)


def _repeated_gradients(run, q, k, v, dout, repeats):
    """dq, dk, dv of `repeats` backwards, each while another (unordered) backward of the same
    inputs runs on a second stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs are made
    results = []
    for _ in range(repeats):
        with torch.cuda.stream(side):
            busy = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            torch.autograd.grad(run(*busy, False), busy, dout)
        results.append(gradients(lambda q, k, v: run(q, k, v, True), q, k, v, dout))
    torch.cuda.synchronize()
    return results


@requires_hopper
@pytest.mark.parametrize(
    "shape, causal, window",
    [
        ((2, 300, 517, 8, 2, 64), True, (-1, -1)),
        ((1, 700, 700, 4, 1, 128), False, (100, -1)),
        ((1, 333, 450, 2, 2, 256), True, (-1, -1)),
    ],
)
def test_deterministic_gradients_are_bitwise_equal(shape, causal, window):
    """deterministic=True: 20 backwards bitwise equal with other work on another stream; and
    the gradients as close to the reference as the default's."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q * 7 + head_dim)

    def rand(seqlen, heads):
        return torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = rand(seqlen_q, heads_q), rand(seqlen_k, heads_kv), rand(seqlen_k, heads_kv), rand(seqlen_q, heads_q)

    def run(q, k, v, deterministic):
        return hattn.attention(q, k, v, causal=causal, window_size=window, deterministic=deterministic)

    first, *rest = _repeated_gradients(run, q, k, v, dout, 20)
    for i, again in enumerate(rest):
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} of repeat {i + 1} differs from the first"
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window)[0],
        q.double(), k.double(), v.double(), dout.double(),
    )  # fmt: skip
    check_gradients(first, want, torch.bfloat16)


@requires_hopper
def test_deterministic_varlen_gradients_are_bitwise_equal():
    lens_q, lens_k, heads_q, heads_kv, head_dim = [300, 1, 0, 517], [400, 64, 9, 517], 4, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(11)

    def rand(rows, h):
        return torch.randn(rows, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v, dout = rand(sum(lens_q), heads_q), rand(sum(lens_k), heads_kv), rand(sum(lens_k), heads_kv), rand(
        sum(lens_q), heads_q)  # fmt: skip
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)

    def run(q, k, v, deterministic):
        return hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      deterministic=deterministic)  # fmt: skip

    first, *rest = _repeated_gradients(run, q, k, v, dout, 20)
    for i, again in enumerate(rest):
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} of repeat {i + 1} differs from the first"


@requires_hopper
def test_lse_gradient_is_refused():
    q, k, v = (torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = hattn.attention(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="no gradient through the LSE"):
        (out.float().sum() + lse.sum()).backward()
    q.grad = None
    out, lse = hattn.attention(q, k, v, return_lse=True)
    out.float().sum().backward()  # lse unused: fine
    assert q.grad is not None and torch.isfinite(q.grad).all()


@requires_hopper
def test_no_grad_keeps_the_forward_alone():
    q, k, v = (torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        out = hattn.attention(q, k, v)
    assert out.grad_fn is None


@requires_hopper
def test_scratch_comes_from_torch(monkeypatch):
    """The backward's fp32 sums (and a negative scale's sign-flipped q in the forward) come from
    torch's caching allocator through hattn.ops.runner._scratch; when it raises, the call raises
    RuntimeError naming what it needed and what the allocator said."""
    import hattn.ops.runner as ops

    calls = []
    real = ops._scratch

    def counting(nbytes, stream):
        calls.append(nbytes)
        return real(nbytes, stream)

    monkeypatch.setattr(ops, "_scratch", counting)
    q, k, v = (torch.randn(1, 40, 2, 64, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN for _ in range(3))
    dout = torch.randn_like(q)
    got = gradients(lambda q, k, v: hattn.attention(q, k, v, causal=True), q, k, v, dout)
    assert len(calls) == 1 and calls[0] > 0  # one block: the sums and the row sums
    want = gradients(
        lambda q, k, v: attention_ref(q, k, v, causal=True)[0], q.double(), k.double(), v.double(), dout.double()
    )  # fmt: skip
    check_gradients(got, want, torch.bfloat16)
    calls.clear()
    out = hattn.attention(q, k, v, softmax_scale=-0.1)
    assert len(calls) == 1 and calls[0] == q.numel() * q.element_size()  # q's sign-flipped copy
    ref, _ = attention_ref(q.double(), k.double(), v.double(), softmax_scale=-0.1)
    assert torch.allclose(out.double(), ref, atol=3e-2, rtol=0)

    def empty(nbytes, stream):
        raise RuntimeError(f"no {nbytes} bytes here")

    monkeypatch.setattr(ops, "_scratch", empty)
    q.requires_grad_(True)
    out = hattn.attention(q, k, v)
    with pytest.raises(RuntimeError, match=r"out_of_memory: .*fp32 sums.*scratch raised RuntimeError: no \d+ bytes here"):
        out.backward(dout)
