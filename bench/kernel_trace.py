"""Summary of a Mosaic GPU in-kernel profile (the Perfetto JSON that a kernel compiled with
`CompilerParams(profile_space=..., profile_dir=...)` writes per call).

Mosaic GPU's profiler (`jax.experimental.mosaic.gpu.profiler`) records, per warpgroup of every
block, the entry and exit of each named scope (`jax.named_scope` in the kernel) in SM clock
cycles, plus the block's start on the global nanosecond timer and its SM. In the JSON an event's
"ts" is (start ns + cycles since the warpgroup's first event) / 1000, "pid" is 1 + the SM and
"tid" is 1 + block x warpgroups + warpgroup. `summarize` turns that into:

* per warpgroup, each phase's cycles per block (mean over the blocks that ran it) and the share
  of the warpgroup's span (first to last event) it takes;
* per block, the span in cycles; per SM, the fraction of the kernel's wall time (first block
  start to last block end, ns) spent inside blocks, and the mean gap between one block's end
  and the next block's start on the same SM (the block exit, launch and prologue that no
  profiled scope covers). Block ends are start + span / `clock_ghz`.

    python -m bench.kernel_trace TRACE.json [--warpgroups 3] [--clock-ghz 1.755]
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import statistics

__all__ = ["summarize", "format_summary", "load_events", "profiled_summary"]


def load_events(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _block_traces(events: list[dict], warpgroups: int):
    """{block: {wg: (sm, [(name, begin, cycles)])}}: each warpgroup's events in order, times
    in cycles since that warpgroup's block start, plus each block's start in ns."""
    traces: dict[int, dict[int, list]] = collections.defaultdict(dict)
    starts: dict[int, float] = {}
    firsts: dict[int, float] = {}
    for e in events:
        trace = e["tid"] - 1
        block, wg = divmod(trace, warpgroups)
        ts = e["ts"] * 1e3
        if trace not in firsts:  # the first event of a trace is at its block start (ns)
            firsts[trace] = ts
            starts[block] = min(starts.get(block, ts), ts)
        entry = traces[block].setdefault(wg, (e["pid"] - 1, []))
        entry[1].append((e["name"], e["ph"] == "B", ts - firsts[trace]))
    return traces, starts


def summarize(events: list[dict], *, warpgroups: int = 3, clock_ghz: float = 1.755) -> dict:
    """Phase, block and SM statistics of one kernel call's trace events (module docstring)."""
    traces, starts = _block_traces(events, warpgroups)
    phase = collections.defaultdict(lambda: collections.defaultdict(list))
    spans = collections.defaultdict(list)
    block_span: dict[int, float] = {}
    block_sm: dict[int, int] = {}
    for block, wgs in traces.items():
        longest = 0.0
        for wg, (sm, evs) in wgs.items():
            block_sm[block] = sm
            open_at: dict[str, list[float]] = collections.defaultdict(list)
            totals: dict[str, float] = collections.defaultdict(float)
            for name, begin, t in evs:
                if begin:
                    open_at[name].append(t)
                elif open_at[name]:
                    totals[name] += t - open_at[name].pop()
            span = evs[-1][2] - evs[0][2] if evs else 0.0
            spans[wg].append(span)
            longest = max(longest, span)
            for name, cycles in totals.items():
                phase[wg][name].append(cycles)
        block_span[block] = longest
    per_sm = collections.defaultdict(list)
    for block, start in starts.items():
        per_sm[block_sm[block]].append((start, start + block_span[block] / clock_ghz))
    gaps, busy = [], []
    t_first = min(s for s, _ in itertools.chain(*per_sm.values()))
    t_last = max(e for _, e in itertools.chain(*per_sm.values()))
    for blocks in per_sm.values():
        blocks.sort()
        busy.append(sum(e - s for s, e in blocks) / max(t_last - t_first, 1e-9))
        gaps += [max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(blocks, blocks[1:])]
    out = {
        "blocks": len(traces), "sms": len(per_sm), "clock_ghz": clock_ghz,
        "kernel_wall_us": (t_last - t_first) / 1e3,
        "block_span_cycles": {"mean": statistics.fmean(block_span.values()),
                              "median": statistics.median(block_span.values())},
        "blocks_per_sm": len(traces) / max(len(per_sm), 1),
        "sm_busy_fraction": statistics.fmean(busy),
        "gap_between_blocks_ns": {"mean": statistics.fmean(gaps) if gaps else 0.0,
                                  "median": statistics.median(gaps) if gaps else 0.0},
        "warpgroups": {},
    }
    for wg in sorted(phase):
        mean_span = statistics.fmean(spans[wg])
        out["warpgroups"][wg] = {
            "span_cycles": mean_span,
            "phases": {name: {"cycles_per_block": sum(v) / len(spans[wg]),
                              "share": sum(v) / len(spans[wg]) / max(mean_span, 1e-9)}
                       for name, v in sorted(phase[wg].items(), key=lambda kv: -sum(kv[1]))},
        }
    return out


def profiled_summary(call, trace_dir: str, *, warpgroups: int = 3,
                     clock_ghz: float = 1.755) -> tuple[dict, str] | None:
    """Runs `call()` (a kernel call compiled with `profile_dir=trace_dir`, blocking) and
    returns (`summarize` of the trace it wrote, the trace's path), or None if it wrote none.
    The profiler writes its trace from a host callback: `jax.effects_barrier()` waits for it."""
    import jax

    os.makedirs(trace_dir, exist_ok=True)
    call()
    jax.effects_barrier()
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.json")), key=os.path.getmtime)
    if not traces:
        return None
    return (summarize(load_events(traces[-1]), warpgroups=warpgroups, clock_ghz=clock_ghz),
            traces[-1])


def format_summary(s: dict) -> str:
    lines = [f"{s['blocks']} blocks on {s['sms']} SMs ({s['blocks_per_sm']:.1f} a SM), kernel "
             f"{s['kernel_wall_us']:.1f} us wall; block span {s['block_span_cycles']['mean']:.0f}"
             f" cycles mean ({s['block_span_cycles']['median']:.0f} median); SMs inside blocks "
             f"{100 * s['sm_busy_fraction']:.1f}% of the wall time at {s['clock_ghz']} GHz; gap "
             f"between blocks {s['gap_between_blocks_ns']['mean']:.0f} ns mean "
             f"({s['gap_between_blocks_ns']['median']:.0f} median)"]
    for wg, w in s["warpgroups"].items():
        parts = ", ".join(f"{n} {p['cycles_per_block']:.0f} ({100 * p['share']:.0f}%)"
                          for n, p in w["phases"].items())
        lines.append(f"  wg{wg}: span {w['span_cycles']:.0f} cycles a block: {parts}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--warpgroups", type=int, default=3)
    ap.add_argument("--clock-ghz", type=float, default=1.755)
    args = ap.parse_args(argv)
    print(format_summary(summarize(load_events(args.trace), warpgroups=args.warpgroups,
                                   clock_ghz=args.clock_ghz)))


if __name__ == "__main__":
    main()
