"""Launcher extraction and plans (CPU): the protobuf, PTX and Triton-IR readers against hand-built
inputs, the kernels extracted from the JAX path's CUDA lowering (Triton and Mosaic GPU) against
the decode kernel's grid and signature, plan caching, config validation, the compile routes.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import pytest

from funcmla.attention.pallas import DecodeKernelConfig
from funcmla.interop import launcher as L
from tests.launcher_helpers import (FP8, PTX, SCALE, _field, _lowering_available, fp8_config,
                                    needs_lowering)


# ----------------------------------------------------------------------------- protobuf

def _kernel_call(params: list[bytes], *, name="k", ptx="PTX", warps=4, smem=1024,
                 grid=(3, 2, 5), num_ctas=None) -> bytes:
    kernel = (_field(1, name.encode()) + _field(2, warps) + _field(3, smem)
              + _field(4, ptx.encode()) + _field(5, b"ttir") + _field(6, 90))
    if num_ctas is not None:
        kernel += _field(10, num_ctas)
    call = _field(1, kernel) + _field(2, grid[0]) + _field(3, grid[1]) + _field(4, grid[2])
    for p in params:
        call += _field(5, p)
    return _field(1, call) + _field(3, b"") + _field(4, b"user")


def _array(div=16, zero=0) -> bytes:
    inner = (_field(1, zero) if zero else b"") + _field(2, div)
    return _field(1, inner)


def test_proto_reads_a_kernel_call():
    raw = _kernel_call([_array(16), _array(8), _array(16)], name="mla", ptx=".entry mla()",
                       warps=8, smem=70000, grid=(2, 7, 300), num_ctas=1)
    p = L.parse_kernel_call_proto(zlib.decompress(zlib.compress(raw)))
    assert p == {"name": "mla", "num_warps": 8, "num_ctas": 1, "shared_mem_bytes": 70000,
                 "ptx": ".entry mla()", "grid": (2, 7, 300), "ptr_divisibility": (16, 8, 16)}


def test_proto_refuses_what_the_launcher_cannot_launch():
    with pytest.raises(ValueError, match="autotuned"):
        L.parse_kernel_call_proto(_field(2, b""))
    with pytest.raises(ValueError, match="array parameters"):
        L.parse_kernel_call_proto(_kernel_call([_field(3, 5)]))  # an i32 scalar parameter
    with pytest.raises(ValueError, match="zeroed bytes"):
        L.parse_kernel_call_proto(_kernel_call([_array(16, zero=64)]))


def test_ptx_entry_and_target():
    entry, params = L.ptx_entry_params(PTX, "mla_decode_ps1_m16_kv64")
    assert entry == "mla_decode_ps1_m16_kv64" and len(params) == 3
    assert all(p.endswith(f"_param_{i}") for i, p in enumerate(params))
    assert L.compile.ptx_target(PTX) == "sm_90a"
    with pytest.raises(ValueError, match="expected one .entry other"):
        L.ptx_entry_params(PTX, "other")


# ----------------------------------------------------------------------------- plans

def _expected_splits(b, rows, max_kv, kc: DecodeKernelConfig) -> int:
    from funcmla.attention.pallas import choose_num_splits

    block_m = kc.resolved_block_m(rows)
    return choose_num_splits(b, -(-rows // block_m), max_kv, kc, block_m)


@needs_lowering
@pytest.mark.parametrize("b,h,s_q,max_kv,splits,page_size", [
    (4, 16, 1, 1024, None, 1),   # split-KV with merge
    (300, 16, 1, 256, None, 1),  # many programs
    (3, 8, 3, 256, None, 1),     # rows 24 -> padded to 32
    (2, 128, 1, 512, 1, 1),      # two row blocks, forced single split
    (4, 16, 1, 1024, None, 64),  # page table
])
def test_decode_plan_reads_the_jax_path_kernels(b, h, s_q, max_kv, splits, page_size):
    if page_size == 1:
        cap, pool = b * max_kv, b * max_kv + 64
        cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=pool,
                                   kv_capacity=cap, max_kv_len=max_kv, num_splits=splits,
                                   sm_scale=SCALE)
        meta = ((b + 1,), "i32")
    else:
        cap, pool = b * (max_kv // page_size), b * max_kv + page_size
        cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=pool,
                                   kv_capacity=cap, num_splits=splits, sm_scale=SCALE,
                                   page_size=page_size)
        meta = ((b,), "i32")
    plan = L.decode_plan(cfg)
    rows = s_q * h
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    nrb = -(-rows // block_m)
    s = splits or _expected_splits(b, rows, max_kv, cfg.kernel)
    assert plan.num_splits == s
    assert plan.decode.name == f"mla_decode_ps{page_size}_m{block_m}_kv64"
    assert plan.decode.grid == (nrb, s, b)
    assert plan.decode.num_warps == (4 if block_m <= 16 else 8)
    assert plan.decode.operands == (meta, ((cap,), "i32"), ((b, nrb * block_m, 576), "bf16"),
                                    ((pool, 576), "bf16"))
    assert plan.decode.results[1] == ((b, s, nrb * block_m), "f32")
    if s == 1:
        assert plan.merge is None and plan.calls == (plan.decode,)
    else:
        assert plan.merge.name.startswith(f"funcmla_merge_s{s}_d")
        assert plan.merge.operands == plan.decode.results
        assert plan.merge.results == (((b, nrb * block_m, 512), "bf16"),
                                      ((b, nrb * block_m), "f32"))
    assert all(d in (16, 32) for k in plan.calls for d in k.ptr_divisibility)
    fn, avals = plan.source
    assert [a.shape for a in avals][2:] == ([(b + 1,), (cap,)] if page_size == 1
                                            else [(b, cap // b), (b,)])


@needs_lowering
@pytest.mark.parametrize("partial_dtype,name", [("bfloat16", "bf16"), ("float32", "f32")])
def test_decode_plan_partials_follow_partial_dtype(partial_dtype, name):
    """The split partials the plan wires (decode result -> merge operand, and the buffer the
    launcher allocates) are in `DecodeKernelConfig.partial_dtype`; the lse partials stay f32."""
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=4096, kv_capacity=1024,
                               max_kv_len=512, num_splits=4, sm_scale=SCALE,
                               kernel=DecodeKernelConfig(partial_dtype=partial_dtype))
    plan = L.decode_plan(cfg)
    assert plan.decode.results == (((2, 4, 16, 512), name), ((2, 4, 16), "f32"))
    assert plan.merge.operands == plan.decode.results


def test_ttir_divisibility_reads_each_argument():
    text = ("module {\n  tt.func public @k(%arg0: !tt.ptr<i32> {tt.divisibility = 32 : i32}, "
            "%arg1: !tt.ptr<bf16>, %arg2: !tt.ptr<f32> {tt.divisibility = 16 : i32}) {\n"
            "    tt.return\n  }\n}")
    assert L.ttir_divisibility(text) == (32, 1, 16)
    with pytest.raises(ValueError, match="no public tt.func"):
        L.ttir_divisibility("module {}")


def _triton_reason() -> str | None:
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as err:
        return f"triton not importable ({err})"
    return _lowering_available()


@pytest.mark.skipif(_triton_reason() is not None, reason=str(_triton_reason()))
def test_triton_route_compiles_the_plan_to_cubin_without_a_gpu():
    cfg = L.DecodeLaunchConfig(num_seqs=8, num_heads=16, pool_rows=4096, kv_capacity=2048,
                               max_kv_len=256, sm_scale=SCALE, num_splits=4)
    plan = L.decode_plan(cfg)
    images = L.compile_plan(plan, "9.0", "triton")
    assert set(images) == {plan.decode.name, plan.merge.name}
    for call in plan.calls:
        img = images[call.name]
        n = len(call.operands) + len(call.results)
        assert img.entry == call.name and n <= img.num_params <= n + 2 and img.route == "triton"
        assert img.image[:4] == b"\x7fELF"  # a cubin
        entry, params = L.ptx_entry_params(img.ptx, img.entry)
        assert len(params) == img.num_params
    assert images[plan.decode.name].shared_mem_bytes > 48 * 1024


@needs_lowering
def test_plans_are_cached_per_static_configuration():
    a = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                             sm_scale=SCALE)
    b = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                             sm_scale=SCALE)
    c = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=48,
                             sm_scale=SCALE)
    assert L.decode_plan(a) is L.decode_plan(b)
    assert L.decode_plan(c) is not L.decode_plan(a)
    assert L.decode_plan(c).decode.operands[1] == ((48,), "i32")


@pytest.mark.parametrize("field,value,match", [
    ("num_seqs", 0, "num_seqs"), ("num_heads", -1, "num_heads"), ("s_q", 1.5, "s_q"),
    ("pool_rows", True, "pool_rows"), ("max_kv_len", 0, "max_kv_len"),
    ("num_splits", -2, "num_splits"), ("dtype", "float32", "dtype"),
    ("page_size", 48, "power of two"),
])
def test_config_rejects_bad_values(field, value, match):
    kw = dict(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32, sm_scale=SCALE)
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        L.DecodeLaunchConfig(**kw)


def test_paged_config_rules():
    kw = dict(num_seqs=4, num_heads=16, pool_rows=4096, sm_scale=SCALE, page_size=64)
    assert L.DecodeLaunchConfig(kv_capacity=32, **kw).resolved_max_kv_len == 8 * 64
    with pytest.raises(ValueError, match="num_seqs \\* max_pages"):
        L.DecodeLaunchConfig(kv_capacity=30, **kw)
    with pytest.raises(ValueError, match="implied by the page table"):
        L.DecodeLaunchConfig(kv_capacity=32, max_kv_len=100, **kw)


def test_kernel_route_resolution(monkeypatch):
    assert L.kernel_route("triton") == "triton" and L.kernel_route("xla") == "xla"
    monkeypatch.setenv("FUNCMLA_LAUNCHER_COMPILER", "triton")
    assert L.kernel_route() == "triton"
    monkeypatch.setenv("FUNCMLA_LAUNCHER_COMPILER", "auto")
    assert L.kernel_route() == ("xla" if jax.default_backend() == "gpu" else "triton")
    with pytest.raises(ValueError, match="one of"):
        L.kernel_route("nvcc")


# ----------------------------------------------------------------------------- Mosaic GPU
_MGPU = DecodeKernelConfig(kernel="mgpu")


@needs_lowering
@pytest.mark.parametrize("b,h,s_q,page_size,splits", [
    (32, 128, 1, 1, None),   # the split rule splits: Mosaic GPU decode + Triton merge
    (8, 128, 1, 64, 1),      # one split: the Mosaic GPU kernel alone
    (4, 64, 2, 1, 2),        # s_q = 2: q folded to [B, s_q * H, D]
    (4, 64, 1, 16, 3),       # page 16: one TMA copy per page
])
def test_mosaic_decode_is_extracted_with_its_module_and_buffers(b, h, s_q, page_size, splits):
    import hashlib

    ctx = 1024
    cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=b * ctx + 4 * page_size,
                               kv_capacity=b * ctx // page_size, num_splits=splits, sm_scale=SCALE,
                               page_size=page_size, kernel=_MGPU)
    plan = L.decode_plan(cfg)
    dec = plan.decode
    assert isinstance(dec, L.MosaicCall) and plan.kernel == "mgpu" and plan.kernel_reason is None
    # the module XLA would compile: MLIR bytecode, keyed by its SHA-256 like the custom call
    assert dec.module.startswith(b"ML\xefR") and dec.kernel_hash == hashlib.sha256(
        dec.module).digest()
    rows, meta = s_q * h, ((b + 1,) if page_size == 1 else (b,))
    assert dec.operands == ((meta, "i32"), ((b * ctx // page_size,), "i32"),
                            ((b, rows, 576), "bf16"), ((b * ctx + 4 * page_size, 576), "bf16"))
    s = plan.num_splits
    assert s == splits if splits else s > 1
    o_dtype = "bf16"  # final output (s == 1) or bf16 partials (the default partial_dtype)
    assert dec.results == (((b, s, rows, 512), o_dtype), ((b, s, rows), "f32"))
    assert (plan.merge is None) == (s == 1)
    if s > 1:
        assert isinstance(plan.merge, L.TritonCall)
        assert plan.merge.operands == dec.results
    assert plan.triton_calls == ((plan.merge,) if s > 1 else ())
    assert plan.rows_pad == rows


@needs_lowering
def test_auto_dispatch_records_why_the_triton_kernel_runs():
    def plan(h, kernel="auto", b=8):
        return L.decode_plan(L.DecodeLaunchConfig(
            num_seqs=b, num_heads=h, pool_rows=b * 256, kv_capacity=b * 256, sm_scale=SCALE,
            kernel=DecodeKernelConfig(kernel=kernel)))

    # JAX's default backend here is the CPU: mla_decode's auto dispatch picks Triton
    got = plan(128)
    assert got.kernel == "triton" and isinstance(got.decode, L.TritonCall)
    assert "default backend is cpu" in got.kernel_reason
    assert "not a multiple of 64" in plan(16).kernel_reason
    assert plan(128, "triton").kernel_reason == "DecodeKernelConfig.kernel='triton'"
    with pytest.raises(L.LauncherUnavailable, match="not a multiple of 64"):
        plan(16, "mgpu")


@needs_lowering
def test_auto_dispatch_on_a_gpu_backend_follows_mla_decode(monkeypatch):
    # what the extraction trusts is the lowered custom call: with a GPU default backend the
    # auto dispatch lowers the Mosaic GPU kernel from mgpu_min_blocks blocks of 64 rows
    import funcmla.attention.pallas.decode_triton as dt

    monkeypatch.setattr(dt.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(L.plan.jax, "default_backend", lambda: "gpu")
    big = L.DecodeLaunchConfig(num_seqs=40, num_heads=128, pool_rows=40 * 256 + 1,
                               kv_capacity=40 * 256, sm_scale=SCALE,
                               kernel=DecodeKernelConfig(mgpu_min_blocks=4))
    small = dataclasses.replace(big, num_seqs=1, kv_capacity=256)  # 2 blocks of 64 rows
    assert L.decode_plan(big).kernel == "mgpu"
    got = L.decode_plan(small)
    assert got.kernel == "triton" and "mgpu_min_blocks = 4" in got.kernel_reason


class _Lowered:
    """A stand-in for jax's Lowered: compiler_ir() returns a module parsed from text."""

    def __init__(self, text: str):
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir

        with mlir.make_ir_context():
            self.module = ir.Module.parse(text)

    def compiler_ir(self, dialect):
        return self.module


