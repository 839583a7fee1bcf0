#!/usr/bin/env python3
"""Where the backward algorithm itself misses the precision criterion (issue 53), on the CPU.

python/tests/test_precision.py checks hattn's gradients on the GPU against fp64 with the
criterion of test_contract.py (helpers.error_bound: twice the plain same-dtype implementation's
error plus half an ulp at the largest reference value, at least 1e-6), and explains a miss by
precision.py's same-precision emulation of the kernels' arithmetic. This tool runs the GPU test's
own case draw (test_precision.case_params, its seed) without hattn: for each case, the emulation
and ablations of it against fp64 with the same criterion, to say which of the algorithm's
steps its misses come from:

  emu          the kernels' arithmetic: fp32 steps, P^T and dS^T rounded to the dtype
  p32, ds32    P^T, or dS^T, kept in fp32 (the dtype's rounding of that operand removed)
  o_exact      delta = rowsum(dO * O) from the exact O (fp64, read in fp32) instead of the forward's O
               rounded to the dtype
  fp64         every fp32 step in fp64, the dtype's roundings kept (emulate_gradients(compute=fp64))
  tanh         softcap only: tanh with an error of tanh.approx's measured size

Prints the misses per dtype and softcap, and writes the cases the emulation misses (--all: every
case) as CSV. No GPU needed; 2000 cases take about 3 minutes on 2 cores.

    python3 tools/precision_emulation_study.py --cases 2000 --out misses.csv
"""
import argparse
import csv
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "python" / "tests"), str(ROOT / "python")]

VARIANTS = ("emu", "p32", "ds32", "o_exact", "fp64", "tanh")


def study_case(p) -> dict:
    import torch
    import test_precision as tp
    from helpers import attention_ref, error_bound, gradients, visible_mask
    from precision import emulate_backward, emulate_forward, emulate_gradients

    q, k, v, dout = tp.make_inputs(p, device="cpu")
    args = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
    pos = (p["causal"], None, p["window"], p["softcap"])
    ref = gradients(lambda q, k, v: attention_ref(q, k, v, upcast=True, **args)[0], *(t.double() for t in (q, k, v, dout)))
    naive = gradients(lambda q, k, v: attention_ref(q, k, v, upcast=False, **args)[0], q, k, v, dout)
    out, lse = emulate_forward(q, k, v, *pos)
    emulated = {
        "emu": emulate_backward(q, k, v, out, lse, dout, *pos),
        "p32": emulate_backward(q, k, v, out, lse, dout, *pos, round_p=False),
        "ds32": emulate_backward(q, k, v, out, lse, dout, *pos, round_ds=False),
        "o_exact": emulate_backward(q, k, v, attention_ref(q, k, v, upcast=True, **args)[0], lse, dout, *pos),
        "fp64": emulate_gradients(q, k, v, dout, *pos, compute=torch.float64),
    }
    if p["softcap"]:
        emulated["tanh"] = emulate_gradients(q, k, v, dout, *pos, tanh="profile", tanh_seed=p["seed"])
    keys_seen = visible_mask(p["seqlen_q"], p["seqlen_k"], p["causal"], p["window"]).sum(-1)
    row = dict(index=p["index"], dtype=tp.dtype_name(p["dtype"]), softcap=p["softcap"], head_dim=p["head_dim"],
               seqlen_q=p["seqlen_q"], seqlen_k=p["seqlen_k"], heads_q=p["heads_q"], heads_kv=p["heads_kv"],
               causal=int(p["causal"]), window=f"{p['window'][0]}x{p['window'][1]}", magnitude=p["magnitude"],
               one_key_row=int(bool((keys_seen == 1).any())))  # fmt: skip
    for i, g in enumerate(tp.GRADS):
        bound = error_bound(ref[i], naive[i], p["dtype"])
        row[f"{g}_ref_max"] = ref[i].abs().max().item()
        row[f"{g}_bound"] = bound
        for name in VARIANTS:
            err = (emulated[name][i].double() - ref[i]).abs().max().item() if name in emulated else None
            row[f"{g}_{name}"] = "" if err is None else err
            row[f"{g}_{name}_miss"] = "" if err is None else int(err > bound)
    return row


def missed(row, name) -> bool:
    return any(row[f"{g}_{name}_miss"] in (1, "1") for g in ("dq", "dk", "dv"))


def summary(rows) -> str:
    lines = [f"{len(rows)} cases (test_precision's draw); misses of the FA3-style criterion per variant"]
    for dtype in ("bf16", "fp16"):
        for capped in (False, True):
            sel = [r for r in rows if r["dtype"] == dtype and (float(r["softcap"]) > 0) == capped]
            emu = [r for r in sel if missed(r, "emu")]
            counts = ", ".join(f"{name} {sum(missed(r, name) for r in sel)}" for name in VARIANTS
                               if capped or name != "tanh")  # fmt: skip
            grads = {g: sum(r[f"{g}_emu_miss"] in (1, "1") for r in emu) for g in ("dq", "dk", "dv")}
            one_key = sum(int(r["one_key_row"]) for r in emu)
            lines.append(f"{dtype}{' softcap' if capped else ''}: {len(sel)} cases; {counts}; the emulation's misses "
                         f"by gradient {grads}, {one_key} of {len(emu)} in cases with a row that sees one key")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--out", default=None, help="CSV of the cases the emulation misses (default: none)")
    ap.add_argument("--all", action="store_true", help="write every case to --out")
    a = ap.parse_args()
    os.environ.setdefault("HATTN_PRECISION_CASES", str(a.cases))
    import torch
    import test_precision as tp

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    start = time.time()
    rows = [study_case(p) for p in tp.case_params(tp.SEED, a.cases)]
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            writer.writeheader()
            writer.writerows(r for r in rows if a.all or missed(r, "emu"))
    print(summary(rows))
    print(f"seed {tp.SEED}, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
