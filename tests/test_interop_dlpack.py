"""DLPack bridge: zero copy (same data pointer), exact round trips, clear errors, no donation."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.interop.dlpack import check_not_shared, data_ptr, is_shared, to_jax, to_torch

ON_GPU = jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if ON_GPU else [])
DTYPES = [torch.int32, torch.bfloat16, torch.float32]


def _random(dtype, shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int32:
        t = torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32)
    else:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
    return t.to(device)


def _bits(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor (bit-exact comparisons, NaN payloads included)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_to_jax_to_torch_is_zero_copy_and_exact(dtype, device):
    t = _random(dtype, (37, 576), device)
    x = to_jax(t)
    assert data_ptr(x) == t.data_ptr()  # JAX aliases torch's memory
    assert x.shape == (37, 576) and x.dtype == jnp.dtype(str(dtype).split(".")[1])
    back = to_torch(x)
    assert back.data_ptr() == t.data_ptr()  # and torch aliases JAX's view of it
    assert back.dtype == dtype and back.shape == t.shape
    np.testing.assert_array_equal(_bits(back), _bits(t))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bfloat16, jnp.float32])
def test_jax_to_torch_to_jax_is_zero_copy_and_exact(dtype, device):
    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    host = np.random.default_rng(1).standard_normal((8, 130)) * 50
    x = jax.device_put(jnp.asarray(host).astype(dtype), dev)
    t = to_torch(x)
    assert t.data_ptr() == data_ptr(x)
    assert t.device.type == device
    y = to_jax(t)
    assert data_ptr(y) == data_ptr(x)
    np.testing.assert_array_equal(np.asarray(y.view(jnp.uint8) if dtype != jnp.int32 else y),
                                  np.asarray(x.view(jnp.uint8) if dtype != jnp.int32 else x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
def test_fp8_travels_as_uint8_zero_copy_and_round_trips_exactly(fp8, device):
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)  # every bit pattern
    t = raw.to(device).view(fp8)
    bits = to_jax(t, fp8="bits")
    assert bits.dtype == jnp.uint8 and data_ptr(bits) == t.data_ptr()  # zero copy transport
    back = to_torch(bits, fp8_dtype=fp8)
    assert back.dtype == fp8 and back.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(_bits(back), _bits(t))
    # default: bitcast on the JAX side to the matching float8 dtype, bit-exact both ways
    x = to_jax(t)
    assert x.dtype == jnp.dtype(fp8.__repr__().split(".")[1])
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8)),
                                  _bits(t))
    again = to_torch(x)
    assert again.dtype == fp8
    np.testing.assert_array_equal(_bits(again), _bits(t))
    # the bitcast inside jit reads the zero-copy bytes directly
    f = jax.jit(lambda b: jax.lax.bitcast_convert_type(b, x.dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(bits)), t.float().cpu().numpy())


@settings(max_examples=40)
@given(shape=st.lists(st.integers(0, 7), max_size=4).map(tuple),
       dtype=st.sampled_from(DTYPES + [torch.uint8, torch.float8_e4m3fn, torch.int8]),
       seed=st.integers(0, 2**16))
def test_round_trip_any_shape_is_zero_copy_and_bit_exact(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape + (4,), generator=g, dtype=torch.int32).to(torch.uint8)
    t = raw.view(torch.int32).view(dtype) if dtype.itemsize == 4 else (
        raw.view(torch.int16).view(dtype) if dtype.itemsize == 2 else raw[..., 0].view(dtype))
    t = t.contiguous()
    fp8 = dtype == torch.float8_e4m3fn
    x = to_jax(t, fp8="bits")
    back = to_torch(x, fp8_dtype=dtype if fp8 else None)
    assert back.dtype == dtype and back.shape == t.shape
    if t.numel():
        assert data_ptr(x) == t.data_ptr() == back.data_ptr()
    np.testing.assert_array_equal(_bits(back), _bits(t))  # NaN payloads included


def test_non_contiguous_slice_is_refused_unless_copy_requested():
    cache = _random(torch.bfloat16, (64, 1, 576), "cpu")
    v = cache[..., :512]  # the V half of the latent cache: not compact
    with pytest.raises(ValueError, match=r"not contiguous.*strides \(576, 576, 1\).*copy=True"):
        to_jax(v)
    x = to_jax(v, copy=True)
    assert data_ptr(x) != cache.data_ptr()  # a copy, as asked
    np.testing.assert_array_equal(_bits(to_torch(x)), _bits(v))
    # the whole buffer goes through without a copy, and slicing happens in JAX
    whole = to_jax(cache)
    assert data_ptr(whole) == cache.data_ptr()


def test_transposed_tensor_is_refused():
    t = _random(torch.float32, (16, 8), "cpu").t()
    with pytest.raises(ValueError, match="not contiguous"):
        to_jax(t)


def test_misaligned_tensor_is_refused_unless_copy_requested():
    base = torch.arange(64, dtype=torch.int32)
    t = base[1:17]  # contiguous but 4 bytes past a 64-byte boundary
    assert t.data_ptr() % 64
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        to_jax(t)
    x = to_jax(t, copy=True)
    np.testing.assert_array_equal(np.asarray(x), np.arange(1, 17))


def test_lazy_negation_and_conjugation_bits_are_refused_unless_copy_requested():
    """`-t` views and `t.conj()` carry a lazy bit DLPack cannot express: the raw memory holds
    the un-negated values. Refused by default; copy=True resolves them (exact values)."""
    t = torch.arange(64, dtype=torch.float32)
    neg = torch._neg_view(t)
    with pytest.raises(ValueError, match="lazy negation bit"):
        to_jax(neg)
    np.testing.assert_array_equal(np.asarray(to_jax(neg, copy=True)), -np.arange(64))
    z = (torch.arange(16, dtype=torch.float32) * (1 + 2j)).to(torch.complex64)
    with pytest.raises(ValueError, match="lazy conjugation bit"):
        to_jax(z.conj())
    np.testing.assert_array_equal(np.asarray(to_jax(z.conj(), copy=True)), np.conj(z.numpy()))
    assert np.asarray(to_jax(t))[5] == 5  # the plain tensor still crosses without a copy


def test_int64_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match=r"torch.int64 is not supported.*to\(torch.int32\)"):
        to_jax(torch.arange(4))


def test_import_is_a_view_torch_writes_are_visible():
    t = torch.zeros(32, dtype=torch.int32)
    x = to_jax(t)
    t[5] = 7  # torch still owns the memory; the JAX array is a view of it
    assert int(np.asarray(x)[5]) == 7


def test_shared_arrays_must_not_be_donated():
    t = torch.ones(16, dtype=torch.float32)
    imported = to_jax(t)
    exported_src = jnp.arange(16, dtype=jnp.int32)
    view = to_torch(exported_src)
    fresh = jnp.zeros(4)
    assert is_shared(imported) and is_shared(exported_src) and not is_shared(fresh)
    check_not_shared(fresh)
    with pytest.raises(ValueError, match="kv_pool .*shares memory with a torch tensor"):
        check_not_shared(fresh, imported, names=("fresh", "kv_pool"))
    with pytest.raises(ValueError, match="argument 0"):
        check_not_shared(exported_src)
    del view


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU with JAX CUDA and torch CUDA")
def test_cuda_streams_are_ordered_without_blocking_the_host():
    # torch -> JAX: a long torch kernel writes the tensor; the import must not wait on the host,
    # yet JAX must see the written values.
    a = torch.randn(4096, 4096, device="cuda")
    t = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):
        a = a @ a / 64.0
    t.fill_(3.0)
    start = time.perf_counter()
    x = to_jax(t)
    host_s = time.perf_counter() - start
    assert not torch.cuda.current_stream().query()  # torch work still queued: host did not block
    assert float(jnp.sum(x)) == 3.0 * (1 << 20)
    assert host_s < 0.05
    # JAX -> torch: a long JAX computation; the export returns before it finishes and torch's
    # stream reads the final values.
    big = jnp.ones((4096, 4096), jnp.float32)
    f = jax.jit(lambda m: jnp.sum(jnp.linalg.matrix_power(m / 4096.0, 1023)) * jnp.ones(8))
    f(big).block_until_ready()
    y = f(big)
    start = time.perf_counter()
    ty = to_torch(y)
    host_s = time.perf_counter() - start
    torch_s = torch.empty(8, device="cuda").copy_(ty)  # queued behind the wait on JAX's event
    assert not torch.cuda.current_stream().query()  # JAX still computing: host did not block
    assert host_s < 0.05
    np.testing.assert_allclose(torch_s.cpu().numpy(), np.full(8, 4096.0), rtol=1e-3)
    np.testing.assert_allclose(ty.cpu().numpy(), np.full(8, 4096.0), rtol=1e-3)
