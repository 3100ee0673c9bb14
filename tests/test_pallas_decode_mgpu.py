"""The warp-specialized Mosaic GPU decode kernel against a float64 dense NumPy reference.

On CPU it runs in Mosaic GPU interpret mode (barriers, TMA copies and wgmma are simulated; the
transposed q k^T product is a plain dot there, see `decode_mgpu._qk`, and pages under 8 tokens
are gathered row by row instead of by the compiled kernel's cp.async producer); the compiled
kernel is tested when a GPU is present, and lowered for CUDA on every host. Pool rows outside
every sequence hold NaN, so a read past a sequence's end (the tail of its last tile) shows up in
the result.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcmla.attention.pallas import (
    DecodeKernelConfig,
    MgpuDecodeConfig,
    kernel_choice,
    merge_splits_pallas,
    mgpu_decode_supported,
    mla_decode,
    mla_decode_rows_mgpu,
)
from funcmla.attention.pallas.decode_common import kv_rows_from_csr, kv_rows_from_page_table
from funcmla.attention.pallas.mgpu_ops import interpreter_unsupported, mgpu_params, xla_cpu_threads
from funcmla.layout import PageTable
from tests.test_pallas_decode import SCALE, check, make_problem, reference
from tests.trace_checks import assert_profiled_like_plain


def kv_rows(p, page_size):
    """The problem's KV metadata as `KVRows`: its token CSR at page size 1, else its page table."""
    if page_size == 1:
        return kv_rows_from_csr(p["kv_indptr"], p["kv_indices"])
    return kv_rows_from_page_table(PageTable(p["table"], p["lens"], page_size))


def run(p, *, s_q, page_size, num_splits, interpret):
    kv = kv_rows(p, page_size)
    o, lse = mla_decode_rows_mgpu(p["q"], p["pool"], kv, sm_scale=SCALE, s_q=s_q,
                                  num_splits=num_splits, interpret=interpret)
    b, s, rows, dv = o.shape
    if s > 1:
        assert o.dtype == jnp.bfloat16  # the default partial_dtype
        o, lse = merge_splits_pallas(o, lse, jnp.bfloat16, interpret=interpret)
    else:
        assert o.dtype == jnp.bfloat16
        o, lse = o[:, 0], lse[:, 0]
    h = p["q"].shape[1]
    return o.reshape(b * s_q, h, dv), lse.reshape(b * s_q, h)


# heads, s_q, page size, lengths (0 = empty sequence), max pages, splits, what unused pool rows
# hold. The interpreter's cost grows with the blocks (sequences x splits), so each case runs
# few. Together they cover a full tile, a partial last tile, an empty sequence, an empty split
# (70 tokens = 2 tiles in 3 splits), one copy per tile (page 64) and several (pages 16 and 8),
# the row gather (pages 2 and 4; the clamped reads of a partial last tile), the causal fold of
# s_q > 1, and the unmasked interior tiles ahead of masked ones. Unused rows (slot 0 included)
# hold NaN, +Inf or -Inf, which must not reach the output.
CPU_CASES = [
    (64, 1, 64, [100, 0], 3, 1, np.nan),
    (64, 1, 16, [70], 6, 3, np.inf),
    (16, 4, 8, [90], 13, 2, -np.inf),
    (16, 4, 2, [130], 70, 1, np.inf),  # tile 1 ends past the causal limit of token 0
    (64, 1, 4, [129], 40, 2, np.nan),
]


# The interpreter runs ~10 s of CPU per case: the first case runs in `./dev test`, the others
# (and the two tests below) are `slow` (CI runs them after it).
CPU_CASES = CPU_CASES[:1] + [pytest.param(*c, marks=pytest.mark.slow) for c in CPU_CASES[1:]]


@pytest.mark.parametrize("heads,s_q,page_size,lens,max_pages,splits,poison", CPU_CASES)
def test_interpret_matches_reference(heads, s_q, page_size, lens, max_pages, splits, poison):
    rng = np.random.default_rng(heads * 7 + page_size)
    p = make_problem(rng, batch=len(lens), heads=heads, s_q=s_q, page_size=page_size,
                     lens=lens, max_pages=max_pages, poison=poison)
    out, lse = run(p, s_q=s_q, page_size=page_size, num_splits=splits, interpret=True)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], s_q, SCALE))


