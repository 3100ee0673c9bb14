"""Shared pieces of the launcher tests (tests/test_launcher_*.py)."""

from __future__ import annotations

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


def prefill_config(**kw):
    """The CPU prefill launcher tests' configuration (one lowering shared by the tests and the
    bad-input battery): 2 heads, up to 256 q rows, 384 k / v rows and 5 requests."""
    from funcmla.attention.pallas.prefill_mgpu import MgpuPrefillConfig

    return L.PrefillLaunchConfig(**{**dict(num_heads=2, q_capacity=256, kv_capacity=384,
                                           batch=5, sm_scale=0.125,
                                           kernel=MgpuPrefillConfig(block_kv=64)), **kw})
