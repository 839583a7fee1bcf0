"""hattn.attention_varlen, the variable-length batch (FlashAttention's cu_seqlens).

The CPU tests run everywhere: argument errors, shape inference on meta tensors, torch.compile
tracing, routing (only the production forward has it) and the layout rules for packed tensors. The
GPU tests (Hopper only) compare each sequence of a packed batch with the fp64 reference run on
that sequence alone, and run the op under torch.compile, CUDA graphs and opcheck.
"""

import hattn
import pytest
import torch
from hattn import _C
from hattn.ops.checks import _as_kernel_input, _kernel_layout_ok, _strides
from hattn.ops.runner import _problem_kwargs
from helpers import INPUT_MEAN, binding, check_sequence, cu_seqlens_of, requires_hopper

HQ, HKV, D = 8, 2, 64
LENS_Q, LENS_K = [100, 0, 37], [120, 5, 0]  # an empty query side and an empty key side


def varlen_args(lens_q=LENS_Q, lens_k=LENS_K, heads_q=HQ, heads_kv=HKV, head_dim=D, dtype=torch.bfloat16, device="cpu"):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of random packed inputs."""
    q = torch.randn(sum(lens_q), heads_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lens_k), heads_kv, head_dim, dtype=dtype, device=device)
    return (
        q, k, torch.randn_like(k), cu_seqlens_of(lens_q, device), cu_seqlens_of(lens_k, device),
        max(max(lens_q), 1), max(max(lens_k), 1),
    )  # fmt: skip


def replace(args, **changes):
    """varlen_args with some replaced by name."""
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    values = dict(zip(names, args))
    values.update(changes)
    return tuple(values[n] for n in names)


# --- package (CPU) ---------------------------------------------------------------------------------


def test_exported():
    assert callable(hattn.attention_varlen) and callable(hattn.flash_attn_varlen_func)
    assert {"attention_varlen", "flash_attn_varlen_func"} <= set(hattn.__all__)
    assert hasattr(torch.ops.hattn, "attention_varlen_fwd")


def test_op_schema():
    schema = str(torch.ops.hattn.attention_varlen_fwd.default._schema)
    args = (
        "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, bool causal, float? softmax_scale, str kernel, bool return_lse, "
        "SymInt window_left=-1, SymInt window_right=-1, float softcap=0., bool deterministic=False"
    )
    assert schema.startswith(f"hattn::attention_varlen_fwd({args})")
    assert schema.endswith("-> (Tensor, Tensor)")


# --- argument errors (raised before any GPU is needed) -----------------------------------------------


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (
            lambda a: replace(a, q=a[0][None]),
            ValueError,
            r"q: must be 3-D \[total_q, heads, head_dim\] \(the sequences packed along dim 0\)",
        ),
        (lambda a: replace(a, k=a[1][0]), ValueError, r"k: must be 3-D \[total_k, heads, head_dim\]"),
        (lambda a: replace(a, v=a[2].unsqueeze(0)), ValueError, r"v: must be 3-D"),
        (lambda a: replace(a, q=a[0].float()), ValueError, r"q: dtype must be torch.bfloat16 or torch.float16"),
        (
            lambda a: replace(a, k=a[1].half()),
            ValueError,
            r"k: dtype torch.float16 must match q's dtype torch.bfloat16",
        ),
        (
            lambda a: replace(a, v=a[2][:7]),
            ValueError,
            r"v: shape \(7, 2, 64\) must equal k's shape \(125, 2, 64\) \[total_k, heads_kv, head_dim\]",
        ),
        (
            lambda a: replace(a, k=a[1][..., :32], v=a[2][..., :32]),
            ValueError,
            r"k: head_dim 32 must equal q's head_dim 64",
        ),
        (
            lambda a: replace(a, q=a[0][:, :5], k=a[1][:, :2], v=a[2][:, :2]),
            ValueError,
            r"k: q's heads \(5\) must be a multiple of k/v's heads \(2\)",
        ),
        (
            lambda a: replace(a, cu_seqlens_q=a[3].long()),
            ValueError,
            r"cu_seqlens_q: dtype must be torch.int32, got torch.int64",
        ),
        (lambda a: replace(a, cu_seqlens_k=a[4].float()), ValueError, r"cu_seqlens_k: dtype must be torch.int32"),
        (
            lambda a: replace(a, cu_seqlens_k=a[4][:3]),
            ValueError,
            r"cu_seqlens_k: length 3 must equal cu_seqlens_q's length 4 \(batch \+ 1\)",
        ),
        (
            lambda a: replace(a, cu_seqlens_q=a[3][:0], cu_seqlens_k=a[4][:0]),
            ValueError,
            r"cu_seqlens_q: must be 1-D \[batch \+ 1\], got shape \(0,\)",
        ),
        (
            lambda a: replace(a, cu_seqlens_k=a[4][None]),
            ValueError,
            r"cu_seqlens_k: must be 1-D \[batch \+ 1\], got shape \(1, 4\)",
        ),
        (lambda a: replace(a, max_seqlen_q=-1), ValueError, r"max_seqlen_q: must be >= 0, got -1"),
        (lambda a: replace(a, max_seqlen_k=-3), ValueError, r"max_seqlen_k: must be >= 0, got -3"),
        (lambda a: replace(a, max_seqlen_k=120.0), TypeError, r"max_seqlen_k: must be an int .*, got float"),
        (
            lambda a: replace(a, max_seqlen_q=torch.tensor(100)),
            TypeError,
            r"max_seqlen_q: must be an int .*, got Tensor",
        ),
        (lambda a: replace(a, max_seqlen_q=True), TypeError, r"max_seqlen_q: must be an int .*, got bool"),
        (lambda a: replace(a, q="q"), TypeError, r"q: must be a torch.Tensor, got str"),
        (
            lambda a: replace(a, cu_seqlens_k=[0, 120, 125, 125]),
            TypeError,
            r"cu_seqlens_k: must be a torch.Tensor, got list",
        ),
    ],
)
def test_argument_errors_name_the_argument(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention_varlen(*mutate(varlen_args()))


def test_unknown_kernel_and_window_size():
    with pytest.raises(ValueError, match=r"kernel: unknown kernel 'nope' \(known: auto, 01_"):
        hattn.attention_varlen(*varlen_args(), kernel="nope")
    with pytest.raises(ValueError, match=r"window_size: must be a pair"):
        hattn.attention_varlen(*varlen_args(), window_size=5)


def test_cpu_tensors_are_refused_clearly():
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"q: must be a CUDA tensor, got device cpu"):
            hattn.attention_varlen(*varlen_args())
    else:
        with pytest.raises(RuntimeError, match=r"no suitable GPU is present.*Hopper.*q is on cpu"):
            hattn.attention_varlen(*varlen_args())


# --- shape inference: the fake implementation, on meta tensors -------------------------------------


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_shapes(dtype, return_lse):
    args = varlen_args(dtype=dtype, device="meta")
    q = args[0]
    out, lse = torch.ops.hattn.attention_varlen_fwd(*args, True, None, "auto", return_lse)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.dtype == torch.float32
    assert lse.shape == ((HQ, sum(LENS_Q)) if return_lse else (0,))


def test_meta_validates_too():
    args = varlen_args(device="meta")
    with pytest.raises(ValueError, match=r"cu_seqlens_k: length 2 must equal cu_seqlens_q's length 4"):
        torch.ops.hattn.attention_varlen_fwd(*replace(args, cu_seqlens_k=args[4][:2]), False, None, "auto", False)
    with pytest.raises(ValueError, match=r"max_seqlen_q: must be >= 0, got -1"):
        torch.ops.hattn.attention_varlen_fwd(*replace(args, max_seqlen_q=-1), False, None, "auto", False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_traces_without_breaks(dynamic):
    """Dynamo traces hattn.attention_varlen into one graph (real GPU runs are below)."""
    torch._dynamo.reset()

    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        out, lse = hattn.attention_varlen(
            q * 2, k, v, cu_q, cu_k, max_q, max_k, causal=True, softmax_scale=0.125, return_lse=True
        )
        return out.float().sum(-1), lse + 1

    args = varlen_args(device="meta")
    out, lse = torch.compile(f, backend="eager", fullgraph=True, dynamic=dynamic)(*args)
    assert out.shape == (sum(LENS_Q), HQ) and lse.shape == (HQ, sum(LENS_Q))
    explanation = torch._dynamo.explain(f)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# --- routing and the raw binding ---------------------------------------------------------------------


def resolve(args, kernel="auto", causal=False, window=(-1, -1)):
    """The kernel _C resolves a varlen problem of these (CPU) tensors to; launches nothing."""
    q, k, v, cu_q, cu_k, max_q, max_k = args
    kwargs = _problem_kwargs(q, k, v, torch.empty_like(q), None, causal, None, kernel, window, (cu_q, cu_k, max_q, max_k))
    return binding(_C.resolve_kernel, **kwargs)


def test_problem_kwargs_of_packed_tensors():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args()
    kwargs = _problem_kwargs(q, k, v, torch.empty_like(q), None, False, None, "auto", (-1, -1), (cu_q, cu_k, max_q, max_k))
    assert kwargs["batch"] == 3 and kwargs["seqlen_q"] == 100 and kwargs["seqlen_k"] == 120
    assert kwargs["total_q"] == 137 and kwargs["total_k"] == 125
    assert kwargs["heads_q"] == HQ and kwargs["heads_kv"] == HKV and kwargs["head_dim"] == D
    assert kwargs["cu_seqlens_q"] == cu_q.data_ptr() and kwargs["cu_seqlens_k"] == cu_k.data_ptr()
    assert kwargs["q_strides"] == (0, HQ * D, D) and kwargs["k_strides"] == (0, HKV * D, D)
    dense = _problem_kwargs(*(t.unsqueeze(0) for t in (q, k, v, q)), None, False, None, "auto")
    assert "cu_seqlens_q" not in dense and dense["q_strides"] == (137 * HQ * D, HQ * D, D)


def test_only_the_final_kernel_has_it():
    names = [k.name for k in hattn.kernels()]
    args = varlen_args()
    assert resolve(args) == names[-1]
    assert resolve(args, causal=True, window=(16, 0)) == names[-1]
    for name in names[:-1]:
        with pytest.raises(NotImplementedError, match=rf"{name}: no variable-length batch"):
            resolve(args, kernel=name)


def test_binding_varlen_errors():
    args = varlen_args()
    q, k, v, cu_q, cu_k, max_q, max_k = args
    kwargs = _problem_kwargs(q, k, v, torch.empty_like(q), None, False, None, "auto", (-1, -1), (cu_q, cu_k, max_q, max_k))
    with pytest.raises(ValueError, match=r"^invalid_argument: cu_seqlens_k: must be set together with cu_seqlens_q"):
        binding(_C.resolve_kernel, **{**kwargs, "cu_seqlens_k": 0})
    with pytest.raises(ValueError, match=r"^invalid_argument: total_q: must be >= 1 with cu_seqlens"):
        binding(_C.resolve_kernel, **{**kwargs, "total_q": 0})
    # All queries empty: nothing for the kernel to do, and the library refuses it, as it does Sq = 0.
    with pytest.raises(ValueError, match=r"total_q: must be >= 1"):
        resolve(varlen_args(lens_q=[0, 0, 0]))


# --- layouts: which packed inputs are read in place ---------------------------------------------------


def test_layout_rules_of_packed_tensors():
    qkv = torch.randn(300, 3, 4, 128, dtype=torch.bfloat16)  # packed qkv [total, 3, H, D]
    assert _kernel_layout_ok(torch.randn(300, 4, 128, dtype=torch.bfloat16))
    assert _kernel_layout_ok(qkv[:, 1])
    assert _strides(qkv[:, 1]) == (0, 3 * 4 * 128, 128)
    assert _kernel_layout_ok(torch.randn(4, 300, 64, dtype=torch.float16).transpose(0, 1))  # [H, T, D] storage
    assert _kernel_layout_ok(torch.randn(1, 4, 64, dtype=torch.float16)[:, :, :64])
    odd = torch.randn(300, 4, 132, dtype=torch.bfloat16)[..., :128]
    assert not _kernel_layout_ok(odd)
    assert not _kernel_layout_ok(torch.randn(300, 4, 256, dtype=torch.bfloat16)[..., ::2])  # D strided
    assert not _kernel_layout_ok(torch.randn(300, 1, 128, dtype=torch.bfloat16).expand(300, 4, 128))  # stride 0
    misaligned = torch.randn(300 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(300, 4, 128)
    assert misaligned.is_contiguous() and not _kernel_layout_ok(misaligned)

    ok = qkv[:, 0]
    assert _as_kernel_input(ok) is ok
    for bad in (odd, misaligned):
        fixed = _as_kernel_input(bad)
        assert fixed.is_contiguous() and _kernel_layout_ok(fixed) and torch.equal(fixed, bad)


# --- GPU: every sequence against the fp64 reference on that sequence alone ------------------------------


def make_varlen(lens_q, lens_k, heads_q, heads_kv, head_dim, dtype, seed=0):
    """Packed CUDA inputs (randn + INPUT_MEAN, as make_qkv) and int32 CUDA offsets."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(total, heads):
        return torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    q, k, v = rand(sum(lens_q), heads_q), rand(sum(lens_k), heads_kv), rand(sum(lens_k), heads_kv)
    return q, k, v, cu_seqlens_of(lens_q, "cuda"), cu_seqlens_of(lens_k, "cuda")


