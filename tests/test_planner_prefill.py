"""AITER prefill PS planner (get_ps_metadata_v1): jit planner vs the serial NumPy oracle, a
hand-worked example, buffer sizes, config and input validation, the named
legacy pairing and the granularity check."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.checks import checked
from funcmla.config import MI300X, MI355X, custom_device
from funcmla.layout import PageTable, TokenCSR
from funcmla.planners.oracle_prefill import ps_prefill_plan_oracle, ps_prefill_sizes_oracle
from funcmla.planners.prefill import (
    PrefillPlanConfig,
    check_plan_matches_metadata,
    check_prefill_plan_inputs,
    plan_ps_prefill,
    ps_prefill_plan_sizes,
)

FIELDS = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
          "reduce_partial_map", "num_works", "num_partials")
BATCH = 64  # static batch: hypothesis batches (1..64) are padded with empty requests
MAX_QLEN = 2048


def inputs(qo_lens, prefix, block_size=1, *, token_kv=False, batch=None):
    """qo_indptr, kv_indptr (entries of block_size tokens; tokens if token_kv), context_lens."""
    qo_lens = np.asarray(qo_lens, np.int64)
    ctx = qo_lens + np.asarray(prefix, np.int64)
    pad = 0 if batch is None else batch - len(qo_lens)
    qo_lens, ctx = np.pad(qo_lens, (0, pad)), np.pad(ctx, (0, pad))
    entries = ctx if token_kv else -(-ctx // block_size)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(entries)]).astype(np.int32)
    return qo_indptr, kv_indptr, ctx.astype(np.int32)


def oracle(cfg, qo_indptr, kv_indptr, ctx):
    return ps_prefill_plan_oracle(
        qo_indptr, kv_indptr, ctx, num_cu=cfg.device.num_cu, num_heads_k=cfg.num_heads_k,
        gqa_ratio=cfg.gqa_ratio, qhead_granularity=cfg.qhead_granularity,
        qlen_granularity=cfg.qlen_granularity, kvlen_granularity=cfg.kvlen_granularity,
        block_size=cfg.block_size, is_causal=cfg.is_causal, max_qlen=cfg.max_qlen)


def assert_same(plan, ref):
    for name in FIELDS:
        a, b = np.asarray(getattr(plan, name)), ref[name]
        assert a.shape == b.shape, (name, a.shape, b.shape)
        bad = np.argwhere(np.atleast_1d(a != b))
        assert bad.size == 0, f"{name} differs at {bad[:4].tolist()}: " \
                              f"{a[tuple(bad[:4].T)]} vs {b[tuple(bad[:4].T)]}"


# ---- a hand-worked example (8 TGs, lens [600, 300], causal) --------------------------------

EXAMPLE = PrefillPlanConfig(device=custom_device(8), num_heads_k=1, gqa_ratio=1, max_qlen=600)


def test_worked_example_oracle_and_jit():
    qo_indptr, kv_indptr, ctx = inputs([600, 300], [0, 0])
    ref = oracle(EXAMPLE, qo_indptr, kv_indptr, ctx)
    assert ref["reduce_indptr"].tolist() == [0, 3, 6, 8, 10, 10, 10]
    # groups in (qo_start, qo_end) order; partial rows in units of qlen_granularity = 256
    assert ref["reduce_final_map"][:4].tolist() == [[256, 512], [512, 600], [600, 856], [856, 900]]
    assert (ref["reduce_partial_map"][:10] // 256).tolist() == [3, 4, 5, 0, 1, 2, 6, 7, 8, 9]
    works = ref["work_info"][: ref["num_works"]]
    # batch 0's tiles are visited [0,256), [512,600), [256,512) (ping-pong)
    first_seen = list(dict.fromkeys(map(tuple, works[:, 2:4].tolist())))
    assert first_seen[:3] == [(0, 256), (512, 600), (256, 512)]
    # 16 units of 128 tokens over 8 TGs: 2 units (256 tokens) each
    assert ref["work_indptr"].tolist() == [0, 1, 2, 3, 5, 6, 8, 10, 11]
    assert works[0].tolist() == [0, -1, 0, 256, 0, 256, 0, (1 << 16) | 0]
    plan = plan_ps_prefill(qo_indptr, kv_indptr, ctx, config=EXAMPLE)
    assert plan.kind == "prefill" and plan.block_size == 1 and not plan.legacy
    assert_same(plan, ref)


# ---- jit == oracle over random batches --------------------------------------------------------

CONFIGS = {
    "cu8_hk1_causal": PrefillPlanConfig(device=custom_device(8), max_qlen=MAX_QLEN),
    "cu80_hk16_noncausal": PrefillPlanConfig(device=custom_device(80), num_heads_k=16,
                                             is_causal=False, max_qlen=MAX_QLEN),
    "mi355x_hk1_gqa16_noncausal": PrefillPlanConfig(device=MI355X, gqa_ratio=16, is_causal=False,
                                                    max_qlen=MAX_QLEN),
    "mi300x_hk16_gqa2_causal": PrefillPlanConfig(device=MI300X, num_heads_k=16, gqa_ratio=2,
                                                 max_qlen=MAX_QLEN),
    "legacy_ps64_cu80": PrefillPlanConfig.legacy_page_granular(64, device=custom_device(80),
                                                               max_qlen=MAX_QLEN),
}


@st.composite
def batches(draw):
    n = draw(st.integers(1, BATCH))
    qo = draw(st.lists(st.integers(0, MAX_QLEN), min_size=n, max_size=n))
    prefix = draw(st.lists(st.sampled_from([0, 0, 1, 100, 127, 128, 1000, 3000]), min_size=n,
                           max_size=n))
    return qo, prefix


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=8)
@given(batch=batches())
def test_jit_matches_oracle(name, batch):
    cfg = CONFIGS[name]
    qo_indptr, kv_indptr, ctx = inputs(*batch, cfg.block_size, token_kv=cfg.legacy,
                                       batch=BATCH)
    plan = plan_ps_prefill(qo_indptr, kv_indptr, ctx, config=cfg)
    assert_same(plan, oracle(cfg, qo_indptr, kv_indptr, ctx))


def test_edge_batches_match_oracle():
    cfg = CONFIGS["cu8_hk1_causal"]
    cases = [
        ([0] * 3, [0] * 3),  # nothing to plan
        ([1], [0]),  # one token: one unit, 7 TGs without work
        ([2048] * 64, [0] * 64),  # the static maximum
        ([256, 0, 257, 5], [0, 7, 127, 129]),  # tile boundaries +- 1
    ]
    for qo, prefix in cases:
        qo_indptr, kv_indptr, ctx = inputs(qo, prefix, batch=BATCH)
        plan = plan_ps_prefill(qo_indptr, kv_indptr, ctx, config=cfg)
        assert_same(plan, oracle(cfg, qo_indptr, kv_indptr, ctx))
    # non-causal, zero-length KV tiles (context 0) that land at the end of the unit stream are
    # dropped by the C++ loop (no TG has capacity left); the port must drop them too
    nc = PrefillPlanConfig(device=custom_device(8), is_causal=False, max_qlen=MAX_QLEN)
    qo_indptr = np.array([0, 10, 20] + [20] * (BATCH - 2), np.int32)
    kv_indptr = np.array([0, 300, 300] + [300] * (BATCH - 2), np.int32)
    ctx = np.diff(kv_indptr).astype(np.int32)
    plan = plan_ps_prefill(qo_indptr, kv_indptr, ctx, config=nc)
    ref = oracle(nc, qo_indptr, kv_indptr, ctx)
    assert_same(plan, ref)
    assert int(ref["num_works"]) == 3  # 3 units of tile 0; tile 1 (no KV) gets nothing


def test_plan_is_jittable_without_host_round_trip():
    cfg = CONFIGS["cu8_hk1_causal"]
    qo_indptr, kv_indptr, ctx = inputs([300, 700], [10, 0], batch=BATCH)

    @jax.jit
    def f(a, b, c):
        return plan_ps_prefill(a, b, c, config=cfg).work_info.sum()

    jaxpr = str(jax.make_jaxpr(lambda a, b, c: plan_ps_prefill(a, b, c, config=cfg))(
        qo_indptr, kv_indptr, ctx))
    assert "callback" not in jaxpr
    ref = oracle(cfg, qo_indptr, kv_indptr, ctx)
    assert int(f(qo_indptr, kv_indptr, ctx)) == int(ref["work_info"].sum())


# ---- sizes, configs, inputs ------------------------------------------------------------------


@pytest.mark.parametrize("batch,max_qlen,hk,gqa,dev", [
    (1, 1, 1, 1, MI300X), (4, 600, 16, 1, MI300X), (64, 2048, 1, 4, MI355X),
    (1024, 8192, 16, 1, MI355X), (3, 0, 1, 1, custom_device(8)), (5, 300, 2, 2, custom_device(1)),
])
def test_sizes_match_info_v1(batch, max_qlen, hk, gqa, dev):
    cfg = PrefillPlanConfig(device=dev, num_heads_k=hk, gqa_ratio=gqa, max_qlen=max_qlen)
    s = ps_prefill_plan_sizes(batch, max_qlen, config=cfg)
    assert (s.max_works, s.num_tiles, s.max_partials) == ps_prefill_sizes_oracle(
        batch, hk, max_qlen, cfg.qlen_granularity, dev.num_cu)
    assert s.num_cu == dev.num_cu and s.partial_rows == s.max_partials * 256


def test_mi300x_hk16_sizes_by_hand():
    cfg = PrefillPlanConfig(device=MI300X, num_heads_k=16)
    s = ps_prefill_plan_sizes(4, 600, config=cfg)
    # gcd(16, 304) = 16 clusters of 19 CUs; mq = 3
    assert (s.max_works, s.num_tiles, s.max_partials) == ((4 + 18) * 3 * 16, 12, min(22, 36) * 3)


def test_default_config_is_token_granular():
    cfg = PrefillPlanConfig(device=MI355X, gqa_ratio=2)
    assert (cfg.block_size, cfg.kvlen_granularity, cfg.qlen_granularity, cfg.qhead_granularity,
            cfg.legacy) == (1, 128, 128, 2, False)
    legacy = PrefillPlanConfig.legacy_page_granular(256, device=MI355X)
    assert (legacy.block_size, legacy.kvlen_granularity, legacy.legacy) == (256, 256, True)
    assert PrefillPlanConfig.legacy_page_granular(16, device=MI355X).kvlen_granularity == 128


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=64), r"block_size=64.*legacy_page_granular"),
    (dict(block_size=3, legacy=True), r"block_size must be a power of two"),
    (dict(kvlen_granularity=100, block_size=64, legacy=True),
     r"kvlen_granularity=100 must be a multiple of block_size=64"),
    (dict(num_heads_k=0), r"num_heads_k must be a positive int, got 0"),
    (dict(gqa_ratio=3), r"gqa_ratio=3 does not divide"),
    (dict(max_qlen=-1), r"max_qlen must be an int >= 0, got -1"),
    (dict(num_heads_k=4096, gqa_ratio=16), r"16-bit field"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefillPlanConfig(device=MI300X, **kwargs)


def test_plan_shape_errors():
    cfg = CONFIGS["cu8_hk1_causal"]
    with pytest.raises(ValueError, match="inconsistent batch sizes"):
        plan_ps_prefill(np.zeros(3, np.int32), np.zeros(4, np.int32), np.zeros(2, np.int32), config=cfg)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        ps_prefill_plan_sizes(0, 10, config=cfg)


@functools.lru_cache(maxsize=None)
def _input_checker(cfg):
    """The checkified input check for one config, jitted once (not re-traced per call)."""
    return jax.jit(checked(functools.partial(check_prefill_plan_inputs, config=cfg)))


def _input_error(qo_indptr, kv_indptr, ctx, cfg):
    err, _ = _input_checker(cfg)(jnp.asarray(qo_indptr, jnp.int32),
                                 jnp.asarray(kv_indptr, jnp.int32), jnp.asarray(ctx, jnp.int32))
    return err.get()


def test_input_checks_name_the_field():
    cfg = PrefillPlanConfig(device=custom_device(8), max_qlen=512)
    assert _input_error([0, 100, 612], [0, 150, 700], [150, 550], cfg) is None
    msg = _input_error([0, 100, 613], [0, 150, 700], [150, 550], cfg)
    assert "request 1 has 513 queries > config.max_qlen=512" in msg
    msg = _input_error([0, 100, 200], [0, 150, 200], [150, 50], cfg)
    assert "context_lens[1] = 50 is below the query length 100" in msg
    msg = _input_error([0, 100, 200], [0, 150, 260], [150, 250], cfg)
    assert "kv_indptr[2] - kv_indptr[1] = 110 entries, but context_lens[1] = 250 tokens" in msg
    msg = _input_error([0, 100, 90], [0, 150, 260], [150, 110], cfg)
    assert "qo_indptr must be non-decreasing: qo_indptr[2] = 90 < qo_indptr[1] = 100" in msg
    # the seed: a token-granular kv_indptr with the legacy block size 64
    legacy = PrefillPlanConfig.legacy_page_granular(64, device=custom_device(8), max_qlen=512)
    msg = _input_error([0, 100, 200], [0, 150, 260], [150, 110], legacy)
    assert "= 150 entries, but context_lens[0] = 150 tokens needs 3 entries of block_size=64" in msg


def test_granularity_check_refuses_legacy_against_token_csr():
    cfg = PrefillPlanConfig.legacy_page_granular(64, device=custom_device(8), max_qlen=512)
    qo_indptr, kv_indptr, ctx = inputs([300], [0], token_kv=True)
    plan = plan_ps_prefill(qo_indptr, kv_indptr, ctx, config=cfg)
    assert plan.legacy and plan.block_size == 64
    kv = TokenCSR(indptr=jnp.asarray(kv_indptr), indices=jnp.arange(300, dtype=jnp.int32))
    with pytest.raises(ValueError, match=r"block_size=64.*1 token\(s\) per entry.*named legacy"):
        check_plan_matches_metadata(plan, kv)
    check_plan_matches_metadata(plan, kv, allow_legacy_mismatch=True)  # on purpose: allowed
    pt = PageTable(table=jnp.ones((1, 5), jnp.int32), lengths=jnp.array([300], jnp.int32),
                   page_size=64)
    check_plan_matches_metadata(plan, pt)  # page-granular index stream: consistent
    good = plan_ps_prefill(*inputs([300], [0]), config=PrefillPlanConfig(device=custom_device(8),
                                                                         max_qlen=512))
    check_plan_matches_metadata(good, kv)
    with pytest.raises(ValueError, match=r"block_size=1.*page_size=64"):
        check_plan_matches_metadata(good, pt)
    with pytest.raises(TypeError, match="expected a TokenCSR"):
        check_plan_matches_metadata(good, kv_indptr)
