"""Zero-copy DLPack bridge between torch tensors and JAX arrays (CPU and CUDA).

Only the two frameworks' own DLPack entry points are used (`jax.dlpack.from_dlpack`,
`Tensor.__dlpack__`, `jax.Array.__dlpack__`, `torch.utils.dlpack.from_dlpack`); never the PyPI
`dlpack` package.

What is guaranteed, and checked:

* **No copies.** `to_jax(t)` returns an array aliasing `t`'s memory and `to_torch(x)` a tensor
  aliasing `x`'s buffer (same data pointer; the tests assert it). A tensor that is not compact
  (e.g. `kv[..., :512]` of a 576-wide cache) raises `ValueError`, unless the caller passes
  `copy=True`, which makes one contiguous copy first. JAX's own silent alignment copy is
  refused too (`copy=False` is passed down).
* **Streams are ordered on the device, never by blocking the host.** torch -> JAX: JAX hands its
  external-ready-events stream to `Tensor.__dlpack__`, and torch records an event on its current
  stream that this stream waits for. JAX -> torch: `to_torch` passes torch's current CUDA stream
  to `jax.Array.__dlpack__`, and JAX enqueues a wait on it until the buffer is ready
  (`stream=None` would block the host instead).
* **fp8 travels as uint8.** JAX's DLPack has no float8 codes, so an fp8 tensor is exported as its
  uint8 bytes (a free torch view) and bitcast on the other side. `to_jax(t, fp8="bits")` returns
  the zero-copy uint8 alias, to be bitcast inside a jitted function (free there);
  `fp8="bitcast"` (the default) returns a float8 array, which in eager mode is one device copy of
  the bytes (an eager XLA bitcast is a new buffer). `to_torch(bits, fp8_dtype=...)` views uint8
  bytes as fp8 for free; a float8 JAX array is bitcast to uint8 first (one copy, eager).
* **No donation of shared buffers.** Donating to JAX an array that torch still views would let
  XLA free or overwrite torch-visible memory (on GPU PJRT refuses with "Donation requested for
  buffer with external reference"; on CPU it is silently accepted). Every array that crosses
  the bridge is remembered (weakly); `check_not_shared` raises for it, and the shim never passes
  `donate_argnums`.

Each crossing costs a fixed host time, independent of size (`python -m bench.interop`, part 1).
Cross the bridge once per long-lived buffer and once per step for packed metadata
(`funcmla.interop.packed`), not once per field.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.utils.dlpack

__all__ = [
    "FP8_DTYPES",
    "to_jax",
    "to_torch",
    "data_ptr",
    "is_shared",
    "check_not_shared",
]

# torch fp8 dtype -> JAX fp8 dtype (e4m3fnuz / e5m2fnuz are the MI300 (gfx942) formats).
FP8_DTYPES: dict[torch.dtype, Any] = {
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fnuz: jnp.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: jnp.float8_e5m2fnuz,
}
_ALIGN = 64  # bytes; XLA refuses to alias a less aligned buffer
_JAX_FP8_TO_TORCH = {jnp.dtype(v): k for k, v in FP8_DTYPES.items()}

# JAX arrays that alias torch memory (imported) or that torch aliases (exported), by id, with a
# weak reference so the registry never keeps an array alive.
_shared: dict[int, weakref.ref] = {}


def _remember(x: jax.Array) -> None:
    key = id(x)
    _shared[key] = weakref.ref(x, lambda _ref, key=key: _shared.pop(key, None))


def is_shared(x: jax.Array) -> bool:
    """True if `x` crossed the bridge (torch views it, or it views torch memory)."""
    ref = _shared.get(id(x))
    return ref is not None and ref() is x


def check_not_shared(*arrays: jax.Array, names: tuple[str, ...] | None = None) -> None:
    """Raise ValueError if any array shares memory with torch (so it must not be donated)."""
    for i, x in enumerate(arrays):
        if isinstance(x, jax.Array) and is_shared(x):
            name = names[i] if names else f"argument {i}"
            raise ValueError(
                f"{name} (shape {x.shape}, dtype {x.dtype}) shares memory with a torch tensor "
                "through DLPack; donating it would let XLA free or overwrite memory torch still "
                "uses. Pass a copy (jnp.array(x, copy=True)) or do not donate."
            )


def data_ptr(x: jax.Array | torch.Tensor) -> int:
    """Device (or host) address of the first element of a JAX array or torch tensor."""
    if isinstance(x, torch.Tensor):
        return x.data_ptr()
    return x.unsafe_buffer_pointer()


def _describe(t: torch.Tensor) -> str:
    return (f"shape {tuple(t.shape)}, strides {tuple(t.stride())}, dtype {t.dtype}, "
            f"device {t.device}")


def to_jax(t: torch.Tensor, *, copy: bool = False, fp8: str = "bitcast") -> jax.Array:
    """Import a torch tensor into JAX without copying it.

    copy: if False (default) a non-contiguous or non-64-byte-aligned tensor, or one with a lazy
          negation / conjugation bit (`-t` views, `t.conj()`), raises ValueError; if True it is
          first resolved, made contiguous and aligned (one copy, in torch). A contiguous,
          aligned, resolved tensor is never copied either way.
    fp8:  "bitcast" returns a float8 array (one eager device copy, see the module docstring);
          "bits" returns the zero-copy uint8 alias of the bytes.
    The result is registered as shared (`check_not_shared`). int64/float64 tensors are refused
    (JAX runs with x64 off and would silently narrow them with a copy).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
    if fp8 not in ("bitcast", "bits"):
        raise ValueError(f"fp8 must be 'bitcast' or 'bits', got {fp8!r}")
    if t.dtype in (torch.int64, torch.float64, torch.complex128):
        raise TypeError(
            f"to_jax: {t.dtype} is not supported ({_describe(t)}); JAX runs with x64 off and "
            "would narrow it with a copy. Convert in torch first, e.g. t.to(torch.int32)."
        )
    if t.is_neg() or t.is_conj():
        # a lazy negation / conjugation bit is not part of DLPack: exporting the raw memory
        # would hand JAX the un-negated values
        bit = "negation" if t.is_neg() else "conjugation"
        if not copy:
            raise ValueError(
                f"to_jax: tensor carries a lazy {bit} bit ({_describe(t)}); its memory does not "
                f"hold its values. Call t.resolve_neg() / t.resolve_conj() first, or pass "
                "copy=True for one resolved copy."
            )
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        if not copy:
            raise ValueError(
                f"to_jax: tensor is not contiguous ({_describe(t)}); DLPack into JAX needs a "
                "compact layout. Pass the whole buffer and slice inside JAX (e.g. the full "
                "576-wide cache, not cache[..., :512]), or pass copy=True for one contiguous copy."
            )
        t = t.contiguous()
    if t.data_ptr() % _ALIGN:
        if not copy:
            raise ValueError(
                f"to_jax: data pointer 0x{t.data_ptr():x} is not {_ALIGN}-byte aligned "
                f"({_describe(t)}); JAX can only alias aligned buffers (e.g. torch.from_numpy "
                "memory or a view at an odd offset). Pass copy=True for one aligned copy."
            )
        t = t.clone()
    jfp8 = FP8_DTYPES.get(t.dtype)
    src = t.view(torch.uint8) if jfp8 is not None else t
    # copy=False: refuse JAX's silent copy of a misaligned buffer.
    x = jax.dlpack.from_dlpack(src, copy=False)
    _remember(x)
    if jfp8 is not None and fp8 == "bitcast":
        x = jax.lax.bitcast_convert_type(x, jfp8)
    return x


