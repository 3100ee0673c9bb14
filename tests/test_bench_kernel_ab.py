"""bench.kernel_ab's pieces that run without a GPU: a module loaded from a git revision, the
swap of its public names into the live module (and back), and the case names."""

from __future__ import annotations

import subprocess

import pytest

from bench import kernel_ab
from funcmla.attention.pallas import decode_mgpu_fp8

MODULE = "funcmla.attention.pallas.decode_mgpu_fp8"


def _in_git_checkout() -> bool:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                              cwd=kernel_ab.os.path.dirname(decode_mgpu_fp8.__file__)
                              ).returncode == 0
    except FileNotFoundError:
        return False


needs_git = pytest.mark.skipif(not _in_git_checkout(), reason="not a git checkout")


@needs_git
def test_module_at_revision_is_a_separate_module_with_that_source():
    base = kernel_ab.module_at_revision(MODULE, "HEAD")
    assert base is not decode_mgpu_fp8
    assert base.decode_call is not decode_mgpu_fp8.decode_call
    assert base.__file__.startswith("HEAD:") and base.__file__.endswith("decode_mgpu_fp8.py")
    assert [base.latent_column(m) for m in range(512)] == [
        decode_mgpu_fp8.latent_column(m) for m in range(512)]


@needs_git
def test_swapped_replaces_the_public_names_and_restores_them():
    base = kernel_ab.module_at_revision(MODULE, "HEAD")
    live_call, live_rows = decode_mgpu_fp8.decode_call, decode_mgpu_fp8.BLOCK_ROWS
    with kernel_ab.swapped(decode_mgpu_fp8, base) as names:
        assert "decode_call" in names
        assert decode_mgpu_fp8.decode_call is base.decode_call
    assert decode_mgpu_fp8.decode_call is live_call and decode_mgpu_fp8.BLOCK_ROWS == live_rows
    with pytest.raises(RuntimeError):
        with kernel_ab.swapped(decode_mgpu_fp8, base):
            raise RuntimeError("a failing case")
    assert decode_mgpu_fp8.decode_call is live_call


@needs_git
def test_module_at_an_unknown_revision_names_it():
    with pytest.raises(ValueError, match="no-such-rev"):
        kernel_ab.module_at_revision(MODULE, "no-such-rev")


def test_module_from_file_loads_that_source_apart(tmp_path):
    """--base-file: the baseline from a file (a checkout without git history)."""
    path = tmp_path / "base.py"
    path.write_text("__all__ = ['BLOCK_ROWS']\nBLOCK_ROWS = 7\n")
    base = kernel_ab.module_from_file(MODULE, str(path), "e75e8f7")
    assert base.BLOCK_ROWS == 7 and decode_mgpu_fp8.BLOCK_ROWS != 7
    assert base.__file__ == f"e75e8f7:{path}"
    with kernel_ab.swapped(decode_mgpu_fp8, base):
        assert decode_mgpu_fp8.BLOCK_ROWS == 7
    assert decode_mgpu_fp8.BLOCK_ROWS != 7
    with pytest.raises(ValueError, match="no-such-file"):
        kernel_ab.module_from_file(MODULE, str(tmp_path / "no-such-file.py"), "x")


def test_case_names():
    assert kernel_ab.parse_case("h16_b32_ctx4k_p64") == (16, 32, 4096, 64)
    assert kernel_ab.parse_case("h128_b1_ctx16k_p1") == (128, 1, 16384, 1)
    with pytest.raises(ValueError, match="h16_b32_ctx4000_p64"):
        kernel_ab.parse_case("h16_b32_ctx4000_p64")


