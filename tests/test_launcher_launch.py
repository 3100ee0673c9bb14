"""Launcher argument checks and launch programs (CPU): every misuse names the argument and
launches nothing; the pointer wiring of whole decode calls through the real launch program (the C
helper and the pure-ctypes path, with a recording cuLaunchKernel stand-in and a recording Mosaic
GPU host function); the driver layer against a fake libcuda.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas import DecodeKernelConfig
from funcmla.interop import _containers, _launch
from funcmla.interop import launcher as L
from tests.launcher_helpers import PTX, SCALE, _field, fp8_config, needs_lowering


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


# ----------------------------------------------------------------------------- launch programs
class _Recorder:
    """A cuLaunchKernel stand-in (a C-callable ctypes callback): records every launch with the
    parameter values the kernel would receive."""

    def __init__(self, num_params: dict[int, int] | None = None, codes=()):
        self.num_params = num_params if num_params is not None else {}
        self.launches, self.codes = [], list(codes)

        def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            arr = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            n = self.num_params.get(f, 0)
            vals = tuple(ctypes.cast(arr[k], ctypes.POINTER(ctypes.c_uint64))[0]
                         for k in range(n))
            self.launches.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, vals, extra))
            return self.codes.pop(0) if self.codes else 0

        self._cb = _launch.launch_function_type(launch)
        self.address = ctypes.cast(self._cb, ctypes.c_void_p).value


@pytest.mark.parametrize("native", [True, False])
def test_program_launches_masked_kernels_with_slot_values(native):
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    rec = _Recorder({0x11: 3, 0x22: 4})
    ks = [_launch.ProgramKernel("a", 0x11, (1, 2, 3), (128, 1, 1), 70000, [0, 1, 9]),
          _launch.ProgramKernel("b", 0x22, (4, 1, 1), (32, 1, 1), 0, [1, 2, 8, 9])]
    p = _launch.LaunchProgram(ks, 3, {8: 0xF00, 9: 0}, rec.address, native=native)
    assert p.native == native
    assert p.launch(0x55, 0b11, 0xA0, 0xB0, 0xC0) == 0
    assert rec.launches == [
        (0x11, (1, 2, 3), (128, 1, 1), 70000, 0x55, (0xA0, 0xB0, 0), None),
        (0x22, (4, 1, 1), (32, 1, 1), 0, 0x55, (0xB0, 0xC0, 0xF00, 0), None)]
    p.launch(0x56, 0b10, 0xA1, 0xB1, 0xC1)  # kernel a masked off
    assert len(rec.launches) == 3 and rec.launches[-1][4:6] == (0x56, (0xB1, 0xC1, 0xF00, 0))
    rec.codes = [0, 700]  # the second kernel fails: its index is reported
    assert p.launch(1, 0b11, 1, 2, 3) == 700 and p.failed_kernel is ks[1]
    with pytest.raises(ValueError, match="overlap"):
        _launch.LaunchProgram(ks, 9, {8: 0}, rec.address)


class _HostRecorder:
    """A Mosaic GPU host launch function stand-in (C-callable), in either argument convention:
    records (context, stream, buffers) of every call into the shared `log`."""

    def __init__(self, abi: int, num_buffers: int, log: list):
        self.abi = abi

        def direct(context, stream, buffers):
            arr = ctypes.cast(buffers, ctypes.POINTER(ctypes.c_uint64))
            log.append(("host", context, stream, tuple(arr[i] for i in range(num_buffers))))

        def packed(args):
            a = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p))
            deref = lambda p: ctypes.cast(p, ctypes.POINTER(ctypes.c_uint64))[0]  # noqa: E731
            direct(deref(a[0]), deref(a[1]), deref(a[2]))

        kind = _launch._HOST_FN[abi]
        self._cb = kind(direct) if abi == _launch.HOST_ABI_DIRECT else kind(packed)
        self.address = ctypes.cast(self._cb, ctypes.c_void_p).value


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("abi", [_launch.HOST_ABI_DIRECT, _launch.HOST_ABI_PACKED])
def test_program_calls_a_mosaic_host_function_between_driver_launches(native, abi):
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    rec = _Recorder({0x22: 2})
    host = _HostRecorder(abi, 4, rec.launches)
    ks = [_launch.ProgramKernel("mosaic", 0xC0DE, (0, 0, 0), (0, 0, 0), 0, [2, 0, 1, 9],
                                host=host.address, host_abi=abi),
          _launch.ProgramKernel("merge", 0x22, (4, 1, 1), (32, 1, 1), 0, [9, 1])]
    p = _launch.LaunchProgram(ks, 3, {9: 0xF00}, rec.address, native=native)
    assert p.launch(0x55, 0b11, 0xA0, 0xB0, 0xC0) == 0
    # the host function gets its context, torch's stream and the buffers in its order, and
    # runs before the next kernel of the program
    assert rec.launches == [("host", 0xC0DE, 0x55, (0xC0, 0xA0, 0xB0, 0xF00)),
                            (0x22, (4, 1, 1), (32, 1, 1), 0, 0x55, (0xF00, 0xB0), None)]
    assert p.launch(0x56, 0b01, 1, 2, 3) == 0 and rec.launches[-1] == (
        "host", 0xC0DE, 0x56, (3, 1, 2, 0xF00))
    with pytest.raises(ValueError, match="host_abi"):
        _launch.ProgramKernel("m", 1, (0, 0, 0), (0, 0, 0), 0, [0], host=1, host_abi=7)


def test_native_helper_layout_matches_ctypes():
    lib, how = _launch.native_library()
    if lib is None:
        pytest.skip(how)
    # the C side writes exactly len(ctypes_layout()) words (a shorter buffer overflows)
    assert _launch.native_layout(lib) == _launch.ctypes_layout()


_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), want_dtype=st.sampled_from(_DTYPES),
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       want=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       view=st.sampled_from(["plain", "transpose", "step", "offset", "unsqueeze"]))
def test_c_checks_agree_with_the_python_checks(dtype, want_dtype, shape, want, view):
    """For any tensor, the C helper's checks (through torch's shim) accept exactly what
    TensorSpec accepts, and then pass the same data pointer."""
    api, how = _launch.torch_api()
    if api is None:
        pytest.skip(how)
    base = torch.zeros([s + 1 for s in shape] if view == "step" else shape, dtype=dtype)
    if view == "transpose" and base.dim() > 1:
        t = base.transpose(0, -1)
    elif view == "step":
        t = base[tuple(slice(0, s) for s in shape)]
    elif view == "offset":
        t = torch.zeros(base.numel() + 1, dtype=dtype)[1:].view(shape)
    elif view == "unsqueeze":
        t = base.unsqueeze(0)
    else:
        t = base
    spec = L.TensorSpec("x", want_dtype, [tuple(want), (1,) + tuple(want)], -1, 8)
    try:
        ptr, ok = spec.pointer(t), True
    except L.LauncherArgumentError:
        ok = False
    rec = _Recorder({0x11: 1})
    p = _launch.LaunchProgram([_launch.ProgramKernel("k", 0x11, (1, 1, 1), (32, 1, 1), 0, [0])],
                              1, {}, rec.address, native=True)
    code = _launch.describe(api, torch.empty(1, dtype=want_dtype))[:3]
    p.enable_checks(api, [(*code, 7, [tuple(want), (1,) + tuple(want)])])
    p.pack(p.buffer, 0, 1, 1, t._cdata)
    rc = p.run_checked(p.ref)
    assert (rc == 0) == ok, (rc, ok, t.shape, t.stride(), t.dtype)
    if ok:
        assert rec.launches[0][5] == (ptr,)
    else:
        assert rc == _launch.BAD_ARGUMENT and p.bad_argument == 0 and rec.launches == []


def test_the_c_helper_reads_tensors_like_torch():
    api, how = _launch.torch_api()
    if api is None:
        pytest.skip(how)
    t = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)[1:, ::2, 1:]
    dtype, device_type, device_index, ndim, data, sizes, strides = _launch.describe(api, t)
    assert (ndim, data, sizes, strides) == (3, t.data_ptr(), (2, 2, 4), (20, 10, 1))
    assert device_index == -1 and device_type == _launch.describe(api, torch.zeros(1))[1]


class _FakeKernel:
    """Stands in for LoadedKernel: a handle per kernel, the call's grid/warps."""

    def __init__(self, call, device_index, arch, registry):
        self.call = call
        self.function = 0x1000 + len(registry)
        self.grid, self.block = call.grid, (32 * call.num_warps, 1, 1)
        self.shared_mem_bytes = 1000 + len(registry)
        self.num_params = len(call.operands) + len(call.results) + 2  # Triton's scratch
        registry[self.function] = self.num_params

    def info(self):
        return {"name": self.call.name}