# torch's raw current-stream getter (what Triton uses; no Stream object per call), or the
# public API where a torch build lacks it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cuda_stream_for(device) -> int | None:
    """The DLPack stream argument for exporting to torch: torch's current stream on `device`."""
    if device.platform != "gpu":
        return None
    idx = device.local_hardware_id
    stream = _raw_stream(idx) if _raw_stream else torch.cuda.current_stream(idx).cuda_stream
    # DLPack: 0 is ambiguous and disallowed; 1 names the legacy default stream.
    return 1 if stream == 0 else stream


def to_torch(x: jax.Array, *, fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Export a JAX array to torch without copying it.

    On CUDA, JAX makes torch's current stream wait for the buffer (no host block).
    fp8_dtype: view a uint8 array as this torch fp8 dtype (free). A float8 JAX array is always
               returned as the matching torch fp8 dtype (bitcast to uint8 first, one eager copy).
    The array is registered as shared: do not donate it while the tensor lives.
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(x).__name__}")
    devices = x.devices()
    if len(devices) != 1:
        raise ValueError(f"to_torch: only single-device arrays can be exported, got {x.sharding}")
    torch_fp8 = _JAX_FP8_TO_TORCH.get(x.dtype)
    if torch_fp8 is not None:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)
        fp8_dtype = torch_fp8 if fp8_dtype is None else fp8_dtype
    if fp8_dtype is not None:
        if fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be one of {list(FP8_DTYPES)}, got {fp8_dtype}")
        if x.dtype != jnp.uint8:
            raise TypeError(f"fp8_dtype={fp8_dtype} needs uint8 bytes, got an array of {x.dtype}")
    stream = _cuda_stream_for(next(iter(devices)))
    capsule = x.__dlpack__() if stream is None else x.__dlpack__(stream=stream)
    t = torch.utils.dlpack.from_dlpack(capsule)
    _remember(x)
    if fp8_dtype is not None:
        t = t.view(fp8_dtype)
    return t
