# Host (CPU) time per call of each layer of hattn.attention, no GPU sync inside the loop.
import time, cProfile, pstats, io
import torch, hattn
import torch.nn.functional as F
from hattn import _C, ops
from hattn.ops import _problem_kwargs
q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out = torch.empty_like(q)
kw = _problem_kwargs(q, k, v, out, None, False, None, "auto")
stream = torch.cuda.current_stream().cuda_stream
n_ws = _C.workspace_size(**kw)
ws = torch.empty(n_ws, dtype=torch.uint8, device="cuda")
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
def per_call(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6
cases = [
    ("hattn.attention", lambda: hattn.attention(q, k, v)),
    ("torch.ops.hattn.attention_fwd", lambda: torch.ops.hattn.attention_fwd(q, k, v, False, None, "auto", False, -1, -1, None, 0)),
    ("ops.attention_fwd (python fn)", lambda: ops.attention_fwd._opoverload(q, k, v, False, None, "auto", False, -1, -1, None, 0)),
    ("_forward", lambda: ops._forward(q, k, v, out, None, False, None, "auto")),
    ("_problem_kwargs", lambda: _problem_kwargs(q, k, v, out, None, False, None, "auto")),
    ("_C.workspace_size", lambda: _C.workspace_size(**kw)),
    ("_C.forward (caller ws)", lambda: _C.forward(**kw, workspace=ws.data_ptr(), workspace_bytes=n_ws, stream=stream)),
    ("_C.forward num_splits=1", lambda: _C.forward(**{**kw, "num_splits": 1}, stream=stream)),
    ("_C.resolve_kernel", lambda: _C.resolve_kernel(**kw)),
    ("torch.cuda.device ctx", lambda: torch.cuda.device(q.device).__enter__()),
    ("current_stream", lambda: torch.cuda.current_stream(q.device).cuda_stream),
    ("torch.empty", lambda: torch.empty((1, 1, 16, 128), dtype=q.dtype, device=q.device)),
    ("sdpa cudnn", lambda: F.scaled_dot_product_attention(qt, kt, vt)),
]
for name, fn in cases:
    try:
        print(f"{name:34s} {per_call(fn):8.2f} us/call", flush=True)
    except Exception as e:
        print(f"{name:34s} failed: {e}", flush=True)
pr = cProfile.Profile()
pr.enable()
for _ in range(2000): hattn.attention(q, k, v)
pr.disable()
torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
