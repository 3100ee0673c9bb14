"""Bad inputs to the attention paths (reference, plan executor) and to the value checks, eager
and under `jit` through `funcmla.checks.checked` (the documented checked variant)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from funcmla import checks
from funcmla.attention.executor import run_work_plan
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import custom_device
from funcmla.indices import indptr_from_lens
from funcmla.layout import PageTable, PoolSpec, TokenCSR
from funcmla.metadata import decode_metadata
from funcmla.planners.prefill import PrefillPlanConfig, plan_ps_prefill
from tests.bad_input import BadInput

D, DV = 8, 4
Q = jnp.ones((3, 2, D), jnp.float32)
POOL_ROWS = jnp.ones((16, D), jnp.float32)
QO = jnp.array([0, 1, 2, 3], jnp.int32)
KV = jnp.array([0, 2, 5, 6], jnp.int32)
IDX = jnp.array([4, 5, 6, 7, 8, 9, 0, 0], jnp.int32)
POOL = PoolSpec(num_pages=10, page_size=4)  # usable slots [4, 44)
R2T = (jnp.arange(4 * 8, dtype=jnp.int32) + 4).reshape(4, 8)


def case(name, call, error, *match):
    return BadInput(name, call, error, tuple(match))


def ref(q=Q, pool=POOL_ROWS, qo=QO, kv=KV, idx=IDX, **kw):
    kw = dict(dict(sm_scale=0.5, v_head_dim=DV), **kw)
    return lambda: mla_attention_reference(q, pool, qo, kv, idx, **kw)


def under_jit(fn, *args):
    """Run `fn` jitted through `checks.checked` and raise its first failed check."""
    def call():
        err, _ = jax.jit(checks.checked(fn))(*args)
        err.throw()
    return call


def csr(indptr, idx):
    return TokenCSR(jnp.asarray(indptr, jnp.int32), jnp.asarray(idx, jnp.int32))


def token_csr_check(kv):
    return under_jit(lambda k: checks.check_token_csr(k, pool=POOL), kv)


@functools.cache
def _prefill(gqa_ratio):
    lens = np.array([24, 8], np.int32)
    meta_qo, meta_kv = indptr_from_lens(lens), indptr_from_lens(lens)
    plan = plan_ps_prefill(meta_qo, meta_kv, lens, config=PrefillPlanConfig(
        device=custom_device(4), max_qlen=32, gqa_ratio=gqa_ratio))
    meta = decode_metadata(jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32) + 4,
                           jnp.array([0, 1]), jnp.asarray(lens), capacity=32)
    import dataclasses

    meta = dataclasses.replace(meta, qo_indptr=meta_qo, mode="extend")
    return plan, meta


def executor(heads=16, gqa_ratio=1, rows=32, **kw):
    def call():
        plan, meta = _prefill(gqa_ratio)
        q = jnp.ones((rows, heads, D), jnp.float32)
        args = dict(sm_scale=0.5, max_qo_span=32, max_kv_span=32, v_head_dim=DV)
        run_work_plan(q, jnp.ones((64, D), jnp.float32), meta, plan, **dict(args, **kw))
    return call


CASES: list[BadInput] = [
    # ---- reference ---------------------------------------------------------------------------
    case("reference.page_table_as_kv_indices",
         ref(idx=PageTable(jnp.ones((3, 2), jnp.int32), jnp.array([2, 3, 1]), 2)), TypeError,
         r"kv_indices: expected an int32 array", r"got PageTable \(page-granular\)"),
    case("reference.token_csr_as_kv_indices", ref(idx=csr([0, 2], [4, 5])), TypeError,
         r"kv_indices: expected an int32 array", r"got TokenCSR"),
    case("reference.float_indptr", ref(kv=KV.astype(jnp.float32)), TypeError,
         r"kv_indptr must be an integer array", r"float32"),
    case("reference.fewer_q_rows_than_requests", ref(q=Q[:2]), ValueError,
         r"qo_indptr\[-1\] = 3 query rows", r"q has 2 rows"),
    case("reference.max_kv_len_below_a_request", ref(max_kv_len=2), ValueError,
         r"kv_lens\[1\] = 3", r"max_kv_len = 2"),
    case("reference.slot_outside_pool", ref(idx=IDX.at[1].set(99)), ValueError,
         r"kv_indices\[1\] = 99", r"pool's 16 rows"),
    case("reference.negative_slot", ref(idx=IDX.at[3].set(-1)), ValueError,
         r"kv_indices\[3\] = -1", r"\[0, 16\)"),
    case("reference.indptr_decreasing", ref(kv=jnp.array([0, 4, 2, 6], jnp.int32)), ValueError,
         r"kv_indptr\[2\] = 2 < kv_indptr\[1\] = 4", r"int32 limit"),
    case("reference.indptr_past_capacity", ref(kv=jnp.array([0, 2, 5, 9], jnp.int32)),
         ValueError, r"kv_indptr\[-1\] = 9", r"capacity 8"),
    case("reference.indptr_shapes_differ", ref(qo=QO[:3]), ValueError,
         r"qo_indptr and kv_indptr must both be \[B \+ 1\]", r"\(3,\), \(4,\)"),
    case("reference.q_not_3d", ref(q=Q[0]), ValueError, r"expected q \[T, H, D\]",
         r"q \(2, 8\)"),
    case("reference.v_head_dim_too_wide", ref(v_head_dim=9), ValueError, r"v_head_dim=9",
         r"\(0, 8\]"),
    case("reference.max_kv_len_negative", ref(max_kv_len=-1), ValueError,
         r"max_kv_len must be an int >= 0", r"got -1"),
    case("reference.checked_under_jit",
         under_jit(lambda q: mla_attention_reference(q, POOL_ROWS, QO, KV, IDX, sm_scale=0.5,
                                                     v_head_dim=DV), Q[:2]),
         checkify.JaxRuntimeError, r"qo_indptr\[-1\] = 3 query rows", r"q has 2 rows"),
    # ---- executor ----------------------------------------------------------------------------
    case("executor.prefill_plan_gqa_ratio_below_heads", executor(heads=16, gqa_ratio=1),
         ValueError, r"cover q heads \[0, 1\)", r"q has 16 heads", r"gqa_ratio=16"),
    case("executor.q_rows_below_queries", executor(heads=2, gqa_ratio=2, rows=16), ValueError,
         r"qo_indptr\[-1\] = 32 query rows", r"q has 16 rows"),
    case("executor.block_size_mismatch", executor(heads=2, gqa_ratio=2, page_size=16),
         ValueError, r"page_size=16", r"token-granular"),
    case("executor.max_kv_span_not_positive", executor(heads=2, gqa_ratio=2, max_kv_span=0),
         ValueError, r"max_kv_span must be a positive int", r"got 0"),
    case("executor.head_folding_needs_decode_plan",
         executor(heads=2, gqa_ratio=2, qk_batch_ratio=2, uni_seqlen_qo=1), ValueError,
         r"qk_batch_ratio=2 needs a decode plan", r"uni_seqlen_qo"),
    case("executor.v_head_dim_too_wide", executor(heads=2, gqa_ratio=2, v_head_dim=9),
         ValueError, r"v_head_dim=9", r"\(0, 8\]"),
    # ---- value checks (checkify, under jit) -------------------------------------------------
    case("checks.indptr_start", token_csr_check(csr([1, 2, 3], [4, 5, 9, 0])),
         checkify.JaxRuntimeError, r"kv_indptr\[0\] must be 0", r"got 1"),
    case("checks.indptr_int32_wrap",
         under_jit(lambda lens: checks.check_indptr(indptr_from_lens(lens), "kv_indptr"),
                   jnp.array([2**31 - 1, 5], jnp.int32)),
         checkify.JaxRuntimeError, r"kv_indptr must be non-decreasing", r"int32 limit 2147483647"),
    case("checks.indptr_over_capacity", token_csr_check(csr([0, 2, 5], [4, 5, 9, 10])),
         checkify.JaxRuntimeError, r"kv_indptr\[-1\] = 5", r"capacity 4"),
    case("checks.slot_outside_pool", token_csr_check(csr([0, 2, 3], [4, 44, 9, 0])),
         checkify.JaxRuntimeError, r"kv_indices\[1\] = 44", r"usable pool slots \[4, 44\)"),
    case("checks.slot_in_reserved_page", token_csr_check(csr([0, 2, 3], [4, 5, 3, 0])),
         checkify.JaxRuntimeError, r"kv_indices\[2\] = 3", r"reserved page 0"),
    case("checks.csr_float_indices",
         lambda: checks.check_token_csr_static(TokenCSR(jnp.array([0, 1], jnp.int32),
                                                        jnp.array([1.0]))),
         TypeError, r"kv\.indices must be int32", r"float32"),
    case("checks.page_table_page_id",
         under_jit(lambda p: checks.check_page_table(p, pool=POOL, max_context_len=12),
                   PageTable(jnp.array([[1, 2, 0], [11, 0, 0]], jnp.int32),
                             jnp.array([6, 2], jnp.int32), 4)),
         checkify.JaxRuntimeError, r"page_table\[1, 0\] = 11", r"usable pages \[1, 10\]"),
    case("checks.page_table_page_size_vs_pool",
         lambda: checks.check_page_table(PageTable(jnp.ones((1, 1), jnp.int32),
                                                   jnp.ones(1, jnp.int32), 8),
                                         pool=POOL, max_context_len=8),
         ValueError, r"page_table\.page_size=8", r"pool's 4"),
    case("checks.page_contiguity",
         under_jit(lambda kv: checks.check_page_contiguity(kv, page_size=4),
                   csr([0, 6], [8, 9, 11, 10, 20, 21])),
         checkify.JaxRuntimeError, r"kv_indices\[2\] = 11", r"page contiguity at page_size 4"),
    case("checks.metadata_names_the_length_not_the_slot",
         under_jit(lambda m: checks.check_metadata(m, pool=POOL, max_context_len=8),
                   jax.jit(lambda r, i, s: decode_metadata(r, i, s, capacity=16))(
                       R2T, jnp.array([0, 1]), jnp.array([3, 9]))),
         checkify.JaxRuntimeError, r"kv_lens\[1\] = 9", r"max_context_len=8"),
    case("checks.builder_checked_under_jit",
         under_jit(lambda s: decode_metadata(R2T, jnp.array([0, 1]), s, capacity=16),
                   jnp.array([3, 9])),
         checkify.JaxRuntimeError, r"seq_lens\[1\] = 9", r"max_context_len = 8"),
    case("checks.builder_capacity_under_jit",
         under_jit(lambda s: decode_metadata(R2T, jnp.array([0, 1]), s, capacity=8),
                   jnp.array([8, 8])),
         checkify.JaxRuntimeError, r"sum\(seq_lens\) = 16", r"the buffer capacity 8"),
    case("checks.page_size", lambda: checks.check_page_size(24, "pool page_size"), ValueError,
         r"pool page_size must be a power of two", r"got 24"),
]
