"""The check shared by the GPU tests of the kernels' in-kernel profiler: the profiled call's
outputs are the plain call's bits, and its trace names the kernel's phases."""

import json

import jax
import numpy as np


def assert_profiled_like_plain(profiled, plain, trace_dir, phases: set[str]) -> list[dict]:
    """profiled / plain: the outputs of one call with and one without the profiler; trace_dir:
    the profiler's `profile_dir` (a pathlib.Path); phases: named scopes the trace must hold.
    Returns the trace's events."""
    jax.effects_barrier()
    for a, b in zip(profiled, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    traces = list(trace_dir.glob("*.json"))
    assert traces, "no trace written"
    events = json.load(open(traces[0]))["traceEvents"]
    missing = phases - {e["name"] for e in events}
    assert not missing, missing
    return events
