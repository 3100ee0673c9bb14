"""Benchmark verdicts: bench.decode_targets (issue #5's targets judged from benchmark rows,
restated by hand here) and bench.prefill's choice of the ratio's baseline."""

import json
import re

import pytest

from bench.decode_targets import main, target_verdicts


def _row(h, b, ctx, page_size, *, us, pct=50.0, tf=100.0, err=2e-3):
    return dict(heads=h, batch=b, ctx=ctx, page_size=page_size, time_us=us, pct_ceiling=pct,
                tflops=tf, rel_err=err)


ROWS = [
    _row(16, 32, 4096, 1, us=44.6, pct=80.5),
    _row(16, 32, 4096, 64, us=43.8, pct=79.9),          # misses 80% by 0.1 point
    _row(16, 32, 1024, 64, us=20.0, pct=60.0),          # ctx 1k: outside the 80% target
    _row(128, 128, 4096, 1, us=280.0, tf=541.0),
    _row(128, 128, 4096, 64, us=250.0, tf=580.0),       # p1/p64 = 1.12: misses the 10%
    _row(128, 32, 16384, 64, us=253.0, tf=576.0),       # no page-1 partner: no pair
    _row(128, 1, 4096, 1, us=19.6),
    _row(128, 1, 4096, 64, us=20.3, err=None),          # error not measured: not judged
    _row(16, 1, 4096, 64, us=11.6, err=0.02),           # error too large
]


def _by_target(rows):
    return {v["target"].split(":")[0]: v for v in target_verdicts(rows)}


def test_verdicts_restate_each_target():
    v = _by_target(ROWS)
    ceil = v["H16, B >= 32, ctx >= 4k"]
    assert (ceil["measured"], ceil["passed"], ceil["met"]) == (2, 1, False)
    assert ceil["worst"] == dict(case="H16 B32 L4096 p64", value=79.9, ok=False)

    tf = v["H128, B >= 32, ctx >= 4k"]
    assert (tf["measured"], tf["passed"], tf["met"]) == (3, 2, False)
    assert tf["worst"]["case"] == "H128 B128 L4096 p1"

    b1 = v["batch 1, ctx 4k"]
    assert (b1["measured"], b1["passed"]) == (3, 2)
    assert b1["worst"] == dict(case="H128 B1 L4096 p64", value=20.3, ok=False)

    pairs = v["page 1 within 10% of page 64"]
    got = {c["case"]: round(c["value"], 4) for c in pairs["cases"]}
    assert got == {"H16 B32 L4096 p1/p64": round(44.6 / 43.8, 4),
                   "H128 B128 L4096 p1/p64": 1.12,
                   "H128 B1 L4096 p1/p64": round(19.6 / 20.3, 4)}
    assert pairs["passed"] == 2 and not pairs["met"]

    err = v["rel err < 1e-2 vs float32"]
    assert (err["measured"], err["passed"]) == (8, 7)
    assert err["worst"]["value"] == 0.02


def test_all_met_and_unmeasured():
    good = [_row(16, 32, 4096, 1, us=44.0, pct=81.0), _row(16, 32, 4096, 64, us=43.0, pct=82.0)]
    v = _by_target(good)
    assert v["H16, B >= 32, ctx >= 4k"]["met"]
    assert v["page 1 within 10% of page 64"]["met"]
    # No 128-head or batch-1 case: not measured is never "met".
    assert v["H128, B >= 32, ctx >= 4k"]["measured"] == 0
    assert not v["H128, B >= 32, ctx >= 4k"]["met"]
    assert v["batch 1, ctx 4k"]["worst"] is None


def test_cli_reads_a_saved_run(tmp_path, capsys):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"grid": ROWS}))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "550 TFLOP/s: NOT met (2 of 3; worst H128 B128 L4096 p1 541 TFLOP/s)" in out
    assert main([]) == 2


def test_prefill_table_takes_the_extend_rows(monkeypatch):
    """bench.prefill's extend group: bench.extend's rows in the prefill table's schema (its
    timing code needs a GPU; the mapping and the line format do not)."""
    import types

    import bench.extend as extend_mod
    import bench.prefill as prefill_mod

    row = dict(case="H128 B8 q1024 kv5120 p64", kernel="mgpu", time_us=17883.0, tflops=588.0,
               decode_baseline_us=17500.0, decode_baseline_tflops=595.4,
               vs_decode_baseline=588.0 / 595.4, rel_err=1.75e-3)
    seen = {}

    def fake_rows(**kw):
        seen.update(kw)
        return [row]

    monkeypatch.setattr(extend_mod, "extend_rows", fake_rows)
    monkeypatch.setattr(extend_mod, "target_verdicts", lambda rows: [("450 TFLOP/s", "met")])
    args = types.SimpleNamespace(reps=10, only="H128", time_limit=None)
    (got,) = prefill_mod.extend_group_rows(args)
    assert seen == dict(reps=3, only="H128", time_limit_s=None)
    assert (got["group"], got["case"], got["config"]) == ("extend", row["case"], "mgpu")
    assert (got["us"], got["tflops"], got["baseline_us"]) == (17883.0, 588.0, 17500.0)
    assert got["targets"] == "450 TFLOP/s: met"
    line = prefill_mod.fmt(got)
    assert "588.0 TFLOP/s" in line and "decode kernel 17500.0 us" in line
    assert [name for name, _ in prefill_mod.case_groups()] == ["mha", "extend"]


