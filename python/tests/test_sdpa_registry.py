"""hattn as a flash-attention implementation in torch's registry (hattn.sdpa.register_flash_impl).

CPU tests: "hattn" is registered at import; the overriding kernels take the aten ops' schemas
argument for argument; activation puts them on the CUDA key of the four flash ops and
restore_flash_attention_impl takes them off again, leaving the dispatch tables as they were.
With the kernels put on the CPU key instead (where these ops have none), hattn's launches
replaced by the fp64 reference and torch's kernels by recorders, the ops run end to end on the
CPU through the dispatcher and autograd: outputs shaped, typed and strided as torch's meta
functions give them, gradients through the backward ops, the fallback calls handed to torch's
kernel with every argument, and the LSE of a hattn forward made FlashAttention-2's for torch's
backward.

GPU tests (Hopper only): SDPA calls that torch sends to its flash backend reach hattn after
activation and not before, with outputs and gradients within the fp64 reference bound; calls
hattn cannot run reach torch's flash kernel with torch's result; deterministic mode sends the
backward to torch; torch.compile; restore_flash_attention_impl undoes the override.
"""

import inspect
import math

import hattn
import hattn.sdpa as sdpa
import pytest
import torch
import torch.nn.functional as F
from helpers import INPUT_MEAN, attention_ref, check_gradients, error_bound, gradients, requires_hopper, visible_mask

registry = sdpa._torch_registry()
requires_registry = pytest.mark.skipif(
    registry is None, reason=f"torch {torch.__version__} has no flash-attention registry (torch >= 2.10 has it)"
)
pytestmark = requires_registry

OPS = sdpa._FLASH_OPS
KERNELS = {
    "_scaled_dot_product_flash_attention": "_sdpa_forward",
    "_scaled_dot_product_flash_attention_backward": "_sdpa_backward",
    "_flash_attention_forward": "_flash_forward",
    "_flash_attention_backward": "_flash_backward",
}


def schema(name):
    return getattr(torch.ops.aten, name).default._schema


def dispatch_tables():
    return {name: torch._C._dispatch_dump_table(f"aten::{name}") for name in OPS}


def has_torch_cuda_kernels():
    try:
        for name in OPS:
            torch.library.get_kernel(f"aten::{name}", "CUDA")
    except RuntimeError:
        return False
    return True


@pytest.fixture
def restored():
    """Leaves no flash implementation active after the test."""
    yield
    if registry.current_flash_attention_impl() is not None:
        registry.restore_flash_attention_impl()


# --- registration (CPU) -------------------------------------------------------------------------------


def test_registered_at_import():
    assert sdpa.FLASH_IMPL == "hattn"
    assert "hattn" in registry.list_flash_attention_impls()
    assert sdpa.register_flash_impl() is True  # a second registration changes nothing
    assert registry.list_flash_attention_impls().count("hattn") == 1
    assert registry.current_flash_attention_impl() != "hattn"  # registering is not activating


@pytest.mark.parametrize("name", OPS)
def test_kernels_take_the_aten_schemas(name):
    """Argument for argument: names in order, keyword-only where the schema says so, the schema's defaults."""
    params = list(inspect.signature(getattr(sdpa._FlashImpl, KERNELS[name])).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "keyset"]  # with_keyset=True passes the DispatchKeySet first
    params = params[2:]
    arguments = schema(name).arguments
    assert [p.name for p in params] == [a.name for a in arguments]
    for p, a in zip(params, arguments):
        assert (p.kind == inspect.Parameter.KEYWORD_ONLY) == a.kwarg_only, a.name
        if a.has_default_value():
            assert p.default == a.default_value, a.name
        else:
            assert p.default is inspect.Parameter.empty, a.name