@pytest.mark.slow
def test_interpret_running_max_moves():
    """Keys that grow 1000x along the sequence make the running max rise tile after tile, so
    every tile rescales the accumulator and the row sums: against the float64 reference, in
    the three unmasked tiles and the masked last one. (A running max that never moved would
    overflow P here.)"""
    rng = np.random.default_rng(5)
    p = make_problem(rng, batch=1, heads=64, s_q=1, page_size=16, lens=[200], max_pages=14)
    pool = np.array(jnp.asarray(p["pool"], jnp.float32))
    for sl in p["slot_lists"]:
        pool[sl] *= np.geomspace(0.05, 50.0, len(sl))[:, None]  # scores grow 1000x
    p["pool"] = jnp.asarray(pool, jnp.bfloat16)
    out, lse = run(p, s_q=1, page_size=16, num_splits=1, interpret=True)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], 1, SCALE))


@pytest.mark.slow
@pytest.mark.parametrize("page_size,s_q,lens,splits", [(16, 1, [300], 2), (1, 2, [140], 1)])
def test_interpret_has_no_data_race(page_size, s_q, lens, splits):
    """Mosaic GPU's interpreter, with its happens-before race detector on, finds no unordered
    shared-memory access between the producer and the two consumers: stage refills (3 tiles in
    split 0 of 300 tokens; 3 tiles of the page-1 gather), the P and alpha hand-off, the zeroed
    tail, the final row-sum exchange. (Dropping consumer 1's wait for P makes this fail.)
    The detector is a private jax API: skip where it has moved."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        pytest.skip(f"Mosaic GPU interpreter's race detector not importable: {e}")
    rng = np.random.default_rng(11)
    p = make_problem(rng, batch=len(lens), heads=64 // s_q, s_q=s_q, page_size=page_size,
                     lens=lens, max_pages=max(lens) // page_size + 1)
    o, _ = mla_decode_rows_mgpu(p["q"], p["pool"], kv_rows(p, page_size), sm_scale=SCALE, s_q=s_q,
                                num_splits=splits,
                                interpret=InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not interpret_pallas_call.get_races().races_found


def test_interpreter_needs_a_worker_thread_a_warpgroup(monkeypatch):
    """XLA's CPU worker count (PJRT_NPROC, else NPROC, else the CPUs the process may use); under
    3 a forced Mosaic GPU kernel is refused in interpret mode, bf16 and fp8 pools alike, naming
    the fix (never a hang); auto takes Triton there anyway."""
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    assert xla_cpu_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("NPROC", "7")
    assert xla_cpu_threads() == 7
    monkeypatch.setenv("PJRT_NPROC", "+-3")  # not a number: the next variable counts
    assert xla_cpu_threads() == 7
    monkeypatch.setenv("PJRT_NPROC", " 3 ")
    assert xla_cpu_threads() == 3 and interpreter_unsupported() is None
    q = jax.ShapeDtypeStruct((2, 64, 576), jnp.bfloat16)
    for kv_dtype in (None, jnp.float8_e4m3fn):
        assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q, 64, 1, kv_dtype=kv_dtype,
                             interpret=True)[0] == "mgpu"
    monkeypatch.setenv("PJRT_NPROC", "2")
    assert xla_cpu_threads() == 2
    for kv_dtype in (None, jnp.float8_e4m3fn):
        with pytest.raises(ValueError, match=r"kernel='mgpu': Mosaic GPU interpret mode .*3 "
                                             r"warpgroups.* has 2 .*PJRT_NPROC=3"):
            kernel_choice(DecodeKernelConfig(kernel="mgpu"), q, 64, 1, kv_dtype=kv_dtype,
                          interpret=True)
        name, why = kernel_choice(DecodeKernelConfig(), q, 64, 1, kv_dtype=kv_dtype,
                                  interpret=True)
        assert name == "triton" and "PJRT_NPROC" in why
    with pytest.raises(RuntimeError, match="has 2"):
        mgpu_params(True)
    assert mgpu_params(False) is None


@pytest.mark.parametrize("rows,page_size,dtype,needle", [
    (16, 64, jnp.bfloat16, "multiple of 64"),
    (64, 3, jnp.bfloat16, "does not divide"),
    (64, 64, jnp.float16, "bfloat16"),
    (64, 96, jnp.bfloat16, "not a multiple"),
    (64, 24, jnp.bfloat16, "does not divide"),
])
def test_unsupported_shapes_are_named(rows, page_size, dtype, needle):
    why = mgpu_decode_supported(rows, page_size, 576, 512, dtype)
    assert why is not None and needle in why
    for ok_page in (1, 2, 4, 8, 16, 64, 128):
        assert mgpu_decode_supported(128, ok_page, 576, 512, jnp.bfloat16) is None


def test_rejects_unsupported_call():
    rng = np.random.default_rng(0)
    p = make_problem(rng, batch=2, heads=16, s_q=1, page_size=64, lens=[5, 9], max_pages=1)
    with pytest.raises(ValueError, match="multiple of 64"):
        run(p, s_q=1, page_size=64, num_splits=1, interpret=True)


def test_pool_rows_off_the_8_row_tiles_leave_the_mosaic_kernels_at_tma_pages():
    """A TMA copy views the pool as 8-row tiles, so at pages of 8 tokens and more a pool whose
    rows are not a multiple of 8 is no Mosaic GPU kernel's (bf16, fp8 and the fp8 products
    alike): kernel="mgpu" raises naming the rows before anything lowers (Mosaic GPU's own
    tiling error was the message before), "auto" keeps Triton with that reason, and the row
    gather (pages under 8) takes any pool."""
    q = jax.ShapeDtypeStruct((2, 128, 576), jnp.bfloat16)
    mgpu = DecodeKernelConfig(kernel="mgpu")
    for kv_dtype in (None, jnp.float8_e4m3fn):
        for page_size in (8, 64):
            with pytest.raises(ValueError, match=r"kernel='mgpu': kv_pool has 4100 rows, not a "
                                                 r"multiple of 8: .*TMA"):
                kernel_choice(mgpu, q, page_size, 1, kv_dtype=kv_dtype, pool_rows=4100)
            name, why = kernel_choice(DecodeKernelConfig(), q, page_size, 1, kv_dtype=kv_dtype,
                                      pool_rows=4100)
            assert name == "triton" and "4100 rows" in why
            assert kernel_choice(mgpu, q, page_size, 1, kv_dtype=kv_dtype,
                                 pool_rows=4104)[0] == "mgpu"
        assert kernel_choice(mgpu, q, 1, 1, kv_dtype=kv_dtype, pool_rows=4101)[0] == "mgpu"
    with pytest.raises(ValueError, match=r"fp8_products='fp8' .*kv_pool has 4100 rows"):
        kernel_choice(DecodeKernelConfig(fp8_products="fp8"), q, 64, 1,
                      kv_dtype=jnp.float8_e4m3fn, pool_rows=4100)
    rng = np.random.default_rng(1)
    p = make_problem(rng, batch=2, heads=64, s_q=1, page_size=64, lens=[70, 9], max_pages=2)
    pool = jnp.concatenate([p["pool"], p["pool"][:4]])  # rows + 4
    with pytest.raises(ValueError, match=r"kv_pool has \d+ rows, not a multiple of 8"):
        mla_decode(p["q"], pool, page_table=PageTable(p["table"], p["lens"], 64), sm_scale=SCALE,
                   config=mgpu, interpret=True)


@pytest.mark.parametrize("fields,needle", [
    (dict(profile_space=-1, profile_dir="/tmp"), "profile_space=-1"),
    (dict(profile_space=161, profile_dir="/tmp"), r"profile_space=161 .*\[0, 160\]"),
    (dict(profile_space=8), "needs a profile_dir"),
    (dict(registers=(40, 236, 228)), "consumer 0 budget must be a multiple of 8"),
    (dict(registers=(16, 232, 232)), "producer budget must be a multiple of 8 in .24, 256."),
    (dict(registers=(40, 240, 232)), "sums to 512, over 504"),
    (dict(registers=(40, 232)), "tuple of three ints"),
])
def test_rejects_bad_config(fields, needle):
    with pytest.raises(ValueError, match=needle):
        MgpuDecodeConfig(**fields)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page_size,lens,max_pages,splits", [
    (128, 1, 64, [4096, 1000, 63, 1, 0], 64, 2),
    (128, 1, 1, [4096, 1000, 63, 1, 0], 4096, 2),
    (16, 4, 2, [777, 130], 400, 1),
    (128, 2, 16, [777, 2048], 128, 3),
    (64, 1, 8, [300, 5], 40, 1),
])
def test_gpu_matches_reference(heads, s_q, page_size, lens, max_pages, splits):
    rng = np.random.default_rng(1)
    p = make_problem(rng, batch=len(lens), heads=heads, s_q=s_q, page_size=page_size,
                     lens=lens, max_pages=max_pages)
    fn = jax.jit(lambda q, pool, table, ln: run(dict(p, q=q, pool=pool, table=table, lens=ln),
                                                s_q=s_q, page_size=page_size,
                                                num_splits=splits, interpret=False))
    out, lse = fn(p["q"], p["pool"], p["table"], p["lens"])
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], s_q, SCALE))


@pytest.mark.gpu
def test_gpu_profile_names_every_phase(tmp_path):
    """`MgpuDecodeConfig.profile_space` writes Mosaic GPU's per-warpgroup trace, with the
    kernel's named phases, and leaves the output as it is without the profiler."""
    rng = np.random.default_rng(2)
    p = make_problem(rng, batch=2, heads=64, s_q=1, page_size=64, lens=[300, 130], max_pages=5)
    kv = kv_rows(p, 64)
    cfg = MgpuDecodeConfig(profile_space=64, profile_dir=str(tmp_path))
    profiled = jax.jit(lambda q, pool: mla_decode_rows_mgpu(
        q, pool, kv, sm_scale=SCALE, s_q=1, num_splits=1, config=cfg))(p["q"], p["pool"])
    plain = jax.jit(lambda q, pool: mla_decode_rows_mgpu(
        q, pool, kv, sm_scale=SCALE, s_q=1, num_splits=1))(p["q"], p["pool"])
    assert_profiled_like_plain(profiled, plain, tmp_path,
                               {"qk", "wait_kv", "softmax", "hand_off", "pv", "wait_p", "finish"})


