"""Every value check fires on bad input, names the field, position and value, and passes good input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcmla import checks
from funcmla.layout import PageTable, PoolSpec, TokenCSR, is_power_of_two, next_power_of_two
from funcmla.metadata import decode_metadata, extend_metadata

POOL = PoolSpec(num_pages=10, page_size=4)  # usable slots [4, 44)


def _raises(fn, *args, match):
    err, _ = jax.jit(checks.checked(fn))(*args)
    with pytest.raises(Exception, match=match):
        err.throw()


def _ok(fn, *args):
    err, _ = jax.jit(checks.checked(fn))(*args)
    assert err.get() is None


def csr(indptr, indices):
    return TokenCSR(jnp.asarray(indptr, jnp.int32), jnp.asarray(indices, jnp.int32))


def test_good_csr_passes():
    _ok(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 2, 3], [4, 5, 9, 0]))


def test_indptr_must_start_at_zero():
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([1, 2, 3], [4, 5, 9, 0]),
            match=r"kv_indptr\[0\] must be 0, got 1")


def test_indptr_must_be_monotone():
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 3, 2, 4], [4, 5, 9, 10]),
            match=r"kv_indptr must be non-decreasing: kv_indptr\[2\] = 2 < kv_indptr\[1\] = 3")


def test_indptr_within_capacity():
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 2, 5], [4, 5, 9, 10]),
            match=r"kv_indptr\[-1\] = 5 live entries exceed the buffer capacity 4")


def test_live_index_inside_pool():
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 2, 3], [4, 44, 9, 0]),
            match=r"kv_indices\[1\] = 44 is outside the usable pool slots \[4, 44\)")
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 2, 3], [4, 5, -7, 0]),
            match=r"kv_indices\[2\] = -7 is outside")


def test_live_index_outside_reserved_page_zero():
    _raises(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 2, 3], [4, 5, 3, 0]),
            match=r"kv_indices\[2\] = 3 .*reserved page 0")


def test_fill_entries_past_live_range_are_not_checked():
    _ok(lambda kv: checks.check_token_csr(kv, pool=POOL), csr([0, 1], [4, 999, -1]))


def test_lengths_within_max_context_len():
    _raises(lambda x: checks.check_lengths(x, "seq_lens", max_context_len=100),
            jnp.array([5, 101, 3]), match=r"seq_lens\[1\] = 101 is outside \[0, max_context_len=100\]")
    _raises(lambda x: checks.check_lengths(x, "seq_lens", max_context_len=100),
            jnp.array([5, 1, -3]), match=r"seq_lens\[2\] = -3")


def test_request_indices_inside_request_pool():
    _raises(lambda x: checks.check_request_indices(x, pool_size=8), jnp.array([0, 7, 8]),
            match=r"req_pool_indices\[2\] = 8 is outside the request pool \[0, 8\)")


def test_page_table_check():
    pt = PageTable(jnp.array([[1, 2, 0], [11, 0, 0]], jnp.int32), jnp.array([6, 2], jnp.int32), 4)
    _raises(lambda p: checks.check_page_table(p, pool=POOL, max_context_len=12), pt,
            match=r"page_table\[1, 0\] = 11 is outside the usable pages \[1, 10\]")
    pt = PageTable(jnp.array([[1, 2, 0], [0, 0, 0]], jnp.int32), jnp.array([6, 2], jnp.int32), 4)
    _raises(lambda p: checks.check_page_table(p, pool=POOL, max_context_len=12), pt,
            match=r"page_table\[1, 0\] = 0 .*page 0 is reserved")
    pt = PageTable(jnp.array([[1, 2, 3]], jnp.int32), jnp.array([13], jnp.int32), 4)
    _raises(lambda p: checks.check_page_table(p, pool=POOL, max_context_len=100), pt,
            match=r"page_table.lengths\[0\] = 13 is outside \[0, max_context_len=12\]")


def test_page_contiguity():
    good = csr([0, 6], [8, 9, 10, 11, 20, 21])
    _ok(lambda kv: checks.check_page_contiguity(kv, page_size=4), good)
    bad = csr([0, 6], [8, 9, 11, 10, 20, 21])
    _raises(lambda kv: checks.check_page_contiguity(kv, page_size=4), bad,
            match=r"kv_indices\[2\] = 11 breaks page contiguity at page_size 4")


def test_metadata_check_covers_queries_vs_keys():
    r2t = (jnp.arange(4 * 8, dtype=jnp.int32) + 4).reshape(4, 8)
    # built under a plain jit (no value checks), then checked: the metadata check still sees it
    build = jax.jit(lambda *a: extend_metadata(*a, capacity=8))
    meta = build(r2t, jnp.array([0, 1]), jnp.array([2, 3]), jnp.array([2, 4]))
    _raises(lambda m: checks.check_metadata(m, pool=POOL, max_context_len=8), meta,
            match=r"request 1 has 4 queries but only 3 keys")
    with pytest.raises(ValueError, match=r"extend_seq_lens\[1\] = 4, seq_lens\[1\] = 3"):
        extend_metadata(r2t, jnp.array([0, 1]), jnp.array([2, 3]), jnp.array([2, 4]), capacity=8)
    meta = decode_metadata(r2t, jnp.array([0, 1]), jnp.array([2, 3]), capacity=8)
    _ok(lambda m: checks.check_metadata(m, pool=POOL, max_context_len=8), meta)


@pytest.mark.parametrize("bad", [0, 3, 24, -4])
def test_page_size_power_of_two(bad):
    with pytest.raises(ValueError, match=f"page_size must be a power of two, got {bad}"):
        checks.check_page_size(bad)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        PoolSpec(4, bad)


@given(n=st.integers(0, 1 << 40), floor=st.sampled_from([1, 8, 16, 1024]))
def test_next_power_of_two(n, floor):
    """The smallest power of two >= n, at least floor: against 2 ** ceil(log2 n)."""
    want = max(floor, 2 ** math.ceil(math.log2(n)) if n > 1 else 1)
    assert next_power_of_two(n, floor) == want
    assert is_power_of_two(want) and not (want > floor and want // 2 >= n)


def test_static_checks_dtypes_shapes_and_layout():
    with pytest.raises(TypeError, match="kv.indices must be int32, got float32"):
        checks.check_token_csr_static(TokenCSR(jnp.array([0, 1], jnp.int32), jnp.array([1.0])))
    with pytest.raises(ValueError, match=r"kv.indptr must be 1-D, got shape \(1, 2\)"):
        checks.check_token_csr_static(TokenCSR(jnp.zeros((1, 2), jnp.int32), jnp.zeros(3, jnp.int32)))
    pt = PageTable(jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32), 4)
    with pytest.raises(TypeError, match=r"kv: expected a TokenCSR \(token-granular\), got PageTable \(page-granular\)"):
        checks.check_token_csr_static(pt)
    r2t = jnp.zeros((4, 8), jnp.int32)
    meta = decode_metadata(r2t, jnp.array([0, 1]), jnp.array([2, 3]), capacity=8)
    q = jnp.zeros((2, 4, 512))
    with pytest.raises(ValueError, match="must be 576 wide"):
        checks.check_attention_inputs_static(q, jnp.zeros((8, 576)), meta)
    with pytest.raises(TypeError, match="q must be a floating dtype"):
        checks.check_attention_inputs_static(jnp.zeros((2, 4, 576), jnp.int32), jnp.zeros((8, 576)), meta)


def test_index_checks_catch_out_of_bounds_gathers():
    """checkify's index checks (enabled by checks.checked) catch a raw OOB gather too."""
    _raises(lambda x, i: x[i], jnp.arange(4), jnp.array(7), match="out-of-bounds")
