"""Ragged MHA prefill: argument checks and the entry point of the Mosaic GPU prefill kernel.

`mha_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale=..., causal=...)` runs
`prefill_mgpu.prefill_kernel` on checked arguments and returns (out [Tq, H, 128], lse [Tq, H]);
`prefill_step` builds the schedule it runs on once for a serving step's layers.
`_check_tensors` and `_check_indptrs` hold the static checks (one home each),
`validate_prefill_inputs` the eager check of index values (also run by `prefill_step` when the
indptrs are concrete), `prefill_kernel_config` the tile configuration for the batch's longest
request (one home: the torch launcher and the SGLang backend ask it too). Partial results over
disjoint key sets combine with `merge.merge_attention_states`. Design and numbers:
docs/prefill_kernel.md; reproduce with `python -m bench.prefill`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas.prefill_mgpu import (
    HEAD_DIM,
    V_HEAD_DIM,
    MgpuPrefillConfig,
    prefill_kernel,
)
from funcmla.attention.pallas.prefill_layout import (
    PrefillGeometry,
    live_tile_count,
    prefill_geometry,
    prefill_layout,
)
from funcmla.attention.kv_quant import is_fp8_kv, one_scale
from funcmla.checks import check_indptr
from funcmla.guards import EAGER
from funcmla.layout import expect_index_array

__all__ = ["mha_prefill", "prefill_step", "PrefillStep", "validate_prefill_inputs",
           "prefill_kernel_config", "HEAD_DIMS", "SHORT_KV_LEN", "SHORT_CONFIG"]

# The (q/k head dim, v head dim) pairs the kernel takes: DeepSeek's decompressed MHA
# (128 nope + 64 rope, v 128).
HEAD_DIMS = ((HEAD_DIM, V_HEAD_DIM),)

# Batches whose longest request has at most SHORT_KV_LEN keys run 64-token tiles, two q
# tiles a CTA in three stages: a q tile there holds few KV tiles, so the shorter tile halves
# its causal tail and a CTA's start is paid once per two q tiles; past it 128-token tiles
# (the default config) win. Crossover from `bench.prefill --sweep --configs
# kv128_s2_pp,kv64_s4_pp` over 256..16k tokens a request, re-measured with two q tiles a CTA
# (`--configs kv128_s2_pp,kv64_s3_pp_g2`: about 2048 keys, within 4% of each other from 1536),
# tiles a CTA from `--configs kv64_s4_pp,kv64_s3_pp_g2,kv64_s3_pp_g3,kv64_s3_pp_g4`
# (docs/prefill_kernel.md, "Tile configuration by request length").
SHORT_KV_LEN = 1536
SHORT_CONFIG = MgpuPrefillConfig(block_kv=64, num_stages=3, tiles_per_cta=2)


def prefill_kernel_config(max_kv_len: int | None) -> MgpuPrefillConfig:
    """The kernel configuration for a batch whose longest request has `max_kv_len` keys:
    `SHORT_CONFIG` up to `SHORT_KV_LEN`, else the default `MgpuPrefillConfig()`; None (the
    lengths are not known on the host, e.g. traced indptrs under jit) gives the default.
    Only speed depends on it: every configuration computes the same attention."""
    if max_kv_len is None:
        return MgpuPrefillConfig()
    if not isinstance(max_kv_len, numbers.Integral) or isinstance(max_kv_len, bool) \
            or max_kv_len < 0:
        raise ValueError(f"max_kv_len must be an int >= 0 or None, got {max_kv_len!r}")
    return SHORT_CONFIG if max_kv_len <= SHORT_KV_LEN else MgpuPrefillConfig()


def _check_indptrs(qo_indptr, kv_indptr) -> None:
    """Static checks of the token CSRs (dtype, shape [B + 1], B >= 1, one B for both): a
    TypeError (dtype) or ValueError naming the argument and the value."""
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        expect_index_array(x, name)
        if x.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != 1 or x.shape[0] < 2:
            raise ValueError(f"{name} must have shape [B + 1] with B >= 1, got {x.shape}")
    if qo_indptr.shape != kv_indptr.shape:
        raise ValueError(f"qo_indptr {qo_indptr.shape} and kv_indptr {kv_indptr.shape} must "
                         "both be [B + 1] for the same B")


def _check_tensors(q, k, v, *, sm_scale) -> None:
    """Static checks of q / k / v (rank, dtype, head dims, heads, token counts) and sm_scale:
    a TypeError (dtype) or ValueError naming the argument and the value or limit."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape [T, H, D], got {x.shape}")
        if x.dtype != jnp.bfloat16 and not is_fp8_kv(x.dtype):
            raise TypeError(f"{name} ({x.dtype}) must be bfloat16, or float8_e4m3fn / "
                            "float8_e4m3fnuz with an optional scale")
    pair = (q.shape[2], v.shape[2])
    if k.shape[2] != q.shape[2] or pair not in HEAD_DIMS:
        raise ValueError(f"head dims q {q.shape[2]} / k {k.shape[2]} / v {v.shape[2]} are not "
                         f"supported: (q and k, v) must be one of {HEAD_DIMS}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same tokens and heads")
    if q.shape[1] < 1 or k.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}: the kernel takes "
                         "num_kv_heads = H >= 1 (no grouped heads)")
    if not (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
            and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive finite float")


def validate_prefill_inputs(qo_indptr, kv_indptr, num_q: int, num_kv: int, *,
                            causal: bool) -> None:
    """Eager value check of the token CSRs: each starts at 0, does not decrease and ends within
    its tensor (qo_indptr[-1] <= Tq = num_q, kv_indptr[-1] <= Tk = num_kv); causal requests
    have kv_len >= q_len. Raises ValueError naming the field, the request and the values."""
    for name, x, limit, what in (("qo_indptr", qo_indptr, num_q, "q.shape[0]"),
                                 ("kv_indptr", kv_indptr, num_kv, "k.shape[0]")):
        a = np.asarray(x)
        check_indptr(a, name, checker=EAGER)
        if a[-1] > limit:
            raise ValueError(f"{name}[-1] = {a[-1]} exceeds {what} = {limit}")
    if causal:
        q_lens = np.diff(np.asarray(qo_indptr))
        kv_lens = np.diff(np.asarray(kv_indptr))
        short = kv_lens < q_lens
        if short.any():
            i = int(short.argmax())
            raise ValueError(f"request {i}: kv_len {kv_lens[i]} < q_len {q_lens[i]}; causal "
                             "(bottom-right) attention needs kv_len >= q_len")


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("operands",),
                   meta_fields=("num_q", "num_kv", "causal", "config", "geometry",
                                "interpret"))
