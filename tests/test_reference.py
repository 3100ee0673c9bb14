"""Reference attention vs a float64 NumPy restatement, and page-size invariance of outputs."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from funcmla.metadata import decode_metadata, extend_metadata
from tests.pools import attention_oracle_f64, latent_rows, layout_requests, rel_err

D, DV, H = 576, 512, 4
SCALE = MLADims().sm_scale  # DeepSeek-V3
BATCH, MAX_CTX, CAP, MAX_Q = 4, 256, 4 * 256, 64
POOL_ROWS = 1280  # >= (pages + 1) * page_size for every case below


# jitted once for the fixed shapes below (eager, each example re-runs the host-side checks and
# op-by-op dispatch; the inputs are valid by construction)
_extend_metadata = jax.jit(extend_metadata, static_argnames=("capacity",))


def _case(kv_lens, q_lens, page_size, seed):
    rng = np.random.default_rng(seed)
    r2t, rpi, num_pages, owner = layout_requests(kv_lens, page_size, rng=rng,
                                                 max_context_len=MAX_CTX, num_req_slots=BATCH + 2)
    pool = np.zeros((POOL_ROWS, D), np.float32)  # fixed shape: one compilation
    pool[: len(owner)] = latent_rows(owner, D, seed=7)
    pad = BATCH - len(kv_lens)
    seq = np.concatenate([kv_lens, np.zeros(pad, int)]).astype(np.int32)
    ext = np.concatenate([q_lens, np.zeros(pad, int)]).astype(np.int32)
    rpi = np.concatenate([rpi, np.zeros(pad, np.int32)]).astype(np.int32)
    meta = _extend_metadata(r2t, rpi, seq, ext, capacity=CAP)
    q = np.random.default_rng(seed + 1000).standard_normal((MAX_Q, H, D)).astype(np.float32)
    return q, pool, meta


def _run(q, pool, meta):
    return mla_attention_reference(q, pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                   sm_scale=SCALE, max_kv_len=MAX_CTX)


case_st = st.lists(
    st.tuples(st.integers(0, MAX_CTX), st.integers(0, 16)), min_size=1, max_size=BATCH
).map(lambda xs: (np.array([k for k, _ in xs]), np.array([min(q, k) for k, q in xs])))


@given(case=case_st, page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 99))
def test_reference_matches_float64(case, page_size, seed):
    kv_lens, q_lens = case
    q, pool, meta = _case(kv_lens, q_lens, page_size, seed)
    out, lse = (np.asarray(a) for a in _run(q, pool, meta))  # host slices: no compile per n
    n = int(meta.qo_indptr[-1])
    ref_out, ref_lse = attention_oracle_f64(q[:n], pool, np.asarray(meta.qo_indptr),
                                            np.asarray(meta.kv_indptr), np.asarray(meta.kv_indices),
                                            SCALE, DV)
    assert rel_err(out[:n], ref_out) < 1e-5
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse[:n]), fin)
    assert rel_err(lse[:n][fin], ref_lse[fin]) < 1e-5
    # padding queries past qo_indptr[-1]: out 0, lse +inf
    assert np.all(out[n:] == 0) and np.all(np.isinf(lse[n:]))


@settings(max_examples=8)  # three page sizes per example, each a new trace of the reference
@given(case=case_st, seed=st.integers(0, 99))
def test_outputs_identical_across_page_sizes(case, seed):
    kv_lens, q_lens = case
    outs = []
    for page_size in (1, 16, 64):
        q, pool, meta = _case(kv_lens, q_lens, page_size, seed)  # same q (same seed), pages differ
        outs.append(_run(q, pool, meta))
    for out, lse in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0][0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(outs[0][1]), rtol=1e-6)


def test_zero_length_kv_gives_zero_and_inf():
    q, pool, meta = _case(np.array([0, 5]), np.array([0, 1]), 16, 0)
    meta = decode_metadata(jnp.zeros((6, MAX_CTX), jnp.int32) + 16, jnp.array([0, 1, 2, 3]),
                           jnp.array([0, 3, 0, 2]), capacity=CAP)
    out, lse = mla_attention_reference(q[:4], pool, meta.qo_indptr, meta.kv_indptr,
                                       meta.kv_indices, sm_scale=SCALE, max_kv_len=8)
    lse = np.asarray(lse)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isinf(lse[0]))
    assert np.all(np.asarray(out[2]) == 0) and np.all(np.isinf(lse[2]))
    assert np.all(np.isfinite(lse[1])) and np.all(np.isfinite(lse[3]))


def test_decode_single_key_returns_that_value():
    pool = np.random.default_rng(0).standard_normal((32, D)).astype(np.float32)
    meta = decode_metadata(jnp.full((2, 8), 9, jnp.int32), jnp.array([0]), jnp.array([1]), capacity=4)
    q = np.ones((1, H, D), np.float32)
    out, lse = mla_attention_reference(q, pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                       sm_scale=SCALE, max_kv_len=4)
    np.testing.assert_allclose(np.asarray(out[0]), np.broadcast_to(pool[9, :DV], (H, DV)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse[0]), np.full(H, pool[9].sum() * SCALE), rtol=1e-5)