def _fake_launcher(cfg, native=None, c_checks=True):
    """A launcher on the CPU with fake kernels and a recording cuLaunchKernel; c_checks=False
    forces the Python argument checks (what runs without the C helper or the torch shim)."""
    rec = _Recorder()
    cls = L.DecodeLauncher if cfg.page_size == 1 else L.PagedDecodeLauncher
    lau = cls(L.decode_plan(cfg), "cpu",
              kernel_factory=lambda c, i, a: _FakeKernel(c, i, a, rec.num_params),
              stream_fn=lambda i: 0x5EED, launch_address=rec.address, native=native)
    if c_checks and lau.padded is False and native is not False:
        assert lau.checks.startswith("C") or _launch.torch_api()[0] is None, lau.checks
    if not c_checks:
        lau._checked_hot = None
    return lau, rec


def _cpu_inputs(cfg):
    t = cfg.num_seqs * cfg.s_q
    q = torch.zeros(t, cfg.num_heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(cfg.pool_rows, 1, 576, dtype=getattr(torch, cfg.pool_dtype))
    if cfg.page_size == 1:
        return (q, kv, torch.zeros(cfg.num_seqs + 1, dtype=torch.int32),
                torch.zeros(cfg.kv_capacity, dtype=torch.int32))
    return (q, kv, torch.zeros(cfg.num_seqs, cfg.max_pages, dtype=torch.int32),
            torch.zeros(cfg.num_seqs, dtype=torch.int32))


@needs_lowering
@pytest.mark.parametrize("splits,page_size,native,c_checks", [
    (1, 1, True, True), (4, 1, True, True), (4, 1, True, False), (4, 1, False, False),
    (1, 16, True, True), (4, 16, True, False)])
def test_launcher_wires_pointers_in_kernel_order(splits, page_size, native, c_checks):
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    cap = 32 if page_size == 1 else 2 * 4
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=cap,
                               num_splits=splits, sm_scale=SCALE, page_size=page_size)
    lau, rec = _fake_launcher(cfg, native, c_checks)
    q, kv, x, y = _cpu_inputs(cfg)
    out, lse = lau(q, kv, x, y)
    assert out.shape == (2, 16, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 16) and lse.dtype == torch.float32
    dec = rec.launches[0]
    assert len(rec.launches) == (1 if splits == 1 else 2)
    assert dec[0] == lau.decode.function and dec[1] == lau.plan.decode.grid
    assert dec[3] == lau.decode.shared_mem_bytes and dec[4] == 0x5EED
    meta, table = (x, y) if page_size == 1 else (y, x)  # CSR: kv_indptr first; paged: lengths first
    assert dec[5][:4] == (meta.data_ptr(), table.data_ptr(), q.data_ptr(), kv.data_ptr())
    assert dec[5][6:] == (0, 0)  # Triton's scratch pointers: null
    if splits == 1:
        assert dec[5][4:6] == (out.data_ptr(), lse.data_ptr())
    else:
        parts = (lau._o_part.data_ptr(), lau._lse_part.data_ptr())
        assert dec[5][4:6] == parts
        mer = rec.launches[1]
        assert mer[0] == lau.merge.function and mer[1] == lau.plan.merge.grid
        assert mer[5] == parts + (out.data_ptr(), lse.data_ptr(), 0, 0)
    # given outputs are used as they are; a second call re-targets every pointer
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    q2 = q.clone()
    got = lau(q2, kv, x, y, out=out2, lse=lse2)
    assert got[0] is out2 and got[1] is lse2
    last = rec.launches[-1][5]
    assert (out2.data_ptr(), lse2.data_ptr()) == (last[4:6] if splits == 1 else last[2:4])
    first_of_call = rec.launches[-1 if splits == 1 else -2][5]
    assert first_of_call[2] == q2.data_ptr()

    class Sub(torch.Tensor):  # a tensor subclass (its _cdata goes through __torch_function__)
        pass

    lau(q2.as_subclass(Sub), kv, x, y, out=out2, lse=lse2)
    assert rec.launches[-1 if splits == 1 else -2][5][2] == q2.data_ptr()