@needs_git
def test_main_times_each_variant_with_its_own_module(monkeypatch, tmp_path):
    """main() with bench_case replaced by a stand-in that reports which decode_call the live
    module holds at call time: REV's rounds must see REV's function, the tree's its own."""
    import json

    from bench import decode_case

    live_call = decode_mgpu_fp8.decode_call
    seen = []

    def fake_bench_case(key, h, b, ctx, page, ceiling, reps, config, **kw):
        tree = decode_mgpu_fp8.decode_call is live_call
        seen.append(tree)
        return dict(time_us=10.0 if tree else 20.0, rel_err=1e-3, kernel="mgpu", num_splits=1)

    monkeypatch.setattr(decode_case, "bench_case", fake_bench_case)
    assert kernel_ab.main(["--rev", "HEAD", "--cases", "h16_b32_ctx4k_p64", "--rounds", "2",
                           "--out", str(tmp_path)]) == 0
    assert seen == [True, False, False, True]  # the first of a round alternates
    assert decode_mgpu_fp8.decode_call is live_call
    (case,) = json.loads((tmp_path / "kernel_ab.json").read_text())["cases"]
    assert case["times_us"] == {"tree": [10.0, 10.0], "rev": [20.0, 20.0]}
    assert case["ratio"] == 0.5


def test_a_run_cut_short_keeps_the_cases_it_finished(monkeypatch, tmp_path):
    """kernel_ab.json is rewritten after every case: when the second case fails (as a time
    limit cuts a device run), the file holds the first one."""
    import json

    from bench import decode_case

    def fake_bench_case(key, h, b, ctx, page, ceiling, reps, config, **kw):
        if ctx == 16384:
            raise TimeoutError("cut")
        return dict(time_us=10.0, rel_err=1e-3, kernel="mgpu", num_splits=1)

    monkeypatch.setattr(decode_case, "bench_case", fake_bench_case)
    with pytest.raises(TimeoutError):
        kernel_ab.main(["--rev", "HEAD", "--cases", "h16_b32_ctx4k_p64,h16_b32_ctx16k_p64",
                        "--rounds", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "kernel_ab.json").read_text())
    assert [c["case"] for c in data["cases"]] == ["h16_b32_ctx4k_p64"]
    assert data["info"]["rounds"] == 1 and not (tmp_path / "kernel_ab.json.tmp").exists()


def test_prefill_case_names():
    assert kernel_ab.parse_prefill_case("prefill_h16_16x1k") == (16, 16, 1024)
    assert kernel_ab.parse_prefill_case("prefill_h128_1x16k") == (128, 1, 16384)
    with pytest.raises(ValueError, match="prefill_h16_16x1000"):
        kernel_ab.parse_prefill_case("prefill_h16_16x1000")


@needs_git
def test_swap_reaches_the_modules_that_imported_a_name(monkeypatch, tmp_path):
    """`prefill` imports `prefill_kernel` by name: swapping `prefill_mgpu` must reach it there
    (and put it back), and main() must time REV's rounds with REV's kernel."""
    import json

    from funcmla.attention.pallas import prefill, prefill_mgpu

    live = prefill_mgpu.prefill_kernel
    assert prefill.prefill_kernel is live
    base = kernel_ab.module_at_revision(kernel_ab.PREFILL_MODULE, "HEAD")
    with kernel_ab.swapped(prefill_mgpu, base):
        assert prefill.prefill_kernel is base.prefill_kernel is prefill_mgpu.prefill_kernel
        assert prefill.MgpuPrefillConfig is base.MgpuPrefillConfig
    assert prefill.prefill_kernel is live and prefill_mgpu.prefill_kernel is live

    seen = []

    def fake_runner(args, h, n, tokens):
        assert (h, n, tokens) == (16, 16, 1024)

        def run(variant):
            tree = prefill.prefill_kernel is live
            assert tree == (variant == "tree")
            seen.append(tree)
            return (100.0 if tree else 80.0), 2e-3, "kv128_s2_pp"
        return run

    monkeypatch.setattr(kernel_ab, "prefill_runner", fake_runner)
    assert kernel_ab.main(["--rev", "HEAD", "--module", kernel_ab.PREFILL_MODULE,
                           "--cases", "prefill_h16_16x1k", "--rounds", "2",
                           "--out", str(tmp_path)]) == 0
    assert seen == [True, False, False, True]  # the first of a round alternates
    (case,) = json.loads((tmp_path / "kernel_ab.json").read_text())["cases"]
    assert (case["heads"], case["requests"], case["tokens"]) == (16, 16, 1024)
    assert case["ratio"] == 1.25


