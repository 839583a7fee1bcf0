"""TRIAL (wip/fp8-exp2-fma): exponentials partly on the FMA pipe, timed interleaved in one process
on the same tensors (each variant chosen per call through environment variables that 16's launch
reads):
  --mode fp8: hattn.attention_fp8 at D = 128 with 0..3 of every 4 n8 tiles' exponentials on the
              FMA pipe (HATTN_TRIAL_FMA_EXP2) and 2 or 3 K/V stages (HATTN_TRIAL_FP8_STAGES);
  --mode d64: hattn.attention, bf16, D = 64 (H = 32), the dense kernels, HATTN_TRIAL_FMA_EXP2 0..3.
The error column is the largest |out - out of the first variant|.

  python3 scripts/trial_fp8_exp2.py --mode fp8|d64 [--reps 30]
"""
import argparse
import os
import statistics

import torch

import hattn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fp8", "d64"), default="fp8")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    fp8 = args.mode == "fp8"
    variants = [(st, fma) for st in ((2, 3) if fp8 else (2,)) for fma in (0, 1, 2, 3)]
    print(f"# {args.mode}; columns: s<stages>f<FMA tiles of 4>, TFLOP/s (median of {args.reps})")
    print("shape                 " + " ".join(f"s{st}f{fma}".rjust(7) for st, fma in variants) + "   max|d| vs first")

    def use(variant):
        os.environ["HATTN_TRIAL_FP8_STAGES"] = str(variant[0])
        os.environ["HATTN_TRIAL_FMA_EXP2"] = str(variant[1])

    dim, heads = (128, 16) if fp8 else (64, 32)
    for causal in (False, True):
        for seqlen in (1024, 4096, 16384):
            batch = 16384 // seqlen
            if fp8:
                q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
                ds = torch.full((batch, heads), 0.5, device="cuda")

                def call():
                    return hattn.attention_fp8(q, k, v, q_descale=ds, k_descale=ds, v_descale=ds, causal=causal)
            else:
                q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

                def call():
                    return hattn.attention(q, k, v, causal=causal)
            flops = 4 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
            times = {v_: [] for v_ in variants}
            outs = {}
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for v_ in variants:  # warm-up and outputs
                use(v_)
                for _ in range(3):
                    outs[v_] = call()
            for _ in range(args.reps):
                for v_ in variants:
                    use(v_)
                    start.record()
                    call()
                    stop.record()
                    stop.synchronize()
                    times[v_].append(start.elapsed_time(stop))
            tf = [flops / statistics.median(times[v_]) / 1e9 for v_ in variants]
            err = max((outs[v_].float() - outs[variants[0]].float()).abs().max().item() for v_ in variants)
            print(f"{'causal' if causal else 'full':6s} S={seqlen:5d} B={batch:2d}   " + " ".join(f"{t:7.1f}" for t in tf)
                  + f"   {err:.4f}")
    os.environ.pop("HATTN_TRIAL_FMA_EXP2", None)
    os.environ.pop("HATTN_TRIAL_FP8_STAGES", None)


if __name__ == "__main__":
    main()