@needs_lowering
class _FakeMosaic:
    """Stands in for MosaicKernel: a context handle and a recording host launch function."""

    def __init__(self, call, log, abi=_launch.HOST_ABI_DIRECT):
        self.call, self.function = call, 0xC0DE
        self.num_params = len(call.operands) + len(call.results)
        self._host = _HostRecorder(abi, self.num_params, log)
        self.host, self.host_abi = self._host.address, abi
        self.grid, self.block, self.shared_mem_bytes = (0, 0, 0), (0, 0, 0), 0

    def info(self):
        return {"name": self.call.name}


@needs_lowering
@pytest.mark.parametrize("splits,page_size,native,c_checks", [
    (1, 1, True, True), (2, 1, True, True), (2, 16, True, False), (2, 1, False, False)])
def test_mosaic_launcher_wires_the_host_function_then_the_merge(splits, page_size, native,
                                                                c_checks):
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    b, h, ctx = 2, 64, 256
    cfg = L.DecodeLaunchConfig(num_seqs=b, num_heads=h, pool_rows=b * ctx + 4 * page_size,
                               kv_capacity=b * ctx // page_size, num_splits=splits, sm_scale=SCALE,
                               page_size=page_size, kernel=DecodeKernelConfig(kernel="mgpu"))
    plan = L.decode_plan(cfg)
    assert plan.kernel == "mgpu"
    rec = _Recorder()

    def factory(call, index, arch):
        if isinstance(call, L.MosaicCall):
            return _FakeMosaic(call, rec.launches)
        return _FakeKernel(call, index, arch, rec.num_params)

    cls = L.DecodeLauncher if page_size == 1 else L.PagedDecodeLauncher
    lau = cls(plan, "cpu", kernel_factory=factory, stream_fn=lambda i: 0x5EED,
              launch_address=rec.address, native=native)
    if not c_checks:
        lau._checked_hot = None
    # TMA needs 16-byte addresses; the Triton merge's IR declares 32-byte divisibility
    assert not lau.padded and lau.align == (16 if splits == 1 else 32)
    assert lau.info()["kernel"] == "mgpu" and lau.info()["kernel_reason"] is None
    q, kv, x, y = _cpu_inputs(cfg)
    out, lse = lau(q, kv, x, y)
    meta, table = (x, y) if page_size == 1 else (y, x)
    head = (meta.data_ptr(), table.data_ptr(), q.data_ptr(), kv.data_ptr())
    if splits == 1:
        assert rec.launches == [("host", 0xC0DE, 0x5EED,
                                 head + (out.data_ptr(), lse.data_ptr()))]
    else:
        parts = (lau._o_part.data_ptr(), lau._lse_part.data_ptr())
        assert rec.launches[0] == ("host", 0xC0DE, 0x5EED, head + parts)
        mer = rec.launches[1]
        assert mer[0] == lau.merge.function and mer[5] == parts + (
            out.data_ptr(), lse.data_ptr(), 0, 0)
    n = len(rec.launches)
    with pytest.raises(L.LauncherArgumentError, match="q"):
        lau(q.float(), kv, x, y)
    assert len(rec.launches) == n  # a refused call launches nothing