def _mosaic_text(config: str, aliases: str = "") -> str:
    return f'''
func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {{
  %0 = stablehlo.custom_call @mosaic_gpu_v2(%arg0) {{api_version = 2 : i32,
    backend_config = "", mhlo.backend_config = {{{config}}}{aliases}}}
    : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}}'''


def test_mosaic_call_is_read_from_its_backend_config():
    calls = L.extract_kernel_calls(_Lowered(_mosaic_text(
        'kernel_hash = "h", module = "ML\\EFRfuncmla_k", use_custom_barrier = false, '
        'uses_xla_collective_metadata = false, skip_device_barrier = false')))
    assert len(calls) == 1 and isinstance(calls[0], L.MosaicCall)
    c = calls[0]
    assert c.module == b"ML\xefRfuncmla_k" and c.kernel_hash == b"h"
    assert c.operands == c.results == (((4,), "f32"),) and c.name == "funcmla_k"
    assert L.extract_triton_calls(_Lowered(_mosaic_text('module = "x"'))) == []


@pytest.mark.parametrize("config,aliases,match", [
    ('kernel_hash = "h"', "", "without a module"),
    ('module = "m", use_custom_barrier = true', "", "use_custom_barrier=true"),
    ('module = "m", uses_xla_collective_metadata = true', "", "collective_metadata=true"),
    ('module = "m", xla_replica_ids = "0,1"', "", "xla_replica_ids"),
    ('module = "m"', ", output_operand_aliases = [#stablehlo.output_operand_alias<"
     "output_tuple_indices = [], operand_index = 0, operand_tuple_indices = []>]", "aliases"),
])
def test_mosaic_calls_the_launcher_cannot_wire_are_refused(config, aliases, match):
    with pytest.raises(L.LauncherUnavailable, match=match):
        L.extract_kernel_calls(_Lowered(_mosaic_text(config, aliases)))