@pytest.mark.skipif(not has_torch_cuda_kernels(), reason="this torch build has no CUDA kernels of the flash ops")
def test_activation_overrides_the_cuda_kernels_and_restore_undoes_it(restored):
    before = dispatch_tables()
    calls = sdpa.flash_impl_calls()
    registry.activate_flash_attention_impl("hattn")
    assert registry.current_flash_attention_impl() == "hattn"
    for name, table in dispatch_tables().items():
        cuda = next(line for line in table.splitlines() if line.startswith("CUDA:"))
        assert "hattn/sdpa.py" in cuda, (name, cuda)
        assert table != before[name]
    registry.restore_flash_attention_impl()
    assert registry.current_flash_attention_impl() is None
    assert dispatch_tables() == before
    # Activated twice in a row (torch restores the first before the second) and restored: the same.
    registry.activate_flash_attention_impl("hattn")
    registry.activate_flash_attention_impl("hattn")
    registry.restore_flash_attention_impl()
    assert dispatch_tables() == before
    assert sdpa.flash_impl_calls() == calls  # nothing ran


# --- the kernels on the CPU key, with stand-ins (CPU) --------------------------------------------------


def reference_forward(q, k, v, out, causal, scale, window):
    """Stands in for _run_hattn_forward: the fp64 reference (bottom-right causal, window) into out; the LSE."""
    ref, lse = attention_ref(q, k, v, causal, scale, window=window)
    out.copy_(ref)
    return lse.float()