@dataclasses.dataclass(frozen=True)
class PrefillStep:
    """`mha_prefill`'s schedule for one batch of token CSRs (`prefill_step`): built once, it
    serves every layer whose q / k / v have these row counts, so a layer runs only the kernel
    (and a row padding where a row count is not a multiple of 8 or is under a tile;
    `python -m bench.prefill`: `layer_us`). A pytree: the arrays are its leaves, the rest is
    static.

    operands: the kernel's six int32 operands (request starts and lengths, tile schedule;
        `prefill_layout`).
    """

    operands: tuple
    num_q: int
    num_kv: int
    causal: bool
    config: MgpuPrefillConfig
    geometry: PrefillGeometry
    interpret: object


def prefill_step(qo_indptr: jax.Array, kv_indptr: jax.Array, num_q: int, num_kv: int, *,
                 causal: bool = True, config: MgpuPrefillConfig | None = None,
                 max_kv_len: int | None = None, interpret=False) -> PrefillStep:
    """The schedule of `mha_prefill` over token CSRs qo_indptr / kv_indptr (int32 [B + 1]) for
    q of num_q rows and k / v of num_kv rows: checked index values where concrete
    (`validate_prefill_inputs`, with `causal`'s kv_len >= q_len), the tile config
    (`config`, or `prefill_kernel_config` of the longest kv_len from concrete indptrs or of
    `max_kv_len`), and the kernel's index operands. Where the indptrs are concrete the
    operands are computed now (an outer jit holds them as constants) for a grid of the batch's
    own tiles (`slot_count`); traced ones get the grid that covers any batch. A serving step
    builds it once for all its layers: `mha_prefill(q, k, v, step=step, sm_scale=...)`."""
    for name, n in (("num_q", num_q), ("num_kv", num_kv)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be an int >= 0 (a row count), got {n!r}")
    _check_indptrs(qo_indptr, kv_indptr)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    concrete_kv = _is_concrete(kv_indptr)
    concrete = concrete_kv and _is_concrete(qo_indptr)
    if concrete:
        validate_prefill_inputs(qo_indptr, kv_indptr, num_q, num_kv, causal=causal)
    if config is None:
        if max_kv_len is None and concrete_kv:
            max_kv_len = int(np.max(np.diff(np.asarray(kv_indptr))))
        config = prefill_kernel_config(max_kv_len)
    elif max_kv_len is not None:
        raise ValueError("max_kv_len picks the config: pass one of config and max_kv_len")
    if not isinstance(config, MgpuPrefillConfig):
        raise TypeError(f"config must be a MgpuPrefillConfig, got {type(config).__name__}")
    # concrete indptrs: the grid's tile axis sized to this batch (`slot_count`)
    live_tiles = live_tile_count(qo_indptr, num_q) if concrete else None
    geometry = prefill_geometry(num_q, num_kv, qo_indptr.shape[0] - 1,
                                block_kv=config.block_kv, interpret=interpret,
                                live_tiles=live_tiles)
    # concrete indptrs: computed now, so an outer jit holds the schedule as constants
    with jax.ensure_compile_time_eval() if concrete else contextlib.nullcontext():
        operands = _schedule(qo_indptr, kv_indptr, num_q=num_q, num_kv=num_kv,
                             geometry=geometry) if num_q else ()
    return PrefillStep(tuple(operands), int(num_q), int(num_kv), causal, config, geometry,
                       interpret)


def mha_prefill(q: jax.Array, k: jax.Array, v: jax.Array, qo_indptr: jax.Array | None = None,
                kv_indptr: jax.Array | None = None, *, sm_scale: float,
                causal: bool | None = None, config: MgpuPrefillConfig | None = None,
                max_kv_len: int | None = None, q_scale=None, k_scale=None, v_scale=None,
                interpret=None, step: PrefillStep | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Ragged multi-head attention over token CSRs (prefill / extend), Mosaic GPU kernel.

    q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128] (`HEAD_DIMS`): each bfloat16, or fp8
        (float8_e4m3fn / float8_e4m3fnuz) standing for x_scale * float(x), as SGLang's fp8
        prefill passes them (unit scales there). q_scale / k_scale / v_scale: None (1), a
        positive float or a float32 array of shape () or [1]; only for an fp8 operand. An fp8
        operand is dequantized to bfloat16 before the kernel (exact at scale 1, one bf16
        rounding of x * scale otherwise); the kernel computes in bf16 as for bf16 inputs
        (docs/prefill_kernel.md, "fp8 inputs").
    qo_indptr, kv_indptr: int32 [B + 1], request i's queries are q rows
        [qo_indptr[i], qo_indptr[i + 1]), its keys k / v rows [kv_indptr[i], kv_indptr[i + 1]).
    step: instead of the indptrs, a `PrefillStep` of them (`prefill_step`), built once for the
        layers of a serving step; causal, config / max_kv_len and interpret are then the
        step's (passing a different one is an error).
    causal: bottom-right: query j of a request with q_len queries and kv_len keys sees keys
        < kv_len - q_len + 1 + j (needs kv_len >= q_len); False: every key of its request.
        None: the step's, else True.
    sm_scale: softmax scale (static positive float). config: `MgpuPrefillConfig`, or None:
        `prefill_kernel_config` of the longest request's kv_len, read from concrete indptrs or
        given as `max_kv_len` (a host-side hint, e.g. SGLang's seq_lens_cpu maximum; a static
        int) where the indptrs are traced; with neither, the default config.
    interpret: False (compiled, sm_90a), True (Mosaic GPU interpret mode, CPU) or Pallas's GPU
        interpreter parameters; None: the step's, else False.

    Returns out [Tq, H, 128] (q's dtype; bfloat16 for an fp8 q) and lse [Tq, H] float32 (natural
    log of the softmax denominator of the scaled scores). A query with no visible key (a request
    with kv_len 0, rows past qo_indptr[-1]) gets out 0 and lse +inf. Rows of k / v outside every
    request (NaN, Inf) never reach an output. Index values are checked here when concrete
    (`validate_prefill_inputs`); under an outer jit they are the caller's contract and nothing
    is read or written out of bounds. Requests start on any row (the kernel reads from the 8-row
    group holding a request's first row and masks the rows before it); q / k / v are copied
    only to pad a row count that is not a multiple of 8 or is under one tile.
    """
    _check_tensors(q, k, v, sm_scale=sm_scale)
    if step is None:
        if qo_indptr is None or kv_indptr is None:
            raise ValueError("mha_prefill needs qo_indptr and kv_indptr, or step=")
        step = prefill_step(qo_indptr, kv_indptr, q.shape[0], k.shape[0],
                            causal=True if causal is None else causal, config=config,
                            max_kv_len=max_kv_len,
                            interpret=False if interpret is None else interpret)
    else:
        _check_step(step, q, k, qo_indptr, kv_indptr, causal=causal, config=config,
                    max_kv_len=max_kv_len, interpret=interpret)
    scales = tuple(one_scale(f"{n}_scale", s, x.dtype, who=n)
                   for n, s, x in (("q", q_scale, q), ("k", k_scale, k), ("v", v_scale, v)))
    return _mha_prefill(q, k, v, step, scales, sm_scale=float(sm_scale))


def _check_step(step, q, k, qo_indptr, kv_indptr, *, causal, config, max_kv_len, interpret):
    """A step given to `mha_prefill`: of these row counts, and nothing it fixed passed again."""
    if not isinstance(step, PrefillStep):
        raise TypeError(f"step must be a PrefillStep (prefill_step), got {type(step).__name__}")
    if qo_indptr is not None or kv_indptr is not None:
        raise ValueError("pass the indptrs or step=, not both (the step holds its indptrs)")
    if config is not None or max_kv_len is not None:
        raise ValueError("config / max_kv_len are the step's: pass them to prefill_step")
    for name, got, want in (("causal", causal, step.causal),
                            ("interpret", interpret, step.interpret)):
        if got is not None and got != want:
            raise ValueError(f"{name}={got!r} disagrees with the step's {name}={want!r}")
    if q.shape[0] != step.num_q or k.shape[0] != step.num_kv:
        raise ValueError(f"q has {q.shape[0]} rows and k / v {k.shape[0]}; the step was built "
                         f"for num_q={step.num_q} and num_kv={step.num_kv}")


@functools.partial(jax.jit, static_argnames=("num_q", "num_kv", "geometry"))
def _schedule(qo_indptr, kv_indptr, *, num_q, num_kv, geometry):
    """The kernel index operands of a `PrefillStep`."""
    return tuple(prefill_layout(qo_indptr, kv_indptr, num_q, num_kv, geometry))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _mha_prefill(q, k, v, step, scales=(None, None, None), *, sm_scale):
    q, k, v = (_dequantized(x, s) for x, s in zip((q, k, v), scales))
    tq, h, _ = q.shape
    if tq == 0:
        return (jnp.zeros((0, h, V_HEAD_DIM), q.dtype), jnp.zeros((0, h), jnp.float32))
    geometry = step.geometry
    qp = _pad_rows(q, geometry.q_rows)
    kp, vp = _pad_rows(k, geometry.kv_rows), _pad_rows(v, geometry.kv_rows)
    kernel = prefill_kernel(geometry.q_rows, h, geometry.num_reqs, q.dtype, sm_scale=sm_scale,
                            causal=step.causal, config=step.config, interpret=step.interpret,
                            num_slots=geometry.num_slots)
    out, lse = kernel(*step.operands, qp, kp, vp)
    return out[:tq], lse[:tq]


def _dequantized(x, scale):
    """x as the kernel's bfloat16: an fp8 operand's float(x) * scale (exact without a scale:
    every fp8 value is a bf16 value), a bf16 one as it is."""
    if x.dtype == jnp.bfloat16:
        return x
    y = x.astype(jnp.float32)
    return (y if scale is None else y * scale[0]).astype(jnp.bfloat16)


def _pad_rows(x, rows: int):
    if x.shape[0] >= rows:
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0)))
