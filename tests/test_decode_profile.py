"""`bench.decode_profile`: the split count that keeps a profiled block's trace within the
profiler's space, the kernel names, and the per-tile view of a summary (a trace written by
Mosaic GPU's own writer). The profiled runs themselves need a GPU (`pytest -m gpu`)."""

import pytest

from bench import decode_profile
from bench.kernel_trace import summarize
from funcmla.attention.pallas import decode_mgpu, decode_mgpu_fp8, decode_mgpu_fp8_wide
from funcmla.attention.pallas.decode_mgpu import MAX_PROFILE_SPACE

pytest.importorskip("jax.experimental.mosaic.gpu.profiler")
from tests.test_kernel_trace import GHZ, block, dumped  # noqa: E402


def test_a_profiled_block_never_records_more_regions_than_the_profiler_holds():
    """Past `profile_space` regions a warpgroup's trace is undefined behaviour, so every
    split's tiles x regions a tile + regions a block stays within it, and the split rule's
    count is kept where it already does."""
    most = decode_profile.max_profiled_tiles()
    assert (most * decode_profile.REGIONS_PER_TILE + decode_profile.REGIONS_PER_BLOCK
            <= MAX_PROFILE_SPACE)
    assert ((most + 1) * decode_profile.REGIONS_PER_TILE + decode_profile.REGIONS_PER_BLOCK
            > MAX_PROFILE_SPACE)
    for ctx in (1, 64, 1000, 1024, 4096, 16384, 100_000):
        for rule in (1, 2, 7, 64):
            splits = decode_profile.profile_splits(rule, ctx)
            tiles = -(-ctx // 64)
            assert splits >= rule
            assert -(-tiles // splits) <= most
            if -(-tiles // rule) <= most:
                assert splits == rule
    assert decode_profile.profile_splits(1, 16384) == -(-256 // most)


def test_kernel_names_pick_the_module_the_dispatch_rule_runs():
    assert decode_profile.kernel_call("bf16", 128) == (decode_mgpu, {}, False)
    assert decode_profile.kernel_call("fp8", 16) == (decode_mgpu_fp8, {}, True)
    assert decode_profile.kernel_call("fp8", 32) == (decode_mgpu_fp8, {}, True)  # row groups
    assert decode_profile.kernel_call("fp8", 128) == (decode_mgpu_fp8_wide, {}, True)
    assert decode_profile.kernel_call("fp8-products", 128) == (
        decode_mgpu_fp8_wide, {"products": "fp8"}, True)
    with pytest.raises(ValueError, match="'fp16' is not one of"):
        decode_profile.kernel_call("fp16", 128)


def test_unknown_kernel_or_case_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="'fp4' is not one of"):
        decode_profile.main(["--kernels", "bf16,fp4", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="h<heads>_b<batch>"):
        decode_profile.main(["--cases", "h128_b4", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_per_tile_view_divides_a_block_by_its_tiles():
    """A schedule of 4 tiles a block (qk 300 + pv 200 cycles each): per tile, qk 300 and pv
    200 on both consumers, and the span over the tiles."""
    s = summarize(dumped([block(0, 0, 4), block(1, 0, 4)]), clock_ghz=GHZ)
    text = decode_profile.format_per_tile(dict(s, tiles_per_block=4.0))
    lines = text.splitlines()
    assert "4.0 tiles a block" in lines[0]
    for wg in (0, 1):
        line = next(ln for ln in lines if ln.strip().startswith(f"wg{wg}:"))
        assert "qk 300" in line and "pv 200" in line, line
        assert line.strip().startswith(f"wg{wg}: {(100 + 502 * 4 + 50) / 4:.0f} a tile"), line


@pytest.mark.gpu
def test_gpu_profiles_every_kernel(tmp_path):
    """Each kernel's profiled call leaves a trace whose summary names its phases: the scores
    on consumer 0, P V on both consumers, the copies on the producer."""
    import json

    assert decode_profile.main(["--cases", "h128_b4_ctx1k_p64,h16_b4_ctx1k_p1", "--kernels",
                                "bf16,fp8,fp8-products", "--out", str(tmp_path)]) == 0
    report = json.load(open(tmp_path / "decode_profile.json"))
    # h16 has no 64-row block: bf16 and fp8-products refuse it by name
    assert {r["case"] + " " + r["kernel"] for r in report["rows"]} == {
        "h128_b4_ctx1k_p64 bf16", "h128_b4_ctx1k_p64 fp8", "h128_b4_ctx1k_p64 fp8-products",
        "h16_b4_ctx1k_p1 fp8"}
    assert set(report["errors"]) == {"h16_b4_ctx1k_p1 bf16", "h16_b4_ctx1k_p1 fp8-products"}
    for r in report["rows"]:
        wgs = r["warpgroups"]
        assert "qk" in wgs["0"]["phases"] and "pv" in wgs["1"]["phases"], r["kernel"]
        assert "copy" in wgs["2"]["phases"], r["kernel"]


def test_a_shape_a_kernel_does_not_take_is_named():
    assert "multiple of 64" in decode_profile.unsupported("bf16", 16, 64)
    assert "multiple of 64" in decode_profile.unsupported("fp8-products", 16, 64)
    assert decode_profile.unsupported("fp8", 16, 1) is None
    assert decode_profile.unsupported("fp8", 128, 64) is None
    assert "page size 96" in decode_profile.unsupported("bf16", 128, 96)
