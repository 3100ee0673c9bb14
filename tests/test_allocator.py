"""Tests of funcmla.allocator against a plain-Python restatement of SGLang's paged allocator."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from funcmla import allocator as A
from funcmla.allocator import AllocatorSpec
from funcmla.layout import PoolSpec

BATCH = 4  # static batch of every op in the state machine (padded rows are masked)


# --------------------------------------------------------------------------------------------
# the model: SGLang's PagedTokenToKVPoolAllocator without need_sort (free pages are a list,
# alloc takes from the front, free prepends sorted unique pages), plus per-page refcounts.


class ModelAllocator:
    def __init__(self, spec: AllocatorSpec):
        self.page_size = spec.page_size
        self.max_len = spec.max_context_len
        self.free = list(range(1, spec.num_pages + 1))
        self.ref = [0] * (spec.num_pages + 1)
        self.rows = [[] for _ in range(spec.num_req_slots)]

    def cdiv(self, x):
        return -(-x // self.page_size)

    def _precheck(self, reqs):
        """reqs: [(row, prefix_len, seq_len)] with seq > prefix == len(row)."""
        status = 0
        for r, p, _ in reqs:
            if p % self.page_size and self.ref[self.rows[r][p - 1] // self.page_size] > 1:
                status |= A.SHARED_PAGE_WRITE
        if sum(self.cdiv(s) - self.cdiv(p) for _, p, s in reqs) > len(self.free):
            status |= A.OUT_OF_PAGES
        return status

    def alloc_extend(self, reqs):
        """SGLang alloc_extend_naive: part 1 (old partial page), 2 (full pages), 3 (last)."""
        status = self._precheck(reqs)
        if status:
            return status, []
        page_size, k, out = self.page_size, 0, []
        for r, p, s in reqs:
            row = self.rows[r]
            last_loc = row[p - 1] if p else -1
            num1 = min(s, self.cdiv(p) * page_size) - p
            new = [last_loc + 1 + i for i in range(num1)]
            if p + num1 < s:
                num2 = (s // page_size - self.cdiv(p)) * page_size
                for _ in range(num2 // page_size):
                    new += [self.free[k] * page_size + i for i in range(page_size)]
                    k += 1
                if p + num1 + num2 < s:
                    new += [self.free[k] * page_size + i for i in range(s % page_size)]
                    k += 1
            row.extend(new)
            out.extend(new)
        for page in self.free[:k]:
            self.ref[page] = 1
        del self.free[:k]
        return 0, out

    def alloc_decode(self, reqs):
        """SGLang alloc_decode: last_loc + 1, or the first slot of the next free page."""
        status = self._precheck([(r, s - 1, s) for r, s in reqs])
        if status:
            return status, []
        k, out = 0, []
        for r, s in reqs:
            row = self.rows[r]
            if self.cdiv(s) == self.cdiv(s - 1):
                slot = row[s - 2] + 1
            else:
                slot = self.free[k] * self.page_size
                self.ref[self.free[k]] = 1
                k += 1
            row.append(slot)
            out.append(slot)
        del self.free[:k]
        return 0, out

    def truncate(self, reqs):
        released = set()
        for r, n in reqs:
            row = self.rows[r]
            for p in range(self.cdiv(n), self.cdiv(len(row))):
                page = row[p * self.page_size] // self.page_size
                self.ref[page] -= 1
                if self.ref[page] == 0:
                    released.add(page)
            del row[n:]
        self.free = sorted(released) + self.free

    def share(self, reqs):
        for src, dst, n in reqs:
            self.rows[dst] = list(self.rows[src][:n])
            for p in range(n // self.page_size):
                self.ref[self.rows[src][p * self.page_size] // self.page_size] += 1


# --------------------------------------------------------------------------------------------
# checks on a host copy of the state


def host(state):
    return jax.tree_util.tree_map(np.asarray, state)


def check_invariants(st_: A.AllocatorState):
    """Model-independent invariants of an allocator state (numpy arrays)."""
    page_size, n_pages = st_.page_size, st_.free_pages.shape[0]
    num_free = int(st_.num_free)
    free = st_.free_pages[:num_free]
    assert 0 <= num_free <= n_pages
    assert np.all(st_.free_pages[num_free:] == 0), "stack tail must be zero"
    assert np.all((free >= 1) & (free <= n_pages)), f"bad free page ids {free}"
    assert len(np.unique(free)) == num_free, "a page is free twice"
    refs = np.zeros(n_pages + 1, np.int64)
    for r, n in enumerate(st_.req_lens):
        row = st_.req_to_token[r]
        assert np.all(row[n:] == 0), f"row {r}: entries past req_len must be 0"
        if n == 0:
            continue
        t = np.arange(n)
        # page of each token, read from its page's first slot
        pages = row[t - t % page_size] // page_size
        assert np.all(row[:n] == pages * page_size + t % page_size), f"row {r}: contiguity broken"
        row_pages = pages[::page_size]
        assert np.all(row_pages >= 1), f"row {r}: holds the reserved page 0"
        assert len(np.unique(row_pages)) == len(row_pages), f"row {r}: page used twice"
        np.add.at(refs, row_pages, 1)
    np.testing.assert_array_equal(st_.page_refcount, refs, err_msg="refcount != holders")
    assert refs[0] == 0
    in_use = np.flatnonzero(refs)
    assert not np.intersect1d(in_use, free).size, "a page is both free and in use"
    assert num_free + len(in_use) == n_pages, "free + in use != num_pages"


def assert_matches_model(st_, model: ModelAllocator):
    num_free = int(st_.num_free)
    assert st_.free_pages[:num_free][::-1].tolist() == model.free, "free-list order"
    assert st_.page_refcount.tolist() == model.ref
    assert st_.req_lens.tolist() == [len(r) for r in model.rows]
    for r, row in enumerate(model.rows):
        assert st_.req_to_token[r, : len(row)].tolist() == row, f"row {r}"


# --------------------------------------------------------------------------------------------
# hand-computed examples


def small(page_size=4, num_pages=8, rows=4, max_len=32):
    return A.init_allocator(AllocatorSpec(num_pages, page_size, rows, max_len))


def test_module_docstring_example():
    failed, tried = doctest.testmod(A, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried > 0 and failed == 0


def test_init_state():
    s = host(small())
    assert s.free_pages.tolist() == [8, 7, 6, 5, 4, 3, 2, 1]  # page 1 on top
    assert int(s.num_free) == 8 and s.page_refcount.tolist() == [0] * 9
    assert s.req_to_token.shape == (4, 32) and s.req_to_token.dtype == np.int32


def test_extend_three_parts_by_hand():
    s = small()
    r = A.alloc_extend(s, jnp.array([2]), jnp.array([0]), jnp.array([6]), capacity=16)
    assert int(r.status) == 0 and int(r.num_tokens) == 6
    assert r.out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9] + [0] * 10  # pages 1, 2
    # prefix 6 -> 17: part 1 fills slots 10, 11 of page 2; part 2 pages 3, 4; part 3 page 5
    r = A.alloc_extend(r.state, jnp.array([2]), jnp.array([6]), jnp.array([17]), capacity=16)
    assert int(r.status) == 0 and int(r.num_tokens) == 11
    assert r.out_cache_loc[:11].tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    s = host(r.state)
    assert s.req_to_token[2, :18].tolist() == list(range(4, 21)) + [0]
    assert int(s.req_lens[2]) == 17 and int(s.num_free) == 3
    check_invariants(s)


def test_decode_by_hand():
    s = small()
    s = A.alloc_extend(s, jnp.array([0, 1]), jnp.array([0, 0]), jnp.array([3, 4]), capacity=8).state
    # row 0 continues page 1 (slot 7); row 1 is page-aligned and starts page 3 (slot 12)
    valid = jnp.array([True, True, False])
    r = A.alloc_decode(s, jnp.array([0, 1, 3]), jnp.array([4, 5, 99]), valid)
    assert int(r.status) == 0 and r.out_cache_loc.tolist() == [7, 12, 0]
    assert int(r.num_tokens) == 2
    check_invariants(host(r.state))


def test_free_order_and_shared_prefix_refcount():
    s = small()
    s = A.alloc_extend(s, jnp.array([0]), jnp.array([0]), jnp.array([10]), capacity=16).state
    u = A.share_prefix(s, jnp.array([0]), jnp.array([1]), jnp.array([8]))
    assert int(u.status) == 0
    h = host(u.state)
    assert h.req_to_token[1, :9].tolist() == list(range(4, 12)) + [0]
    assert h.page_refcount[:4].tolist() == [0, 2, 2, 1]
    # freeing the source keeps the shared pages 1, 2 and frees page 3 only
    u = A.free_requests(u.state, jnp.array([0]))
    h = host(u.state)
    assert int(u.status) == 0 and int(h.num_free) == 6 and h.free_pages[5] == 3
    # freeing the sharer returns 1, 2 with 1 on top: handed out next, in ascending order
    u = A.free_requests(u.state, jnp.array([1]))
    h = host(u.state)
    assert h.free_pages.tolist() == [8, 7, 6, 5, 4, 3, 2, 1]
    check_invariants(h)


def test_padding_writes_reserved_slot_and_full_pool_reusable():
    spec = AllocatorSpec(num_pages=4, page_size=16, num_req_slots=2, max_context_len=64)
    s = A.init_allocator(spec)
    for _ in range(3):  # fill the whole pool, free it, repeat: every page comes back
        r = A.alloc_extend(s, jnp.array([1, 0]), jnp.array([0, 0]), jnp.array([64, 0]), capacity=80)
        assert int(r.status) == 0 and int(r.num_tokens) == 64
        assert sorted(r.out_cache_loc[:64].tolist()) == list(range(16, 80))
        assert r.out_cache_loc[64:].tolist() == [0] * 16
        assert int(A.num_free_pages(r.state)) == 0 and int(A.pages_in_use(r.state)) == 4
        s = A.free_requests(r.state, jnp.array([1])).state
        assert int(A.num_free_pages(s)) == 4


# --------------------------------------------------------------------------------------------
# failures are values, and leave the state unchanged


def _assert_same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def busy():
    s = small()
    s = _ext([0, 1], [0, 0], [9, 8])(s).state
    return A.share_prefix(s, jnp.array([1]), jnp.array([2]), jnp.array([8])).state  # 5 free


def _a(*xs):
    return [jnp.array(x, jnp.int32) for x in xs]


def _ext(rows, pre, seq, capacity=32):
    return lambda s: A.alloc_extend(s, *_a(rows, pre, seq), capacity=capacity)


def _dec(rows, seq):
    return lambda s: A.alloc_decode(s, *_a(rows, seq))


def _share(src, dst, n):
    return lambda s: A.share_prefix(s, *_a(src, dst, n))


# name -> (op on the `busy` state, the exact expected status)
CASES = {
    "oom": (_ext([3], [0], [21]), A.OUT_OF_PAGES),
    "oom_decode": (None, A.OUT_OF_PAGES),
    "prefix_mismatch": (_ext([0], [8], [10]), A.BAD_LENGTH),
    "seq_lt_prefix": (_ext([0], [9], [5]), A.BAD_LENGTH),
    "too_long": (_ext([3], [0], [33], 40), A.BAD_LENGTH | A.OUT_OF_PAGES),
    "over_capacity": (_ext([3], [0], [5], 4), A.OVER_CAPACITY),
    "row_out_of_range": (_ext([4], [0], [2], 4), A.BAD_REQUEST_INDEX),
    "row_repeated": (_dec([0, 0], [10, 10]), A.BAD_REQUEST_INDEX),
    "decode_len": (_dec([0], [9]), A.BAD_LENGTH),
    "shared_page_write": (None, A.SHARED_PAGE_WRITE),
    "truncate_grow": (lambda s: A.truncate_requests(s, *_a([0], [10])), A.BAD_LENGTH),
    "truncate_negative_row": (lambda s: A.free_requests(s, *_a([-1])), A.BAD_REQUEST_INDEX),
    "share_unaligned": (_share([0], [3], [6]), A.BAD_LENGTH),
    "share_too_long": (_share([1], [3], [12]), A.BAD_LENGTH),
    "share_dst_busy": (_share([0], [1], [4]), A.BAD_LENGTH),
    "share_self": (_share([0], [0], [4]), A.BAD_REQUEST_INDEX | A.BAD_LENGTH),
}


def _exhaust_then_decode(s):
    s = A.alloc_extend(s, jnp.array([3]), jnp.array([0]), jnp.array([12]), capacity=32).state
    assert int(A.num_free_pages(s)) == 0
    return s, A.alloc_decode(s, jnp.array([1]), jnp.array([9]))  # row 1 is page-aligned


def _shared_page_write(s):
    s = A.truncate_requests(s, jnp.array([2]), jnp.array([6])).state  # row 2 now ends mid page 4
    return s, A.alloc_decode(s, jnp.array([2]), jnp.array([7]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_failure_is_reported_and_state_unchanged(busy, case):
    fn, bit = CASES[case]  # bit: the exact expected status
    if case == "oom_decode":
        before, res = _exhaust_then_decode(busy)
    elif case == "shared_page_write":
        before, res = _shared_page_write(busy)
    else:
        before, res = busy, fn(busy)
    assert int(res.status) == bit, (case, A.status_names(res.status))
    assert not bool(res.ok)
    if isinstance(res, A.AllocResult):
        assert bool(res.oom) == bool(bit & A.OUT_OF_PAGES)
    _assert_same(res.state, before)
    if hasattr(res, "out_cache_loc"):
        assert not np.any(np.asarray(res.out_cache_loc)), "failed alloc must hand out nothing"
    with pytest.raises(A.AllocatorError, match=A.status_names(bit)[0]):
        A.raise_for_status(res, case)


def test_padded_rows_are_ignored(busy):
    """Invalid rows may carry garbage (out-of-range rows, wrong lengths): they are masked."""
    r = A.alloc_extend(
        busy, jnp.array([3, 99, 0]), jnp.array([0, -5, 0]), jnp.array([4, 1000, 3]),
        jnp.array([True, False, False]), capacity=8,
    )
    assert int(r.status) == 0 and int(r.num_tokens) == 4
    d = A.alloc_decode(r.state, jnp.array([-7, 3]), jnp.array([0, 5]), jnp.array([False, True]))
    assert int(d.status) == 0 and int(d.out_cache_loc[0]) == 0
    check_invariants(host(d.state))


def _spec(**kw):
    return {**dict(num_pages=4, page_size=4, num_req_slots=1, max_context_len=8), **kw}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (_spec(num_pages=0), "num_pages must be a positive int, got 0"),
        (_spec(page_size=12), "page_size must be a power of two, got 12"),
        (_spec(num_req_slots=-1), "num_req_slots must be a positive int, got -1"),
        (_spec(max_context_len=2.0), "max_context_len must be a positive int, got 2.0"),
        (_spec(num_pages=2**28, page_size=64), "overflows int32"),
    ],
)
def test_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AllocatorSpec(**kwargs)


def test_spec_from_pool():
    spec = AllocatorSpec.for_pool(PoolSpec(num_pages=6, page_size=16), num_req_slots=2,
                                  max_context_len=64)
    assert spec == AllocatorSpec(6, 16, 2, 64) and spec.pool.num_slots == 7 * 16
    with pytest.raises(TypeError, match="pool must be a PoolSpec"):
        AllocatorSpec.for_pool((6, 16), num_req_slots=2, max_context_len=64)


def test_argument_validation():
    s = small()
    with pytest.raises(TypeError, match="spec must be an AllocatorSpec"):
        A.init_allocator(8)
    with pytest.raises(ValueError, match="capacity must be a positive int, got 0"):
        A.alloc_extend(s, jnp.array([0]), jnp.array([0]), jnp.array([1]), capacity=0)
    with pytest.raises(ValueError, match="disagree in shape"):
        A.alloc_decode(s, jnp.array([0, 1]), jnp.array([1]))
    with pytest.raises(ValueError, match="valid must be bool"):
        A.alloc_decode(s, jnp.array([0]), jnp.array([1]), jnp.array([1]))
    with pytest.raises(ValueError, match="must be rank 1"):
        A.truncate_requests(s, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="B >= 1"):
        A.alloc_decode(s, jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))
    with pytest.raises(TypeError, match="integer array"):
        A.share_prefix(s, jnp.array([0.0]), jnp.array([1]), jnp.array([0]))


# --------------------------------------------------------------------------------------------
# random operation sequences, checked op by op against the model


SPECS = {  # small pools so that out-of-memory is frequent
    1: AllocatorSpec(num_pages=48, page_size=1, num_req_slots=6, max_context_len=40),
    16: AllocatorSpec(num_pages=14, page_size=16, num_req_slots=6, max_context_len=128),
    64: AllocatorSpec(num_pages=7, page_size=64, num_req_slots=6, max_context_len=256),
}


class AllocatorMachine(RuleBasedStateMachine):
    spec: AllocatorSpec = None  # set by the per-page-size subclasses
    ops = 0  # operations run, across every example (per page-size subclass)

    def __init__(self):
        super().__init__()
        self.state = A.init_allocator(self.spec)
        self.model = ModelAllocator(self.spec)
        self.page_size = self.spec.page_size
        self.rows = self.spec.num_req_slots
        self.max_len = self.spec.max_context_len

    # ---- helpers
    def _lens(self):
        return [len(r) for r in self.model.rows]

    def _pad(self, *cols, n_valid):
        """Pad per-request columns to BATCH with garbage rows, masked by `valid`."""
        fill = [self.rows + 7, -3, 10**6]
        pad = BATCH - n_valid
        out = [np.array(list(c) + [fill[i % 3]] * pad, np.int32) for i, c in enumerate(cols)]
        valid = np.arange(BATCH) < n_valid
        return [jnp.asarray(c) for c in out] + [jnp.asarray(valid)]

    def _apply(self, res, expected_status):
        type(self).ops += 1
        assert int(res.status) == expected_status, (
            A.status_names(res.status), A.status_names(expected_status))
        self.state = res.state

    def _draw_rows(self, data, candidates=None):
        candidates = range(self.rows) if candidates is None else candidates
        return data.draw(
            st.lists(st.sampled_from(candidates), min_size=1, max_size=BATCH, unique=True)
        )

    # ---- rules
    @rule(data=st.data())
    def extend(self, data):
        rows = self._draw_rows(data)
        lens = self._lens()
        hi = [min(self.max_len, lens[r] + 3 * self.page_size + 3) for r in rows]
        seqs = [data.draw(st.integers(lens[r], h)) for r, h in zip(rows, hi)]
        reqs = [(r, lens[r], s) for r, s in zip(rows, seqs) if s > lens[r]]
        status, out = self.model.alloc_extend(reqs)
        args = self._pad(rows, [lens[r] for r in rows], seqs, n_valid=len(rows))
        res = A.alloc_extend(self.state, *args, capacity=BATCH * self.max_len)
        self._apply(res, status)
        n = len(out) if status == 0 else 0
        assert int(res.num_tokens) == sum(s - p for _, p, s in reqs)
        loc = np.asarray(res.out_cache_loc)  # slice on the host: no compile per n
        assert loc[:n].tolist() == out
        assert not np.any(loc[n:])

    @rule(data=st.data())
    def decode(self, data):
        lens = self._lens()
        cand = [r for r in range(self.rows) if lens[r] < self.max_len]
        if not cand:
            return
        rows = self._draw_rows(data, cand)
        reqs = [(r, lens[r] + 1) for r in rows]
        status, out = self.model.alloc_decode(reqs)
        res = A.alloc_decode(self.state, *self._pad(rows, [s for _, s in reqs], n_valid=len(rows)))
        self._apply(res, status)
        expect = out if status == 0 else [0] * len(rows)
        assert np.asarray(res.out_cache_loc).tolist() == expect + [0] * (BATCH - len(rows))

    @rule(data=st.data())
    def share(self, data):
        lens = self._lens()
        srcs = [r for r in range(self.rows) if lens[r] >= self.page_size]
        dsts = [r for r in range(self.rows) if lens[r] == 0]
        if not srcs or not dsts:
            return
        dst = self._draw_rows(data, dsts)
        reqs = []
        for d in dst:
            s = data.draw(st.sampled_from(srcs))
            n_pages = data.draw(st.integers(1, lens[s] // self.page_size))
            reqs.append((s, d, self.page_size * n_pages))
        self.model.share(reqs)
        res = A.share_prefix(self.state, *self._pad(*zip(*reqs), n_valid=len(reqs)))
        self._apply(res, 0)

    @rule(data=st.data(), to_zero=st.booleans())
    def truncate(self, data, to_zero):
        lens = self._lens()
        rows = self._draw_rows(data)
        new = [0 if to_zero else data.draw(st.integers(0, lens[r])) for r in rows]
        self.model.truncate(list(zip(rows, new)))
        if to_zero:
            res = A.free_requests(self.state, *self._pad(rows, n_valid=len(rows)))
        else:
            res = A.truncate_requests(self.state, *self._pad(rows, new, n_valid=len(rows)))
        self._apply(res, 0)

    @rule(data=st.data())
    def invalid(self, data):
        """An op with bad input: reported, and nothing changes (the model is not touched)."""
        lens = self._lens()
        r = data.draw(st.integers(0, self.rows - 1))
        kinds = ["prefix", "too_long", "repeat", "decode", "grow", "dst_busy"]
        kind = data.draw(st.sampled_from(kinds))
        cap = BATCH * self.max_len
        if kind == "prefix":
            args = self._pad([r], [lens[r] + 1], [lens[r] + 2], n_valid=1)
            res = A.alloc_extend(self.state, *args, capacity=cap)
        elif kind == "too_long":
            args = self._pad([r], [lens[r]], [self.max_len + 1], n_valid=1)
            res = A.alloc_extend(self.state, *args, capacity=cap)
        elif kind == "repeat":
            res = A.alloc_decode(self.state, *self._pad([r, r], [lens[r] + 1] * 2, n_valid=2))
        elif kind == "decode":
            res = A.alloc_decode(self.state, *self._pad([r], [lens[r] + 2], n_valid=1))
        elif kind == "grow":
            res = A.truncate_requests(self.state, *self._pad([r], [lens[r] + 1], n_valid=1))
        else:
            busy = [d for d in range(self.rows) if lens[d] > 0 and d != r]
            if lens[r] < self.page_size or not busy:
                return
            res = A.share_prefix(self.state,
                                 *self._pad([r], [busy[0]], [self.page_size], n_valid=1))
        type(self).ops += 1
        status = int(res.status)
        assert status != 0 and status & (A.BAD_LENGTH | A.BAD_REQUEST_INDEX), (kind, status)
        _assert_same(res.state, self.state)

    @invariant()
    def consistent(self):
        h = host(self.state)
        check_invariants(h)
        assert_matches_model(h, self.model)


def _machine_test(page_size, ops_per_example=16):
    """Each example runs up to 50 ops; the profile sets the example count (20 under `ci`, 60
    under `dev`), and at least `ops_per_example` ops per example must have run."""
    machine = type(f"Machine{page_size}", (AllocatorMachine,), {"spec": SPECS[page_size], "ops": 0})
    examples = settings.default.max_examples
    min_ops = ops_per_example * examples
    case = settings(max_examples=examples, stateful_step_count=50, deadline=None)(machine).TestCase

    class Case(case):
        @classmethod
        def tearDownClass(cls):  # the sequences really ran (and were not all trivially short)
            super().tearDownClass()
            assert machine.ops >= min_ops, f"page_size={page_size}: only {machine.ops} ops ran"

    return Case


TestAllocatorPs1 = _machine_test(1)
TestAllocatorPs16 = _machine_test(16)
TestAllocatorPs64 = _machine_test(64)
