"""hattn.attention_paged (a paged KV cache through a block table), attention's seqlens_k (keys in
use per sequence of a dense cache) and num_splits (split-KV).

The CPU tests run everywhere: argument errors, op schemas, shape inference on meta tensors,
torch.compile tracing, the problem handed to the binding, and routing (only the production forward
has seqlens_k and paged caches, and only with page_size a multiple of 128). The GPU tests
(Hopper only) gather each sequence's logical keys and values out of its pages and compare with
the fp64 reference run on them alone, and run the op under torch.compile, CUDA graphs and opcheck.
"""

import functools
import math

import hattn
import pytest
import torch
from hattn import _C
from hattn.ops.checks import _kernel_layout_ok
from hattn.ops.runner import _problem_kwargs
from helpers import INPUT_MEAN, binding, check_sequence, requires_hopper

B, SQ, HQ, HKV, D = 3, 4, 8, 2, 64
PAGE, NUM_PAGES, MAX_PAGES = 128, 10, 4
NAMES = ("q", "k_cache", "v_cache", "block_table", "seqlens_k")


def paged_args(batch=B, seqlen_q=SQ, heads_q=HQ, heads_kv=HKV, head_dim=D, page_size=PAGE, num_pages=NUM_PAGES,
               max_pages=MAX_PAGES, dtype=torch.bfloat16, device="cpu"):  # fmt: skip
    """(q, k_cache, v_cache, block_table, seqlens_k) of random inputs; the table's values don't matter off the GPU."""
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_pages, page_size, heads_kv, head_dim, dtype=dtype, device=device)
    table = (torch.arange(batch * max_pages, device=device) % num_pages).to(torch.int32).view(batch, max_pages)
    seqlens_k = torch.full((batch,), 200, dtype=torch.int32, device=device)
    return q, k_cache, torch.randn_like(k_cache), table, seqlens_k


def replace(args, **changes):
    """paged_args with some replaced by name."""
    values = dict(zip(NAMES, args))
    values.update(changes)
    return tuple(values[n] for n in NAMES)


def kernel_names():
    return [k.name for k in hattn.kernels()]


# --- package (CPU) ---------------------------------------------------------------------------------


def test_exported():
    assert callable(hattn.attention_paged) and callable(hattn.flash_attn_with_kvcache)
    assert {"attention_paged", "flash_attn_with_kvcache"} <= set(hattn.__all__)
    assert hasattr(torch.ops.hattn, "attention_paged_fwd")


def test_op_schemas():
    schema = str(torch.ops.hattn.attention_paged_fwd.default._schema)
    args = (
        "Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seqlens_k, bool causal, "
        "float? softmax_scale, str kernel, bool return_lse, SymInt window_left=-1, SymInt window_right=-1, "
        "SymInt num_splits=0, Tensor? kv_batch_idx=None, float softcap=0., Tensor? k_descale=None, "
        "Tensor? v_descale=None"
    )
    assert schema == f"hattn::attention_paged_fwd({args}) -> (Tensor, Tensor)"
    # attention_fwd gained its new arguments at the end: positional callers keep working.
    schema = str(torch.ops.hattn.attention_fwd.default._schema)
    args = (
        "Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, str kernel, bool return_lse, "
        "SymInt window_left=-1, SymInt window_right=-1, Tensor? seqlens_k=None, SymInt num_splits=0, "
        "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, float softcap=0., bool deterministic=False, "
        "Tensor? k_descale=None, Tensor? v_descale=None"
    )
    assert schema == f"hattn::attention_fwd({args}) -> (Tensor, Tensor)"


