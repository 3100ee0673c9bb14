"""Index expansion vs plain-loop restatements, and page-size invariance of the index stream."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from funcmla.indices import (
    FILL_SLOT,
    gather_token_indices,
    kv_last_page_len,
    page_table_from_csr,
    page_table_from_token_slots,
    token_slots_from_page_table,
)
from funcmla.layout import PageTable, TokenCSR
from funcmla.segments import segment_positions
from tests.pools import gather_oracle, layout_requests

MAX_CTX = 16384


@functools.partial(jax.jit, static_argnames=("capacity",))
def _gather(r2t, rpi, lens, start, *, capacity):
    return gather_token_indices(r2t, rpi, lens, start, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages", "capacity"))
def _roundtrip(r2t, rpi, lens, *, page_size, max_pages, capacity):
    pt = page_table_from_token_slots(r2t, rpi, lens, page_size=page_size, max_pages=max_pages)
    return pt, token_slots_from_page_table(pt, capacity=capacity)


def lengths_strategy(max_batch=256, max_len=MAX_CTX, max_total=1 << 16):
    """Mostly short sequences, some long, some empty; total bounded to keep the test fast."""
    one = st.one_of(st.integers(0, 40), st.integers(0, max_len), st.just(0))
    return st.lists(one, min_size=1, max_size=max_batch).map(
        lambda ls: [min(x, max(0, max_total // len(ls))) if sum(ls) > max_total else x for x in ls]
    )


def _padded(lens, rng, page_size, max_batch):
    """Lay out on max_batch + 2 request slots, then pad the batch to max_batch with zero-length
    rows on request slot 0: every example of a test has the same shapes (one compilation per
    static argument set, not one per drawn batch size)."""
    r2t, rpi, num_pages, owner = layout_requests(lens, page_size, rng=rng, max_context_len=MAX_CTX,
                                                 num_req_slots=max_batch + 2)
    lens_p = np.zeros(max_batch, np.int32)
    lens_p[: len(lens)] = lens
    rpi_p = np.zeros(max_batch, np.int32)
    rpi_p[: len(lens)] = rpi
    return r2t, rpi_p, lens_p, owner


@given(lens=lengths_strategy(), page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 9))
def test_gather_matches_loop_oracle(lens, page_size, seed):
    rng = np.random.default_rng(seed)
    r2t, rpi, lens_p, _ = _padded(lens, rng, page_size, 256)
    cap = 1 << 17  # > max_total = 1 << 16 live tokens
    start = np.zeros_like(lens_p)
    csr = _gather(r2t, rpi, lens_p, start, capacity=cap)
    indptr, ref = gather_oracle(r2t, rpi, lens_p)
    np.testing.assert_array_equal(np.asarray(csr.indptr), indptr)
    got = np.asarray(csr.indices)
    np.testing.assert_array_equal(got[: indptr[-1]], ref)
    assert np.all(got[indptr[-1] :] == FILL_SLOT)


@given(lens=lengths_strategy(max_batch=32, max_total=1 << 14), seed=st.integers(0, 9))
def test_same_sequences_same_stream_across_page_sizes(lens, seed):
    """Page sizes 1, 16, 64: identical index streams up to slot renaming (same (req, pos))."""
    cap = 1 << 15  # > max_total
    streams = []
    for page_size in (1, 16, 64):
        rng = np.random.default_rng(seed + page_size)
        r2t, rpi, lens_p, owner = _padded(lens, rng, page_size, 32)
        csr = _gather(r2t, rpi, lens_p, np.zeros_like(lens_p), capacity=cap)
        indptr = np.asarray(csr.indptr)
        idx = np.asarray(csr.indices)[: indptr[-1]]
        streams.append((indptr, owner[idx]))
    for indptr, logical in streams[1:]:
        np.testing.assert_array_equal(indptr, streams[0][0])
        np.testing.assert_array_equal(logical, streams[0][1])
    # and the logical stream is exactly (request i, position t) in CSR order
    expect = np.concatenate(
        [np.stack([np.full(n, i), np.arange(n)], 1) for i, n in enumerate(lens)] + [np.zeros((0, 2))]
    )
    np.testing.assert_array_equal(streams[0][1], expect)


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages"))
def _page_table_from_csr(csr, *, page_size, max_pages):
    return page_table_from_csr(csr, page_size=page_size, max_pages=max_pages)


@given(lens=lengths_strategy(max_batch=64, max_total=1 << 14), page_size=st.sampled_from([1, 16, 64]),
       seed=st.integers(0, 9))
def test_page_table_roundtrip(lens, page_size, seed):
    rng = np.random.default_rng(seed)
    r2t, rpi, lens_p, _ = _padded(lens, rng, page_size, 64)
    cap = 1 << 15  # > max_total
    max_pages = MAX_CTX // page_size
    pt, csr = _roundtrip(r2t, rpi, lens_p, page_size=page_size, max_pages=max_pages, capacity=cap)
    # page table == slot // page_size at page starts (create_flashmla_kv_indices semantics), 0
    # elsewhere
    table = np.asarray(pt.table)
    for i, n in enumerate(lens_p):
        npg = -(-n // page_size)
        np.testing.assert_array_equal(table[i, :npg], r2t[rpi[i], : npg * page_size : page_size] // page_size)
        assert np.all(table[i, npg:] == 0)
    indptr, ref = gather_oracle(r2t, rpi, lens_p)
    np.testing.assert_array_equal(np.asarray(csr.indices)[: indptr[-1]], ref)
    # csr -> page table gives the same table
    pt2 = _page_table_from_csr(csr, page_size=page_size, max_pages=max_pages)
    np.testing.assert_array_equal(np.asarray(pt2.table), table)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kv_last_page_len_formula(page_size):
    lens = np.array([0, 1, page_size - 1 or 1, page_size, page_size + 1, 3 * page_size, 1000])
    got = np.asarray(kv_last_page_len(jnp.asarray(lens, jnp.int32), page_size=page_size))
    ref = [0 if n == 0 else (n - 1) % page_size + 1 for n in lens]
    np.testing.assert_array_equal(got, ref)
    pt = PageTable(jnp.zeros((len(lens), 20), jnp.int32), jnp.asarray(lens, jnp.int32), page_size)
    np.testing.assert_array_equal(np.asarray(pt.kv_last_page_len), ref)


def test_kv_start_offsets_the_gather():
    r2t = np.arange(3 * 10, dtype=np.int32).reshape(3, 10) + 100
    csr = gather_token_indices(jnp.asarray(r2t), jnp.array([2, 1]), jnp.array([3, 2]),
                               jnp.array([4, 0]), capacity=8)
    np.testing.assert_array_equal(np.asarray(csr.indices), [124, 125, 126, 110, 111, 0, 0, 0])


def test_overflow_never_writes_past_capacity():
    """Unchecked under jit the overflow is dropped; eager (checked) it raises."""
    r2t = jnp.arange(2 * 10, dtype=jnp.int32).reshape(2, 10) + 100
    with pytest.raises(ValueError, match=r"sum\(kv_lens\) = 12 live tokens exceed the buffer capacity 8"):
        gather_token_indices(r2t, jnp.array([0, 1]), jnp.array([6, 6]), capacity=8)
    csr = jax.jit(lambda *a: gather_token_indices(*a, capacity=8))(
        r2t, jnp.array([0, 1]), jnp.array([6, 6]))
    assert csr.indices.shape == (8,)
    assert int(csr.indptr[-1]) == 12  # live count says 12 > 8; funcmla.checks reports it
    np.testing.assert_array_equal(np.asarray(csr.indices), [100, 101, 102, 103, 104, 105, 110, 111])


def test_layout_types_are_not_interchangeable():
    csr = TokenCSR(jnp.array([0, 2], jnp.int32), jnp.array([5, 6], jnp.int32))
    pt = PageTable(jnp.array([[1]], jnp.int32), jnp.array([2], jnp.int32), 4)
    with pytest.raises(TypeError, match="expected a PageTable"):
        jax.jit(lambda c: token_slots_from_page_table(c, capacity=4))(csr)
    with pytest.raises(TypeError, match="expected a TokenCSR"):
        jax.jit(lambda p: page_table_from_csr(p, page_size=4, max_pages=2))(pt)


@pytest.mark.parametrize("bad", [0, 3, 48, -16, 2.0])
def test_page_size_must_be_power_of_two(bad):
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        kv_last_page_len(jnp.array([1], jnp.int32), page_size=bad)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        PageTable(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), bad)


_segment_positions = jax.jit(segment_positions, static_argnums=1)


@given(lens=st.lists(st.integers(0, 5), min_size=6, max_size=6))
def test_segment_positions_against_loops(lens):
    """(row, offset, live) of each of 32 positions against plain loops over the rows (one
    compilation: 6 rows, 32 positions)."""
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    row, off, live = (np.asarray(x) for x in _segment_positions(jnp.asarray(indptr), 32))
    want = [(i, t) for i, n in enumerate(lens) for t in range(n)]
    assert live.tolist() == [True] * len(want) + [False] * (32 - len(want))
    assert list(zip(row[:len(want)].tolist(), off[:len(want)].tolist())) == want
    assert np.all((row >= 0) & (row < len(lens)))  # in bounds for gathers, dead ones too
