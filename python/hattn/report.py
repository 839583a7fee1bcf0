"""Benchmark reports: the text table, CSV, JSON and PNG plots of hattn.bench records.

A record is a flat dict, one per (shape, implementation):
  tag           "grid" (FlashAttention-3 benchmark grid) or "capstone"
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, dtype
  name          a hattn kernel ("03_mma_sync", "auto") or an anchor ("fa3", "sdpa_cudnn", ...)
  kind          "hattn" or "anchor"
  flops         4*B*Hq*Sq*Sk*D, halved when causal
  ms, tflops    median time and throughput (None when not timed)
  reps          the number of timed calls behind the median
  ratio         tflops / the best anchor's tflops at this shape (None when either is missing)
  best_anchor   the name of that anchor
  max_err, tol  max |out - reference| and the bound it had to meet (None when not checked)
  status        "ok", "FAIL" (wrong output), "skipped", "unsupported", "error" or "not given"
                (an anchor whose library the run was not given: FlashAttention-3's)
  note          why, for anything but "ok"

Nothing here needs a GPU; plots need matplotlib (skipped with a message when it is missing).
"""

from __future__ import annotations

import csv
import json
import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

FIELDS = (
    "tag", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "causal", "dtype",
    "name", "kind", "flops", "ms", "reps", "tflops", "ratio", "best_anchor", "max_err", "tol", "status", "note",
)  # fmt: skip

ShapeKey = Tuple


def shape_key(r: Dict) -> ShapeKey:
    return (r["tag"], r["head_dim"], r["causal"], r["seqlen_q"], r["seqlen_k"], r["batch"], r["heads_q"], r["heads_kv"])


def shape_label(r: Dict) -> str:
    seq = f"S={r['seqlen_q']}" if r["seqlen_q"] == r["seqlen_k"] else f"Sq={r['seqlen_q']} Sk={r['seqlen_k']}"
    heads = f"H={r['heads_q']}" if r["heads_q"] == r["heads_kv"] else f"Hq={r['heads_q']} Hkv={r['heads_kv']}"
    mask = "causal" if r["causal"] else "full"
    return f"{r['tag']} D={r['head_dim']} {mask} {seq} B={r['batch']} {heads}"


def group_by_shape(records: Iterable[Dict]) -> Dict[ShapeKey, List[Dict]]:
    groups: Dict[ShapeKey, List[Dict]] = {}
    for r in records:
        groups.setdefault(shape_key(r), []).append(r)
    return groups


def fill_ratios(records: List[Dict]) -> None:
    """Sets ratio and best_anchor on every record from the best timed anchor at its shape."""
    for group in group_by_shape(records).values():
        anchors = [r for r in group if r["kind"] == "anchor" and r["status"] == "ok" and r.get("tflops")]
        best = max(anchors, key=lambda r: r["tflops"], default=None)
        for r in group:
            r["best_anchor"] = best["name"] if best else None
            r["ratio"] = r["tflops"] / best["tflops"] if best and r.get("tflops") else None


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(records: Sequence[Dict]) -> str:
    """One block per shape: each implementation's time, throughput, ratio to the best anchor, error."""
    lines = []
    header = f"  {'implementation':26s} {'ms':>9s} {'TFLOP/s':>8s} {'vs best':>8s} {'max err':>9s}  status"
    for group in group_by_shape(records).values():
        lines.append(shape_label(group[0]) + f"   ({group[0]['flops'] / 1e12:.3g} TFLOP)")
        lines.append(header)
        for r in group:
            status = r["status"] + (f" ({r['note']})" if r.get("note") else "")
            lines.append(
                f"  {r['name']:26s} {_fmt(r['ms'], '9.3f'):>9s} {_fmt(r['tflops'], '8.1f'):>8s} "
                f"{_fmt(r['ratio'], '7.2f') + ('x' if r['ratio'] is not None else ''):>8s} "
                f"{_fmt(r['max_err'], '9.2e'):>9s}  {status}"
            )
    return "\n".join(lines)


def format_summary(records: Sequence[Dict]) -> str:
    """One line per shape: our best kernel against the best anchor."""
    lines = [f"{'shape':58s} {'best hattn':>24s} {'TFLOP/s':>8s} {'best anchor':>16s} {'TFLOP/s':>8s} {'ratio':>6s}"]
    for group in group_by_shape(records).values():
        ours = best_hattn(group) or {}
        anchor = next((r for r in group if r["name"] == group[0].get("best_anchor")), {})
        lines.append(
            f"{shape_label(group[0]):58s} {ours.get('name', '-'):>24s} {_fmt(ours.get('tflops'), '8.1f'):>8s} "
            f"{anchor.get('name', '-'):>16s} {_fmt(anchor.get('tflops'), '8.1f'):>8s} "
            f"{_fmt(ours.get('ratio'), '6.2f'):>6s}"
        )
    failures = [r for r in records if r["status"] in ("FAIL", "error")]
    if failures:
        lines.append(
            f"{len(failures)} FAILED or errored: " + ", ".join(f"{r['name']} @ {shape_label(r)}" for r in failures)
        )
    return "\n".join(lines)