# --- argument errors (raised before any GPU is needed) -----------------------------------------------


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda a: replace(a, q=a[0][0]), ValueError, r"q: must be 4-D \[batch, seqlen, heads, head_dim\]"),
        (
            lambda a: replace(a, k_cache=a[1][0]),
            ValueError,
            r"k_cache: must be 4-D \[num_pages, page_size, heads_kv, head_dim\] \(a paged cache\), got shape "
            r"\(128, 2, 64\)",
        ),
        (lambda a: replace(a, v_cache=a[2][None]), ValueError, r"v_cache: must be 4-D \[num_pages, page_size"),
        (lambda a: replace(a, q=a[0].float()), ValueError, r"q: dtype must be torch.bfloat16 or torch.float16"),
        (
            lambda a: replace(a, k_cache=a[1].half()),
            ValueError,
            r"k_cache: dtype torch.float16 must match q's dtype torch.bfloat16",
        ),
        (lambda a: replace(a, v_cache=a[2].to(torch.int8)), ValueError, r"v_cache: dtype must be torch.bfloat16"),
        (
            lambda a: replace(a, v_cache=a[2][:9]),
            ValueError,
            r"v_cache: shape \(9, 128, 2, 64\) must equal k_cache's shape \(10, 128, 2, 64\) "
            r"\[num_pages, page_size, heads_kv, head_dim\]",
        ),
        (
            lambda a: replace(a, k_cache=a[1][:, :0], v_cache=a[2][:, :0]),
            ValueError,
            r"k_cache: num_pages and page_size \(dims 0 and 1\) must be >= 1, got shape \(10, 0, 2, 64\)",
        ),
        (
            lambda a: replace(a, k_cache=a[1][..., :32], v_cache=a[2][..., :32]),
            ValueError,
            r"k_cache: head_dim 32 must equal q's head_dim 64",
        ),
        (
            lambda a: replace(a, q=a[0][:, :, :5]),
            ValueError,
            r"k_cache: q's heads \(5\) must be a multiple of k_cache/v_cache's heads \(2\)",
        ),
        (
            lambda a: replace(a, block_table=a[3].long()),
            ValueError,
            r"block_table: dtype must be torch.int32, got torch.int64",
        ),
        (
            lambda a: replace(a, block_table=a[3][0]),
            ValueError,
            r"block_table: must be 2-D \[batch, max_pages_per_seq\] with q's batch 3 and max_pages_per_seq >= 1, "
            r"got shape \(4,\)",
        ),
        (lambda a: replace(a, block_table=a[3][:2]), ValueError, r"block_table: must be 2-D .*got shape \(2, 4\)"),
        (lambda a: replace(a, block_table=a[3][:, :0]), ValueError, r"block_table: must be 2-D .*got shape \(3, 0\)"),
        (
            lambda a: replace(a, block_table=torch.zeros(1, 1, dtype=torch.int32).expand(3, 2**24)),
            ValueError,
            r"block_table: max_pages_per_seq \(16777216\) \* page_size \(128\) keys exceed 2\^31 - 1",
        ),
        (lambda a: replace(a, seqlens_k=a[4].long()), ValueError, r"seqlens_k: dtype must be torch.int32"),
        (
            lambda a: replace(a, seqlens_k=a[4][:2]),
            ValueError,
            r"seqlens_k: must be 1-D \[batch\] with q's batch 3, got shape \(2,\)",
        ),
        (lambda a: replace(a, seqlens_k=a[4][None]), ValueError, r"seqlens_k: must be 1-D .*got shape \(1, 3\)"),
        (lambda a: replace(a, seqlens_k=200), TypeError, r"seqlens_k: must be a torch.Tensor, got int"),
        (lambda a: replace(a, block_table=[[0, 1]] * 3), TypeError, r"block_table: must be a torch.Tensor, got list"),
        (lambda a: replace(a, k_cache="k"), TypeError, r"k_cache: must be a torch.Tensor, got str"),
    ],
)
def test_argument_errors_name_the_argument(mutate, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention_paged(*mutate(paged_args()))


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"num_splits": 65}, ValueError, r"num_splits: must be 0 \(automatic\), 1 \(off\) or up to 64, got 65"),
        ({"num_splits": -1}, ValueError, r"num_splits: must be 0 \(automatic\), 1 \(off\) or up to 64, got -1"),
        ({"num_splits": 2.0}, TypeError, r"num_splits: must be an int, got float"),
        ({"num_splits": True}, TypeError, r"num_splits: must be an int, got bool"),
        ({"kernel": "nope"}, ValueError, r"kernel: unknown kernel 'nope' \(known: auto, 01_"),
        ({"window_size": 5}, ValueError, r"window_size: must be a pair"),
    ],
)
def test_keyword_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        hattn.attention_paged(*paged_args(), **kwargs)


def dense_args(**shape):
    """(q, k, v, seqlens_k) of a dense cache of 300 keys per sequence."""
    q, _, _, _, seqlens_k = paged_args(**shape)
    k = torch.randn(q.shape[0], 300, HKV, q.shape[-1], dtype=q.dtype)
    return q, k, torch.randn_like(k), seqlens_k


@pytest.mark.parametrize(
    "seqlens_k, error, pattern",
    [
        (lambda s: s.long(), ValueError, r"seqlens_k: dtype must be torch.int32, got torch.int64"),
        (lambda s: s[:1], ValueError, r"seqlens_k: must be 1-D \[batch\] with q's batch 3, got shape \(1,\)"),
        (lambda s: s.tolist(), TypeError, r"seqlens_k: must be a torch.Tensor, got list"),
    ],
)
def test_attention_seqlens_k_errors(seqlens_k, error, pattern):
    q, k, v, lens = dense_args()
    with pytest.raises(error, match=pattern):
        hattn.attention(q, k, v, seqlens_k=seqlens_k(lens))
    if not isinstance(seqlens_k(lens), list):
        with pytest.raises(error, match=pattern):
            hattn.resolve_kernel(q, k, v, seqlens_k=seqlens_k(lens))


@pytest.mark.parametrize("name", ["kv_batch_idx", "leftpad_k"])
def test_attention_cache_index_errors(name):
    q, k, v, lens = dense_args()
    for bad, error, pattern in (
        (lens.long(), ValueError, rf"{name}: dtype must be torch.int32, got torch.int64"),
        (lens[:2], ValueError, rf"{name}: must be 1-D \[batch\] with q's batch 3, got shape \(2,\)"),
        ([0, 1, 2], TypeError, rf"{name}: must be a torch.Tensor, got list"),
    ):
        with pytest.raises(error, match=pattern):
            hattn.attention(q, k, v, seqlens_k=lens, **{name: bad})


