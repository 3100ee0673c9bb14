"""Bad inputs of the work planners (funcmla.planners): configurations AITER refuses, lengths past
the int32 limits of the plan, mismatched shapes, capacity too small, granularity mismatch.
Each case names the field and the value or the limit (tests/test_bad_inputs.py runs them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from funcmla.checks import run_checked
from funcmla.config import MI300X, custom_device
from funcmla.layout import TokenCSR
from funcmla.planners import (
    DecodePlanConfig,
    PrefillPlanConfig,
    check_decode_plan_inputs,
    check_plan_matches_metadata,
    check_prefill_plan_inputs,
    mla_decode_plan_sizes,
    plan_mla_decode,
    plan_ps_prefill,
    ps_prefill_plan_sizes,
)
from tests.bad_input import BadInput

LIMIT = r"int32 limit 2147483647"
DEV = custom_device(8)
DECODE = DecodePlanConfig(device=DEV, num_heads=16)
DECODE_P64 = DecodePlanConfig(device=DEV, num_heads=16, page_size=64)
DECODE_MTP = DecodePlanConfig(device=custom_device(8, "gfx950"), num_heads=64, q_dtype="fp8",
                              kv_dtype="fp8", max_seqlen_qo=4)  # ragged qo, qo splits
PREFILL = PrefillPlanConfig(device=DEV, max_qlen=512)
LEGACY64 = PrefillPlanConfig.legacy_page_granular(64, device=DEV, max_qlen=512)


def _i32(*xs):
    return [np.asarray(x, np.int32) for x in xs]


def _decode_cfg(**kwargs):
    return lambda: DecodePlanConfig(**{"device": MI300X, "num_heads": 16, **kwargs})


def _prefill_cfg(**kwargs):
    return lambda: PrefillPlanConfig(**{"device": MI300X, **kwargs})


def _decode(qo, kv, last, cfg=DECODE, **kwargs):
    return lambda: plan_mla_decode(qo, kv, last, config=cfg, **kwargs)


def _prefill(qo, kv, ctx, cfg=PREFILL):
    return lambda: plan_ps_prefill(qo, kv, ctx, config=cfg)


def _wrapped(lens):
    """An int32 cumulative sum that passed 2**31 - 1 (what an int32 cumsum of the lengths gives)."""
    return np.concatenate([[0], np.cumsum(np.asarray(lens, np.int64))]).astype(np.int32)


def _decode_checked_under_jit(qo, kv, last, cfg=DECODE):
    """The checkify variant under jit: traced inputs, the first failed check raised."""
    fn = jax.jit(lambda q, k, lp: check_decode_plan_inputs(q, k, lp, config=cfg))
    return lambda: run_checked(fn, *(jnp.asarray(x, jnp.int32) for x in (qo, kv, last)))


def _prefill_checked_under_jit(qo, kv, ctx, cfg=PREFILL):
    fn = jax.jit(lambda q, k, c: check_prefill_plan_inputs(q, k, c, config=cfg))
    return lambda: run_checked(fn, *(jnp.asarray(x, jnp.int32) for x in (qo, kv, ctx)))


def _legacy_plan_vs_token_csr():
    qo, kv, ctx = _i32([0, 300], [0, 5], [300])
    plan = plan_ps_prefill(qo, kv, ctx, config=LEGACY64)
    token_csr = TokenCSR(indptr=jnp.asarray([0, 300], jnp.int32),
                         indices=jnp.arange(300, dtype=jnp.int32))
    check_plan_matches_metadata(plan, token_csr)


GOOD_QO, GOOD_KV, GOOD_LAST = _i32([0, 1, 2], [0, 100, 300], [1, 1])
TWO_BILLION = np.array([0, 2_000_000_000, 4_000_000_000], np.int64)
JaxRuntimeError = checkify.JaxRuntimeError

CASES: list[BadInput] = [
    # ---- DecodePlanConfig: values AITER's planner refuses -------------------------------------
    BadInput("planners.decode_config.page_size_not_power_of_two", _decode_cfg(page_size=48),
             ValueError, (r"page_size", r"48", r"power of two")),
    BadInput("planners.decode_config.kv_granularity_not_power_of_two",
             _decode_cfg(kv_granularity=24), ValueError, (r"kv_granularity", r"24")),
    BadInput("planners.decode_config.num_heads_not_multiple_of_8", _decode_cfg(num_heads=12),
             ValueError, (r"num_heads", r"12", r"multiple of 8")),
    BadInput("planners.decode_config.num_heads_unsupported", _decode_cfg(num_heads=24),
             ValueError, (r"num_heads", r"24", r"not supported")),
    BadInput("planners.decode_config.dtype", _decode_cfg(q_dtype="fp16"), ValueError,
             (r"q_dtype", r"'fp16'", r"bf16")),
    BadInput("planners.decode_config.num_heads_k", _decode_cfg(num_heads_k=2), ValueError,
             (r"num_heads_k", r"=2")),
    BadInput("planners.decode_config.max_seqlen_qo", _decode_cfg(max_seqlen_qo=0), ValueError,
             (r"max_seqlen_qo", r"=0", r">= 1")),
    BadInput("planners.decode_config.uni_seqlen_qo_above_max",
             _decode_cfg(max_seqlen_qo=2, uni_seqlen_qo=3), ValueError,
             (r"uni_seqlen_qo", r"=3", r"max_seqlen_qo=2")),
    BadInput("planners.decode_config.folding_needs_uni_seqlen_qo", _decode_cfg(num_heads=128),
             ValueError, (r"uni_seqlen_qo", r"=-1", r"folded")),
    BadInput("planners.decode_config.folding_needs_page_size_1",
             _decode_cfg(num_heads=128, uni_seqlen_qo=1, page_size=16), ValueError,
             (r"page_size", r"=16", r"page_size == 1")),
    BadInput("planners.decode_config.max_split_per_batch", _decode_cfg(max_split_per_batch=0),
             ValueError, (r"max_split_per_batch", r"=0")),
    BadInput("planners.decode_config.zero_kv_behaviour", _decode_cfg(zero_kv_behaviour="fast"),
             ValueError, (r"zero_kv_behaviour", r"'fast'")),
    BadInput("planners.decode_config.parallel_not_eligible",
             _decode_cfg(max_seqlen_qo=2, zero_kv_behaviour="parallel"), ValueError,
             (r"zero_kv_behaviour", r"'parallel'", r"max_seqlen_qo == 1")),
    BadInput("planners.decode_config.is_causal_not_bool", _decode_cfg(is_causal=1), ValueError,
             (r"is_causal", r"=1", r"bool")),
    BadInput("planners.decode_config.device", _decode_cfg(device="mi300x"), ValueError,
             (r"device", r"'mi300x'", r"DeviceProfile")),
    # ---- PrefillPlanConfig --------------------------------------------------------------------
    BadInput("planners.prefill_config.block_size_not_token_granular",
             _prefill_cfg(block_size=64), ValueError,
             (r"block_size=64", r"legacy_page_granular")),
    BadInput("planners.prefill_config.block_size_not_power_of_two",
             _prefill_cfg(block_size=3, legacy=True), ValueError,
             (r"block_size", r"power of two", r"\b3\b")),
    BadInput("planners.prefill_config.kvlen_granularity_vs_block_size",
             _prefill_cfg(kvlen_granularity=100, block_size=64, legacy=True), ValueError,
             (r"kvlen_granularity=100", r"block_size=64")),
    BadInput("planners.prefill_config.num_heads_k", _prefill_cfg(num_heads_k=0), ValueError,
             (r"num_heads_k", r"got 0")),
    BadInput("planners.prefill_config.gqa_ratio_vs_tile", _prefill_cfg(gqa_ratio=3), ValueError,
             (r"gqa_ratio=3", r"256")),
    BadInput("planners.prefill_config.max_qlen", _prefill_cfg(max_qlen=-1), ValueError,
             (r"max_qlen", r"-1")),
    BadInput("planners.prefill_config.q_head_range_16_bits",
             _prefill_cfg(num_heads_k=4096, gqa_ratio=16), ValueError,
             (r"q head range end 65536", r"16-bit")),
    BadInput("planners.prefill_config.legacy_page_size",
             lambda: PrefillPlanConfig.legacy_page_granular(48, device=MI300X), ValueError,
             (r"page_size", r"48", r"power of two")),
    BadInput("planners.prefill_config.device", _prefill_cfg(device=None), TypeError,
             (r"device", r"None", r"DeviceProfile")),
    # ---- buffer sizes -------------------------------------------------------------------------
    BadInput("planners.decode_sizes.batch_size", lambda: mla_decode_plan_sizes(0, DECODE),
             ValueError, (r"batch_size", r"got 0")),
    BadInput("planners.decode_sizes.config", lambda: mla_decode_plan_sizes(4, PREFILL),
             TypeError, (r"config", r"PrefillPlanConfig")),
    BadInput("planners.prefill_sizes.batch_size",
             lambda: ps_prefill_plan_sizes(0, 10, config=PREFILL), ValueError,
             (r"batch_size", r"got 0")),
    BadInput("planners.prefill_sizes.max_qlen",
             lambda: ps_prefill_plan_sizes(4, -1, config=PREFILL), ValueError,
             (r"max_qlen", r"-1")),
    # ---- plan_mla_decode: shapes, dtypes, capacity, options -----------------------------------
    BadInput("planners.decode.float_indptr",
             _decode(GOOD_QO.astype(np.float32), GOOD_KV, GOOD_LAST), ValueError,
             (r"qo_indptr", r"int32", r"float32")),
    BadInput("planners.decode.indptr_not_vector",
             _decode(GOOD_QO, GOOD_KV[None], GOOD_LAST), ValueError,
             (r"kv_indptr", r"vector", r"\(1, 3\)")),
    BadInput("planners.decode.qo_kv_shape_mismatch",
             _decode(GOOD_QO[:2], GOOD_KV, GOOD_LAST), ValueError,
             (r"qo_indptr shape \(2,\)", r"kv_indptr shape \(3,\)")),
    BadInput("planners.decode.last_page_lens_shape",
             _decode(GOOD_QO, GOOD_KV, GOOD_LAST[:1]), ValueError,
             (r"kv_last_page_lens", r"\(2,\)", r"\(1,\)")),
    BadInput("planners.decode.empty_batch", _decode(GOOD_QO[:1], GOOD_KV[:1], GOOD_LAST[:0]),
             ValueError, (r"kv_indptr", r">= 2 entries", r"\(1,\)")),
    BadInput("planners.decode.batch_size_below_batch",
             _decode(GOOD_QO, GOOD_KV, GOOD_LAST, batch_size=1), ValueError,
             (r"batch_size=1", r"\(2\)")),
    BadInput("planners.decode.walk", _decode(GOOD_QO, GOOD_KV, GOOD_LAST, walk="fast"),
             ValueError, (r"walk", r"'fast'")),
    BadInput("planners.decode.fill_impl", _decode(GOOD_QO, GOOD_KV, GOOD_LAST, fill_impl="gpu"),
             ValueError, (r"fill_impl", r"'gpu'")),
    BadInput("planners.decode.config_type", _decode(GOOD_QO, GOOD_KV, GOOD_LAST, cfg=PREFILL),
             TypeError, (r"config", r"PrefillPlanConfig")),
    # ---- plan_mla_decode: values (eager: checked by default) ---------------------------------
    BadInput("planners.decode.total_kv_over_int32",
             _decode(GOOD_QO, TWO_BILLION, GOOD_LAST), ValueError,
             (r"total kv length 4000000000", r"kv_indptr\[2\]", LIMIT)),
    BadInput("planners.decode.kv_indptr_wrapped",
             _decode(GOOD_QO, _wrapped([2_000_000_000] * 2), GOOD_LAST), ValueError,
             (r"kv_indptr\[2\] = -294967296", LIMIT, r"wrapped")),
    BadInput("planners.decode.kv_near_int32_limit",
             _decode(GOOD_QO, _i32([0, 2_147_483_640, 2_147_483_641])[0], GOOD_LAST),
             ValueError, (r"total kv length 2147483641", LIMIT, r"kv_granularity")),
    BadInput("planners.decode.request_tokens_over_int32",
             _decode(GOOD_QO, _i32([0, 100, 40_000_000])[0], _i32([3, 64])[0], cfg=DECODE_P64),
             ValueError, (r"request 1 has 39999900 pages", r"page_size=64", LIMIT)),
    BadInput("planners.decode.last_page_len_out_of_range",
             _decode(GOOD_QO, GOOD_KV, _i32([0, 64])[0], cfg=DECODE_P64), ValueError,
             (r"kv_last_page_lens\[0\] = 0", r"page_size=64")),
    BadInput("planners.decode.kv_indptr_decreasing",
             _decode(GOOD_QO, _i32([0, 300, 100])[0], GOOD_LAST), ValueError,
             (r"kv_indptr must be non-decreasing", r"kv_indptr\[2\] = 100")),
    BadInput("planners.decode.kv_indptr_start",
             _decode(GOOD_QO, _i32([5, 100, 300])[0], GOOD_LAST), ValueError,
             (r"kv_indptr\[0\] must be 0", r"got 5")),
    BadInput("planners.decode.qo_len_above_max_seqlen_qo",
             _decode(_i32([0, 4, 9])[0], GOOD_KV, GOOD_LAST, cfg=DECODE_MTP), ValueError,
             (r"qo_indptr\[2\] - qo_indptr\[1\] = 5", r"max_seqlen_qo=4")),
    BadInput("planners.decode.checked_under_jit_wrapped",
             _decode_checked_under_jit(GOOD_QO, _wrapped([2_000_000_000] * 2), GOOD_LAST),
             JaxRuntimeError, (r"kv_indptr\[2\] = -294967296", LIMIT)),
    # ---- plan_ps_prefill ---------------------------------------------------------------------
    BadInput("planners.prefill.inconsistent_batch",
             _prefill(*_i32([0, 5, 9], [0, 5, 9, 9], [5, 4])), ValueError,
             (r"inconsistent batch sizes", r"kv_indptr \(4,\)")),
    BadInput("planners.prefill.not_vector",
             _prefill(*_i32([[0, 5]], [0, 5], [5])), ValueError,
             (r"qo_indptr", r"1-D", r"\(1, 2\)")),
    BadInput("planners.prefill.total_qo_over_int32",
             _prefill(TWO_BILLION, TWO_BILLION, TWO_BILLION[1:] - TWO_BILLION[:-1]),
             ValueError,
             (r"total qo length 4000000000", r"qo_indptr\[2\]", LIMIT)),
    BadInput("planners.prefill.qo_indptr_wrapped",
             _prefill(_wrapped([2_000_000_000] * 2), _wrapped([2_000_000_000] * 2),
                      _i32([2_000_000_000] * 2)[0]), ValueError,
             (r"qo_indptr\[2\] = -294967296", LIMIT, r"wrapped")),
    BadInput("planners.prefill.context_near_int32_limit",
             _prefill(*_i32([0, 1], [0, 2_147_483_600], [2_147_483_600])), ValueError,
             (r"context_lens\[0\] = 2147483600", LIMIT, r"kvlen_granularity")),
    BadInput("planners.prefill.qo_len_above_max_qlen",
             _prefill(*_i32([0, 100, 613], [0, 150, 700], [150, 550])), ValueError,
             (r"request 1 has 513 queries", r"max_qlen=512")),
    BadInput("planners.prefill.context_below_qo_len",
             _prefill(*_i32([0, 100, 200], [0, 150, 200], [150, 50])), ValueError,
             (r"context_lens\[1\] = 50", r"query length 100")),
    BadInput("planners.prefill.granularity_mismatch",
             _prefill(*_i32([0, 100, 200], [0, 150, 260], [150, 250])), ValueError,
             (r"kv_indptr\[2\] - kv_indptr\[1\] = 110 entries", r"context_lens\[1\] = 250",
              r"block_size=1")),
    BadInput("planners.prefill.checked_under_jit_granularity",
             _prefill_checked_under_jit(*_i32([0, 100, 200], [0, 150, 260], [150, 110]),
                                        cfg=LEGACY64), JaxRuntimeError,
             (r"kv_indptr\[1\] - kv_indptr\[0\] = 150 entries", r"block_size=64")),
    BadInput("planners.prefill.legacy_plan_vs_token_metadata", _legacy_plan_vs_token_csr,
             ValueError, (r"block_size=64", r"1 token\(s\) per entry")),
    BadInput("planners.prefill.plan_not_a_workplan",
             lambda: check_plan_matches_metadata(object(), None), TypeError,
             (r"plan", r"WorkPlan", r"object")),
]
