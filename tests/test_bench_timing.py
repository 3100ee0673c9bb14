"""bench.timing.trace_kernel_stats: kernel sums and per-call spans from profiler trace events."""

import pytest

from bench.timing import trace_kernel_stats


def _trace(calls):
    """Perfetto-style events: a GPU process with the given kernels per call, a host process
    with an event that must be ignored. calls: list of [(start_us, dur_us, name), ...]."""
    events = [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 1, "ts": 0.0, "dur": 1e6, "name": "python"}]
    for call in calls:
        events += [{"ph": "X", "pid": 7, "tid": 3, "ts": t, "dur": d, "name": n}
                   for t, d, n in call]
    return events


def test_sums_spans_and_per_kernel_rows():
    # 3 calls 100 us apart; in each: a 2 us kernel, a 1 us gap, a 5 us kernel (span 8 us),
    # except the last, whose second kernel is 7 us (span 10 us).
    calls = [[(100.0 * i, 2.0, "prep"), (100.0 * i + 3.0, 5.0 if i < 2 else 7.0, "main")]
             for i in range(3)]
    got = trace_kernel_stats(_trace(calls), reps=3)
    assert got["kernels_per_call"] == 2
    assert got["busy_us_per_call"] == pytest.approx((2 + 5 + 2 + 5 + 2 + 7) / 3)
    assert got["span_us"] == pytest.approx(8.0)  # median of 8, 8, 10
    assert [k["name"] for k in got["kernels"]] == ["main", "prep"]
    assert got["kernels"][0]["median_us"] == 5.0 and got["kernels"][0]["per_call"] == 1


def test_unsorted_events_and_a_single_call():
    calls = [[(50.0, 4.0, "b"), (10.0, 1.0, "a"), (30.0, 2.0, "a")]]
    got = trace_kernel_stats(_trace(calls), reps=1)
    assert got["span_us"] == pytest.approx(44.0) and got["kernels_per_call"] == 3


def test_no_device_events():
    assert trace_kernel_stats(_trace([]), reps=5) is None


def test_primed_calls_are_cut_at_the_prime_kernels():
    # Each call is queued behind a long prime kernel: calls are split there, primes left out.
    # The gap inside call 2 (20 us) is larger than the gap between calls' kernels and the next
    # prime, so cutting at the largest gaps would split it wrongly.
    calls = [[(0.0, 500.0, "bench_queue_prime_kernel"), (500.5, 2.0, "prep"),
              (503.0, 5.0, "main")],
             [(509.0, 500.0, "bench_queue_prime_kernel"), (1009.5, 2.0, "prep"),
              (1031.5, 5.0, "main")]]
    got = trace_kernel_stats(_trace(calls), reps=2, prime_name="bench_queue_prime")
    assert got["kernels_per_call"] == 2
    assert got["busy_us_per_call"] == pytest.approx(7.0)
    assert got["span_us"] == pytest.approx((7.5 + 27.0) / 2)
    assert {k["name"] for k in got["kernels"]} == {"prep", "main"}
