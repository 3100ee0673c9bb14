"""Shared pieces of the launcher tests (tests/test_launcher_*.py, the SGLang MHA extend's)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from funcmla.config import MLADims
from funcmla.interop import launcher as L

SCALE = MLADims().sm_scale


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


def _lowering_available() -> str | None:
    try:
        L.decode_plan(L.DecodeLaunchConfig(num_seqs=2, num_heads=16, pool_rows=64,
                                           kv_capacity=32, sm_scale=SCALE))
    except RuntimeError as err:  # jaxlib > 0.10.2 without the CUDA plugin cannot compile
        return str(err)
    return None


needs_lowering = pytest.mark.skipif(_lowering_available() is not None,
                                    reason="no Pallas Triton lowering for CUDA on this install")
# the launchers' extraction runs on the jaxlibs it was tested on (`support.TESTED_JAXLIB`); on
# another, building one raises LauncherUnavailable by design
needs_launcher = pytest.mark.skipif(L.jaxlib_unsupported_reason() is not None,
                                    reason=f"{L.jaxlib_unsupported_reason()}")



FP8 = "float8_e4m3fn"


def fp8_config(h: int, page_size: int, b: int = 4, ctx: int = 256, **kw):
    """An fp8-pool DecodeLaunchConfig: `b` sequences of up to `ctx` tokens, a token CSR
    (page_size 1) or a page table of ctx // page_size pages per sequence."""
    if page_size == 1:
        return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, pool_rows=b * ctx + 64,
                                    kv_capacity=b * ctx, max_kv_len=ctx, sm_scale=SCALE,
                                    kv_dtype=FP8, **kw)
    return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, pool_rows=b * ctx + 4 * page_size,
                                kv_capacity=b * ctx // page_size, sm_scale=SCALE,
                                page_size=page_size, kv_dtype=FP8, **kw)


def gpu_reason() -> str | None:
    """None where the launcher's GPU tests can run (CUDA torch, a JAX GPU, the launcher)."""
    import jax
    import torch

    if not torch.cuda.is_available():
        return "no CUDA torch"
    if jax.devices()[0].platform != "gpu":
        return "JAX has no GPU"
    return L.launcher_unavailable_reason()


needs_gpu = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))


def bits(t):
    """A bf16 / float32 torch tensor's bits, for bit-identity checks."""
    import torch

    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def cpu_launch_config(**kw):
    """The CPU prefill launcher tests' configuration (one lowering shared by the tests and the
    bad-input battery): 2 heads, up to 256 q rows, 384 k / v rows and 5 requests."""
    from funcmla.attention.pallas.prefill_mgpu import MgpuPrefillConfig

    return L.PrefillLaunchConfig(**{**dict(num_heads=2, q_capacity=256, kv_capacity=384,
                                           batch=5, sm_scale=0.125,
                                           kernel=MgpuPrefillConfig(block_kv=64)), **kw})


