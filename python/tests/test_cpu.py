"""Tests that run everywhere, with or without a GPU: import, kernel list, argument errors,
shape inference (meta tensors), torch.compile tracing, layout rules and the raw binding."""

import re

import hattn
import pytest
import torch
from hattn import _C
from hattn.ops.checks import _as_kernel_input, _kernel_layout_ok
from helpers import binding, hopper_skip_reason

B, SQ, SK, HQ, HKV, D = 2, 100, 120, 8, 2, 64


def cpu_qkv(dtype=torch.bfloat16, **shape):
    s = dict(batch=B, seqlen_q=SQ, seqlen_k=SK, heads_q=HQ, heads_kv=HKV, head_dim=D)
    s.update(shape)
    q = torch.randn(s["batch"], s["seqlen_q"], s["heads_q"], s["head_dim"], dtype=dtype)
    k = torch.randn(s["batch"], s["seqlen_k"], s["heads_kv"], s["head_dim"], dtype=dtype)
    return q, k, torch.randn_like(k)


# --- package ------------------------------------------------------------------------------------


def test_no_leak_report_at_exit():
    """A program that ran an op exits quietly: the launch cache's problems are let go before the
    extension is torn down (nanobind printed "leaked N instances!" otherwise)."""
    import os
    import subprocess
    import sys

    code = ("from hattn import _C\nfrom hattn.ops import runner\n"
            "runner._LAUNCHES[('x',)] = (_C.AttentionProblem(), _C.Buffers())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "leaked" not in res.stderr, res.stderr


def test_import_and_version():
    assert isinstance(hattn.__version__, str) and hattn.__version__
    assert callable(hattn.attention)
    assert hasattr(torch.ops.hattn, "attention_fwd")


def test_kernels_lists_the_lineage_then_the_production_forward():
    kernels = hattn.kernels()
    assert kernels, "no kernel registered"
    names = [k.name for k in kernels]
    assert len(set(names)) == len(names), names
    assert "auto" not in names
    assert names[-1] == "fwd_sm90", "the production forward comes last: what \"auto\" asks first"
    for k in kernels[:-1]:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", k.name), k.name
    for k in kernels:
        assert k.description.strip(), k.name
    assert names[:-1] == sorted(names[:-1]), "lineage order is the numbering order"
    assert [tuple(k) for k in kernels] == [tuple(k) for k in _C.kernels()]


def test_op_schema():
    schema = str(torch.ops.hattn.attention_fwd.default._schema)
    args = (
        "Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, str kernel, bool return_lse, "
        "SymInt window_left=-1, SymInt window_right=-1, Tensor? seqlens_k=None, SymInt num_splits=0, "
        "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, float softcap=0., bool deterministic=False, "
        "Tensor? k_descale=None, Tensor? v_descale=None"
    )
    assert schema.startswith(f"hattn::attention_fwd({args})")
    assert schema.endswith("-> (Tensor, Tensor)")


# --- argument errors (raised before any GPU is needed) -----------------------------------------------


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q: must be 4-D \[batch, seqlen, heads, head_dim\]"),
        (lambda q, k, v: (q, k.unsqueeze(0), v), ValueError, r"k: must be 4-D"),
        (
            lambda q, k, v: (q.float(), k, v),
            ValueError,
            r"q: dtype must be torch.bfloat16 or torch.float16, got torch.float32",
        ),
        (lambda q, k, v: (q, k, v.to(torch.int8)), ValueError, r"v: dtype must be"),
        (lambda q, k, v: (q, k.half(), v), ValueError, r"k: dtype torch.float16 must match q's dtype torch.bfloat16"),
        (lambda q, k, v: (q, k, v[:, :7]), ValueError, r"v: shape \(2, 7, 2, 64\) must equal k's shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k: batch 1 must equal q's batch 2"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, r"k: head_dim 32 must equal q's head_dim 64"),
        (
            lambda q, k, v: (q[:, :, :5], k[:, :, :2], v[:, :, :2]),
            ValueError,
            r"k: q's heads \(5\) must be a multiple of k/v's heads \(2\)",
        ),
        (lambda q, k, v: ("q", k, v), TypeError, r"q: must be a torch.Tensor, got str"),
    ],
)
def test_argument_errors_name_the_argument(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention(*mutate(*cpu_qkv()))


def test_window_size_is_checked_and_routed():
    q, k, v = cpu_qkv()
    last = hattn.kernels()[-1].name
    assert hattn.resolve_kernel(q, k, v, window_size=(16, 0)) == last  # only the production forward has it
    assert hattn.resolve_kernel(q, k, v, causal=True, window_size=(16, -1)) == last
    with pytest.raises(NotImplementedError, match=r"15_three_consumers: no sliding window"):
        hattn.resolve_kernel(q, k, v, kernel="15_three_consumers", window_size=(16, 0))
    with pytest.raises(ValueError, match=r"window_left: must be >= 0, or -1"):
        hattn.resolve_kernel(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"window_right: must be -1 or 0 with causal"):
        hattn.resolve_kernel(q, k, v, causal=True, window_size=(4, 2))
    with pytest.raises(ValueError, match=r"window_size: must be a pair"):
        hattn.resolve_kernel(q, k, v, window_size=5)


def test_unknown_kernel():
    with pytest.raises(ValueError, match=r"kernel: unknown kernel 'nope' \(known: auto, 01_"):
        hattn.attention(*cpu_qkv(), kernel="nope")


def test_cpu_tensors_are_refused_clearly():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"q: must be a CUDA tensor, got device cpu"):
            hattn.attention(*cpu_qkv())
    else:
        with pytest.raises(RuntimeError, match=r"no suitable GPU is present.*Hopper.*q is on cpu"):
            hattn.attention(*cpu_qkv())


