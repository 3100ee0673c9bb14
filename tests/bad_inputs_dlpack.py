"""Bad inputs to the DLPack bridge (`funcmla.interop.dlpack`); every case needs torch."""

from __future__ import annotations

import importlib.util

from tests.bad_input import BadInput

CASES: list[BadInput] = []

if importlib.util.find_spec("torch") is not None:
    import jax.numpy as jnp
    import torch

    from funcmla.interop import dlpack

    def case(name, call, error, *match):
        return BadInput(name, call, error, tuple(match), needs=("torch",))

    def shared():
        x = dlpack.to_jax(torch.zeros(16))
        dlpack.check_not_shared(x, names=("kv_pool",))

    CASES = [
        case("dlpack.negation_bit", lambda: dlpack.to_jax(torch._neg_view(torch.arange(16.0))),
             ValueError, r"lazy negation bit", r"resolve_neg\(\)", r"copy=True"),
        case("dlpack.conjugation_bit",
             lambda: dlpack.to_jax(torch.ones(16, dtype=torch.complex64).conj()), ValueError,
             r"lazy conjugation bit", r"complex64"),
        case("dlpack.int64", lambda: dlpack.to_jax(torch.zeros(4, dtype=torch.int64)), TypeError,
             r"torch\.int64 is not supported", r"x64 off"),
        case("dlpack.float64", lambda: dlpack.to_jax(torch.zeros(4, dtype=torch.float64)),
             TypeError, r"torch\.float64 is not supported", r"shape \(4,\)"),
        case("dlpack.not_contiguous", lambda: dlpack.to_jax(torch.zeros(4, 576)[:, :512]),
             ValueError, r"not contiguous", r"strides \(576, 1\)"),
        case("dlpack.misaligned", lambda: dlpack.to_jax(torch.zeros(64)[1:]), ValueError,
             r"not 64-byte aligned", r"shape \(63,\)"),
        case("dlpack.not_a_tensor", lambda: dlpack.to_jax([1, 2]), TypeError,
             r"to_jax expects a torch\.Tensor", r"got list"),
        case("dlpack.fp8_mode", lambda: dlpack.to_jax(torch.zeros(4), fp8="raw"), ValueError,
             r"fp8 must be 'bitcast' or 'bits'", r"'raw'"),
        case("dlpack.to_torch_not_an_array", lambda: dlpack.to_torch(torch.zeros(4)), TypeError,
             r"to_torch expects a jax\.Array", r"got Tensor"),
        case("dlpack.to_torch_fp8_dtype",
             lambda: dlpack.to_torch(jnp.zeros(4, jnp.uint8), fp8_dtype=torch.float16),
             ValueError, r"fp8_dtype must be one of", r"torch\.float16"),
        case("dlpack.to_torch_fp8_from_float",
             lambda: dlpack.to_torch(jnp.zeros(4, jnp.float32), fp8_dtype=torch.float8_e4m3fn),
             TypeError, r"fp8_dtype=torch\.float8_e4m3fn needs uint8", r"float32"),
        case("dlpack.donating_a_shared_array", shared, ValueError,
             r"kv_pool \(shape \(16,\)", r"shares memory with a torch tensor"),
    ]
