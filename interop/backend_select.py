"""One attention entry point that picks a backend and reports which one ran.

Backends, in the order `auto` tries them:

* "aiter":     AITER's MLA kernels through torch (ROCm torch with amd-aiter importable;
               contract-tested only, see `funcmla.interop.aiter_dispatch`).
* "pallas":    funcmla's Pallas kernels on an NVIDIA GPU through JAX, imported lazily:
               `funcmla.attention.pallas.mla_decode` for causal uniform-length queries (decode,
               target verify, draft extend with s_q <= PALLAS_MAX_S_Q queries per request),
               `mla_extend` (the decode kernels over query chunks) for every other batch:
               extend with or without a prefix, mixed and ragged batches, long verify and
               draft-extend spans, non-causal calls. fp8 pools (float8_e4m3fn bytes) run both
               with the pool's scale. Only an input no kernel reads (a q dtype other than
               bf16 / f16, another fp8 format) falls back to the reference, and says why.
* "reference": `funcmla.attention.reference.mla_attention_reference` (dense, float32, any
               platform).

`select_backend(requested)` honours an explicit request (and raises, saying why, if that backend
cannot run here); `auto` picks the first available. `mla_attention` runs the chosen backend and
returns an `AttentionResult` with the name of the backend that actually ran (a pallas request
that falls back to "reference" says why in `fallback_reason`).

Inputs may be torch tensors or JAX arrays; outputs are in the framework of `q`. torch inputs are
imported into JAX without copies (`funcmla.interop.dlpack`), JAX outputs exported the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import torch

from funcmla.attention.kv_quant import check_kv_scale_values
from funcmla.attention.reference import mla_attention_reference
from funcmla.interop import aiter_dispatch
from funcmla.interop.dlpack import FP8_DTYPES, to_jax, to_torch

__all__ = [
    "BACKENDS",
    "PALLAS_MAX_S_Q",
    "AttentionResult",
    "backend_availability",
    "select_backend",
    "mla_attention",
    "pallas_route",
]

BACKENDS = ("aiter", "pallas", "reference")
PALLAS_MAX_S_Q = 4


@dataclasses.dataclass(frozen=True)
class AttentionResult:
    """out [T, H, v_head_dim]; lse [T, H] float32 natural log (None if the backend has none)."""

    out: Any
    lse: Any
    backend: str
    fallback_reason: str | None = None
    via: str = "jax"  # "jax" (DLPack + jit), "launcher" (torch launch, no DLPack), "torch" (aiter)
    launcher_reason: str | None = None  # why the launcher was asked for but not used


def _pallas_unavailable_reason() -> str | None:
    try:
        devices = jax.devices()
    except RuntimeError as err:  # no backend at all
        return f"no JAX devices ({err})"
    dev = devices[0]
    if dev.platform != "gpu":
        return f"JAX's default device is {dev.platform!r}, not an NVIDIA GPU"
    version = str(getattr(dev.client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return "JAX runs on ROCm; the Pallas kernel targets NVIDIA GPUs"
    try:
        _pallas_decode()
    except (ImportError, AttributeError) as err:
        return f"funcmla.attention.pallas.mla_decode is not importable ({err})"
    return None


def _aiter_unavailable_reason() -> str | None:
    try:
        aiter_dispatch.load_aiter()
    except aiter_dispatch.AiterUnavailable as err:
        return str(err)
    return None


_REASONS = {
    "aiter": _aiter_unavailable_reason,
    "pallas": _pallas_unavailable_reason,
    "reference": lambda: None,
}


def backend_availability() -> dict[str, str | None]:
    """Backend name -> None if it can run here, else the reason it cannot."""
    return {name: _REASONS[name]() for name in BACKENDS}


def select_backend(requested: str | None = None) -> str:
    """Resolve "auto"/None to the first available backend; check an explicit request."""
    if requested in (None, "auto"):
        return next(name for name in BACKENDS if _REASONS[name]() is None)
    if requested not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {requested!r}; choose from {BACKENDS} or 'auto'")
    reason = _REASONS[requested]()
    if reason is not None:
        raise RuntimeError(
            f"attention backend {requested!r} was requested but cannot run: {reason}")
    return requested


def _pallas_decode():
    from funcmla.attention.pallas import mla_decode  # lazy: written separately, may be absent

    return mla_decode


def _pallas_extend():
    from funcmla.attention.pallas import mla_extend  # lazy, as _pallas_decode

    return mla_extend


def _dequant(kv_rows, kv_fp8_dtype, kv_scale):
    """uint8 bytes of an fp8 pool -> float32 values (bitcast inside jit: no copy of the pool)."""
    if kv_fp8_dtype is None:
        return kv_rows
    vals = jax.lax.bitcast_convert_type(kv_rows, kv_fp8_dtype).astype(jnp.float32)
    return vals if kv_scale is None else vals * kv_scale


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_head_dim", "causal", "max_kv_len",
                                             "out_dtype", "kv_fp8_dtype"))
def _reference(q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, sm_scale, v_head_dim, causal,
               max_kv_len, out_dtype, kv_fp8_dtype=None, kv_scale=None):
    kv_rows = _dequant(_rows(kv_pool), kv_fp8_dtype, kv_scale)
    out, lse = mla_attention_reference(q, kv_rows, qo_indptr, kv_indptr, kv_indices,
                                       sm_scale=sm_scale, v_head_dim=v_head_dim, causal=causal,
                                       max_kv_len=max_kv_len)
    return out.astype(out_dtype), lse


def _rows(kv_pool):
    """[slots, 1, D] / [slots, 1, 1, D] / [slots, D] -> [slots, D].

    Free inside jit only: an eager reshape of the imported pool would copy all of it."""
    return kv_pool.reshape(kv_pool.shape[0], kv_pool.shape[-1])


def _host_scale(kv_scale):
    """kv_scale with its value read where it is on the host, never from a device: a real or a
    CPU torch tensor -> a float, checked positive and finite (`check_kv_scale_values`); a torch
    tensor on a device (SGLang's `layer.k_scale`) is returned as it is, its dtype and shape
    checked (float32, () or [1]) and its value the caller's contract (reading it would be a
    device sync); a JAX array is returned as it is, its value checked where it is concrete and
    on the CPU. Raises TypeError / ValueError naming kv_scale."""
    if isinstance(kv_scale, torch.Tensor):
        if kv_scale.dtype != torch.float32:
            raise TypeError(f"kv_scale must be float32, got {kv_scale.dtype}")
        if tuple(kv_scale.shape) not in ((), (1,)):
            raise ValueError(f"kv_scale must have shape () or [1] (one scale per layer), got "
                             f"{tuple(kv_scale.shape)}")
        if kv_scale.device.type != "cpu":
            return kv_scale
        kv_scale = float(kv_scale.reshape(()))  # a host tensor: no device sync
    if isinstance(kv_scale, numbers.Real) and not isinstance(kv_scale, bool):
        check_kv_scale_values(kv_scale=kv_scale)
        return float(kv_scale)
    if isinstance(kv_scale, jax.Array) and not isinstance(kv_scale, jax.core.Tracer) and all(
            d.platform == "cpu" for d in kv_scale.devices()):
        check_kv_scale_values(kv_scale=kv_scale)
    return kv_scale


def launcher_scale(kv_scale):
    """kv_scale as the torch launcher takes it (`_host_scale`; None stays None, a JAX array
    becomes a torch tensor: the launcher reads torch tensors)."""
    if kv_scale is None:
        return None
    scale = _host_scale(kv_scale)
    return to_torch(scale) if isinstance(scale, jax.Array) else scale


# Device scale tensors imported into JAX, by id, with a weak reference (a dead or reused id is a
# miss): one DLPack import per layer's scale, not one per call.
_IMPORTED_SCALES: dict[int, tuple[weakref.ref, int, jax.Array]] = {}


def _scale_array(kv_scale) -> jax.Array:
    """kv_scale (`_host_scale`) as a float32 array for the jitted calls (where it is a traced
    value): a float or a JAX array as a scalar, a device torch tensor as a zero-copy alias of
    its own shape () or [1] (imported once per tensor; it sees later in-place writes)."""
    kv_scale = _host_scale(kv_scale)
    if not isinstance(kv_scale, torch.Tensor):
        return jnp.asarray(kv_scale, jnp.float32).reshape(())
    hit = _IMPORTED_SCALES.get(id(kv_scale))
    if hit is not None and hit[0]() is kv_scale and hit[1] == kv_scale.data_ptr():
        return hit[2]
    x = to_jax(kv_scale.detach())
    key = id(kv_scale)
    _IMPORTED_SCALES[key] = (weakref.ref(kv_scale, lambda _r, key=key: _IMPORTED_SCALES.pop(
        key, None)), kv_scale.data_ptr(), x)
    return x


def _fp8_args(kv_fp8_dtype, kv_scale) -> dict:
    """The Pallas kernels' arguments for an fp8 pool's uint8 bytes (none for another pool)."""
    if kv_fp8_dtype is None:
        return {}
    return {"kv_dtype": kv_fp8_dtype, "k_scale": kv_scale}


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "max_kv_len", "v_head_dim",
                                             "kv_fp8_dtype"))
def _pallas(q, kv_pool, kv_indptr, kv_indices, *, sm_scale, s_q, max_kv_len, v_head_dim,
            kv_fp8_dtype=None, kv_scale=None):
    # metadata padded to a batch bucket lists more (empty) requests than q holds: keep q's
    kv_indptr = kv_indptr[: q.shape[0] // s_q + 1]
    out, lse = _pallas_decode()(q, _rows(kv_pool), kv_indptr=kv_indptr, kv_indices=kv_indices,
                                sm_scale=sm_scale, s_q=s_q, max_kv_len=max_kv_len,
                                v_head_dim=v_head_dim, **_fp8_args(kv_fp8_dtype, kv_scale))
    return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "max_kv_len", "v_head_dim",
                                             "kv_fp8_dtype"))
def _pallas_ragged(q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, sm_scale, causal,
                   max_kv_len, v_head_dim, kv_fp8_dtype=None, kv_scale=None):
    out, lse = _pallas_extend()(q, _rows(kv_pool), qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                                kv_indices=kv_indices, sm_scale=sm_scale, causal=causal,
                                max_kv_len=max_kv_len, v_head_dim=v_head_dim,
                                **_fp8_args(kv_fp8_dtype, kv_scale))
    return out.astype(q.dtype), lse


# What the Pallas kernels read: q of these dtypes; fp8 pools of this format (as uint8 bytes).
_PALLAS_Q_DTYPES = ("bfloat16", "float16")
_PALLAS_FP8 = "float8_e4m3fn"


def _pallas_fallback(q, kv_fp8_dtype) -> str | None:
    """Why the Pallas kernels cannot take these inputs (None: they can)."""
    dtype = str(q.dtype).removeprefix("torch.")
    if dtype not in _PALLAS_Q_DTYPES:
        return f"the Pallas kernels take bf16 / f16 q; q is {dtype}"
    if kv_fp8_dtype is not None and jnp.dtype(kv_fp8_dtype).name != _PALLAS_FP8:
        return (f"the Pallas kernels read {_PALLAS_FP8} pools; this pool is "
                f"{jnp.dtype(kv_fp8_dtype).name}")
    return None


def pallas_route(mode, meta, *, causal: bool = True) -> tuple[str, int | None]:
    """("decode", s_q) where `mla_decode` runs the call (causal, s_q <= PALLAS_MAX_S_Q queries
    for every request), else ("extend", None): `mla_extend` runs it."""
    s_q = _uniform_s_q(mode, meta)
    if causal and s_q is not None and s_q <= PALLAS_MAX_S_Q:
        return "decode", s_q
    return "extend", None


def _uniform_s_q(mode, meta) -> int | None:
    """s_q if every request has the same number of queries (known statically), else None."""
    if mode == "decode":
        return 1
    if mode in ("target_verify", "draft_extend"):
        return int(meta.num_draft_tokens)
    return None


def mla_attention(
    q,  # [T, H, 576] torch or JAX
    kv_pool,  # [slots, 576] / [slots, 1, 576] / [slots, 1, 1, 576], torch or JAX
    meta,  # funcmla.metadata.ForwardMetadata (JAX) for pallas/reference; torch metadata for aiter
    *,
    sm_scale: float,
    v_head_dim: int = 512,
    causal: bool = True,
    backend: str | None = None,
    max_kv_len: int | None = None,
    plan=None,
    num_kv_splits: int | None = None,
    kv_scale=None,
    q_scale=None,
    mode: str | None = None,
    kv_fp8_dtype=None,
    return_lse: bool = True,
    use_launcher: bool = False,
    launcher_inputs: tuple | None = None,
) -> AttentionResult:
    """Absorbed MLA attention over token-granular metadata on the selected backend.

    max_kv_len: static bound on KV tokens per request for the JAX backends (bucket it to few
                values to limit recompiles); None means the kv_indices capacity.
    plan, num_kv_splits, q_scale: AITER only (see aiter_dispatch.mla_decode).
    kv_scale:   AITER's kv_scale; on the JAX backends and the launcher, the dequant scale of an
                fp8 pool: a float, or a float32 tensor / array of shape () or [1]. A device
                tensor (SGLang's `layer.k_scale`) is read by the kernel, never by the host (no
                sync); values known on the host are checked positive and finite.
    mode:       "decode" | "extend" | "target_verify" | "draft_extend"; defaults to `meta.mode`
                (torch metadata with SGLang's fields has none: pass it). It picks the kernel.
    kv_fp8_dtype: JAX backends: `kv_pool` holds the uint8 bytes of an fp8 cache of this JAX
                dtype (as `to_jax(..., fp8="bits")` imports it); it is bitcast inside the jitted
                reference (no copy, later torch writes stay visible) and multiplied by
                `kv_scale` (a float) if given; the Pallas kernels read float8_e4m3fn bytes
                with `kv_scale` as k_scale (other fp8 formats fall back to the reference).
    return_lse: False skips exporting lse (one DLPack crossing less per call); lse is None.
    use_launcher, launcher_inputs: pallas with a torch q: launch the kernels straight on
                torch tensors through `funcmla.interop.launcher` (no DLPack; capturable in a
                torch CUDA graph), with launcher_inputs = (kv_pool, kv_indptr, kv_indices)
                torch tensors for a decode-shaped call (`torch_decode`; kv_indices of a static
                capacity: a launcher is built per shape), and (kv_pool, kv_indptr, kv_indices,
                qo_indptr) for any call, extends included (`torch_extend`: launchers per
                bucket of q rows and batch). An fp8 pool (torch.float8_e4m3fn, or uint8 bytes
                with kv_fp8_dtype, viewed as fp8 at no cost) runs there too, with kv_scale.
                Where the launcher cannot run, the DLPack + jit path runs on `kv_pool` /
                `meta` and `launcher_reason` says why.
    The output dtype is q's dtype; lse is float32.
    """
    name = select_backend(backend)
    mode = mode or getattr(meta, "mode", None)
    if name == "aiter":
        return _run_aiter(q, kv_pool, meta, mode=mode, sm_scale=sm_scale, v_head_dim=v_head_dim,
                          causal=causal, plan=plan, num_kv_splits=num_kv_splits,
                          q_scale=q_scale, kv_scale=kv_scale)
    from_torch = isinstance(q, torch.Tensor)
    fallback = launcher_reason = None
    route, s_q = pallas_route(mode, meta, causal=causal)
    if name == "pallas":
        fallback = _pallas_fallback(q, kv_fp8_dtype)
    if name == "pallas" and fallback is None and use_launcher:
        launcher_inputs = _launcher_pool_view(launcher_inputs, kv_fp8_dtype)
        launcher_reason = _launcher_reason(q, launcher_inputs, s_q=s_q, kv_fp8_dtype=kv_fp8_dtype)
        if launcher_reason is None:
            from funcmla.interop import launcher

            fp8_pool = launcher_inputs[0].dtype in _TORCH_FP8
            scale = launcher_scale(kv_scale) if fp8_pool else None
            pool, kv_indptr, kv_indices = launcher_inputs[:3]
            try:  # building a launcher can still refuse (e.g. no Mosaic GPU compiler): say why
                if s_q is None:
                    out, lse = launcher.torch_extend(
                        q, pool, launcher_inputs[3], kv_indptr, kv_indices,
                        sm_scale=float(sm_scale), causal=causal, max_kv_len=max_kv_len,
                        v_head_dim=v_head_dim, k_scale=scale, return_lse=return_lse)
                else:
                    out, lse = launcher.torch_decode(q, pool, kv_indptr, kv_indices,
                                                     sm_scale=float(sm_scale), s_q=s_q,
                                                     max_kv_len=max_kv_len,
                                                     v_head_dim=v_head_dim, k_scale=scale)
            except launcher.LauncherUnavailable as err:
                launcher_reason = f"the launcher is unavailable: {err}"
            else:
                return AttentionResult(out, lse if return_lse else None, "pallas",
                                       via="launcher")
    qj = to_jax(q) if from_torch else q
    kvj = to_jax(kv_pool) if isinstance(kv_pool, torch.Tensor) else kv_pool
    # the scale is a traced argument: per-layer scales share one compiled program
    scale = None if kv_scale is None or kv_fp8_dtype is None else _scale_array(kv_scale)
    fp8 = dict(kv_fp8_dtype=None if kv_fp8_dtype is None else jnp.dtype(kv_fp8_dtype).name,
               kv_scale=scale)
    if name == "pallas" and fallback is None and route == "decode":
        out, lse = _pallas(qj, kvj, meta.kv_indptr, meta.kv_indices, sm_scale=float(sm_scale),
                           s_q=s_q, max_kv_len=max_kv_len, v_head_dim=v_head_dim, **fp8)
        ran = "pallas"
    elif name == "pallas" and fallback is None:
        out, lse = _pallas_ragged(qj, kvj, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                  sm_scale=float(sm_scale), causal=causal,
                                  max_kv_len=max_kv_len, v_head_dim=v_head_dim, **fp8)
        ran = "pallas"
    else:
        out, lse = _reference(qj, kvj, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                              sm_scale=float(sm_scale), v_head_dim=v_head_dim, causal=causal,
                              max_kv_len=max_kv_len, out_dtype=jnp.dtype(qj.dtype),
                              kv_fp8_dtype=None if kv_fp8_dtype is None
                              else jnp.dtype(kv_fp8_dtype), kv_scale=scale)
        ran = "reference"
    if not return_lse:
        lse = None
    if from_torch:
        out = to_torch(out)
        lse = None if lse is None else to_torch(lse)
    return AttentionResult(out, lse, ran, fallback, launcher_reason=launcher_reason)


# torch's fp8 dtypes, by JAX dtype name (a uint8 pool of fp8 bytes is viewed as one of them).
_TORCH_FP8_BY_NAME = {jnp.dtype(v).name: k for k, v in FP8_DTYPES.items()}
_TORCH_FP8 = frozenset(FP8_DTYPES)


def _launcher_pool_view(launcher_inputs, kv_fp8_dtype):
    """launcher_inputs with a uint8 pool of fp8 bytes (kv_fp8_dtype names their format) viewed
    as that torch fp8 dtype (no copy); unchanged otherwise."""
    if kv_fp8_dtype is None or launcher_inputs is None or len(launcher_inputs) not in (3, 4):
        return launcher_inputs
    pool = launcher_inputs[0]
    if isinstance(pool, torch.Tensor) and pool.dtype == torch.uint8:
        fp8 = _TORCH_FP8_BY_NAME.get(jnp.dtype(kv_fp8_dtype).name)
        if fp8 is not None:
            return (pool.view(fp8),) + tuple(launcher_inputs[1:])
    return launcher_inputs


def _launcher_reason(q, launcher_inputs, *, s_q: int | None = 1,
                     kv_fp8_dtype=None) -> str | None:
    """None if the torch launcher can run q with launcher_inputs (kv_pool, kv_indptr,
    kv_indices[, qo_indptr]): a decode of s_q queries per request (`pallas_route`), or, with
    qo_indptr, an extend (s_q None); else why not. kv_fp8_dtype: the format of a uint8 pool's
    fp8 bytes (`_launcher_pool_view`)."""
    n = 3 if s_q is not None else 4
    if launcher_inputs is None or len(launcher_inputs) not in (n, 4):
        return ("the launcher needs launcher_inputs=(kv_pool, kv_indptr, kv_indices"
                + (")" if n == 3 else ", qo_indptr) for an extend-shaped call (not causal, "
                   f"or more than {PALLAS_MAX_S_Q} queries per request)"))
    launcher_inputs = _launcher_pool_view(launcher_inputs, kv_fp8_dtype)
    try:
        from funcmla.interop import launcher
    except ImportError as err:
        return f"funcmla.interop.launcher is not importable ({err})"
    pool, kv_indptr, kv_indices = launcher_inputs[:3]
    if s_q is None:
        return launcher.torch_extend_unsupported_reason(q, pool, launcher_inputs[3], kv_indptr,
                                                        kv_indices)
    return launcher.torch_decode_unsupported_reason(q, pool, kv_indptr, kv_indices)


def _run_aiter(q, kv_pool, meta, *, mode, sm_scale, v_head_dim, causal, plan, num_kv_splits,
               q_scale, kv_scale) -> AttentionResult:
    if not isinstance(q, torch.Tensor) or not isinstance(kv_pool, torch.Tensor):
        raise TypeError("the aiter backend takes torch tensors (q, kv_pool)")
    if not causal:
        raise ValueError("the AITER MLA path here is causal (bottom-right) only")
    if num_kv_splits is None:
        raise ValueError("the aiter backend needs num_kv_splits (always passed to AITER)")
    if mode not in ("decode", "extend", "target_verify", "draft_extend"):
        raise ValueError(f"the aiter backend needs mode= (decode/extend/...), got {mode!r}")
    if mode == "extend":
        out = aiter_dispatch.mla_prefill(q, kv_pool, meta, sm_scale=sm_scale,
                                         num_kv_splits=num_kv_splits, v_head_dim=v_head_dim)
        return AttentionResult(out, None, "aiter", via="torch")
    out, lse = aiter_dispatch.mla_decode(q, kv_pool, meta, plan, sm_scale=sm_scale,
                                         num_kv_splits=num_kv_splits, v_head_dim=v_head_dim,
                                         q_scale=q_scale, kv_scale=kv_scale)
    return AttentionResult(out, lse, "aiter", via="torch")