def check_varlen(q, k, v, lens_q, lens_k, out, lse, causal=False, softmax_scale=None, window=(-1, -1)):
    """Each sequence's rows of out and lse against attention_ref on that sequence alone, within
    twice the error of plain same-dtype torch (the bound of test_gpu.py)."""
    total_q, heads_q, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    sq0 = sk0 = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(sq0, sq0 + sq)
        o, lse_b = out[rows], lse[:, rows]
        sq0, sk0, keys = sq0 + sq, sk0 + sk, slice(sk0, sk0 + sk)
        if sq == 0:
            continue
        check_sequence(o, lse_b, q[rows], k[keys], v[keys], causal, softmax_scale, window, f"sequence {b}")
    assert sq0 == total_q and sk0 == k.shape[0]


def run_varlen(lens_q, lens_k, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, causal=False,
               softmax_scale=None, window=(-1, -1), seed=0):  # fmt: skip
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, heads_q, heads_kv, head_dim, dtype, seed)
    out, lse = hattn.attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, softmax_scale=softmax_scale,
        return_lse=True, window_size=window,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_varlen(q, k, v, lens_q, lens_k, out, lse, causal, softmax_scale, window)


def random_lengths(n, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=gen).tolist()


LENGTHS = {
    # (lens_q, lens_k)
    "one": ([1000], [1000]),
    "one_cross": ([130], [700]),
    "mixed": ([1, 17, 128, 129, 300, 513, 64], [1, 129, 128, 17, 300, 255, 1000]),
    "empty_q": ([0, 200, 0, 77], [50, 200, 33, 77]),
    "empty_k": ([90, 200, 31], [0, 150, 0]),
    "q_longer": ([300, 129], [100, 17]),  # causal: rows before the keys see nothing
    "self_40": (random_lengths(40, 0, 300, seed=1),) * 2,
    "cross_40": (random_lengths(40, 0, 260, seed=2), random_lengths(40, 0, 400, seed=3)),
}


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
def test_matches_each_sequence_alone(lengths, causal):
    lens_q, lens_k = LENGTHS[lengths]
    run_varlen(lens_q, lens_k, causal=causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtype_and_head_dim(dtype, head_dim, causal):
    lens_q, lens_k = LENGTHS["mixed"]
    run_varlen(lens_q, lens_k, 4, 4, head_dim, dtype, causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [8, 4, 1], ids=["gqa1", "gqa2", "gqa8"])
def test_gqa(heads_kv, causal):
    lens_q, lens_k = LENGTHS["cross_40"]
    run_varlen(lens_q, lens_k, 8, heads_kv, 64, causal=causal)


@requires_hopper
@pytest.mark.parametrize(
    "head_dim, causal, window",
    [(128, False, (64, 64)), (64, True, (100, -1)), (256, False, (0, 0)), (128, False, (-1, 40)), (64, True, (7, 0))],
)
def test_sliding_window(head_dim, causal, window):
    lens_q, lens_k = LENGTHS["mixed"]
    run_varlen(lens_q, lens_k, 4, 2, head_dim, causal=causal, window=window)


@requires_hopper
def test_softmax_scale():
    lens_q, lens_k = LENGTHS["cross_40"]
    run_varlen(lens_q, lens_k, 4, 4, 128, torch.float16, causal=True, softmax_scale=0.3)


@requires_hopper
def test_equal_lengths_match_the_dense_op():
    """A batch of equal lengths packed along the rows is the dense problem."""
    B, S, H, D = 3, 333, 8, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN for _ in range(3))
    cu = cu_seqlens_of([S] * B, "cuda")
    out, lse = hattn.attention_varlen(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, S, S, causal=True, return_lse=True)
    dense, dense_lse = hattn.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out.view(B, S, H, D), dense, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse.view(H, B, S).transpose(0, 1), dense_lse, rtol=0, atol=1e-4)


