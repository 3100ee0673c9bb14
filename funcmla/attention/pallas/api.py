"""The decode entry points: argument checks, the choice of kernel, and the split merge.

`mla_decode` takes a token CSR or a page table, checks every static argument (shapes, dtypes,
page size, heads, s_q, split count), picks the kernel (`uses_mgpu`: the Mosaic GPU kernel where
it applies and the batch fills a quarter of the GPU, else the Triton-lowered one), runs it with
the split rule's count (`decode_num_splits`) and merges the splits (`merge_splits_pallas`).
`mla_decode_rows` and `mla_decode_rows_mgpu` run one kernel alone. An fp8 pool
(float8_e4m3fn, with `k_scale` / `v_scale`: `funcmla.attention.kv_quant`) runs an fp8
Mosaic GPU kernel at 64-row blocks (`decode_mgpu_fp8_wide`) or at other multiples of 16
folded rows (`decode_mgpu_fp8`, row groups of 16), the Triton kernel elsewhere; all read fp8
bytes (K straight into fp8 `wgmma`s in the Mosaic GPU kernels). `validate_decode_inputs` is
the eager check of index values. Why the rule picks what it does: docs/decode_kernel.md;
reproduce with `python -m bench.decode --only "H128 B1 L4096"`.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.attention.kv_quant import kv_scales
from funcmla.attention.pallas import (
    decode_mgpu,
    decode_mgpu_fp8,
    decode_mgpu_fp8_wide,
    decode_triton,
)
from funcmla.attention.pallas.decode_common import (
    MAX_POOL_ROWS,
    PARTIAL_DTYPES,
    DecodeKernelConfig,
    KVRows,
    check_kv_form,
    choose_num_splits,
    fp8_triton_config,
    kv_rows_from_csr,
    kv_rows_from_page_table,
    num_row_blocks,
)
from funcmla.attention.pallas.decode_mgpu import BLOCK_M as MGPU_BLOCK_M
from funcmla.attention.pallas.decode_mgpu import (
    MgpuDecodeConfig,
    mgpu_decode_supported,
    mgpu_split_config,
)
from funcmla.attention.pallas.merge import merge_splits_pallas
from funcmla.attention.pallas.mgpu_kv_copy import pool_rows_unsupported
from funcmla.attention.pallas.mgpu_ops import interpreter_unsupported
from funcmla.layout import PageTable, is_power_of_two

__all__ = ["mla_decode", "mla_decode_rows", "mla_decode_rows_mgpu", "check_decode_args",
           "validate_decode_inputs", "uses_mgpu", "kernel_choice", "decode_num_splits",
           "KV_FP8_DTYPE"]

# The fp8 pool dtype the decode kernels read. float8_e4m3fnuz (AMD's variant) stays on the
# reference: the Triton lowering casts it on no NVIDIA GPU.
KV_FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def check_decode_args(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float,
                      s_q: int, num_splits: int | None, v_head_dim: int) -> int:
    """Checks what both kernels need of their static arguments; returns the batch size.

    q [T, H, D] bf16 or f16 and kv_pool [slots, D] of q's dtype or float8_e4m3fn, T = batch *
    s_q; D = v_head_dim + a rope part; `kv` well formed for `batch` sequences; slots fit int32
    ids. Raises TypeError (dtypes) or ValueError naming the argument and the value or limit.
    """
    kv.check()
    if q.ndim != 3:
        raise ValueError(f"q must have shape [T, H, D], got {q.shape}")
    if kv_pool.ndim != 2:
        raise ValueError(f"kv_pool must have shape [slots, D], got {kv_pool.shape}")
    t, h, d = q.shape
    slots, d_pool = kv_pool.shape
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"q ({q.dtype}) must be bfloat16 or float16")
    if kv_pool.dtype != q.dtype and kv_pool.dtype != KV_FP8_DTYPE:
        raise TypeError(f"kv_pool ({kv_pool.dtype}) is not taken by the decode kernels: the "
                        f"dtype of q ({q.dtype}) or {KV_FP8_DTYPE.name} (with k_scale / v_scale)")
    if d_pool != d:
        raise ValueError(f"kv_pool row width {d_pool} != q head dim {d} (q {q.shape})")
    if h < 1:
        raise ValueError(f"q must have at least one head, got q.shape={q.shape}")
    if not isinstance(v_head_dim, int) or not 0 < v_head_dim < d:
        raise ValueError(f"v_head_dim={v_head_dim!r} must be an int in [1, head dim {d})")
    if not (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
            and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive finite float")
    if slots > MAX_POOL_ROWS:
        raise ValueError(f"kv_pool has {slots} rows; slot ids are int32 (at most {MAX_POOL_ROWS})")
    if slots < kv.page_size:
        raise ValueError(f"kv_pool has {slots} rows, fewer than page_size={kv.page_size}")
    if not isinstance(s_q, int) or isinstance(s_q, bool) or s_q <= 0 or t % s_q:
        raise ValueError(f"s_q={s_q!r} must be a positive int dividing q.shape[0]={t}")
    b = t // s_q
    if kv.num_seqs != b:
        raise ValueError(f"q holds {b} sequences (T={t}, s_q={s_q}) but the KV metadata "
                         f"(kv_indptr / page_table) has {kv.num_seqs}")
    if kv.form == "strided" and kv.table.shape[0] != b * kv.entries_per_seq:
        raise ValueError(f"KVRows.table has {kv.table.shape[0]} entries; {b} sequences of "
                         f"entries_per_seq={kv.entries_per_seq} need {b * kv.entries_per_seq}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits <= 0):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    return b


def _check_triton_dims(d: int, v_head_dim: int) -> None:
    d_rope = d - v_head_dim
    if not (is_power_of_two(v_head_dim) and is_power_of_two(d_rope) and d_rope >= 16):
        raise ValueError(
            f"head dim {d} must be v_head_dim ({v_head_dim}) + a rope part, both powers of two "
            ">= 16 (the Triton lowering tiles them separately)")


def decode_num_splits(config: DecodeKernelConfig, num_seqs: int, rows: int, max_kv_len: int,
                      *, mgpu: bool, kv_fp8: bool = False) -> int:
    """The split rule's KV split count for `num_seqs` sequences of `rows` folded query rows
    (s_q * H) and up to `max_kv_len` tokens, for the kernel `mla_decode` runs: 64-row blocks
    (the 16-row fp8 kernel's blocks of 16 rows for an fp8 pool, `kv_fp8`; one block an SM
    either way) and `mgpu_split_config` for the Mosaic GPU kernels, `config`'s block rows for
    Triton."""
    if mgpu:
        block_rows = (decode_mgpu_fp8.BLOCK_ROWS
                      if kv_fp8 and fp8_mgpu_kernel(rows, config) is decode_mgpu_fp8
                      else MGPU_BLOCK_M)
        return choose_num_splits(num_seqs, max(1, rows // block_rows), max_kv_len,
                                 mgpu_split_config(config), MGPU_BLOCK_M)
    block_m = config.resolved_block_m(rows)
    return choose_num_splits(num_seqs, num_row_blocks(rows, block_m), max_kv_len, config,
                             block_m)


def _fp8_mgpu_wide(rows: int) -> bool:
    """Whether an fp8 pool at `rows` folded query rows goes to `decode_mgpu_fp8_wide` (64-row
    blocks, `decode_mgpu`'s products) rather than `decode_mgpu_fp8` (16-row blocks,
    transposed; other multiples of 16 as row groups). At 128 heads the 16-row kernel's 8 row
    groups took 1.50-1.68x the 64-row kernel's time; at 32 heads its 2 groups took 0.46-0.53x
    Triton's, which ran them before (`bench.kernel_ab`; docs/decode_kernel.md, decision
    log)."""
    return rows % MGPU_BLOCK_M == 0


def fp8_mgpu_kernel(rows: int, config: DecodeKernelConfig):
    """The fp8 Mosaic GPU kernel module for `rows` folded query rows: `decode_mgpu_fp8_wide`
    for fp8 products or at a multiple of 64, else `decode_mgpu_fp8`."""
    if config.fp8_products == "fp8" or _fp8_mgpu_wide(rows):
        return decode_mgpu_fp8_wide
    return decode_mgpu_fp8


def fp8_mgpu_supported(rows: int, page_size: int, head_dim: int, v_head_dim: int, q_dtype,
                       kv_dtype) -> str | None:
    """None when one of the fp8 Mosaic GPU kernels takes the shape, else the reason."""
    if _fp8_mgpu_wide(rows):
        return decode_mgpu_fp8_wide.fp8_wide_supported(rows, page_size, head_dim, v_head_dim,
                                                       q_dtype, kv_dtype)
    return decode_mgpu_fp8.fp8_narrow_supported(rows, page_size, head_dim, v_head_dim,
                                                q_dtype, kv_dtype)


def kernel_choice(config: DecodeKernelConfig, q, page_size: int, s_q: int, *,
                  v_head_dim: int = 512, interpret: bool = False,
                  kv_dtype=None, pool_rows: int | None = None) -> tuple[str, str]:
    """("mgpu" or "triton", why) for q ([T, H, D], an array or a ShapeDtypeStruct) over a pool
    of `kv_dtype` (default q's) and `pool_rows` rows (when known) at this page size
    (`DecodeKernelConfig.kernel`); raises for kernel="mgpu" on a shape, dtype or pool it does
    not take (`mgpu_kv_copy.pool_rows_unsupported`).

    "mgpu" is one of three Mosaic GPU kernels: `decode_mgpu` for a bf16 pool, and for an fp8
    pool `decode_mgpu_fp8_wide` at a multiple of 64 folded rows or `decode_mgpu_fp8` at
    another multiple of 16 (row groups of 16).
    "auto" keeps batches of fewer than `config.mgpu_min_blocks` blocks of 64 rows on Triton
    (bf16 and fp8 alike): there a Mosaic GPU block's fixed cost outweighs its matrix rate
    (`python -m bench.decode_dispatch`); at 128 heads the fp8 one takes 0.34-0.42x of the
    Triton kernel's time (`python -m bench.decode --kv-dtype fp8 --fp8-variants`). "auto" runs
    an fp8 pool on `decode_mgpu_fp8` from `config.fp8_mgpu_min_seqs`
    sequences (0.48-0.75x of the Triton kernel's time at batch 32 and 128), other fp8 shapes
    and smaller batches on Triton. `config.fp8_products="fp8"` with an fp8 pool runs
    `decode_mgpu_fp8_wide` wherever it applies (interpret mode included) and raises elsewhere:
    no other kernel has those products.
    """
    rows = s_q * q.shape[1]
    dtype = q.dtype if kv_dtype is None else kv_dtype
    fp8 = jnp.dtype(dtype) != jnp.dtype(q.dtype)
    if fp8 and config.fp8_products == "fp8":
        return _fp8_products_choice(config, rows, page_size, q, v_head_dim, dtype, interpret,
                                    pool_rows)
    if config.kernel == "triton":
        return "triton", "DecodeKernelConfig.kernel='triton'"
    if fp8:
        why = fp8_mgpu_supported(rows, page_size, q.shape[2], v_head_dim, q.dtype, dtype)
        if why is not None:
            why = f"kv_pool dtype {jnp.dtype(dtype).name}: no fp8 Mosaic GPU kernel takes it: {why}"
    else:
        why = mgpu_decode_supported(rows, page_size, q.shape[2], v_head_dim, q.dtype)
    why = why or pool_rows_unsupported(pool_rows, page_size)
    if why is None and interpret:
        why = interpreter_unsupported()
    if config.kernel == "mgpu":
        if why is not None:
            raise ValueError(f"DecodeKernelConfig.kernel='mgpu': {why}")
        return "mgpu", "DecodeKernelConfig.kernel='mgpu'"
    if why is not None:
        return "triton", f"the Mosaic GPU kernel does not apply: {why}"
    if interpret:
        return "triton", "interpret mode: auto takes the Triton kernel"
    backend = jax.default_backend()
    if backend != "gpu":
        return "triton", f"JAX's default backend is {backend}, not a GPU (no GPU backend)"
    seqs = q.shape[0] // s_q
    if fp8 and not _fp8_mgpu_wide(rows):
        if seqs < config.fp8_mgpu_min_seqs:
            return "triton", (f"fp8 pool: {seqs} sequences < fp8_mgpu_min_seqs = "
                              f"{config.fp8_mgpu_min_seqs}")
        return "mgpu", (f"fp8 pool at {rows} folded rows, {seqs} sequences >= "
                        f"fp8_mgpu_min_seqs = {config.fp8_mgpu_min_seqs}: the fp8 Mosaic GPU "
                        "kernel")
    blocks = seqs * (rows // MGPU_BLOCK_M)
    if blocks < config.mgpu_min_blocks:
        return "triton", (f"{blocks} blocks of 64 rows < mgpu_min_blocks = "
                          f"{config.mgpu_min_blocks}")
    return "mgpu", f"{blocks} blocks of 64 rows >= mgpu_min_blocks = {config.mgpu_min_blocks}"


def _fp8_products_choice(config: DecodeKernelConfig, rows: int, page_size: int, q, v_head_dim,
                         kv_dtype, interpret: bool, pool_rows: int | None) -> tuple[str, str]:
    """`kernel_choice` for an fp8 pool with fp8_products="fp8": the 64-row fp8 Mosaic GPU
    kernel, or ValueError naming why it cannot run."""
    why = None
    if config.kernel == "triton":
        why = "kernel='triton' has no fp8 products"
    else:  # fp8_wide_supported names rows that are not a multiple of 64 first
        why = decode_mgpu_fp8_wide.fp8_wide_supported(rows, page_size, q.shape[2], v_head_dim,
                                                      q.dtype, kv_dtype)
        why = why or pool_rows_unsupported(pool_rows, page_size)
        if why is None and interpret:
            why = interpreter_unsupported()
        if why is None and not interpret and jax.default_backend() != "gpu":
            why = f"JAX's default backend is {jax.default_backend()}, not a GPU"
    if why is not None:
        raise ValueError("DecodeKernelConfig.fp8_products='fp8' runs only on the 64-row fp8 "
                         f"Mosaic GPU kernel: {why}")
    return "mgpu", "DecodeKernelConfig.fp8_products='fp8': the 64-row fp8 Mosaic GPU kernel"


def uses_mgpu(config: DecodeKernelConfig, q, page_size: int, s_q: int, *,
              v_head_dim: int = 512, interpret: bool = False, kv_dtype=None,
              pool_rows: int | None = None) -> bool:
    """Whether `mla_decode` runs the Mosaic GPU kernel (`kernel_choice`)."""
    return kernel_choice(config, q, page_size, s_q, v_head_dim=v_head_dim, interpret=interpret,
                         kv_dtype=kv_dtype, pool_rows=pool_rows)[0] == "mgpu"


def _triton_rows(q, kv_pool, kv: KVRows, *, sm_scale, s_q, num_splits, config, v_head_dim,
                 interpret, scales=None):
    b = check_decode_args(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=num_splits,
                          v_head_dim=v_head_dim)
    _check_triton_dims(q.shape[2], v_head_dim)
    if scales is not None:
        config = fp8_triton_config(config, s_q * q.shape[1])
    ns = num_splits or decode_num_splits(config, b, s_q * q.shape[1], kv.max_kv_len, mgpu=False)
    return decode_triton.decode_call(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=ns,
                                     config=config, v_head_dim=v_head_dim, interpret=interpret,
                                     scales=scales)


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "num_splits", "config",
                                              "interpret", "v_head_dim"))
def mla_decode_rows(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float,
                    s_q: int = 1, num_splits: int | None = None,
                    config: DecodeKernelConfig = DecodeKernelConfig(), v_head_dim: int = 512,
                    interpret: bool = False, k_scale=None,
                    v_scale=None) -> tuple[jax.Array, jax.Array]:
    """The Triton-lowered decode kernel alone (one pallas_call, no merge) on a `KVRows`;
    arguments as in `mla_decode` (scale values are not checked under this jit: see
    `kv_quant.check_kv_scale_values`).

    Returns o [B, S, rows_pad, Dv] (q.dtype when S == 1: the output; else per-split partials in
    `config.partial_dtype`) and lse float32 [B, S, rows_pad] (S == 1: +inf for no KV; else
    -inf for an empty split); rows = s_q * H folded token-major, rows_pad = rows rounded up to
    block_m, S = num_splits or the split rule's choice. `merge_splits_pallas(o, lse, q.dtype)`
    turns S > 1 partials into the output.
    """
    return _triton_rows(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=num_splits,
                        config=config, v_head_dim=v_head_dim, interpret=interpret,
                        scales=kv_scales(kv_pool.dtype, k_scale, v_scale))


def mla_decode_rows_mgpu(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float,
                         s_q: int, num_splits: int, v_head_dim: int = 512,
                         partial_dtype="bfloat16",
                         config: MgpuDecodeConfig = MgpuDecodeConfig(),
                         interpret=False) -> tuple[jax.Array, jax.Array]:
    """The Mosaic GPU decode kernel alone (no merge), same contract as `mla_decode_rows` with
    rows_pad = rows (s_q * H must be a multiple of 64: `mgpu_decode_supported`).

    partial_dtype: float32 or bfloat16, the storage of S > 1 partials. `interpret`: False
    (compiled), True (Mosaic GPU interpret mode) or Pallas's GPU interpreter parameters
    (`InterpretGPUParams`, e.g. with `detect_races=True`). Not jitted here: call it inside jit.
    """
    check_decode_args(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=num_splits,
                      v_head_dim=v_head_dim)
    if num_splits is None:
        raise ValueError("num_splits must be a positive int, got None")
    why = mgpu_decode_supported(s_q * q.shape[1], kv.page_size, q.shape[2], v_head_dim,
                                kv_pool.dtype)
    why = why or pool_rows_unsupported(kv_pool.shape[0], kv.page_size)
    if why is not None:
        raise ValueError(f"mla_decode_rows_mgpu: {why}")
    if not isinstance(config, MgpuDecodeConfig):
        raise TypeError(f"config must be a MgpuDecodeConfig, got {type(config).__name__}")
    if jnp.dtype(partial_dtype).name not in PARTIAL_DTYPES:
        raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype!r}")
    return decode_mgpu.decode_call(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q,
                                   num_splits=num_splits, v_head_dim=v_head_dim,
                                   partial_dtype=partial_dtype, config=config,
                                   interpret=interpret)


def _merged(o: jax.Array, lse: jax.Array, out_dtype, config: DecodeKernelConfig,
            interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Per-split results [B, S, R, Dv] / [B, S, R] -> [B, R, Dv] / [B, R]: the kernel's own
    output when S == 1, else the merge kernel's."""
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    return merge_splits_pallas(o, lse, out_dtype, block_d=config.merge_block_d,
                               interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "num_splits", "config",
                                              "interpret", "v_head_dim", "kv_dtype"))
def _mla_decode_kv(q, kv_pool, kv: KVRows, scales, *, sm_scale, s_q, num_splits, config,
                   v_head_dim, interpret, kv_dtype=None):
    """Decode kernel + (num_splits > 1) merge, unpadded to [T, H, Dv] and [T, H]. kv_dtype:
    the fp8 dtype a uint8 pool's bytes hold (bitcast here, inside the jit: no copy)."""
    if kv_dtype is not None:
        kv_pool = jax.lax.bitcast_convert_type(kv_pool, kv_dtype)
    check_decode_args(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=num_splits,
                      v_head_dim=v_head_dim)
    t, h, _ = q.shape
    rows = s_q * h
    mgpu = uses_mgpu(config, q, kv.page_size, s_q, v_head_dim=v_head_dim, interpret=interpret,
                     kv_dtype=kv_pool.dtype, pool_rows=kv_pool.shape[0])
    if mgpu and scales is not None:
        kernel = fp8_mgpu_kernel(rows, config)
        ns = num_splits or decode_num_splits(config, t // s_q, rows, kv.max_kv_len, mgpu=True,
                                             kv_fp8=True)
        products = {} if kernel is decode_mgpu_fp8 else {"products": config.fp8_products}
        o, lse = kernel.decode_call(
            q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q, num_splits=ns, k_scale=scales[0],
            v_scale=scales[1], v_head_dim=v_head_dim, partial_dtype=config.partial_dtype,
            interpret=interpret, **products)
    elif mgpu:
        ns = num_splits or decode_num_splits(config, t // s_q, rows, kv.max_kv_len, mgpu=True)
        o, lse = mla_decode_rows_mgpu(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q,
                                      num_splits=ns, v_head_dim=v_head_dim,
                                      partial_dtype=config.partial_dtype, interpret=interpret)
    else:
        o, lse = _triton_rows(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q,
                              num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                              interpret=interpret, scales=scales)
    out, lse_out = _merged(o, lse, q.dtype, config, interpret)
    if out.shape[1] != rows:
        out, lse_out = out[:, :rows], lse_out[:, :rows]
    return out.reshape(t, h, v_head_dim), lse_out.reshape(t, h)


def pool_scales(kv_pool: jax.Array, kv_dtype, k_scale, v_scale):
    """(k_scale, v_scale) float32 [1] arrays of an fp8 pool (`kv_dtype` names the format of a
    uint8 pool's bytes), None for a bf16 pool; raises naming the argument."""
    pool_dtype = kv_pool.dtype
    if kv_dtype is not None:
        if jnp.dtype(kv_dtype) != KV_FP8_DTYPE:
            raise TypeError(f"kv_dtype={kv_dtype!r}: the decode kernels read "
                            f"{KV_FP8_DTYPE.name} bytes from a uint8 kv_pool")
        if kv_pool.dtype != jnp.uint8:
            raise TypeError(f"kv_dtype={kv_dtype!r} reinterprets a uint8 kv_pool; kv_pool is "
                            f"{kv_pool.dtype}")
        pool_dtype = KV_FP8_DTYPE
    return kv_scales(pool_dtype, k_scale, v_scale)


def mla_decode(q: jax.Array, kv_pool: jax.Array, *, kv_indptr: jax.Array | None = None,
               kv_indices: jax.Array | None = None, page_table: PageTable | None = None,
               sm_scale: float, s_q: int = 1, num_splits: int | None = None,
               config: DecodeKernelConfig = DecodeKernelConfig(), max_kv_len: int | None = None,
               v_head_dim: int = 512, interpret: bool = False, k_scale=None,
               v_scale=None, kv_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over the paged latent pool.

    q:          [T, H, 576] bf16 (or f16 on the Triton kernel), T = batch * s_q, token-major
                (the s_q tokens of a sequence are consecutive).
    kv_pool:    [slots, 576], q's dtype or float8_e4m3fn; V is the first `v_head_dim` (512)
                columns of a row.
    k_scale, v_scale: an fp8 pool's per-layer scales (a float or a float32 array of shape
                () or [1]; v_scale defaults to k_scale, k_scale to 1): scores use k_scale * x,
                the output v_scale * x (`funcmla.attention.kv_quant`). An error for other
                pools. An fp8 pool runs an fp8 Mosaic GPU kernel where one takes the
                shape, else the Triton kernel (`kernel_choice`).
    kv_dtype:   None, or "float8_e4m3fn" for a uint8 kv_pool holding fp8 bytes (the zero-copy
                form `funcmla.interop.dlpack.to_jax(t, fp8="bits")` gives): bitcast inside
                the jit, so the pool is never copied.
    KV metadata, exactly one of:
      kv_indptr [B+1] int32 (tokens) + kv_indices [capacity] int32 (token slots); page size 1.
      page_table: funcmla.layout.PageTable (page ids [B, max_pages], lengths [B] in tokens,
                  static page_size); token t of sequence b is row
                  table[b, t // page_size] * page_size + t % page_size.
    sm_scale:   softmax scale (static positive float; `funcmla.config.MLADims.sm_scale`).
    s_q:        query tokens per sequence (speculative decoding), bottom-right causal.
    num_splits: split-KV count; None: the split rule (`decode_num_splits`).
    max_kv_len: static upper bound on KV tokens per sequence for the split rule (token CSR
                only; defaults to the capacity of kv_indices).
    config:     `DecodeKernelConfig`: which kernel (`uses_mgpu`) and its tiling.
    interpret:  run in Pallas interpret mode (CPU).

    Returns out [T, H, v_head_dim] (q.dtype) and lse [T, H] float32 (natural log); a sequence
    with no KV gives out 0 and lse +inf. Pool rows no sequence uses never reach the output,
    whatever they hold. Index values are not checked here (`validate_decode_inputs` does it
    eagerly); positions past a sequence's length are never read.
    """
    check_kv_form(page_table, kv_indptr, kv_indices, max_kv_len)
    if page_table is not None:
        kv = kv_rows_from_page_table(page_table)
    else:
        kv = kv_rows_from_csr(kv_indptr, kv_indices, max_kv_len)
    if not isinstance(config, DecodeKernelConfig):
        raise TypeError(f"config must be a DecodeKernelConfig, got {type(config).__name__}")
    if not (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)):
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive finite float")
    scales = pool_scales(kv_pool, kv_dtype, k_scale, v_scale)
    return _mla_decode_kv(q, kv_pool, kv, scales, sm_scale=float(sm_scale), s_q=s_q,
                          num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                          interpret=interpret,
                          kv_dtype=None if kv_dtype is None else KV_FP8_DTYPE.name)


def validate_decode_inputs(kv_pool_rows: int, *, kv_indptr=None, kv_indices=None,
                           page_table: PageTable | None = None) -> None:
    """Eager (non-jittable) value check of decode metadata; raises ValueError naming the field.

    Token CSR: kv_indptr starts at 0, is non-decreasing and ends within kv_indices; every live
    kv_indices entry is in [0, kv_pool_rows). Page table: lengths fit the table width and every
    live page id p has (p + 1) * page_size <= kv_pool_rows.
    """
    if page_table is not None:
        table = np.asarray(page_table.table)
        lengths = np.asarray(page_table.lengths)
        page_size = page_table.page_size
        if (lengths < 0).any():
            raise ValueError(f"page_table.lengths has negative values: {lengths[lengths < 0][:4]}")
        need = -(-lengths // page_size)
        if (need > table.shape[1]).any():
            bad = int(np.argmax(need > table.shape[1]))
            raise ValueError(f"page_table.lengths[{bad}]={lengths[bad]} needs {need[bad]} pages; "
                             f"the table has {table.shape[1]}")
        for i, n in enumerate(need):
            live = table[i, :n]
            if live.size and (live.min() < 0 or (live.max() + 1) * page_size > kv_pool_rows):
                raise ValueError(f"page_table.table[{i}] has page ids outside "
                                 f"[0, {kv_pool_rows // page_size}): {live.min()}..{live.max()}")
        return
    indptr = np.asarray(kv_indptr)
    indices = np.asarray(kv_indices)
    if indptr[0] != 0 or (np.diff(indptr) < 0).any() or indptr[-1] > indices.shape[0]:
        raise ValueError(f"kv_indptr must start at 0, not decrease and end <= "
                         f"{indices.shape[0]}; got {indptr[:4]}..{indptr[-1]}")
    live = indices[: indptr[-1]]
    if live.size and (live.min() < 0 or live.max() >= kv_pool_rows):
        raise ValueError(f"kv_indices has slots outside [0, {kv_pool_rows}): "
                         f"{live.min()}..{live.max()}")
