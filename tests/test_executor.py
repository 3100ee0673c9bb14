"""The plan executor: running decode and prefill WorkPlans (per-work partials + mla_reduce_v1 merge)
must give `mla_attention_reference`'s output for every valid plan, at page sizes 1, 16 and 64; and
the seed reproduced: a prefill plan with the legacy page-granular pairing, forced through, is far
from the reference, while the default (token-granular) pairing matches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.executor import PagedKVMetadata, plan_spans, run_work_plan
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MI300X, MLADims, custom_device
from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode_jit
from funcmla.planners.prefill import PrefillPlanConfig, plan_ps_prefill

D, DV, SCALE = 576, 512, MLADims().sm_scale
POOL_SLOTS = 2048  # static pool rows for every page size (one compile per executor config)
B = 4  # static batch (padded with empty requests)
T_ROWS = 256  # static query rows (prefill)
KV_SPAN = 256  # static max tokens per work / per request
Q_GRAN = 16  # prefill qlen_granularity in these tests (small tiles, several per request)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def paged_layout(kv_lens, page_size, rng):
    """Random pages (page 0 reserved) for each request. Returns token slots per request (token
    CSR), page ids per request (page CSR) and kv_last_page_len."""
    num_pages = POOL_SLOTS // page_size - 1
    pages_per = [-(-int(n) // page_size) for n in kv_lens]
    assert sum(pages_per) <= num_pages
    perm = rng.permutation(np.arange(1, num_pages + 1))
    tok, pages, k = [], [], 0
    for n, p in zip(kv_lens, pages_per):
        pg = perm[k : k + p]
        k += p
        t = np.arange(n)
        tok.append(pg[t // page_size] * page_size + t % page_size)
        pages.append(pg)
    last = np.array([(int(n) - 1) % page_size + 1 if n else 0 for n in kv_lens], np.int32)
    return tok, pages, last


def csr(chunks, capacity):
    indptr = np.concatenate([[0], np.cumsum([len(c) for c in chunks])]).astype(np.int32)
    flat = np.zeros(capacity, np.int32)
    flat[: indptr[-1]] = np.concatenate(chunks) if indptr[-1] else []
    return jnp.asarray(indptr), jnp.asarray(flat)


def random_qkv(rows, heads, seed):
    kq, kp = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kq, (rows, heads, D), jnp.float32),
            jax.random.normal(kp, (POOL_SLOTS, D), jnp.float32))


# ---- prefill plans ----------------------------------------------------------------------------

PREFILL_KW = dict(device=custom_device(8), num_heads_k=2, gqa_ratio=2, max_qlen=64,
                  qlen_granularity=Q_GRAN)
KV_GRAN = 32  # small split unit, so that tiles get split across TGs (partials + reduce)
PREFILL_H = 4


def prefill_meta(qo_lens, prefix, page_size, seed=0):
    """Token-granular metadata over a paged pool (random pages from `seed`), and each
    request's context length (prefix + queries)."""
    rng = np.random.default_rng(seed)
    qo_lens = np.pad(np.asarray(qo_lens), (0, B - len(qo_lens)))
    ctx = qo_lens + np.pad(np.asarray(prefix), (0, B - len(prefix)))
    tok, _, _ = paged_layout(ctx, page_size, rng)
    kv_indptr, kv_indices = csr(tok, POOL_SLOTS)
    qo_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32))
    return PagedKVMetadata(qo_indptr, kv_indptr, kv_indices, jnp.ones((B,), jnp.int32)), ctx