# ----------------------------------------------------------------------------- jaxlib support
def test_untested_jaxlib_is_refused_with_the_reason(monkeypatch):
    monkeypatch.delenv("FUNCMLA_LAUNCHER_ANY_JAXLIB", raising=False)
    here = L.support.jaxlib_version()
    assert (L.jaxlib_unsupported_reason() is None) == (here in L.TESTED_JAXLIB)
    monkeypatch.setattr(L.support, "jaxlib_version", lambda: "0.99.0")
    why = L.jaxlib_unsupported_reason()
    assert "jaxlib 0.99.0" in why and "0.10.2" in why and "0.11.2" in why
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               sm_scale=SCALE)
    with pytest.raises(L.LauncherUnavailable, match="jaxlib 0.99.0"):
        L.decode_plan(cfg)
    monkeypatch.setenv("FUNCMLA_LAUNCHER_ANY_JAXLIB", "1")
    assert L.jaxlib_unsupported_reason() is None


@pytest.mark.parametrize("version,abi", [("0.10.2", 2), ("0.11.2", 1), ("0.12.0", 1)])
def test_mosaic_host_abi_follows_the_jaxlib(monkeypatch, version, abi):
    monkeypatch.setattr(L.support, "jaxlib_version", lambda: version)
    assert L.support.mosaic_host_abi() == abi


