"""The Pallas paged MLA decode kernel against a float64 dense NumPy reference.

CPU runs use Pallas interpret mode on small, fixed shapes (so each variant compiles once); the
GPU tests (compiled kernel) skip without a GPU. Unused pool rows, including the reserved page 0
that padded table entries point at, hold NaN: any read past a sequence's end shows up.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas import (
    DecodeKernelConfig,
    KVRows,
    choose_num_splits,
    merge_splits,
    merge_splits_pallas,
    mla_decode,
    mla_decode_rows,
    validate_decode_inputs,
)
from funcmla.attention.pallas.decode_common import kv_rows_from_csr
from funcmla.config import MLADims
from funcmla.layout import PageTable
from tests.pools import attention_oracle_f64


D, DV = 576, 512
SCALE = MLADims().sm_scale


# ------------------------------------------------------------------------------- helpers

def reference(q, pool, slot_lists, s_q, sm_scale):
    """float64 dense decode; slot_lists[b] = token slots of sequence b (bottom-right causal)."""
    lens = np.array([len(sl) for sl in slot_lists], np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(lens)])
    kv_indices = np.concatenate([np.asarray(sl, np.int64) for sl in slot_lists] + [np.zeros(0, np.int64)])
    qo_indptr = np.arange(len(slot_lists) + 1) * s_q
    return attention_oracle_f64(np.asarray(jnp.asarray(q, jnp.float32)),
                                np.asarray(jnp.asarray(pool, jnp.float32)),
                                qo_indptr, kv_indptr, kv_indices, sm_scale, DV)


def make_problem(rng, *, batch, heads, s_q, page_size, lens, max_pages, capacity_pad=17,
                 poison=np.nan):
    """Random q and pool, a page table (page ids from a permutation of 1..); every pool row no
    sequence uses (page 0 included, where padded table entries point) holds `poison`."""
    n_pages = batch * max_pages + 1
    slots = n_pages * page_size
    pool = rng.standard_normal((slots, D)).astype(np.float32)
    q = rng.standard_normal((batch * s_q, heads, D)).astype(np.float32)
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = perm[: batch * max_pages].reshape(batch, max_pages).copy()
    slot_lists = []
    for b in range(batch):
        used = -(-int(lens[b]) // page_size)
        table[b, used:] = 0  # padded entries point at the reserved page 0
        pos = np.arange(lens[b])
        slot_lists.append((table[b, pos // page_size] * page_size + pos % page_size).astype(
            np.int32))
    live = np.zeros(slots, bool)
    for sl in slot_lists:
        live[sl] = True
    pool[~live] = poison
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(int(indptr[-1]) + capacity_pad, np.int32)
    if indptr[-1]:
        indices[: indptr[-1]] = np.concatenate(slot_lists)
    return dict(
        q=jnp.asarray(q, jnp.bfloat16), pool=jnp.asarray(pool, jnp.bfloat16),
        table=jnp.asarray(table), lens=jnp.asarray(np.asarray(lens, np.int32)),
        kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(indices), slot_lists=slot_lists)


def check(out, lse, ref_out, ref_lse):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    assert out.dtype == np.float64 and np.isfinite(out).all(), "NaN/inf in out"
    live = np.isfinite(ref_lse)
    assert (lse[~live] == np.inf).all(), "empty rows must have lse +inf"
    assert (out[~live] == 0).all(), "empty rows must have out 0"
    if live.any():
        err = np.linalg.norm(out[live] - ref_out[live]) / np.linalg.norm(ref_out[live])
        assert err < 1e-2, f"rel err {err}"
        np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-3, atol=2e-2)


def run_csr(p, *, s_q, num_splits=None, capacity=None, sm_scale=SCALE, interpret=True,
            config=DecodeKernelConfig()):
    return mla_decode(p["q"], p["pool"], kv_indptr=p["kv_indptr"], kv_indices=p["kv_indices"],
                      sm_scale=sm_scale, s_q=s_q, num_splits=num_splits, config=config,
                      max_kv_len=capacity, interpret=interpret)


def run_pages(p, *, s_q, page_size, num_splits=None, sm_scale=SCALE, interpret=True,
              config=DecodeKernelConfig()):
    pt = PageTable(p["table"], p["lens"], page_size)
    return mla_decode(p["q"], p["pool"], page_table=pt, sm_scale=sm_scale, s_q=s_q,
                      num_splits=num_splits, config=config, interpret=interpret)


def assert_bitwise(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# ------------------------------------------------------------------------------- interpret

@pytest.mark.parametrize(
    "heads,s_q,num_splits",
    [(16, 1, None), (32, 2, 3), (16, 4, 1), (16, 3, 2)],
)
def test_token_csr_matches_reference(heads, s_q, num_splits):
    rng = np.random.default_rng(heads * 10 + s_q)
    lens = np.array([150, 0, 3, 97])  # includes a zero-length and a shorter-than-a-block one
    p = make_problem(rng, batch=4, heads=heads, s_q=s_q, page_size=1, lens=lens, max_pages=160)
    out, lse = run_csr(p, s_q=s_q, num_splits=num_splits)
    assert out.shape == (4 * s_q, heads, DV) and out.dtype == jnp.bfloat16
    assert lse.shape == (4 * s_q, heads) and lse.dtype == jnp.float32
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], s_q, SCALE))


@pytest.mark.parametrize("page_size,heads,s_q,num_splits", [(16, 16, 3, 2), (64, 32, 1, None)])
def test_page_table_matches_reference(page_size, heads, s_q, num_splits):
    rng = np.random.default_rng(page_size + s_q)
    lens = np.array([0, 130, 64, 1])
    p = make_problem(rng, batch=4, heads=heads, s_q=s_q, page_size=page_size, lens=lens,
                     max_pages=-(-130 // page_size) + 1)  # one padded column at least
    out, lse = run_pages(p, s_q=s_q, page_size=page_size, num_splits=num_splits)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], s_q, SCALE))


@settings(max_examples=6)
@given(lens=st.lists(st.integers(0, 200), min_size=3, max_size=3))
def test_random_lengths_token_csr(lens):
    """Any lengths (zero, partial blocks, several blocks) on one compiled shape; Hypothesis
    draws the lengths (the data is fixed), so a failure shrinks to the smallest lengths."""
    rng = np.random.default_rng(0)
    lens = np.array(lens)
    p = make_problem(rng, batch=3, heads=16, s_q=2, page_size=1, lens=lens, max_pages=200,
                     capacity_pad=600 - int(lens.sum()))
    out, lse = run_csr(p, s_q=2, num_splits=2, capacity=200)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], 2, SCALE))


def test_split_count_does_not_change_result():
    rng = np.random.default_rng(5)
    p = make_problem(rng, batch=2, heads=16, s_q=1, page_size=1, lens=np.array([300, 77]),
                     max_pages=300)
    o1, l1 = run_csr(p, s_q=1, num_splits=1)
    o4, l4 = run_csr(p, s_q=1, num_splits=4)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l4), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o4, np.float32),
                               atol=2e-2)


@pytest.mark.slow  # five interpret-mode kernel runs
def test_partial_dtypes():
    """The split partials are stored in `partial_dtype` (bf16 by default, float32 on request;
    the merge kernel widens them), both within the reference tolerance;
    one split is unaffected (no partials); other dtypes are refused by name."""
    rng = np.random.default_rng(13)
    p = make_problem(rng, batch=3, heads=16, s_q=2, page_size=1, lens=np.array([300, 0, 77]),
                     max_pages=300)
    ref = reference(p["q"], p["pool"], p["slot_lists"], 2, SCALE)
    assert DecodeKernelConfig().partial_dtype == "bfloat16"
    kv = kv_rows_from_csr(p["kv_indptr"], p["kv_indices"], 300)
    for dtype in ("bfloat16", "float32"):
        cfg = DecodeKernelConfig(partial_dtype=dtype)
        o, _ = mla_decode_rows(p["q"], p["pool"], kv, sm_scale=SCALE, s_q=2, num_splits=3,
                               config=cfg, interpret=True)
        assert o.dtype == jnp.dtype(dtype)
        check(*run_csr(p, s_q=2, num_splits=3, capacity=300, config=cfg), *ref)
    assert_bitwise(run_csr(p, s_q=2, num_splits=1, capacity=300, config=cfg),
                   run_csr(p, s_q=2, num_splits=1, capacity=300))
    with pytest.raises(ValueError, match="partial_dtype"):
        DecodeKernelConfig(partial_dtype="float16")


def test_all_empty_and_scale_parameter():
    rng = np.random.default_rng(9)
    # the shapes of test_split_count_does_not_change_result (601 pool rows, 394 indices), so
    # the unsplit and 4-split runs reuse its two compiled programs
    p = make_problem(rng, batch=2, heads=16, s_q=1, page_size=1, lens=np.array([0, 0]),
                     max_pages=300, capacity_pad=394)
    for ns in (1, 4):
        out, lse = run_csr(p, s_q=1, num_splits=ns)
        assert (np.asarray(out, np.float32) == 0).all() and (np.asarray(lse) == np.inf).all()
    # a different scale is honoured (and differs from the default's result)
    p = make_problem(rng, batch=2, heads=16, s_q=1, page_size=1, lens=np.array([40, 9]),
                     max_pages=40)
    out, lse = run_csr(p, s_q=1, sm_scale=0.03)
    ref = reference(p["q"], p["pool"], p["slot_lists"], 1, 0.03)
    check(out, lse, *ref)
    assert not np.allclose(ref[1], reference(p["q"], p["pool"], p["slot_lists"], 1, SCALE)[1])


# ------------------------------------------------------------------------------- pure parts

def test_merge_splits_equals_softmax_over_union():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 3, 4, 40))  # [B, 3, 4, 2 splits x 20 keys] scores
    v = rng.standard_normal((2, 40, DV))
    parts_o, parts_l = [], []
    for k in range(2):
        sk = s[..., 20 * k: 20 * (k + 1)]
        m = sk.max(-1, keepdims=True)
        p = np.exp(sk - m)
        parts_o.append(np.einsum("bxrk,bkd->bxrd", p / p.sum(-1, keepdims=True),
                                 v[:, 20 * k: 20 * (k + 1)]))
        parts_l.append((m + np.log(p.sum(-1, keepdims=True)))[..., 0])
    # fold [B, 3, 4] rows into R=12 and add an empty third split
    o_part = np.stack([x.reshape(2, 12, DV) for x in parts_o] + [np.zeros((2, 12, DV))], 1)
    l_part = np.stack([x.reshape(2, 12) for x in parts_l] + [np.full((2, 12), -np.inf)], 1)
    out, lse = merge_splits(jnp.asarray(o_part, jnp.float32), jnp.asarray(l_part, jnp.float32),
                            jnp.float32)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    ref_o = np.einsum("bxrk,bkd->bxrd", p / p.sum(-1, keepdims=True), v).reshape(2, 12, DV)
    ref_l = (m + np.log(p.sum(-1, keepdims=True)))[..., 0].reshape(2, 12)
    np.testing.assert_allclose(np.asarray(out), ref_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_l, rtol=1e-5, atol=1e-5)
    out, lse = merge_splits(jnp.zeros((1, 2, 3, DV)), jnp.full((1, 2, 3), -jnp.inf), jnp.float32)
    assert (np.asarray(out) == 0).all() and (np.asarray(lse) == np.inf).all()


def test_split_rule():
    # one program per SM: cost(s) = ceil(B*rb*s / 132) * (ceil(blocks / s) + 2) + (1 if s > 1)
    cfg = DecodeKernelConfig(programs_per_sm=1)
    assert choose_num_splits(32, 1, 4096, cfg) == 4  # 128 programs of 16 blocks: one wave
    assert choose_num_splits(128, 1, 4096, cfg) == 1  # 128 programs already
    assert choose_num_splits(128, 2, 4096, cfg) == 1  # 2 waves either way
    assert choose_num_splits(32, 2, 4096, cfg) == 2  # 128 programs of 32 blocks
    assert choose_num_splits(1, 1, 4096, cfg) == 64  # one block per program
    assert choose_num_splits(1, 1, 16384, cfg) == 64  # max_splits (128 without it)
    big = dataclasses.replace(cfg, max_splits=1024)
    assert choose_num_splits(1, 1, 16384, big) == 128  # 2 blocks each; 256 would be 2 waves
    assert choose_num_splits(1, 1, 4096, dataclasses.replace(cfg, max_splits=8)) == 8
    assert choose_num_splits(1, 1, 10, cfg) == 1
    assert choose_num_splits(512, 2, 4096, cfg) == 1
    assert choose_num_splits(1, 1, 4096, DecodeKernelConfig(min_blocks_per_split=4)) == 16
    assert choose_num_splits(32, 1, 4096, DecodeKernelConfig(programs_per_sm=2)) == 8
    # programs per SM, estimated from shared memory (q + KV tiles) and registers
    st3 = DecodeKernelConfig(num_stages=3)
    assert st3.kv_buffers() == 1  # 3 stages: ids one stage ahead of the rows
    assert st3.resolved_programs_per_sm(16) == 2  # 94 KB, ~205 registers
    assert choose_num_splits(32, 1, 4096, st3, block_m=16) == 8
    # defaults: 5 stages (2 KV tiles, 169 KB, one program per SM) at 16-32 rows, 2 at 64 rows
    cfg = DecodeKernelConfig()
    assert cfg.resolved_num_stages(16) == 5 and cfg.resolved_num_stages(64) == 2
    assert cfg.kv_buffers(16) == 2 and cfg.resolved_programs_per_sm(16) == 1
    assert DecodeKernelConfig(block_kv=16, num_stages=8).resolved_programs_per_sm(16) == 3
    assert cfg.resolved_programs_per_sm(64) == 1  # registers
    assert choose_num_splits(32, 1, 4096, cfg, block_m=16) == 4  # best measured (H200)
    assert choose_num_splits(128, 1, 4096, cfg, block_m=16) == 1
    assert choose_num_splits(32, 2, 4096, cfg, block_m=64) == 2
    assert choose_num_splits(128, 2, 4096, cfg, block_m=64) == 1


@pytest.mark.slow  # interpret-mode runs of three kernel forms at two split counts
def test_kv_rows_forms_agree_bitwise():
    """The launcher's "lens" form (table_start + kv_lens) and mla_decode's in-kernel forms."""
    rng = np.random.default_rng(11)
    lens = np.array([40, 0, 70])
    p = make_problem(rng, batch=3, heads=16, s_q=1, page_size=1, lens=lens, max_pages=80)
    indptr = p["kv_indptr"]
    kv_lens = KVRows(p["kv_indices"], indptr[:-1], indptr[1:] - indptr[:-1], 1, 80)
    kv_indptr = KVRows(p["kv_indices"], indptr, None, 1, 80)
    assert (kv_lens.form, kv_indptr.form) == ("lens", "indptr")
    for ns in (1, 3):
        o_csr, l_csr = run_csr(p, s_q=1, num_splits=ns, capacity=80)
        # mla_decode_rows is the decode kernel alone: [B, S, rows_pad, 512] + [B, S, rows_pad]
        parts = [mla_decode_rows(p["q"], p["pool"], kv, sm_scale=SCALE, num_splits=ns,
                                 interpret=True) for kv in (kv_lens, kv_indptr)]
        for o_p, l_p in parts:
            assert o_p.shape == (3, ns, 16, DV) and l_p.shape == (3, ns, 16)
            np.testing.assert_array_equal(np.asarray(o_p, np.float32),
                                          np.asarray(parts[0][0], np.float32))
            np.testing.assert_array_equal(np.asarray(l_p), np.asarray(parts[0][1]))
        o_p, l_p = parts[0]
        if ns == 1:
            assert o_p.dtype == jnp.bfloat16 and (np.asarray(l_p)[1] == np.inf).all()
            np.testing.assert_array_equal(np.asarray(o_p[:, 0], np.float32),
                                          np.asarray(o_csr, np.float32))
        else:
            assert o_p.dtype == jnp.bfloat16 and (np.asarray(l_p)[1] == -np.inf).all()
            o_m, l_m = merge_splits_pallas(o_p, l_p, jnp.bfloat16, interpret=True)
            np.testing.assert_array_equal(np.asarray(o_m, np.float32),
                                          np.asarray(o_csr, np.float32))
            np.testing.assert_array_equal(np.asarray(l_m), np.asarray(l_csr))


def test_kv_rows_checks():
    t = jnp.zeros(8, jnp.int32)
    with pytest.raises(ValueError, match="entries_per_seq"):
        KVRows(t, None, jnp.zeros(2, jnp.int32), 1, 4).check()
    with pytest.raises(ValueError, match="table_start"):
        KVRows(t, jnp.zeros(1, jnp.int32), None, 1, 4).check()
    with pytest.raises(TypeError, match="KVRows.kv_lens"):
        KVRows(t, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.float32), 1, 4).check()
    KVRows(t, None, jnp.zeros(2, jnp.int32), 16, 64, entries_per_seq=4).check()


def test_bad_inputs_are_named():
    rng = np.random.default_rng(2)
    p = make_problem(rng, batch=2, heads=16, s_q=1, page_size=1, lens=np.array([5, 6]),
                     max_pages=8)
    with pytest.raises(ValueError, match="s_q"):
        run_csr(p, s_q=3)
    with pytest.raises(TypeError, match="kv_pool"):
        mla_decode(p["q"], p["pool"].astype(jnp.float32), kv_indptr=p["kv_indptr"],
                   kv_indices=p["kv_indices"], sm_scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="sequences"):
        mla_decode(p["q"][:1], p["pool"], kv_indptr=p["kv_indptr"], kv_indices=p["kv_indices"],
                   sm_scale=SCALE, interpret=True)
    with pytest.raises(TypeError, match="kv_indices"):
        mla_decode(p["q"], p["pool"], kv_indptr=p["kv_indptr"],
                   kv_indices=p["kv_indices"].astype(jnp.uint32), sm_scale=SCALE)
    with pytest.raises(ValueError, match="not both"):
        mla_decode(p["q"], p["pool"], kv_indptr=p["kv_indptr"], kv_indices=p["kv_indices"],
                   page_table=PageTable(p["table"], p["lens"], 1), sm_scale=SCALE)
    with pytest.raises(ValueError, match="num_splits"):
        run_csr(p, s_q=1, num_splits=0)
    with pytest.raises(ValueError, match="block_m"):
        DecodeKernelConfig(block_m=24)
    with pytest.raises(ValueError, match="max_splits must be a positive int, got 0"):
        DecodeKernelConfig(max_splits=0)
    with pytest.raises(ValueError, match="row width"):
        mla_decode(p["q"], p["pool"][:, :512], kv_indptr=p["kv_indptr"],
                   kv_indices=p["kv_indices"], sm_scale=SCALE)


def test_validate_decode_inputs():
    indptr = np.array([0, 3, 5], np.int32)
    validate_decode_inputs(10, kv_indptr=indptr, kv_indices=np.array([1, 2, 3, 4, 9, 99]))
    with pytest.raises(ValueError, match="kv_indices"):
        validate_decode_inputs(10, kv_indptr=indptr, kv_indices=np.array([1, 2, 3, 4, 10]))
    with pytest.raises(ValueError, match="kv_indptr"):
        validate_decode_inputs(10, kv_indptr=np.array([0, 3, 9]), kv_indices=np.arange(5))
    table = jnp.array([[1, 2], [3, 0]], jnp.int32)
    validate_decode_inputs(64, page_table=PageTable(table, jnp.array([20, 16]), 16))
    with pytest.raises(ValueError, match="page_table.table"):
        validate_decode_inputs(48, page_table=PageTable(table, jnp.array([20, 16]), 16))
    with pytest.raises(ValueError, match="page_table.lengths"):
        validate_decode_inputs(64, page_table=PageTable(table, jnp.array([40, 16]), 16))


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q,page_size", [(16, 1, 1), (128, 2, 64), (64, 4, 16)])
def test_gpu_kernel_matches_reference(heads, s_q, page_size):
    rng = np.random.default_rng(heads + s_q)
    lens = np.array([1000, 0, 64, 513, 7])
    max_pages = -(-1000 // page_size) + 1
    p = make_problem(rng, batch=5, heads=heads, s_q=s_q, page_size=page_size, lens=lens,
                     max_pages=max_pages)
    if page_size == 1:
        out, lse = run_csr(p, s_q=s_q, interpret=False)
    else:
        out, lse = run_pages(p, s_q=s_q, page_size=page_size, interpret=False)
    check(out, lse, *reference(p["q"], p["pool"], p["slot_lists"], s_q, SCALE))


# ------------------------------------------------------------------------------- benchmark

def test_bench_device_stats_spans_and_kernel_medians():
    """bench/decode.py's device time: runs are equal slices of the events; the span per call
    counts the gaps between kernels of a run but not the gap between runs."""
    from bench.decode import device_stats

    events, t = [], 0.0
    for run in range(2):
        for call in range(4):
            dec = 10.0 + call  # 10, 11, 12, 13 us
            events.append((t, dec, "mla_decode_ps1_m16_kv64"))
            events.append((t + dec + 1.0, 2.0, "funcmla_merge_s4_d64"))
            t += dec + 4.0  # 1 us gap after the merge
        t += 5000.0  # host time between runs: not device time
    st = device_stats(events, calls=4, runs=2)
    assert st["decode_us"] == 11.5 and st["merge_us"] == 2.0
    assert st["kernels_per_call"] == 2.0
    # one run: 4 calls of (dec + 4) us minus the trailing 1 us gap after the last merge
    assert st["span_us"] == pytest.approx((46.0 + 16.0 - 1.0) / 4)
    assert st["busy_us"] == pytest.approx((46.0 + 8.0) / 4)
    assert device_stats([], calls=4, runs=2) is None
    # runs are split at the host gaps, not by count: an extra event inside run 2 (a copy)
    # stays in run 2 and does not pull run 2's first kernel into run 1
    extra = events + [(events[-1][0] + 2.5, 0.5, "MemcpyD2D")]
    st2 = device_stats(extra, calls=4, runs=2)
    assert st2["span_us"] == pytest.approx(st["span_us"] + 0.25 / 2)  # run 2 ends 1 us later
    assert st2["decode_us"] == 11.5
    # memsets (e.g. zeroed buffers) are counted per call, not as kernels
    assert st["memset_us"] == 0.0 and st["memsets_per_call"] == 0.0
    zeroed = events + [(t0 - 0.8, 0.6, "Memset") for t0, _, nm in events if "decode" in nm]
    st3 = device_stats(zeroed, calls=4, runs=2)
    assert st3["memset_us"] == pytest.approx(0.6) and st3["memsets_per_call"] == 1.0
    assert st3["decode_us"] == 11.5 and st3["merge_us"] == 2.0