@requires_hopper
def test_max_seqlen_above_the_longest():
    """max_seqlen is a bound: one larger than the longest sequence gives the same result."""
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, torch.bfloat16)
    exact = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    loose = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q) + 700, max(lens_k) + 300, causal=True)
    torch.testing.assert_close(loose, exact, rtol=0, atol=0)


@requires_hopper
def test_return_lse_false_gives_the_same_output():
    lens_q, lens_k = LENGTHS["cross_40"]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 8, 2, 128, torch.bfloat16)
    out = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    out2, _ = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


@requires_hopper
def test_strided_views_and_offsets():
    """Packed qkv slices are read in place; odd layouts and strided offsets are copied first."""
    lens = [300, 0, 129, 64]
    T, H, D = sum(lens), 4, 128
    qkv = torch.randn(T, 3, H, D, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN
    q, k, v = qkv.unbind(1)
    assert all(_kernel_layout_ok(t) for t in (q, k, v))
    cu = cu_seqlens_of(lens, "cuda")
    out, lse = hattn.attention_varlen(q, k, v, cu, cu, 300, 300, causal=True, return_lse=True)
    check_varlen(q, k, v, lens, lens, out, lse, causal=True)

    q2 = (torch.randn(T, H, D + 4, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN)[..., :D]  # copied
    k2 = k.clone()[:, :1].expand(T, H, D)  # stride 0: copied
    assert not _kernel_layout_ok(q2) and not _kernel_layout_ok(k2)
    cu_strided = torch.stack([cu, cu * 7], dim=1)[:, 0]  # stride 2: copied
    assert not cu_strided.is_contiguous()
    out, lse = hattn.attention_varlen(q2, k2, v, cu_strided, cu, 300, 300, return_lse=True)
    check_varlen(q2, k2, v, lens, lens, out, lse)


@requires_hopper
def test_gpu_argument_errors_and_lineage_kernels():
    args = varlen_args(device="cuda")
    with pytest.raises(ValueError, match=r"cu_seqlens_q: must be a CUDA tensor, got device cpu"):
        hattn.attention_varlen(*replace(args, cu_seqlens_q=args[3].cpu()))
    with pytest.raises(ValueError, match=r"k: must be a CUDA tensor, got device cpu"):
        hattn.attention_varlen(*replace(args, k=args[1].cpu()))
    with pytest.raises(NotImplementedError, match=r"no variable-length batch"):
        hattn.attention_varlen(*args, kernel=hattn.kernels()[0].name)
    with pytest.raises(ValueError, match=r"^invalid_argument: head_dim: must be 64, 128 or 256 \(got 96\)"):
        hattn.attention_varlen(*varlen_args(head_dim=96, device="cuda"))


# --- GPU: the op in torch.compile, CUDA graphs, opcheck ---------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(dynamic):
    torch._dynamo.reset()

    def block(x, wq, wkv, cu, max_seqlen):
        T, _ = x.shape
        q = (x @ wq).view(T, 8, 128)
        k, v = (x @ wkv).view(T, 2, 2, 128).unbind(1)  # GQA, strided views of one projection
        out, lse = hattn.attention_varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, return_lse=True)
        return out.flatten(1) + x, lse.exp().sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    wq = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    wkv = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) / 32
    for lens in ([256, 100, 31], [384, 7, 0, 200]):
        x = torch.randn(sum(lens), 1024, device="cuda", dtype=torch.bfloat16)
        cu = cu_seqlens_of(lens, "cuda")
        out, total = compiled(x, wq, wkv, cu, max(lens))
        expected, expected_total = block(x, wq, wkv, cu, max(lens))
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # inductor may fuse the projections differently
        torch.testing.assert_close(total, expected_total, rtol=1e-3, atol=0)