def reference_backward(dout, q, k, v, out, lse, causal, scale, window):
    """Stands in for _run_hattn_backward: attention's gradients in fp64, as contiguous [B, L, H, E] tensors
    in the inputs' dtype, as hattn::attention_bwd returns them.

    Written out (autograd is off inside a kernel): P = softmax(S), dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q, dk and dv summed over each
    K/V head's query heads. A row that sees no key has P = 0."""
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads_q // heads_kv
    qh, doh = (t.double().transpose(1, 2) for t in (q, dout))  # [B, Hq, Lq, E]
    kh, vh = (t.double().transpose(1, 2).repeat_interleave(group, dim=1) for t in (k, v))
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal or tuple(window) != (-1, -1):
        s = s.masked_fill(~visible_mask(q.shape[1], k.shape[1], causal, window), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    o = torch.matmul(p, vh)
    dv_h = torch.matmul(p.transpose(-1, -2), doh)
    dp = torch.matmul(doh, vh.transpose(-1, -2))
    ds = p * (dp - (doh * o).sum(-1, keepdim=True))
    dq_h = torch.matmul(ds, kh) * scale
    dk_h = torch.matmul(ds.transpose(-1, -2), qh) * scale

    def per_kv_head(g):  # [B, Hq, Lk, E] -> [B, Lk, Hkv, E]
        b, _, lk, e = g.shape
        return g.view(b, heads_kv, group, lk, e).sum(2).transpose(1, 2)

    return tuple(g.to(q.dtype).contiguous() for g in (dq_h.transpose(1, 2), per_kv_head(dk_h), per_kv_head(dv_h)))


class TorchKernel:
    """Stands in for torch's kernel of one op: records each call and returns outputs of the meta function's shapes."""

    def __init__(self, name):
        self.name, self.calls = name, []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        meta = getattr(torch.ops.aten, self.name).default(*to_meta(args), **to_meta(kwargs))
        return tuple(torch.zeros_like(m, device="cpu") if isinstance(m, torch.Tensor) else m for m in meta)


def to_meta(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    if isinstance(x, (tuple, list)):
        return type(x)(to_meta(y) for y in x)
    if isinstance(x, dict):
        return {key: to_meta(y) for key, y in x.items()}
    return x


@pytest.fixture
def on_cpu(monkeypatch):
    """hattn's kernels on the CPU key, hattn's launches replaced by the reference, torch's kernels by
    recorders, the device rule passed; yields the recorders. The CPU key's tables come back as they were."""
    before = dispatch_tables()
    monkeypatch.setattr(sdpa, "_on_hopper", lambda t: True)
    monkeypatch.setattr(sdpa, "_run_hattn_forward", reference_forward)
    monkeypatch.setattr(sdpa, "_run_hattn_backward", reference_backward)
    kernels = {name: TorchKernel(name) for name in OPS}
    impl = sdpa._FlashImpl("CPU", kernels)
    try:
        yield kernels
    finally:
        impl.remove()
        assert dispatch_tables() == before  # the stand-in registration leaves nothing behind


def bhse(batch, heads, seqlen, head_dim, seed, dtype=torch.bfloat16, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(batch, heads, seqlen, head_dim, generator=gen, dtype=torch.float32) + INPUT_MEAN
    return t.to(dtype).requires_grad_(requires_grad)


def same_metadata(got, want):
    """Outputs like the meta function's: tensors of its shapes, dtypes and strides, ints and Nones alike."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), (i, g)
            assert (g.shape, g.dtype) == (w.shape, w.dtype), (i, g.shape, g.dtype, w.shape, w.dtype)
            if g.numel() > 1:
                assert g.stride() == w.stride(), (i, g.stride(), w.stride())
        else:
            assert g == w, (i, g, w)


def counts_since(before):
    now = sdpa.flash_impl_calls()
    return {key: now[key] - before[key] for key in now}


@pytest.mark.parametrize(
    "heads_q, heads_kv, seqlen_q, seqlen_k, causal, scale",
    [(4, 4, 70, 70, True, None), (4, 2, 37, 53, False, 0.3), (6, 1, 64, 64, True, 0.125)],
    ids=["causal", "gqa-cross-scale", "mqa-causal"],
)
def test_sdpa_op_runs_hattn_with_gradients(on_cpu, heads_q, heads_kv, seqlen_q, seqlen_k, causal, scale):
    """aten._scaled_dot_product_flash_attention and, through its autograd formula, its _backward."""
    q = bhse(2, heads_q, seqlen_q, 64, seed=1, requires_grad=True)
    k = bhse(2, heads_kv, seqlen_k, 64, seed=2, requires_grad=True)
    v = bhse(2, heads_kv, seqlen_k, 64, seed=3, requires_grad=True)
    dout = bhse(2, heads_q, seqlen_q, 64, seed=4)
    before = sdpa.flash_impl_calls()
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    same_metadata(result, torch.ops.aten._scaled_dot_product_flash_attention(*to_meta((q, k, v)), 0.0, causal, False,
                                                                             scale=scale))  # fmt: skip
    out, lse = result[0], result[1]
    ref, ref_lse = attention_ref(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal, scale)
    naive, _ = attention_ref(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal, scale, upcast=False)
    assert (out.transpose(1, 2).double() - ref).abs().max().item() <= error_bound(ref, naive, q.dtype)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)
    out.backward(dout)
    want = gradients(lambda q, k, v: attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal,
                                                   scale)[0].transpose(1, 2),
                     q.double(), k.double(), v.double(), dout.double())  # fmt: skip
    check_gradients((q.grad, k.grad, v.grad), want, q.dtype, "sdpa op")
    # The backward op called directly (.grad is laid out by autograd): gradients laid out as the meta function's.
    args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, seqlen_q, seqlen_k, 0.0, causal,
            result[6], result[7])  # fmt: skip
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(*args, scale=scale)
    same_metadata(grads, torch.ops.aten._scaled_dot_product_flash_attention_backward(*to_meta(args), scale=scale))
    torch.testing.assert_close(grads, (q.grad, k.grad, v.grad), rtol=0, atol=0)
    assert counts_since(before) == {"hattn_forward": 1, "hattn_backward": 2, "torch_forward": 0, "torch_backward": 0}
    assert all(not kernel.calls for kernel in on_cpu.values())


def test_flash_op_runs_hattn_with_a_bottom_right_mask_and_window(on_cpu):
    """aten._flash_attention_forward ([B, L, H, E]) with Lq > Lk: causal aligned bottom-right, rows that see
    no key (LSE -inf), a window; and its backward."""
    q = bhse(1, 4, 90, 128, seed=5, requires_grad=True).detach().transpose(1, 2).requires_grad_()
    k = bhse(1, 2, 40, 128, seed=6).transpose(1, 2).requires_grad_()
    v = bhse(1, 2, 40, 128, seed=7).transpose(1, 2).requires_grad_()
    dout = bhse(1, 4, 90, 128, seed=8).transpose(1, 2)
    before = sdpa.flash_impl_calls()
    args = (None, None, 90, 40, 0.0, True, False)
    kwargs = dict(scale=0.1, window_size_left=16, window_size_right=5)  # causal makes the right side 0
    result = torch.ops.aten._flash_attention_forward(q, k, v, *args, **kwargs)
    same_metadata(result, torch.ops.aten._flash_attention_forward(*to_meta((q, k, v)), *args, **kwargs))
    out, lse = result[0], result[1]
    ref, ref_lse = attention_ref(q.detach(), k.detach(), v.detach(), True, 0.1, window=(16, 0))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)
    assert torch.isneginf(lse[:, :, :50]).all() and torch.isfinite(lse[:, :, 50:]).all()
    out.backward(dout)
    want = gradients(lambda q, k, v: attention_ref(q, k, v, True, 0.1, window=(16, 0))[0],
                     q.double(), k.double(), v.double(), dout.double())  # fmt: skip
    check_gradients((q.grad, k.grad, v.grad), want, q.dtype, "flash op")
    args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, 90, 40, 0.0, True, result[2],
            result[3])  # fmt: skip
    grads = torch.ops.aten._flash_attention_backward(*args, scale=0.1, window_size_left=16, window_size_right=5)
    same_metadata(grads, torch.ops.aten._flash_attention_backward(*to_meta(args), scale=0.1, window_size_left=16,
                                                                  window_size_right=5))  # fmt: skip
    assert counts_since(before) == {"hattn_forward": 1, "hattn_backward": 2, "torch_forward": 0, "torch_backward": 0}


@pytest.mark.parametrize(
    "make, kwargs, words",
    [
        (lambda: (bhse(1, 2, 64, 64, 1),) * 3, {"dropout_p": 0.1}, "dropout"),
        (lambda: (bhse(1, 2, 64, 64, 1),) * 3, {"return_debug_mask": True}, "return_debug_mask"),
        (lambda: (bhse(1, 2, 64, 96, 1),) * 3, {}, "head dims"),
        (lambda: (bhse(1, 2, 64, 64, 1, dtype=torch.float32),) * 3, {}, "dtypes"),
        (lambda: (bhse(1, 6, 64, 64, 1), bhse(1, 4, 64, 64, 2), bhse(1, 4, 64, 64, 3)), {}, "enable_gqa"),
        (lambda: (bhse(1, 2, 0, 64, 1),) * 3, {}, "size 0"),
        (lambda: (bhse(1, 2, 64, 64, 1),) * 3, {"scale": float("inf")}, "finite scale"),
    ],
    ids=["dropout", "debug-mask", "head-dim-96", "fp32", "heads-not-a-multiple", "empty", "scale-inf"],
)
def test_sdpa_op_hands_what_hattn_cannot_run_to_torch(on_cpu, make, kwargs, words):
    q, k, v = make()
    dropout_p, is_causal, debug = kwargs.get("dropout_p", 0.0), False, kwargs.get("return_debug_mask", False)
    why = sdpa.flash_fallback_reason(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p,
                                     return_debug_mask=debug, scale=kwargs.get("scale"))  # fmt: skip
    assert why is not None and words in why, why
    before = sdpa.flash_impl_calls()
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, debug, scale=kwargs.get("scale"))
    (keyset, args, passed), = on_cpu["_scaled_dot_product_flash_attention"].calls
    assert isinstance(keyset, torch._C.DispatchKeySet)
    assert args[0] is q and args[1] is k and args[2] is v and args[3:] == (dropout_p, is_causal, debug)
    assert passed == {"scale": kwargs.get("scale")}
    assert counts_since(before)["torch_forward"] == 1 and counts_since(before)["hattn_forward"] == 0


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"cum_seq": True}, "variable-length"),
        ({"seqused_k": torch.tensor([30], dtype=torch.int32)}, "seqused_k"),
        ({"alibi_slopes": torch.ones(1, 2)}, "ALiBi"),
    ],
    ids=["varlen", "seqused_k", "alibi"],
)
def test_flash_op_hands_its_extra_arguments_to_torch(on_cpu, extra, words):
    q, k, v = (bhse(1, 2, 40, 64, seed).transpose(1, 2) for seed in (1, 2, 3))
    cum = torch.tensor([0, 40], dtype=torch.int32) if extra.pop("cum_seq", False) else None
    if cum is not None:
        q, k, v = (t[0] for t in (q, k, v))  # [total, H, E]
    why = sdpa.flash_fallback_reason(q, k, v, cum_seq_q=cum, **extra)
    assert why is not None and words in why, why
    torch.ops.aten._flash_attention_forward(q, k, v, cum, cum, 40, 39, 0.0, False, False, **extra)
    (_, args, passed), = on_cpu["_flash_attention_forward"].calls
    assert args[:5] == (q, k, v, cum, cum) and args[5:] == (40, 39, 0.0, False, False)
    want = {"scale": None, "window_size_left": None, "window_size_right": None, "seqused_k": None, "alibi_slopes": None}
    assert passed == {**want, **extra}


def test_hattns_backward_is_the_deterministic_one_under_torchs_flag(monkeypatch):
    asked = []
    monkeypatch.setattr(sdpa, "attention_bwd", lambda *a, deterministic=False: asked.append(deterministic) or a[1:4])
    q, k, v = (bhse(1, 2, 20, 64, seed).transpose(1, 2) for seed in (1, 2, 3))
    assert sdpa._run_hattn_backward(None, q, k, v, None, None, True, None, (-1, 0)) == (q, k, v)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        sdpa._run_hattn_backward(None, q, k, v, None, None, True, None, (-1, 0))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert asked == [False, True]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_deterministic_backward_runs_hattn(on_cpu, head_dim):
    """Under torch.use_deterministic_algorithms both halves run hattn (the backward its deterministic one, which
    has a fixed order with GQA at every head dim)."""
    q = bhse(1, 4, 50, head_dim, seed=1).transpose(1, 2).requires_grad_()
    k, v = (bhse(1, 2, 20, head_dim, seed).transpose(1, 2).requires_grad_() for seed in (2, 3))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        before = sdpa.flash_impl_calls()
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 50, 20, 0.0, True, False)
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert counts_since(before) == {"hattn_forward": 1, "hattn_backward": 1, "torch_forward": 0, "torch_backward": 0}
    assert not on_cpu["_flash_attention_backward"].calls


def test_flash_fallback_reason_rules():
    q, k, v = (bhse(2, 4, 64, 64, seed).transpose(1, 2) for seed in (1, 2, 3))
    reason = lambda *a, **kw: sdpa.flash_fallback_reason(*a, check_device=False, **kw)  # noqa: E731
    assert reason(q, k, v) is None
    assert reason(q, k[:, :10], v[:, :10]) is None  # Lq != Lk: causal or not, the mask is bottom-right here
    assert reason(bhse(2, 8, 64, 64, 4).transpose(1, 2), k, v) is None  # GQA needs no flag
    assert "3-D" in reason(q[0], k[0], v[0])
    assert "Hopper" in sdpa.flash_fallback_reason(q, k, v)  # CPU tensors
    assert sdpa._flash_window(False, None, None) == (-1, -1)
    assert sdpa._flash_window(True, None, None) == (-1, 0)
    assert sdpa._flash_window(True, 8, 3) == (8, 0)  # FlashAttention-2: causal puts the right edge on the diagonal
    assert sdpa._flash_window(False, -5, 7) == (-1, 7)  # any negative side is open


# --- SDPA through torch's flash backend (GPU) ----------------------------------------------------------


def cuda_bhse(batch, heads, seqlen, head_dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN


def flash_sdpa(*args, **kwargs):
    """F.scaled_dot_product_attention with torch's flash backend only (the path the override takes)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(*args, **kwargs)


def sdpa_ref(q, k, v, causal, scale):
    out, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.transpose(1, 2)


@requires_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "heads_q, heads_kv, seqlen_q, seqlen_k, causal, scale",
    [(8, 2, 300, 300, True, None), (4, 4, 137, 77, False, 0.05)],
    ids=["gqa-causal", "cross-scale"],
)
def test_sdpa_reaches_hattn_after_activation_and_not_before(
    restored, dtype, head_dim, heads_q, heads_kv, seqlen_q, seqlen_k, causal, scale
):
    q = cuda_bhse(2, heads_q, seqlen_q, head_dim, dtype, seed=1).requires_grad_()
    k = cuda_bhse(2, heads_kv, seqlen_k, head_dim, dtype, seed=2).requires_grad_()
    v = cuda_bhse(2, heads_kv, seqlen_k, head_dim, dtype, seed=3).requires_grad_()
    dout = cuda_bhse(2, heads_q, seqlen_q, head_dim, dtype, seed=4)
    gqa = heads_q != heads_kv

    def call(q, k, v):
        return flash_sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)

    before = sdpa.flash_impl_calls()
    gradients(call, q, k, v, dout)  # torch's FlashAttention-2, before activation
    assert counts_since(before) == dict.fromkeys(before, 0)

    registry.activate_flash_attention_impl("hattn")
    out = call(q.detach(), k.detach(), v.detach())
    assert counts_since(before)["hattn_forward"] == 1
    bshe = [t.detach().transpose(1, 2) for t in (q, k, v)]
    want, _ = attention_ref(*bshe, causal, scale)
    naive, _ = attention_ref(*bshe, causal, scale, upcast=False)
    assert not torch.isnan(out).any()
    err = (out.transpose(1, 2).double() - want).abs().max().item()
    bound = error_bound(want, naive, dtype)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"
    assert out.stride() == torch.empty_like(q).stride()  # as torch's flash kernel lays it out

    got = gradients(call, q, k, v, dout)
    assert counts_since(before)["hattn_backward"] == 1
    ref = gradients(lambda q, k, v: sdpa_ref(q, k, v, causal, scale), q.double(), k.double(), v.double(),
                    dout.double())  # fmt: skip
    check_gradients(got, ref, dtype, f"E {head_dim} H {heads_q}/{heads_kv} L {seqlen_q} S {seqlen_k}")

    registry.restore_flash_attention_impl()
    counted = sdpa.flash_impl_calls()
    gradients(call, q, k, v, dout)
    assert sdpa.flash_impl_calls() == counted  # restored: torch's kernels again


@requires_hopper
@pytest.mark.parametrize(
    "head_dim, kwargs",
    [(96, {}), (64, {"dropout_p": 0.2})],
    ids=["head-dim-96", "dropout"],
)
def test_calls_hattn_cannot_run_reach_torchs_flash_kernel(restored, head_dim, kwargs):
    q, k, v = (cuda_bhse(2, 4, 200, head_dim, torch.bfloat16, seed) for seed in (1, 2, 3))
    torch.manual_seed(0)
    expected = flash_sdpa(q, k, v, is_causal=True, **kwargs)
    registry.activate_flash_attention_impl("hattn")
    before = sdpa.flash_impl_calls()
    torch.manual_seed(0)
    got = flash_sdpa(q, k, v, is_causal=True, **kwargs)
    counts = counts_since(before)
    assert counts["hattn_forward"] == 0 and counts["torch_forward"] >= 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@requires_hopper
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(4, 4, 128), (4, 2, 64), (4, 2, 256)],
                         ids=["mha-128", "gqa-64", "gqa-256"])
