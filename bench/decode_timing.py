"""How the decode benchmarks time a call: wall clock over a jit of n calls (`time_calls`), and
device time from a profiler trace of the same compiled jit (`profile_timings`, `device_stats`),
jobs in one trace told apart by a tiny marker kernel (`MARK`)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .report import log
from .timing import gpu_events, perfetto_events, wall_times_s

__all__ = ["MARK", "Timing", "device_stats", "marker_jit", "profile_timings", "time_calls",
           "trace_device_events"]


@dataclasses.dataclass
class Timing:
    """Wall-clock timing of a jit of `calls` calls (`jf(args)`), and its device statistics
    once `profile_timings` has run it under the profiler (`dev`, see `device_stats`)."""

    wall_s: float
    wall_min_s: float
    wall_max_s: float
    jf: object
    args: list
    calls: int
    dev: dict | None = None


def time_calls(fn: Callable, args_list: list[tuple], reps: int) -> Timing:
    """Median wall seconds per call of `fn` over args_list, the calls batched into one jit
    (after a warm-up; synchronised; per rep: the jit's wall time / len(args_list))."""
    def many(all_args):
        return [fn(*a) for a in all_args]
    jf = jax.jit(many)
    ts = [t / len(args_list) for t in
          wall_times_s(lambda: jax.block_until_ready(jf(args_list)), reps=reps, warmup=1)]
    return Timing(statistics.median(ts), min(ts), max(ts), jf, args_list, len(args_list))


MARK = "bench_decode_marker"


def _marker_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


@functools.partial(jax.jit, static_argnums=1)
def marker_jit(x: jax.Array, interpret: bool) -> jax.Array:
    """The marker kernel (named MARK) on `x`."""
    return pl.pallas_call(_marker_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          name=MARK, interpret=interpret)(x)


_MARK_INPUT: list = []


def _marker():
    """One tiny kernel named MARK (separates jobs in a device trace). Its input is made once,
    outside any trace, so that a marker adds exactly one kernel to a trace (no fill or copy)."""
    if not _MARK_INPUT:
        _MARK_INPUT.append(jax.block_until_ready(jnp.zeros((16, 128), jnp.float32)))
    jax.block_until_ready(marker_jit(_MARK_INPUT[0], jax.devices()[0].platform != "gpu"))


def trace_device_events(fn: Callable[[], object]) -> list[tuple[float, float, str]]:
    """(start_us, dur_us, name) of the device activity (CUPTI kernel and memcpy records) while
    fn() runs, read from a jax.profiler Perfetto trace, in start order; [] without a GPU."""
    return gpu_events(perfetto_events(fn))


def device_stats(events: list[tuple[float, float, str]], calls: int,
                 runs: int) -> dict | None:
    """Device time of `runs` back-to-back runs of a jit of `calls` calls, from their events
    (runs are told apart by the runs - 1 largest gaps between consecutive events: the host
    round trips between runs):

      span_us      per call: median over runs of (last end - first start) / calls, i.e. the
                   device time per call when calls are issued back to back (gaps included);
      busy_us      per call: sum of all durations / (runs * calls);
      decode_us / merge_us: median duration of the kernels named mla_decode* / *merge*;
      memset_us    per call: summed duration of the memset activities (e.g. zeroed buffers),
                   memsets_per_call;
      kernels_per_call, kernels: the 6 largest kernels by total time (name, median us, count).
    None without events."""
    if not events or calls <= 0 or runs <= 0:
        return None
    events = sorted(events)
    gaps = sorted(range(1, len(events)),
                  key=lambda i: events[i][0] - (events[i - 1][0] + events[i - 1][1]))
    cuts = sorted(gaps[len(gaps) - (runs - 1):]) if runs > 1 else []
    spans, start = [], 0
    for cut in cuts + [len(events)]:
        chunk = events[start:cut]
        if chunk:
            spans.append((max(t + d for t, d, _ in chunk) - chunk[0][0]) / calls)
        start = cut
    by_name: dict[str, list[float]] = {}
    for _, d, name in events:
        by_name.setdefault(name, []).append(d)
    dec = [d for _, d, nm in events if "mla_decode" in nm]
    mer = [d for _, d, nm in events if "merge" in nm]
    mset = [d for _, d, nm in events if "memset" in nm.lower()]
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:6]
    return dict(span_us=statistics.median(spans),
                busy_us=sum(d for _, d, _ in events) / (runs * calls),
                decode_us=statistics.median(dec) if dec else 0.0,
                merge_us=statistics.median(mer) if mer else 0.0,
                memset_us=sum(mset) / (runs * calls),
                memsets_per_call=len(mset) / (runs * calls),
                kernels_per_call=len(events) / (runs * calls),
                kernels=[(nm[:60], round(statistics.median(v), 2), len(v) / (runs * calls))
                         for nm, v in top])


def profile_timings(timings: list[Timing], runs: int = 2) -> None:
    """Runs each timing's compiled jit `runs` more times inside one profiler trace (a marker
    kernel before each) and stores `device_stats` in `.dev`; a failed trace leaves None."""
    timings = [t for t in timings if t is not None]
    if not timings:
        return
    _marker()

    def body():
        for t in timings:
            _marker()
            for _ in range(runs):
                jax.block_until_ready(t.jf(t.args))
        _marker()

    try:
        events = trace_device_events(body)
    except Exception as e:  # noqa: BLE001 - a missing profiler must not stop the benchmark
        log(f"   profiler trace failed: {type(e).__name__}: {str(e)[:200]}")
        return
    marks = [i for i, e in enumerate(events) if MARK in e[2]]
    for k, t in enumerate(timings):
        if k + 1 < len(marks):
            t.dev = device_stats(events[marks[k] + 1:marks[k + 1]], t.calls, runs)
