"""The decode grid's outputs: the rich table, the bar plot against the targets and
decode.json."""

from __future__ import annotations

import json
import os

import numpy as np

from .report import log

__all__ = ["dump", "plot", "print_table"]


def print_table(rows: list[dict], title: str) -> None:
    """The grid's rows as a rich table (plain lines without rich)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        for r in rows:
            log(r)
        return
    t = Table(title=title)
    for c in ("H", "B", "ctx", "ps", "splits", "device us", "dec+merge us", "wall us", "GB/s",
              "%ceil", "wall %ceil", "TFLOP/s", "xla us", "x xla", "rel err"):
        t.add_column(c, justify="right")
    f1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        t.add_row(str(r["heads"]), str(r["batch"]), str(r["ctx"]), str(r["page_size"]),
                  str(r["num_splits"]), f1(r["device_us"]),
                  "-" if r["decode_us"] is None else f"{r['decode_us']:.1f}+{r['merge_us']:.1f}",
                  f1(r["wall_us"]), f"{r['gbps']:.0f}", f"{r['pct_ceiling']:.1f}",
                  f"{r['wall_pct_ceiling']:.1f}", f"{r['tflops']:.1f}", f1(r["xla_us"]),
                  "-" if r["speedup_vs_xla"] is None else f"{r['speedup_vs_xla']:.2f}",
                  "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}")
    Console(width=180).print(t)


def plot(rows: list[dict], path: str) -> None:
    """Bars of % of the copy ceiling (16 heads) and TFLOP/s (128 heads) per case, device span
    beside wall clock, with the targets as lines; saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, h, key, wkey, label in (
            (axes[0], 16, "pct_ceiling", "wall_pct_ceiling", "% of copy ceiling"),
            (axes[1], 128, "tflops", None, "TFLOP/s")):
        sel = [r for r in rows if r["heads"] == h]
        names = [f"B{r['batch']}\nL{r['ctx'] // 1024}k\np{r['page_size']}" for r in sel]
        x = np.arange(len(sel))
        ax.bar(x - 0.2, [r[key] for r in sel], 0.4, label="pallas, device span")
        wall = [r[key] * r["time_us"] / r["wall_us"] for r in sel]
        ax.bar(x + 0.2, wall, 0.4, label="pallas, wall clock (jit of n calls)")
        if h == 16:
            ax.axhline(80, color="r", ls="--", label="target 80%")
        else:
            ax.axhline(550, color="r", ls="--", label="target 550")
        ax.set_xticks(x)
        ax.set_xticklabels(names, fontsize=6)
        ax.set_title(f"heads {h}: {label}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dump(results: dict, out: str) -> None:
    """results as `out`/decode.json (rewritten after every case, so a stopped run keeps them)."""
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(results, f, indent=1)
