"""AITER decode planner (get_mla_metadata_v1, v1.2): jit planner vs the serial NumPy oracle,
hand-worked plans, buffer sizes, plan invariants, the Pallas fill, config validation."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.checks import checked
from funcmla.config import MI300X, MI355X, custom_device
from funcmla.planners.decode import check_decode_plan_inputs, plan_mla_decode, plan_mla_decode_jit
from funcmla.planners.decode_config import DecodePlanConfig
from funcmla.planners.decode_fill import (
    NEVER,
    FillParams,
    fill_advance,
    fill_inputs,
    fill_step,
    fill_tiles_scan,
)
from funcmla.planners.decode_chase import chase_states
from funcmla.planners.decode_fill_pallas import fill_tiles_pallas
from funcmla.planners.decode_sizes import mla_decode_plan_sizes
from funcmla.planners.oracle_decode import plan_mla_decode_reference

FIELDS = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
          "reduce_partial_map", "num_works", "num_partials")
BATCHES = (1, 7, 64, 512)  # static batch sizes (one compile each per config)


def make_inputs(kv_lens, qo_lens, last=None):
    """Token/page CSR inputs. kv_lens are kv_indices entries (pages if page_size > 1); last:
    tokens in each request's last page (default 1)."""
    kv_lens = np.asarray(kv_lens, np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    last = np.ones(len(kv_lens), np.int32) if last is None else np.asarray(last, np.int32)
    return qo_indptr, kv_indptr, last


def run_both(cfg, qo_indptr, kv_indptr, last, fill_impl="scan"):
    got = plan_mla_decode_jit(jnp.asarray(qo_indptr), jnp.asarray(kv_indptr), jnp.asarray(last),
                              config=cfg, fill_impl=fill_impl)
    ref = plan_mla_decode_reference(qo_indptr, kv_indptr, last, config=cfg)
    return jax.tree.map(np.asarray, got), ref


def assert_same(got, ref):
    assert got.kind == ref.kind == "decode" and got.block_size == ref.block_size
    for name in FIELDS:
        a, b = getattr(got, name), getattr(ref, name)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        bad = np.argwhere(np.atleast_1d(a != b))
        assert bad.size == 0, f"{name} differs at {bad[:4].tolist()}: {a[tuple(bad[:4].T)]} vs " \
                              f"{b[tuple(bad[:4].T)]}"


def check_invariants(plan, cfg, qo_indptr, kv_indptr, planner):
    """Structural properties any correct plan has (independent of AITER's exact choices)."""
    nw, npart = int(plan.num_works), int(plan.num_partials)
    wi, wp = plan.work_info, plan.work_indptr
    assert wp[0] == 0 and wp[-1] == nw and np.all(np.diff(wp) >= 0)
    assert nw <= wi.shape[0] and np.all(wi[nw:] == 0)
    ri = plan.reduce_indptr
    assert ri[0] == 0 and ri[-1] == npart and np.all(np.diff(ri) >= 0)
    assert np.all(plan.reduce_partial_map[npart:] == 0)
    ratio = cfg.qk_batch_ratio
    kv_len = np.diff(kv_indptr)
    # works of each (batch, qo_start) in plan order, contiguous in work order
    tiles: dict[tuple[int, int], list[int]] = {}
    order = []
    for w in range(nw):
        key = (int(wi[w, 0]), int(wi[w, 2]))
        if key not in tiles:
            order.append(key)
        else:
            assert order[-1] == key, f"works of tile {key} are not contiguous"
        tiles.setdefault(key, []).append(w)
    num_b = (len(kv_indptr) - 1) * ratio
    expect_tiles = []
    for b in range(num_b):
        if cfg.uniform_qo:
            s0, s1 = cfg.uni_seqlen_qo * b, cfg.uni_seqlen_qo * (b + 1)
        else:
            s0, s1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        nt = cfg.num_qo_tiles(s1 - s0)
        ts = -(-(s1 - s0) // nt)
        expect_tiles += [(b, s0 + t * ts, min(s0 + (t + 1) * ts, s1), ts) for t in range(nt)]
    partial_rows = set()
    split_tile = 0
    for k, (b, qs, qe, ts) in enumerate(expect_tiles):
        r = b // ratio
        kb, ke = int(kv_indptr[r]), int(kv_indptr[r + 1])
        ws = tiles.pop((b, qs), [])
        if not ws:  # only the parallel planner drops (zero-length KV) tiles
            assert planner == "parallel" and kv_len[r] == 0, (b, qs)
            continue
        rows = wi[ws]
        assert np.all(rows[:, 3] == qe)
        assert rows[0, 4] == kb and rows[-1, 6] == (ke - rows[-1, 5]) * (cfg.page_size == 1)
        if len(ws) > 1:  # split: contiguous kv, consecutive partial rows, a reduce group
            assert np.all(rows[1:, 4] == rows[:-1, 5])
            ploc = rows[:, 1]
            assert np.all(np.diff(ploc) == ts) and ploc[0] >= 0
            g0, g1 = ri[k], ri[k + 1]
            assert g1 - g0 == len(ws)
            assert np.array_equal(plan.reduce_partial_map[g0:g1], ploc)
            assert tuple(plan.reduce_final_map[k]) == (qs, qe)
            partial_rows.update(range(ploc[0], ploc[-1] + ts))
            split_tile += 1
        else:
            assert rows[0, 1] == -1 and ri[k + 1] == ri[k]
            assert tuple(plan.reduce_final_map[k]) == (0, 0)
    assert not tiles, f"works for unknown tiles {list(tiles)[:4]}"
    # partial rows of different splits never overlap
    assert len(partial_rows) == sum(
        int(ri[k + 1] - ri[k]) * ts for k, (_, _, _, ts) in enumerate(expect_tiles))


# ---------------------------------------------------------------------------------------------
# Random configurations (hypothesis).


@st.composite
def configs(draw):
    arch = draw(st.sampled_from(["gfx942", "gfx950"]))
    num_cu = draw(st.sampled_from([8, 80, 256, 304]))
    heads = draw(st.sampled_from([16, 32, 64, 128]))
    dtype = draw(st.sampled_from(["bf16", "fp8"]))
    msq = draw(st.integers(1, 4))
    page = draw(st.sampled_from([1, 16, 64]))
    gran = draw(st.sampled_from([max(page, 16), 1, 4, 32]))
    uniform = draw(st.booleans())
    kwargs = dict(
        device=custom_device(num_cu, arch), num_heads=heads, q_dtype=dtype, kv_dtype=dtype,
        max_seqlen_qo=msq, uni_seqlen_qo=msq if uniform else -1, page_size=page,
        kv_granularity=gran, is_causal=draw(st.booleans()),
        max_split_per_batch=draw(st.sampled_from([-1, -1, 1, 3])),
        experimental=draw(st.booleans()),
        zero_kv_behaviour=draw(st.sampled_from([None, "serial"])),
    )
    try:
        return DecodePlanConfig(**kwargs)
    except ValueError:  # folding needs uni_seqlen_qo and page 1: fall back to a legal variant
        kwargs.update(uni_seqlen_qo=msq, page_size=1, kv_granularity=16)
        try:
            return DecodePlanConfig(**kwargs)
        except ValueError:
            return DecodePlanConfig(**{**kwargs, "num_heads": 16})


@st.composite
def batches(draw, cfg, batch_sizes=BATCHES):
    """A decode batch for `cfg`, every value drawn through Hypothesis (so failures shrink):
    KV lengths in tokens (some zero), ragged qo lengths, last-page lengths."""
    b = draw(st.sampled_from(batch_sizes))
    max_len = draw(st.sampled_from([64, 2048, 32768]))  # tokens
    tok = st.integers(0, max_len)
    if draw(st.booleans()):  # often-empty requests (zero-length KV, cudagraph padding)
        tok = st.one_of(st.just(0), tok)
    kv_tok = np.asarray(draw(st.lists(tok, min_size=b, max_size=b)), np.int64)
    kv_lens = -(-kv_tok // cfg.page_size)
    if cfg.uniform_qo:
        qo_lens = np.full(b, cfg.uni_seqlen_qo)
    else:
        qo_lens = np.asarray(draw(st.lists(st.integers(1, cfg.max_seqlen_qo), min_size=b,
                                           max_size=b)))
    last = np.asarray(draw(st.lists(st.integers(1, cfg.page_size), min_size=b, max_size=b)),
                      np.int32)
    return make_inputs(kv_lens, qo_lens, last)


@pytest.mark.slow  # every example is a new config: a new compile (fixed configs below run fast)
@settings(max_examples=8)
@given(data=st.data())
def test_matches_oracle_random_configs(data):
    cfg = data.draw(configs())
    qo_indptr, kv_indptr, last = data.draw(batches(cfg))
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    check_invariants(got, cfg, qo_indptr, kv_indptr, cfg.planner(len(kv_indptr) - 1))


# A few fixed configurations with many data examples each (one compile per config).
FIXED = {
    "mi300x_h128_bf16_fold8": DecodePlanConfig(device=MI300X, num_heads=128, uni_seqlen_qo=1),
    "mi355x_h16_parallel": DecodePlanConfig(device=MI355X, num_heads=16),
    "mi355x_h128_fp8_mtp2_causal": DecodePlanConfig(
        device=MI355X, num_heads=128, q_dtype="fp8", kv_dtype="fp8", max_seqlen_qo=2,
        uni_seqlen_qo=2, is_causal=True),
    "gfx950_h64_fp8_mtp4_ragged_qo": DecodePlanConfig(
        device=custom_device(80, "gfx950"), num_heads=64, q_dtype="fp8", kv_dtype="fp8",
        max_seqlen_qo=4, is_causal=True),
    "gfx942_h32_bf16_fold2_mtp3": DecodePlanConfig(
        device=custom_device(8, "gfx942"), num_heads=32, max_seqlen_qo=3, uni_seqlen_qo=3,
        is_causal=True),
    "h16_mtp4_gran1_tail": DecodePlanConfig(
        device=custom_device(80), num_heads=16, max_seqlen_qo=4, uni_seqlen_qo=4,
        kv_granularity=1, is_causal=True),
    "page64_fp8_exp": DecodePlanConfig(
        device=MI355X, num_heads=16, q_dtype="fp8", kv_dtype="fp8", max_seqlen_qo=4,
        uni_seqlen_qo=4, page_size=64, kv_granularity=64, experimental=True),
    "page16_split_cap": DecodePlanConfig(
        device=custom_device(304), num_heads=16, page_size=16, max_split_per_batch=2),
}


@pytest.mark.parametrize("name", list(FIXED))
@settings(max_examples=6)
@given(data=st.data())
def test_matches_oracle_fixed_configs(name, data):
    cfg = FIXED[name]
    qo_indptr, kv_indptr, last = data.draw(batches(cfg, batch_sizes=(64,)))
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    check_invariants(got, cfg, qo_indptr, kv_indptr, cfg.planner(64))


# The fused Pallas plan compiles slowly in interpret mode (XLA:CPU), so the default run covers
# each branch of its programs once: head folding at 512 slots (looped emission, the chase),
# the parallel zero-KV rule, ragged qo with the tail rule (empty slots, the tile walk, causal
# trim), page size 64 (kv_offset from the last page). The other configs run with `-m slow`.
FUSED_FAST = ("mi300x_h128_bf16_fold8", "mi355x_h16_parallel", "gfx950_h64_fp8_mtp4_ragged_qo",
              "page64_fp8_exp")


@pytest.mark.parametrize("name", [n if n in FUSED_FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FIXED])
@settings(max_examples=3)
@given(data=st.data())
def test_fused_pallas_plan_matches_oracle(name, data):
    # The walk, then derive + emit, Pallas programs (interpret mode off-GPU) == the serial oracle.
    cfg = FIXED[name]
    qo_indptr, kv_indptr, last = data.draw(batches(cfg, batch_sizes=(64,)))
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last, fill_impl="fused")
    assert_same(got, ref)


@pytest.mark.parametrize("planner", ["parallel", "serial"])
def test_zero_kv_parallel_vs_serial(planner):
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16,
                           zero_kv_behaviour=None if planner == "parallel" else "serial")
    assert cfg.planner(7) == planner
    kv_lens = [141, 0, 226, 0, 10, 43, 246]
    qo_indptr, kv_indptr, last = make_inputs(kv_lens, [1] * 7)
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    # Hand-worked: blocks n = [9,0,15,0,1,3,16], cost n+16, sum 156, P = ceil(156/8)+16 = 36.
    # b0 fits on cu0 (R 36->11). b1 (n=0) does not fit R=11 (< overhead 16): parallel drops
    # it, serial puts an empty work on cu1. b2 then starts a fresh cluster; b3 (n=0) is met
    # with R=5 (parallel: dropped, R=0; serial: empty work on the next cluster) ...
    wi = got.work_info[: int(got.num_works)]
    if planner == "parallel":
        assert got.work_indptr.tolist() == [0, 1, 2, 4, 5, 5, 5, 5, 5]
        assert wi[:, 0].tolist() == [0, 2, 4, 5, 6]
    else:
        # serial: b1 empty on cu1 (R 36-16=20); b2 (cost 31) is cut: 4 blocks on cu1, 11 on
        # cu2 (R 9); b3 empty on cu3 (R 20); b4 (17) fits cu3 (R 3); b5 (19) -> cu4 (R 17);
        # b6 (32) is cut: 1 block on cu4, 15 on cu5. Partial rows 0,1 (b2) and 2,3 (b6).
        assert got.work_indptr.tolist() == [0, 1, 3, 4, 6, 8, 9, 9, 9]
        assert wi[:, 0].tolist() == [0, 1, 2, 2, 3, 4, 5, 6, 6]
        assert wi[1].tolist() == [1, -1, 1, 2, 141, 141, 0, 0]  # the empty work
        assert wi[2].tolist() == [2, 0, 2, 3, 141, 205, 162, 0]
        assert wi[7].tolist() == [6, 2, 6, 7, 420, 436, 230, 0]
        assert wi[8].tolist() == [6, 3, 6, 7, 436, 666, 0, 0]
    check_invariants(got, cfg, qo_indptr, kv_indptr, planner)


def test_hand_worked_split():
    # 4 CUs, 16 heads, page 1, granularity 16, kv lens [100, 20, 300] tokens.
    # blocks n = [7, 2, 19]; sum of (n + 16) = 76; P = ceil(76/4) + 16 = 35; 19 blocks/fresh CU.
    # b0: 7+16 <= 35 fits cu0 (R=12). b1: 18 > 12 and R <= 16: cu0 abandoned, fits cu1 (R=17).
    # b2: 35 > 17, R > 16: cut now: 1 block (16 tokens) on cu1, the other 18 blocks on cu2.
    cfg = DecodePlanConfig(device=custom_device(4), num_heads=16)
    qo_indptr, kv_indptr, last = make_inputs([100, 20, 300], [1, 1, 1])
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    assert got.work_indptr.tolist() == [0, 1, 3, 4, 4]
    assert got.work_info.tolist() == [
        [0, -1, 0, 1, 0, 100, 0, 0],
        [1, -1, 1, 2, 100, 120, 0, 0],
        [2, 0, 2, 3, 120, 136, 284, 0],
        [2, 1, 2, 3, 136, 420, 0, 0],
        [0] * 8, [0] * 8,
    ]
    assert got.reduce_indptr.tolist() == [0, 0, 0, 2]
    assert got.reduce_final_map.tolist() == [[0, 0], [0, 0], [2, 3]]
    assert got.reduce_partial_map.tolist() == [0, 1, 0, 0, 0, 0]
    assert int(got.num_works) == 4 and int(got.num_partials) == 2


def test_hand_worked_tail_merge():
    # 3 CUs, 16 heads, max_seqlen_qo 4 (uniform), causal, kv lens [32, 7, 19] tokens.
    # n = [2, 1, 2]; sum = 18 + 17 + 18 = 53; P = ceil(53/3) + 16 = 34.
    # b0 fits cu0 (R=16). b1: 17 > 16, cu0 abandoned, fits cu1 (R=17). b2: 18 > 17 and R > 16:
    # a cut after 1 block would leave 3 tokens < max_seqlen_qo=4, so the fragment takes all of
    # b2, unsplit, over-filling cu1 (R=-1). With max_seqlen_qo=1 it is split onto cu2.
    qo_indptr = np.array([0, 4, 8, 12], np.int32)
    kv_indptr = np.array([0, 32, 39, 58], np.int32)
    last = np.ones(3, np.int32)
    cfg = DecodePlanConfig(device=custom_device(3), num_heads=16, max_seqlen_qo=4,
                           uni_seqlen_qo=4, is_causal=True)
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    assert got.work_indptr.tolist() == [0, 1, 3, 3]
    assert got.work_info[:3].tolist() == [
        [0, -1, 0, 4, 0, 32, 0, 0], [1, -1, 4, 8, 32, 39, 0, 0], [2, -1, 8, 12, 39, 58, 0, 0]]
    assert int(got.num_partials) == 0
    cfg1 = dataclasses.replace(cfg, max_seqlen_qo=1, uni_seqlen_qo=1)
    got1, ref1 = run_both(cfg1, np.arange(4, dtype=np.int32), kv_indptr, last)
    assert_same(got1, ref1)
    assert got1.work_indptr.tolist() == [0, 1, 3, 4]
    assert got1.work_info[2:4, 4:7].tolist() == [[39, 55, 3], [55, 58, 0]]


def test_causal_batch_tail_mtp():
    # gfx950 fp8, 128 heads, 2 query tokens: one qo tile per token; the first token's works end
    # one KV entry early (kv_offset 1) when causal (docs §4.5).
    # One CU, so nothing is split: the plan lists the four tiles in order.
    cfg = DecodePlanConfig(device=custom_device(1, "gfx950"), num_heads=128, q_dtype="fp8",
                           kv_dtype="fp8", max_seqlen_qo=2, uni_seqlen_qo=2, is_causal=True)
    assert cfg.qo_splits and cfg.num_qo_tiles(2) == 2
    qo_indptr, kv_indptr, last = make_inputs([50, 70], [2, 2])
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    assert got.work_info[:4, [0, 2, 3, 4, 5, 6]].tolist() == [
        [0, 0, 1, 0, 49, 1], [0, 1, 2, 0, 50, 0], [1, 2, 3, 50, 119, 1], [1, 3, 4, 50, 120, 0]]


def test_page_size_kv_offset_uses_last_page_len():
    # page 16: kv_indptr counts pages; a cut work's kv_offset counts tokens after it.
    cfg = DecodePlanConfig(device=custom_device(2), num_heads=16, page_size=16)
    assert cfg.overhead == 1
    qo_indptr = np.array([0, 1], np.int32)
    kv_indptr = np.array([0, 40], np.int32)  # 40 pages, the last one holding 5 tokens
    last = np.array([5], np.int32)
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last)
    assert_same(got, ref)
    # n = 3 blocks of 16 pages; P = ceil(4/2)+1 = 3: cut 2 blocks (32 pages) on cu0, 1 on cu1
    assert got.work_info[:2].tolist() == [[0, 0, 0, 1, 0, 32, 7 * 16 + 5, 0],
                                          [0, 1, 0, 1, 32, 40, 0, 0]]