def test_cache_entries_free_the_cache_batch():
    """With kv_batch_idx, a dense k and v and a block table may have any number of entries."""
    q, k, v, lens = dense_args()
    with pytest.raises(ValueError, match=r"k: batch 5 must equal q's batch 3"):
        hattn.attention(q, k[:1].expand(5, -1, -1, -1), v[:1].expand(5, -1, -1, -1))
    index = torch.tensor([4, 0, 4], dtype=torch.int32)
    gpu = r"no suitable GPU|must be a CUDA tensor"  # past every shape check
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.attention(
            q, k[:1].expand(5, -1, -1, -1), v[:1].expand(5, -1, -1, -1), seqlens_k=lens, kv_batch_idx=index
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"k: must have at least one batch entry"):
        hattn.attention(q, k[:0], v[:0], kv_batch_idx=index)
    args = paged_args()
    wide = torch.zeros(7, MAX_PAGES, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table: must be 2-D \[batch, max_pages_per_seq\] with q's batch 3"):
        hattn.attention_paged(*replace(args, block_table=wide))
    with pytest.raises((RuntimeError, ValueError), match=gpu):
        hattn.attention_paged(*replace(args, block_table=wide), kv_batch_idx=index)
    with pytest.raises(ValueError, match=r"block_table: must be 2-D \[rows, max_pages_per_seq\], both >= 1"):
        hattn.attention_paged(*replace(args, block_table=wide[:0]), kv_batch_idx=index)
    with pytest.raises(ValueError, match=r"kv_batch_idx: must be 1-D \[batch\] with q's batch 3"):
        hattn.attention_paged(*args, kv_batch_idx=index[:1])


def test_cache_entries_and_left_padding_reach_the_binding():
    q, k, v, lens = dense_args()
    index, pad = torch.tensor([1, 0, 1], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    kwargs = _problem_kwargs(q, k[:2], v[:2], torch.empty_like(q), None, False, None, "auto", seqlens_k=lens, kv_batch_idx=index,
                             leftpad_k=pad)  # fmt: skip
    assert kwargs["kv_batch_idx"] == index.data_ptr() and kwargs["kv_batch"] == 2
    assert kwargs["leftpad_k"] == pad.data_ptr() and kwargs["batch"] == 3
    assert binding(_C.resolve_kernel, **kwargs) == kernel_names()[-1]
    args = paged_args()
    q, k_cache, v_cache, table, lens = args
    kwargs = _problem_kwargs(q, k_cache, v_cache, torch.empty_like(q), None, False, None, "auto", seqlens_k=lens,
                             block_table=table.repeat(2, 1), kv_batch_idx=index)  # fmt: skip
    assert kwargs["kv_batch"] == 2 * B and kwargs["max_pages_per_seq"] == MAX_PAGES
    with pytest.raises(ValueError, match=r"leftpad_k: not with block_table"):
        binding(_C.resolve_kernel, **paged_kwargs(args), leftpad_k=pad.data_ptr())
    q, k, v, _ = dense_args()
    kwargs = _problem_kwargs(q, k, v, torch.empty_like(q), None, False, None, kernel_names()[-2], kv_batch_idx=index)
    with pytest.raises(NotImplementedError, match=r"no kv_batch_idx or leftpad_k"):
        binding(_C.resolve_kernel, **kwargs)


def test_attention_num_splits_errors():
    q, k, v, _ = dense_args()
    with pytest.raises(ValueError, match=r"num_splits: must be 0 \(automatic\), 1 \(off\) or up to 64, got 100"):
        hattn.attention(q, k, v, num_splits=100)
    with pytest.raises(TypeError, match=r"num_splits: must be an int, got NoneType"):
        hattn.attention(q, k, v, num_splits=None)


def test_cpu_tensors_are_refused_clearly():
    q, k, v, lens = dense_args()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"q: must be a CUDA tensor, got device cpu"):
            hattn.attention_paged(*paged_args())
        with pytest.raises(ValueError, match=r"q: must be a CUDA tensor, got device cpu"):
            hattn.attention(q, k, v, seqlens_k=lens)
    else:
        with pytest.raises(RuntimeError, match=r"no suitable GPU is present.*Hopper.*q is on cpu"):
            hattn.attention_paged(*paged_args())
        with pytest.raises(RuntimeError, match=r"no suitable GPU is present.*Hopper.*q is on cpu"):
            hattn.attention(q, k, v, seqlens_k=lens, num_splits=3)


# --- shape inference: the fake implementations, on meta tensors ------------------------------------


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_shapes(dtype, return_lse):
    args = paged_args(dtype=dtype, device="meta")
    q = args[0]
    out, lse = torch.ops.hattn.attention_paged_fwd(*args, True, None, "auto", return_lse, 16, 0, 3)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == ((B, HQ, SQ) if return_lse else (0,))

    q, k, v, lens = (t.to("meta") for t in dense_args(dtype=dtype))
    out, lse = torch.ops.hattn.attention_fwd(q, k, v, False, None, "auto", return_lse, -1, -1, lens, 2)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == ((B, HQ, SQ) if return_lse else (0,))
    # Cache entries (a cache of 5) and left padding.
    k, v = (t[:1].expand(5, -1, -1, -1) for t in (k, v))
    out, lse = torch.ops.hattn.attention_fwd(q, k, v, True, None, "auto", return_lse, -1, -1, lens, 0, lens, lens)
    assert out.shape == q.shape and lse.shape == ((B, HQ, SQ) if return_lse else (0,))
    out, _ = torch.ops.hattn.attention_paged_fwd(*args[:3], args[3].repeat(2, 1), *args[4:], True, None, "auto",
                                                 return_lse, -1, -1, 0, args[4])  # fmt: skip
    assert out.shape == args[0].shape


def test_meta_validates_too():
    args = paged_args(device="meta")
    with pytest.raises(ValueError, match=r"block_table: must be 2-D .*got shape \(2, 4\)"):
        torch.ops.hattn.attention_paged_fwd(*replace(args, block_table=args[3][:2]), False, None, "auto", False)
    with pytest.raises(ValueError, match=r"num_splits: must be 0 \(automatic\), 1 \(off\) or up to 64, got 65"):
        torch.ops.hattn.attention_paged_fwd(*args, False, None, "auto", False, -1, -1, 65)
    q, k, v, lens = (t.to("meta") for t in dense_args())
    with pytest.raises(ValueError, match=r"seqlens_k: dtype must be torch.int32"):
        torch.ops.hattn.attention_fwd(q, k, v, False, None, "auto", False, -1, -1, lens.long())


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_traces_without_breaks(dynamic):
    """Dynamo traces attention_paged, attention with seqlens_k and the kvcache drop-in into one
    graph each (real GPU runs are below)."""
    torch._dynamo.reset()

    def paged(q, k_cache, v_cache, table, lens):
        out, lse = hattn.attention_paged(
            q * 2, k_cache, v_cache, table, lens, causal=True, softmax_scale=0.125, return_lse=True, num_splits=3
        )
        return out.float().sum(-1), lse + 1

    def dense(q, k, v, lens):
        out, lse = hattn.attention(q, k, v, causal=True, return_lse=True, seqlens_k=lens, num_splits=2)
        return out + 1, lse

    def drop_in(q, k_cache, v_cache, table):
        paged = hattn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, block_table=table, causal=True)
        dense = hattn.flash_attn_with_kvcache(q, q, q, cache_seqlens=3, return_softmax_lse=True)
        return paged, dense

    args = paged_args(device="meta")
    out, lse = torch.compile(paged, backend="eager", fullgraph=True, dynamic=dynamic)(*args)
    assert out.shape == (B, SQ, HQ) and lse.shape == (B, HQ, SQ)
    dargs = tuple(t.to("meta") for t in dense_args())
    out, lse = torch.compile(dense, backend="eager", fullgraph=True, dynamic=dynamic)(*dargs)
    assert out.shape == (B, SQ, HQ, D) and lse.shape == (B, HQ, SQ)
    paged_out, (dense_out, dense_lse) = torch.compile(drop_in, backend="eager", fullgraph=True, dynamic=dynamic)(
        *args[:4]
    )
    assert paged_out.shape == dense_out.shape == (B, SQ, HQ, D) and dense_lse.shape == (B, HQ, SQ)
    for f, a in ((paged, args), (dense, dargs), (drop_in, args[:4])):
        explanation = torch._dynamo.explain(f)(*a)
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, f.__name__