def test_parse_setting_reads_a_literal_and_names_a_bad_argument():
    assert kernel_ab.parse_setting("_PROMOTE=576") == ("_PROMOTE", 576)
    assert kernel_ab.parse_setting(" INT_BLOCKS = (1, 3) ") == ("INT_BLOCKS", (1, 3))
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        kernel_ab.parse_setting("_PROMOTE")
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        kernel_ab.parse_setting("1x=2")
    with pytest.raises(ValueError, match="'_PROMOTE=big'.*Python literal"):
        kernel_ab.parse_setting("_PROMOTE=big")


def test_settings_applied_binds_and_restores_and_names_a_missing_constant():
    rows = decode_mgpu_fp8.BLOCK_ROWS
    with kernel_ab.settings_applied(decode_mgpu_fp8, [("BLOCK_ROWS", 3)]):
        assert decode_mgpu_fp8.BLOCK_ROWS == 3
    assert decode_mgpu_fp8.BLOCK_ROWS == rows
    with pytest.raises(RuntimeError):
        with kernel_ab.settings_applied(decode_mgpu_fp8, [("BLOCK_ROWS", 3)]):
            raise RuntimeError("a failing case")
    assert decode_mgpu_fp8.BLOCK_ROWS == rows
    with pytest.raises(ValueError, match="decode_mgpu_fp8 has no NO_SUCH_KNOB"):
        with kernel_ab.settings_applied(decode_mgpu_fp8, [("BLOCK_ROWS", 3),
                                                          ("NO_SUCH_KNOB", 1)]):
            pass
    assert decode_mgpu_fp8.BLOCK_ROWS == rows  # nothing bound before the check


