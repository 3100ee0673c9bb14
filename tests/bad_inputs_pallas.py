"""Bad inputs of the Pallas decode entry points (funcmla.attention.pallas): wrong shapes, dtypes,
page sizes, heads, s_q, split counts, mismatched metadata, bad configurations, bad merge
partials and bad index values. Every check runs before a kernel is built (at trace time), so
each case is fast. Each names the field and the value or the limit (tests/test_bad_inputs.py
runs them)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas import (
    DecodeKernelConfig,
    KVRows,
    MgpuDecodeConfig,
    merge_splits_pallas,
    mla_decode,
    mla_extend,
    mla_decode_rows,
    mla_decode_rows_mgpu,
    validate_decode_inputs,
)
from funcmla.config import MLADims
from funcmla.layout import PageTable, is_power_of_two
from tests.bad_input import BadInput

SCALE = MLADims().sm_scale
B, H, D = 2, 16, 576


def _q(batch=B, heads=H, d=D, dtype=jnp.bfloat16, s_q=1):
    return jnp.zeros((batch * s_q, heads, d), dtype)


def _pool(rows=64, d=D, dtype=jnp.bfloat16):
    return jnp.zeros((rows, d), dtype)


def _indptr(batch=B, dtype=jnp.int32):
    return (jnp.arange(batch + 1) * 4).astype(dtype)


def _indices(n=16, dtype=jnp.int32):
    return jnp.ones((n,), dtype)


def _csr(q=None, pool=None, indptr=None, indices=None, **kw):
    """mla_decode on a token CSR, each argument replaceable."""
    return lambda: mla_decode(_q() if q is None else q, _pool() if pool is None else pool,
                              kv_indptr=_indptr() if indptr is None else indptr,
                              kv_indices=_indices() if indices is None else indices,
                              **{"sm_scale": SCALE, "interpret": True, **kw})


def _pages(table, lengths, page_size, q=None, pool=None, **kw):
    return lambda: mla_decode(_q() if q is None else q, _pool() if pool is None else pool,
                              page_table=PageTable(table, lengths, page_size),
                              **{"sm_scale": SCALE, "interpret": True, **kw})


def _mgpu(page_size=64, heads=64, dtype=jnp.bfloat16, pool_rows=256, **kw):
    """mla_decode_rows_mgpu on a page table of `page_size` over `pool_rows` rows."""
    def call():
        if is_power_of_two(page_size):
            kv = KVRows(jnp.ones((B * 2,), jnp.int32), None, jnp.full((B,), 4, jnp.int32),
                        page_size, 2 * page_size, entries_per_seq=2)
        else:  # the "lens" form takes any page size; PageTable would refuse it first
            kv = KVRows(jnp.ones((B * 2,), jnp.int32), jnp.array([0, 2], jnp.int32),
                        jnp.full((B,), 4, jnp.int32), page_size, 2 * page_size)
        args = {"sm_scale": SCALE, "s_q": 1, "num_splits": 1, "interpret": True, **kw}
        return mla_decode_rows_mgpu(_q(heads=heads, dtype=dtype), _pool(pool_rows, dtype=dtype), kv,
                                    **args)
    return call


def _with_xla_cpu_threads(n: int, call):
    """`call` where XLA:CPU's worker count reads as `n` (PJRT_NPROC), restored after."""
    def run():
        before = os.environ.get("PJRT_NPROC")
        os.environ["PJRT_NPROC"] = str(n)
        try:
            return call()
        finally:
            if before is None:
                del os.environ["PJRT_NPROC"]
            else:
                os.environ["PJRT_NPROC"] = before
    return run


def _merge(o_shape, lse_shape, o_dtype=jnp.float32, lse_dtype=jnp.float32, **kw):
    return lambda: merge_splits_pallas(jnp.zeros(o_shape, o_dtype), jnp.zeros(lse_shape, lse_dtype),
                                       jnp.bfloat16, interpret=True, **kw)


