"""GPU tests: every kernel against an fp64 reference, and the op under torch.compile, CUDA graphs
and opcheck. They skip with the reason without a Hopper (sm_90) GPU.

Every check is parametrized over hattn.kernels() and "auto", so each lineage step is tested. A
kernel that refuses a problem (NotImplementedError: a documented limit of that step) is skipped
for it with the kernel's message; "auto" must handle everything here.
"""

import math

import hattn
import pytest
import torch
from helpers import attention_ref, error_bound, lse_bound, make_qkv, masked_rows, requires_hopper

pytestmark = requires_hopper

KERNELS = [k.name for k in hattn.kernels()] + ["auto"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run(q, k, v, kernel, causal=False, softmax_scale=None, window=(-1, -1)):
    """(out, lse) of hattn.attention, skipping a kernel that documents it can't run the problem."""
    try:
        out, lse = hattn.attention(
            q, k, v, causal=causal, softmax_scale=softmax_scale, kernel=kernel, return_lse=True, window_size=window
        )
    except NotImplementedError as e:
        if kernel == "auto":
            raise
        pytest.skip(f"{kernel} does not support this problem: {e}")
    torch.cuda.synchronize()
    return out, lse


def check(q, k, v, out, lse, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """out and lse against the fp64 reference, within twice the error of plain same-dtype torch."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    batch, seqlen_q, heads_q, _ = q.shape
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"

    ref_out, ref_lse = attention_ref(q, k, v, causal, softmax_scale, upcast=True, window=window, softcap=softcap)
    naive_out, naive_lse = attention_ref(q, k, v, causal, softmax_scale, upcast=False, window=window, softcap=softcap)
    err = (out.double() - ref_out).abs().max().item()
    bound = error_bound(ref_out, naive_out, q.dtype)
    assert err <= bound, f"out: max error {err:.3e} > bound {bound:.3e} (naive {q.dtype} error x2 + atol)"

    dead = masked_rows(seqlen_q, k.shape[1], causal, window).to(q.device)
    if dead.any():
        assert (out[:, dead] == 0).all(), "fully masked rows must give output 0"
        assert torch.isneginf(lse[:, :, dead]).all(), "fully masked rows must give lse -inf"
    live = ~dead
    if live.any():
        assert torch.isfinite(lse[:, :, live]).all(), "lse must be finite on rows that see a key"
        lerr = (lse[:, :, live].double() - ref_lse[:, :, live]).abs().max().item()
        lbound = lse_bound(ref_lse[:, :, live], naive_lse[:, :, live])
        assert lerr <= lbound, f"lse: max error {lerr:.3e} > bound {lbound:.3e}"


# --- correctness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_dtype_and_head_dim(kernel, dtype, head_dim, causal):
    q, k, v = make_qkv(2, 197, 197, 4, 4, head_dim, DTYPES[dtype])  # 197: no tile multiple
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_kv", [8, 4, 1], ids=["gqa1", "gqa2", "gqa8"])
def test_gqa(kernel, heads_kv, causal):
    q, k, v = make_qkv(2, 300, 300, 8, heads_kv, 128, torch.bfloat16)
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k",
    [(1, 1), (1, 300), (300, 1), (17, 129), (129, 17), (255, 513), (513, 255), (64, 65), (1000, 1000), (2049, 2049)],
)
def test_sequence_lengths(kernel, seqlen_q, seqlen_k, causal):
    """Lengths that are not tile multiples; causal with Sq > Sk has fully masked rows (out 0, lse -inf)."""
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 2, 64, torch.bfloat16)
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, head_dim, causal, window",
    [
        (300, 300, 128, False, (64, 64)),
        (257, 400, 64, True, (100, -1)),
        (200, 130, 256, False, (0, 0)),  # Sq > Sk: rows before the keys see nothing
        (150, 1000, 128, False, (-1, 40)),
        (1000, 1000, 64, True, (7, 0)),  # narrower than a tile
        (300, 9000, 128, False, (4000, 4000)),  # long enough for the wide tiles
        (90, 500, 256, False, (20, 0)),
    ],
)
def test_sliding_window(seqlen_q, seqlen_k, head_dim, causal, window):
    """window_size on the production forward ("auto"); the lineage kernels refuse it (test_cpu.py)."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16)
    check(q, k, v, *run(q, k, v, "auto", causal, window=window), causal=causal, window=window)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, head_dim, causal, window, softcap",
    [
        (300, 300, 128, False, (-1, -1), 1.5),  # a cap inside the scores' range
        (257, 700, 64, True, (-1, -1), 30.0),  # a cap far outside it: nearly no change
        (200, 500, 256, True, (90, 0), 3.0),
        (2000, 2000, 128, False, (-1, -1), 2.0),  # long enough for the wide tiles
        (1, 4000, 128, False, (-1, -1), 5.0),  # decoding: split-KV and GQA packing
    ],
)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_softcap(dtype, seqlen_q, seqlen_k, head_dim, causal, window, softcap):
    """softcap on the production forward ("auto"), against the capped fp64 reference; the lineage
    kernels refuse it (the backward: test_backward.py)."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, DTYPES[dtype])
    out, lse = hattn.attention(q, k, v, causal=causal, return_lse=True, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    check(q, k, v, out, lse, causal=causal, window=window, softcap=softcap)
    with pytest.raises(NotImplementedError, match=r"no softcap"):
        hattn.attention(q, k, v, softcap=softcap, kernel=hattn.kernels()[-2].name)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_fully_masked_rows_d128(kernel, dtype):
    q, k, v = make_qkv(2, 200, 70, 4, 4, 128, DTYPES[dtype])
    check(q, k, v, *run(q, k, v, kernel, causal=True), causal=True)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale(kernel, causal):
    q, k, v = make_qkv(2, 150, 230, 4, 4, 128, torch.float16)
    check(q, k, v, *run(q, k, v, kernel, causal, softmax_scale=0.3), causal=causal, softmax_scale=0.3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_views(kernel, causal):
    """Packed qkv slices and BHSD storage are read in place; odd layouts are copied first."""
    B, S, H, D = 2, 333, 4, 128
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16) + 0.5  # packed projection
    q, k, v = qkv.unbind(2)
    assert all(hattn.ops.checks._kernel_layout_ok(t) for t in (q, k, v))
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)

    bhsd = torch.randn(3, B, H, S, D, device="cuda", dtype=torch.bfloat16) + 0.5
    q, k, v = (t.transpose(1, 2) for t in bhsd)  # [B, S, H, D] views of BHSD storage
    assert all(hattn.ops.checks._kernel_layout_ok(t) for t in (q, k, v))
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)

    wide = torch.randn(B, S, H, D + 4, device="cuda", dtype=torch.bfloat16) + 0.5
    q = wide[..., :D]  # strides not multiples of 8: copied
    k = (torch.randn(B, S, H, 2 * D, device="cuda", dtype=torch.bfloat16) + 0.5)[..., ::2]  # D strided: copied
    v = (torch.randn(B, S, 1, D, device="cuda", dtype=torch.bfloat16) + 0.5).expand(B, S, H, D)  # stride 0: copied
    assert not any(hattn.ops.checks._kernel_layout_ok(t) for t in (q, k, v))
    check(q, k, v, *run(q, k, v, kernel, causal), causal=causal)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_element_written(kernel, causal):
    """Outputs poisoned with NaN before the launch; a strided out (a slice of a wider buffer)."""
    B, Sq, Sk, H, D = 2, 190, 130, 4, 64  # Sq > Sk: causal has fully masked rows
    q, k, v = make_qkv(B, Sq, Sk, H, H, D, torch.bfloat16)
    wide = torch.full((B, Sq, H + 1, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = wide[:, :, :H]
    lse = torch.full((B, H, Sq), float("nan"), device="cuda")
    try:
        hattn.launch(q, k, v, out, lse, causal=causal, kernel=kernel)
    except NotImplementedError as e:
        if kernel == "auto":
            raise
        pytest.skip(f"{kernel} does not support this problem: {e}")
    torch.cuda.synchronize()
    assert torch.isnan(wide[:, :, H]).all(), "wrote outside out"
    check(q, k, v, out.contiguous(), lse, causal=causal)


def test_return_lse_false_gives_the_same_output():
    q, k, v = make_qkv(2, 257, 257, 8, 2, 128, torch.bfloat16)
    out = hattn.attention(q, k, v, causal=True)
    out2, _ = hattn.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_runs_on_the_current_stream():
    """q2 is written on a side stream after a sleep: a launch on any other stream would read it early."""
    q, k, v = make_qkv(2, 1024, 1024, 8, 8, 128, torch.bfloat16)
    expected = hattn.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        q2 = q * 1
        out = hattn.attention(q2, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_gpu_argument_errors():
    q, k, v = make_qkv(1, 64, 64, 4, 4, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"k: must be a CUDA tensor, got device cpu"):
        hattn.attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match=r"^invalid_argument: head_dim: must be 64, 128 or 256 \(got 96\)"):
        q96, k96, v96 = make_qkv(1, 64, 64, 4, 4, 96, torch.bfloat16)
        hattn.attention(q96, k96, v96)
    with pytest.raises(ValueError, match=r"q: dtype must be torch.bfloat16 or torch.float16"):
        hattn.attention(q.float(), k, v)


# --- the op in torch.compile, CUDA graphs, opcheck -------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_graph_capture_and_replay(kernel):
    q, k, v = make_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=1)
    try:
        hattn.attention(q, k, v, causal=True, kernel=kernel)  # warm-up (and support check) outside capture
    except NotImplementedError as e:
        if kernel == "auto":
            raise
        pytest.skip(f"{kernel} does not support this problem: {e}")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = hattn.attention(q, k, v, causal=True, kernel=kernel, return_lse=True)
    for seed in (2, 3):  # new inputs copied into the captured buffers, then replay
        q2, k2, v2 = make_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, seed=seed)
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_lse = hattn.attention(q2, k2, v2, causal=True, kernel=kernel, return_lse=True)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph(dynamic):
    torch._dynamo.reset()

    def block(x, wq, wkv):
        B, S, _ = x.shape
        q = (x @ wq).view(B, S, 8, 128)
        k, v = (x @ wkv).view(B, S, 2, 2, 128).unbind(2)  # GQA, strided views of one projection
        out, lse = hattn.attention(q, k, v, causal=True, return_lse=True)
        return out.flatten(2) + x, lse.exp().sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    wq = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    wkv = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) / 32
    for S in (256, 384):
        x = torch.randn(2, S, 1024, device="cuda", dtype=torch.bfloat16)
        out, total = compiled(x, wq, wkv)
        expected, expected_total = block(x, wq, wkv)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # inductor may fuse the projections differently
        torch.testing.assert_close(total, expected_total, rtol=1e-3, atol=0)


def test_compile_reduce_overhead_cuda_graphs():
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: hattn.attention(q, k, v, causal=True) * 2, fullgraph=True, mode="reduce-overhead")
    q, k, v = make_qkv(1, 512, 512, 8, 8, 64, torch.float16)
    for _ in range(3):  # recording, then replays
        out = f(q, k, v)
    torch.testing.assert_close(out, hattn.attention(q, k, v, causal=True) * 2, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_opcheck(kernel):
    q, k, v = make_qkv(2, 130, 200, 4, 2, 64, torch.bfloat16)
    try:
        hattn.attention(q, k, v, kernel=kernel)
    except NotImplementedError as e:
        if kernel == "auto":
            raise
        pytest.skip(f"{kernel} does not support this problem: {e}")
    # The full set for "auto"; the cheap ones for each lineage kernel.
    utils = None if kernel == "auto" else ("test_schema", "test_faketensor")
    for causal, scale, return_lse in ((False, None, True), (True, 0.2, False)):
        args = (q, k, v, causal, scale, kernel, return_lse)
        kwargs = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(torch.ops.hattn.attention_fwd.default, args, **kwargs)


def test_large_head_count_and_batch():
    q, k, v = make_qkv(3, 129, 257, 40, 8, 128, torch.bfloat16)
    check(q, k, v, *run(q, k, v, "auto", causal=True), causal=True)
    assert math.isfinite(hattn.attention(q, k, v).float().sum().item())


def test_bench_times_kernels_beside_the_anchors(tmp_path):
    """python -m hattn.bench end to end on one small shape: every implementation checked and timed."""
    import csv

    from hattn import bench

    argv = ["--no-capstone", "--dims", "64", "--seqlens", "512", "--causal", "no", "--reps", "3",
            "--kernels", "12_epilogue_hot_loop,13_wide_tiles", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = list(csv.DictReader(open(tmp_path / "pybench.csv")))
    by_name = {r["name"]: r for r in rows}
    for name in ("sdpa_cudnn", "sdpa_flash", "12_epilogue_hot_loop", "13_wide_tiles"):
        assert by_name[name]["status"] == "ok", by_name[name]
        assert float(by_name[name]["ms"]) > 0 and int(by_name[name]["reps"]) >= 3


@requires_hopper
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_tensors_give_empty_results(batch, seqlen_q, seqlen_k):
    """No batch or no queries: empty outputs; no keys: out 0 and LSE -inf (as FlashAttention-3);
    the gradients of all three are 0. No kernel runs, and nothing raises."""
    make = lambda s, h: torch.randn(batch, s, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(seqlen_q, 4), make(seqlen_k, 2), make(seqlen_k, 2)
    out, lse = hattn.attention(q, k, v, return_lse=True)
    assert out.shape == (batch, seqlen_q, 4, 64) and lse.shape == (batch, 4, seqlen_q)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.all(t.grad == 0)


def test_profiler_sees_the_ops():
    """An eager call skips the dispatcher (_direct_call_ok) except while torch.profiler runs: then it
    goes through the op, and the profile names it (forward, and the backward through autograd)."""
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    hattn.attention(q, k, v)  # outside the profiler: the direct call (and its launch cache)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hattn.attention(q, k, v, causal=True)
        q.requires_grad_(True)
        hattn.attention(q, k, v).float().sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert {"hattn::attention_fwd", "hattn::attention_bwd"} <= names, sorted(n for n in names if "hattn" in n)