def prefill_case(qo_lens, prefix, page_size, *, causal, legacy=False, seed=0):
    """`prefill_meta`'s metadata, a prefill plan, the executor and the reference."""
    meta, ctx = prefill_meta(qo_lens, prefix, page_size, seed)
    qo_indptr, kv_indptr, kv_indices = meta.qo_indptr, meta.kv_indptr, meta.kv_indices
    if legacy:
        cfg = PrefillPlanConfig.legacy_page_granular(page_size, is_causal=causal, **PREFILL_KW)
    else:
        cfg = PrefillPlanConfig(is_causal=causal, kvlen_granularity=KV_GRAN, **PREFILL_KW)
    plan = plan_ps_prefill(qo_indptr, kv_indptr, jnp.asarray(ctx, jnp.int32), config=cfg)
    q, pool = random_qkv(T_ROWS, PREFILL_H, seed)
    out, lse = run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=Q_GRAN,
                             max_kv_span=KV_SPAN, causal=causal, allow_legacy_mismatch=legacy)
    ref_out, ref_lse = mla_attention_reference(q, pool, qo_indptr, kv_indptr, kv_indices,
                                               sm_scale=SCALE, causal=causal, max_kv_len=KV_SPAN)
    return plan, meta, (out, lse), (ref_out, ref_lse)


def assert_matches(got, ref):
    (out, lse), (ref_out, ref_lse) = got, ref
    assert np.all(np.isfinite(np.asarray(out)))
    assert rel_err(out, ref_out) < 1e-5
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    assert rel_err(np.asarray(lse)[fin], np.asarray(ref_lse)[fin]) < 1e-5


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
@settings(max_examples=8)
@given(data=st.data())
def test_prefill_plans_match_reference(data):
    """Causal prefill (the kernel's mode; the non-causal planner path is covered against the
    oracle in test_planner_prefill.py), page sizes 1/16/64 of the pool behind the token CSR."""
    n = data.draw(st.integers(1, B))
    qo = data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    prefix = data.draw(st.lists(st.sampled_from([0, 1, 31, 100, 150]), min_size=n, max_size=n))
    page_size = data.draw(st.sampled_from([1, 16, 64]))
    plan, _, got, ref = prefill_case(qo, prefix, page_size, causal=True,
                                     seed=data.draw(st.integers(0, 99)))
    assert_matches(got, ref)


@functools.cache
def split_prefill_case():
    """The split prefill batch, run once per process (this test and the poisoned-rows test
    read it)."""
    return prefill_case([64, 64, 50, 7], [150, 0, 3, 100], 16, causal=True)


def test_prefill_split_tiles_are_reduced():
    """A batch large enough that tiles are split across TGs (partials + reduce) still matches."""
    plan, _, got, ref = split_prefill_case()
    assert int(plan.num_partials) >= 4
    assert_matches(got, ref)


# ---- the seed: legacy pairing at page size 64 ---------------------------------------------------


def test_seed_legacy_pairing_is_refused_and_wrong_when_forced(capsys):
    qo, prefix = [64, 48, 64, 33], [150, 0, 64, 17]
    meta, _ = prefill_meta(qo, prefix, 64)
    legacy_cfg = PrefillPlanConfig.legacy_page_granular(64, **PREFILL_KW)
    legacy_plan = plan_ps_prefill(meta.qo_indptr, meta.kv_indptr, jnp.diff(meta.kv_indptr),
                                  config=legacy_cfg)
    q, pool = random_qkv(T_ROWS, PREFILL_H, 0)
    with pytest.raises(ValueError, match=r"block_size=64 but kv_indices entries hold page_size=1"):
        run_work_plan(q, pool, meta, legacy_plan, sm_scale=SCALE, max_qo_span=Q_GRAN,
                      max_kv_span=KV_SPAN)
    errs = {}
    for page_size in (1, 16, 64):
        _, _, got, ref = prefill_case(qo, prefix, page_size, causal=True)
        assert_matches(got, ref)  # the fix: token-granular plan, right at every page size
    plan, _, (out, _), (ref_out, _) = prefill_case(qo, prefix, 64, causal=True, legacy=True)
    assert plan.legacy and plan.block_size == 64
    err = rel_err(out, ref_out)
    with capsys.disabled():
        print(f"\n[seed] legacy pairing (block_size 64) forced through the executor: rel err {err:.3f}")
    assert err > 0.1