def test_batch_size_capacity_and_shapes():
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16)
    qo_indptr, kv_indptr, last = make_inputs([5, 9, 300], [1, 1, 1])
    small = plan_mla_decode_jit(jnp.asarray(qo_indptr), jnp.asarray(kv_indptr),
                                jnp.asarray(last), config=cfg, fill_impl="scan")
    big = plan_mla_decode_jit(jnp.asarray(qo_indptr), jnp.asarray(kv_indptr),
                              jnp.asarray(last), config=cfg, batch_size=7, fill_impl="scan")
    sizes = mla_decode_plan_sizes(7, cfg)
    assert big.work_info.shape == sizes.work_info and big.reduce_indptr.shape == (8,)
    nw = int(small.num_works)
    assert np.array_equal(big.work_info[:nw], small.work_info[:nw])
    assert np.array_equal(big.work_indptr, small.work_indptr)
    assert big.reduce_indptr.tolist()[:4] == small.reduce_indptr.tolist()
    with pytest.raises(ValueError, match="batch_size=2"):
        plan_mla_decode_jit(jnp.asarray(qo_indptr), jnp.asarray(kv_indptr), jnp.asarray(last),
                            config=cfg, batch_size=2)
    with pytest.raises(ValueError, match="kv_last_page_lens"):
        plan_mla_decode_jit(jnp.asarray(qo_indptr), jnp.asarray(kv_indptr),
                            jnp.asarray(last[:2]), config=cfg)
    with pytest.raises(ValueError, match="int32"):
        plan_mla_decode_jit(jnp.asarray(qo_indptr, jnp.float32), jnp.asarray(kv_indptr),
                            jnp.asarray(last), config=cfg)