@needs_lowering
@pytest.mark.parametrize("c_checks", [True, False])
def test_misuse_raises_and_never_launches(c_checks):
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               num_splits=2, sm_scale=SCALE)
    lau, rec = _fake_launcher(cfg, c_checks=c_checks)
    q, kv, indptr, indices = _cpu_inputs(cfg)
    good = dict(q=q, kv_pool=kv, kv_indptr=indptr, kv_indices=indices, out=None, lse=None)
    qbig = torch.zeros(q.numel() + 8, dtype=q.dtype)
    cases = {
        "q must be torch.bfloat16": dict(q=q.half()),
        "kv_pool has shape": dict(kv_pool=kv[:-1]),
        "kv_indptr must be torch.int32": dict(kv_indptr=indptr.long()),
        "kv_indices has shape": dict(kv_indices=indices[:-1]),
        "q must be contiguous": dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)),
        "q data pointer .* not 32-byte aligned": dict(q=qbig[1:1 + q.numel()].view(q.shape)),
        "out has shape": dict(out=torch.zeros(2, 16, 511, dtype=torch.bfloat16)),
        "lse must be torch.float32": dict(lse=torch.zeros(2, 16, dtype=torch.bfloat16)),
        "kv_indices must be a torch.Tensor": dict(kv_indices=np.zeros(32, np.int32)),
    }
    for match, change in cases.items():
        kw = {**good, **change}
        with pytest.raises(L.LauncherArgumentError, match=match):
            lau(kw["q"], kw["kv_pool"], kw["kv_indptr"], kw["kv_indices"], out=kw["out"],
                lse=kw["lse"])
    assert rec.launches == []
    lau(q, kv.view(64, 576), indptr, indices)  # another accepted pool view: launches
    lau(q, kv, indptr, indices)  # and back
    assert len(rec.launches) == 4


