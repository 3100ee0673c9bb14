"""`funcmla demo` in-process on a small trace: every verdict passes, and each part reports what
the demo claims (identical outputs across page sizes, the legacy prefill pairing refused and
wrong when forced, the block-granular buffer overflow reported)."""

from __future__ import annotations

import json

import pytest

from funcmla.demo import run_demo
from funcmla.simulate import SimulationConfig

PAGE_SIZES = (1, 64)  # the smallest and the largest page size of the full demo (1, 16, 64)


@pytest.mark.slow  # ~45 s of CPU, nearly all XLA compiles of the chain at two page sizes
def test_demo_on_a_small_trace_passes(capsys):
    small = SimulationConfig(num_requests=4, use_plans=True)
    status = run_demo(page_sizes=PAGE_SIZES, as_json=True, progress=False, simulation=small)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0 and report["ok"] is True
    assert all(report["verdicts"].values()), report["verdicts"]
    assert len(report["verdicts"]) == 8

    trace = report["trace"]
    assert trace["outputs_identical"] is True and trace["max_output_diff"] == 0.0
    assert [s["page_size"] for s in trace["summary"]] == list(PAGE_SIZES)
    assert all(s["plan_works"] > 0 and s["max_rel_err"] < 1e-5 for s in trace["summary"])

    legacy = [c for c in report["seed_prefill"] if c["pairing"] == "legacy"]
    assert len(legacy) == 1 and legacy[0]["page_size"] == 64 and legacy[0]["block_size"] == 64
    assert "does not match the metadata" in legacy[0]["refused"]
    assert legacy[0]["num_problems"] > 0 and legacy[0]["rel_err"] > 0.1
    fixed = [c for c in report["seed_prefill"] if c["pairing"] == "fixed"]
    assert {c["page_size"] for c in fixed} == set(PAGE_SIZES)
    assert all(c["block_size"] == 1 and c["refused"] is None for c in fixed)
    assert all(c["rel_err"] < 1e-5 and c["num_problems"] == 0 for c in fixed)

    buf = report["seed_buffer"]
    assert "exceed the buffer capacity" in buf["legacy_blocks"]["error"]
    assert buf["legacy_blocks"]["live_tokens"] > buf["legacy_blocks"]["capacity"]
    assert buf["token_granular"]["error"] is None