# ---------------------------------------------------------------------------------------------
# Pallas fill (interpret mode off-GPU) == scan fill.


@st.composite
def fill_cases(draw, s, ov, params):
    """Fill inputs drawn through Hypothesis: block counts (some 0, some empty slots), tail
    points, a payload. Returns (tiles int32 [s, 8], payload, bpc)."""
    elem = [st.integers(0, 59), st.just(0)] + ([st.just(-1)] if params.empty_slots else [])
    n = np.asarray(draw(st.lists(st.one_of(*elem), min_size=s, max_size=s)), np.int64)
    split = draw(st.integers(2, 8))
    payload = int(-(-np.maximum(n, 0).sum() // split)) + ov + draw(st.integers(1, 8))
    bpc = payload - ov
    if params.tail_rule:  # a tail point 1-3 blocks before the end, or none
        back = draw(st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=s, max_size=s))
        e_min = np.array([NEVER if k is None else max(int(v) - k, 0) for v, k in zip(n, back)])
    else:
        e_min = np.full(s, NEVER)
    tiles = fill_inputs(jnp.asarray(n, jnp.int32), jnp.asarray(e_min, jnp.int32),
                        jnp.int32(payload), jnp.int32(bpc), params=params)
    return tiles, jnp.int32(payload), jnp.int32(bpc)


@functools.lru_cache(maxsize=None)
def _fills(params, chunk):
    scan = jax.jit(lambda t, p, b: fill_tiles_scan(t, p, b, params=params))
    pallas = jax.jit(lambda t, p, b: fill_tiles_pallas(t, p, b, params=params, chunk=chunk,
                                                       interpret=True))
    advance = jax.jit(lambda cu, r, t, p, b: fill_advance(params, p, b, cu, r, tuple(t.T)))
    step = jax.jit(lambda cu, r, t, p, b: fill_step(params, p, b, cu, r, tuple(t.T))[:2])
    return scan, pallas, advance, step


FILL_PARAMS = [FillParams(16, False), FillParams(16, True),
               FillParams(16, True, tail_rule=False, empty_slots=False)]


@pytest.mark.parametrize("params", FILL_PARAMS)
@settings(max_examples=8)
@given(data=st.data())
def test_pallas_fill_matches_scan(params, data):
    tiles, payload, bpc = data.draw(fill_cases(22, 16, params))  # 22 % 4 != 0: padding
    scan, pallas, _, _ = _fills(params, 4)
    want, got = np.asarray(scan(tiles, payload, bpc)), np.asarray(pallas(tiles, payload, bpc))
    np.testing.assert_array_equal(got, want)
    assert want[0].tolist() == [0, int(payload)]


@pytest.mark.parametrize("params", FILL_PARAMS)
@settings(max_examples=8)
@given(data=st.data(), ov=st.sampled_from([1, 16]))
def test_fill_advance_is_the_carry_of_fill_step(params, data, ov):
    # The short-chain step the walk runs must agree with the full step on every reachable
    # state: remain in [-bpc, payload] (negative after a tail merge), any cluster.
    params = dataclasses.replace(params, overhead=ov)
    tiles, payload, bpc = data.draw(fill_cases(256, ov, params))
    remain = data.draw(st.lists(st.integers(-int(bpc), int(payload)), min_size=256,
                                max_size=256))
    remain = jnp.asarray(remain, jnp.int32).at[:8].set(payload).at[8:16].set(ov)  # edges
    cu = jnp.asarray(data.draw(st.lists(st.integers(0, 49), min_size=256, max_size=256)),
                     jnp.int32)
    _, _, advance, step = _fills(params, 4)
    got, want = advance(cu, remain, tiles, payload, bpc), step(cu, remain, tiles, payload, bpc)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@functools.lru_cache(maxsize=None)
def _advance_jit(params):
    return jax.jit(lambda cu, r, t, p, b: fill_advance(params, p, b, cu, r, tuple(t.T)))


@pytest.mark.parametrize("parallel", [False, True])
@settings(max_examples=10)
@given(data=st.data(), ov=st.sampled_from([1, 4, 16]))
def test_fill_advance_closed_form_for_nonempty_tiles(parallel, data, ov):
    # docs/planners.md ("The chase"): for n >= 1 blocks (no tail rule) the three cases of the
    # walk are one rotation modulo bpc, remain' = (max-ish(remain) - ov - n) mod bpc, and the
    # cluster advances by the abandon flag plus the clusters the tile's data crosses.
    bpc = data.draw(st.integers(ov + 1, 699))
    payload = bpc + ov
    params = FillParams(ov, parallel, tail_rule=False, empty_slots=False)
    s = 256

    def draw_list(elements):
        return np.asarray(data.draw(st.lists(elements, min_size=s, max_size=s)), np.int64)

    n = draw_list(st.integers(1, 4 * bpc + 1))
    # reachable: [0, bpc], and payload (fresh)
    remain = draw_list(st.one_of(st.integers(0, bpc), st.just(payload)))
    cu = draw_list(st.integers(0, 299))
    tiles = fill_inputs(jnp.asarray(n, jnp.int32), jnp.full((s,), NEVER, jnp.int32),
                        jnp.int32(payload), jnp.int32(bpc), params=params)
    got_cu, got_r = _advance_jit(params)(jnp.asarray(cu, jnp.int32),
                                         jnp.asarray(remain, jnp.int32), tiles,
                                         jnp.int32(payload), jnp.int32(bpc))
    abandon = remain <= ov
    rho = np.where(abandon, ov, remain)
    want_r = (rho - ov - n) % bpc
    p0 = np.where(abandon | (remain == payload), -ov, bpc - remain)
    want_cu = cu + abandon + np.maximum(0, (p0 + n + ov - 1) // bpc)
    np.testing.assert_array_equal(np.asarray(got_r), want_r)
    np.testing.assert_array_equal(np.asarray(got_cu), want_cu)


@functools.lru_cache(maxsize=None)
def _chase_jit(params):
    return jax.jit(lambda n, p, b: chase_states(n, p, b, params=params))


CHASE_TEST_SLOTS = 300


@pytest.mark.parametrize("parallel", [False, True])
@settings(max_examples=25)
@given(data=st.data(), ov=st.sampled_from([0, 1, 4, 16]),
       size=st.sampled_from([1, 7, 64, CHASE_TEST_SLOTS]), hi=st.sampled_from([1, 5, 100, 4000]),
       zeros=st.booleans(), empties=st.booleans(), clusters=st.sampled_from([1, 8, 80, 304]))
def test_chase_equals_the_tile_walk(parallel, data, ov, size, hi, zeros, empties, clusters):
    # The chase over events (decode_chase) gives the walk's state before every tile: empty
    # slots, zero-length tiles under both zero-KV rules, few and many clusters.
    elem = ([st.integers(1, hi)] + ([st.just(0)] if zeros else [])
            + ([st.just(-1)] if empties else []))
    n = np.asarray(data.draw(st.lists(st.one_of(*elem), min_size=size, max_size=size)))
    payload = -(-int(np.where(n >= 0, n + ov, 0).sum()) // clusters) + ov
    bpc = payload - ov
    if bpc <= ov:  # the chase's precondition; make the clusters wider instead
        bpc = ov + 1 + data.draw(st.integers(0, 7))
        payload = bpc + ov
    params = FillParams(ov, parallel, tail_rule=False, empty_slots=True)
    # One shape for every size (one compile): trailing empty slots leave the states unchanged.
    nj = jnp.asarray(np.pad(n, (0, CHASE_TEST_SLOTS - size), constant_values=-1), jnp.int32)
    tiles = fill_inputs(nj, jnp.full(nj.shape, NEVER, jnp.int32), jnp.int32(payload),
                        jnp.int32(bpc), params=params)
    want = np.asarray(_fills(params, 4)[0](tiles, jnp.int32(payload), jnp.int32(bpc)))[:size]
    cu, remain = _chase_jit(params)(nj, jnp.int32(payload), jnp.int32(bpc))
    np.testing.assert_array_equal(np.asarray(cu)[:size], want[:, 0])
    np.testing.assert_array_equal(np.asarray(remain)[:size], want[:, 1])


@functools.lru_cache(maxsize=None)
def _pallas_walk(params, walk):
    return jax.jit(lambda t, p, b: fill_tiles_pallas(t, p, b, params=params, walk=walk,
                                                     interpret=True))


@pytest.mark.parametrize("walk", ["chase", "auto"])
@settings(max_examples=4)
@given(data=st.data())
def test_pallas_chase_matches_scan(walk, data):
    # The chase inside the Pallas walk kernel (interpret mode): forced, and chosen at run time
    # (lax.cond on bpc: either branch, depending on the drawn payload).
    params = FillParams(16, True, tail_rule=False, empty_slots=True)
    tiles, payload, bpc = data.draw(fill_cases(22, 16, params))
    want = np.asarray(_fills(params, 4)[0](tiles, payload, bpc))
    got = np.asarray(_pallas_walk(params, walk)(tiles, payload, bpc))
    np.testing.assert_array_equal(got, want)


def test_chase_refused_where_it_cannot_run():
    tiles = jnp.zeros((4, 8), jnp.int32)
    with pytest.raises(ValueError, match="tail rule"):
        fill_tiles_pallas(tiles, jnp.int32(20), jnp.int32(4), params=FillParams(16, True),
                          walk="chase", interpret=True)
    with pytest.raises(ValueError, match="walk must be one of"):
        fill_tiles_pallas(tiles, jnp.int32(20), jnp.int32(4), params=FillParams(16, True),
                          walk="parallel", interpret=True)
    with pytest.raises(ValueError, match=r"live_slots must be in \[1, 4\], got 5"):
        fill_tiles_pallas(tiles, jnp.int32(20), jnp.int32(4), params=FillParams(16, True),
                          live_slots=5, interpret=True)
    with pytest.raises(ValueError, match="tail-merge rule"):
        chase_states(jnp.zeros((4,), jnp.int32), 20, 4, params=FillParams(16, True))
    cfg = DecodePlanConfig(device=MI300X, num_heads=16, uni_seqlen_qo=1)
    z = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="walk must be one of .* got 'fast'"):
        plan_mla_decode_jit(z, z, z[:2], config=cfg, walk="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mi300x_h128_bf16_fold8", "h16_mtp4_gran1_tail",
                                  "gfx950_h64_fp8_mtp4_ragged_qo"])
@pytest.mark.parametrize("fill_impl", ["pallas", "fused"])
def test_compiled_pallas_fill_matches_oracle_gpu(name, fill_impl):
    cfg = FIXED[name]
    rng = np.random.default_rng(5)
    for b in (7, 300):
        kv_lens = rng.integers(0, 5000, b)
        kv_lens[rng.random(b) < 0.3] = 0
        qo_lens = (np.full(b, cfg.uni_seqlen_qo) if cfg.uniform_qo
                   else rng.integers(1, cfg.max_seqlen_qo + 1, b))
        got, ref = run_both(cfg, *make_inputs(kv_lens, qo_lens), fill_impl=fill_impl)
        assert_same(got, ref)


def test_plan_with_pallas_fill_matches_oracle():
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16, max_seqlen_qo=4,
                           uni_seqlen_qo=4, kv_granularity=4, is_causal=True)
    qo_indptr, kv_indptr, last = make_inputs([0, 3, 130, 0, 45, 7, 900], [4] * 7)
    got, ref = run_both(cfg, qo_indptr, kv_indptr, last, fill_impl="pallas")
    assert_same(got, ref)


