"""The capstone: hattn inside a video-generation transformer, end to end.

    python -m hattn.capstone [--model wan2.1-1.3b] [--size 480p] [--reps 5] [--out DIR]

This builds diffusers' WanTransformer3DModel with the published configuration of Wan 2.1
(1.3B or 14B) and random weights. No checkpoint is loaded: the weights' values do not change
the work, only the numbers. It runs in bf16 on the GPU and times one denoising step, the
transformer's forward pass on the latents of 81 frames:

  * torch_default: attention as diffusers calls it, torch.nn.functional.scaled_dot_product_attention
    with torch's own choice of backend;
  * torch_cudnn and torch_flash: the same with SDPA held to its cuDNN or FLASH backend;
  * hattn: the same call inside hattn.patch_sdpa(), so hattn runs every attention it supports;
  * fa3: SDPA replaced by FlashAttention-3's forward on BSHD views of the same tensors, for every
    call it takes (no mask or dropout, bf16, D 64/128/256, causal only with as many queries as
    keys), when its library is given (--fa3 PATH or HATTN_FA3_LIB); else the run says it was
    not given.

The variants run in turn within each repetition (in a different order each time), with CUDA
events around each forward. The report gives the median time of each, hattn's speedup over
each torch variant, and which attention calls hattn ran (and why the others went to torch).
It writes capstone.json and capstone.csv with the GPU, its clock and the commit.

Sizes: 480p (480 x 832) gives 21 x 30 x 52 = 32,760 tokens, and 720p (720 x 1280) gives
21 x 45 x 80 = 75,600: the benchmark's capstone shapes. The text has 512 tokens of width 4096.
`--model tiny` is a two-layer toy for tests; it also runs on the CPU (--device cpu), where
every attention goes to torch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import json
import os
import random
import statistics
import time
import unittest.mock
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import fa3
from . import sdpa as _sdpa
from .bench import commit, environment

# Wan 2.1's published transformer configurations (text-to-video), and a toy for tests.
MODELS: Dict[str, Dict] = {
    "wan2.1-1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
    "wan2.1-14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
    "tiny": dict(num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=2, text_dim=64, freq_dim=32),
}
COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

# Latents [channels, frames, height, width] of 81 frames after Wan's VAE (4x in time, 8x in space).
SIZES = {"480p": (16, 21, 60, 104), "720p": (16, 21, 90, 160), "tiny": (16, 3, 8, 8)}
TEXT_TOKENS = 512

VARIANTS = ("torch_default", "torch_cudnn", "torch_flash", "hattn", "fa3")
TORCH_VARIANTS = ("torch_default", "torch_cudnn", "torch_flash")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hattn.capstone", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="wan2.1-1.3b")
    p.add_argument("--size", choices=sorted(SIZES), default="480p")
    p.add_argument("--reps", type=int, default=5, help="timed forward passes per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed passes per variant first (default 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the tiny model only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for capstone.json and capstone.csv (default: none written)")
    fa3.add_argument(p)
    args = p.parse_args(argv)
    fa3.check_argument(p, args)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if args.variant_list == ["fa3"]:
        p.error("--variants: fa3 with at least one other variant")
    args.fa3_note = None  # why the fa3 variant does not run (main sets it)
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    if args.device == "cpu" and args.model != "tiny":
        p.error("--device cpu runs only --model tiny")
    return args


def build_model(name: str, device: str, dtype: torch.dtype, seed: int):
    """diffusers' WanTransformer3DModel with the named configuration and random weights."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as e:
        raise SystemExit(f"python -m hattn.capstone needs diffusers (pip install diffusers): {e}") from None
    torch.manual_seed(seed)
    config = dict(COMMON, **MODELS[name])
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    # As from_pretrained(torch_dtype=dtype) loads it: dtype everywhere except the modules the
    # model class keeps in float32 (RoPE, time embedding, modulation table, block norms).
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for tensor_name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep & set(tensor_name.split(".")) else dtype)
    return model.eval(), config