def test_fp8_verdicts_judge_both_products_against_their_own_targets():
    """bench.decode_fp8: default products against #23's targets (bf16's time where none is
    set) and < 1e-2; the all-fp8 path against <= 600 us at H128 B128 16k and its own error
    bound; other variants are not judged."""
    from bench.decode_fp8 import FP8_PRODUCTS_ERR, fp8_verdicts

    def fp8(h, b, ctx, us, err, variant=None):
        return dict(_row(h, b, ctx, 64, us=us, err=err), kv_dtype="fp8", variant=variant)

    rows = [dict(_row(128, 128, 16384, 64, us=940.0), kv_dtype="bf16", variant=None),
            fp8(128, 128, 16384, 1590.0, 2.5e-3),
            fp8(128, 128, 16384, 590.0, 3e-2, "fp8_products=fp8"),
            fp8(128, 128, 16384, 100.0, 3e-3, "kernel=triton"),
            dict(_row(128, 32, 4096, 64, us=71.0), kv_dtype="bf16", variant=None),
            fp8(128, 32, 4096, 70.0, FP8_PRODUCTS_ERR * 1.1, "fp8_products=fp8"),
            fp8(16, 128, 16384, 299.0, 2e-3)]
    got = {(v["case"], v["products"]): v for v in fp8_verdicts(rows)}
    assert len(got) == 4
    mixed = got[("H128 B128 L16384 p64", "mixed")]
    assert (mixed["target_us"], mixed["time_ok"], mixed["err_ok"]) == (940.0, False, True)
    fast = got[("H128 B128 L16384 p64", "fp8")]
    assert (fast["target_us"], fast["time_ok"], fast["err_ok"]) == (600.0, True, True)
    small = got[("H128 B32 L4096 p64", "fp8")]
    assert (small["target_us"], small["time_ok"], small["err_ok"]) == (71.0, True, False)
    h16 = got[("H16 B128 L16384 p64", "mixed")]
    assert (h16["target_us"], h16["time_ok"], h16["err_bound"]) == (300.0, True, 1e-2)


def test_prefill_ratio_baseline_reads_the_kernels_own_layout():
    """bench.prefill: the ratio's baseline is the fastest that reads the kernel's token-major
    inputs; a faster one on head-major copies (a layout change the caller would pay for) is
    only reported beside it."""
    from bench.prefill import HEAD_MAJOR, fastest_baselines

    base = {"cudnn_batched": 2045.4, "cudnn_per_request": 2554.1, "torch_cudnn": 2101.0,
            "torch_flash": 3209.6, "torch_cudnn" + HEAD_MAJOR: 1537.2,
            "torch_flash" + HEAD_MAJOR: 3000.0}
    assert fastest_baselines(base) == ("cudnn_batched", "torch_cudnn" + HEAD_MAJOR,
                                       "cudnn_per_request")
    assert fastest_baselines({"torch_cudnn": 1.0}) == ("torch_cudnn", None, None)
    assert fastest_baselines({}) == (None, None, None)


def test_prefill_16_requests_are_judged_against_the_requests_one_by_one():
    """The issue's 16 x 1k ratio target is against "the baseline running the same requests one
    by one padded": `ratio_one_by_one` decides it, the batched call's `ratio` does not; one
    request is judged on `ratio` (there is no other way to run it)."""
    from bench.prefill import PER_REQUEST, fastest_baselines, verdict

    base = {"cudnn_batched": 280.0, "torch_cudnn": 200.0,
            "torch_cudnn" + PER_REQUEST: 400.0, "cudnn" + PER_REQUEST: 500.0}
    assert fastest_baselines(base)[::2] == ("torch_cudnn", "torch_cudnn" + PER_REQUEST)
    row = dict(case="causal 16x1k H16", tflops=300.0, ratio=200.0 / 320.0,
               ratio_one_by_one=400.0 / 320.0, rel_err=2e-3)
    assert verdict(row) == "met"
    assert verdict(dict(row, ratio_one_by_one=0.85)) == (
        "missed: x0.850 < x0.9 of the baseline one by one")
    assert verdict(dict(row, ratio_one_by_one=None)).startswith("missed: x0.000")
    h128 = dict(row, case="causal 16x1k H128", tflops=336.0)
    assert verdict(h128) == "missed: 336 < 400 TFLOP/s"
    one = dict(case="causal 1x16k H128", tflops=632.5, ratio=0.94, rel_err=2e-3)
    assert verdict(one) == "missed: x0.940 < x0.95 of the baseline"
    assert verdict(dict(one, ratio=1.13, rel_err=2e-2)) == "missed: error 2.0e-02 >= 0.01"


def test_prefill_shapes_option():
    """bench.prefill --shapes: causal cases named as the MHA cases; a malformed entry is
    named."""
    from bench.prefill import parse_shapes

    assert parse_shapes("128:16x1024, 16:2x8192") == [
        ("causal 16x1024 H128", 128, [1024] * 16, True),
        ("causal 2x8192 H16", 16, [8192] * 2, True)]
    for bad in ("128:16", "0:2x8", "h128:2x8"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_shapes(bad)