# ---------------------------------------------------------------------------------------------
# Sizes (get_mla_metadata_info_v1) and the host-side decisions.


@pytest.mark.parametrize("kwargs, batch, expect", [
    # (num_cu+1, max_work, tile_cnt+1, max_split_tiles, max_qo_tiles_per_batch)
    (dict(device=MI300X, num_heads=128, uni_seqlen_qo=1), 64,
     (305, (64 + 303) * 8, 64 * 8 + 1, min(64 + 303, 2 * 303) * 8, 8)),   # ceil(128/16) = 8
    (dict(device=MI300X, num_heads=16), 512, (305, 815, 513, 606, 1)),     # 16 heads: /128
    (dict(device=MI355X, num_heads=16, q_dtype="fp8", kv_dtype="fp8", max_seqlen_qo=4,
          uni_seqlen_qo=4, experimental=True, max_split_per_batch=2), 4,
     (513, 515, 5, 515, 1)),                                                # occupancy 2
    (dict(device=MI355X, num_heads=128, max_seqlen_qo=2, uni_seqlen_qo=2), 3,
     (257, (3 + 255) * 2, 7, 258 * 2, 2)),                                  # gfx950 bf16: eff
    (dict(device=MI355X, num_heads=64), 10, (257, 265, 11, 265, 1)),        # gfx950 bf16 64: eff
    (dict(device=custom_device(8), num_heads=32, max_seqlen_qo=3, uni_seqlen_qo=3), 100,
     (9, 107 * 6, 601, 14 * 6, 6)),                                         # ceil(96/16)
])
def test_sizes_match_formula(kwargs, batch, expect):
    cfg = DecodePlanConfig(**kwargs)
    s = mla_decode_plan_sizes(batch, cfg)
    got = (s.work_indptr[0], s.work_info[0], s.reduce_indptr[0], s.reduce_partial_map[0],
           s.max_qo_tiles_per_batch)
    assert got == expect
    assert s.reduce_final_map == (batch * s.max_qo_tiles_per_batch, 2) and s.work_info[1] == 8


