"""TRIAL (wip/fp8-promote2): FP8 variants timed interleaved in one process on the same tensors,
each chosen per call through environment variables that 16's launch_fp8 reads:
  HATTN_TRIAL_PROMOTE=1|2: P V tiles summed in o_tile before they are added to O (1: every tile);
  HATTN_TRIAL_FMA_EXP2=0|1 (D = 64 only): one of every four n8 tiles' exponentials on the FMA pipe.
The error column is the largest |out - out of the first variant|.

  python3 scripts/trial_fp8_promote.py [--reps 30]
"""
import argparse
import os
import statistics

import torch

import hattn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    for dim, heads in ((128, 16), (64, 32)):
        variants = [(pr, fma) for fma in ((0,) if dim == 128 else (0, 1)) for pr in (1, 2)]
        print(f"# D={dim}; columns: p<promote every>f<FMA tiles of 4>, TFLOP/s (median of {args.reps})")
        print("shape                 " + " ".join(f"p{pr}f{fma}".rjust(7) for pr, fma in variants) + "   max|d| vs first")

        def use(variant):
            os.environ["HATTN_TRIAL_PROMOTE"] = str(variant[0])
            os.environ["HATTN_TRIAL_FMA_EXP2"] = str(variant[1])

        for causal in (False, True):
            for seqlen in (1024, 4096, 16384):
                batch = 16384 // seqlen
                q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
                ds = torch.full((batch, heads), 0.5, device="cuda")

                def call():
                    return hattn.attention_fp8(q, k, v, q_descale=ds, k_descale=ds, v_descale=ds, causal=causal)
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
    os.environ.pop("HATTN_TRIAL_PROMOTE", None)


if __name__ == "__main__":
    main()
