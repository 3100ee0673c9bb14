"""Forward-mode metadata vs SGLang's semantics (its `ForwardMode`s, as its aiter backend builds
their metadata)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from funcmla import metadata as md
from funcmla.checks import check_metadata, checked
from funcmla.layout import PoolSpec
from tests.pools import gather_oracle, layout_requests, next_pow2

MAX_CTX = 4096
BATCH = 16


def _jit(fn, *static):
    return jax.jit(fn, static_argnames=static)


decode = _jit(md.decode_metadata, "capacity")
extend = _jit(md.extend_metadata, "capacity")
verify = _jit(md.target_verify_metadata, "capacity", "num_draft_tokens")
draft = _jit(md.draft_extend_metadata, "capacity", "num_draft_tokens")


def _batch(lens, page_size, seed):
    rng = np.random.default_rng(seed)
    r2t, rpi, num_pages, owner = layout_requests(lens, page_size, rng=rng, max_context_len=MAX_CTX,
                                                 num_req_slots=BATCH + 2)
    pad = BATCH - len(lens)
    lens_p = np.concatenate([lens, np.zeros(pad, np.int64)]).astype(np.int32)
    rpi_p = np.concatenate([rpi, np.zeros(pad, np.int32)]).astype(np.int32)
    return r2t, rpi_p, lens_p, num_pages


def _expect_common(meta, r2t, rpi, kv_lens, qo_lens):
    indptr, idx = gather_oracle(r2t, rpi, kv_lens)
    np.testing.assert_array_equal(np.asarray(meta.kv_indptr), indptr)
    np.testing.assert_array_equal(np.asarray(meta.kv_indices)[: indptr[-1]], idx)  # host slice
    np.testing.assert_array_equal(np.asarray(meta.qo_indptr), np.concatenate([[0], np.cumsum(qo_lens)]))
    np.testing.assert_array_equal(np.asarray(meta.kv_last_page_len), np.ones(len(kv_lens)))
    assert int(meta.max_q_len) == max(qo_lens)
    assert int(meta.max_kv_len) == max(kv_lens)
    for f in ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len", "max_q_len", "max_kv_len"):
        assert getattr(meta, f).dtype == jnp.int32, f


lens_st = st.lists(st.integers(1, 1000), min_size=1, max_size=BATCH)


@given(lens=lens_st, page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 99))
def test_decode(lens, page_size, seed):
    r2t, rpi, seq, _ = _batch(np.array(lens), page_size, seed)
    meta = decode(r2t, rpi, seq, capacity=BATCH * 1024)
    assert meta.mode == "decode"
    _expect_common(meta, r2t, rpi, seq, np.ones(BATCH, int))


@given(lens=lens_st, page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 99),
       data=st.data())
def test_extend_with_and_without_prefix(lens, page_size, seed, data):
    r2t, rpi, seq, _ = _batch(np.array(lens), page_size, seed)
    with_prefix = data.draw(st.booleans())
    ext = np.array([data.draw(st.integers(1, n)) if n and with_prefix else n for n in seq], np.int32)
    meta = extend(r2t, rpi, seq, ext, capacity=BATCH * 1024)
    _expect_common(meta, r2t, rpi, seq, ext)


@given(lens=lens_st, page_size=st.sampled_from([1, 16, 64]), n=st.integers(1, 4),
       seed=st.integers(0, 99))
def test_target_verify_and_draft_extend(lens, page_size, n, seed):
    r2t, rpi, seq, _ = _batch(np.array(lens) + 4, page_size, seed)
    # target verify: seq_lens count the tokens before the n drafts, kv_lens = seq_lens + n
    before = seq - n
    meta = verify(r2t, rpi, before, num_draft_tokens=n, capacity=BATCH * 1100)
    _expect_common(meta, r2t, rpi, before + n, np.full(BATCH, n))
    np.testing.assert_array_equal(np.asarray(meta.qo_indptr), np.arange(BATCH + 1) * n)
    assert meta.num_draft_tokens == n and meta.mode == "target_verify"
    # draft extend: seq_lens already include the n tokens
    meta = draft(r2t, rpi, seq, num_draft_tokens=n, capacity=BATCH * 1100)
    _expect_common(meta, r2t, rpi, seq, np.full(BATCH, n))


def test_draft_keys_per_mode():
    """Only target verify reads keys past seq_lens (its n drafts; SGLang's seq_lens exclude
    them there and include them in draft extend)."""
    assert {m: md.draft_keys(m, 3) for m in md.MODES} == {
        "decode": 0, "extend": 0, "target_verify": 3, "draft_extend": 0}


def test_one_capacity_compiles_once():
    traces = []

    @functools.partial(jax.jit, static_argnames=("capacity",))
    def build(r2t, rpi, seq, *, capacity):
        traces.append(1)
        return md.decode_metadata(r2t, rpi, seq, capacity=capacity)

    rng = np.random.default_rng(0)
    for step in range(25):
        lens = rng.integers(1, 1000, size=rng.integers(1, BATCH + 1))
        r2t, rpi, seq, _ = _batch(lens, 16, step)
        meta = build(r2t, rpi, seq, capacity=BATCH * 1024)
        assert int(meta.kv_indptr[-1]) == lens.sum()
    assert len(traces) == 1


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("n_draft", [0, 3])
def test_buffer_plan_is_token_granular(page_size, n_draft):
    plan = md.BufferPlan(max_bs=8, max_context_len=1000, page_size=page_size,
                         num_draft_tokens=n_draft)
    assert plan.kv_indices_capacity == 8 * (math.ceil(1000 / page_size) * page_size + n_draft)
    assert plan.kv_indices_capacity >= 8 * (1000 + n_draft)  # every full batch fits
    assert plan.page_table_shape == (8, math.ceil(1000 / page_size))
    legacy = md.BufferPlan(8, 1000, page_size, legacy_block_granular_kv_indices=True)
    assert legacy.kv_indices_capacity == 8 * math.ceil(1000 / page_size)


def test_seed_overflow_reproduced_and_reported():
    """The seed's second bug: a block-granular kv_indices buffer at page size 64 overflows once
    the batch's tokens pass max_bs * ceil(ctx / 64); the check reports it, nothing is written
    past the buffer."""
    page_size, max_bs, ctx = 64, 4, 1024
    lens = np.array([300, 200, 100, 50])
    r2t, rpi, seq, num_pages = _batch(lens, page_size, 1)
    rpi, seq = rpi[:max_bs], seq[:max_bs]
    pool = PoolSpec(num_pages, page_size)

    def build_and_check(r2t, rpi, seq, capacity):
        meta = md.decode_metadata(r2t, rpi, seq, capacity=capacity)
        check_metadata(meta, pool=pool, max_context_len=ctx)
        return meta

    legacy = md.BufferPlan(max_bs, ctx, page_size, legacy_block_granular_kv_indices=True)
    fn = jax.jit(checked(build_and_check), static_argnums=3)
    err, meta = fn(r2t, rpi, seq, legacy.kv_indices_capacity)
    assert meta.kv_indices.shape == (legacy.kv_indices_capacity,) == (64,)
    with pytest.raises(Exception, match=r"sum\(seq_lens\) = 650 live tokens exceed the buffer capacity 64"):
        err.throw()
    with pytest.raises(ValueError, match=r"sum\(seq_lens\) = 650 live tokens exceed the buffer capacity 64"):
        md.decode_metadata(r2t, rpi, seq, capacity=legacy.kv_indices_capacity)  # eager: checked
    fixed = md.BufferPlan(max_bs, ctx, page_size)
    err, meta = fn(r2t, rpi, seq, fixed.kv_indices_capacity)
    assert err.get() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_bs=0, max_context_len=10), "max_bs must be a positive int"),
        (dict(max_bs=2, max_context_len=-1), "max_context_len must be a positive int"),
        (dict(max_bs=2, max_context_len=10, page_size=48), "page_size must be a power of two"),
        (dict(max_bs=2, max_context_len=10, num_draft_tokens=-1), "num_draft_tokens"),
    ],
)
def test_buffer_plan_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        md.BufferPlan(**kwargs)


def test_builders_reject_bad_shapes_and_dtypes():
    r2t = jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(TypeError, match="seq_lens must be an integer array"):
        md.decode_metadata(r2t, jnp.array([0, 1]), jnp.array([1.0, 2.0]), capacity=8)
    with pytest.raises(ValueError, match=r"extend_seq_lens must have shape \[batch\]=\(2,\)"):
        md.extend_metadata(r2t, jnp.array([0, 1]), jnp.array([1, 2]), jnp.array([1, 1, 1]), capacity=8)
    with pytest.raises(ValueError, match="num_draft_tokens must be a positive int"):
        md.target_verify_metadata(r2t, jnp.array([0]), jnp.array([1]), num_draft_tokens=0, capacity=8)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        md.decode_metadata(r2t, jnp.array([0]), jnp.array([1]), capacity=0)
