"""bench.ptxas_report: the ptxas report parser against real ptxas 13.0 output, the PTX's
setmaxnreg budgets, case names, and a run on a host without a GPU (each case recorded as
failed, nothing raised)."""

from __future__ import annotations

import json

import pytest

from bench.ptxas_report import main, parse_case, parse_ptxas, setmaxnreg_values

# ptxas 13.0 -v on the bf16 decode kernel (384 threads; budgets 40 / 232 / 232)
_KERNEL = "'mla_decode_mgpu_ps64_mosaic_gpu_kernel'"
HONOURED = (
    f"ptxas warning : Registers are spilled to local memory in function {_KERNEL}, "
    "232 bytes spill stores, 228 bytes spill loads\n"
    "ptxas info    : 0 bytes gmem\n"
    f"ptxas info    : Compiling entry function {_KERNEL} for 'sm_90a'\n"
    "ptxas info    : Function properties for mla_decode_mgpu_ps64_mosaic_gpu_kernel\n"
    "    208 bytes stack frame, 232 bytes spill stores, 228 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers, 208 bytes cumulative stack size, "
    "1 bytes smem\n")
# ... and on a variant whose budgets (216 / 144 / 144) ptxas could not honour
IGNORED = (
    "ptxas info    : (C7507) Potential Performance Loss: 'setmaxnreg' ignored to maintain "
    "minimum register requirements.\n"
    "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
    f"serialized due to insufficient register resources for the function {_KERNEL}\n"
    f"ptxas warning : Registers are spilled to local memory in function {_KERNEL}, "
    "428 bytes spill stores, 528 bytes spill loads\n"
    "    328 bytes stack frame, 428 bytes spill stores, 528 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers, 328 bytes cumulative stack size, "
    "1 bytes smem\n")


def test_parses_registers_spills_and_notes():
    assert parse_ptxas(HONOURED) == {
        "registers": 168, "stack_frame_bytes": 208, "spill_store_bytes": 232,
        "spill_load_bytes": 228, "setmaxnreg_ignored": False, "wgmma_serialized": False}
    got = parse_ptxas(IGNORED)
    assert got["setmaxnreg_ignored"] and got["wgmma_serialized"]
    assert (got["spill_store_bytes"], got["spill_load_bytes"]) == (428, 528)
    clean = parse_ptxas("ptxas info    : Used 90 registers, used 1 barriers\n")
    assert clean["registers"] == 90 and clean["spill_store_bytes"] == 0
    assert clean["stack_frame_bytes"] is None


def test_setmaxnreg_values_in_order():
    ptx = ("\tsetmaxnreg.dec.sync.aligned.u32 40;\n\tbar.sync 0;\n"
           "\tsetmaxnreg.inc.sync.aligned.u32 232;\n")
    assert setmaxnreg_values(ptx) == [("dec", 40), ("inc", 232)]
    assert setmaxnreg_values("\tbar.sync 0;\n") == []


@pytest.mark.parametrize("name, want", [("bf16_h128_p64", ("bf16", 128, 64)),
                                        ("fp8products_h128_p1", ("fp8products", 128, 1))])
def test_case_names(name, want):
    assert parse_case(name) == want


def test_bad_case_name_is_named():
    with pytest.raises(ValueError, match="fp16_h16_p64"):
        parse_case("fp16_h16_p64")


def test_no_gpu_records_the_failure(tmp_path):
    """On CPU the compile fails in the child (Mosaic GPU needs a GPU): main returns 1 and the
    JSON names the case and the child's error."""
    assert main(["--cases", "bf16_h128_p64", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "ptxas_report.json").read_text())
    assert rows[0]["case"] == "bf16_h128_p64" and rows[0]["returncode"] != 0
    assert "interpret mode" in rows[0]["error"] and rows[0]["kernels"] == {}


def test_loops_without_the_cuda_binaries_say_why(tmp_path, monkeypatch):
    """Without ptxas or nvdisasm (a CPU host without Triton) a kernel's loops are not read, and
    the report says so rather than failing."""
    import bench.ptxas_report as report

    monkeypatch.setattr(report, "find_tool", lambda name: None)
    ptx = tmp_path / "k.ptx"
    ptx.write_text("// empty\n")
    assert report.kernel_loops(str(ptx)) == {"loops_error": "ptxas or nvdisasm not found"}
