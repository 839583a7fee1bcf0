# cuDNN's forward kernels (torch SDPA, cuDNN backend, BHSD inputs) on the short shapes where
# 16 is behind: run under ncu to read each launch's grid, block, registers and shared memory.
import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

shapes = [  # (batch, seqlen, heads, head_dim, causal): the grid's batch * S = 16384, H * D = 2048
    (32, 512, 32, 64, True), (16, 1024, 32, 64, True), (8, 2048, 32, 64, True),
    (32, 512, 32, 64, False), (16, 1024, 16, 128, False), (8, 2048, 16, 128, False),
    (32, 512, 16, 128, True),
]
for b, s, h, d, causal in shapes:
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(f"b{b}_s{s}_h{h}_d{d}_{'causal' if causal else 'full'}")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print("shape", b, s, h, d, causal, file=sys.stderr)
