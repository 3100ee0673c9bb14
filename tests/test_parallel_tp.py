"""Tensor parallelism over heads: under `shard_map` on the mesh's "tp" axis (4 or 2 of the
conftest's 4 CPU devices) the reference, the plan executor and the Pallas decode kernel
(interpret mode) give the single-device result, with out and lse sharded by heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from funcmla.attention.executor import run_work_plan
from funcmla.attention.pallas import mla_decode
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims, custom_device
from funcmla.layout import PageTable
from funcmla.metadata import ForwardMetadata
from funcmla.parallel import (
    make_mesh,
    sglang_mesh,
    tp_attention_reference,
    tp_mla_decode,
    tp_run_work_plan,
)
from funcmla.planners import DecodePlanConfig, plan_mla_decode
from tests.pools import attention_oracle_f64

D, DV, SCALE = 576, 512, MLADims().sm_scale
B, CTX, SLOTS = 4, 48, 256
CAP = B * CTX


def problem(lens, heads, seed=0):
    """Token CSR over a pool whose unused rows (past the reserved row 0) are NaN."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(CAP, np.int32)
    indices[: indptr[-1]] = rng.permutation(np.arange(1, SLOTS))[: indptr[-1]]
    pool = np.full((SLOTS, D), np.nan, np.float32)
    pool[0] = 0.0
    pool[indices[: indptr[-1]]] = rng.standard_normal((int(indptr[-1]), D))
    q = rng.standard_normal((len(lens), heads, D)).astype(np.float32)
    return q, pool, np.arange(len(lens) + 1, dtype=np.int32), indptr, indices


def assert_head_sharded(x, mesh):
    assert x.sharding.mesh == mesh and x.sharding.spec[:2] == P(None, "tp")[:2]


def test_sglang_mesh_maps_ranks_like_sglang():
    """--tp 4 --dp 2 --enable-dp-attention: attention TP 2 inside each of 2 DP ranks, GPU i at
    (i // 2, i % 2) (SGLang: attn_dp_rank = tp_rank // attn_tp_size)."""
    mesh = sglang_mesh(4, 2, enable_dp_attention=True)
    assert dict(mesh.shape) == {"dp": 2, "tp": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.tolist() == [[0, 1], [2, 3]]
    assert dict(sglang_mesh(4).shape) == {"dp": 1, "tp": 4}


@settings(max_examples=6)
@given(st.lists(st.integers(0, CTX), min_size=B, max_size=B))
def test_reference_tp4_equals_single_device(lens):
    q, pool, qo, indptr, indices = problem(lens, heads=8)
    mesh = make_mesh(tp=4)
    out, lse = tp_attention_reference(q, pool, qo, indptr, indices, mesh=mesh, sm_scale=SCALE,
                                      max_kv_len=CTX)
    assert_head_sharded(out, mesh)
    assert_head_sharded(lse, mesh)
    ref_out, ref_lse = mla_attention_reference(q, pool, qo, indptr, indices, sm_scale=SCALE,
                                               max_kv_len=CTX)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
    o64, l64 = attention_oracle_f64(q, pool, qo, indptr, indices, SCALE, DV)
    np.testing.assert_allclose(np.asarray(out), o64, rtol=1e-4, atol=1e-4)
    assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(l64))


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
def test_executor_tp2_equals_single_device():
    """Each TP rank runs a plan for its own 16 heads; the result equals the single-device
    executor over 32 heads (a head-folded plan) and the float64 oracle."""
    heads, tp = 32, 2
    q, pool, qo, indptr, indices = problem([40, 0, 17, 3], heads=heads, seed=1)
    md = ForwardMetadata(kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(indices),
                         qo_indptr=jnp.asarray(qo), kv_last_page_len=jnp.ones(B, jnp.int32),
                         max_q_len=jnp.int32(1), max_kv_len=jnp.int32(40), mode="decode")
    device = custom_device(4)
    local = DecodePlanConfig(device=device, num_heads=heads // tp)
    plan = plan_mla_decode(md.qo_indptr, md.kv_indptr, md.kv_last_page_len, config=local)
    mesh = make_mesh(tp=tp)
    out, lse = tp_run_work_plan(q, pool, md, plan, mesh=mesh, sm_scale=SCALE, max_qo_span=1,
                                max_kv_span=CTX)
    assert_head_sharded(out, mesh)
    full = DecodePlanConfig(device=device, num_heads=heads, uni_seqlen_qo=1)
    assert full.qk_batch_ratio == 2
    full_plan = plan_mla_decode(md.qo_indptr, md.kv_indptr, md.kv_last_page_len, config=full)
    ref_out, ref_lse = run_work_plan(q, pool, md, full_plan, sm_scale=SCALE, max_qo_span=1,
                                     max_kv_span=CTX, qk_batch_ratio=2, uni_seqlen_qo=1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
    o64, _ = attention_oracle_f64(q, pool, qo, indptr, indices, SCALE, DV)
    np.testing.assert_allclose(np.asarray(out), o64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["csr", "pages"])
def test_pallas_decode_tp2_equals_single_device(form):
    """The Pallas kernel (interpret mode) with 16 heads split 8 + 8: bitwise the single-device
    kernel, NaN rows never read."""
    q, pool, _, indptr, indices = problem([33, 0, 9, 48], heads=16, seed=2)
    q, pool = jnp.asarray(q, jnp.bfloat16), jnp.asarray(pool, jnp.bfloat16)
    if form == "csr":
        kv = dict(kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(indices),
                  max_kv_len=CTX)
    else:
        table = np.zeros((B, CTX), np.int32)
        lens = np.diff(indptr)
        for b in range(B):
            table[b, : lens[b]] = indices[indptr[b]: indptr[b + 1]]
        kv = dict(page_table=PageTable(table=jnp.asarray(table), lengths=jnp.asarray(lens),
                                       page_size=1))
    mesh = make_mesh(tp=2)
    out, lse = tp_mla_decode(q, pool, mesh=mesh, sm_scale=SCALE, interpret=True, **kv)
    assert_head_sharded(out, mesh)
    ref_out, ref_lse = mla_decode(q, pool, sm_scale=SCALE, interpret=True, **kv)
    assert np.array_equal(np.asarray(out), np.asarray(ref_out))
    assert np.array_equal(np.asarray(lse), np.asarray(ref_lse))
    assert np.isfinite(np.asarray(out, np.float32)).all()
