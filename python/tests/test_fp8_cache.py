"""An FP8 KV cache: k and v in torch.float8_e4m3fn beside bf16/fp16 q, with k_descale and
v_descale [B, Hkv], through hattn.attention_paged, hattn.attention and flash_attn_with_kvcache.

The CPU tests run everywhere: argument errors, shapes on meta tensors, the problem handed to the
binding and routing (only the production forward has it, without a window). The GPU tests
(Hopper only) compare with the fp64 reference on the dequantized cache (codes x descales).
"""

import hattn
import pytest
import torch
from hattn import _C
from hattn.flash_attn_interface import flash_attn_with_kvcache as fa3_with_kvcache
from hattn.ops.runner import _problem_kwargs
from helpers import binding, requires_hopper
from test_paged import check_sequences, gather, make_paged, paged_args

E4M3 = torch.float8_e4m3fn
B, SQ, HQ, HKV, D = 3, 4, 8, 2, 64


def fp8_paged_args(device="cpu", dtype=torch.bfloat16):
    """paged_args with e4m3 caches, and (k_descale, v_descale) fp32 [B, Hkv]."""
    q, k_cache, v_cache, table, lens = paged_args(dtype=dtype, device=device)
    descales = tuple(torch.ones(B, HKV, device=device) for _ in range(2))
    return (q, k_cache.to(E4M3), v_cache.to(E4M3), table, lens), descales


# --- package (CPU) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_shapes(dtype):
    args, (kd, vd) = fp8_paged_args("meta", dtype)
    out, lse = torch.ops.hattn.attention_paged_fwd(*args, True, None, "auto", True, -1, -1, 0, None, 0.0, kd, vd)
    assert out.shape == args[0].shape and out.dtype == dtype and lse.shape == (B, HQ, SQ)
    q, k, v = args[0], *(t[:B] for t in args[1:3])
    out, _ = torch.ops.hattn.attention_fwd(q, k, v, False, None, "auto", False, -1, -1, args[4], 0, None, None, 0.0,
                                           False, kd, vd)  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype


def test_argument_errors_name_the_argument():
    (q, k8, v8, table, lens), (kd, vd) = fp8_paged_args()
    with pytest.raises(ValueError, match=r"v_cache: dtype torch.bfloat16 must match k_cache's dtype"):
        hattn.attention_paged(q, k8, v8.to(q.dtype), table, lens)
    with pytest.raises(ValueError, match=r"k_descale: shape must be \(batch, heads_kv\) = \(3, 2\)"):
        hattn.attention_paged(q, k8, v8, table, lens, k_descale=kd[:1])
    with pytest.raises(ValueError, match=r"v_descale: dtype must be torch.float32"):
        hattn.attention_paged(q, k8, v8, table, lens, v_descale=vd.half())
    with pytest.raises(ValueError, match=r"k_descale: dequantization scales are for an e4m3 KV cache"):
        hattn.attention_paged(q, k8.to(q.dtype), v8.to(q.dtype), table, lens, k_descale=kd)
    with pytest.raises(NotImplementedError, match=r"e4m3 KV cache \(kv_dtype\) runs without a sliding window"):
        torch.ops.hattn.attention_paged_fwd(q.to("meta"), k8.to("meta"), v8.to("meta"), table.to("meta"),
                                            lens.to("meta"), False, None, "auto", False, 100, -1)  # fmt: skip
    lineage = hattn.kernels()[0].name
    with pytest.raises(NotImplementedError, match=r"no e4m3 KV cache \(kv_dtype\)"):
        torch.ops.hattn.attention_fwd(q.to("meta"), k8[:B].to("meta"), v8[:B].to("meta"), False, None, lineage, False)
    new = q[:, :1, :HKV]  # rows to append, in q's dtype
    with pytest.raises(ValueError, match=r"k: dtype torch.float16 must be q's, torch.bfloat16: the append quantizes"):
        hattn.flash_attn_with_kvcache(q, k8, v8, k=new.half(), v=new, cache_seqlens=lens, block_table=table)
    with pytest.raises(ValueError, match=r"v: dtype torch.float8_e4m3fn must be q's"):
        hattn.flash_attn_with_kvcache(q, k8, v8, k=new, v=new.to(E4M3), cache_seqlens=lens, block_table=table)
    with pytest.raises(NotImplementedError, match=r"e4m3 KV cache \(kv_dtype\) runs without a sliding window"):
        # refused before the append could write into the cache
        hattn.flash_attn_with_kvcache(q, k8, v8, k=new, v=new, cache_seqlens=lens, block_table=table,
                                      window_size=(64, -1))  # fmt: skip
    with pytest.raises(ValueError, match=r"v_descale: shape must be \(batch, heads_kv\)"):
        hattn.flash_attn_with_kvcache(q, k8, v8, k=new, v=new, cache_seqlens=lens, block_table=table, v_descale=vd.T)
    with pytest.raises(NotImplementedError, match=r"q_descale with torch.bfloat16 q"):
        fa3_with_kvcache(q, k8, v8, cache_seqlens=lens, page_table=table, q_descale=kd, k_descale=kd)
    with pytest.raises(NotImplementedError, match=r"an e4m3 KV cache is forward only"):
        hattn.attention(q.clone().requires_grad_(), k8[:B], v8[:B])