@pytest.mark.slow  # interpreter runs behind the dispatcher
def test_mla_decode_dispatches_to_mgpu():
    """`DecodeKernelConfig(kernel="mgpu")` routes `mla_decode` (token CSR, split, merge)
    through the Mosaic GPU kernel (the page-1 row gather, -Inf in unused rows); an unsupported
    shape is refused by name."""
    rng = np.random.default_rng(5)
    p = make_problem(rng, batch=1, heads=64, s_q=1, page_size=1, lens=[70], max_pages=80,
                     poison=-np.inf)
    cfg = DecodeKernelConfig(kernel="mgpu")
    out, lse = mla_decode(p["q"], p["pool"], kv_indptr=p["kv_indptr"],
                          kv_indices=p["kv_indices"], sm_scale=SCALE, num_splits=2, config=cfg,
                          interpret=True)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], 1, SCALE))
    with pytest.raises(ValueError, match="kernel='mgpu'.*multiple of 64"):
        mla_decode(p["q"][:, :16], p["pool"], kv_indptr=p["kv_indptr"],
                   kv_indices=p["kv_indices"], sm_scale=SCALE, config=cfg, interpret=True)
    with pytest.raises(ValueError, match="kernel must be"):
        DecodeKernelConfig(kernel="cuda")


@pytest.mark.slow  # interpreter runs at two partial dtypes
def test_partial_dtypes():
    """DecodeKernelConfig.partial_dtype reaches this kernel through `mla_decode`: the kernel's
    partials have that dtype (read off the traced program, nothing runs), and float32 partials
    merge within the reference tolerance (bf16 ones, the default, run in CPU_CASES)."""
    rng = np.random.default_rng(6)
    p = make_problem(rng, batch=1, heads=64, s_q=1, page_size=16, lens=[200], max_pages=14)
    kv = kv_rows(p, 16)
    pt = PageTable(p["table"], p["lens"], 16)
    for dtype, short in (("bfloat16", "bf16"), ("float32", "f32")):
        o, _ = jax.eval_shape(lambda q, pool: mla_decode_rows_mgpu(
            q, pool, kv, sm_scale=SCALE, s_q=1, num_splits=2, partial_dtype=dtype,
            interpret=True), p["q"], p["pool"])
        assert o.dtype == jnp.dtype(dtype) and o.shape == (1, 2, 64, 512)
        cfg = DecodeKernelConfig(kernel="mgpu", partial_dtype=dtype)
        text = str(jax.make_jaxpr(lambda q, pool: mla_decode(
            q, pool, page_table=pt, sm_scale=SCALE, num_splits=2, config=cfg,
            interpret=True))(p["q"], p["pool"]))
        assert f"{short}[1,2,64,512]" in text
    out, lse = mla_decode(p["q"], p["pool"], page_table=pt, sm_scale=SCALE, num_splits=2,
                          config=cfg, interpret=True)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], 1, SCALE))
    with pytest.raises(ValueError, match="partial_dtype"):
        mla_decode_rows_mgpu(p["q"], p["pool"], kv, sm_scale=SCALE, s_q=1, num_splits=2,
                             partial_dtype=jnp.float16, interpret=True)