# ---- decode plans -----------------------------------------------------------------------------

DECODE_CONFIGS = {
    # page size 16 and 64 (page CSR: kv_indptr in pages, kv_indices page ids)
    "ps16_h16": (DecodePlanConfig(device=custom_device(8), num_heads=16, page_size=16,
                                  kv_granularity=16), 16),
    "ps64_h16": (DecodePlanConfig(device=custom_device(8), num_heads=16, page_size=64,
                                  kv_granularity=64), 64),
    # page size 1 (token CSR), MTP (2 tokens, causal) and head folding: 32 bf16 heads on gfx942
    # fold to 16 heads x 2 batches
    "ps1_h32_fold2_mtp2": (DecodePlanConfig(device=custom_device(8, "gfx942"), num_heads=32,
                                            max_seqlen_qo=2, uni_seqlen_qo=2, is_causal=True), 1),
}


def decode_case(name, kv_lens, seed=0):
    cfg, page_size = DECODE_CONFIGS[name]
    rng = np.random.default_rng(seed)
    tok, pages, last = paged_layout(kv_lens, page_size, rng)
    uni = max(cfg.uni_seqlen_qo, 1)
    qo_indptr = jnp.arange(B + 1, dtype=jnp.int32) * uni
    tok_indptr, tok_indices = csr(tok, POOL_SLOTS)
    if page_size == 1:
        meta = PagedKVMetadata(qo_indptr, tok_indptr, tok_indices, jnp.ones((B,), jnp.int32))
    else:
        pg_indptr, pg_indices = csr(pages, POOL_SLOTS)
        meta = PagedKVMetadata(qo_indptr, pg_indptr, pg_indices, jnp.asarray(last))
    plan = plan_mla_decode_jit(qo_indptr, meta.kv_indptr, meta.kv_last_page_len, config=cfg)
    q, pool = random_qkv(B * uni, cfg.num_heads, seed)
    out, lse = run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=uni,
                             max_kv_span=KV_SPAN, page_size=page_size, causal=True,
                             qk_batch_ratio=cfg.qk_batch_ratio, uni_seqlen_qo=uni)
    ref = mla_attention_reference(q, pool, qo_indptr, tok_indptr, tok_indices, sm_scale=SCALE,
                                  causal=True, max_kv_len=KV_SPAN)
    return plan, meta, (out, lse), ref


@pytest.mark.parametrize("name", list(DECODE_CONFIGS))
@settings(max_examples=4)
@given(kv_lens=st.lists(st.integers(3, KV_SPAN), min_size=B, max_size=B),
       seed=st.integers(0, 99))
def test_decode_plans_match_reference(name, kv_lens, seed):
    plan, _, got, ref = decode_case(name, kv_lens, seed)
    assert_matches(got, ref)


@functools.cache
def fixed_decode_case(name):
    """decode_case(name) of one fixed batch, run once per process (this test and the
    poisoned-rows test read it)."""
    return decode_case(name, [250, 3, 200, 77])


def test_decode_split_and_fold_cover_partials():
    plan, _, got, ref = fixed_decode_case("ps1_h32_fold2_mtp2")
    assert int(plan.num_partials) > 0  # split-KV works, merged by the reduce
    assert_matches(got, ref)


# ---- executor contract ------------------------------------------------------------------------


def test_span_too_small_poisons_output_instead_of_clamping():
    meta, _ = prefill_meta([64], [150], 1)
    plan = plan_ps_prefill(meta.qo_indptr, meta.kv_indptr, jnp.diff(meta.kv_indptr),
                           config=PrefillPlanConfig(kvlen_granularity=KV_GRAN, **PREFILL_KW))
    need_q, need_kv = plan_spans(plan, meta)
    assert need_q == Q_GRAN and need_kv > 16
    q, pool = random_qkv(T_ROWS, PREFILL_H, 0)
    out, lse = run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=Q_GRAN,
                             max_kv_span=16)
    assert np.all(np.isnan(np.asarray(out))) and np.all(np.isnan(np.asarray(lse)))


