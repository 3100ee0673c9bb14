"""What ptxas made of each Mosaic GPU decode kernel: registers, spills, and whether it honoured
the warpgroups' `setmaxnreg` budgets and kept the `wgmma`s asynchronous. No timing.

Each case compiles one kernel on a small problem in its own process, with Mosaic GPU's dump
switches on (`MOSAIC_GPU_DUMP_PTXAS`, `MOSAIC_GPU_DUMP_PTX`, `MOSAIC_GPU_DUMP_TO`), and the
report is read back from the dumped `.ptxas` file:

    python -m bench.ptxas_report --out out/                       # every case
    python -m bench.ptxas_report --cases bf16_h128_p64,fp8_h16_p1 --out out/

Cases are `<pool>_h<heads>_p<page size>`, pool one of bf16, fp8 (the fp8 Mosaic GPU kernel the
dispatch rule picks for the rows) and fp8products (`fp8_products="fp8"`). Where `ptxas` and
`nvdisasm` are found (on PATH, or the copies Triton bundles), each kernel's PTX is also built
into a cubin and disassembled, and the report gives each loop's spill loads and stores
(`bench.sass_loops`: a spill in a loop is reloaded every trip). Writes out/ptxas_report.json and
keeps each kernel's PTX (and SASS) under out/ptxas/<case>/, so that a change of register budget
can be tried offline (edit the `setmaxnreg` lines; `ptxas -v --gpu-name sm_90a kernel.ptx`).
Why it matters: a 384-thread block starts at 168 registers a thread, `setmaxnreg` moves
registers between its warpgroups (an increase is served only from the block's own decreases,
so the budgets sum to at most 3 x 168 = 504), and ptxas drops every budget (C7507) when one is
below what its warpgroup needs, or serializes `wgmma`s (C7512) when their accumulators do not
fit (docs/decode_kernel.md, "What limits 128 heads").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

from bench.sass_loops import loop_spills

__all__ = ["DEFAULT_CASES", "parse_case", "parse_ptxas", "setmaxnreg_values", "find_tool",
           "kernel_loops", "main"]

DEFAULT_CASES = ("bf16_h128_p64,bf16_h128_p1,fp8_h16_p64,fp8_h16_p1,fp8_h128_p64,"
                 "fp8products_h128_p64")
_CASE = re.compile(r"(bf16|fp8|fp8products)_h(\d+)_p(\d+)")
_BATCH, _CTX = 16, 1024  # 16 sequences: the 16-row fp8 kernel's dispatch floor


def parse_case(name: str) -> tuple[str, int, int]:
    """(pool, heads, page size) of a case name such as fp8_h16_p64."""
    m = _CASE.fullmatch(name)
    if m is None:
        raise ValueError(f"case {name!r} is not <bf16|fp8|fp8products>_h<heads>_p<page>, "
                         "e.g. fp8_h16_p64")
    return m.group(1), int(m.group(2)), int(m.group(3))


def parse_ptxas(text: str) -> dict:
    """The figures of one kernel's ptxas report (`ptxas -v` output): registers a thread at
    entry, stack frame and spill bytes, and the performance notes C7507 (setmaxnreg ignored)
    and C7512 (wgmma serialized)."""
    def number(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else None

    return {
        "registers": number(r"Used (\d+) registers"),
        "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores") or 0,
        "spill_load_bytes": number(r"(\d+) bytes spill loads") or 0,
        "setmaxnreg_ignored": "C7507" in text,
        "wgmma_serialized": "C7512" in text,
    }


def setmaxnreg_values(ptx: str) -> list[tuple[str, int]]:
    """The `setmaxnreg` instructions of a PTX file, in order: ("inc" | "dec", registers)."""
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]


def find_tool(name: str) -> str | None:
    """The path of CUDA binary `name` (ptxas, nvdisasm): on PATH, else the copy Triton bundles
    (`triton/backends/nvidia/bin`, installed beside jax on the GPU machines), else None."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def kernel_loops(ptx_path: str) -> dict:
    """{"loops": `bench.sass_loops.loop_spills` of the kernel} from its PTX (ptxas to a cubin,
    `nvdisasm -c` to a .sass kept beside it), or {"loops_error": why not}."""
    ptxas, nvdisasm = find_tool("ptxas"), find_tool("nvdisasm")
    if not (ptxas and nvdisasm):
        return {"loops_error": "ptxas or nvdisasm not found"}
    stem = ptx_path[:-len(".ptx")]
    build = subprocess.run([ptxas, "--gpu-name", "sm_90a", ptx_path, "-o", stem + ".cubin"],
                           capture_output=True, text=True)
    if build.returncode:
        return {"loops_error": f"ptxas: {build.stderr.strip()[-200:]}"}
    sass = subprocess.run([nvdisasm, "-c", stem + ".cubin"], capture_output=True, text=True)
    os.remove(stem + ".cubin")
    if sass.returncode:
        return {"loops_error": f"nvdisasm: {sass.stderr.strip()[-200:]}"}
    with open(stem + ".sass", "w") as fh:
        fh.write(sass.stdout)
    return {"loops": loop_spills(sass.stdout)}