def test_host_decisions():
    fold = DecodePlanConfig(device=MI300X, num_heads=128, uni_seqlen_qo=1)
    assert (fold.qk_batch_ratio, fold.planner_num_heads, fold.overhead) == (8, 16, 16)
    assert fold.qo_splits is False and fold.planner(64) == "serial"  # folding -> serial
    native = DecodePlanConfig(device=MI300X, num_heads=128, q_dtype="fp8", kv_dtype="fp8")
    assert native.qk_batch_ratio == 1 and native.qo_splits is False
    assert native.planner(64) == "parallel"
    # LDS bound of the parallel planner: 4*(3+5B) + 4B <= 64 KiB on gfx942 (B <= 2730)
    assert native.planner(2730) == "parallel" and native.planner(2731) == "serial"
    uni = dataclasses.replace(native, uni_seqlen_qo=1)
    assert uni.planner(3276) == "parallel" and uni.planner(3277) == "serial"
    mtp = DecodePlanConfig(device=MI355X, num_heads=64, q_dtype="fp8", kv_dtype="fp8",
                           max_seqlen_qo=4)
    assert mtp.qo_splits and mtp.packed_qo_len_per_wg == 128 and mtp.num_qo_tiles(4) == 2
    assert mtp.num_qo_tiles(1) == 1 and mtp.planner(4) == "serial"
    assert DecodePlanConfig(device=MI300X, num_heads=16, page_size=64).overhead == 1
    assert DecodePlanConfig(device=MI300X, num_heads=16, page_size=4).overhead == 4
    exp = DecodePlanConfig(device=MI355X, num_heads=16, q_dtype="fp8", kv_dtype="fp8",
                           max_seqlen_qo=4, uni_seqlen_qo=4, experimental=True)
    assert exp.occupancy == 2 and exp.num_cu == 512
    capped = DecodePlanConfig(device=MI300X, num_heads=16, max_split_per_batch=2)
    assert capped.num_splits(10) == 20 and capped.num_splits(1000) == 304


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=128, page_size=48), r"page_size=48.*power of two"),
    (dict(num_heads=16, kv_granularity=24), r"kv_granularity=24.*power of two"),
    (dict(num_heads=12), r"num_heads=12.*multiple of 8"),
    (dict(num_heads=24), r"num_heads=24.*not supported"),
    (dict(num_heads=16, q_dtype="fp16"), r"q_dtype='fp16'"),
    (dict(num_heads=16, num_heads_k=2), r"num_heads_k=2"),
    (dict(num_heads=16, max_seqlen_qo=0), r"max_seqlen_qo=0"),
    (dict(num_heads=16, max_seqlen_qo=2, uni_seqlen_qo=3), r"uni_seqlen_qo=3"),
    (dict(num_heads=128), r"uni_seqlen_qo=-1.*folded"),
    (dict(num_heads=128, uni_seqlen_qo=1, page_size=16), r"page_size=16.*folded"),
    (dict(num_heads=16, max_split_per_batch=0), r"max_split_per_batch=0"),
    (dict(num_heads=16, zero_kv_behaviour="fast"), r"zero_kv_behaviour='fast'"),
    (dict(num_heads=16, max_seqlen_qo=2, zero_kv_behaviour="parallel"),
     r"zero_kv_behaviour='parallel'"),
    (dict(num_heads=16, is_causal=1), r"is_causal=1"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodePlanConfig(device=MI300X, **kwargs)


def test_config_is_hashable_static():
    a = DecodePlanConfig(device=MI300X, num_heads=16)
    b = DecodePlanConfig(device=MI300X, num_heads=16)
    assert a == b and hash(a) == hash(b)


# ---------------------------------------------------------------------------------------------
# Input checks: eager calls check values (NumPy), the checkify variant says the same under jit.


@functools.lru_cache(maxsize=None)
def _checked_decode_inputs(cfg):
    return jax.jit(checked(lambda q, k, lp: check_decode_plan_inputs(q, k, lp, config=cfg)))


def test_eager_plan_accepts_int64_host_inputs_that_fit():
    # the inputs and config of test_zero_kv_parallel_vs_serial[parallel]: the same jit compile
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16)
    qo_indptr, kv_indptr, last = make_inputs([141, 0, 226, 0, 10, 43, 246], [1] * 7)
    got = plan_mla_decode(qo_indptr.astype(np.int64), kv_indptr.astype(np.int64),
                          last.astype(np.int64), config=cfg, fill_impl="scan")
    assert_same(jax.tree.map(np.asarray, got),
                plan_mla_decode_reference(qo_indptr, kv_indptr, last, config=cfg))
    err, _ = _checked_decode_inputs(cfg)(*(jnp.asarray(x) for x in (qo_indptr, kv_indptr, last)))
    assert err.get() is None


@pytest.mark.parametrize("kv_indptr, match", [
    ([0, 2_000_000_000, -294_967_296, 0, 0, 0, 0, 0],
     r"kv_indptr\[2\] = -294967296 is negative.*int32 limit"),
    ([0, 300, 100, 100, 100, 100, 100, 100],
     r"kv_indptr must be non-decreasing: kv_indptr\[2\] = 100 < kv_indptr\[1\]"),
    ([0, 1, 2, 3, 4, 5, 2_147_483_640, 2_147_483_641],
     r"total kv length 2147483641 .* int32 limit 2147483647"),
])
def test_eager_and_checkify_input_checks_agree(kv_indptr, match):
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16)
    args = (np.arange(8, dtype=np.int32), np.array(kv_indptr, np.int32), np.ones(7, np.int32))
    with pytest.raises(ValueError, match=match):
        plan_mla_decode(*args, config=cfg)
    err, _ = _checked_decode_inputs(cfg)(*(jnp.asarray(x) for x in args))
    assert re.search(match, err.get())