# ----------------------------------------------------------------------------- fp8 scales
@needs_lowering
@pytest.mark.parametrize("h,page_size,native,c_checks", [
    (16, 1, True, True), (16, 64, True, False), (128, 1, False, False)])
def test_fp8_launcher_wires_scale_tensors_and_float_copies(h, page_size, native, c_checks):
    """The decode kernel's scale operands get the scale tensors' pointers, or a float's device
    copy (holding the float; one per distinct value, reused); v_scale defaults to k_scale,
    k_scale to 1. The merge and the other operands are wired as for a bf16 pool."""
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    cfg = fp8_config(h, page_size)
    lau, rec = _fake_launcher(cfg, native, c_checks)
    q, kv, x, y = _cpu_inputs(cfg)
    assert kv.dtype == torch.float8_e4m3fn
    ks, vs = torch.tensor(0.3), torch.full((1,), 0.7)
    split = lau.plan.num_splits > 1

    def scale_params(**kw):
        out, lse = lau(q, kv, x, y, **kw)
        dec = rec.launches[-2 if split else -1][5]
        meta, table = (x, y) if page_size == 1 else (y, x)
        assert dec[:4] == (meta.data_ptr(), table.data_ptr(), q.data_ptr(), kv.data_ptr())
        outs = (lau._o_part.data_ptr(), lau._lse_part.data_ptr()) if split else (
            out.data_ptr(), lse.data_ptr())
        assert dec[6:] == outs + (0, 0)
        if split:
            assert rec.launches[-1][5] == outs + (out.data_ptr(), lse.data_ptr(), 0, 0)
        return dec[4:6]

    assert scale_params(k_scale=ks, v_scale=vs) == (ks.data_ptr(), vs.data_ptr())
    k_ptr, v_ptr = scale_params(k_scale=0.25, v_scale=0.5)
    copies = {t.data_ptr(): t for t in lau._scales.floats.cache.values()}
    assert copies[k_ptr].item() == 0.25 and copies[v_ptr].item() == 0.5
    assert copies[k_ptr].dtype == torch.float32 and copies[k_ptr].shape == (1,)
    n = len(copies)
    assert scale_params(k_scale=0.25, v_scale=0.5) == (k_ptr, v_ptr)  # cached: no new copy
    assert scale_params(k_scale=np.float32(0.25)) == (k_ptr, k_ptr)  # v_scale = k_scale
    assert len(lau._scales.floats.cache) == n
    one, _ = scale_params()
    assert one == lau._scales.one.data_ptr() and lau._scales.one.item() == 1.0
    assert scale_params(v_scale=vs) == (one, vs.data_ptr())