def test_launch_checks_outputs():
    q, k, v = cpu_qkv()
    with pytest.raises((ValueError, RuntimeError)):
        hattn.launch(q, k, v, torch.empty_like(q), None)
    if torch.cuda.is_available():
        q, k, v = (t.cuda() for t in (q, k, v))
        with pytest.raises(ValueError, match=r"out: must be torch.bfloat16 of q's shape"):
            hattn.launch(q, k, v, torch.empty_like(q)[:, :3], None)
        with pytest.raises(ValueError, match=r"lse: must be a contiguous float32 tensor of shape \(2, 8, 100\)"):
            hattn.launch(q, k, v, torch.empty_like(q), torch.empty(2, 100, 8, device="cuda"))


# --- shape inference: the fake implementation, on meta tensors -------------------------------------


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_shapes(dtype, return_lse):
    q, k, v = (t.to("meta") for t in cpu_qkv(dtype))
    out, lse = torch.ops.hattn.attention_fwd(q, k, v, True, None, "auto", return_lse)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.dtype == torch.float32
    assert lse.shape == ((B, HQ, SQ) if return_lse else (0,))


def test_meta_validates_too():
    q, k, v = (t.to("meta") for t in cpu_qkv())
    with pytest.raises(ValueError, match=r"k: q's heads \(8\) must be a multiple of k/v's heads \(3\)"):
        torch.ops.hattn.attention_fwd(
            q, k[:, :, :1].expand(B, SK, 3, D), v[:, :, :1].expand(B, SK, 3, D), False, None, "auto", False
        )


def test_meta_checks_what_the_library_checks():
    """The fake implementation refuses what the GPU call would (so torch.compile fails at trace
    time): a head dim the kernels lack, a bad window, a lineage kernel asked for a production
    feature. The messages are the library's."""
    q, k, v = (t.to("meta") for t in cpu_qkv())
    lineage = hattn.kernels()[-2].name
    fwd = torch.ops.hattn.attention_fwd
    q96, k96, v96 = (t.to("meta") for t in cpu_qkv(head_dim=96))
    with pytest.raises(ValueError, match=r"head_dim: must be 64, 128 or 256 \(got 96\)"):
        fwd(q96, k96, v96, False, None, "auto", False)
    with pytest.raises(ValueError, match=r"window_right: must be -1 or 0 with causal"):
        fwd(q, k, v, True, None, "auto", False, 8, 4)
    with pytest.raises(NotImplementedError, match=rf"{lineage}: no sliding window"):
        fwd(q, k, v, False, None, lineage, False, 8, 0)
    with pytest.raises(NotImplementedError, match=rf"{lineage}: no softcap"):
        fwd(q, k, v, False, None, lineage, False, -1, -1, softcap=30.0)
    out, _ = fwd(q, k, v, False, None, "auto", False, 8, 0, softcap=30.0)  # the production forward has both
    assert out.shape == q.shape


