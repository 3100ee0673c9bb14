"""Fuzz: random and adversarial batches (out-of-range rows, negative and too long lengths,
negative starts, totals past the buffer, NaN/Inf in reserved and unused pool rows) through the
request-table gather, the decode metadata and the reference attention, against a NumPy model.

For each batch: an eager call (values checked) must raise ValueError exactly when the model
says the batch is invalid, and otherwise equal the model; an unchecked jitted call must equal
the model's out-of-bounds-safe semantics (an out-of-range read yields the fill slot, nothing
wraps) whatever the batch; the attention output must equal a float64 NumPy attention and stay
finite whatever the unused rows hold. `HYPOTHESIS_PROFILE=dev` (or `fuzz`) runs 10^4 batches,
CI's `ci` profile 150.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.reference import mla_attention_reference
from funcmla.indices import FILL_SLOT, gather_token_indices
from funcmla.metadata import decode_metadata

ROWS, COLS = 5, 12  # request table: 5 rows, max_context_len 12
PAGE = 4  # reserved page 0 = slots [0, 4)
SLOTS = PAGE + ROWS * COLS + 8  # usable slots, plus 8 rows no request ever uses
CAPACITY = 24
D, DV, H, SCALE = 8, 4, 2, 0.3
EXAMPLES = {"dev": 10_000, "fuzz": 10_000}.get(os.environ.get("HYPOTHESIS_PROFILE", "ci"), 150)
POISON = st.sampled_from([np.nan, np.inf, -np.inf, 3e38])

_gather_jit = jax.jit(lambda r, i, n, s: gather_token_indices(r, i, n, s, capacity=CAPACITY))


@st.composite
def batches(draw):
    batch = draw(st.sampled_from([1, 4]))  # two shapes: one compile each, every path covered
    adversarial = draw(st.booleans())
    lo_r, hi_r = (-2, ROWS + 1) if adversarial else (0, ROWS - 1)
    lo_n, hi_n = (-3, COLS + 3) if adversarial else (0, COLS)
    rpi = draw(st.lists(st.integers(lo_r, hi_r), min_size=batch, max_size=batch))
    lens = draw(st.lists(st.integers(lo_n, hi_n), min_size=batch, max_size=batch))
    start = draw(st.lists(st.integers(-3 if adversarial else 0, COLS), min_size=batch,
                          max_size=batch))
    # the request table: a permutation of the usable slots (every row of slots distinct)
    table = draw(st.permutations(range(PAGE, PAGE + ROWS * COLS)))
    return (np.array(rpi, np.int32), np.array(lens, np.int32), np.array(start, np.int32),
            np.array(table, np.int32).reshape(ROWS, COLS))


def model_gather(r2t, rpi, lens, start):
    """(valid, indptr, indices): the checked verdict, and the unchecked semantics (dropped past
    capacity; a read outside the table, negative positions included, gives FILL_SLOT)."""
    total = int(np.clip(lens, 0, None).sum())
    valid = bool(np.all((rpi >= 0) & (rpi < ROWS)) and np.all(lens >= 0) and np.all(start >= 0)
                 and np.all(start + lens <= COLS) and total <= CAPACITY)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    out = np.full(CAPACITY, FILL_SLOT, np.int64)
    for i, (r, n, s) in enumerate(zip(rpi, lens, start)):
        for j in range(max(int(n), 0)):
            t = indptr[i] + j
            if not 0 <= t < CAPACITY or indptr[i + 1] <= t:
                continue
            c = s + j
            out[t] = r2t[r, c] if (0 <= r < ROWS and 0 <= c < COLS) else FILL_SLOT
    # positions past indptr[-1] are fill; with a negative length the segments overlap, which
    # only the unchecked path sees: compare it where the model is unambiguous
    return valid, indptr, out


def model_attention(q, pool, lens_list, slots_list):
    """float64 softmax(q k^T * scale) v per request (decode: one query sees all its keys)."""
    out = np.zeros((len(lens_list), H, DV))
    for b, slots in enumerate(slots_list):
        if len(slots) == 0:
            continue
        k = pool[slots].astype(np.float64)
        s = np.einsum("hd,sd->hs", q[b].astype(np.float64), k) * SCALE
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b] = (p / p.sum(axis=-1, keepdims=True)) @ k[:, :DV]
    return out


@settings(max_examples=EXAMPLES)
@given(batches(), POISON, POISON, st.integers(-4, 4))
def test_no_silent_wrong_output(batch, poison_reserved, poison_unused, q_shift):
    rpi, lens, start, r2t = batch
    valid, indptr, want = model_gather(r2t, rpi, lens, start)

    # eager: checked; raises exactly for the invalid batches, else equals the model
    try:
        csr = gather_token_indices(r2t, rpi, lens, start, capacity=CAPACITY)
    except ValueError:
        assert not valid, "a valid batch was refused"
    else:
        assert valid, "an invalid batch passed the checks"
        np.testing.assert_array_equal(np.asarray(csr.indptr), indptr)
        np.testing.assert_array_equal(np.asarray(csr.indices), want)

    # unchecked jit: never an out-of-bounds or wrapped read, whatever the batch
    if np.all(lens >= 0) and int(lens.sum()) < 2**31:
        got = _gather_jit(r2t, rpi, lens, start)
        np.testing.assert_array_equal(np.asarray(got.indices), want)
        assert set(np.asarray(got.indices).tolist()) <= set(r2t.ravel().tolist()) | {FILL_SLOT}

    if not valid or int(lens.sum()) == 0 or np.any(start):
        return
    # decode metadata + reference attention over a pool whose reserved page and unused rows
    # hold poison: masked positions must contribute exactly zero
    meta = decode_metadata(r2t, rpi, lens, capacity=CAPACITY)
    np.testing.assert_array_equal(np.asarray(meta.kv_indices), want)
    live = want[: int(indptr[-1])]
    pool = np.full((SLOTS, D), poison_unused, np.float32)
    pool[:PAGE] = poison_reserved
    pool[live] = np.cos(np.arange(len(live) * D, dtype=np.float32) * 0.7 + q_shift).reshape(-1, D)
    q = np.sin(np.arange(len(lens) * H * D, dtype=np.float32) * 0.3 - q_shift).reshape(-1, H, D)
    out, lse = mla_attention_reference(
        jnp.asarray(q), jnp.asarray(pool), meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
        sm_scale=SCALE, v_head_dim=DV, max_kv_len=COLS)
    slots = [want[indptr[i]: indptr[i + 1]] for i in range(len(lens))]
    ref = model_attention(q, pool, lens, slots)
    out = np.asarray(out)
    assert np.all(np.isfinite(out)), "poison from an unused or reserved row reached the output"
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    empty = lens == 0
    assert np.all(out[empty] == 0) and np.all(np.isinf(np.asarray(lse)[empty]))
