"""Draw a WorkPlan: the KV work of every compute unit, so load balance shows at a glance.

One stacked bar per compute unit; each segment is one work, its height the work's KV length in
tokens (`(kv_end - kv_start) * block_size`) plus a fixed per-work overhead, its colour the batch
(request) it serves. Works that write a partial result (split tiles, merged later by the
reduce) are hatched; the dashed line is the mean load per unit.
"""

from __future__ import annotations

import numpy as np

from funcmla.planners.plan import (
    BATCH_IDX,
    KV_END,
    KV_START,
    PARTIAL_QO_LOC,
    QO_END,
    QO_START,
    WorkPlan,
)

__all__ = ["plan_summary", "plot_work_plan"]


def plan_summary(plan: WorkPlan) -> dict:
    """Host-side summary of a plan: works and tokens per compute unit, splits, reduce groups."""
    work_indptr = np.asarray(plan.work_indptr)
    num_works = int(plan.num_works)
    info = np.asarray(plan.work_info)[:num_works]
    tokens = (info[:, KV_END] - info[:, KV_START]).clip(min=0) * plan.block_size
    per_cu_tokens = np.add.reduceat(np.append(tokens, 0), work_indptr[:-1]) * (np.diff(work_indptr) > 0)
    reduce_indptr = np.asarray(plan.reduce_indptr)
    return {
        "kind": plan.kind,
        "block_size": plan.block_size,
        "legacy": plan.legacy,
        "num_cu": plan.num_cu,
        "num_works": num_works,
        "max_work": plan.max_work,
        "num_partial_works": int((info[:, PARTIAL_QO_LOC] >= 0).sum()),
        "num_split_tiles": int((np.diff(reduce_indptr) > 0).sum()),
        "num_partials": int(plan.num_partials),
        "busy_cus": int((np.diff(work_indptr) > 0).sum()),
        "tokens_per_cu_max": int(per_cu_tokens.max(initial=0)),
        "tokens_per_cu_mean": float(per_cu_tokens.mean()) if len(per_cu_tokens) else 0.0,
        "works_per_cu": np.diff(work_indptr).tolist(),
        "tokens_per_cu": per_cu_tokens.astype(int).tolist(),
    }


def plot_work_plan(plan: WorkPlan, path: str, *, title: str | None = None,
                   overhead_tokens: int = 0) -> str:
    """Write a PNG of the plan's per-unit work to `path` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work_indptr = np.asarray(plan.work_indptr)
    num_works = int(plan.num_works)
    info = np.asarray(plan.work_info)[:num_works]
    num_cu = plan.num_cu
    cmap = plt.get_cmap("tab20")
    fig_w = min(max(8.0, num_cu * 0.06 + 4), 24.0)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(fig_w, 7.5), height_ratios=[3, 1], sharex=True)
    loads = np.zeros(num_cu)
    seen: set[int] = set()
    for cu in range(num_cu):
        bottom = 0.0
        for w in range(work_indptr[cu], min(work_indptr[cu + 1], num_works)):
            b = int(info[w, BATCH_IDX])
            h = max(int(info[w, KV_END] - info[w, KV_START]), 0) * plan.block_size + overhead_tokens
            split = info[w, PARTIAL_QO_LOC] >= 0
            ax.bar(cu, h, bottom=bottom, width=0.85, color=cmap(b % 20),
                   hatch="///" if split else None, edgecolor="black" if split else "none",
                   linewidth=0.3, label=f"request {b}" if b not in seen and b < 20 else None)
            seen.add(b)
            bottom += h
        loads[cu] = bottom
    if num_cu:
        ax.axhline(loads.mean(), color="black", linestyle="--", linewidth=0.8,
                   label=f"mean {loads.mean():.0f} tokens")
    ax.set_ylabel("KV tokens per unit")
    summary = plan_summary(plan)
    ax.set_title(title or (
        f"{plan.kind} work plan: {summary['num_works']} works on {summary['busy_cus']}/{num_cu} units, "
        f"{summary['num_split_tiles']} split tiles, block_size {plan.block_size}"
        + (" (LEGACY)" if plan.legacy else "")))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax2.bar(range(num_cu), np.diff(work_indptr), width=0.85, color="grey")
    ax2.set_ylabel("works")
    ax2.set_xlabel("compute unit")
    # qo rows of each split tile, for the caption
    split_rows = info[info[:, PARTIAL_QO_LOC] >= 0][:, [QO_START, QO_END]]
    fig.text(0.01, 0.005, f"hatched: partial works (merged by the reduce); "
             f"{len(np.unique(split_rows, axis=0)) if len(split_rows) else 0} reduce groups",
             fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