def test_mosaic_compiler_absent_here_says_why():
    # CPU CI has no jaxlib CUDA plugin: building a Mosaic GPU kernel must refuse, not crash
    why = L.mosaic.mosaic_unavailable_reason()
    if why is None:
        pytest.skip("this machine has jaxlib's Mosaic GPU compiler")
    assert "MosaicGpuCompile" in why
    with pytest.raises(L.LauncherUnavailable, match="MosaicGpuCompile"):
        L.mosaic.mosaic_library()


# ----------------------------------------------------------------------------- fp8 pools
@needs_lowering
@pytest.mark.parametrize("h,page_size", [(16, 1), (16, 64), (128, 1), (128, 64)])
def test_fp8_plan_reads_the_triton_kernel_with_scale_operands(h, page_size):
    """An fp8 configuration that auto keeps on Triton (here: no GPU backend) lowers mla_decode
    with a float8_e4m3fn pool and two float32 [1] scale operands, with the fp8 tiling and the
    split rule's count for it, and every operand traced back to the launcher input it views."""
    from funcmla.attention.pallas.api import decode_num_splits
    from funcmla.attention.pallas.decode_common import fp8_triton_config

    b, ctx = 4, 256
    cfg = fp8_config(h, page_size, b, ctx)
    plan = L.decode_plan(cfg)
    dec = plan.decode
    block_m = min(64, h)
    kc = fp8_triton_config(DecodeKernelConfig(), h)
    assert isinstance(dec, L.TritonCall) and plan.kernel == "triton"
    # mla_decode's own reason: no GPU backend on this host (both fp8 Mosaic GPU kernels apply)
    assert "no GPU backend" in plan.kernel_reason
    assert dec.name == f"mla_decode_ps{page_size}_m{block_m}_kv64_fp8"
    assert (dec.num_warps, dec.num_stages) == (8, 5 if h == 16 else 1)
    assert plan.num_splits == decode_num_splits(kc, b, h, ctx, mgpu=False)
    assert dec.grid == (h // block_m, plan.num_splits, b)
    cap = b * ctx // page_size
    meta = ((b + 1,) if page_size == 1 else (b,), "i32")
    assert dec.operands == (meta, ((cap,), "i32"), ((b, h, 576), "bf16"),
                            ((cfg.pool_rows, 576), "f8E4M3FN"), ((1,), "f32"), ((1,), "f32"))
    index = ("kv_indptr", "kv_indices") if page_size == 1 else ("lengths", "page_table")
    assert plan.decode_inputs == index + ("q", "kv_pool", "k_scale", "v_scale")
    assert dec.sources == ((2, 3) if page_size == 1 else (3, 2)) + (0, 1, 4, 5)
    fn, avals = plan.source
    assert [(a.shape, str(a.dtype)) for a in avals[1:2] + avals[4:]] == [
        ((cfg.pool_rows, 576), FP8), ((1,), "float32"), ((1,), "float32")]


@needs_lowering
@pytest.mark.parametrize("page_size,splits,auto,h", [(1, None, True, 16), (64, 1, True, 16),
                                                      (16, 2, False, 16), (4, 1, False, 16),
                                                      (64, None, True, 32), (1, 2, False, 32)])
def test_fp8_plan_reads_the_fp8_mosaic_kernel_from_its_inputs(page_size, splits, auto, h,
                                                               monkeypatch):
    """At 16 heads (and at 32, in two row groups) the 16-row fp8 Mosaic GPU kernel (auto's
    choice on a GPU backend from fp8_mgpu_min_seqs sequences, or kernel="mgpu") reads every
    operand from a launcher input: q as [B, H, 576] bf16 (it prepares the f16 rows and score
    factors itself), the two scales, the fp8 pool; it writes [B, S, H, 512] untransposed, as
    the bf16 kernel does."""
    if auto:
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    b, ctx = 16, 1024
    kernel = DecodeKernelConfig(kernel="auto" if auto else "mgpu")
    cfg = fp8_config(h, page_size, b, ctx, num_splits=splits, kernel=kernel)
    plan = L.decode_plan(cfg)
    dec = plan.decode
    assert isinstance(dec, L.MosaicCall) and plan.kernel == "mgpu" and plan.kernel_reason is None
    assert dec.name.startswith(f"mla_decode_mgpu_fp8_ps{page_size}")
    meta = ((b + 1,) if page_size == 1 else (b,), "i32")
    assert dec.operands == (meta, ((b * ctx // page_size,), "i32"), ((b, h, 576), "bf16"),
                            ((1,), "f32"), ((1,), "f32"), ((cfg.pool_rows, 576), "f8E4M3FN"))
    index = ("kv_indptr", "kv_indices") if page_size == 1 else ("lengths", "page_table")
    assert plan.decode_inputs == index + ("q", "k_scale", "v_scale", "kv_pool")
    s = plan.num_splits
    assert s == splits if splits else s >= 1
    assert dec.results == (((b, s, h, 512), "bf16"), ((b, s, h), "f32"))
    assert (plan.merge is None) == (s == 1) and plan.rows_pad == h


@needs_lowering
@pytest.mark.parametrize("page_size", [1, 64])
def test_fp8_products_plan_reads_the_all_fp8_kernel(page_size, monkeypatch):
    """`fp8_products="fp8"` reaches torch callers: the plan holds the 64-row fp8 Mosaic GPU
    kernel's fp8-products form (its own kernel name), wired like the default products: the
    same operands from the same launcher inputs and the same results."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    b, ctx = 16, 1024
    plans = {}
    for products in ("mixed", "fp8"):
        kernel = DecodeKernelConfig(fp8_products=products)
        plans[products] = L.decode_plan(fp8_config(128, page_size, b, ctx, kernel=kernel))
    mixed, fp8 = plans["mixed"], plans["fp8"]
    assert fp8.kernel == "mgpu" and isinstance(fp8.decode, L.MosaicCall)
    assert mixed.decode.name.startswith(f"mla_decode_mgpu_fp8w_ps{page_size}")
    assert fp8.decode.name.startswith(f"mla_decode_mgpu_fp8wa_ps{page_size}")
    assert fp8.decode_inputs == mixed.decode_inputs
    assert fp8.decode.operands == mixed.decode.operands
    assert fp8.decode.results == mixed.decode.results
    assert (fp8.merge is None) == (mixed.merge is None)


def test_config_kv_dtype_rules():
    kw = dict(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32, sm_scale=SCALE)
    fp8 = L.DecodeLaunchConfig(kv_dtype=FP8, **kw)
    assert fp8.fp8 and fp8.pool_dtype == FP8
    same = L.DecodeLaunchConfig(kv_dtype="bfloat16", **kw)  # q's own dtype: stored as None
    assert same == L.DecodeLaunchConfig(**kw) and not same.fp8 and same.pool_dtype == "bfloat16"
    for bad in ("float8_e5m2", "uint8", "float16"):
        with pytest.raises(ValueError, match=rf"DecodeLaunchConfig.kv_dtype must be None .*"
                                             rf"got '{bad}'"):
            L.DecodeLaunchConfig(kv_dtype=bad, **kw)


_REAL_JAX_PATH = L.plan.jax_path


def _pool_words_path(cfg, view):
    """A JAX path for `cfg` (fp8, one split) whose Pallas call reads the pool through `view`
    (applied inside an inner jit, as `decode_call` would), with operands in mla_decode's order
    and results of its shapes; the kernel body only writes its outputs."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b, rows, d, dv = cfg.num_seqs, cfg.rows_pad, cfg.head_dim, cfg.v_head_dim

    def kernel(indptr_ref, table_ref, q_ref, pool_ref, ks_ref, vs_ref, o_ref, lse_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        lse_ref[...] = jnp.zeros(lse_ref.shape, lse_ref.dtype)

    @jax.jit
    def inner(q, kv_pool, kv_indptr, kv_indices, k_scale, v_scale):
        pool = view(kv_pool)
        full = lambda shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))  # noqa
        return pl.pallas_call(
            kernel, grid=(1, 1, b),
            in_specs=[full(kv_indptr.shape), full(kv_indices.shape),
                      pl.BlockSpec((None, rows, d), lambda i, j, k: (k, i, 0)), full(pool.shape),
                      full((1,)), full((1,))],
            out_specs=[pl.BlockSpec((None, None, rows, dv), lambda i, j, k: (k, j, i, 0)),
                       pl.BlockSpec((None, None, rows), lambda i, j, k: (k, j, i))],
            out_shape=[jax.ShapeDtypeStruct((b, 1, rows, dv), jnp.bfloat16),
                       jax.ShapeDtypeStruct((b, 1, rows), jnp.float32)],
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            name="pool_words",
        )(kv_indptr, kv_indices, q.reshape(b, rows, d), pool, k_scale, v_scale)

    return inner, _REAL_JAX_PATH(cfg)[1]


@needs_lowering
def test_pool_bitcast_in_front_of_the_kernel_is_wired_to_the_pool(monkeypatch):
    """The fp8 pool bitcast to uint16 [slots, 288] inside the JAX path (the same bytes) before
    the Pallas call: the plan traces the operand back through the bitcast, the reshape and the
    inner jit to the launcher's pool, and the launcher passes the pool's own pointer there.
    A computed operand (a slice of the pool: other bytes) is refused."""
    import jax.numpy as jnp
    from jax import lax
    import torch

    from tests.test_launcher_launch import _FakeKernel, _Recorder

    cfg = fp8_config(16, 1, b=2, ctx=64, num_splits=1)
    slots = cfg.pool_rows

    def words(pool):
        return lax.bitcast_convert_type(pool.reshape(slots, 288, 2), jnp.uint16)

    L.plan._decode_plan.cache_clear()
    try:
        monkeypatch.setattr(L.plan, "jax_path", lambda c: _pool_words_path(c, words))
        plan = L.decode_plan(cfg)
        assert plan.decode.name == "pool_words"
        assert plan.decode.operands[3] == ((slots, 288), "ui16") and plan.decode.sources[3] == 1
        assert plan.decode_inputs == ("kv_indptr", "kv_indices", "q", "kv_pool", "k_scale",
                                      "v_scale")
        rec = _Recorder()
        lau = L.DecodeLauncher(plan, "cpu",
                               kernel_factory=lambda c, i, a: _FakeKernel(c, i, a, rec.num_params),
                               stream_fn=lambda i: 1, launch_address=rec.address)
        q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
        kv = torch.zeros(slots, 576, dtype=torch.float8_e4m3fn)
        indptr, indices = torch.zeros(3, dtype=torch.int32), torch.zeros(128, dtype=torch.int32)
        ks = torch.full((1,), 0.25)
        out, lse = lau(q, kv, indptr, indices, k_scale=ks, v_scale=0.5)
        params = rec.launches[0][5]
        assert params[:5] == (indptr.data_ptr(), indices.data_ptr(), q.data_ptr(), kv.data_ptr(),
                              ks.data_ptr())
        v_copy = lau._scales(0.5, None)[0]  # the float's device copy
        assert params[5] == v_copy.data_ptr() and v_copy.item() == 0.5
        assert params[6:8] == (out.data_ptr(), lse.data_ptr())

        L.plan._decode_plan.cache_clear()
        monkeypatch.setattr(L.plan, "jax_path",
                            lambda c: _pool_words_path(c, lambda p: words(p)[1:]))
        with pytest.raises(L.LauncherUnavailable, match="operand 3 .* is computed"):
            L.decode_plan(cfg)
    finally:
        L.plan._decode_plan.cache_clear()