def test_main_with_set_times_the_knob_against_the_module_as_it_is(monkeypatch, tmp_path):
    """--set without a revision: the tree's rounds see the rebound constant, the baseline's
    the module's own value (or --base-set's); a constant the module lacks is refused before
    any case runs."""
    import json

    from bench import decode_case

    rows = decode_mgpu_fp8.BLOCK_ROWS
    seen = []

    def fake_bench_case(key, h, b, ctx, page, ceiling, reps, config, **kw):
        seen.append(decode_mgpu_fp8.BLOCK_ROWS)
        return dict(time_us=9.0 if decode_mgpu_fp8.BLOCK_ROWS == 5 else 10.0, rel_err=1e-3,
                    kernel="mgpu", num_splits=1)

    monkeypatch.setattr(decode_case, "bench_case", fake_bench_case)
    assert kernel_ab.main(["--set", "BLOCK_ROWS=5", "--cases", "h16_b32_ctx4k_p64",
                           "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert seen == [5, rows, rows, 5]  # the first of a round alternates
    assert decode_mgpu_fp8.BLOCK_ROWS == rows
    data = json.loads((tmp_path / "kernel_ab.json").read_text())
    assert data["info"]["set"] == ["BLOCK_ROWS=5"] and data["info"]["rev"] == "as is"
    assert data["cases"][0]["ratio"] == 0.9
    seen.clear()
    assert kernel_ab.main(["--set", "BLOCK_ROWS=5", "--base-set", "BLOCK_ROWS=6", "--cases",
                           "h16_b32_ctx4k_p64", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert seen == [5, 6] and decode_mgpu_fp8.BLOCK_ROWS == rows
    data = json.loads((tmp_path / "kernel_ab.json").read_text())
    assert data["info"]["rev"] == "with BLOCK_ROWS=6"
    assert data["info"]["base_set"] == ["BLOCK_ROWS=6"]
    seen.clear()
    with pytest.raises(SystemExit):  # --base-set rebinds the live module: not with --rev
        kernel_ab.main(["--rev", "HEAD", "--base-set", "BLOCK_ROWS=6", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="no NO_SUCH_KNOB"):
        kernel_ab.main(["--set", "BLOCK_ROWS=5", "--base-set", "NO_SUCH_KNOB=1", "--cases",
                        "h16_b32_ctx4k_p64", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="no NO_SUCH_KNOB"):
        kernel_ab.main(["--set", "NO_SUCH_KNOB=1", "--cases", "h16_b32_ctx4k_p64",
                        "--out", str(tmp_path)])
    assert seen == []
    with pytest.raises(SystemExit):
        kernel_ab.main(["--cases", "h16_b32_ctx4k_p64", "--out", str(tmp_path)])


@needs_git
def test_an_unchanged_config_class_stays_the_live_one():
    """`api.mla_decode_rows_mgpu`'s default `config=MgpuDecodeConfig()` was made from the live
    class at import: with `decode_mgpu` swapped for REV's, the isinstance check it runs must
    still accept it (a second class of the same name refused every call)."""
    import inspect

    from funcmla.attention.pallas import api, decode_mgpu

    live_cls = decode_mgpu.MgpuDecodeConfig
    default = inspect.signature(api.mla_decode_rows_mgpu).parameters["config"].default
    base = kernel_ab.module_at_revision("funcmla.attention.pallas.decode_mgpu", "HEAD")
    with kernel_ab.swapped(decode_mgpu, base) as names:
        assert "MgpuDecodeConfig" in names and decode_mgpu.decode_call is base.decode_call
        assert base.MgpuDecodeConfig is live_cls is api.MgpuDecodeConfig
        assert isinstance(default, api.MgpuDecodeConfig)
    assert decode_mgpu.MgpuDecodeConfig is live_cls


def test_a_changed_config_class_is_swapped(tmp_path):
    """A baseline whose config has other fields keeps its own class for its rounds."""
    path = tmp_path / "base.py"
    path.write_text("import dataclasses\n__all__ = ['MgpuDecodeConfig']\n"
                    "@dataclasses.dataclass(frozen=True)\nclass MgpuDecodeConfig:\n"
                    "    other: int = 1\n")
    from funcmla.attention.pallas import decode_mgpu

    live_cls = decode_mgpu.MgpuDecodeConfig
    base = kernel_ab.module_from_file("funcmla.attention.pallas.decode_mgpu", str(path), "x")
    with kernel_ab.swapped(decode_mgpu, base):
        assert decode_mgpu.MgpuDecodeConfig is base.MgpuDecodeConfig is not live_cls
    assert decode_mgpu.MgpuDecodeConfig is live_cls


@pytest.mark.parametrize("module, pool", [
    ("funcmla.attention.pallas.decode_mgpu", "bf16"),
    ("funcmla.attention.pallas.decode_mgpu_fp8_wide", "fp8"),
])
def test_the_pool_dtype_follows_the_module_unless_given(monkeypatch, tmp_path, module, pool):
    """A bf16 kernel's module is timed on a bf16 pool (an fp8 pool would run another module's
    kernel), an fp8 one's on an fp8 pool; --kv-dtype overrides."""
    from bench import decode_case
    from bench.decode_fp8 import KV_SCALE

    scales = []

    def fake_bench_case(key, h, b, ctx, page, ceiling, reps, config, **kw):
        scales.append(kw["kv_scale"])
        return dict(time_us=10.0, rel_err=1e-3, kernel="mgpu", num_splits=1)

    monkeypatch.setattr(decode_case, "bench_case", fake_bench_case)
    args = ["--set", "BLOCK_M=64", "--module", module, "--cases", "h128_b32_ctx4k_p64",
            "--rounds", "1", "--out", str(tmp_path)]
    assert kernel_ab.main(args) == 0
    assert scales == [KV_SCALE if pool == "fp8" else None] * 2
    scales.clear()
    other = "bf16" if pool == "fp8" else "fp8"
    assert kernel_ab.main(args + ["--kv-dtype", other]) == 0
    assert scales == [KV_SCALE if other == "fp8" else None] * 2