@requires_hopper
def test_cuda_graph_capture_and_replay_with_new_lengths():
    """The offsets are read on the GPU only, so one graph serves any lengths of the same totals."""
    lens_q, lens_k = [300, 0, 129, 71], [250, 90, 0, 160]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 8, 2, 128, torch.bfloat16, seed=1)
    max_q, max_k = 400, 400  # covers every length list below
    hattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = hattn.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    for seed, (new_q, new_k) in ((2, (lens_q, lens_k)), (3, ([100, 400, 0, 0], [0, 300, 100, 100]))):
        q2, k2, v2, cu_q2, cu_k2 = make_varlen(new_q, new_k, 8, 2, 128, torch.bfloat16, seed=seed)
        for dst, src in ((q, q2), (k, k2), (v, v2), (cu_q, cu_q2), (cu_k, cu_k2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_lse = hattn.attention_varlen(
            q2, k2, v2, cu_q2, cu_k2, max_q, max_k, causal=True, return_lse=True
        )
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
        check_varlen(q2, k2, v2, new_q, new_k, out, lse, causal=True)


@requires_hopper
def test_opcheck():
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 64, torch.bfloat16)
    for causal, scale, return_lse in ((False, None, True), (True, 0.2, False)):
        args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, scale, "auto", return_lse)
        torch.library.opcheck(torch.ops.hattn.attention_varlen_fwd.default, args)