def test_problem_kwargs_carry_the_cache_dtype_and_descales():
    (q, k8, v8, table, lens), (kd, vd) = fp8_paged_args()
    kwargs = _problem_kwargs(q, k8, v8, torch.empty_like(q), None, False, None, "auto", seqlens_k=lens,
                             block_table=table, k_descale=kd, v_descale=vd)  # fmt: skip
    assert kwargs["dtype"] == "bf16" and kwargs["kv_dtype"] == "e4m3"
    assert kwargs["k_descale"] == kd.data_ptr() and kwargs["v_descale"] == vd.data_ptr()
    assert "q_descale" not in kwargs
    assert binding(_C.resolve_kernel, **kwargs) == hattn.kernels()[-1].name
    assert "kv_dtype" not in _problem_kwargs(q, q, q, torch.empty_like(q), None, False, None, "auto")


# --- GPU -------------------------------------------------------------------------------------------


def quantized(k_cache, v_cache, heads_kv, batch, seed):
    """The caches as e4m3 codes and random descales in [0.25, 2), fp32 [B, Hkv]."""
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    descales = tuple(torch.rand(batch, heads_kv, device="cuda", generator=gen) * 1.75 + 0.25 for _ in range(2))
    return k_cache.to(E4M3), v_cache.to(E4M3), descales


def dequantized(cache8, table, lens, descale):
    """Each sequence's keys (or values) as the kernel sees them, code x descale, fp32 [n, Hkv, D]."""
    return [gather(cache8.float(), table, b, n) * descale[b][None, :, None] for b, n in enumerate(lens)]


@requires_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_fp8_cache_matches_reference(causal, dtype, head_dim):
    lens = [0, 1, 127, 129, 300, 1000]
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 4, 8, 2, head_dim, dtype, 128)
    k8, v8, (kd, vd) = quantized(k_cache, v_cache, 2, len(lens), 0)
    out, lse = hattn.attention_paged(q, k8, v8, table, seqlens_k, causal=causal, return_lse=True, k_descale=kd,
                                     v_descale=vd)  # fmt: skip
    torch.cuda.synchronize()
    check_sequences(q, dequantized(k8, table, lens, kd), dequantized(v8, table, lens, vd), out, lse, causal=causal)


@requires_hopper
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 1e5, 1e6])
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["plain", "softcap"])
def test_bf16_queries_of_any_magnitude(magnitude, softcap):
    """bf16 queries over an e4m3 cache run in fp16 with Q scaled by 2^-8 (kv_dequant.cuh's
    kHalfQScale): queries past fp16's range (1e5, 1e6; exact up to 1.6e7) and far below it
    stay right, with and without softcapping (which takes the scale back inside the tanh)."""
    lens = [1, 300, 1000]
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 4, 8, 2, 128, torch.bfloat16, 128, seed=3)
    q = (q * magnitude).to(torch.bfloat16)
    k8, v8, (kd, vd) = quantized(k_cache, v_cache, 2, len(lens), 3)
    out, lse = hattn.attention_paged(q, k8, v8, table, seqlens_k, softcap=softcap, return_lse=True, k_descale=kd,
                                     v_descale=vd)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_sequences(q, dequantized(k8, table, lens, kd), dequantized(v8, table, lens, vd), out, lse, softcap=softcap)