def test_executor_static_errors():
    meta, _ = prefill_meta([8], [0], 1)
    plan = plan_ps_prefill(meta.qo_indptr, meta.kv_indptr, jnp.diff(meta.kv_indptr),
                           config=PrefillPlanConfig(kvlen_granularity=KV_GRAN, **PREFILL_KW))
    q, pool = random_qkv(T_ROWS, PREFILL_H, 0)
    with pytest.raises(ValueError, match=r"plan block_size=1 but kv_indices entries hold page_size=16"):
        run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=8, max_kv_span=8,
                      page_size=16)
    with pytest.raises(ValueError, match=r"max_kv_span must be a positive int, got 0"):
        run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=8, max_kv_span=0)
    with pytest.raises(ValueError, match=r"qk_batch_ratio=2 needs a decode plan"):
        run_work_plan(q, pool, meta, plan, sm_scale=SCALE, max_qo_span=8, max_kv_span=8,
                      qk_batch_ratio=2, uni_seqlen_qo=1)
    with pytest.raises(ValueError, match=r"expected q \[T, H, D\]"):
        run_work_plan(q[0], pool, meta, plan, sm_scale=SCALE, max_qo_span=8, max_kv_span=8)


# ---- unused rows never reach an output --------------------------------------------------------


def live_slots(meta, page_size):
    """Token slots of every live KV token of `meta` (token CSR or page CSR)."""
    indptr, idx = np.asarray(meta.kv_indptr), np.asarray(meta.kv_indices)
    last = np.asarray(meta.kv_last_page_len)
    slots = []
    for b in range(len(indptr) - 1):
        ent = idx[indptr[b]:indptr[b + 1]]
        if page_size == 1:
            slots.append(ent)
        elif len(ent):
            n = (len(ent) - 1) * page_size + last[b]
            t = np.arange(n)
            slots.append(ent[t // page_size] * page_size + t % page_size)
    return np.concatenate(slots) if slots else np.zeros(0, np.int64)


@pytest.mark.parametrize("case", ["prefill_split_ps16", "decode_ps16", "decode_fold_mtp"])
def test_poisoned_unused_rows_change_nothing(case):
    """NaN, +Inf and -Inf in the reserved page 0, in every pool row no request uses and in q's
    padding rows: the executor's output is bitwise the clean one (masked positions are selected
    away, never multiplied by zero)."""
    if case == "prefill_split_ps16":
        plan, meta, got, _ = split_prefill_case()
        page_size, kw = 1, dict(max_qo_span=Q_GRAN, max_kv_span=KV_SPAN)
        q, pool = random_qkv(T_ROWS, PREFILL_H, 0)
    else:
        name = "ps16_h16" if case == "decode_ps16" else "ps1_h32_fold2_mtp2"
        plan, meta, got, _ = fixed_decode_case(name)
        cfg, page_size = DECODE_CONFIGS[name]
        uni = max(cfg.uni_seqlen_qo, 1)
        kw = dict(max_qo_span=uni, max_kv_span=KV_SPAN, page_size=page_size,
                  qk_batch_ratio=cfg.qk_batch_ratio, uni_seqlen_qo=uni)
        q, pool = random_qkv(B * uni, cfg.num_heads, 0)
    used = np.zeros(POOL_SLOTS, bool)
    used[live_slots(meta, page_size)] = True
    assert not used[0] and used.sum() < POOL_SLOTS - 100
    poison = jnp.asarray(np.resize([np.nan, np.inf, -np.inf], POOL_SLOTS), jnp.float32)
    bad_pool = jnp.where(jnp.asarray(used)[:, None], pool, poison[:, None])
    rows = int(meta.qo_indptr[-1])
    bad_q = q.at[rows:].set(jnp.nan) if rows < q.shape[0] else q
    out, lse = run_work_plan(bad_q, bad_pool, meta, plan, sm_scale=SCALE, causal=True, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(got[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(got[1]))
