# Does the library-allocated (cudaMallocAsync) split path split inside a torch process?
import torch, hattn
from hattn import _C
from hattn.ops import _problem_kwargs
q = torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
out = torch.empty_like(q)
kw = _problem_kwargs(q, k, v, out, None, False, None, "auto")
print("workspace_size", _C.workspace_size(**kw))
stream = torch.cuda.current_stream().cuda_stream
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
def t(fn, n=50):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        flush.zero_(); a.record(); fn(); b.record()
    torch.cuda.synchronize()
    xs = sorted(a.elapsed_time(b) for a, b in ev); return xs[n // 2] * 1e3
ws = torch.empty(_C.workspace_size(**kw), dtype=torch.uint8, device="cuda")
for name, fn in [
    ("C forward, library cudaMallocAsync", lambda: _C.forward(**kw, stream=stream)),
    ("C forward, num_splits=1", lambda: _C.forward(**{**kw, "num_splits": 1}, stream=stream)),
    ("C forward, caller workspace", lambda: _C.forward(**kw, workspace=ws.data_ptr(), workspace_bytes=ws.numel(), stream=stream)),
    ("hattn.attention", lambda: hattn.attention(q, k, v)),
    ("hattn.attention num_splits=1", lambda: hattn.attention(q, k, v, num_splits=1)),
]:
    print(f"{name:40s} {t(fn):8.1f} us")
err = torch.cuda.memory_stats()
print("ok")