def make_inputs(model_name: str, size: str, config: Dict, device: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    latents = torch.randn(1, *SIZES[size], device=device, dtype=dtype, generator=gen)
    text = torch.randn(1, TEXT_TOKENS if model_name != "tiny" else 16, config["text_dim"], device=device,
                       dtype=dtype, generator=gen)
    timestep = torch.tensor([500], device=device)
    return latents, timestep, text


def tokens(size: str) -> int:
    _, frames, height, width = SIZES[size]
    return frames * (height // 2) * (width // 2)


class AttentionLog:
    """Counts a variant's SDPA calls (hattn's inside patch_sdpa(), or FA3's): run by the variant
    itself, or handed to torch and why."""

    def __init__(self):
        self.ran = 0
        self.to_torch: Dict[str, int] = collections.Counter()

    def count(self, why: Optional[str]) -> None:
        """One call: why it went to torch, or None when the variant ran it."""
        if why is None:
            self.ran += 1
        else:
            self.to_torch[why] += 1

    def wrap(self, fn: Callable) -> Callable:
        def logged(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            self.count(_sdpa.sdpa_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
            return fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa)

        return logged


def fa3_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """Why FlashAttention-3 (as the benchmark's library holds it) does not take this SDPA call,
    or None when it does."""
    if attn_mask is not None or dropout_p != 0.0:
        return "a mask or dropout"
    if query.dim() != 4 or not query.is_cuda or any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return "not 4-d bf16 CUDA tensors"
    if query.shape[-1] not in (64, 128, 256) or key.shape[-1] != query.shape[-1]:
        return "a head dim other than 64, 128 or 256"
    if query.shape[1] != key.shape[1] and not (enable_gqa and query.shape[1] % key.shape[1] == 0):
        return "different head counts without enable_gqa"
    if is_causal and query.shape[2] != key.shape[2]:
        return "causal with fewer queries than keys (SDPA aligns it top-left, FA3 bottom-right)"
    return None


def fa3_sdpa(log: Optional[AttentionLog] = None) -> Callable:
    """torch SDPA's signature over FA3's forward, on BSHD views of the BHSD tensors; calls that
    FA3 does not take go to torch. `log` counts which ran where."""
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def call(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        why = fa3_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if log is not None:
            log.count(why)
        if why is not None:
            return torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return fa3.forward(q, k, v, is_causal, scale=scale)[0].transpose(1, 2)

    return call


def variant_context(name: str, log: Optional[AttentionLog] = None):
    """A context manager that sets up attention for one variant; `log` counts the calls that
    hattn (or FA3, for the fa3 variant) ran."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "torch_cudnn":
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    if name == "torch_flash":
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    if name == "hattn":
        if log is None:
            return _sdpa.patch_sdpa()
        return unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                                          log.wrap(_sdpa.scaled_dot_product_attention))
    if name == "fa3":
        return unittest.mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fa3_sdpa(log))
    return contextlib.nullcontext()


def run(args: argparse.Namespace) -> Dict:
    device, dtype = args.device, torch.bfloat16
    model, config = build_model(args.model, device, dtype, args.seed)
    latents, timestep, text = make_inputs(args.model, args.size, config, device, dtype, args.seed)
    cuda = device.startswith("cuda")

    def forward(variant: str, log: Optional[AttentionLog] = None) -> torch.Tensor:
        with torch.inference_mode(), variant_context(variant, log):
            return model(latents, timestep, text, return_dict=False)[0]

    # The first, untimed pass of each variant: the outputs compared below, and the calls that
    # hattn and FA3 ran counted (the timed passes run without the count).
    logs = {"hattn": AttentionLog(), "fa3": AttentionLog()}
    outputs = {v: forward(v, logs.get(v)) for v in args.variant_list}
    calls = {"by_hattn": logs["hattn"].ran, "to_torch": dict(logs["hattn"].to_torch)}
    fa3_calls = {"by_fa3": logs["fa3"].ran, "to_torch": dict(logs["fa3"].to_torch)}
    for _ in range(max(args.warmup - 1, 0)):
        for v in args.variant_list:
            forward(v)
    times: Dict[str, List[float]] = {v: [] for v in args.variant_list}
    order = list(args.variant_list)
    rng = random.Random(args.seed)
    for _ in range(args.reps):
        rng.shuffle(order)
        for v in order:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                forward(v)
                end.record()
                torch.cuda.synchronize()
                times[v].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                forward(v)
                times[v].append((time.perf_counter() - t0) * 1e3)

    reference = outputs[args.variant_list[0]]
    rows = []
    for v in args.variant_list:
        diff = (outputs[v].float() - reference.float()).abs().max().item()
        rows.append({"variant": v, "ms": statistics.median(times[v]), "reps": len(times[v]),
                     "max_abs_diff_vs_first": diff, "output_max_abs": reference.float().abs().max().item()})
    if "hattn" in times:
        hattn_ms = statistics.median(times["hattn"])
        for r in rows:
            r["hattn_speedup"] = r["ms"] / hattn_ms
    import diffusers

    return {
        "meta": dict(environment() if cuda else {"device": "cpu"}, commit=commit(), diffusers=diffusers.__version__,
                     model=args.model, size=args.size,
                     tokens=tokens(args.size), text_tokens=text.shape[1], config=config,
                     reps=args.reps, warmup=args.warmup, attention_calls_per_hattn_pass=calls,
                     **({"attention_calls_per_fa3_pass": fa3_calls} if "fa3" in args.variant_list else {}),
                     fa3=args.fa3_note or fa3.library_path(args.fa3)),
        "results": rows,
    }


def report(result: Dict) -> str:
    m = result["meta"]
    lines = [f"# {m['model']} at {m['size']} ({m['tokens']} video tokens, {m['text_tokens']} text tokens), "
             f"one transformer forward, bf16; commit {m['commit']}",
             f"{'variant':16s}{'ms':>12s}{'hattn speedup':>16s}{'max |diff| vs ' + result['results'][0]['variant']:>34s}"]
    for r in result["results"]:
        speed = f"{r['hattn_speedup']:.3f}x" if "hattn_speedup" in r else "-"
        lines.append(f"{r['variant']:16s}{r['ms']:12.2f}{speed:>16s}{r['max_abs_diff_vs_first']:34.3e}")
    calls = m["attention_calls_per_hattn_pass"]
    lines.append(f"attention calls per hattn pass: {calls['by_hattn']} by hattn"
                 + "".join(f"; {n} to torch ({why})" for why, n in calls["to_torch"].items()))
    fa3_calls = m.get("attention_calls_per_fa3_pass")
    if fa3_calls:
        lines.append(f"attention calls per fa3 pass: {fa3_calls['by_fa3']} by FA3"
                     + "".join(f"; {n} to torch ({why})" for why, n in fa3_calls["to_torch"].items()))
    elif m.get("fa3"):
        lines.append(f"fa3: {m['fa3']}")
    return "\n".join(lines)


def write(result: Dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "capstone.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "capstone.csv"), "w", newline="") as f:
        fields = ["model", "size", "tokens", "variant", "ms", "reps", "hattn_speedup", "max_abs_diff_vs_first",
                  "gpu", "sm_clock_mhz_end", "commit"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        m = result["meta"]
        for r in result["results"]:
            w.writerow(dict(r, model=m["model"], size=m["size"], tokens=m["tokens"], gpu=m.get("gpu", "cpu"),
                            sm_clock_mhz_end=m.get("sm_clock_mhz_end", ""), commit=m["commit"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("python -m hattn.capstone: no CUDA GPU here; it needs a Hopper GPU (or --model tiny --device cpu)")
        return 2
    # FA3 runs when its library is given (and on the GPU); otherwise the variant is left out and
    # the report says why.
    if "fa3" in args.variant_list:
        if not args.device.startswith("cuda"):
            args.fa3_note = "FlashAttention-3 runs on the GPU only"
        else:
            args.fa3_note = fa3.load(args.fa3)
            if args.fa3_note and args.fa3_note != fa3.NOT_GIVEN:  # a library was named and did not load
                print(f"python -m hattn.capstone: {args.fa3_note}")
                return 2
        if args.fa3_note:
            args.variant_list.remove("fa3")
    result = run(args)
    if args.device.startswith("cuda"):
        from .bench import sm_clock_mhz

        result["meta"]["sm_clock_mhz_end"] = sm_clock_mhz()
    print(report(result))
    if args.out:
        write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