def test_compile_fullgraph_traces_without_breaks():
    """Dynamo traces hattn.attention into one graph (real GPU runs are in test_gpu.py)."""
    torch._dynamo.reset()

    def f(q, k, v):
        out, lse = hattn.attention(q * 2, k, v, causal=True, softmax_scale=0.125, return_lse=True)
        return out.float().sum(-1), lse + 1

    q, k, v = (t.to("meta") for t in cpu_qkv())
    out, lse = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    assert out.shape == (B, SQ, HQ) and lse.shape == (B, HQ, SQ)
    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# --- layouts: which inputs are read in place ---------------------------------------------------------


def test_layout_rules():
    x = torch.randn(2, 64, 3, 4, 128, dtype=torch.bfloat16)  # packed qkv [B, S, 3, H, D]
    assert _kernel_layout_ok(torch.randn(2, 64, 4, 128, dtype=torch.bfloat16))
    assert _kernel_layout_ok(x[:, :, 1])  # slice of packed qkv
    assert _kernel_layout_ok(torch.randn(2, 4, 64, 128, dtype=torch.bfloat16).transpose(1, 2))  # BHSD storage
    assert _kernel_layout_ok(torch.randn(1, 64, 1, 64, dtype=torch.float16))
    odd = torch.randn(2, 64, 4, 132, dtype=torch.bfloat16)[..., :128]  # strides not multiples of 8
    assert not _kernel_layout_ok(odd)
    assert not _kernel_layout_ok(torch.randn(2, 64, 4, 256, dtype=torch.bfloat16)[..., ::2])  # D strided
    assert not _kernel_layout_ok(torch.randn(2, 64, 1, 128, dtype=torch.bfloat16).expand(2, 64, 4, 128))  # stride 0
    misaligned = torch.randn(64 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(1, 64, 4, 128)
    assert misaligned.is_contiguous() and not _kernel_layout_ok(misaligned)

    ok = x[:, :, 0]
    assert _as_kernel_input(ok) is ok
    for bad in (odd, misaligned):
        fixed = _as_kernel_input(bad)
        assert fixed.is_contiguous() and _kernel_layout_ok(fixed) and torch.equal(fixed, bad)


# --- the raw binding ------------------------------------------------------------------------------------


def problem(**overrides):
    """_C keyword arguments of a valid problem with stand-in (aligned, non-null) pointers, 1 TiB
    apart: no two tensors share memory."""
    strides = lambda s, h: (s * h * D, h * D, D)  # noqa: E731
    kwargs = dict(
        dtype="bf16", batch=B, seqlen_q=SQ, seqlen_k=SK, heads_q=HQ, heads_kv=HKV, head_dim=D,
        q=1 << 40, q_strides=strides(SQ, HQ), k=2 << 40, k_strides=strides(SK, HKV),
        v=3 << 40, v_strides=strides(SK, HKV), out=4 << 40, out_strides=strides(SQ, HQ),
    )  # fmt: skip
    kwargs.update(overrides)
    return kwargs


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (dict(head_dim=96), r"^invalid_argument: head_dim: must be 64, 128 or 256 \(got 96\)"),
        (dict(heads_kv=3), r"^invalid_argument: heads_kv"),
        (dict(q=0), r"^invalid_argument: q: pointer is null"),
        (dict(k=(2 << 20) + 2), r"^invalid_argument: k: pointer must be 16-byte aligned"),
        (dict(v_strides=(SK * HKV * D, HKV * D + 4, D)), r"^invalid_argument: v: seq stride"),
        (dict(seqlen_q=0), r"^invalid_argument: seqlen_q: must be >= 1"),
        (dict(softmax_scale=float("inf")), r"^invalid_argument: softmax_scale: must be finite"),
        (dict(kernel="nope"), r"^invalid_argument: kernel: unknown kernel 'nope'"),
        (dict(workspace=(5 << 20) + 4, workspace_bytes=64), r"^invalid_argument: workspace: pointer must be 16-byte"),
        (dict(workspace_bytes=64), r"^invalid_argument: workspace_bytes: 64 given without a workspace pointer"),
    ],
)
def test_binding_invalid_argument_is_value_error(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        binding(_C.forward, **problem(**overrides))
    with pytest.raises(ValueError, match=pattern):
        binding(_C.resolve_kernel, **problem(**overrides))
    with pytest.raises(ValueError, match=pattern):
        binding(_C.workspace_size, **problem(**overrides))
    with pytest.raises(ValueError, match=pattern):
        binding(_C.plan, **problem(**overrides))


def test_plan_binding_before_a_gpu():
    """_C.plan refuses as forward() does (no_device last); _C.buffers_of gives the problem's
    addresses; a Plan comes only from _C.plan."""
    from hattn.ops.runner import _problem

    if hopper_skip_reason() is not None:
        with pytest.raises(RuntimeError, match=r"^no_device: "):
            binding(_C.plan, **problem())
    buffers = _C.buffers_of(_problem(problem(lse=5 << 40))[0])
    assert (buffers.q, buffers.out, buffers.lse, buffers.seqlens_k) == (1 << 40, 4 << 40, 5 << 40, 0)
    with pytest.raises(TypeError):
        _C.Plan()  # made by _C.plan only


def test_binding_dtype_name():
    with pytest.raises(ValueError, match=r"dtype: must be 'bf16', 'fp16' or 'e4m3' \(got 'fp32'\)"):
        binding(_C.forward, **problem(dtype="fp32"))


def test_binding_resolves_without_gpu():
    names = [k.name for k in hattn.kernels()]
    assert binding(_C.resolve_kernel, **problem()) in names
    assert binding(_C.resolve_kernel, **problem(kernel=names[0])) == names[0]
    q, k, v = cpu_qkv()
    assert hattn.resolve_kernel(q, k, v, causal=True) in names


def test_binding_refuses_without_a_usable_gpu():
    """Stand-in pointers: no_device without a Hopper GPU; with one, they are not GPU memory."""
    if hopper_skip_reason() is None:
        with pytest.raises(ValueError, match=r"^invalid_argument: q: pointer is not GPU memory"):
            binding(_C.forward, **problem())
    else:
        with pytest.raises(RuntimeError, match=r"^no_device: "):
            binding(_C.forward, **problem())
        with pytest.raises(RuntimeError, match=r"^no_device: "):
            binding(_C.workspace_size, **problem())


def test_calls_go_through_the_op_while_the_profiler_runs():
    """Eager calls may skip the dispatcher (hattn.ops.runner._direct_call_ok), except while torch.profiler
    runs: then they go through the op so that the profile shows hattn::... (test_gpu checks the names)."""
    import hattn.ops.runner as ops

    assert ops._direct_call_ok(())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not ops._direct_call_ok(())
    assert ops._direct_call_ok(())


def test_problem_classes():
    """hattn._C.AttentionProblem and BackwardProblem: the C++ structs, their fields as attributes."""
    import copy

    p = _C.AttentionProblem()
    assert (p.dtype, p.batch, p.q, p.lse, p.softmax_scale, p.pack_gqa, p.window_left) == ("bf16", 0, 0, 0, None, None, -1)
    p.dtype, p.batch, p.q, p.q_strides, p.softmax_scale, p.pack_gqa = "e4m3", 3, 1 << 40, (7, 5, 1), 0.25, True
    assert (p.dtype, p.batch, p.q, p.q_strides, p.softmax_scale, p.pack_gqa) == ("e4m3", 3, 1 << 40, (7, 5, 1), 0.25, True)
    with pytest.raises(ValueError, match=r"dtype: must be 'bf16', 'fp16' or 'e4m3' \(got 'fp32'\)"):
        p.dtype = "fp32"
    c = copy.copy(p)
    c.q, c.batch = 2 << 40, 4
    assert (p.q, p.batch) == (1 << 40, 3)  # a copy, not a view
    b = _C.BackwardProblem()
    b.forward = p
    b.forward.head_dim = 128  # the nested problem is the backward problem's own
    b.dq, b.dq_strides = 5 << 40, (1, 2, 3)
    assert (b.forward.batch, b.forward.head_dim, p.head_dim, b.dq, b.dq_strides) == (3, 128, 0, 5 << 40, (1, 2, 3))