@pytest.mark.parametrize("registers,expected", [
    (None, [("decrease", 40), ("increase", 232)]),
    ((40, 256, 208), [("decrease", 40), ("increase", 256), ("increase", 208)]),
])
def test_kernel_sets_its_register_budgets(setmaxnreg_calls, registers, expected):
    """The warpgroups' `setmaxnreg` (recorded while the kernel is traced for CUDA): the
    kernel's own budgets, one increase for both consumers when they are equal, else one each,
    and the config's when it names them."""
    b = 2
    q = jax.ShapeDtypeStruct((b, 128, 576), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64 * 64, 576), jnp.bfloat16)
    kv = kv_rows_from_page_table(PageTable(jnp.zeros((b, 16), jnp.int32),
                                           jnp.zeros((b,), jnp.int32), 64))
    cfg = MgpuDecodeConfig(registers=registers)
    fn = jax.jit(lambda q, pool, kv: mla_decode_rows_mgpu(q, pool, kv, sm_scale=SCALE, s_q=1,
                                                          num_splits=1, config=cfg))
    jax.export.export(fn, platforms=["cuda"])(q, pool, kv)
    assert sorted(setmaxnreg_calls) == sorted(expected)


@pytest.mark.parametrize("page_size,splits", [(64, 1), (16, 2), (1, 2), (4, 1)])
def test_lowers_for_cuda(page_size, splits):
    """The compiled (not interpreted) kernel lowers for CUDA on any host: Mosaic GPU's layout
    inference, the tiling of every copy and the shared-memory budget (227 KB) are checked at
    lowering, so CI catches what the interpreter does not model."""
    b, h = 2, 128
    q = jax.ShapeDtypeStruct((b, h, 576), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64 * 64, 576), jnp.bfloat16)
    if page_size == 1:  # the cp.async row gather (inline Mosaic GPU)
        kv = kv_rows_from_csr(jnp.zeros((b + 1,), jnp.int32), jnp.zeros((b * 4096,), jnp.int32))
    else:
        kv = kv_rows_from_page_table(PageTable(jnp.zeros((b, 4096 // page_size), jnp.int32),
                                               jnp.zeros((b,), jnp.int32), page_size))
    fn = jax.jit(lambda q, pool, kv: mla_decode_rows_mgpu(q, pool, kv, sm_scale=SCALE, s_q=1,
                                                          num_splits=splits))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.export.export(fn, platforms=["cuda"])(q, pool, kv).mlir_module()
    assert "mosaic_gpu" in text
    # the row gather's copies signal their stage as they land; the producer never waits
    assert ("nvvm.cp.async.mbarrier.arrive" in text) == (page_size < 8)
    assert "nvvm.cp.async.wait.group" not in text
    # no spelling that this jax deprecates (jax 0.11: plgpu.transpose_ref, plgpu.load with a
    # separate index): the warning names the kernel's own line
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, DeprecationWarning)
            and f"{os.sep}funcmla{os.sep}" in w.filename]
    assert not ours, ours
