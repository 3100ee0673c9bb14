"""Bad inputs of fp8 KV pools (funcmla.attention.kv_quant): a pool dtype not taken, a scale of
the wrong shape or dtype, a non-finite or non-positive scale, a scale on a pool that is not fp8,
the Mosaic GPU kernel asked for an fp8 pool it does not take, and fp8 products where no kernel
has them. Each is refused before any launch, naming the
argument and the value (tests/test_bad_inputs.py runs them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas import (
    DecodeKernelConfig,
    mla_decode,
    mla_decode_rows,
    mla_decode_rows_mgpu,
)
from funcmla.attention.pallas.decode_common import kv_rows_from_csr
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from tests.bad_input import BadInput

SCALE = MLADims().sm_scale
B, H, D = 2, 16, 576
FP8 = jnp.float8_e4m3fn


def _q(heads=H):
    return jnp.zeros((B, heads, D), jnp.bfloat16)


def _pool(dtype=FP8, rows=64):
    return jnp.zeros((rows, D), dtype)


def _meta():
    return dict(kv_indptr=jnp.array([0, 4, 8], jnp.int32), kv_indices=jnp.arange(8, dtype=jnp.int32))


def _decode(pool=None, heads=H, **kw):
    return lambda: mla_decode(_q(heads), _pool() if pool is None else pool, **_meta(),
                              sm_scale=SCALE, interpret=True, **kw)


def _reference(pool=None, **kw):
    m = _meta()
    return lambda: mla_attention_reference(
        _q(), _pool() if pool is None else pool, jnp.array([0, 1, 2], jnp.int32),
        m["kv_indptr"], m["kv_indices"], sm_scale=SCALE, **kw)


def _rows_mgpu():
    kv = kv_rows_from_csr(**_meta())
    return mla_decode_rows_mgpu(_q(64), _pool(), kv, sm_scale=SCALE, s_q=1, num_splits=1,
                                interpret=True)


def _rows(**kw):
    kv = kv_rows_from_csr(**_meta())
    return lambda: mla_decode_rows(_q(), _pool(), kv, sm_scale=SCALE, interpret=True, **kw)


def _attention(kv_scale):
    """`mla_attention` (reference backend) over a uint8 pool of fp8 bytes with a torch
    kv_scale made by `kv_scale(torch)`."""
    def call():
        import torch

        from funcmla.interop.backend_select import mla_attention
        from funcmla.metadata import decode_metadata

        meta = decode_metadata(jnp.arange(8, dtype=jnp.int32).reshape(2, 4), jnp.array([0, 1]),
                               jnp.array([4, 4]), capacity=8)
        return mla_attention(_q(), _pool(jnp.uint8), meta, sm_scale=SCALE, backend="reference",
                             mode="decode", kv_fp8_dtype=FP8, kv_scale=kv_scale(torch),
                             max_kv_len=4)

    return call


CASES = [
    BadInput("fp8.reference_pool_e5m2", _reference(_pool(jnp.float8_e5m2)), TypeError,
             ("kv_pool", "float8_e5m2")),
    BadInput("fp8.reference_pool_uint8", _reference(_pool(jnp.uint8)), TypeError,
             ("kv_pool", "uint8")),
    BadInput("fp8.reference_scale_on_bf16_pool",
             _reference(_pool(jnp.bfloat16), k_scale=0.5), ValueError,
             ("k_scale", "bfloat16")),
    BadInput("fp8.reference_k_scale_shape",
             _reference(k_scale=jnp.ones((2,), jnp.float32)), ValueError,
             ("k_scale", r"\(2,\)")),
    BadInput("fp8.reference_k_scale_dtype",
             _reference(k_scale=jnp.ones((1,), jnp.bfloat16)), TypeError,
             ("k_scale", "bfloat16")),
    BadInput("fp8.reference_k_scale_nan", _reference(k_scale=float("nan")), ValueError,
             ("k_scale", "nan")),
    BadInput("fp8.reference_v_scale_zero", _reference(v_scale=jnp.zeros((), jnp.float32)),
             ValueError, ("v_scale", r"0\.0")),
    BadInput("fp8.reference_v_scale_negative_array",
             _reference(v_scale=np.array([-2.0], np.float32)), ValueError,
             ("v_scale", r"-2\.0")),
    BadInput("fp8.reference_k_scale_string", _reference(k_scale="1.0"), TypeError,
             ("k_scale", "str")),
    BadInput("fp8.decode_pool_fnuz", _decode(_pool(jnp.float8_e4m3fnuz)), TypeError,
             ("kv_pool", "float8_e4m3fnuz")),
    BadInput("fp8.decode_pool_e5m2", _decode(_pool(jnp.float8_e5m2)), TypeError,
             ("kv_pool", "float8_e5m2")),
    BadInput("fp8.decode_k_scale_inf", _decode(k_scale=float("inf")), ValueError,
             ("k_scale", "inf")),
    BadInput("fp8.decode_k_scale_negative", _decode(k_scale=-1.0), ValueError,
             ("k_scale", r"-1\.0")),
    BadInput("fp8.decode_k_scale_shape", _decode(k_scale=jnp.ones((1, 1), jnp.float32)),
             ValueError, ("k_scale", r"\(1, 1\)")),
    BadInput("fp8.decode_v_scale_dtype", _decode(v_scale=jnp.ones((), jnp.float16)), TypeError,
             ("v_scale", "float16")),
    BadInput("fp8.decode_v_scale_nan_array",
             _decode(v_scale=jnp.array([np.nan], jnp.float32)), ValueError,
             ("v_scale", "nan")),
    BadInput("fp8.decode_scale_on_bf16_pool", _decode(_pool(jnp.bfloat16), k_scale=1.0),
             ValueError, ("k_scale", "bfloat16")),
    BadInput("fp8.decode_rows_k_scale_shape", _rows(k_scale=jnp.ones((3,), jnp.float32)),
             ValueError, ("k_scale", r"\(3,\)")),
    BadInput("fp8.decode_mgpu_kernel",
             _decode(heads=40, config=DecodeKernelConfig(kernel="mgpu")), ValueError,
             ("kernel='mgpu'", "float8_e4m3fn", "40", "multiple of 16")),
    BadInput("fp8.config_fp8_products_unknown",
             lambda: DecodeKernelConfig(fp8_products="e5m2"), ValueError,
             ("fp8_products", "'e5m2'")),
    BadInput("fp8.decode_fp8_products_at_16_rows",
             _decode(config=DecodeKernelConfig(fp8_products="fp8")), ValueError,
             ("fp8_products='fp8'", "s_q\\*H = 16", "multiple of 64")),
    BadInput("fp8.decode_fp8_products_on_triton",
             _decode(heads=64, config=DecodeKernelConfig(fp8_products="fp8", kernel="triton")),
             ValueError, ("fp8_products='fp8'", "kernel='triton'")),
    BadInput("fp8.decode_rows_mgpu", _rows_mgpu, ValueError,
             ("mla_decode_rows_mgpu", "float8_e4m3fn")),
    BadInput("fp8.decode_uint8_pool_without_kv_dtype", _decode(_pool(jnp.uint8)), TypeError,
             ("kv_pool", "uint8")),
    BadInput("fp8.decode_kv_dtype_e5m2", _decode(_pool(jnp.uint8), kv_dtype="float8_e5m2"),
             TypeError, ("kv_dtype", "float8_e5m2")),
    BadInput("fp8.decode_kv_dtype_on_fp8_pool", _decode(kv_dtype="float8_e4m3fn"), TypeError,
             ("kv_dtype", "float8_e4m3fn")),
    BadInput("fp8.attention_kv_scale_tensor_dtype",
             _attention(lambda torch: torch.ones(1, dtype=torch.float64)), TypeError,
             (r"kv_scale must be float32", r"torch\.float64"), needs=("torch",)),
    BadInput("fp8.attention_kv_scale_tensor_shape", _attention(lambda torch: torch.ones(2)),
             ValueError, (r"kv_scale must have shape \(\) or \[1\]", r"\(2,\)"),
             needs=("torch",)),
    BadInput("fp8.attention_kv_scale_host_tensor_value",
             _attention(lambda torch: torch.tensor([-1.0])), ValueError,
             (r"kv_scale=\[-1.0\]", r"positive finite float"), needs=("torch",)),
]