def best_hattn(group: Sequence[Dict]) -> Optional[Dict]:
    """The fastest hattn kernel with a correct output in one shape's records."""
    ours = [r for r in group if r["kind"] == "hattn" and r["status"] == "ok" and r.get("tflops")]
    return max(ours, key=lambda r: r["tflops"], default=None)


def write_csv(records: Sequence[Dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in records:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in FIELDS})


def write_json(meta: Dict, records: Sequence[Dict], path: str) -> None:
    def clean(v):  # JSON has no inf/nan
        return None if isinstance(v, float) and not math.isfinite(v) else v

    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [{k: clean(r.get(k)) for k in FIELDS} for r in records]}, f, indent=1)
        f.write("\n")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def _panels(records: Sequence[Dict]) -> List[Tuple[int, bool]]:
    """(head_dim, causal) of the grid shapes, in a stable order."""
    return sorted({(r["head_dim"], r["causal"]) for r in records if r["tag"] == "grid"})


def _subplots(plt, n: int, title: str):
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat)


def plot_lineage(records: Sequence[Dict], kernel_order: Sequence[str], path: str, title: str = "") -> bool:
    """TFLOP/s along the lineage (x: kernel), one line per sequence length, one panel per (D, causal)."""
    plt = _pyplot()
    panels = _panels(records)
    if plt is None or not panels:
        return False
    fig, axes = _subplots(plt, len(panels), title or "hattn lineage: TFLOP/s per step")
    order = [k for k in kernel_order if any(r["name"] == k for r in records)]
    for ax, (d, causal) in zip(axes, panels):
        rows = [r for r in records if r["tag"] == "grid" and r["head_dim"] == d and r["causal"] == causal]
        seqlens = sorted({r["seqlen_q"] for r in rows})
        cmap = plt.get_cmap("viridis", max(len(seqlens), 2))
        for i, s in enumerate(seqlens):
            ys = []
            for k in order:
                hit = next((r for r in rows if r["seqlen_q"] == s and r["name"] == k and r["status"] == "ok"), None)
                ys.append(hit["tflops"] if hit else float("nan"))
            ax.plot(range(len(order)), ys, marker="o", color=cmap(i), label=f"S={s}")
        ax.set_xticks(range(len(order)))
        ax.set_xticklabels(order, rotation=30, ha="right", fontsize=8)
        if any(r["name"] in order and r["status"] == "ok" and r.get("tflops") for r in rows):
            ax.set_yscale("log")  # the lineage spans orders of magnitude
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # below the suptitle
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_vs_anchors(records: Sequence[Dict], path: str, title: str = "") -> bool:
    """Our best kernel per shape against each anchor: TFLOP/s over sequence length; capstone as bars."""
    plt = _pyplot()
    panels = _panels(records)
    capstone = [g for g in group_by_shape(records).values() if g[0]["tag"] == "capstone"]
    if plt is None or not (panels or capstone):
        return False
    fig, axes = _subplots(plt, len(panels) + (1 if capstone else 0), title or "hattn (best kernel) vs the anchors")
    anchors = sorted({r["name"] for r in records if r["kind"] == "anchor"})
    for ax, (d, causal) in zip(axes, panels):
        groups = [g for g in group_by_shape(records).values()
                  if g[0]["tag"] == "grid" and g[0]["head_dim"] == d and g[0]["causal"] == causal]  # fmt: skip
        groups.sort(key=lambda g: g[0]["seqlen_q"])
        xs = [g[0]["seqlen_q"] for g in groups]
        best = [best_hattn(g) for g in groups]
        ax.plot(xs, [b["tflops"] if b else float("nan") for b in best], marker="o", linewidth=2.5, label="hattn (best)")
        for a in anchors:
            ys = [
                next((r["tflops"] for r in g if r["name"] == a and r["status"] == "ok"), float("nan")) for g in groups
            ]
            ax.plot(xs, ys, marker=".", linestyle="--", label=a)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if capstone:
        ax = axes[len(panels)]
        names = ["hattn (best)"] + anchors
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = []
            for g in capstone:
                hit = (
                    best_hattn(g) if i == 0 else next((r for r in g if r["name"] == name and r["status"] == "ok"), None)
                )
                ys.append(hit["tflops"] if hit else 0.0)
            ax.bar([j + i * width for j in range(len(capstone))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(capstone))])
        ax.set_xticklabels([f"S={g[0]['seqlen_q']}\nH={g[0]['heads_q']}" for g in capstone], fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title("capstone shapes (B=1, D=128, non-causal)")
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # below the suptitle
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
