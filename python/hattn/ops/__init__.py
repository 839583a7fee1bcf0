"""The PyTorch ops: hattn::attention_fwd, hattn::attention_varlen_fwd,
hattn::attention_paged_fwd and hattn::attention_fp8_fwd over the raw-pointer binding
hattn._C.forward, and the backward ops hattn::attention_bwd and hattn::attention_varlen_bwd
(hattn._C.backward) behind the first two. One module a feature, over one runner:

  dense.py     hattn.attention (dense batches, KV-cache lengths and entries, left padding)
  varlen.py    hattn.attention_varlen (variable-length batches)
  kvcache.py   hattn.attention_paged (paged caches) and append_kv
  mla.py       hattn.mla_with_kvcache (MLA decoding over a paged latent cache), mla_schedule
  fp8.py       hattn.attention_fp8 (e4m3 inputs)
  backward.py  the backward ops behind the dense and variable-length autograd
  runner.py    a call's arguments for hattn._C, the launch, scratch, the launch cache
  checks.py    the argument checks (shared by the real and fake implementations), the
               kernels' input layout, the checking mode

Layout rules (BSHD, [batch, seqlen, heads, head_dim]):
  * A q/k/v tensor is passed to the kernel as it is, without a copy, when its last dim is
    contiguous (stride 1), its data pointer is 16-byte aligned and every other stride is a
    positive multiple of 16 bytes (8 elements of bf16/fp16, 16 of FP8; dims of extent 1 are
    exempt). That covers contiguous tensors, transposed BHSD storage seen as BSHD, and slices
    of a packed qkv [B, S, 3, H, D].
  * Any other layout (last dim strided, odd strides, stride 0 from expand(), misaligned
    storage offset) is first copied to a contiguous tensor: correct, but one extra read and
    write of that input.
  * out is always allocated contiguous [B, Sq, Hq, D] in the input dtype (bf16 for FP8
    inputs); lse is contiguous fp32 [B, Hq, Sq] (an empty tensor when return_lse is False).

A variable-length batch (attention_varlen) packs the sequences along the rows: q and out are
[total_q, Hq, D], k and v [total_k, Hkv, D], and the same rules apply to the row and head
strides; lse is [Hq, total_q]. cu_seqlens_q and cu_seqlens_k are int32 [batch + 1] offsets on
the GPU (copied when not contiguous); only the kernel reads them.

A paged KV cache (attention_paged) holds the keys and values in pages: k_cache and v_cache are
[num_pages, page_size, Hkv, D], and the same rules apply to their page, row and head strides
(an odd layout copies the whole cache). block_table [batch, max_pages_per_seq] and seqlens_k
[batch] are int32 on the GPU (copied when not contiguous); only the kernel reads them, as it
reads attention's optional seqlens_k, kv_batch_idx and leftpad_k (a cache entry and a first
key per sequence) and attention_paged's kv_batch_idx (a block_table row per sequence).

The launch runs on torch.cuda.current_stream() of q's device, with no host synchronization, so
the op can be captured in a CUDA graph. The dense op with seqlens_k and the paged op remember
each checked launch by its tensors' layout (see _launch_key): a decoding loop's later calls
only fill in their pointers, which halves the host's time per call.
"""

from .backward import attention_bwd, attention_varlen_bwd
from .checks import checking, kernel_names, set_checking
from .dense import attention, attention_fwd
from .fp8 import attention_fp8, attention_fp8_fwd
from .kvcache import append_kv, attention_paged, attention_paged_fwd
from .mla import mla_decode_fwd, mla_schedule, mla_with_kvcache
from .runner import launch, resolve_kernel
from .varlen import attention_varlen, attention_varlen_fwd

__all__ = [
    "append_kv",
    "attention",
    "attention_bwd",
    "attention_fp8",
    "attention_fp8_fwd",
    "attention_fwd",
    "attention_paged",
    "attention_paged_fwd",
    "attention_varlen",
    "attention_varlen_bwd",
    "attention_varlen_fwd",
    "checking",
    "kernel_names",
    "launch",
    "mla_decode_fwd",
    "mla_schedule",
    "mla_with_kvcache",
    "resolve_kernel",
    "set_checking",
]
