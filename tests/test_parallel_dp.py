"""DP attention: the batch split (SGLang's round robin and shortest queue), per-rank metadata
and plans from the single-device builders at each rank's own capacities and CU count, padded
plans still valid, and attention over 2 or 4 ranks (one IDLE) gathered back to the global
order equal to the single-device result. Each rank's pool holds only its own requests' rows;
every other row is NaN, so a rank reading another's KV shows up."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims, custom_device
from funcmla.metadata import BufferPlan, decode_metadata
from funcmla.parallel import (
    DPLayout,
    DPRank,
    build_dp_step,
    check_split,
    dp_attention,
    gather_global,
    make_mesh,
    rank_rows,
    rank_step,
    split_batch,
    stack_pools,
    stack_rows,
)
from funcmla.parallel.dp_schedule import shortest_queue_budget
from funcmla.planners import DecodePlanConfig, plan_mla_decode, plan_problems
from tests.pools import attention_oracle_f64, scattered_requests

D, DV, SCALE = 576, 512, MLADims().sm_scale
N, CTX, SLOTS = 7, 40, 320


# ------------------------------------------------------------------------------ the split

def test_round_robin_cycles_and_carries_its_counter():
    s = split_batch(5, 3, policy="round_robin", counter=1)
    assert s.rank_of.tolist() == [1, 2, 0, 1, 2] and s.counter == 0
    assert [r.tolist() for r in s.requests] == [[2], [0, 3], [1, 4]]
    assert s.slot_of.tolist() == [0, 0, 0, 1, 1]
    s2 = split_batch(2, 3, policy="round_robin", counter=s.counter)
    assert s2.rank_of.tolist() == [0, 1]


def test_pinned_requests_skip_the_counter():
    s = split_batch(4, 2, policy="round_robin", pinned=[1, -1, 1, -1])
    assert s.rank_of.tolist() == [1, 0, 1, 1] and s.counter == 0


def test_shortest_queue_levels_then_round_robins():
    """SGLang's DPBudget: loads [3, 0, 1] -> rank 1 once (to 1), ranks 1 and 2 twice (to 3),
    then round robin from rank 0."""
    assert shortest_queue_budget([3, 0, 1]) == [1, 1, 2, 1, 2]
    s = split_batch(7, 3, policy="shortest_queue", loads=[3, 0, 1])
    assert s.rank_of.tolist() == [1, 1, 2, 1, 2, 0, 1]


@given(st.lists(st.integers(0, 12), min_size=1, max_size=6), st.integers(0, 40),
       st.sampled_from(["round_robin", "shortest_queue"]))
def test_split_invariants(loads, n, policy):
    """Every request lands exactly once; shortest queue never lifts a rank above the busiest
    one before all are level, and leaves them within one of each other once the requests
    cover the gap; round robin from level ranks leaves them within one."""
    dp = len(loads)
    s = split_batch(n, dp, policy=policy, loads=loads)
    assert sorted(np.concatenate(s.requests).tolist()) == list(range(n))
    for r, ids in enumerate(s.requests):
        assert (s.rank_of[ids] == r).all() and s.slot_of[ids].tolist() == list(range(len(ids)))
    counts = np.bincount(s.rank_of, minlength=dp)
    if policy == "shortest_queue":
        final = np.asarray(loads) + counts
        gap = sum(max(loads) - x for x in loads)
        if n <= gap:
            assert final.max() <= max(loads)
        else:
            assert final.max() - final.min() <= 1
    else:
        assert counts.max() - counts.min() <= 1


# ------------------------------------------------------------------------ a global problem

plan_jit = jax.jit(plan_mla_decode, static_argnames=("config",))


def global_problem(heads, seed=0):
    """N requests (one empty) laid out in one slot space; q, pool, and the reference."""
    rng = np.random.default_rng(seed)
    lens, req_to_token, rpi = scattered_requests(rng, N, CTX, SLOTS, empty=2)
    q = rng.standard_normal((N, heads, D)).astype(np.float32)
    pool = rng.standard_normal((SLOTS, D)).astype(np.float32)
    md = decode_metadata(req_to_token, rpi, lens, capacity=N * CTX)
    o64, l64 = attention_oracle_f64(q, pool, np.asarray(md.qo_indptr), np.asarray(md.kv_indptr),
                                    np.asarray(md.kv_indices), SCALE, DV)
    return dict(lens=lens, req_to_token=req_to_token, rpi=rpi, q=q, pool=pool, md=md,
                o64=o64, l64=l64)


def rank_pools(g, split):
    """Each rank's own pool: its requests' rows, the reserved row 0 zero, NaN elsewhere."""
    pools = []
    for ids in split.requests:
        p = np.full_like(g["pool"], np.nan)
        p[0] = 0.0
        for i in ids:
            own = g["req_to_token"][g["rpi"][i], : g["lens"][i]]
            p[own] = g["pool"][own]
        pools.append(p)
    return pools


def layout_for(split, heads_local, *, extra=(0, 1, 2, 0)):
    """Per-rank capacities that differ (max_bs = batch + 0..2, own context bound) and CU
    counts that differ (4, 6, 8, 10)."""
    ranks = tuple(
        DPRank(BufferPlan(max_bs=max(1, len(ids)) + extra[r % 4], max_context_len=CTX + 8 * r),
               custom_device(4 + 2 * r))
        for r, ids in enumerate(split.requests))
    return DPLayout(ranks, DecodePlanConfig(device=custom_device(4), num_heads=heads_local))


def run_dp(g, split, layout, mesh, impl, **static):
    check_split(layout, split, g["lens"])
    inputs = [(g["req_to_token"], g["rpi"][ids], g["lens"][ids]) for ids in split.requests]
    step = build_dp_step(layout, mesh, inputs)
    q = stack_rows(rank_rows(g["q"], split, layout), mesh)
    pools = stack_pools(rank_pools(g, split), mesh)
    out, lse = dp_attention(q, pools, step, mesh=mesh, layout=layout, impl=impl,
                            sm_scale=SCALE, **static)
    assert out.shape[:2] == (layout.dp, layout.max_bs)
    return gather_global(out, lse, split, mesh=mesh), step


def check_global(g, out, lse, atol=1e-4):
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    np.testing.assert_allclose(out, g["o64"], rtol=atol, atol=atol)
    assert np.array_equal(np.isinf(lse), np.isinf(g["l64"]))
    live = np.isfinite(g["l64"])
    np.testing.assert_allclose(lse[live], g["l64"][live], rtol=atol, atol=atol)


# ------------------------------------------------------------------------------- DP runs

@pytest.mark.slow  # a 4-rank mesh: each rank's plan compiles its own executor program
def test_dp4_executor_with_an_idle_rank_equals_single_device():
    """4 ranks (rank 0 IDLE: the shortest-queue split finds it busiest), each with its own
    max_bs, context bound and CU count; each runs its own plan in the executor."""
    g = global_problem(heads=16)
    split = split_batch(N, 4, policy="shortest_queue", loads=[3, 0, 0, 0])
    assert split.batch_sizes[0] == 0
    layout = layout_for(split, 16)
    mesh = make_mesh(dp=4)
    (out, lse), step = run_dp(g, split, layout, mesh, "executor")
    check_global(g, out, lse)
    ref_out, _ = mla_attention_reference(g["q"], g["pool"], g["md"].qo_indptr,
                                         g["md"].kv_indptr, g["md"].kv_indices,
                                         sm_scale=SCALE, max_kv_len=CTX)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    assert out.sharding.is_fully_replicated


@pytest.mark.slow  # the dp4 mesh again: four rank configs, four planner compiles
def test_rank_steps_are_the_single_device_builders_and_stay_valid_padded():
    """A rank's metadata is `decode_metadata` over its requests (padded with empty ones to its
    max_bs; rank 0 is IDLE: all padding); its plan is `plan_mla_decode`
    on its own CU count; after padding to the layout's common shapes the validator finds
    nothing new in the plan."""
    g = global_problem(heads=16)  # the executor test's problem: its rank steps compile once
    split = split_batch(N, 4, policy="shortest_queue", loads=[3, 0, 0, 0])
    layout = layout_for(split, 16)
    mesh = make_mesh(dp=4)
    inputs = [(g["req_to_token"], g["rpi"][ids], g["lens"][ids]) for ids in split.requests]
    stacked = build_dp_step(layout, mesh, inputs)
    for r, ids in enumerate(split.requests):
        rank = layout.ranks[r]
        own = rank_step(g["req_to_token"], g["rpi"][ids], g["lens"][ids], rank=rank,
                        plan_config=layout.plan_config(r))
        pad = rank.max_bs - len(ids)  # empty requests up to the rank's max_bs
        md = decode_metadata(g["req_to_token"], np.pad(g["rpi"][ids], (0, pad)),
                             np.pad(g["lens"][ids], (0, pad)), capacity=rank.kv_capacity)
        for f in ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len"):
            np.testing.assert_array_equal(getattr(own.metadata, f), getattr(md, f))
        assert own.metadata.kv_indptr[len(ids)] == g["lens"][ids].sum()
        assert own.plan.num_cu == rank.device.num_cu
        direct = plan_jit(own.metadata.qo_indptr, own.metadata.kv_indptr,
                                 own.metadata.kv_last_page_len, config=layout.plan_config(r))
        for f in ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
                  "reduce_partial_map"):
            np.testing.assert_array_equal(getattr(own.plan, f), getattr(direct, f))
        padded = jax.tree_util.tree_map(lambda x: np.asarray(x)[r], stacked)
        # padding adds no finding (AITER's parallel planner leaves zero-KV padding requests
        # on a full cluster without a work; the validator lists those in both)
        assert plan_problems(padded.plan, padded.metadata) == plan_problems(own.plan,
                                                                              own.metadata)
        assert int(padded.plan.num_works) == int(own.plan.num_works)


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
@pytest.mark.parametrize("impl", ["reference", "executor"])
def test_dp2_tp2_equals_single_device(impl):
    """--tp 4 --dp 2 --enable-dp-attention: 2 ranks, 32 heads split 16 + 16 inside each (the
    executor runs each rank's plan for its 16 local heads)."""
    g = global_problem(heads=32, seed=1)
    split = split_batch(N, 2, policy="round_robin")
    layout = layout_for(split, 16)
    mesh = make_mesh(dp=2, tp=2)
    (out, lse), _ = run_dp(g, split, layout, mesh, impl)
    check_global(g, out, lse)
    assert out.sharding.spec[:2] == (None, "tp")


@pytest.mark.parametrize("impl", ["pallas"])
def test_dp2_pallas_decode_equals_single_device(impl):
    """The Pallas kernel (interpret mode) per rank."""
    import jax.numpy as jnp

    g = global_problem(heads=16, seed=2)
    g["q"] = np.asarray(jnp.asarray(g["q"], jnp.bfloat16).astype(jnp.float32))
    g["pool"] = np.asarray(jnp.asarray(g["pool"], jnp.bfloat16).astype(jnp.float32))
    g["o64"], g["l64"] = attention_oracle_f64(
        g["q"], g["pool"], np.asarray(g["md"].qo_indptr), np.asarray(g["md"].kv_indptr),
        np.asarray(g["md"].kv_indices), SCALE, DV)
    split = split_batch(N, 2, policy="shortest_queue")
    layout = DPLayout(tuple(DPRank(BufferPlan(max_bs=4, max_context_len=CTX), custom_device(4))
                            for _ in range(2)))
    mesh = make_mesh(dp=2)
    check_split(layout, split, g["lens"])
    inputs = [(g["req_to_token"], g["rpi"][ids], g["lens"][ids]) for ids in split.requests]
    step = build_dp_step(layout, mesh, inputs)
    q = stack_rows([x.astype(jnp.bfloat16) for x in rank_rows(g["q"], split, layout)], mesh)
    pools = stack_pools([jnp.asarray(p, jnp.bfloat16) for p in rank_pools(g, split)], mesh)
    out, lse = dp_attention(q, pools, step, mesh=mesh, layout=layout, impl=impl,
                            sm_scale=SCALE, interpret=True)
    out, lse = gather_global(out, lse, split, mesh=mesh)
    check_global(g, out, lse, atol=2e-2)
