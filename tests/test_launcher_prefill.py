"""The torch prefill launcher on the CPU (`funcmla.interop.launcher.prefill`).

* its layout, restated in torch ops, equals `prefill_layout` (the JAX rule) on random batches;
* its plan is the one Mosaic GPU call of `prefill_kernel`, each operand a parameter;
* a launcher built with a stand-in kernel wires the step's layout into the kernel's eleven
  buffers and returns out / lse: the stand-in is a Mosaic GPU host function that computes
  the kernel's contract in float64 NumPy from those buffers, so the launcher's result must equal
  the same attention computed on the caller's own rows, bit for bit;
* (slow) with the real kernel in interpret mode behind the host function, the launcher equals
  `mha_prefill` bit for bit although its geometry (capacities) is larger.

On the GPU (marked `gpu`): bit-identity with `mha_prefill` under jit, and a CUDA graph of a
step's layout and three layers replayed with new lengths."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas.prefill_layout import prefill_geometry, prefill_layout
from funcmla.attention.pallas.prefill_mgpu import MgpuPrefillConfig
from funcmla.interop import _launch
from funcmla.interop.launcher import prefill as P
from funcmla.interop.launcher.prefill_layout import torch_prefill_layout
from tests.launcher_helpers import (ContractPrefillKernel, attend_f64, bits,
                                    contract_prefill_launcher, host_view, needs_gpu,
                                    needs_launcher, cpu_launch_config)

SCALE = 0.125
H = 2
CFG = cpu_launch_config()


# ----------------------------------------------------------------------------- layout
@functools.lru_cache(maxsize=None)
def _jax_layout(b: int, tq: int, tk: int, geometry):
    return jax.jit(lambda qo, kv: prefill_layout(qo, kv, tq, tk, geometry))


_LAYOUT_SHAPES = [  # (B, batch, tq, tk, interpret): fewer requests than the capacity, exactly
    (3, 5, 200, 300, False),  # as many, the interpreter's geometry, no k / v rows at all
    (4, 4, 256, 384, False),
    (2, 6, 100, 120, True),
    (2, 2, 40, 0, False),
]


@pytest.mark.parametrize("b,batch,tq,tk,interpret", _LAYOUT_SHAPES)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_torch_layout_equals_the_jax_layout(b, batch, tq, tk, interpret, data):
    q_lens = data.draw(st.lists(st.integers(0, tq // b), min_size=b, max_size=b))
    extra = data.draw(st.lists(st.integers(0, max(0, tk // b - tq // b)), min_size=b,
                               max_size=b))
    kv_lens = [min(q + e, tk // b) for q, e in zip(q_lens, extra)] if tk else [0] * b
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    g = prefill_geometry(tq + 8, tk + 16, batch, block_kv=64, interpret=interpret)
    want = _jax_layout(b, tq, tk, g)(jnp.asarray(qo), jnp.asarray(kv))
    got = torch_prefill_layout(torch.from_numpy(qo), torch.from_numpy(kv), tq, tk, g)
    for name, w, x in zip(want._fields, want, got):
        assert x.dtype == torch.int32, name
        np.testing.assert_array_equal(x.numpy(), np.asarray(w), err_msg=name)


def test_layout_refuses_more_than_the_geometry_holds():
    g = prefill_geometry(16, 16, 1, block_kv=64)
    qo = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="2 requests .* exceed the geometry's 1"):
        torch_prefill_layout(qo, qo, 8, 8, g)
    with pytest.raises(ValueError, match="exceed"):
        prefill_layout(jnp.asarray(qo[:2]), jnp.asarray(qo[:2]), 17, 8, g)


# ----------------------------------------------------------------------------- plan
@needs_launcher
def test_plan_is_the_kernel_with_each_operand_a_parameter():
    plan = P.prefill_plan(CFG)
    g = plan.geometry
    assert g == CFG.geometry and g.num_reqs == CFG.batch + 1
    call = plan.call
    assert call.name.startswith("mha_prefill_mgpu_causal_kv64")
    assert call.sources == tuple(range(9))
    r, n = g.num_reqs, g.num_slots
    assert call.operands == (((r + 1,), "i32"),) * 2 + (((r,), "i32"),) * 2 + (
        ((n,), "i32"),) * 2 + (((g.q_rows, H, 192), "bf16"), ((g.kv_rows, H, 192), "bf16"),
                               ((g.kv_rows, H, 128), "bf16"))
    assert call.results == (((g.q_rows, H, 128), "bf16"), ((g.q_rows, H), "f32"))
    assert P.prefill_plan(CFG) is plan  # cached per configuration


def test_capacity_buckets():
    assert [P.prefill_capacity(n) for n in (0, 1, 128, 129, 1000, 1024, 1025, 16384, 20000)] == [
        128, 128, 128, 144, 1024, 1024, 1152, 16384, 20480]
    for n in range(1, 5000, 37):  # holds n, at most 12.5% spare above 128
        c = P.prefill_capacity(n)
        assert n <= c <= max(128, n * 9 / 8)
    assert [P.prefill_batch_capacity(b) for b in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 32]


# ----------------------------------------------------------------------------- wiring
def _attend(q, k, v, causal: bool):
    return attend_f64(q, k, v, causal, SCALE)


@functools.lru_cache(maxsize=None)
def _launcher(native: bool, config=CFG):
    return contract_prefill_launcher(config, native)


def _batch(rng, q_lens, kv_lens, extra_q=3, extra_kv=5, poison=np.nan):
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rng.standard_normal((qo[-1] + extra_q, H, 192))
    k = rng.standard_normal((kv[-1] + extra_kv, H, 192))
    v = rng.standard_normal((kv[-1] + extra_kv, H, 128))
    k[kv[-1]:] = v[kv[-1]:] = poison  # rows no request uses
    bf = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), torch.from_numpy(qo), torch.from_numpy(kv)


def _expected(q, k, v, qo, kv, causal=True):
    """The float64 attention of each request on the caller's own rows; rows past qo[-1]: 0 /
    +inf."""
    f = lambda t: t.float().numpy().astype(jnp.bfloat16)  # noqa: E731
    q, k, v = f(q), f(k), f(v)
    out = np.zeros((q.shape[0], H, 128), jnp.bfloat16)
    lse = np.full((q.shape[0], H), np.inf, np.float32)
    for r in range(len(qo) - 1):
        a, b, c, d = qo[r], qo[r + 1], kv[r], kv[r + 1]
        out[a:b], lse[a:b] = _attend(q[a:b], k[c:d], v[c:d], causal)
    return out, lse


@needs_launcher
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("q_lens,kv_lens", [
    ([70, 0, 1, 64], [100, 0, 33, 64]),    # unaligned starts, an empty request, q_len = 1
    ([130, 9], [130, 240]),                # a request over two q tiles; a long prefix
    ([200], [200]),                        # one request, fewer than the capacity's
])
def test_launcher_wires_the_layout_and_gathers_back(native, q_lens, kv_lens):
    if native and _launch.native_reason() is not None:
        pytest.skip(_launch.native_reason())
    lau, log = _launcher(native)
    q, k, v, qo, kv = _batch(np.random.default_rng(len(q_lens)), q_lens, kv_lens)
    n = len(log)
    out, lse = lau(q, k, v, qo, kv)
    assert len(log) == n + 1 and log[-1][:2] == (0xC0DE, 0x5EED)  # one launch, torch's stream
    want_out, want_lse = _expected(q, k, v, qo.numpy(), kv.numpy())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    np.testing.assert_array_equal(out.float().numpy(), want_out.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    # a step built once serves every layer; given out / lse are written in place
    step = lau.layout(qo, kv, q.shape[0], k.shape[0])
    o2, l2 = torch.full_like(out, 7), torch.full_like(lse, 7)
    got = lau(q, k, v, step=step, out=o2, lse=l2)
    assert got[0] is o2 and got[1] is l2
    assert torch.equal(o2, out) and torch.equal(l2, lse)


@needs_launcher
def test_laid_out_k_v_give_the_copied_call_s_bits():
    """k / v handed over with the kernel's row count (kv_laid_out=True: row r is token r, the
    rows past num_kv unused) reach the kernel as the launcher's own copies would: out and lse
    bit-equal, for bf16 and for fp8 rows with a scale."""
    lau, log = _launcher(False)
    q, k, v, qo, kv = _batch(np.random.default_rng(7), [70, 0, 1, 64], [100, 0, 33, 64])
    step = lau.layout(qo, kv, q.shape[0], k.shape[0])
    rows = torch.arange(lau.geometry.kv_rows).clamp(max=k.shape[0] - 1)
    k8 = k.to(torch.float8_e4m3fn)
    for kk, scale in ((k, None), (k8, 0.5)):
        want = lau(q, kk, v, step=step, k_scale=scale)
        n = len(log)
        got = lau(q, kk[rows], v[rows], step=step, k_scale=scale, kv_laid_out=True)
        assert len(log) == n + 1
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_launcher
def test_tensors_with_the_kernel_s_rows_are_read_and_written_in_place():
    """q / k / v with the geometry's rows (contiguous bf16) reach the kernel as they are, and
    out returned is the kernel's own out (its first Tq rows); the caller's out of the kernel's
    rows is written by the kernel itself. Fewer rows: one padding copy each, same bits."""
    lau, log = _launcher(False)
    g = lau.geometry
    rng = np.random.default_rng(9)
    q, k, v, qo, kv = _batch(rng, [70, 0, 1, 64], [100, 0, 33, 64])
    pad = [torch.cat([x, x[:1].expand(n - x.shape[0], -1, -1)])
           for x, n in ((q, g.q_rows), (k, g.kv_rows), (v, g.kv_rows))]
    want = lau(q, k, v, qo, kv)
    n = len(log)
    out = torch.empty((g.q_rows, H, 128), dtype=torch.bfloat16)
    got = lau(pad[0], pad[1], pad[2], qo, kv, out=out)
    ptrs = log[n][2]
    assert ptrs[6:10] == (pad[0].data_ptr(), pad[1].data_ptr(), pad[2].data_ptr(),
                          out.data_ptr())
    assert got[0] is out
    assert torch.equal(out[:q.shape[0]], want[0])
    assert torch.equal(got[1][:q.shape[0]], want[1])
    got = lau(q, k, v, qo, kv)
    assert got[0].untyped_storage().data_ptr() == log[-1][2][9]  # a view of the kernel's out
    assert got[0].shape == q.shape[:2] + (128,)


@needs_launcher
def test_full_attention_and_empty_q():
    cfg = P.PrefillLaunchConfig(num_heads=H, q_capacity=128, kv_capacity=128, batch=2,
                                sm_scale=SCALE, causal=False,
                                kernel=MgpuPrefillConfig(block_kv=64))
    lau, _ = _launcher(False, cfg)
    q, k, v, qo, kv = _batch(np.random.default_rng(3), [5, 40], [50, 20])
    out, lse = lau(q, k, v, qo, kv)
    want_out, want_lse = _expected(q, k, v, qo.numpy(), kv.numpy(), causal=False)
    np.testing.assert_array_equal(out.float().numpy(), want_out.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    out, lse = lau(q[:0], k, v, torch.zeros(2, dtype=torch.int32), kv[:2] * 0)
    assert out.shape == (0, H, 128) and lse.shape == (0, H)


@needs_launcher
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_operands_are_dequantized_as_mha_prefill_does(dtype):
    """fp8 q / k / v with a float, a tensor and no scale: the kernel's bf16 inputs, hence out
    and lse, are bit-equal to those from `mha_prefill`'s own dequantization (float32
    x * scale, one bf16 rounding) of the same bytes."""
    from funcmla.attention.pallas.prefill import _dequantized

    lau, _ = _launcher(False)
    q, k, v, qo, kv = _batch(np.random.default_rng(11), [70, 0, 33], [100, 5, 40])
    q8, k8, v8 = (x.float().to(dtype) for x in (q, k, v))  # NaN stays NaN (unused rows)
    k_scale = torch.tensor([1.75])
    out, lse = lau(q8, k8, v8, qo, kv, q_scale=0.3, k_scale=k_scale)

    def jax_deq(x, scale):
        j = jnp.asarray(x.view(torch.uint8).numpy()).view(jnp.dtype(str(dtype).split(".")[1]))
        s = None if scale is None else jnp.asarray(np.float32(scale).reshape(1))
        return torch.from_numpy(np.array(_dequantized(j, s).astype(jnp.float32))).to(
            torch.bfloat16)

    deq = [jax_deq(q8, 0.3), jax_deq(k8, k_scale.numpy()), jax_deq(v8, None)]
    want_out, want_lse = _expected(*deq, qo.numpy(), kv.numpy())
    np.testing.assert_array_equal(out.float().numpy(), want_out.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)


@needs_launcher
def test_bad_tensors_launch_nothing():
    """Every call case of the bad-input battery (tests/bad_inputs_launcher_prefill.py) raises
    before the kernel's host function runs."""
    from tests import bad_inputs_launcher_prefill as B

    calls = [c for c in B.CASES if c.name.startswith("launcher_prefill.call_")]
    assert len(calls) >= 10
    for case in calls:
        n = len(B.HOST_CALLS)
        with pytest.raises(case.error):
            case.call()
        assert len(B.HOST_CALLS) == n, case.name
    B.HOST_CALLS.clear()
    lau, good = B._launcher()
    lau(good["q"], good["k"], good["v"], good["qo"], good["kv"])  # the good call runs it once
    assert len(B.HOST_CALLS) == 1