@needs_lowering
@pytest.mark.parametrize("c_checks", [True, False])
def test_fp8_scale_misuse_raises_and_never_launches(c_checks):
    cfg = fp8_config(16, 1)
    lau, rec = _fake_launcher(cfg, c_checks=c_checks)
    q, kv, x, y = _cpu_inputs(cfg)
    spare = torch.zeros(16)
    cases = {
        r"k_scale must be torch.float32, got torch.float64": dict(k_scale=torch.ones(1).double()),
        r"v_scale has shape \[2\]; the compiled configuration takes \[\] or \[1\]":
            dict(v_scale=torch.ones(2)),
        r"k_scale data pointer .* not 32-byte aligned": dict(k_scale=spare[1:2]),
        r"k_scale=\[-1.0\] must be a positive finite float": dict(k_scale=-1.0),
        r"v_scale=\[0.0\] must be a positive finite float": dict(v_scale=0.0),
        r"k_scale=\[inf\] must be": dict(k_scale=1e39),  # beyond float32
        r"v_scale=\[nan\] must be": dict(v_scale=float("nan")),
        r"k_scale must be a float or a float32 torch tensor .* got str": dict(k_scale="0.5"),
        r"v_scale must be a float or a float32 torch tensor .* got bool": dict(v_scale=True),
        r"kv_pool must be torch.float8_e4m3fn, got torch.bfloat16":
            dict(kv=kv.to(torch.bfloat16)),
    }
    for match, change in cases.items():
        kw = {"kv": kv, **change}
        pool = kw.pop("kv")
        with pytest.raises(L.LauncherArgumentError, match=match):
            lau(q, pool, x, y, **kw)
    assert rec.launches == []
    bf16, brec = _fake_launcher(L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64,
                                                     kv_capacity=32, sm_scale=SCALE))
    with pytest.raises(L.LauncherArgumentError, match="v_scale applies to an fp8 kv_pool; this "
                                                      "launcher's pool is bfloat16"):
        bf16(*_cpu_inputs(bf16.config), v_scale=torch.ones(1))
    assert brec.launches == []


def test_float_scales_keep_one_copy_per_value_and_refuse_a_new_one_in_capture(monkeypatch):
    from funcmla.interop.launcher import scales as S

    fs = S.FloatScales("cpu")
    a = fs.tensor("k_scale", 0.125)
    assert fs.tensor("v_scale", 0.125) is a and a.item() == 0.125 and a.device.type == "cpu"
    # a device's copies under a stream capture: a known value is served, a new one refused
    cuda = S.FloatScales(torch.device("cuda", 0))
    cuda.cache[0.5] = a
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cuda.tensor("k_scale", 0.5) is a
    with pytest.raises(L.LauncherArgumentError, match=r"k_scale=0.75 is a float the launcher "
                                                      r"has not seen before, passed during a CUDA "
                                                      r"graph capture"):
        cuda.tensor("k_scale", 0.75)
    monkeypatch.setattr(S, "MAX_FLOAT_SCALES", 2)
    fs.tensor("k_scale", 2.0)
    with pytest.raises(L.LauncherArgumentError, match=r"v_scale=3.0: 2 distinct float scales "
                                                      r"are already kept on cpu"):
        fs.tensor("v_scale", 3.0)
    assert S.float_scales("cpu") is S.float_scales(torch.device("cpu"))


