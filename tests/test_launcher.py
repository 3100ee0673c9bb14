"""The torch launcher (funcmla.interop.launcher).

CPU (always): the protobuf and PTX readers against hand-built inputs, the kernels extracted from
a CUDA lowering against the decode kernel's documented grid and signature, plan caching, config
validation, argument checks (every misuse names the argument and launches nothing, with a
recording fake in place of the CUDA kernels), and the launcher's own Pallas kernels (kv_lens,
merge) in interpret mode against NumPy.
GPU (skipped without CUDA torch + JAX GPU): bit-identity with `mla_decode`, CUDA-graph capture and
replay with new data, misuse on the device.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas import DecodeKernelConfig
from funcmla.interop import launcher as L

SCALE = 0.1352337788608801


# ----------------------------------------------------------------------------- protobuf
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, value) -> bytes:
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value)
    return _varint(num << 3 | 2) + _varint(len(value)) + value


def _kernel_call(params: list[bytes], *, name="k", ptx="PTX", warps=4, smem=1024,
                 grid=(3, 2, 5), num_ctas=None) -> bytes:
    kernel = (_field(1, name.encode()) + _field(2, warps) + _field(3, smem) + _field(4, ptx.encode())
              + _field(5, b"ttir") + _field(6, 90))
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


PTX = """
.version 8.7
.target sm_90a
.address_size 64
.extern .shared .align 16 .b8 global_smem[];
.visible .entry mla_decode_ps1_m16_kv64(
\t.param .u64 .ptr .global .align 1 mla_decode_ps1_m16_kv64_param_0,
\t.param .u64 .ptr .global .align 1 mla_decode_ps1_m16_kv64_param_1,
\t.param .u64 .ptr .global .align 1 mla_decode_ps1_m16_kv64_param_2
)
.reqntid 128
{
\tret;
}
"""


def test_ptx_entry_and_target():
    entry, params = L.ptx_entry_params(PTX, "mla_decode_ps1_m16_kv64")
    assert entry == "mla_decode_ps1_m16_kv64" and len(params) == 3
    assert all(p.endswith(f"_param_{i}") for i, p in enumerate(params))
    assert L.ptx_target(PTX) == "sm_90a"
    with pytest.raises(ValueError, match="expected one .entry other"):
        L.ptx_entry_params(PTX, "other")


# ----------------------------------------------------------------------------- plans
def _lowering_available() -> str | None:
    try:
        L.decode_plan(L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64,
                                           kv_capacity=32, sm_scale=SCALE))
    except RuntimeError as err:  # jaxlib > 0.10.2 without the CUDA plugin cannot compile
        return str(err)
    return None


needs_lowering = pytest.mark.skipif(_lowering_available() is not None,
                                    reason="no Pallas Triton lowering for CUDA on this install")


def _expected_splits(b, rows, max_kv, kc: DecodeKernelConfig) -> int:
    block_m = kc.block_m or min(64, max(16, 1 << (rows - 1).bit_length()))
    nrb = -(-rows // block_m)
    want = -(-kc.waves * kc.num_sms // (b * nrb))
    cap = max(1, (-(-max_kv // kc.block_kv)) // kc.min_blocks_per_split)
    return max(1, min(want, cap))


@needs_lowering
@pytest.mark.parametrize("b,h,s_q,max_kv,splits", [
    (4, 16, 1, 1024, None),   # split-KV with merge
    (300, 16, 1, 256, None),  # one split (many programs)
    (3, 8, 3, 256, None),     # rows 24 -> padded to 32
    (2, 128, 1, 512, 1),      # two row blocks, forced single split
])
def test_decode_plan_matches_the_kernel_contract(b, h, s_q, max_kv, splits):
    cap, pool = b * max_kv, b * max_kv + 64
    cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=pool,
                               kv_capacity=cap, max_kv_len=max_kv, num_splits=splits,
                               sm_scale=SCALE)
    plan = L.decode_plan(cfg)
    rows = s_q * h
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    nrb = -(-rows // block_m)
    s = splits or _expected_splits(b, rows, max_kv, cfg.kernel)
    assert plan.num_splits == s
    assert plan.decode.grid == (nrb, s, b)
    assert plan.decode.num_warps == (4 if block_m <= 16 else 8)
    assert plan.decode.operands == (((b,), "i32"), ((b,), "i32"), ((cap,), "i32"),
                                    ((b, nrb * block_m, 576), "bf16"), ((pool, 576), "bf16"))
    assert plan.decode.results[1] == ((b, s, nrb * block_m), "f32")
    assert plan.prep.grid == (b, 1, 1) and plan.prep.operands == (((b + 1,), "i32"),)
    if s == 1:
        assert plan.merge is None
    else:
        assert plan.merge.grid == (b, nrb * block_m // L.MERGE_BLOCK_R, 1)
        assert plan.merge.results == (((b, nrb * block_m, 512), "bf16"),
                                      ((b, nrb * block_m), "f32"))
    assert len(plan.decode.ptr_divisibility) == 7
    assert all(d in (16, 32) for d in plan.decode.ptr_divisibility)


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
def test_extracted_kernels_compile_to_cubin_without_a_gpu():
    cfg = L.DecodeLaunchConfig(num_seqs=8, num_heads=16, pool_rows=4096, kv_capacity=2048,
                               max_kv_len=256, sm_scale=SCALE)
    plan = L.decode_plan(cfg)
    assert plan.merge is not None
    for call in (plan.prep, plan.decode, plan.merge):
        img = L.compile_call(call, "9.0")
        n = len(call.operands) + len(call.results)
        assert img.entry == call.name and n <= img.num_params <= n + 2
        assert img.image[:4] == b"\x7fELF"  # a cubin
        assert L.ptx_target(img.ptx).startswith("sm_90")
        entry, params = L.ptx_entry_params(img.ptx, img.entry)
        assert len(params) == img.num_params
    assert L.compile_call(plan.decode, "9.0").shared_mem_bytes > 48 * 1024
    assert L.compile_call(plan.prep, "9.0").shared_mem_bytes == 0


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
    assert L.decode_plan(c).decode.operands[2] == ((48,), "i32")


@pytest.mark.parametrize("field,value,match", [
    ("num_seqs", 0, "num_seqs"), ("num_heads", -1, "num_heads"), ("s_q", 1.5, "s_q"),
    ("pool_rows", True, "pool_rows"), ("max_kv_len", 0, "max_kv_len"),
    ("num_splits", -2, "num_splits"), ("dtype", "float32", "dtype"),
])
def test_config_rejects_bad_values(field, value, match):
    kw = dict(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32, sm_scale=SCALE)
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        L.DecodeLaunchConfig(**kw)


# ----------------------------------------------------------------------------- argument checks
def test_tensor_spec_accepts_and_names_each_misuse():
    spec = L.TensorSpec("q", torch.bfloat16, [(4, 16, 576)], -1)
    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    assert spec.pointer(q) == q.data_ptr()
    bad = {
        "must be torch.bfloat16, got torch.float32": q.float(),
        r"shape \[3, 16, 576\]": q[:3],
        "must be contiguous": q.transpose(0, 1).contiguous().transpose(0, 1),
        "not 16-byte aligned": torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape),
        "must be a torch.Tensor": np.zeros((4, 16, 576)),
    }
    for match, t in bad.items():
        with pytest.raises(L.LauncherArgumentError, match="q has " + match if "shape" in match
                           else match):
            spec.pointer(t)
    gpu_spec = L.TensorSpec("kv_pool", torch.bfloat16, [(4, 16, 576)], 0)
    with pytest.raises(L.LauncherArgumentError, match="kv_pool is on cpu; .*cuda:0"):
        gpu_spec.pointer(q)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       want=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       dtype=st.sampled_from([torch.int32, torch.int64, torch.bfloat16, torch.float32]))
def test_tensor_spec_raises_exactly_on_mismatch(shape, want, dtype):
    spec = L.TensorSpec("x", torch.int32, [tuple(want)], -1)
    t = torch.zeros(shape, dtype=dtype)
    ok = dtype == torch.int32 and list(shape) == list(want)
    if ok:
        assert spec.pointer(t) == t.data_ptr()
    else:
        with pytest.raises(L.LauncherArgumentError, match="^x "):
            spec.pointer(t)


class _FakeKernel:
    """Records launches and the pointers each one saw (stands in for LoadedKernel)."""

    log: list = []

    def __init__(self, call, device_index, arch):
        self.call = call
        self.args = [0] * (len(call.operands) + len(call.results) + 2)

    def launch(self, stream):
        _FakeKernel.log.append((self.call.name, tuple(self.args)))


def _fake_launcher(cfg):
    _FakeKernel.log = []
    return L.DecodeLauncher(L.decode_plan(cfg), "cpu", kernel_factory=_FakeKernel,
                            stream_fn=lambda i: 0)


def _cpu_inputs(cfg):
    t = cfg.num_seqs * cfg.s_q
    return (torch.zeros(t, cfg.num_heads, 576, dtype=torch.bfloat16),
            torch.zeros(cfg.pool_rows, 1, 576, dtype=torch.bfloat16),
            torch.zeros(cfg.num_seqs + 1, dtype=torch.int32),
            torch.zeros(cfg.kv_capacity, dtype=torch.int32))


@needs_lowering
@pytest.mark.parametrize("splits", [1, 4])
def test_launcher_wires_pointers_in_kernel_order(splits):
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               num_splits=splits, sm_scale=SCALE)
    lau = _fake_launcher(cfg)
    q, kv, indptr, indices = _cpu_inputs(cfg)
    out, lse = lau(q, kv, indptr, indices)
    assert out.shape == (2, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 16) and lse.dtype == torch.float32
    names = [name for name, _ in _FakeKernel.log]
    assert names == ["funcmla_kv_lens", lau.plan.decode.name] + (
        [lau.plan.merge.name] if splits > 1 else [])
    kv_lens = lau._kv_lens.data_ptr()
    assert _FakeKernel.log[0][1][:2] == (indptr.data_ptr(), kv_lens)
    dec = _FakeKernel.log[1][1]
    assert dec[:5] == (indptr.data_ptr(), kv_lens, indices.data_ptr(), q.data_ptr(),
                       kv.data_ptr())
    _FakeKernel.log = []
    lens = torch.zeros(2, dtype=torch.int32)
    lau(q, kv, indptr, indices, kv_lens=lens, out=out, lse=lse)
    names_lens = [name for name, _ in _FakeKernel.log]
    assert names_lens == names[1:]  # no prep launch
    assert _FakeKernel.log[0][1][1] == lens.data_ptr()
    with pytest.raises(L.LauncherArgumentError, match="kv_lens has shape"):
        lau(q, kv, indptr, indices, kv_lens=torch.zeros(3, dtype=torch.int32))
    final = _FakeKernel.log[-1][1]
    o_at = 5 if splits == 1 else 2
    assert final[o_at:o_at + 2] == (out.data_ptr(), lse.data_ptr())
    if splits > 1:
        assert dec[5:7] == (lau._o_part.data_ptr(), lau._lse_part.data_ptr())
        assert final[:2] == dec[5:7]


@needs_lowering
def test_misuse_raises_and_never_launches():
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               num_splits=2, sm_scale=SCALE)
    lau = _fake_launcher(cfg)
    q, kv, indptr, indices = _cpu_inputs(cfg)
    good = dict(q=q, kv_pool=kv, kv_indptr=indptr, kv_indices=indices, out=None, lse=None)
    cases = {
        "q must be torch.bfloat16": dict(q=q.half()),
        "kv_pool has shape": dict(kv_pool=kv[:-1]),
        "kv_indptr must be torch.int32": dict(kv_indptr=indptr.long()),
        "kv_indices has shape": dict(kv_indices=indices[:-1]),
        "q must be contiguous": dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)),
        "out has shape": dict(out=torch.zeros(2, 16, 511, dtype=torch.bfloat16)),
        "lse must be torch.float32": dict(lse=torch.zeros(2, 16, dtype=torch.bfloat16)),
    }
    for match, change in cases.items():
        kw = {**good, **change}
        with pytest.raises(L.LauncherArgumentError, match=match):
            lau(kw["q"], kw["kv_pool"], kw["kv_indptr"], kw["kv_indices"], out=kw["out"],
                lse=kw["lse"])
    assert _FakeKernel.log == []


@needs_lowering
def test_padded_rows_copy_through_scratch():
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=8, s_q=3, pool_rows=64, kv_capacity=32,
                               num_splits=1, sm_scale=SCALE)
    lau = _fake_launcher(cfg)
    assert lau.padded and cfg.rows_pad == 32
    q, kv, indptr, indices = _cpu_inputs(cfg)
    q.copy_(torch.arange(q.numel()).reshape(q.shape).to(torch.bfloat16))
    lau._out_pad.fill_(3.0)
    lau._lse_pad.fill_(5.0)
    out, lse = lau(q, kv, indptr, indices)
    assert torch.equal(lau._q_pad[:, :24], q.view(2, 24, 576))
    assert bool((lau._q_pad[:, 24:] == 0).all())
    assert _FakeKernel.log[1][1][3] == lau._q_pad.data_ptr()
    assert bool((out == 3).all()) and bool((lse == 5).all())


def test_torch_decode_reports_why_it_cannot_run():
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    ip, ix = torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    assert "not a torch.Tensor" in L.torch_decode_unsupported_reason(np.zeros(3), q, ip, ix)
    assert "q is on cpu" in L.torch_decode_unsupported_reason(q, q, ip, ix)
    with pytest.raises(L.LauncherUnavailable, match="q is on cpu"):
        L.torch_decode(q, q, ip, ix, sm_scale=SCALE)


# ----------------------------------------------------------------------------- own kernels
def test_kv_lens_kernel_interpret():
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 50, size=7)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    got = np.asarray(L.kv_lens_pallas(jnp.asarray(indptr), interpret=True))
    np.testing.assert_array_equal(got, lens)


def _merge_oracle(o, lse):
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    m = lse.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m[:, None])
    total = w.sum(axis=1)
    out = (w[..., None] * o).sum(axis=1) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse_out = np.where(total > 0, m + np.log(np.where(total > 0, total, 1.0)), np.inf)
    return out, lse_out


@settings(max_examples=12, deadline=None)
@given(splits=st.integers(1, 5), seed=st.integers(0, 2**16), empty=st.floats(0, 0.6))
def test_merge_kernel_interpret_matches_float64(splits, seed, empty):
    rng = np.random.default_rng(seed)
    b, r, dv = 2, 16, 32
    o = rng.standard_normal((b, splits, r, dv)).astype(np.float32)
    lse = (rng.standard_normal((b, splits, r)) * 4).astype(np.float32)
    dead = rng.random((b, splits, r)) < empty
    lse[dead] = -np.inf
    o[dead] = 0.0
    out, lse_out = L.merge_splits_pallas(jnp.asarray(o), jnp.asarray(lse), jnp.float32,
                                         interpret=True)
    ref_out, ref_lse = _merge_oracle(o, lse)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse_out)), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse_out)[fin], ref_lse[fin], rtol=1e-6, atol=1e-6)


def test_merge_rejects_unaligned_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        L.merge_splits_pallas(jnp.zeros((1, 2, 8, 32)), jnp.zeros((1, 2, 8)), jnp.float32,
                              interpret=True)


# ----------------------------------------------------------------------------- GPU
def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA torch"
    if jax.devices()[0].platform != "gpu":
        return "JAX has no GPU"
    return L.launcher_unavailable_reason()


gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


def _gpu_batch(cfg, seed):
    rng = np.random.default_rng(seed)
    dev = torch.device("cuda", 0)
    lens = rng.integers(1, min(cfg.resolved_max_kv_len, cfg.kv_capacity // cfg.num_seqs) + 1,
                        size=cfg.num_seqs)
    lens[0] = 0
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(cfg.kv_capacity, np.int32)
    indices[: indptr[-1]] = rng.integers(0, cfg.pool_rows, size=indptr[-1])
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(cfg.num_seqs * cfg.s_q, cfg.num_heads, 576, device=dev,
                    generator=g).to(torch.bfloat16)
    kv = torch.randn(cfg.pool_rows, 576, device=dev, generator=g).to(torch.bfloat16)
    return q, kv, torch.from_numpy(indptr).to(dev), torch.from_numpy(indices).to(dev)


def _jax_path(cfg, q, kv, indptr, indices):
    from funcmla.attention.pallas import mla_decode

    out, lse = mla_decode(jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv),
                          kv_indptr=jax.dlpack.from_dlpack(indptr),
                          kv_indices=jax.dlpack.from_dlpack(indices), sm_scale=cfg.sm_scale,
                          s_q=cfg.s_q, num_splits=cfg.num_splits,
                          max_kv_len=cfg.resolved_max_kv_len)
    return torch.from_dlpack(out), torch.from_dlpack(lse)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,h,s_q", [(8, 16, 1), (4, 128, 1), (3, 8, 3)])
def test_gpu_single_split_is_bit_identical_to_jax(b, h, s_q):
    cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=8192,
                               kv_capacity=b * 512, max_kv_len=512, num_splits=1,
                               sm_scale=SCALE)
    lau = L.decode_launcher(cfg)
    q, kv, indptr, indices = _gpu_batch(cfg, 1)
    out, lse = lau(q, kv, indptr, indices)
    ref_out, ref_lse = _jax_path(cfg, q, kv, indptr, indices)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), ref_lse.view(torch.int32))
    out3, lse3 = L.torch_decode(q, kv, indptr, indices, sm_scale=SCALE, s_q=s_q, max_kv_len=512,
                                num_splits=1)
    assert torch.equal(out3.view(torch.int16), out.view(torch.int16))
    out2, lse2 = lau(q, kv, indptr, indices, kv_lens=(indptr[1:] - indptr[:-1]).contiguous())
    torch.cuda.synchronize()
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))
    assert torch.equal(lse2.view(torch.int32), lse.view(torch.int32))


@gpu
@pytest.mark.gpu
def test_gpu_split_kv_agrees_with_jax():
    cfg = L.DecodeLaunchConfig(num_seqs=4, num_heads=16, pool_rows=8192, kv_capacity=4 * 1024,
                               max_kv_len=1024, sm_scale=SCALE)
    lau = L.decode_launcher(cfg)
    assert lau.plan.num_splits > 1
    q, kv, indptr, indices = _gpu_batch(cfg, 2)
    out, lse = lau(q, kv, indptr, indices)
    ref_out, ref_lse = _jax_path(cfg, q, kv, indptr, indices)
    torch.cuda.synchronize()
    diff = (out.view(torch.int16).long() - ref_out.view(torch.int16).long()).abs().max()
    assert int(diff) <= 1  # at most one bf16 ulp (the merge's rounding; docs/torch_launcher.md)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.gpu
def test_gpu_graph_replay_runs_the_kernels_on_new_data():
    cfg = L.DecodeLaunchConfig(num_seqs=4, num_heads=16, pool_rows=8192, kv_capacity=4 * 512,
                               max_kv_len=512, sm_scale=SCALE)
    lau = L.decode_launcher(cfg)
    layers = 3
    q, kv, indptr, indices = _gpu_batch(cfg, 3)
    qs = [q.clone() for _ in range(layers)]
    outs = [torch.empty(4, 16, 512, dtype=torch.bfloat16, device=q.device) for _ in range(layers)]
    lses = [torch.empty(4, 16, device=q.device) for _ in range(layers)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lau(qs[0], kv, indptr, indices, out=outs[0], lse=lses[0])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            lau(qs[i], kv, indptr, indices, out=outs[i], lse=lses[i])
    nq, _, nindptr, nindices = _gpu_batch(cfg, 4)
    for i in range(layers):
        qs[i].copy_(nq * (i + 1))
    indptr.copy_(nindptr)
    indices.copy_(nindices)
    g.replay()
    torch.cuda.synchronize()
    for i in range(layers):
        ro, rl = lau(qs[i], kv, indptr, indices)
        torch.cuda.synchronize()
        assert torch.equal(outs[i].view(torch.int16), ro.view(torch.int16))
        assert torch.equal(lses[i].view(torch.int32), rl.view(torch.int32))


@gpu
@pytest.mark.gpu
def test_gpu_misuse_leaves_outputs_untouched():
    cfg = L.DecodeLaunchConfig(num_seqs=4, num_heads=16, pool_rows=8192, kv_capacity=4 * 512,
                               max_kv_len=512, sm_scale=SCALE)
    lau = L.decode_launcher(cfg)
    q, kv, indptr, indices = _gpu_batch(cfg, 5)
    out = torch.full((4, 16, 512), 7.0, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((4, 16), 7.0, device=q.device)
    for bad in (dict(q=q.float()), dict(q=q.cpu()), dict(indices=indices[:-1]),
                dict(q=q.transpose(0, 1).contiguous().transpose(0, 1))):
        a = {"q": q, "indices": indices, **bad}
        with pytest.raises(L.LauncherArgumentError):
            lau(a["q"], kv, indptr, a["indices"], out=out, lse=lse)
    torch.cuda.synchronize()
    assert bool((out == 7).all()) and bool((lse == 7).all())
    assert math.isfinite(float(out.float().sum()))


# ----------------------------------------------------------------------------- driver layer
class _FakeLibcuda:
    """libcuda stand-in: the driver functions as ctypes callbacks, so the real ctypes
    marshaling (argument order, pointer arrays, out-parameters) is exercised without a GPU."""

    def __init__(self):
        import ctypes as C

        vp, ui, i, P = C.c_void_p, C.c_uint, C.c_int, C.POINTER
        self.calls, self.launches, self.launch_codes = [], [], []
        self.current = 0
        proto = lambda *a: C.CFUNCTYPE(i, *a)  # noqa: E731

        def out(ptr, ctype, value):
            C.cast(ptr, P(ctype))[0] = value

        def device_get(dev, ordinal):
            out(dev, i, ordinal)
            return 0

        def attribute(value, attr, dev):
            out(value, i, 232448 if attr == 97 else -1)
            return 0

        def retain(ctx, dev):
            out(ctx, vp, 0x1000 + dev)
            return 0

        def get_current(ctx):
            out(ctx, vp, self.current)
            return 0

        def set_current(ctx):
            self.current = ctx or 0
            self.calls.append(("set_current", ctx))
            return 0

        def load(module, image, n, opts, vals):
            self.calls.append(("load", C.string_at(image)[:16], n))
            out(module, vp, 0x2000)
            return 0

        def get_function(fn, module, name):
            self.calls.append(("get_function", module, C.string_at(name).decode()))
            out(fn, vp, 0x3000)
            return 0

        def func_get(value, attr, fn):
            out(value, i, 42)
            return 0

        def func_set(fn, attr, value):
            self.calls.append(("func_set", fn, attr, value))
            return 0

        names = {0: b"CUDA_SUCCESS", 201: b"CUDA_ERROR_INVALID_CONTEXT",
                 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}
        self._names = {k: C.c_char_p(v) for k, v in names.items()}

        def err_name(code, s):
            out(s, C.c_char_p, self._names.get(code, self._names[700]).value)
            return 0

        def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            slots = C.cast(params, P(vp))
            n = self.expect_params
            values = tuple(C.cast(slots[k], P(vp))[0] for k in range(n))
            self.launches.append(((f, gx, gy, gz, bx, by, bz, smem, stream), values, extra))
            return self.launch_codes.pop(0) if self.launch_codes else 0

        self.expect_params = 0
        table = {
            "cuInit": (proto(ui), lambda flags: 0),
            "cuDeviceGet": (proto(P(i), i), device_get),
            "cuDeviceGetAttribute": (proto(P(i), i, i), attribute),
            "cuDevicePrimaryCtxRetain": (proto(P(vp), i), retain),
            "cuCtxGetCurrent": (proto(P(vp)), get_current),
            "cuCtxSetCurrent": (proto(vp), set_current),
            "cuModuleLoadDataEx": (proto(P(vp), C.c_char_p, ui, P(i), P(vp)), load),
            "cuModuleGetFunction": (proto(P(vp), vp, C.c_char_p), get_function),
            "cuFuncGetAttribute": (proto(P(i), i, vp), func_get),
            "cuFuncSetAttribute": (proto(vp, i, i), func_set),
            "cuGetErrorName": (proto(i, P(C.c_char_p)), err_name),
            "cuGetErrorString": (proto(i, P(C.c_char_p)), err_name),
            "cuLaunchKernel": (proto(vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp), launch),
        }
        self._keep = []
        for name, (factory, impl) in table.items():
            cfn = factory(impl)
            self._keep.append(cfn)
            setattr(self, name, cfn)


def test_loaded_kernel_launch_marshals_pointers_grid_and_stream(monkeypatch):
    from funcmla.interop import _cuda_driver

    fake = _FakeLibcuda()
    drv = _cuda_driver.Driver(fake)
    monkeypatch.setattr(_cuda_driver, "driver", lambda: drv)
    monkeypatch.setattr(L, "_ptxas_candidates", lambda: [])  # image = PTX for the driver's JIT
    call = L.TritonCall(name="mla_decode_ps1_m16_kv64", grid=(1, 8, 4), num_warps=4,
                        num_stages=2, num_ctas=1, shared_mem_bytes=70000,
                        operands=(((4,), "i32"),), results=(((4,), "i32"), ((4,), "f32")),
                        ptr_divisibility=(16, 16, 16), ptx=PTX)
    k = L.LoadedKernel(call, 0, "9.0")
    assert k.num_params == 3 and k.how.startswith("driver-jit") and k.num_regs == 42
    assert ("get_function", 0x2000, "mla_decode_ps1_m16_kv64") in fake.calls
    assert ("func_set", 0x3000, 8, 70000) in fake.calls  # dynamic smem above 48 KiB
    assert fake.calls[0][0] == "set_current"  # primary context made current before loading
    for j, ptr in enumerate((0xA00, 0xB00, 0xC00)):
        k.args[j] = ptr
    fake.expect_params = 3
    k.launch(0x5EED)
    (cfg, values, extra), = fake.launches
    assert cfg == (0x3000, 1, 8, 4, 128, 1, 1, 70000, 0x5EED)
    assert values == (0xA00, 0xB00, 0xC00) and extra is None
    fake.launch_codes = [201, 0]  # no context on this thread: made current, retried once
    fake.current = 0
    k.launch(7)
    assert len(fake.launches) == 3 and fake.calls[-1] == ("set_current", 0x1000)
    fake.launch_codes = [700]
    with pytest.raises(_cuda_driver.CudaDriverError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
        k.launch(7)
