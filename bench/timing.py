"""Small shared helpers for the benchmarks: host timing, JSON output, rich tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import jax


def median_time_s(fn: Callable[[], object], *, reps: int = 20, warmup: int = 2,
                  min_time_s: float = 0.0) -> float:
    """Median wall time of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start) < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * reps:
            break
    return statistics.median(times)


def environment() -> dict:
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "backend": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{x:.4g}" if isinstance(x, float) else str(x) for x in r])
    Console().print(table)
