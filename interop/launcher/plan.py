"""Plan: the static configuration of a decode launcher and the kernels its JAX path runs."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import KV_FP8_DTYPE, DecodeKernelConfig, kernel_choice, mla_decode
from funcmla.attention.pallas.api import _mla_decode_kv, pool_scales
from funcmla.attention.pallas.decode_common import KVRows, num_row_blocks
from funcmla.interop.launcher.checks import _SHORT_DTYPES
from funcmla.interop.launcher.errors import LauncherUnavailable
from funcmla.interop.launcher.extract import (MosaicCall, TritonCall, extract_kernel_calls,
                                              lower_for_cuda)
from funcmla.interop.launcher.support import jaxlib_unsupported_reason
from funcmla.layout import PageTable, check_page_size


_JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Pool dtypes other than q's: the fp8 format the decode kernels read (with k_scale / v_scale).
_KV_DTYPES = {KV_FP8_DTYPE.name: KV_FP8_DTYPE}


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig:
    """Static configuration of one compiled decode launcher.

    num_seqs:    B (requests), num_heads: H, s_q: query tokens per request (T = B * s_q).
    pool_rows:   rows (token slots) of kv_pool [pool_rows, head_dim].
    page_size:   1: token CSR (kv_indptr [B+1], kv_indices [kv_capacity] token slots);
                 > 1: page table [B, kv_capacity // B] of page ids + lengths [B] (tokens).
    kv_capacity: entries of the index table: len(kv_indices), or B * max_pages.
    max_kv_len:  token CSR only: static bound on KV tokens per request for the split rule;
                 None: kv_capacity (as `mla_decode`). Page tables imply max_pages * page_size.
    num_splits:  split-KV count; None: what `mla_decode` picks (its split rule).
    dtype:       q's (and out's) dtype, "bfloat16" or "float16".
    kv_dtype:    the pool's dtype: None (q's dtype), or "float8_e4m3fn" for an fp8 pool read
                 with per-call k_scale / v_scale (float32 operands of the kernel, which is
                 `mla_decode`'s choice as for bf16). q's own dtype name is stored as None.
    lens:        the "lens" index form of `KVRows` instead: table_start [B] (entries),
                 kv_lens [B] (tokens) and a table [kv_capacity] of entries (token slots, or
                 page ids at page_size > 1), max_kv_len its static bound on kv_lens (needed).
                 Sequences may share table entries: the extend launcher's pseudo-sequences
                 (`funcmla.interop.launcher.extend`).
    """

    num_seqs: int
    num_heads: int
    pool_rows: int
    kv_capacity: int
    sm_scale: float
    s_q: int = 1
    max_kv_len: int | None = None
    num_splits: int | None = None
    head_dim: int = 576
    v_head_dim: int = 512
    dtype: str = "bfloat16"
    kernel: DecodeKernelConfig = DecodeKernelConfig()
    page_size: int = 1
    kv_dtype: str | None = None
    lens: bool = False

    def __post_init__(self):
        for name in ("num_seqs", "num_heads", "pool_rows", "kv_capacity", "s_q", "head_dim",
                     "v_head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecodeLaunchConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_kv_len", "num_splits"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"DecodeLaunchConfig.{name} must be None or a positive int, "
                                 f"got {value!r}")
        check_page_size(self.page_size, "DecodeLaunchConfig.page_size")
        if not isinstance(self.lens, bool):
            raise TypeError(f"DecodeLaunchConfig.lens must be a bool, got {self.lens!r}")
        if self.lens and self.max_kv_len is None:
            raise ValueError("DecodeLaunchConfig.max_kv_len is needed with lens=True (the "
                             "static bound on kv_lens the split rule reads)")
        if self.page_size > 1 and not self.lens:
            if self.kv_capacity % self.num_seqs:
                raise ValueError(f"DecodeLaunchConfig.kv_capacity={self.kv_capacity} must be "
                                 f"num_seqs * max_pages (num_seqs={self.num_seqs}) for a page "
                                 "table")
            if self.max_kv_len is not None:
                raise ValueError("DecodeLaunchConfig.max_kv_len is implied by the page table "
                                 "(max_pages * page_size); leave it None")
        if self.dtype not in _JNP_DTYPES:
            raise ValueError(f"DecodeLaunchConfig.dtype must be one of {sorted(_JNP_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.kv_dtype == self.dtype:
            object.__setattr__(self, "kv_dtype", None)  # one key per configuration
        if self.kv_dtype is not None and self.kv_dtype not in _KV_DTYPES:
            raise ValueError(f"DecodeLaunchConfig.kv_dtype must be None (q's dtype, "
                             f"{self.dtype!r}) or one of {sorted(_KV_DTYPES)}, got "
                             f"{self.kv_dtype!r}")
        if not isinstance(self.kernel, DecodeKernelConfig):
            raise TypeError(f"DecodeLaunchConfig.kernel must be a DecodeKernelConfig, got "
                            f"{type(self.kernel).__name__}")

    @property
    def fp8(self) -> bool:
        """Whether the pool is fp8 (read with k_scale / v_scale)."""
        return self.kv_dtype is not None

    @property
    def pool_dtype(self) -> str:
        """The pool's dtype name (kv_dtype, else q's dtype)."""
        return self.kv_dtype or self.dtype

    @property
    def rows(self) -> int:
        return self.s_q * self.num_heads

    @property
    def block_m(self) -> int:
        return self.kernel.resolved_block_m(self.rows)

    @property
    def rows_pad(self) -> int:
        return num_row_blocks(self.rows, self.block_m) * self.block_m

    @property
    def max_pages(self) -> int:
        """Page-table width (entries per request; kv_capacity // num_seqs)."""
        return self.kv_capacity // self.num_seqs

    @property
    def resolved_max_kv_len(self) -> int:
        if self.page_size > 1 and not self.lens:
            return self.max_pages * self.page_size
        return self.kv_capacity if self.max_kv_len is None else self.max_kv_len


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The kernels of one decode configuration, read from its JAX path (no GPU needed).

    decode / merge: the Pallas calls of `mla_decode` for this configuration, in program
    order (merge only when num_splits > 1): the decode is a `MosaicCall` where `mla_decode`
    picks the Mosaic GPU kernel, else a `TritonCall`; kernel_reason: None for Mosaic GPU, else
    why the JAX path runs the Triton kernel for these shapes; source: (the jitted JAX path,
    its input avals), which the "xla" route compiles. decode_inputs: per decode operand, the
    launcher input whose bytes it is (`input_names`; "q_pad": the launcher's zero-padded copy
    of q), read from the operand's source in the lowering, so an operand that is a reshape or
    bitcast of an input (the same bytes) is wired to that input's pointer."""

    config: DecodeLaunchConfig
    num_splits: int
    decode: TritonCall | MosaicCall
    merge: TritonCall | None
    source: tuple = dataclasses.field(compare=False, repr=False)
    kernel_reason: str | None = None
    decode_inputs: tuple[str, ...] = ()

    @property
    def calls(self) -> tuple[TritonCall | MosaicCall, ...]:
        return (self.decode,) if self.merge is None else (self.decode, self.merge)

    @property
    def triton_calls(self) -> tuple[TritonCall, ...]:
        return tuple(c for c in self.calls if isinstance(c, TritonCall))

    @property
    def rows_pad(self) -> int:
        """Query rows per sequence as the decode kernel takes them (Triton pads to its row
        block; the Mosaic GPU kernel only takes multiples of its own)."""
        return self.config.rows if isinstance(self.decode, MosaicCall) else self.config.rows_pad

    @property
    def kernel(self) -> str:
        """"mgpu" or "triton": the decode kernel this plan runs."""
        return "mgpu" if isinstance(self.decode, MosaicCall) else "triton"


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def input_names(config: DecodeLaunchConfig) -> tuple[str, ...]:
    """The launcher's inputs in `jax_path`'s parameter order: q, kv_pool, the index tensors
    (kv_indptr, kv_indices; page_table, lengths; or table_start, kv_lens, table with lens),
    then k_scale, v_scale for an fp8 pool."""
    if config.lens:
        index = ("table_start", "kv_lens", "table")
    elif config.page_size == 1:
        index = ("kv_indptr", "kv_indices")
    else:
        index = ("page_table", "lengths")
    return ("q", "kv_pool") + index + (("k_scale", "v_scale") if config.fp8 else ())


def jax_path(config: DecodeLaunchConfig) -> tuple[Callable, tuple]:
    """(fn, avals): `mla_decode` for `config` as a function of the launcher's inputs, in the
    order of `input_names`: (q, kv_pool, kv_indptr, kv_indices) or (q, kv_pool, page_table,
    lengths), then (k_scale, v_scale) float32 [1] for an fp8 pool."""
    c = config
    dt = _JNP_DTYPES[c.dtype]
    b, t, i32 = c.num_seqs, c.num_seqs * c.s_q, jnp.int32
    q = _sds((t, c.num_heads, c.head_dim), dt)
    pool = _sds((c.pool_rows, c.head_dim), _KV_DTYPES[c.kv_dtype] if c.fp8 else dt)
    scales = (_sds((1,), jnp.float32), _sds((1,), jnp.float32)) if c.fp8 else ()
    # The kernel choice is mla_decode's own (DecodeKernelConfig.kernel, "auto" by default), so
    # the launcher runs the kernel the JAX path runs for these shapes in this process.
    common = dict(sm_scale=float(c.sm_scale), s_q=c.s_q, num_splits=c.num_splits,
                  config=c.kernel, v_head_dim=c.v_head_dim)
    if c.lens:
        def lens(q, kv_pool, table_start, kv_lens, table, *scale):
            # `mla_extend`'s call over its pseudo-sequences (`_mla_extend`)
            kv = KVRows(table, table_start, kv_lens, c.page_size, c.max_kv_len)
            scales = pool_scales(kv_pool, None, *(scale or (None, None)))
            return _mla_decode_kv(q, kv_pool, kv, scales, interpret=False, **common)

        return lens, (q, pool, _sds((b,), i32), _sds((b,), i32),
                      _sds((c.kv_capacity,), i32)) + scales
    if c.page_size == 1:
        def csr(q, kv_pool, kv_indptr, kv_indices, *scale):
            return mla_decode(q, kv_pool, kv_indptr=kv_indptr, kv_indices=kv_indices,
                              max_kv_len=c.max_kv_len, **common, **_scale_args(scale))

        return csr, (q, pool, _sds((b + 1,), i32), _sds((c.kv_capacity,), i32)) + scales

    def paged(q, kv_pool, page_table, lengths, *scale):
        return mla_decode(q, kv_pool, page_table=PageTable(page_table, lengths, c.page_size),
                          **common, **_scale_args(scale))

    return paged, (q, pool, _sds((b, c.max_pages), i32), _sds((b,), i32)) + scales


def _scale_args(scale: tuple) -> dict:
    return dict(zip(("k_scale", "v_scale"), scale))


def triton_reason(config: DecodeLaunchConfig) -> str:
    """Why `mla_decode` runs the Triton kernel for `config` in this process: its auto
    dispatch's own reason (`kernel_choice`; the extracted calls are what the launcher trusts)."""
    c = config
    q = _sds((c.num_seqs * c.s_q, c.num_heads, c.head_dim), _JNP_DTYPES[c.dtype])
    return kernel_choice(c.kernel, q, c.page_size, c.s_q, v_head_dim=c.v_head_dim,
                         kv_dtype=_KV_DTYPES[c.kv_dtype] if c.fp8 else None,
                         pool_rows=c.pool_rows)[1]


def decode_plan(config: DecodeLaunchConfig) -> DecodePlan:
    """Lower `mla_decode` for `config` for CUDA and read its kernels back (cached per config).
    Raises LauncherUnavailable on a jaxlib the extraction was not tested on (`support.py`)."""
    why = jaxlib_unsupported_reason()
    if why is not None:
        raise LauncherUnavailable(why)
    return _decode_plan(config)


@functools.lru_cache(maxsize=128)
def _decode_plan(config: DecodeLaunchConfig) -> DecodePlan:
    c = config
    b, d, dv, rp = c.num_seqs, c.head_dim, c.v_head_dim, c.rows_pad
    fn, avals = jax_path(c)
    try:
        calls = extract_kernel_calls(lower_for_cuda(fn, *avals))
    except ValueError as err:  # e.g. kernel="mgpu" on a shape the Mosaic GPU kernel refuses
        raise LauncherUnavailable(f"mla_decode does not lower: {err} (for {c})") from err
    dname = _SHORT_DTYPES[c.dtype]
    if not calls:
        raise LauncherUnavailable(f"the JAX path of {c} has no Pallas kernel call")
    mosaic = isinstance(calls[0], MosaicCall)
    # Both kernels take q as [B, rows, D] (the s_q tokens of a sequence are consecutive, so
    # this is q's own memory); rows = s_q * H for Mosaic GPU (a multiple of its 64-row block),
    # rows_pad (s_q * H padded to the Triton row block) for Triton.
    rows = c.rows if mosaic else rp
    decode = calls[0]
    inputs = _wired_inputs(c, decode, avals, q_pad=((b, rows, d), dname) if rows != c.rows
                           else None)
    splits = decode.results[0][0][1] if mosaic else decode.grid[1]
    o_dtype = dname if splits == 1 else _SHORT_DTYPES[c.kernel.partial_dtype]
    want_out = (((b, splits, rows, dv), o_dtype), ((b, splits, rows), "f32"))
    want_merge = (want_out, (((b, rows, dv), dname), ((b, rows), "f32")))
    ok = decode.results == want_out and len(calls) == (1 if splits == 1 else 2)
    if ok and splits > 1:
        ok = (isinstance(calls[1], TritonCall)
              and (calls[1].operands, calls[1].results) == want_merge)
    if not ok:
        raise LauncherUnavailable(
            "the JAX path's kernels are not the ones this launcher wires: got "
            f"{[(k.name, k.operands, k.results) for k in calls]}, expected decode -> "
            f"{want_out}" + (f", then a merge {want_merge}" if splits > 1 else ""))
    return DecodePlan(c, splits, decode, calls[1] if splits > 1 else None, (fn, avals),
                      kernel_reason=None if mosaic else triton_reason(c), decode_inputs=inputs)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of MLIR element type `dtype` ("bf16", "f8E4M3FN", "ui16", ...)."""
    m = re.match(r"(?:b?f|u?i)(\d+)", dtype)
    if m is None or int(m.group(1)) % 8:
        raise LauncherUnavailable(f"a kernel operand of element type {dtype}: not wired by the "
                                  "launcher")
    return math.prod(shape) * int(m.group(1)) // 8


def _wired_inputs(c: DecodeLaunchConfig, call: TritonCall | MosaicCall, avals: tuple,
                  q_pad: tuple | None) -> tuple[str, ...]:
    """The launcher input feeding each operand of the decode call (see
    `DecodePlan.decode_inputs`): an operand whose source is a parameter of the JAX path must
    hold all of that parameter's bytes; the only computed operand taken is the zero-padded q
    (`q_pad`: its (shape, dtype)), which the launcher copies into its own buffer. Every input
    must reach the kernel. Raises LauncherUnavailable otherwise."""
    names = input_names(c)
    needed = (set(names) - {"q"}) | {"q_pad"} if q_pad is not None else set(names)
    got: list[str] = []
    why = None
    if len(call.sources) != len(call.operands):
        why = "its operands' sources were not read"
    for i, (sig, src) in enumerate(zip(call.operands, call.sources)):
        if why is not None:
            break
        if src is None:
            if sig != q_pad or "q_pad" in got:
                why = f"operand {i} {sig} is computed in the JAX path, not an input's bytes"
            got.append("q_pad")
            continue
        aval = avals[src]
        want = math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize
        if _nbytes(*sig) != want:
            why = (f"operand {i} {sig} views {names[src]} {tuple(aval.shape)} "
                   f"{jnp.dtype(aval.dtype).name} but holds {_nbytes(*sig)} of its {want} bytes")
        got.append(names[src])
    if why is None and set(got) != needed:
        why = f"it reads {sorted(set(got))}; the launcher wires {sorted(needed)}"
    if why is not None:
        raise LauncherUnavailable(
            f"the JAX path's decode kernel {call.name} is not the one this launcher wires: "
            f"{why} (operands {call.operands}, sources {call.sources}; "
            "funcmla.attention.pallas changed its pallas_call)")
    return tuple(got)
