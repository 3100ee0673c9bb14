"""Scores far above 2^31 in the softmax's base-2 units (query rows of magnitude 2^40 to 2^60)
on the compiled Mosaic GPU kernels, against float64 / float32 references.

On the GPU a softmax written as exp2(s * scale - max) compiles to a multiply-add, whose
argument keeps the rounding residual of the scaled max (up to half its ulp: 2^8 at 2^32),
and exp2 of that is +inf, so out is NaN. The kernels take the max over raw scores and multiply
s - max by the scale. The CPU interpreter rounds every product, so only a GPU shows this.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from funcmla.attention.pallas import DecodeKernelConfig, mha_prefill, mla_decode
from funcmla.attention.reference import mha_attention_reference
from funcmla.layout import PageTable
from tests.test_pallas_decode import SCALE, check, make_problem, reference
from tests.test_pallas_prefill import make

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:.*Triton.*:DeprecationWarning")]

# per head: far above f16 and bf16-product ranges, far below, moderate, 1
MAGNITUDES = np.array([2.0**40, 2.0**-40, 2.0**20, 1.0, 2.0**60, 2.0**30, 2.0**-10, 4.0])


@pytest.mark.parametrize("kernel,heads,page_size,splits", [
    ("mgpu", 128, 64, 2), ("mgpu", 128, 1, 1), ("triton", 16, 64, 2), ("triton", 16, 1, 1)])
def test_decode_on_large_query_rows(kernel, heads, page_size, splits):
    rng = np.random.default_rng(heads + page_size)
    lens = [1000, 0, 513, 7]
    p = make_problem(rng, batch=4, heads=heads, s_q=1, page_size=page_size, lens=lens,
                     max_pages=-(-1000 // page_size))
    mag = np.resize(MAGNITUDES, heads).astype(np.float32)
    q = jnp.asarray(np.asarray(p["q"], np.float32) * mag[None, :, None], jnp.bfloat16)
    if page_size == 1:
        meta = dict(kv_indptr=p["kv_indptr"], kv_indices=p["kv_indices"])
    else:
        meta = dict(page_table=PageTable(p["table"], p["lens"], page_size))
    out, lse = mla_decode(q, p["pool"], sm_scale=SCALE, num_splits=splits,
                          config=DecodeKernelConfig(kernel=kernel), **meta)
    check(out, lse, *reference(q, p["pool"], p["slot_lists"], 1, SCALE))


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_on_large_query_rows(causal):
    q, k, v, qo, kv = make(np.random.default_rng(3), 8, [300, 1, 64], [300, 40, 200])
    q = (q.astype(jnp.float32) * MAGNITUDES[None, :, None]).astype(jnp.bfloat16)
    out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=causal)
    ref, ref_lse = mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=causal)
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    live = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isposinf(lse), ~live)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-5, atol=2e-3)
