"""Masked positions contribute exactly zero, whatever the pool's unused rows hold.

Slot 0 (page 0, where padded table entries and padded tokens point) and every row no sequence
uses hold NaN, +Inf or -Inf. The Triton-lowered kernel (interpret mode) and the split merge must
then give output bitwise equal to the same call on a clean pool (unused rows finite), and that
output must match the float32 reference `mla_attention_reference` run on the clean pool. Token
CSR (page size 1) and page tables (16, 64), one split and several (with an empty split: a
sequence shorter than the split count's tiles), s_q 1-3. The Mosaic GPU kernel's interpret
tests (`tests/test_pallas_decode_mgpu.py`: `CPU_CASES`, the page-1 dispatch test) poison
unused rows the same way, one interpreted run per case.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from funcmla.attention.pallas import DecodeKernelConfig, mla_decode
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from funcmla.layout import PageTable


D, DV = 576, 512
SCALE = MLADims().sm_scale
POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def problem(*, heads, s_q, page_size, lens, seed):
    """q, a clean pool (every row finite), the live-row mask, CSR and page-table metadata.
    Sequence b's pages are a permutation of 1..; table entries past a sequence point at page 0,
    and the CSR capacity past kv_indptr[-1] holds slot 0."""
    rng = np.random.default_rng(seed)
    batch = len(lens)
    max_pages = max(-(-n // page_size) for n in lens) + 1
    n_pages = batch * max_pages + 2  # two pages no sequence uses at all
    pool = rng.standard_normal((n_pages * page_size, D)).astype(np.float32)
    q = rng.standard_normal((batch * s_q, heads, D)).astype(np.float32)
    table = rng.permutation(np.arange(1, n_pages))[: batch * max_pages]
    table = table.reshape(batch, max_pages).astype(np.int32)
    live = np.zeros(len(pool), bool)
    slot_lists = []
    for b, n in enumerate(lens):
        table[b, -(-n // page_size):] = 0
        t = np.arange(n)
        slots = table[b, t // page_size] * page_size + t % page_size
        live[slots] = True
        slot_lists.append(slots.astype(np.int32))
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(int(indptr[-1]) + 11, np.int32)
    indices[: indptr[-1]] = np.concatenate(slot_lists)
    return dict(q=jnp.asarray(q, jnp.bfloat16), pool=pool, live=live, table=table,
                lens=np.asarray(lens, np.int32), kv_indptr=indptr, kv_indices=indices)


def decode(p, pool, *, s_q, page_size, num_splits):
    cfg = DecodeKernelConfig(kernel="triton")
    pool = jnp.asarray(pool, jnp.bfloat16)
    if page_size == 1:
        return mla_decode(p["q"], pool, kv_indptr=jnp.asarray(p["kv_indptr"]),
                          kv_indices=jnp.asarray(p["kv_indices"]), sm_scale=SCALE, s_q=s_q,
                          num_splits=num_splits, config=cfg, interpret=True)
    pt = PageTable(jnp.asarray(p["table"]), jnp.asarray(p["lens"]), page_size)
    return mla_decode(p["q"], pool, page_table=pt, sm_scale=SCALE, s_q=s_q,
                      num_splits=num_splits, config=cfg, interpret=True)


def reference(p, *, s_q):
    """float32 reference on the clean pool (bf16-rounded, as the kernels read it)."""
    batch = len(p["lens"])
    pool = jnp.asarray(jnp.asarray(p["pool"], jnp.bfloat16), jnp.float32)
    return mla_attention_reference(
        jnp.asarray(p["q"], jnp.float32), pool, jnp.arange(batch + 1, dtype=jnp.int32) * s_q,
        jnp.asarray(p["kv_indptr"]), jnp.asarray(p["kv_indices"]), sm_scale=SCALE,
        max_kv_len=int(max(p["lens"].max(), 1)))


def assert_unused_rows_do_not_leak(p, *, s_q, page_size, num_splits, poison):
    clean = decode(p, p["pool"], s_q=s_q, page_size=page_size, num_splits=num_splits)
    dirty_pool = p["pool"].copy()
    dirty_pool[~p["live"]] = POISONS[poison]
    assert not p["live"][0], "slot 0 must be unused"
    dirty = decode(p, dirty_pool, s_q=s_q, page_size=page_size, num_splits=num_splits)
    for c, d in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(d, np.float32))
    out = np.asarray(clean[0], np.float32)
    lse = np.asarray(clean[1])
    ref_out, ref_lse = (np.asarray(x) for x in reference(p, s_q=s_q))
    empty = np.repeat(p["lens"] == 0, s_q)
    assert (out[empty] == 0).all() and (lse[empty] == np.inf).all()
    live = ~empty
    err = np.linalg.norm(out[live] - ref_out[live]) / np.linalg.norm(ref_out[live])
    assert err < 1e-2, f"relative error {err}"
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-3, atol=2e-2)


# page size, s_q, lengths (0: an empty sequence; 70: a partial last tile), splits, poison.
# 3 splits of a 70-token sequence leave an empty split; 150 tokens cross a tile boundary.
TRITON_CASES = [
    (1, 1, [70, 0, 150], 1, "nan"),
    (1, 2, [70, 0, 150], 3, "inf"),
    (16, 1, [70, 0, 150], 3, "nan"),
    (16, 3, [70, 5, 150], 1, "-inf"),
    (64, 1, [70, 0, 150], 1, "inf"),
    (64, 2, [70, 0, 150], 3, "nan"),
]


@pytest.mark.parametrize("page_size,s_q,lens,splits,poison", TRITON_CASES)
def test_triton_kernel_and_merge_ignore_unused_rows(page_size, s_q, lens, splits, poison):
    p = problem(heads=16, s_q=s_q, page_size=page_size, lens=lens, seed=page_size + splits)
    assert_unused_rows_do_not_leak(p, s_q=s_q, page_size=page_size, num_splits=splits,
                                   poison=poison)