# ----------------------------------------------------------------------------- the kernel
class _InterpretKernel(ContractPrefillKernel):
    """The real kernel (Mosaic GPU interpret mode) behind the host function."""

    def __init__(self, call, index, *, config: P.PrefillLaunchConfig):
        super().__init__(call, index, causal=config.causal, scale=config.sm_scale, log=[])
        from funcmla.attention.pallas.prefill_mgpu import prefill_kernel

        g = config.geometry
        kernel = jax.jit(prefill_kernel(g.q_rows, config.num_heads, g.num_reqs, jnp.bfloat16,
                                        sm_scale=config.sm_scale, causal=config.causal,
                                        config=config.kernel, interpret=True,
                                        num_slots=g.num_slots))
        sigs = call.operands + call.results
        dtypes = {"i32": np.int32, "bf16": jnp.bfloat16, "f32": np.float32}

        def host(context, stream, buffers):
            ptrs = ctypes.cast(buffers, ctypes.POINTER(ctypes.c_uint64))
            b = [host_view(ptrs[i], shape, dtypes[dt]) for i, (shape, dt) in enumerate(sigs)]
            out, lse = kernel(*(jnp.asarray(x) for x in b[:9]))
            b[9][...], b[10][...] = np.asarray(out), np.asarray(lse)

        self._cb = _launch._HOST_FN[self.host_abi](host)
        self.host = ctypes.cast(self._cb, ctypes.c_void_p).value