@pytest.mark.parametrize(
    "lens_q, lens_k",
    [([], []), ([0, 0], [5, 7]), ([3, 4], [0, 0]), ([0], [0])],
    ids=["no-sequence", "no-queries", "no-keys", "empty-sequence"],
)
def test_meta_accepts_empty_batches(lens_q, lens_k):
    """Nothing to compute (no sequence, no query or no key in any) is a valid call (see the GPU test)."""
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = torch.empty(total_q, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(total_k, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(len(lens_q) + 1, device="meta", dtype=torch.int32)
    out, lse = torch.ops.hattn.attention_varlen_fwd(q, k, k, cu, cu, max(lens_q, default=0), max(lens_k, default=0),
                                                     False, None, "auto", True)
    assert out.shape == q.shape and lse.shape == (4, total_q)


@requires_hopper
@pytest.mark.parametrize(
    "lens_q, lens_k",
    [([], []), ([0, 0], [5, 7]), ([3, 4], [0, 0]), ([0], [0])],
    ids=["no-sequence", "no-queries", "no-keys", "empty-sequence"],
)
def test_empty_batches_give_empty_results(lens_q, lens_k):
    """As the dense op: rows that see no key give out 0 and LSE -inf, and every gradient is 0; no
    kernel runs, and nothing raises."""
    make = lambda rows, h: torch.randn(rows, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(sum(lens_q), 4), make(sum(lens_k), 2), make(sum(lens_k), 2)
    cu_q, cu_k = cu_seqlens_of(lens_q), cu_seqlens_of(lens_k)
    out, lse = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0),
                                      causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.all(t.grad == 0)


@requires_hopper
@pytest.mark.parametrize("causal, window", [(True, (100, 0)), (False, (90, 30))])
def test_window_edges_do_not_rest_on_max_seqlen(causal, window):
    """A max_seqlen_k (and max_seqlen_q) below the longest sequence cannot drop a window edge: the
    kernel works out each sequence's own bounds, and an edge is dropped only when it binds no row
    of the tensors (it once used the promised lengths: error 1.31 against fp64)."""
    lens_q, lens_k = [50, 60, 40], [300, 80, 120]
    q, k, v, cu_q, cu_k = make_varlen(lens_q, lens_k, 4, 2, 128, torch.bfloat16, seed=5)
    out, lse = hattn.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), 80, causal=causal, return_lse=True,
                                      window_size=window)  # fmt: skip
    torch.cuda.synchronize()
    check_varlen(q, k, v, lens_q, lens_k, out, lse, causal, None, window)
