"""`bench.kernel_trace` on traces written by Mosaic GPU's own profiler writer
(`ProfilerSpec.dump`) from a buffer laid out as the kernel fills it, for a schedule whose phase
times, block spans and gaps are known."""

import io
import json

import numpy as np
import pytest

from bench.kernel_trace import format_summary, summarize

profiler = pytest.importorskip("jax.experimental.mosaic.gpu.profiler")

WARPGROUPS = 3
GHZ = 2.0  # cycles per ns in the synthetic schedule


def dumped(blocks, entries=64):
    """JSON events of `blocks`: a list of (sm, start_ns, {wg: [(name, begin_cycle,
    end_cycle)]}), written by `ProfilerSpec.dump` from the kernel's buffer layout (per block and
    warpgroup: start ns, SM, entries used, then (tag, clock) pairs)."""
    spec = profiler.ProfilerSpec(entries)
    buf = np.zeros((len(blocks), WARPGROUPS, entries), np.uint32)
    for b, (sm, start, wgs) in enumerate(blocks):
        for wg, phases in wgs.items():
            pairs = []
            for name, t0, t1 in phases:
                tag = spec.intern_name(name)
                pairs += [(tag | spec.ENTER, 1000 + t0), (tag | spec.EXIT, 1000 + t1)]
            buf[b, wg, :3] = (start, sm, 2 * len(pairs))
            buf[b, wg, 3:3 + 2 * len(pairs)] = np.ravel(pairs)
    f = io.StringIO()
    spec.dump(buf.ravel(), f, grid=(len(blocks),), block=(128 * WARPGROUPS, 1, 1))
    return json.loads(f.getvalue())["traceEvents"]


def sequence(*phases):
    """Phases (name, cycles) one after another, 1 cycle apart (the writer takes the smallest
    step between two events as the profiler's own cost and removes 1 cycle less per event)."""
    out, t = [], 0
    for name, cycles in phases:
        out.append((name, t, t + cycles))
        t += cycles + 1
    return out


def block(sm, start_ns, tiles):
    """Consumers (wg 0, 1): wait_q 100 cycles, then per tile qk 300 + pv 200, finish 49: a
    span of 100 + 500 x tiles + 49 plus 1 + 2 x tiles steps; producer (wg 2): copy 20 per
    tile."""
    consumer = sequence(("wait_q", 100), *[p for _ in range(tiles)
                                            for p in (("qk", 300), ("pv", 200))], ("finish", 49))
    producer = sequence(*[("copy", 20)] * tiles)
    return sm, start_ns, {0: consumer, 1: consumer, 2: producer}


def span(tiles):
    return 100 + 502 * tiles + 50


def test_phases_spans_and_gaps_of_a_known_schedule():
    # SM 0: a 2-tile block (span 1154 cycles = 577 ns) at t=0, then a 4-tile block (2158
    # cycles = 1079 ns) 123 ns after the first ends; SM 1: one 4-tile block at t=100.
    blocks = [block(0, 0, 2), block(0, 700, 4), block(1, 100, 4)]
    s = summarize(dumped(blocks), warpgroups=WARPGROUPS, clock_ghz=GHZ)
    assert (span(2), span(4)) == (1154, 2158)
    assert s["blocks"] == 3 and s["sms"] == 2
    assert s["block_span_cycles"]["mean"] == pytest.approx((1154 + 2158 + 2158) / 3)
    phases = s["warpgroups"][0]["phases"]
    assert phases["qk"]["cycles_per_block"] == pytest.approx(300 * (2 + 4 + 4) / 3)
    assert phases["pv"]["cycles_per_block"] == pytest.approx(200 * 10 / 3)
    assert phases["wait_q"]["cycles_per_block"] == pytest.approx(100)
    assert s["warpgroups"][2]["phases"]["copy"]["cycles_per_block"] == pytest.approx(200 / 3)
    # wall: 0 .. max(700 + 1079, 100 + 1079) ns
    assert s["kernel_wall_us"] == pytest.approx(1.779)
    assert s["gap_between_blocks_ns"]["mean"] == pytest.approx(123)
    busy0 = (577 + 1079) / 1779
    busy1 = 1079 / 1779
    assert s["sm_busy_fraction"] == pytest.approx((busy0 + busy1) / 2)
    text = format_summary(s)
    assert "3 blocks on 2 SMs" in text and "wg0" in text and "qk 1000" in text


def test_profiled_summary_reads_the_trace_the_call_wrote(tmp_path):
    """The newest trace under the directory after the call, summarized; None without one (the
    directory is made first, as the profiler needs it)."""
    from bench.kernel_trace import profiled_summary

    trace_dir = tmp_path / "traces"
    assert profiled_summary(lambda: None, str(trace_dir)) is None
    assert trace_dir.is_dir()

    def write():
        with open(trace_dir / "call-trace.json", "w") as f:
            json.dump({"traceEvents": dumped([block(0, 0, 3), block(1, 0, 3)])}, f)

    summary, path = profiled_summary(write, str(trace_dir), clock_ghz=GHZ)
    assert path == str(trace_dir / "call-trace.json")
    assert summary == summarize(dumped([block(0, 0, 3), block(1, 0, 3)]), clock_ghz=GHZ)
    assert summary["blocks"] == 2
