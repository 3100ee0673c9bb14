"""Plan validators: valid decode and prefill plans have no problems; the seed (a prefill plan with
the legacy page-64 pairing over a token CSR) is flagged; corrupted plans are flagged with the field,
position and value named, by the NumPy host helper and by the checkify checks under jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.executor import PagedKVMetadata
from funcmla.checks import checked
from funcmla.config import custom_device
from funcmla.layout import TokenCSR
from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode_jit
from funcmla.planners.prefill import (
    PrefillPlanConfig,
    check_plan_matches_metadata,
    plan_ps_prefill,
)
from funcmla.planners.validate import check_work_plan, plan_problems

B = 4
PREFILL = PrefillPlanConfig(device=custom_device(8), num_heads_k=2, gqa_ratio=2, max_qlen=64,
                            qlen_granularity=16, kvlen_granularity=32)
LEGACY64 = PrefillPlanConfig.legacy_page_granular(64, device=custom_device(8), num_heads_k=2,
                                                  gqa_ratio=2, max_qlen=64, qlen_granularity=16)
DECODE = DecodePlanConfig(device=custom_device(8, "gfx942"), num_heads=32, max_seqlen_qo=2,
                          uni_seqlen_qo=2, is_causal=True)  # folds 32 heads to 16 x 2
DECODE_PS16 = DecodePlanConfig(device=custom_device(8), num_heads=16, page_size=16,
                               kv_granularity=16)


def token_meta(qo_lens, ctx):
    qo_lens = np.pad(np.asarray(qo_lens), (0, B - len(qo_lens)))
    ctx = np.pad(np.asarray(ctx), (0, B - len(ctx)))
    qo_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32))
    kv_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32))
    return PagedKVMetadata(qo_indptr, kv_indptr, jnp.zeros((1024,), jnp.int32),
                           jnp.ones((B,), jnp.int32)), jnp.asarray(ctx, jnp.int32)


def prefill_plan(qo_lens, prefix, cfg=PREFILL):
    ctx = np.asarray(qo_lens) + np.asarray(prefix)
    meta, ctx = token_meta(qo_lens, ctx)
    return plan_ps_prefill(meta.qo_indptr, meta.kv_indptr, ctx, config=cfg), meta


def decode_plan(kv_lens):
    meta, _ = token_meta([2] * B, kv_lens)
    plan = plan_mla_decode_jit(meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len, config=DECODE)
    return plan, meta


def decode_problems(plan, meta):
    return plan_problems(plan, meta, qk_batch_ratio=2, uni_seqlen_qo=2)


def replace(plan, **fields):
    arrays = {k: jnp.asarray(v, jnp.int32) for k, v in fields.items()}
    return dataclasses.replace(plan, **arrays)


def edit(arr, index, value):
    a = np.array(arr)
    a[index] = value
    return a


# ---- valid plans ------------------------------------------------------------------------------


@settings(max_examples=15)
@given(qo=st.lists(st.integers(0, 64), min_size=1, max_size=B),
       prefix=st.lists(st.sampled_from([0, 1, 31, 100, 150]), min_size=B, max_size=B),
       causal=st.booleans())
def test_valid_prefill_plans_have_no_problems(qo, prefix, causal):
    cfg = dataclasses.replace(PREFILL, is_causal=causal)
    plan, meta = prefill_plan(qo, prefix[: len(qo)], cfg)
    assert plan_problems(plan, meta, causal=causal, num_heads=4) == []


@settings(max_examples=15)
@given(kv_lens=st.lists(st.integers(0, 600), min_size=B, max_size=B))
def test_valid_decode_plans_have_no_problems(kv_lens):
    kv_lens = [max(n, 2) for n in kv_lens]  # causal MTP: at least as many keys as queries
    plan, meta = decode_plan(kv_lens)
    assert decode_problems(plan, meta) == []


@settings(max_examples=10)
@given(kv_lens=st.lists(st.integers(1, 900), min_size=B, max_size=B))
def test_valid_page_granular_decode_plans_have_no_problems(kv_lens):
    pages = [-(-n // 16) for n in kv_lens]
    last = [(n - 1) % 16 + 1 for n in kv_lens]
    kv_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32))
    meta = PagedKVMetadata(jnp.arange(B + 1, dtype=jnp.int32), kv_indptr,
                           jnp.zeros((256,), jnp.int32), jnp.asarray(last, jnp.int32))
    plan = plan_mla_decode_jit(meta.qo_indptr, kv_indptr, meta.kv_last_page_len, config=DECODE_PS16)
    assert plan_problems(plan, meta, page_size=16) == []
    # the same plan read as a token CSR (1 token per entry) is flagged
    assert any("block_size = 16 but kv_indices entries hold 1 token" in p
               for p in plan_problems(plan, meta, page_size=1))


# ---- the seed -------------------------------------------------------------------------------


def test_seed_legacy_pairing_is_flagged():
    qo, prefix = [64, 48, 64, 33], [150, 0, 64, 17]
    plan, meta = prefill_plan(qo, prefix, LEGACY64)
    problems = plan_problems(plan, meta, num_heads=4, max_per_check=1000)
    text = "\n".join(problems)
    assert "plan.block_size = 64 but kv_indices entries hold 1 token(s)" in text
    assert ("request 0: kv_indptr[1] - kv_indptr[0] = 214 entries, but its 214 tokens are 4 "
            "entries at the plan's block_size = 64") in text
    # tile [0, 16) of request 0 needs 150 + 16 keys: 2 units of 128 tokens = 4 entries of 64 to
    # the planner, 4 tokens to a kernel reading the token CSR
    for heads in ("[0, 2)", "[2, 4)"):
        assert (f"tile (batch 0, qo [0, 16), heads {heads}) needs 166 KV tokens but its works cover "
                "entries [0, 4) = 4 tokens at 1 token(s) per entry (plan block_size = 64)") in text
    kv = TokenCSR(indptr=meta.kv_indptr, indices=meta.kv_indices)
    with pytest.raises(ValueError, match="block_size=64"):
        check_plan_matches_metadata(plan, kv)
    # the default (token-granular) pairing on the same batch is clean
    good, _ = prefill_plan(qo, prefix)
    assert plan_problems(good, meta, num_heads=4) == []
    check_plan_matches_metadata(good, kv)


# ---- corrupted plans: every problem names the field, position and value -----------------------


def test_corrupted_prefill_plans_are_named():
    plan, meta = prefill_plan([64, 48, 64, 33], [150, 0, 64, 17])
    assert plan_problems(plan, meta, num_heads=4) == []
    wi = np.asarray(plan.work_info)
    nw = int(plan.num_works)
    split = [w for w in range(nw) if wi[w, 1] >= 0]
    w1 = split[1]  # a second fragment of a split tile
    cases = [
        (dict(work_indptr=edit(plan.work_indptr, 2, 0)),
         "work_indptr must be non-decreasing: work_indptr[2] = 0 < work_indptr[1]"),
        (dict(work_indptr=edit(plan.work_indptr, 0, 1)), "work_indptr[0] = 1 must be 0"),
        (dict(work_info=edit(wi, (w1, 4), wi[w1, 4] + 1)),
         f"work_info[{w1}].kv_start = {wi[w1, 4] + 1} but the previous fragment ends at {wi[w1, 4]}"),
        (dict(work_info=edit(wi, (0, 0), 9)), "work_info[0].batch_idx = 9 is outside [0, 4)"),
        (dict(work_info=edit(wi, (0, 6), -5)), "work_info[0].kv_offset = -5 is outside"),
        (dict(work_info=edit(wi, (split[0], 1), -1)),
         f"but work_info[{split[0]}] writes the final output"),
        (dict(num_works=nw - 1), f"num_works = {nw - 1} differs from work_indptr[-1] = {nw}"),
        (dict(reduce_partial_map=edit(plan.reduce_partial_map, 1, plan.reduce_partial_map[0])),
         "reduce_partial_map[1] = "),
        (dict(reduce_indptr=edit(plan.reduce_indptr, 1, 1)),
         "reduce group 0 (reduce_final_map = ["),
        (dict(reduce_final_map=edit(plan.reduce_final_map, (0, 1), 1000)),
         "no reduce group for that qo range lists it"),
    ]
    for fields, needle in cases:
        problems = plan_problems(replace(plan, **fields), meta, num_heads=4)
        assert any(needle in p for p in problems), (needle, problems)
    # a missing head range: rows of heads 2..3 not covered
    keep = wi[:nw][(wi[:nw, 7] & 0xFFFF) == 0]
    wi2 = np.zeros_like(wi)
    wi2[: len(keep)] = keep
    problems = plan_problems(replace(plan, work_info=wi2, num_works=len(keep),
                                     work_indptr=np.minimum(plan.work_indptr, len(keep))),
                             meta, num_heads=4)
    assert any("row 0, head 2 is covered by 0 tiles (must be exactly 1)" in p for p in problems)
    # metadata side: kv_indptr must start at 0
    shifted = meta._replace(kv_indptr=meta.kv_indptr + 3)
    assert any("kv_indptr[0] = 3 must be 0" in p for p in plan_problems(plan, shifted, num_heads=4))


def test_corrupted_decode_plans_are_named():
    plan, meta = decode_plan([2000, 30, 1500, 77])
    assert decode_problems(plan, meta) == []
    wi = np.asarray(plan.work_info)
    nw = int(plan.num_works)
    split = [w for w in range(nw) if wi[w, 1] >= 0]
    last_frag = split[-1]
    short = edit(wi, (last_frag, 5), wi[last_frag, 5] - 3)
    problems = decode_problems(replace(plan, work_info=short), meta)
    assert any("needs" in p and "KV tokens but its works cover entries" in p for p in problems), problems
    overlap = edit(wi, (split[1], 1), wi[split[0], 1])
    problems = decode_problems(replace(plan, work_info=overlap), meta)
    assert any("partial rows overlap" in p or "is written by" in p for p in problems), problems
    grp_final = edit(plan.reduce_final_map, (0, 0), 3)
    problems = decode_problems(replace(plan, reduce_final_map=grp_final), meta)
    assert any("no reduce group for that qo range lists it" in p for p in problems), problems


# ---- checkify (under jit) ----------------------------------------------------------------------


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
def test_checkify_checks_under_jit():
    plan, meta = prefill_plan([64, 48, 64, 33], [150, 0, 64, 17])
    legacy, _ = prefill_plan([64, 48, 64, 33], [150, 0, 64, 17], LEGACY64)

    @jax.jit
    def run(plan, meta):
        err, _ = checked(lambda p, m: check_work_plan(p, m, num_rows=256, num_heads=4))(plan, meta)
        return err

    assert run(plan, meta).get() is None
    wi = np.asarray(plan.work_info)
    w1 = [w for w in range(int(plan.num_works)) if wi[w, 1] >= 0][1]
    bad = replace(plan, work_info=edit(wi, (w1, 4), wi[w1, 4] + 1))
    msg = run(bad, meta).get()
    assert f"work_info[{w1}].kv_start = {wi[w1, 4] + 1} but the previous fragment ends at" in msg
    # the seed with its label stripped (block_size claims 1): the coverage check still flags it
    # (same static shape as the plans above, so no recompile)
    unlabelled = dataclasses.replace(legacy, block_size=1, legacy=False)
    msg = run(unlabelled, meta).get()
    assert "needs 166 KV tokens but its works cover entries [0, 4) = 4 tokens" in msg


def test_parallel_decode_planner_zero_kv_rows_are_flagged():
    """AITER's parallel decode planner emits no work for a zero-length KV
    request that lands on a full cluster, so its output row is never written; the serial planner
    emits an empty work. The row-coverage check tells them apart."""
    lens = [100, 100, 0, 0]
    kv_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    meta = PagedKVMetadata(jnp.arange(B + 1, dtype=jnp.int32), kv_indptr,
                           jnp.zeros((256,), jnp.int32), jnp.ones((B,), jnp.int32))
    problems = {}
    for behaviour in ("parallel", "serial"):
        cfg = DecodePlanConfig(device=custom_device(4), num_heads=16, zero_kv_behaviour=behaviour)
        plan = plan_mla_decode_jit(meta.qo_indptr, kv_indptr, meta.kv_last_page_len, config=cfg)
        problems[behaviour] = plan_problems(plan, meta, causal=False)
    assert problems["parallel"] == ["row 2, head 0 is covered by 0 tiles (must be exactly 1)",
                                    "row 3, head 0 is covered by 0 tiles (must be exactly 1)"]
    assert problems["serial"] == []
