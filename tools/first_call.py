#!/usr/bin/env python3
"""A new user's first call, timed: `import torch, hattn`, then the README's quick start
(hattn.attention on q [2, 4096, 16, 128], GQA 4 K/V heads, causal) twice, checked against torch
SDPA. Prints one line. Issue 56's path: clone, pip install, this. Needs a CUDA GPU.

Usage: python tools/first_call.py     (run it outside the source tree, so that the installed
package is the one imported)
"""
import time

t = time.perf_counter()
import torch  # noqa: E402

import hattn  # noqa: E402

t_import = time.perf_counter() - t
if not torch.cuda.is_available():
    raise SystemExit("first_call: no CUDA GPU here; the first call needs an H100/H200")
q = torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
torch.cuda.synchronize()
times = []
for _ in range(2):
    t = time.perf_counter()
    out = hattn.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
err = (out.float() - ref.float()).abs().max().item()
print(f"import torch, hattn: {t_import:.2f} s; first hattn.attention call: {times[0] * 1e3:.1f} ms; "
      f"second: {times[1] * 1e3:.2f} ms; max |out - SDPA| {err:.4f}; {torch.cuda.get_device_name()}, "
      f"torch {torch.__version__}")