# ------------------------------------------------------------- a stand-in prefill kernel
def host_view(ptr: int, shape, dtype) -> np.ndarray:
    """The host memory at `ptr` as a NumPy array (a CPU tensor's storage)."""
    dtype = np.dtype(dtype)
    raw = (ctypes.c_uint8 * (int(np.prod(shape)) * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def attend_f64(q, k, v, causal: bool, scale: float):
    """float64 attention of one request: q [n, H, 192], k [m, H, 192], v [m, H, 128], bottom-
    right causal; (out bf16 [n, H, 128], lse float32 [n, H]), a row with no key 0 / +inf."""
    import jax.numpy as jnp

    n, m = q.shape[0], k.shape[0]
    out = np.zeros((n, q.shape[1], v.shape[2]))
    lse = np.full((n, q.shape[1]), np.inf)
    if m:
        s = np.einsum("nhd,mhd->hnm", q.astype(np.float64), k.astype(np.float64)) * scale
        if causal:
            s = np.where(np.arange(m)[None, None] < m - n + 1 + np.arange(n)[None, :, None], s,
                         -np.inf)
        top = s.max(-1, keepdims=True)
        seen = np.isfinite(top)
        p = np.where(seen, np.exp(s - np.where(seen, top, 0)), 0)
        tot = p.sum(-1)
        o = np.einsum("hnm,mhd->nhd", p, v.astype(np.float64)) / np.where(tot > 0, tot, 1).T[
            ..., None]
        out = np.where(seen[..., 0].T[..., None], o, 0)
        lse = np.where(seen[..., 0], (top[..., 0] + np.log(np.where(tot > 0, tot, 1))),
                       np.inf).T
    return out.astype(jnp.bfloat16), lse.astype(np.float32)


class ContractPrefillKernel:
    """Stands in for MosaicKernel: a host launch function that reads the eleven buffers and
    writes what the kernel's contract says (`prefill_kernel`): per tile slot, 128 query rows of
    its request against that request's keys (float64, `attend_f64`), its rows counted from the
    8-row group of the request's first row (`row_leads`), out and lse rows in place."""

    def __init__(self, call, index, *, causal: bool, scale: float, log: list):
        import jax.numpy as jnp

        from funcmla.attention.pallas.prefill_mgpu import BLOCK_Q, ROW_ALIGN
        from funcmla.interop import _launch

        self.call, self.function, self.host_abi = call, 0xC0DE, _launch.HOST_ABI_DIRECT
        self.num_params = len(call.operands) + len(call.results)
        self.grid, self.block, self.shared_mem_bytes = (0, 0, 0), (0, 0, 0), 0
        sigs = call.operands + call.results
        dtypes = {"i32": np.int32, "bf16": jnp.bfloat16, "f32": np.float32}
        self.log = log

        def host(context, stream, buffers):
            ptrs = ctypes.cast(buffers, ctypes.POINTER(ctypes.c_uint64))
            b = [host_view(ptrs[i], shape, dtypes[dt]) for i, (shape, dt) in enumerate(sigs)]
            self.log.append((context, stream, tuple(ptrs[i] for i in range(len(sigs)))))
            qo, kv, q_lens, kv_lens, req, first, q, k, v, out, lse = b
            for s, r in enumerate(req):
                if r < 0:
                    continue
                n, m, lead = q_lens[r], kv_lens[r], qo[r] % ROW_ALIGN
                tile = np.arange(first[s], first[s] + BLOCK_Q)  # counted from the 8-row group
                live = (tile >= lead) & (tile < lead + n)
                rows = tile[live] - lead
                o, l = attend_f64(q[qo[r]:qo[r] + n], k[kv[r]:kv[r] + m], v[kv[r]:kv[r] + m],
                                  causal, scale)
                out[qo[r] + rows] = o[rows]
                lse[qo[r] + rows] = l[rows]

        self._cb = _launch._HOST_FN[self.host_abi](host)
        self.host = ctypes.cast(self._cb, ctypes.c_void_p).value

    def info(self):
        return {"name": self.call.name}


def contract_prefill_launcher(config, native: bool | None = False):
    """(a CPU PrefillLauncher of `config` whose kernel is `ContractPrefillKernel`, its launch
    log: (context, stream, buffer addresses) per launch)."""
    from funcmla.interop import _launch
    from funcmla.interop.launcher import prefill as P

    log: list = []
    nop = _launch.launch_function_type(lambda *a: 0)
    lau = P.PrefillLauncher(
        P.prefill_plan(config), "cpu",
        kernel_factory=lambda call, i: ContractPrefillKernel(
            call, i, causal=config.causal, scale=config.sm_scale, log=log),
        stream_fn=lambda i: 0x5EED, launch_address=ctypes.cast(nop, ctypes.c_void_p).value,
        native=native)
    lau._keep = nop
    return lau, log
