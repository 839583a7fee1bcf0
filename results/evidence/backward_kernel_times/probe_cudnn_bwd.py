import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
d = int(sys.argv[1]); s = int(sys.argv[2]); causal = sys.argv[3] == "1"
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    out = sdpa(q, k, v, is_causal=causal)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
