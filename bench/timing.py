"""Small shared helpers for the benchmarks: host timing, profiler trace reading, JSON output, rich
tables."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from typing import Callable

import jax


def wall_times_s(fn: Callable[[], object], *, reps: int = 20, warmup: int = 2,
                 min_time_s: float = 0.0) -> list[float]:
    """Wall time of each timed `fn()` call (which must block until its result is ready), after
    `warmup` untimed ones: `reps` calls, more while `min_time_s` has not passed (at most
    10 * reps)."""
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
    return times


def median_time_s(fn: Callable[[], object], *, reps: int = 20, warmup: int = 2,
                  min_time_s: float = 0.0) -> float:
    """Median wall time of `fn()` (which must block until its result is ready)."""
    return statistics.median(wall_times_s(fn, reps=reps, warmup=warmup, min_time_s=min_time_s))


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
    """payload to `path` as indented JSON, whole or not at all (written beside it, then
    renamed over it: a process killed mid-write leaves the previous file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)
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


PRIME_KERNEL = "bench_queue_prime"


@functools.lru_cache(maxsize=None)
def queue_prime(iters: int = 100_000) -> Callable[[], object]:
    """A jitted call (not blocking) whose single GPU kernel, named PRIME_KERNEL, spins for about
    `iters` dependent multiply-adds (at 100k about 0.2 ms expected on an H200, from ~4 cycles
    per dependent FMA at ~2 GHz; not measured): run before a call, it keeps the stream busy until
    the host has queued all of that call's kernels (~0.1-0.3 ms of host time per plan), so the
    call's span shows device time only, not the host's launch gaps. GPU (Triton backend)
    only. Built and compiled once per process (cached)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    def spin(x_ref, o_ref):
        o_ref[...] = lax.fori_loop(0, iters, lambda i, v: v * 0.999 + 1e-3, x_ref[...])

    call = jax.jit(pl.pallas_call(spin, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32),
                                  name=PRIME_KERNEL))
    x = jnp.ones((32,), jnp.float32)
    jax.block_until_ready(call(x))
    return lambda: call(x)


def host_us(fn: Callable[[], object], calls: int, sync: Callable[[], object] | None = None,
            warmup: int = 50, sync_every: int = 100) -> float:
    """Median host time of one `fn()` call (us), `sync()` (if given) every `sync_every` calls
    outside the timed region (so the device queue never fills up and stalls the host)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    pc = time.perf_counter_ns
    for i in range(calls):
        t0 = pc()
        fn()
        times.append(pc() - t0)
        if sync and i % sync_every == sync_every - 1:
            sync()
    if sync:
        sync()
    return statistics.median(times) / 1e3


def perfetto_events(fn: Callable[[], object]) -> list[dict]:
    """The trace events of the Perfetto JSON that `jax.profiler.trace` writes while `fn()` runs;
    [] when it writes none."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            fn()
        paths = [os.path.join(root, f) for root, _, files in os.walk(d) for f in files
                 if f.endswith("perfetto_trace.json.gz")]
        if not paths:
            return []
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gpu_events(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start_us, dur_us, name) of the complete ("X") events of the processes named
    "/device:GPU..." (CUPTI kernel and memcpy records), in start order; [] without a GPU."""
    pids = {e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
    return sorted((float(e["ts"]), float(e["dur"]), str(e["name"])) for e in events
                  if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e)


def device_kernel_times(fn: Callable[[], object], *, reps: int = 20,
                        primed: bool = False) -> dict | None:
    """Per-kernel device time of `fn()` (which must block), from a JAX profiler trace.

    Runs `fn` `reps` times under `jax.profiler.trace` (`perfetto_events`); see
    `trace_kernel_stats` for what is returned. primed: each call is queued behind a
    `queue_prime` kernel (left out of the statistics), so that "span_us" is the device's time
    for the call with every kernel already queued. None when the trace holds no device events
    (CPU backend, or no CUPTI)."""
    prime = queue_prime() if primed else None
    fn()

    def calls():
        for _ in range(reps):
            if prime is not None:
                prime()
            fn()

    return trace_kernel_stats(perfetto_events(calls), reps,
                              prime_name=PRIME_KERNEL if primed else None)


def trace_kernel_stats(events: list[dict], reps: int, *,
                       prime_name: str | None = None) -> dict | None:
    """Kernel statistics of `reps` blocking calls from Chrome/Perfetto trace events.

    Device events are the complete ("X") events of processes named "/device:GPU...". Returns
    {"kernels_per_call", "busy_us_per_call" (sum of kernel durations / reps), "span_us" (median
    over calls of last kernel end - first kernel start: the device time a caller waits for,
    gaps between kernels included), "kernels": [{"name", "per_call", "median_us",
    "total_us_per_call"}...] by total time}, or None without device events. Calls are told
    apart by the reps - 1 largest gaps between consecutive kernels (the host round trips), or,
    with `prime_name`, by the kernels whose name contains it (one before each call; they are
    left out of every figure)."""
    from collections import defaultdict

    kern = gpu_events(events)
    if prime_name is not None:
        groups, cur = [], None
        for k in kern:
            if prime_name in k[2]:
                cur = []
                groups.append(cur)
            elif cur is not None:
                cur.append(k)
        groups = [g for g in groups if g]
        kern = [k for g in groups for k in g]
    if not kern:
        return None
    durs: dict[str, list[float]] = defaultdict(list)
    for _, dur, name in kern:
        durs[name].append(dur)
    if prime_name is None:
        gaps = sorted(range(1, len(kern)), key=lambda i: kern[i][0] - (kern[i - 1][0] +
                                                                       kern[i - 1][1]))
        cuts = sorted(gaps[len(gaps) - (reps - 1):]) if reps > 1 and len(gaps) >= reps - 1 \
            else []
        groups, start = [], 0
        for cut in cuts + [len(kern)]:
            groups.append(kern[start:cut])
            start = cut
    spans = [max(t + d for t, d, _ in group) - group[0][0] for group in groups]
    kernels = sorted(({"name": name, "per_call": len(v) / reps,
                       "median_us": statistics.median(v), "total_us_per_call": sum(v) / reps}
                      for name, v in durs.items()), key=lambda k: -k["total_us_per_call"])
    return {"kernels_per_call": len(kern) / reps,
            "busy_us_per_call": sum(d for _, d, _ in kern) / reps,
            "span_us": statistics.median(spans),
            "kernels": kernels}


def torch_queued_us(torch, fn, reps: int, calls: int) -> float:
    """Device time per call of `fn` (torch work on the current stream): the median over `reps`
    runs of `calls` calls queued behind a sleep kernel between one CUDA-event pair."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(max(3, reps // calls)):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the calls queue behind it
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(ts)


def torch_host_us(torch, fn, reps: int, calls: int) -> float:
    """Host time per call of `fn`: the median over `reps // calls` runs (at least 3) of
    `calls` unsynchronized calls' wall time (the device is idle at each run's start)."""
    host = []
    for _ in range(max(3, reps // calls)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(host)