# --- the problem handed to the binding, and routing ----------------------------------------------------


def paged_kwargs(args, kernel="auto", causal=False, window=(-1, -1), num_splits=0):
    q, k_cache, v_cache, table, lens = args
    return _problem_kwargs(
        q, k_cache, v_cache, torch.empty_like(q), None, causal, None, kernel, window, seqlens_k=lens, block_table=table,
        num_splits=num_splits,
    )  # fmt: skip


def resolve(args, **kwargs):
    """The kernel _C resolves a paged problem of these (CPU) tensors to; launches nothing."""
    return binding(_C.resolve_kernel, **paged_kwargs(args, **kwargs))


def test_problem_kwargs_of_a_paged_cache():
    args = paged_args()
    q, k_cache, v_cache, table, lens = args
    kwargs = paged_kwargs(args, num_splits=5)
    # seqlen_k is the most keys a sequence can have, from shapes alone: seqlens_k is not read.
    assert kwargs["batch"] == B and kwargs["seqlen_q"] == SQ and kwargs["seqlen_k"] == MAX_PAGES * PAGE
    assert kwargs["max_pages_per_seq"] == MAX_PAGES and kwargs["num_pages"] == NUM_PAGES
    assert kwargs["page_size"] == PAGE and kwargs["num_splits"] == 5
    assert kwargs["block_table"] == table.data_ptr() and kwargs["seqlens_k"] == lens.data_ptr()
    assert kwargs["k_strides"] == (PAGE * HKV * D, HKV * D, D) == kwargs["v_strides"]  # (page, row, head)
    assert kwargs["q_strides"] == (SQ * HQ * D, HQ * D, D)
    dense = _problem_kwargs(q, q, q, torch.empty_like(q), None, False, None, "auto")
    assert "block_table" not in dense and "seqlens_k" not in dense and dense["num_splits"] == 0


def test_paged_routes_to_the_final_kernel_only():
    args = paged_args()
    names = kernel_names()
    assert resolve(args) == names[-1]
    assert resolve(args, causal=True, window=(100, 0), num_splits=3) == names[-1]
    assert resolve(paged_args(page_size=256, head_dim=256)) == names[-1]
    assert resolve(args, kernel=names[-1]) == names[-1]
    for name in names[:-1]:
        with pytest.raises(NotImplementedError, match=rf"{name}: no seqlens_k or paged KV cache \(block_table\)"):
            resolve(args, kernel=name)


@pytest.mark.parametrize("page_size", [16, 64, 192])
def test_page_size_not_a_multiple_of_128_is_refused(page_size):
    args = paged_args(page_size=page_size)
    with pytest.raises(NotImplementedError, match=rf"page_size must be a multiple of 128 .*; got {page_size}"):
        resolve(args)
    with pytest.raises(NotImplementedError, match=rf"page_size must be a multiple of 128 .*; got {page_size}"):
        resolve(args, kernel=kernel_names()[-1])


def test_dense_seqlens_k_routes_to_the_final_kernel_only():
    q, k, v, lens = dense_args()
    names = kernel_names()
    assert hattn.resolve_kernel(q, k, v, seqlens_k=lens) == names[-1]
    assert hattn.resolve_kernel(q, k, v, causal=True, seqlens_k=lens, num_splits=4) == names[-1]
    # num_splits is a hint: every kernel takes a problem with it.
    assert hattn.resolve_kernel(q, k, v, kernel=names[0], num_splits=4) == names[0]
    for name in names[:-1]:
        with pytest.raises(NotImplementedError, match=rf"{name}: no seqlens_k or paged KV cache"):
            hattn.resolve_kernel(q, k, v, kernel=name, seqlens_k=lens)


def test_binding_paged_errors():
    args = paged_args()
    kwargs = paged_kwargs(args)
    with pytest.raises(ValueError, match=r"^invalid_argument: seqlens_k: must be set with block_table"):
        binding(_C.resolve_kernel, **{**kwargs, "seqlens_k": 0})
    with pytest.raises(ValueError, match=r"^invalid_argument: block_table: a paged cache cannot be combined with cu_s"):
        cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
        binding(_C.resolve_kernel, **{**kwargs, "cu_seqlens_q": cu.data_ptr(), "cu_seqlens_k": cu.data_ptr(),
                             "total_q": 12, "total_k": 12})  # fmt: skip
    with pytest.raises(ValueError, match=r"^invalid_argument: seqlen_k: 513 keys do not fit in max_pages_per_seq"):
        binding(_C.resolve_kernel, **{**kwargs, "seqlen_k": MAX_PAGES * PAGE + 1})
    with pytest.raises(ValueError, match=r"^invalid_argument: page_size, num_pages, max_pages_per_seq: only with"):
        binding(_C.resolve_kernel, **{**kwargs, "block_table": 0})
    with pytest.raises(ValueError, match=r"^invalid_argument: num_splits: must be 0 \(automatic\), 1 \(off\) or up"):
        binding(_C.resolve_kernel, **{**kwargs, "num_splits": 65})