def test_deterministic_mode_gradients(restored, heads_q, heads_kv, head_dim):
    """Under torch.use_deterministic_algorithms: hattn's deterministic backward, bitwise the same on a second
    run, as close to the reference as torch's own pair."""
    q = cuda_bhse(1, heads_q, 256, head_dim, torch.bfloat16, seed=1).requires_grad_()
    k, v = (cuda_bhse(1, heads_kv, 256, head_dim, torch.bfloat16, seed).requires_grad_() for seed in (2, 3))
    dout = cuda_bhse(1, heads_q, 256, head_dim, torch.bfloat16, seed=4)

    def call(q, k, v):
        return flash_sdpa(q, k, v, is_causal=True, enable_gqa=heads_q != heads_kv)

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        expected = gradients(call, q, k, v, dout)  # torch's forward and backward
        registry.activate_flash_attention_impl("hattn")
        before = sdpa.flash_impl_calls()
        got = gradients(call, q, k, v, dout)
        counts = counts_since(before)
        again = gradients(call, q, k, v, dout)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert counts["hattn_forward"] == 1
    assert (counts["hattn_backward"], counts["torch_backward"]) == (1, 0)
    ref = gradients(lambda q, k, v: sdpa_ref(q, k, v, True, None), q.double(), k.double(), v.double(), dout.double())
    eps = torch.finfo(torch.bfloat16).eps
    for name, g, g2, e, r in zip(("dq", "dk", "dv"), got, again, expected, ref):
        assert torch.isfinite(g).all(), name
        assert torch.equal(g, g2), name
        err, torch_err = ((t.double() - r).abs().max().item() for t in (g, e))
        assert err <= 2 * torch_err + eps * r.abs().max().item(), (name, err, torch_err)