def _compile_one(name: str) -> None:
    """In a child process whose environment switches the dumps on: compile case `name`."""
    import jax
    import jax.numpy as jnp

    from funcmla.attention.pallas import DecodeKernelConfig, mla_decode
    from funcmla.layout import PageTable

    pool_kind, heads, page = parse_case(name)
    q = jax.random.normal(jax.random.key(0), (_BATCH, heads, 576), jnp.bfloat16)
    pool = jax.random.normal(jax.random.key(1), (_BATCH * _CTX, 576), jnp.bfloat16)
    kw = {}
    if pool_kind != "bf16":
        pool, kw = pool.astype(jnp.float8_e4m3fn), {"k_scale": 0.05}
    if page == 1:
        meta = dict(kv_indptr=jnp.arange(_BATCH + 1, dtype=jnp.int32) * _CTX,
                    kv_indices=jnp.arange(_BATCH * _CTX, dtype=jnp.int32), max_kv_len=_CTX)
    else:
        table = jnp.arange(_BATCH * _CTX // page, dtype=jnp.int32).reshape(_BATCH, -1)
        meta = dict(page_table=PageTable(table, jnp.full((_BATCH,), _CTX, jnp.int32), page))
    products = "fp8" if pool_kind == "fp8products" else "mixed"
    config = DecodeKernelConfig(kernel="mgpu", fp8_products=products)
    out, _ = mla_decode(q, pool, sm_scale=0.07, config=config, **meta, **kw)
    out.block_until_ready()


def _report(name: str, dump: str) -> dict:
    """Compiles case `name` in a child process dumping into `dump`; its kernels' reports."""
    os.makedirs(dump, exist_ok=True)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1",
               MOSAIC_GPU_DUMP_TO=dump)
    run = subprocess.run([sys.executable, "-m", "bench.ptxas_report", "--compile-one", name],
                         env=env, capture_output=True, text=True, timeout=300)
    row = {"case": name, "returncode": run.returncode, "kernels": {}}
    if run.returncode:
        lines = run.stderr.strip().splitlines() or ["(no output)"]
        errors = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        row["error"] = (errors or lines)[-1]
    for f in sorted(os.listdir(dump)):
        path = os.path.join(dump, f)
        if f.endswith(".ptxas"):
            kernel = f[:-len(".ptxas")]
            with open(path) as fh:
                row["kernels"].setdefault(kernel, {}).update(parse_ptxas(fh.read()))
        elif f.endswith(".ptx"):
            with open(path) as fh:
                kernel = row["kernels"].setdefault(f[:-len(".ptx")], {})
                kernel["setmaxnreg"] = setmaxnreg_values(fh.read())
            kernel.update(kernel_loops(path))
        elif not f.endswith(".sass"):  # the MLIR pass logs run to hundreds of MB
            os.remove(path)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--out", default="out/")
    ap.add_argument("--compile-one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_one:
        _compile_one(args.compile_one)
        return 0
    names = args.cases.split(",")
    for name in names:
        parse_case(name)
    rows = [_report(name, os.path.join(args.out, "ptxas", name)) for name in names]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ptxas_report.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(f"{'case':<22} {'kernel':<40} regs  spill st/ld  setmaxnreg         notes")
    for row in rows:
        if row.get("error"):
            print(f"{row['case']:<22} failed: {row['error']}")
        for kernel, k in row["kernels"].items():
            notes = " ".join(n for n, on in (("C7507:setmaxnreg-ignored",
                                              k.get("setmaxnreg_ignored")),
                                             ("C7512:wgmma-serialized",
                                              k.get("wgmma_serialized"))) if on)
            budgets = ",".join(f"{op}{n}" for op, n in k.get("setmaxnreg", []))
            print(f"{row['case']:<22} {kernel:<40} {k.get('registers')!s:>4}  "
                  f"{k.get('spill_store_bytes', 0):>4}/{k.get('spill_load_bytes', 0):<4}  "
                  f"{budgets:<18} {notes}")
            for loop in k.get("loops", []):
                if loop["spill_loads"] or loop["spill_stores"]:
                    print(f"{'':<22}   loop at {loop['header']} ({loop['instructions']} "
                          f"instructions): {loop['spill_loads']} LDL, {loop['spill_stores']} "
                          "STL a trip")
    return 0 if all(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