@requires_hopper
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_dense_fp8_cache_decoding(num_splits):
    """hattn.attention with seqlens_k over a dense e4m3 cache, GQA 8 (packed), split-KV."""
    batch, capacity, lens = 3, 3000, [3000, 1, 1500]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, 1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, capacity, 2, 128, device="cuda", generator=gen) for _ in range(2))
    k8, v8, (kd, vd) = quantized(k, v, 2, batch, 5)
    seqlens_k = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = hattn.attention(q, k8, v8, seqlens_k=seqlens_k, num_splits=num_splits, return_lse=True, k_descale=kd,
                               v_descale=vd)  # fmt: skip
    torch.cuda.synchronize()
    keys = [k8[b, :n].float() * kd[b][None, :, None] for b, n in enumerate(lens)]
    values = [v8[b, :n].float() * vd[b][None, :, None] for b, n in enumerate(lens)]
    check_sequences(q, keys, values, out, lse)


@requires_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_appending_quantizes_into_the_fp8_cache(paged):
    """flash_attn_with_kvcache with k and v to append into an e4m3 cache: the new rows land as
    the codes of value / descale of their sequence and K/V head, and the attention reads them."""
    lens, new_rows = [5, 700, 126], 2  # every appended row inside the sequence's own pages
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 1, 8, 2, 128, torch.bfloat16, 128)
    k8, v8, (kd, vd) = quantized(k_cache, v_cache, 2, len(lens), 7)
    gen = torch.Generator(device="cuda").manual_seed(9)
    k_new, v_new = (torch.randn(len(lens), new_rows, 2, 128, device="cuda", dtype=q.dtype, generator=gen)
                    for _ in range(2))  # fmt: skip
    if not paged:  # the same keys in a dense cache [B, capacity, Hkv, D] (codes moved as bytes)
        dense = []
        for cache in (k8, v8):
            codes = torch.zeros(len(lens), 1024, 2, 128, dtype=torch.uint8, device="cuda")
            for b, n in enumerate(lens):
                codes[b, :n] = gather(cache.view(torch.uint8), table, b, n)
            dense.append(codes.view(E4M3))
        (k8, v8), table = dense, None

    def rows(cache, b, first, count):  # sequence b's rows first .. first + count - 1, as codes
        codes = cache.view(torch.uint8)
        return gather(codes, table, b, first + count)[first:] if paged else codes[b, first : first + count]

    out = hattn.flash_attn_with_kvcache(q, k8, v8, k=k_new, v=v_new, cache_seqlens=seqlens_k, block_table=table,
                                        k_descale=kd, v_descale=vd)  # fmt: skip
    torch.cuda.synchronize()
    for b, n in enumerate(lens):
        for cache, new, scale in ((k8, k_new[b], kd[b]), (v8, v_new[b], vd[b])):
            want = (new.float() / scale[None, :, None]).to(E4M3).float()
            got = rows(cache, b, n, new_rows).view(E4M3).float()
            # Nearest code of value / descale; the kernel rounds the quotient to fp32 first, so a
            # value at a tie may round the other way: within one e4m3 step.
            assert ((got - want).abs() <= want.abs() / 8 + 2**-9).all(), f"sequence {b}"
    lens_after = [n + new_rows for n in lens]
    keys, values = ([rows(cache, b, 0, n).view(E4M3).float() * scale[b][None, :, None] for b, n in enumerate(lens_after)]
                    for cache, scale in ((k8, kd), (v8, vd)))  # fmt: skip
    _, lse = hattn.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens_k + new_rows, block_table=table,
                                           k_descale=kd, v_descale=vd, return_softmax_lse=True)  # fmt: skip
    check_sequences(q, keys, values, out, lse)


@requires_hopper
def test_flash_attn_with_kvcache_fp8_cache():
    lens = [5, 900, 128]
    q, k_cache, v_cache, table, seqlens_k = make_paged(lens, 1, 8, 2, 128, torch.bfloat16, 256)
    k8, v8, (kd, vd) = quantized(k_cache, v_cache, 2, len(lens), 3)
    out, lse = fa3_with_kvcache(q, k8, v8, cache_seqlens=seqlens_k, page_table=table, k_descale=kd, v_descale=vd,
                                return_softmax_lse=True)[:2]  # fmt: skip
    torch.cuda.synchronize()
    check_sequences(q, dequantized(k8, table, lens, kd), dequantized(v8, table, lens, vd), out, lse)
    again = hattn.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens_k, block_table=table, k_descale=kd,
                                          v_descale=vd)  # fmt: skip
    assert torch.equal(again, out)