def _extend(qo=(0, 3, 5), kv=(0, 4, 9), indices=16, q_rows=5, pool_rows=64, **kw):
    """mla_extend on a token CSR of 2 requests (3 + 2 queries over 4 + 5 keys)."""
    return lambda: mla_extend(_q(batch=q_rows), _pool(pool_rows),
                              qo_indptr=qo if hasattr(qo, "dtype") else jnp.array(qo, jnp.int32),
                              kv_indptr=jnp.array(kv, jnp.int32),
                              kv_indices=_indices(indices) if isinstance(indices, int)
                              else jnp.array(indices, jnp.int32),
                              **{"sm_scale": SCALE, "interpret": True, **kw})


def _extend_pages(table, lengths, qo=(0, 3, 5), page_size=16, **kw):
    return lambda: mla_extend(_q(batch=5), _pool(64), qo_indptr=jnp.array(qo, jnp.int32),
                              page_table=PageTable(jnp.array(table, jnp.int32),
                                                   jnp.array(lengths, jnp.int32), page_size),
                              **{"sm_scale": SCALE, "interpret": True, **kw})


_TABLE = jnp.array([[1, 2], [3, 0]], jnp.int32)
_PT = PageTable(_TABLE, jnp.array([20, 16], jnp.int32), 16)