# --- GPU: each sequence against the fp64 reference on its gathered keys ---------------------------------


def page_table(lens, page_size, num_pages, max_pages, gen):
    """int32 [B, max_pages] (CPU): each sequence's pages distinct, at random places among num_pages;
    the slots past a sequence's last page point at random pages."""
    pages = [math.ceil(n / page_size) for n in lens]
    assert max(pages) <= max_pages and sum(pages) <= num_pages
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(lens), max_pages), generator=gen)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n]
        used += n
    return table.to(torch.int32)


def make_paged(lens, seqlen_q, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, page_size=128,
               spare_pages=3, spare_slots=1, seed=0):  # fmt: skip
    """Random CUDA inputs of a paged cache: sequence b's keys fill ceil(lens[b] / page_size) pages
    at random places in the cache; the table's spare slots point at random pages (never read for
    keys). Returns (q, k_cache, v_cache, block_table, seqlens_k)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lens]
    max_pages = max(max(pages), 1) + spare_slots
    num_pages = sum(pages) + spare_pages
    table = page_table(lens, page_size, num_pages, max_pages, torch.Generator().manual_seed(seed))

    def rand(*shape):
        return torch.randn(*shape, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    k_cache, v_cache = rand(num_pages, page_size, heads_kv), rand(num_pages, page_size, heads_kv)
    q = rand(len(lens), seqlen_q, heads_q)
    seqlens_k = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table.cuda(), seqlens_k


def gather(cache, table, b, n):
    """Sequence b's first n logical rows of a paged cache: [n, H, D]."""
    page_size = cache.shape[1]
    pages = table[b, : math.ceil(n / page_size)].long()
    return cache[pages].flatten(0, 1)[:n]


def check_sequences(q, keys, values, out, lse, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """Each sequence's out [Sq, Hq, D] and lse [Hq, Sq] against attention_ref on its keys alone
    ([n, Hkv, D] each), within twice the error of plain same-dtype torch (test_gpu.py's bound)."""
    batch, seqlen_q, heads_q, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    for b, (kb, vb) in enumerate(zip(keys, values)):
        check_sequence(out[b], lse[b], q[b], kb, vb, causal, softmax_scale, window, f"sequence {b}", softcap)


def check_paged(q, k_cache, v_cache, table, lens, out, lse, **kwargs):
    keys = [gather(k_cache, table, b, n) for b, n in enumerate(lens)]
    values = [gather(v_cache, table, b, n) for b, n in enumerate(lens)]
    check_sequences(q, keys, values, out, lse, **kwargs)


def run_paged(lens, seqlen_q, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, page_size=128,
              causal=False, softmax_scale=None, window=(-1, -1), num_splits=0, seed=0):  # fmt: skip
    q, k_cache, v_cache, table, seqlens_k = make_paged(
        lens, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size, seed=seed
    )
    out, lse = hattn.attention_paged(
        q, k_cache, v_cache, table, seqlens_k, causal=causal, softmax_scale=softmax_scale, return_lse=True,
        window_size=window, num_splits=num_splits,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_paged(q, k_cache, v_cache, table, lens, out, lse, causal=causal, softmax_scale=softmax_scale, window=window)


# Empty, one key, page edges (127/128/129, 256/257) and lengths that are no multiple of 128.
LENS = [0, 1, 127, 128, 129, 257, 300, 777]
LONG_LENS = [0, 1, 1000, 3001, 4096]  # long sweeps, where split-KV has parts to make


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 64])
@pytest.mark.parametrize("page_size", [128, 256])
def test_paged_matches_reference(page_size, seqlen_q, causal):
    run_paged(LENS, seqlen_q, page_size=page_size, causal=causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_paged_dtype_and_head_dim(dtype, head_dim, causal):
    run_paged(LENS, 4, 4, 4, head_dim, dtype, causal=causal)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [8, 4, 1], ids=["gqa1", "gqa2", "gqa8"])
def test_paged_gqa(heads_kv, causal):
    run_paged(LENS, 64, 8, heads_kv, 64, page_size=256, causal=causal)


@requires_hopper
@pytest.mark.parametrize(
    "seqlen_q, causal, window",
    [(1, False, (64, 64)), (4, True, (100, -1)), (64, False, (0, 0)), (64, False, (-1, 40)), (64, True, (7, 0))],
)
def test_paged_sliding_window(seqlen_q, causal, window):
    run_paged(LENS, seqlen_q, 4, 2, 128, causal=causal, window=window)


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_paged_num_splits(num_splits, seqlen_q, causal):
    run_paged(LONG_LENS, seqlen_q, 8, 1, 128, page_size=256, causal=causal, num_splits=num_splits)


@requires_hopper
def test_paged_softmax_scale():
    run_paged(LENS, 4, 4, 4, 128, torch.float16, causal=True, softmax_scale=0.3)


@requires_hopper
def test_paged_every_slot_used():
    """Every sequence fills all max_pages_per_seq pages: seqlens_k at the planned maximum."""
    lens = [512] * 3
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 4, spare_slots=0, spare_pages=0)
    assert table.shape == (3, 4) and k_cache.shape[0] == 12
    out, lse = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True, return_lse=True)
    check_paged(q, k_cache, v_cache, table, lens, out, lse, causal=True)


