"""The backward through hattn.attention (torch.autograd): dq, dk and dv against the fp64 reference's
autograd gradients (GPU), and the op's schema, fake and refusals (CPU)."""

import hattn
import pytest
import torch
from helpers import (
    INPUT_MEAN,
    attention_ref,
    check_gradients,
    gradients,
    requires_hopper,
)


def test_backward_op_schema():
    schema = str(torch.ops.hattn.attention_bwd.default._schema)
    assert schema.startswith(
        "hattn::attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float? softmax_scale, SymInt window_left=-1, SymInt window_right=-1) -> (Tensor, Tensor, Tensor)"
    )


def test_backward_fake_shapes():
    q = torch.empty(2, 5, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 5, device="meta")
    dq, dk, dv = torch.ops.hattn.attention_bwd(q, q, k, k, q, lse, False, None)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


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