@needs_lowering
def test_padded_rows_copy_through_scratch():
    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=8, s_q=3, pool_rows=64, kv_capacity=32,
                               num_splits=1, sm_scale=SCALE)
    lau, rec = _fake_launcher(cfg)
    assert lau.padded and cfg.rows_pad == 32
    q, kv, indptr, indices = _cpu_inputs(cfg)
    q.copy_(torch.arange(q.numel()).reshape(q.shape).to(torch.bfloat16))
    lau._out_pad.fill_(3.0)
    lau._lse_pad.fill_(5.0)
    out, lse = lau(q, kv, indptr, indices)
    assert torch.equal(lau._q_pad[:, :24], q.view(2, 24, 576))
    assert bool((lau._q_pad[:, 24:] == 0).all())
    params = rec.launches[0][5]
    assert params[2] == lau._q_pad.data_ptr()
    assert params[4:6] == (lau._out_pad.data_ptr(), lau._lse_pad.data_ptr())
    assert bool((out == 3).all()) and bool((lse == 5).all())


@needs_lowering
def test_launch_error_names_the_kernel(monkeypatch):
    from funcmla.interop import _cuda_driver

    cfg = L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64, kv_capacity=32,
                               num_splits=2, sm_scale=SCALE)
    lau, rec = _fake_launcher(cfg)

    class _Drv:
        def check_launch(self, code, name):
            raise _cuda_driver.CudaDriverError(f"cuLaunchKernel({name})", code, "E", "t")

    monkeypatch.setattr(_cuda_driver, "driver", lambda: _Drv())
    rec.codes = [0, 700]
    with pytest.raises(_cuda_driver.CudaDriverError, match=lau.plan.merge.name):
        lau(*_cpu_inputs(cfg))


def test_torch_decode_reports_why_it_cannot_run():
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    ip, ix = torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    assert "not a torch.Tensor" in L.torch_decode_unsupported_reason(np.zeros(3), q, ip, ix)
    assert "q is on cpu" in L.torch_decode_unsupported_reason(q, q, ip, ix)
    with pytest.raises(L.LauncherUnavailable, match="q is on cpu"):
        L.torch_decode(q, q, ip, ix, sm_scale=SCALE)


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
    # no ptxas: the image is the PTX, for the driver's JIT
    monkeypatch.setattr(L.compile, "_ptxas_candidates", lambda: [])
    call = L.TritonCall(name="mla_decode_ps1_m16_kv64", grid=(1, 8, 4), num_warps=4,
                        num_stages=2, num_ctas=1, shared_mem_bytes=70000,
                        operands=(((4,), "i32"),), results=(((4,), "i32"), ((4,), "f32")),
                        ptr_divisibility=(16, 16, 16), ptx=PTX)
    k = L.LoadedKernel(call, 0, "9.0")
    assert drv.launch_address == ctypes.cast(fake.cuLaunchKernel, ctypes.c_void_p).value
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
    # XLA's shared-memory figure unknown: the kernel gets all a block may have (opt-in max
    # 232448 B in the fake, minus its 42 B of static shared memory)
    img = L.CompiledImage(PTX.encode() + b"\0", "mla_decode_ps1_m16_kv64", 3, None, "xla", PTX,
                          "xla")
    k2 = L.LoadedKernel(call, 0, "9.0", img)
    assert k2.shared_mem_bytes == 232448 - 42 and "device maximum" in k2.how
    assert ("func_set", 0x3000, 8, 232448 - 42) in fake.calls


def test_protobuf_wire_reader():
    # Shared by the kernel-call parser and the executable reader (interop/_containers.py).
    msg = _field(1, 150) + _field(2, b"abc") + bytes([0x18]) + b"\xff" * 9 + b"\x01"  # -1
    assert _containers.proto_fields(msg) == [(1, 0, 150), (2, 2, b"abc"), (3, 0, 2**64 - 1)]
    assert _containers.try_proto_fields(b"\x0a\x05ab") is None  # length past the end
    with pytest.raises(ValueError, match="not a well-formed protobuf"):
        _containers.proto_fields(b"\x0a\x05ab")
    with pytest.raises(ValueError, match="truncated varint"):
        _containers.read_varint(b"\x96", 0)