CASES: list[BadInput] = [
    # ------------------------------------------------------------------ mla_decode: q / kv_pool
    BadInput("pallas.decode.q_float32",
             _csr(q=_q(dtype=jnp.float32), pool=_pool(dtype=jnp.float32)),
             TypeError, (r"q \(float32\)", "bfloat16 or float16")),
    BadInput("pallas.decode.pool_dtype_differs", _csr(pool=_pool(dtype=jnp.float16)),
             TypeError, (r"kv_pool \(float16\)", r"q \(bfloat16\)")),
    BadInput("pallas.decode.pool_row_width", _csr(pool=_pool(d=512)),
             ValueError, ("kv_pool row width 512", "q head dim 576")),
    BadInput("pallas.decode.q_rank", _csr(q=jnp.zeros((B, D), jnp.bfloat16)),
             ValueError, (r"q must have shape \[T, H, D\]", r"\(2, 576\)")),
    BadInput("pallas.decode.pool_rank", _csr(pool=jnp.zeros((4, 16, D), jnp.bfloat16)),
             ValueError, (r"kv_pool must have shape \[slots, D\]", r"\(4, 16, 576\)")),
    BadInput("pallas.decode.zero_heads", _csr(q=_q(heads=0)),
             ValueError, ("at least one head", r"\(2, 0, 576\)")),
    BadInput("pallas.decode.v_head_dim_too_wide", _csr(v_head_dim=576),
             ValueError, ("v_head_dim=576", r"head dim 576\)")),
    BadInput("pallas.decode.triton_rope_not_pow2", _csr(v_head_dim=448, config=DecodeKernelConfig(
        kernel="triton")), ValueError, (r"v_head_dim \(448\)", "head dim 576", "powers of two")),
    BadInput("pallas.decode.pool_below_page_size",
             _pages(_TABLE, jnp.array([5, 5], jnp.int32), 64, pool=_pool(16)),
             ValueError, ("kv_pool has 16 rows", "page_size=64")),
    # ------------------------------------------------------------------ s_q, batch, splits, scale
    BadInput("pallas.decode.s_q_not_dividing", _csr(s_q=3),
             ValueError, ("s_q=3", r"q.shape\[0\]=2")),
    BadInput("pallas.decode.s_q_zero", _csr(s_q=0), ValueError, ("s_q=0", "positive int")),
    BadInput("pallas.decode.s_q_float", _csr(s_q=1.0), ValueError, (r"s_q=1\.0", "positive int")),
    BadInput("pallas.decode.batch_differs_from_indptr", _csr(q=_q(batch=3)),
             ValueError, ("q holds 3 sequences", "kv_indptr", "has 2")),
    BadInput("pallas.decode.batch_differs_from_page_table", _pages(_TABLE, jnp.array([5, 5],
             jnp.int32), 16, q=_q(batch=1)), ValueError, ("q holds 1 sequences", "has 2")),
    BadInput("pallas.decode.num_splits_zero", _csr(num_splits=0),
             ValueError, ("num_splits", "got 0")),
    BadInput("pallas.decode.sm_scale_negative", _csr(sm_scale=-0.5),
             ValueError, (r"sm_scale=-0\.5", "positive finite")),
    BadInput("pallas.decode.sm_scale_nan", _csr(sm_scale=float("nan")),
             ValueError, ("sm_scale=nan", "positive finite")),
    BadInput("pallas.decode.sm_scale_array", _csr(sm_scale=jnp.float32(0.1)),
             ValueError, ("sm_scale=", "positive finite float")),
    # ------------------------------------------------------------------ metadata
    BadInput("pallas.decode.indptr_uint32", _csr(indptr=_indptr(dtype=jnp.uint32)),
             TypeError, ("kv_indptr must be int32", "uint32")),
    BadInput("pallas.decode.indices_float", _csr(indices=_indices(dtype=jnp.float32)),
             TypeError, ("kv_indices must be int32", "float32")),
    BadInput("pallas.decode.indptr_2d", _csr(indptr=jnp.zeros((2, 2), jnp.int32)),
             ValueError, (r"kv_indptr must have shape \[num_seqs \+ 1\]", r"\(2, 2\)")),
    BadInput("pallas.decode.indptr_too_short", _csr(indptr=jnp.zeros((1,), jnp.int32)),
             ValueError, (r"kv_indptr must have shape \[num_seqs \+ 1\]", r"\(1,\)")),
    BadInput("pallas.decode.indices_empty", _csr(indices=jnp.zeros((0,), jnp.int32)),
             ValueError, ("kv_indices must have shape", r"\(0,\)")),
    BadInput("pallas.decode.max_kv_len_zero", _csr(max_kv_len=0),
             ValueError, ("max_kv_len must be a positive int", "got 0")),
    BadInput("pallas.decode.both_metadata", lambda: mla_decode(
        _q(), _pool(), kv_indptr=_indptr(), kv_indices=_indices(), page_table=_PT,
        sm_scale=SCALE, interpret=True), ValueError, ("page_table", "kv_indptr", "not both")),
    BadInput("pallas.decode.no_metadata", lambda: mla_decode(_q(), _pool(), sm_scale=SCALE),
             ValueError, ("kv_indptr and kv_indices", "page_table")),
    BadInput("pallas.decode.indices_without_indptr", lambda: mla_decode(
        _q(), _pool(), kv_indices=_indices(), sm_scale=SCALE), ValueError, ("kv_indptr",)),
    BadInput("pallas.decode.max_kv_len_with_page_table",
             _pages(_TABLE, jnp.array([5, 5], jnp.int32), 16, max_kv_len=64),
             ValueError, ("max_kv_len=64", "page_table")),
    BadInput("pallas.decode.page_table_not_a_page_table", lambda: mla_decode(
        _q(), _pool(), page_table=(_TABLE, jnp.array([5, 5]), 16), sm_scale=SCALE),
             TypeError, ("page_table must be a funcmla.layout.PageTable", "tuple")),
    BadInput("pallas.decode.page_table_float", _pages(_TABLE.astype(jnp.float32),
             jnp.array([5, 5], jnp.int32), 16), TypeError, ("page_table.table must be int32",
                                                           "float32")),
    BadInput("pallas.decode.page_table_lengths_shape", _pages(_TABLE, jnp.array([5, 5, 5],
             jnp.int32), 16), ValueError, ("page_table.lengths has shape", r"\(3,\)", "2 rows")),
    BadInput("pallas.decode.page_table_1d", _pages(jnp.zeros((4,), jnp.int32),
             jnp.array([5, 5], jnp.int32), 16), ValueError, ("page_table.table must have shape",
                                                            r"\(4,\)")),
    BadInput("pallas.decode.config_not_a_config", _csr(config={"kernel": "triton"}),
             TypeError, ("config must be a DecodeKernelConfig", "dict")),
    # ------------------------------------------------------------------ kernel="mgpu" shapes
    BadInput("pallas.decode.mgpu_heads", _csr(config=DecodeKernelConfig(kernel="mgpu")),
             ValueError, ("kernel='mgpu'", "s_q\\*H = 16", "multiple of 64")),
    BadInput("pallas.decode.mgpu_pool_rows",
             _pages(jnp.ones((B, 2), jnp.int32), jnp.full((B,), 100, jnp.int32), 64,
                    q=_q(heads=64), pool=_pool(260), config=DecodeKernelConfig(kernel="mgpu")),
             ValueError, ("kernel='mgpu'", "kv_pool has 260 rows", "not a multiple of 8")),
    BadInput("pallas.mgpu.pool_rows", _mgpu(pool_rows=260),
             ValueError, ("mla_decode_rows_mgpu", "kv_pool has 260 rows", "multiple of 8")),
    BadInput("pallas.mgpu.heads_not_64_rows", _mgpu(heads=48),
             ValueError, ("s_q\\*H = 48", "multiple of 64")),
    BadInput("pallas.mgpu.page_size_24", _mgpu(page_size=24),
             ValueError, ("page size 24", "64-token tile")),
    BadInput("pallas.mgpu.page_size_96", _mgpu(page_size=96),
             ValueError, ("page size 96", "multiple of the 64-token tile")),
    BadInput("pallas.mgpu.float16", _mgpu(dtype=jnp.float16),
             ValueError, ("dtype float16", "bfloat16")),
    BadInput("pallas.mgpu.v_head_dim", _mgpu(v_head_dim=256),
             ValueError, ("v_head_dim 256", "512")),
    BadInput("pallas.mgpu.partial_dtype", _mgpu(num_splits=2, partial_dtype=jnp.float16),
             ValueError, ("partial_dtype", "float16")),
    BadInput("pallas.mgpu.num_splits_none", _mgpu(num_splits=None),
             ValueError, ("num_splits", "None")),
    BadInput("pallas.mgpu.config_type", _mgpu(config=DecodeKernelConfig()),
             TypeError, ("config must be a MgpuDecodeConfig", "DecodeKernelConfig")),
    BadInput("pallas.mgpu.interpreter_threads", _with_xla_cpu_threads(2, _mgpu()), RuntimeError,
             ("interpret mode", "has 2", "PJRT_NPROC=3")),
    # ------------------------------------------------------------------ KVRows
    BadInput("pallas.rows.strided_table_size", lambda: mla_decode_rows(
        _q(), _pool(), KVRows(jnp.zeros((6,), jnp.int32), None, jnp.zeros((B,), jnp.int32), 16,
                              64, entries_per_seq=4), sm_scale=SCALE, interpret=True),
             ValueError, ("KVRows.table has 6 entries", "entries_per_seq=4 need 8")),
    BadInput("pallas.rows.entries_per_seq_missing", lambda: mla_decode_rows(
        _q(), _pool(), KVRows(jnp.zeros((8,), jnp.int32), None, jnp.zeros((B,), jnp.int32), 16,
                              64), sm_scale=SCALE, interpret=True),
             ValueError, ("KVRows.entries_per_seq", "got None")),
    BadInput("pallas.rows.page_size_zero", lambda: mla_decode_rows(
        _q(), _pool(), KVRows(jnp.zeros((8,), jnp.int32), jnp.zeros((B,), jnp.int32),
                              jnp.zeros((B,), jnp.int32), 0, 64), sm_scale=SCALE, interpret=True),
             ValueError, ("KVRows.page_size must be a positive int", "got 0")),
    BadInput("pallas.rows.lens_shapes_differ", lambda: mla_decode_rows(
        _q(), _pool(), KVRows(jnp.zeros((8,), jnp.int32), jnp.zeros((3,), jnp.int32),
                              jnp.zeros((B,), jnp.int32), 1, 64), sm_scale=SCALE, interpret=True),
             ValueError, (r"KVRows.table_start \(3,\)", r"kv_lens \(2,\)")),
    # ------------------------------------------------------------------ configurations
    BadInput("pallas.config.block_m", lambda: DecodeKernelConfig(block_m=24),
             ValueError, ("DecodeKernelConfig.block_m", "power of two >= 16", "got 24")),
    BadInput("pallas.config.block_kv", lambda: DecodeKernelConfig(block_kv=8),
             ValueError, ("DecodeKernelConfig.block_kv", "got 8")),
    BadInput("pallas.config.num_warps", lambda: DecodeKernelConfig(num_warps=3),
             ValueError, ("DecodeKernelConfig.num_warps", "got 3")),
    BadInput("pallas.config.num_stages", lambda: DecodeKernelConfig(num_stages=0),
             ValueError, ("DecodeKernelConfig.num_stages", "got 0")),
    BadInput("pallas.config.max_splits", lambda: DecodeKernelConfig(max_splits=0),
             ValueError, ("DecodeKernelConfig.max_splits must be a positive int", "got 0")),
    BadInput("pallas.config.merge_overhead", lambda: DecodeKernelConfig(merge_overhead_blocks=-1),
             ValueError, ("DecodeKernelConfig.merge_overhead_blocks", "got -1")),
    BadInput("pallas.config.merge_block_d", lambda: DecodeKernelConfig(merge_block_d=48),
             ValueError, ("DecodeKernelConfig.merge_block_d", "got 48")),
    BadInput("pallas.config.kernel", lambda: DecodeKernelConfig(kernel="cuda"),
             ValueError, ("DecodeKernelConfig.kernel", "'cuda'")),
    BadInput("pallas.config.partial_dtype", lambda: DecodeKernelConfig(partial_dtype="float16"),
             ValueError, ("DecodeKernelConfig.partial_dtype", "'float16'")),
    BadInput("pallas.mgpu_config.profile_space", lambda: MgpuDecodeConfig(profile_space=161,
                                                                          profile_dir="/tmp"),
             ValueError, ("profile_space=161", r"\[0, 160\]")),
    BadInput("pallas.mgpu_config.profile_dir", lambda: MgpuDecodeConfig(profile_space=8),
             ValueError, ("profile_space > 0", "profile_dir")),
    BadInput("pallas.mgpu_config.registers", lambda: MgpuDecodeConfig(registers=(40, 240, 232)),
             ValueError, (r"registers=\(40, 240, 232\) sums to 512", "over 504")),
    BadInput("pallas.mgpu_config.registers_step",
             lambda: MgpuDecodeConfig(registers=(40, 236, 228)), ValueError,
             ("consumer 0 budget must be a multiple of 8", r"got 236")),
    BadInput("pallas.mgpu_config.registers_form", lambda: MgpuDecodeConfig(registers=232),
             ValueError, ("registers must be a tuple of three ints", "got 232")),
    # ------------------------------------------------------------------ merge_splits_pallas
    BadInput("pallas.merge.rows_not_16", _merge((1, 2, 8, 32), (1, 2, 8)),
             ValueError, (r"merge rows 8 \(o_part.shape\[2\]\)", "multiple of 16")),
    BadInput("pallas.merge.lse_shape", _merge((1, 2, 16, 32), (1, 3, 16)),
             ValueError, (r"lse_part has shape \(1, 3, 16\)", r"needs \(1, 2, 16\)")),
    BadInput("pallas.merge.o_float16", _merge((1, 2, 16, 32), (1, 2, 16), o_dtype=jnp.float16),
             TypeError, (r"o_part \(float16\)", "float32 or bfloat16")),
    BadInput("pallas.merge.lse_bfloat16", _merge((1, 2, 16, 32), (1, 2, 16),
                                                 lse_dtype=jnp.bfloat16),
             TypeError, (r"lse_part \(bfloat16\)", "float32")),
    BadInput("pallas.merge.dv_not_pow2", _merge((1, 2, 16, 48), (1, 2, 16)),
             ValueError, (r"o_part.shape\[3\]=48", "power of two")),
    BadInput("pallas.merge.block_d", _merge((1, 2, 16, 32), (1, 2, 16), block_d=48),
             ValueError, ("block_d=48", "dividing 32")),
    BadInput("pallas.merge.o_rank", _merge((2, 16, 32), (1, 2, 16)),
             ValueError, (r"o_part must have shape \[B, S, R, Dv\]", r"\(2, 16, 32\)")),
    # ------------------------------------------------------------------ validate_decode_inputs
    BadInput("pallas.validate.slot_outside_pool", lambda: validate_decode_inputs(
        10, kv_indptr=np.array([0, 3, 5]), kv_indices=np.array([1, 2, 3, 4, 10])),
             ValueError, ("kv_indices has slots outside", r"\[0, 10\)", r"1\.\.10")),
    BadInput("pallas.validate.indptr_past_indices", lambda: validate_decode_inputs(
        10, kv_indptr=np.array([0, 3, 9]), kv_indices=np.arange(5)),
             ValueError, ("kv_indptr must", "end <= 5", "9")),
    BadInput("pallas.validate.indptr_decreasing", lambda: validate_decode_inputs(
        10, kv_indptr=np.array([0, 3, 2]), kv_indices=np.arange(5)),
             ValueError, ("kv_indptr must", "not decrease")),
    BadInput("pallas.validate.page_outside_pool", lambda: validate_decode_inputs(48,
             page_table=_PT), ValueError, (r"page_table.table\[1\]", r"\[0, 3\)", r"3\.\.3")),
    BadInput("pallas.validate.length_over_table", lambda: validate_decode_inputs(
        64, page_table=PageTable(_TABLE, jnp.array([40, 16], jnp.int32), 16)),
             ValueError, (r"page_table.lengths\[0\]=40", "needs 3 pages", "has 2")),
    BadInput("pallas.validate.negative_length", lambda: validate_decode_inputs(
        64, page_table=PageTable(_TABLE, jnp.array([-3, 16], jnp.int32), 16)),
             ValueError, ("page_table.lengths has negative values", "-3")),
    # ------------------------------------------------------------------ mla_extend
    BadInput("pallas.extend.kv_shorter_than_q", _extend(kv=(0, 2, 7)),
             ValueError, ("request 0 has 3 queries but only 2 keys", "kv lengths")),
    BadInput("pallas.extend.qo_indptr_past_q", _extend(q_rows=4),
             ValueError, (r"qo_indptr\[-1\] = 5", "q has 4 rows")),
    BadInput("pallas.extend.qo_indptr_decreasing", _extend(qo=(0, 3, 2)),
             ValueError, ("qo_indptr must be non-decreasing", r"qo_indptr\[2\] = 2")),
    BadInput("pallas.extend.kv_indptr_past_capacity", _extend(indices=8),
             ValueError, (r"kv_indptr\[-1\] = 9", "capacity 8")),
    BadInput("pallas.extend.slot_outside_pool", _extend(indices=[1] * 6 + [64] + [1] * 9),
             ValueError, (r"kv_indices\[6\] = 64", "pool's 64 rows")),
    BadInput("pallas.extend.page_outside_pool", _extend_pages([[1, 2], [4, 0]], [20, 9]),
             ValueError, (r"page_table.table\[1, 0\] = 4", "pool's 4 pages")),
    BadInput("pallas.extend.length_over_table", _extend_pages([[1, 2], [3, 0]], [40, 9]),
             ValueError, (r"page_table.lengths\[0\] = 40", r"outside \[0, 32\]")),
    BadInput("pallas.extend.page_table_rows", _extend_pages([[1, 2]], [20]),
             ValueError, (r"page_table.table has shape \(1, 2\)", r"needs \[2, max_pages")),
    BadInput("pallas.extend.indptrs_disagree", _extend(kv=(0, 4)),
             ValueError, ("kv_indptr has 2 entries and qo_indptr 3",)),
    BadInput("pallas.extend.qo_indptr_float", _extend(qo=jnp.array([0.0, 3.0, 5.0])),
             TypeError, ("qo_indptr must be an int32 array", "float32")),
    BadInput("pallas.extend.max_q_len", _extend(max_q_len=2),
             ValueError, ("q_len of request 0 = 3", "max_q_len = 2")),
    BadInput("pallas.extend.max_kv_len", _extend(max_kv_len=4),
             ValueError, (r"kv_lens\[1\] = 5", "max_kv_len = 4")),
    BadInput("pallas.extend.causal_not_bool", _extend(causal=1),
             TypeError, ("causal must be a bool", "1")),
    BadInput("pallas.extend.no_metadata", lambda: mla_extend(
        _q(batch=5), _pool(), qo_indptr=jnp.array([0, 3, 5], jnp.int32), sm_scale=SCALE),
             ValueError, ("kv_indptr and kv_indices", "page_table")),
]