@requires_hopper
def test_paged_unused_table_entries_are_not_read():
    """Entries past a sequence's last page may hold anything (the kernel clamps indices)."""
    q, k_cache, v_cache, table, seqlens_k = make_paged(LENS, 4, spare_slots=2)
    expected = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True)
    garbage = table.clone()
    for b, n in enumerate(LENS):
        garbage[b, math.ceil(n / 128) :] = -1 if b % 2 else 10**6
    out = hattn.attention_paged(q, k_cache, v_cache, garbage, seqlens_k, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@requires_hopper
def test_paged_return_lse_false_gives_the_same_output():
    q, k_cache, v_cache, table, seqlens_k = make_paged(LENS, 4)
    out = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True)
    out2, _ = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


@requires_hopper
def test_paged_strided_caches_tables_and_lengths():
    """k and v as slices of one [num_pages, page_size, 2, Hkv, D] cache are read in place;
    a column-major block table and strided lengths are copied first."""
    lens = [300, 0, 129, 64]
    q, k_cache, _, table, seqlens_k = make_paged(lens, 4, 8, 2, 128)
    kv = torch.randn(k_cache.shape[0], 128, 2, 2, 128, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN
    k_cache, v_cache = kv.unbind(2)
    assert _kernel_layout_ok(k_cache) and _kernel_layout_ok(v_cache)
    table_t = table.t().contiguous().t()
    lens_strided = torch.stack([seqlens_k, seqlens_k * 7], dim=1)[:, 0]
    assert not table_t.is_contiguous() and not lens_strided.is_contiguous()
    out, lse = hattn.attention_paged(q, k_cache, v_cache, table_t, lens_strided, causal=True, return_lse=True)
    check_paged(q, k_cache, v_cache, table, lens, out, lse, causal=True)


@requires_hopper
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_page_size_refused(page_size):
    q, k_cache, v_cache, table, seqlens_k = make_paged([100, 30], 1, page_size=page_size)
    with pytest.raises(NotImplementedError, match=rf"page_size must be a multiple of 128 .*; got {page_size}"):
        hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k)


@requires_hopper
def test_paged_gpu_argument_errors_and_lineage_kernels():
    q, k_cache, v_cache, table, seqlens_k = make_paged([100, 30], 4)
    with pytest.raises(ValueError, match=r"block_table: must be a CUDA tensor, got device cpu"):
        hattn.attention_paged(q, k_cache, v_cache, table.cpu(), seqlens_k)
    with pytest.raises(ValueError, match=r"seqlens_k: must be a CUDA tensor, got device cpu"):
        hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k.cpu())
    with pytest.raises(ValueError, match=r"k_cache: must be a CUDA tensor, got device cpu"):
        hattn.attention_paged(q, k_cache.cpu(), v_cache, table, seqlens_k)
    with pytest.raises(NotImplementedError, match=r"no seqlens_k or paged KV cache"):
        hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, kernel=hattn.kernels()[0].name)


# --- GPU: attention with seqlens_k on a dense cache ----------------------------------------------------


def run_dense(lens, seqlen_q, capacity, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, causal=False,
              window=(-1, -1), num_splits=0, seed=0):  # fmt: skip
    """attention() on a dense cache [B, capacity, Hkv, D] with seqlens_k = lens (clamped to capacity)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(len(lens), *shape, head_dim, device="cuda", dtype=dtype, generator=gen) + INPUT_MEAN

    q, k, v = rand(seqlen_q, heads_q), rand(capacity, heads_kv), rand(capacity, heads_kv)
    seqlens_k = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = hattn.attention(
        q, k, v, causal=causal, return_lse=True, window_size=window, seqlens_k=seqlens_k, num_splits=num_splits
    )
    torch.cuda.synchronize()
    used = [min(n, capacity) for n in lens]
    check_sequences(q, [k[b, :n] for b, n in enumerate(used)], [v[b, :n] for b, n in enumerate(used)], out, lse,
                    causal=causal, window=window)  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 64])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_dense_seqlens_k(num_splits, seqlen_q, causal):
    # 1500 > the cache's 1000 keys: clamped to 1000.
    run_dense([0, 1, 129, 500, 1000, 1500], seqlen_q, 1000, causal=causal, num_splits=num_splits)


@requires_hopper
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dense_seqlens_k_dtype_and_head_dim(dtype, head_dim):
    run_dense(LENS, 4, 800, 4, 4, head_dim, dtype, causal=True)


@requires_hopper
def test_dense_seqlens_k_window():
    run_dense(LENS, 64, 800, 4, 2, 128, causal=True, window=(100, 0))


@requires_hopper
def test_dense_seqlens_k_of_every_key_is_plain_attention():
    q, k, v = (torch.randn(3, n, 8, 128, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN for n in (64, 700, 700))
    lens = torch.full((3,), 700, dtype=torch.int32, device="cuda")
    out, lse = hattn.attention(q, k, v, causal=True, return_lse=True, seqlens_k=lens)
    plain, plain_lse = hattn.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, plain, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=1e-4)


@requires_hopper
def test_dense_and_paged_caches_agree():
    """The same logical keys in a dense cache with seqlens_k and in pages give the same result."""
    q, k_cache, v_cache, table, seqlens_k = make_paged(LENS, 4)
    capacity = table.shape[1] * 128
    dense_k = torch.zeros(len(LENS), capacity, 2, 128, device="cuda", dtype=torch.bfloat16)
    dense_v = torch.zeros_like(dense_k)
    for b, n in enumerate(LENS):
        dense_k[b, :n], dense_v[b, :n] = gather(k_cache, table, b, n), gather(v_cache, table, b, n)
    paged = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True)
    dense = hattn.attention(q, dense_k, dense_v, causal=True, seqlens_k=seqlens_k)
    torch.testing.assert_close(paged, dense, rtol=0, atol=2e-2)


@requires_hopper
def test_dense_seqlens_k_lineage_kernels_refuse():
    q = torch.randn(2, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([10, 256], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match=r"no seqlens_k or paged KV cache"):
        hattn.attention(q, k, k, seqlens_k=lens, kernel=hattn.kernels()[0].name)
    with pytest.raises(ValueError, match=r"seqlens_k: must be a CUDA tensor, got device cpu"):
        hattn.attention(q, k, k, seqlens_k=lens.cpu())


# --- GPU: cache entries (kv_batch_idx) and left padding (leftpad_k) ---------------------------------------


def cache_entries(num_entries, capacity, lens, pads, index, heads_kv=2, head_dim=128, seed=0):
    """A dense cache [num_entries, capacity, Hkv, D] whose rows outside each used entry's keys
    pads[b] .. lens[b] - 1 (and every row of the unused entries) are NaN: no kernel may read them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v = (
        torch.randn(num_entries, capacity, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        + INPUT_MEAN
        for _ in range(2)
    )
    live = torch.zeros(num_entries, capacity, dtype=torch.bool, device="cuda")
    for b, (n, pad) in enumerate(zip(lens, pads)):
        live[index[b], min(pad, n) : n] = True
    for t in (k, v):
        t[~live] = float("nan")
    return k, v


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q", [1, 4, 64])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_dense_cache_entries_and_left_padding(num_splits, seqlen_q, causal):
    """Sequence b attends to keys pads[b] .. lens[b] - 1 of entry index[b] of a cache of 7
    entries (two sequences share one; a pad at or past the length leaves no key)."""
    lens, pads, index = [0, 1, 129, 500, 1000, 700], [0, 0, 100, 499, 1, 700], [6, 2, 0, 3, 2, 5]
    k, v = cache_entries(7, 1000, lens, pads, index)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(len(lens), seqlen_q, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) + INPUT_MEAN
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device="cuda")
    out, lse = hattn.attention(
        q, k, v, causal=causal, return_lse=True, seqlens_k=i32(lens), num_splits=num_splits, kv_batch_idx=i32(index),
        leftpad_k=i32(pads),
    )  # fmt: skip
    torch.cuda.synchronize()
    keys = [k[e, p:n] for e, p, n in zip(index, pads, lens)]
    values = [v[e, p:n] for e, p, n in zip(index, pads, lens)]
    check_sequences(q, keys, values, out, lse, causal=causal)