@needs_launcher
@pytest.mark.slow  # Mosaic GPU interpret mode, two geometries
def test_interpret_kernel_behind_the_launcher_equals_mha_prefill():
    """The kernel in the launcher's larger geometry (capacities and spare requests) gives the
    bits `mha_prefill` gives in its exact one; NaN in the unused k / v rows."""
    from funcmla.attention.pallas import mha_prefill

    cfg = P.PrefillLaunchConfig(num_heads=H, q_capacity=256, kv_capacity=256, batch=4,
                                sm_scale=SCALE, kernel=MgpuPrefillConfig(block_kv=64))
    nop = _launch.launch_function_type(lambda *a: 0)
    lau = P.PrefillLauncher(
        P.prefill_plan(cfg), "cpu",
        kernel_factory=lambda call, i: _InterpretKernel(call, i, config=cfg),
        stream_fn=lambda i: 0, launch_address=ctypes.cast(nop, ctypes.c_void_p).value,
        native=False)
    q, k, v, qo, kv = _batch(np.random.default_rng(9), [70, 0, 1, 64], [100, 0, 33, 64])
    out, lse = lau(q, k, v, qo, kv)
    j = lambda t: jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)  # noqa: E731
    want_out, want_lse = jax.jit(functools.partial(
        mha_prefill, sm_scale=SCALE, causal=True, config=cfg.kernel, interpret=True))(
        j(q), j(k), j(v), jnp.asarray(qo.numpy()), jnp.asarray(kv.numpy()))
    np.testing.assert_array_equal(out.float().numpy(), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(lse.numpy(), np.asarray(want_lse))
    assert np.isfinite(out.float().numpy()).all()


def test_torch_mha_prefill_picks_the_kernel_config_from_max_kv_len(monkeypatch):
    """`torch_mha_prefill` builds the launcher of `prefill_kernel_config(max_kv_len)` (the CSRs
    stay on the device: the hint is the caller's host fact), or of the kernel it is given."""
    from funcmla.attention.pallas.prefill import SHORT_CONFIG, SHORT_KV_LEN

    built = []

    def launcher(config, device):
        built.append(config.kernel)
        return lambda *a, **kw: None

    monkeypatch.setattr(P, "prefill_launcher", launcher)
    bf = torch.bfloat16
    args = (torch.zeros(16, 2, 192, dtype=bf), torch.zeros(16, 2, 192, dtype=bf),
            torch.zeros(16, 2, 128, dtype=bf), torch.tensor([0, 8, 16], dtype=torch.int32),
            torch.tensor([0, 8, 16], dtype=torch.int32))
    for kw in ({}, {"max_kv_len": 8}, {"max_kv_len": SHORT_KV_LEN + 1},
               {"kernel": MgpuPrefillConfig(block_kv=64)}):
        P.torch_mha_prefill(*args, sm_scale=SCALE, **kw)
    assert built == [MgpuPrefillConfig(), SHORT_CONFIG, MgpuPrefillConfig(),
                     MgpuPrefillConfig(block_kv=64)]


# ----------------------------------------------------------------------------- GPU
gpu = needs_gpu


def _gpu_batch(h, q_lens, kv_lens, seed):
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(seed)
    qo = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=dev)
    kv = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32, device=dev)
    tq, tk = int(sum(q_lens)) + 5, int(sum(kv_lens)) + 9
    q = torch.randn(tq, h, 192, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(tk, h, 192, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(tk, h, 128, device=dev, generator=g).to(torch.bfloat16)
    k[int(kv[-1]):] = float("nan")  # rows no request uses
    v[int(kv[-1]):] = float("nan")
    return q, k, v, qo, kv


def _jax_prefill(q, k, v, qo, kv, causal):
    from funcmla.attention.pallas import mha_prefill

    j = jax.dlpack.from_dlpack
    out, lse = jax.jit(functools.partial(mha_prefill, sm_scale=SCALE, causal=causal))(
        j(q), j(k), j(v), j(qo), j(kv))
    return torch.from_dlpack(out), torch.from_dlpack(lse)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("h,q_lens,kv_lens,causal", [
    (16, [300, 0, 1, 1000], [300, 50, 33, 1500], True),
    (128, [1024] * 4, [1024] * 4, True),
    (16, [77, 129], [500, 129], False),
])
def test_gpu_bit_identical_to_mha_prefill(h, q_lens, kv_lens, causal):
    q, k, v, qo, kv = _gpu_batch(h, q_lens, kv_lens, 1)
    out, lse = P.torch_mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=causal)
    ref_out, ref_lse = _jax_prefill(q, k, v, qo, kv, causal)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert torch.equal(bits(out), bits(ref_out)) and torch.equal(bits(lse), bits(ref_lse))


@gpu
@pytest.mark.gpu
def test_gpu_graph_replay_with_new_lengths_equals_uncaptured_calls():
    """The step's layout and three layers captured once; replayed after new lengths and new
    rows are copied into the captured tensors."""
    h, layers = 16, 3
    q, k, v, qo, kv = _gpu_batch(h, [200, 7, 300], [400, 7, 300], 3)
    cfg = P.PrefillLaunchConfig(num_heads=h, q_capacity=P.prefill_capacity(q.shape[0]),
                                kv_capacity=P.prefill_capacity(k.shape[0]), batch=8,
                                sm_scale=SCALE)
    lau = P.prefill_launcher(cfg)
    tq, tk = q.shape[0], k.shape[0]
    qs = [q.clone() for _ in range(layers)]
    outs = [torch.empty(tq, h, 128, dtype=torch.bfloat16, device=q.device) for _ in qs]
    lses = [torch.empty(tq, h, device=q.device) for _ in qs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        lau(qs[0], k, v, step=lau.layout(qo, kv, tq, tk), out=outs[0], lse=lses[0])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step = lau.layout(qo, kv, tq, tk)
        for i in range(layers):
            lau(qs[i], k, v, step=step, out=outs[i], lse=lses[i])
    nq, nk, nv, nqo, nkv = _gpu_batch(h, [100, 0, 407], [100, 60, 547], 4)  # same totals
    for i in range(layers):
        qs[i].copy_(nq * (i + 1))
    k.copy_(nk)
    v.copy_(nv)
    qo.copy_(nqo)
    kv.copy_(nkv)
    g.replay()
    torch.cuda.synchronize()
    for i in range(layers):
        ro, rl = lau(qs[i], k, v, qo, kv)
        torch.cuda.synchronize()
        assert torch.equal(bits(outs[i]), bits(ro)) and torch.equal(bits(lses[i]), bits(rl))