@requires_hopper
def test_flash_op_with_a_bottom_right_mask_on_the_gpu(restored):
    """aten._flash_attention_forward directly, Lq > Lk causal: hattn, rows without keys give 0."""
    q = cuda_bhse(1, 4, 300, 128, torch.bfloat16, seed=1).transpose(1, 2)
    k, v = (cuda_bhse(1, 4, 100, 128, torch.bfloat16, seed).transpose(1, 2) for seed in (2, 3))
    registry.activate_flash_attention_impl("hattn")
    before = sdpa.flash_impl_calls()
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 300, 100, 0.0, True, False)
    assert counts_since(before)["hattn_forward"] == 1
    ref, _ = attention_ref(q, k, v, True, None)
    naive, _ = attention_ref(q, k, v, True, None, upcast=False)
    assert (out.double() - ref).abs().max().item() <= error_bound(ref, naive, torch.bfloat16)
    assert (out[:, :200] == 0).all() and torch.isneginf(lse[:, :, :200]).all()


@requires_hopper
def test_compiled_sdpa_reaches_hattn(restored):
    torch._dynamo.reset()
    q, k, v = (cuda_bhse(2, 8, 512, 128, torch.bfloat16, seed).requires_grad_() for seed in (1, 2, 3))
    dout = cuda_bhse(2, 8, 512, 128, torch.bfloat16, seed=4)
    registry.activate_flash_attention_impl("hattn")
    f = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2, fullgraph=True)
    before = sdpa.flash_impl_calls()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):  # read while tracing
        got = gradients(f, q, k, v, dout)
    counts = counts_since(before)
    assert counts["hattn_forward"] >= 1 and counts["hattn_backward"] >= 1
    ref = gradients(lambda q, k, v: sdpa_ref(q, k, v, True, None) * 2, q.double(), k.double(), v.double(),
                    dout.double())  # fmt: skip
    check_gradients(got, ref, torch.bfloat16, "compiled")


@requires_hopper
def test_hattn_drop_in_is_unaffected(restored):
    """hattn.scaled_dot_product_attention runs hattn.attention, not the flash ops, active or not."""
    q = cuda_bhse(1, 4, 128, 64, torch.bfloat16, seed=1)
    expected = hattn.scaled_dot_product_attention(q, q, q)
    registry.activate_flash_attention_impl("hattn")
    before = sdpa.flash_impl_calls()
    torch.testing.assert_close(hattn.scaled_dot_product_attention(q, q, q), expected, rtol=0, atol=0)
    assert counts_since(before) == dict.fromkeys(before, 0)