@requires_hopper
@pytest.mark.parametrize("head_dim", [64, 256])
def test_left_padding_without_seqlens_k(head_dim):
    """leftpad_k alone: keys pads[b] .. Sk - 1, the window aligned to them."""
    pads = [0, 1, 300, 299]
    k, v = cache_entries(4, 300, [300] * 4, pads, list(range(4)), heads_kv=4, head_dim=head_dim)
    q = torch.randn(4, 64, 4, head_dim, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN
    pad = torch.tensor(pads, dtype=torch.int32, device="cuda")
    out, lse = hattn.attention(q, k, v, causal=True, return_lse=True, window_size=(40, 0), leftpad_k=pad)
    torch.cuda.synchronize()
    check_sequences(q, [k[b, p:] for b, p in enumerate(pads)], [v[b, p:] for b, p in enumerate(pads)], out, lse,
                    causal=True, window=(40, 0))  # fmt: skip


@requires_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_cache_entries(causal):
    """attention_paged with kv_batch_idx: sequence b's pages are row index[b] of a table with
    two rows more than sequences, the rows shuffled."""
    q, k_cache, v_cache, table, seqlens_k = make_paged(LENS, 4, seed=3)
    index = torch.randperm(len(LENS) + 2, generator=torch.Generator().manual_seed(3))[: len(LENS)]
    wide = torch.zeros(len(LENS) + 2, table.shape[1], dtype=torch.int32, device="cuda")
    wide[index.cuda()] = table
    index = index.to(torch.int32).cuda()
    out, lse = hattn.attention_paged(
        q, k_cache, v_cache, wide, seqlens_k, causal=causal, return_lse=True, kv_batch_idx=index
    )  # fmt: skip
    torch.cuda.synchronize()
    check_paged(q, k_cache, v_cache, table, LENS, out, lse, causal=causal)


@requires_hopper
def test_cache_entries_and_left_padding_lineage_kernels_refuse():
    q = torch.randn(2, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    index = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match=r"no kv_batch_idx or leftpad_k"):
        hattn.attention(q, k, k, kv_batch_idx=index, kernel=hattn.kernels()[-2].name)
    with pytest.raises(NotImplementedError, match=r"no kv_batch_idx or leftpad_k"):
        hattn.attention(q, k[:2], k[:2], leftpad_k=index, kernel=hattn.kernels()[0].name)
    with pytest.raises(ValueError, match=r"kv_batch_idx: must be a CUDA tensor, got device cpu"):
        hattn.attention(q, k, k, kv_batch_idx=index.cpu())


# --- GPU: the op in torch.compile, CUDA graphs, opcheck ---------------------------------------------------


@requires_hopper
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_paged_compile_fullgraph(dynamic):
    torch._dynamo.reset()

    def decode(x, wq, k_cache, v_cache, table, lens):
        q = (x @ wq).view(x.shape[0], 1, 8, 128)
        out, lse = hattn.attention_paged(q, k_cache, v_cache, table, lens, causal=True, return_lse=True)
        return out.flatten(1) + x, lse.exp().sum()

    compiled = torch.compile(decode, fullgraph=True, dynamic=dynamic)
    wq = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    for seed, lens in ((0, [256, 100, 31]), (1, [384, 7, 0, 200])):
        _, k_cache, v_cache, table, seqlens_k = make_paged(lens, 1, seed=seed)
        x = torch.randn(len(lens), 1024, device="cuda", dtype=torch.bfloat16)
        out, total = compiled(x, wq, k_cache, v_cache, table, seqlens_k)
        expected, expected_total = decode(x, wq, k_cache, v_cache, table, seqlens_k)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # inductor may fuse the projection differently
        torch.testing.assert_close(total, expected_total, rtol=1e-3, atol=0)


@requires_hopper
def test_paged_cuda_graph_replay_with_new_lengths_and_pages():
    """seqlens_k and block_table are read on the GPU only: one graph serves new values of them."""
    lens = [300, 0, 129, 71]
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 4, spare_pages=8, spare_slots=2, seed=1)
    hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True, return_lse=True)
    new_lens = [5, 512, 0, 640]  # up to max_pages_per_seq (5) pages each: the shapes stay the same
    table.copy_(page_table(new_lens, 128, k_cache.shape[0], table.shape[1], torch.Generator().manual_seed(2)))
    seqlens_k.copy_(torch.tensor(new_lens, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    expected, expected_lse = hattn.attention_paged(q, k_cache, v_cache, table, seqlens_k, causal=True, return_lse=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    check_paged(q, k_cache, v_cache, table, new_lens, out, lse, causal=True)


@requires_hopper
def test_opcheck():
    q, k_cache, v_cache, table, seqlens_k = make_paged(LENS, 4, 4, 2, 64)
    for causal, scale, return_lse, splits in ((False, None, True, 0), (True, 0.2, False, 3)):
        args = (q, k_cache, v_cache, table, seqlens_k, causal, scale, "auto", return_lse, -1, -1, splits)
        torch.library.opcheck(torch.ops.hattn.attention_paged_fwd.default, args)
    k = torch.randn(q.shape[0], 800, 2, 64, device="cuda", dtype=torch.bfloat16)
    args = (q, k, k, True, None, "auto", True, -1, -1, seqlens_k, 2)
    torch.library.opcheck(torch.ops.hattn.attention_fwd.default, args)


@requires_hopper
def test_split_decoding_replays_in_a_cuda_graph():
    """A decoding shape that splits runs two kernels, the combine launched as a programmatic
    dependent of the attention kernel: captured in a CUDA graph and replayed on new inputs, it
    matches the eager call bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(5)

    def fresh(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) + INPUT_MEAN

    q, k, v = fresh(2, 1, 8, 128), fresh(2, 5000, 2, 128), fresh(2, 5000, 2, 128)
    kwargs = _problem_kwargs(q, k, v, torch.empty_like(q), None, False, None, "auto")
    assert binding(_C.workspace_size, **kwargs) > 0, "16 items on an H200's 132 SMs split their keys"
    hattn.attention(q, k, v)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hattn.attention(q, k, v)
    for _ in range(3):
        q.copy_(fresh(*q.shape))
        k.copy_(fresh(*k.shape))
        v.copy_(fresh(*v.shape))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, hattn.attention(q, k, v), rtol=0, atol=0)


@requires_hopper
def test_split_workspace_comes_from_torch():
    """A decoding shape that splits asks for a workspace, and the op takes it from torch's caching
    allocator (so graph captures and torch's memory stats see it), not from the CUDA pool."""
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN
    k, v = (torch.randn(2, 5000, 2, 128, device="cuda", dtype=torch.bfloat16) + INPUT_MEAN for _ in range(2))
    out = torch.empty_like(q)
    kwargs = _problem_kwargs(q, k, v, out, None, False, None, "auto")
    needed = binding(_C.workspace_size, **kwargs)
    assert needed > 0, "16 items on an H200's 132 SMs split their keys"
    assert binding(_C.workspace_size, **{**kwargs, "num_splits": 1}) == 0
    with pytest.raises(ValueError, match=r"^invalid_argument: workspace_bytes: \d+ bytes given; .* needs \d+"):
        small = torch.empty(needed, dtype=torch.uint8, device="cuda")
        binding(_C.forward, **kwargs, workspace=small.data_ptr(), workspace_bytes=needed - 16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = hattn.attention(q, k, v)
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after - before >= 2, "out and the workspace both come from torch"
    plain = hattn.attention(q, k, v, num_splits=1)
    torch.testing.assert_close(got, plain, rtol=0, atol=2e-2)


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense_seqlens_k", "paged"])
def test_a_repeated_layout_reads_the_new_tensors(paged):
    """The second call with one layout launches from remembered arguments (hattn.ops.runner._LAUNCHES)
    with the new tensors' pointers: its out equals a first call's on those tensors, bit for bit.
    A view of another alignment is another layout."""
    from hattn.ops.runner import _LAUNCHES

    def call(q, k, v, table, lens):
        # Entries in reverse order (a table or cache of the same rows, flipped), and for the dense
        # cache a left padding: their pointers are filled in too.
        index = torch.arange(len(LENS) - 1, -1, -1, dtype=torch.int32, device="cuda")
        if paged:
            return hattn.attention_paged(
                q, k, v, table.flip(0), lens, causal=True, return_lse=True, num_splits=2, kv_batch_idx=index
            )  # fmt: skip
        pad = torch.minimum(lens, torch.full_like(lens, 5))
        return hattn.attention(
            q, k.flip(0), v.flip(0), causal=True, return_lse=True, seqlens_k=lens, num_splits=2, kv_batch_idx=index,
            leftpad_k=pad,
        )  # fmt: skip

    def inputs(seed):
        q, k, v, table, lens = make_paged(LENS, 4, seed=seed)
        if not paged:  # the same keys in a dense cache
            k, v = (c[table.long()].flatten(1, 2) for c in (k, v))
            table = None
        return q, k, v, table, lens

    first, second = inputs(1), inputs(2)
    _LAUNCHES.clear()
    call(*first)
    assert len(_LAUNCHES) == 1
    again = call(*second)  # remembered arguments, new pointers
    assert len(_LAUNCHES) == 1
    _LAUNCHES.clear()
    fresh = call(*second)  # every check and a new entry
    for got, want in zip(again, fresh):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # q one element into a larger buffer: 2-byte aligned, so copied, and not remembered.
    q = second[0]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    before = len(_LAUNCHES)
    for got, want in zip(call(shifted, *second[1:]), fresh):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(_LAUNCHES) == before
