"""The one-launch split-KV merge (`funcmla.attention.pallas.merge`) against a float64 oracle.

CPU: Pallas interpret mode. GPU (skips without one): the compiled kernel against XLA's
`merge_splits` and the float64 oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from funcmla.attention.pallas import merge_splits, merge_splits_pallas
from funcmla.attention.pallas.merge import merge_block_d


def oracle(o, lse):
    """float64: softmax weights over splits; all-empty rows -> out 0, lse +inf."""
    o, lse = o.astype(np.float64), lse.astype(np.float64)
    m = lse.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m[:, None])
    total = w.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    out = (w[..., None] * o).sum(axis=1) / safe[..., None]
    lse_out = np.where(total > 0, m + np.log(safe), np.inf)
    return out, lse_out


def random_partials(rng, b, s, r, dv, empty):
    o = rng.standard_normal((b, s, r, dv)).astype(np.float32)
    lse = (rng.standard_normal((b, s, r)) * 4).astype(np.float32)
    dead = rng.random((b, s, r)) < empty
    lse[dead] = -np.inf
    o[dead] = 0.0
    return o, lse


def check(out, lse_out, o, lse, rtol=1e-5):
    ref_out, ref_lse = oracle(o, lse)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, rtol=rtol, atol=1e-6)
    assert (np.isinf(np.asarray(lse_out)) == np.isinf(ref_lse)).all()
    assert (np.asarray(lse_out)[np.isinf(ref_lse)] == np.inf).all()
    assert (np.asarray(out)[np.isinf(ref_lse)] == 0).all()
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse_out)[fin], ref_lse[fin], rtol=1e-6, atol=1e-6)


@st.composite
def partials(draw):
    """o f32 [2, S, 32, 32] and lse f32 [2, S, 32] drawn by Hypothesis (so failures shrink):
    lse in [-30, 30] or -inf (an empty split, whose o is 0); row 3 of sequence 0 empty in
    every split."""
    splits = draw(st.sampled_from([1, 2, 3, 7]))
    finite = st.floats(-30, 30, width=32)
    lse = draw(hnp.arrays(np.float32, (2, splits, 32),
                          elements=st.one_of(finite, st.just(-np.inf))))
    o = draw(hnp.arrays(np.float32, (2, splits, 32, 32), elements=st.floats(-4, 4, width=32)))
    lse[0, :, 3] = -np.inf  # a row with no KV at all
    o[np.isinf(lse)] = 0.0
    return o, lse


@settings(max_examples=8, deadline=None)
@given(partials())
def test_interpret_matches_float64(parts):
    o, lse = parts
    out, lse_out = merge_splits_pallas(jnp.asarray(o), jnp.asarray(lse), jnp.float32,
                                       interpret=True)
    assert out.shape == (2, 32, 32) and lse_out.shape == (2, 32)
    check(out, lse_out, o, lse)


def test_tiling_does_not_change_bits_and_dtype_is_honoured():
    rng = np.random.default_rng(3)
    o, lse = random_partials(rng, 3, 5, 16, 256, 0.3)
    oj, lj = jnp.asarray(o), jnp.asarray(lse)
    outs = [merge_splits_pallas(oj, lj, jnp.float32, block_d=bd, interpret=True)
            for bd in (256, 128, 64, 32, 16)]
    for out, lse_out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0][0]))
        np.testing.assert_array_equal(np.asarray(lse_out), np.asarray(outs[0][1]))
    out_bf, lse_bf = merge_splits_pallas(oj, lj, jnp.bfloat16, interpret=True)
    assert out_bf.dtype == jnp.bfloat16 and lse_bf.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out_bf, np.float32),
                                  np.asarray(outs[0][0].astype(jnp.bfloat16), np.float32))
    # same numbers as the XLA restatement (rounding aside)
    x_out, x_lse = merge_splits(oj, lj, jnp.float32)
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(x_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(np.asarray(x_lse)), np.isinf(np.asarray(outs[0][1])))


def test_bfloat16_partials_combine_in_float32():
    """bf16 partials (`DecodeKernelConfig.partial_dtype`) are widened and combined exactly as
    float32 partials holding the same (bf16-rounded) values."""
    rng = np.random.default_rng(8)
    o, lse = random_partials(rng, 2, 3, 16, 64, 0.3)
    o16 = jnp.asarray(o).astype(jnp.bfloat16)
    got = merge_splits_pallas(o16, jnp.asarray(lse), jnp.float32, interpret=True)
    want = merge_splits_pallas(o16.astype(jnp.float32), jnp.asarray(lse), jnp.float32,
                               interpret=True)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    check(*got, np.asarray(o16, np.float64), lse)


def test_block_d_rule():
    # halved from the row width while the grid is short of 264 programs, down to 32 columns
    assert merge_block_d(1, 16, 512) == 32  # batch 1: 16 programs at the narrowest
    assert merge_block_d(32, 16, 512) == 32  # 32 * 8 = 256 < 264 -> 512 programs (H200: the
    #                                          merge 2.3-2.4 us instead of 2.6-2.7 at 64)
    assert merge_block_d(128, 16, 512) == 128  # 128 * 2 = 256 < 264 <= 128 * 4
    assert merge_block_d(128, 128, 512) == 512  # 1024 programs at full width
    assert merge_block_d(1, 16, 32) == 32  # never wider than the row
    assert merge_block_d(1, 16, 16) == 16
    assert merge_block_d(1, 128, 512) == 32  # 8 row tiles x 16 = 128 programs
    assert merge_block_d(8, 128, 512) == 64  # 512 programs: enough
    assert merge_block_d(32, 128, 512) == 256  # H128 batch 32: 512 programs
    for b, r in ((1, 16), (3, 32), (2, 16), (16, 16), (5, 64), (64, 16)):
        bd = merge_block_d(b, r, 512)
        programs = b * (r // 16) * (512 // bd)
        # the widest tile with >= 264 programs; 32 when even that is short of them
        assert programs >= 264 or bd == 32
        assert bd == 512 or programs // 2 < 264


def test_bad_inputs_are_named():
    z = jnp.zeros
    with pytest.raises(ValueError, match="multiple of 16"):
        merge_splits_pallas(z((1, 2, 8, 32)), z((1, 2, 8)), jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="lse_part"):
        merge_splits_pallas(z((1, 2, 16, 32)), z((1, 3, 16)), jnp.float32, interpret=True)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        merge_splits_pallas(z((1, 2, 16, 32), jnp.float16), z((1, 2, 16)), jnp.float32,
                            interpret=True)
    with pytest.raises(TypeError, match="lse_part"):
        merge_splits_pallas(z((1, 2, 16, 32)), z((1, 2, 16), jnp.bfloat16), jnp.float32,
                            interpret=True)
    with pytest.raises(ValueError, match="block_d"):
        merge_splits_pallas(z((1, 2, 16, 32)), z((1, 2, 16)), jnp.float32, block_d=48,
                            interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,r", [(1, 64, 16), (32, 4, 16), (8, 9, 128)])
def test_gpu_kernel_matches_float64_and_xla(b, s, r):
    rng = np.random.default_rng(b + s)
    o, lse = random_partials(rng, b, s, r, 512, 0.2)
    out, lse_out = merge_splits_pallas(jnp.asarray(o), jnp.asarray(lse), jnp.float32)
    check(out, lse_out, o, lse)
    x_out, _ = jax.jit(merge_splits, static_argnums=2)(jnp.asarray(o), jnp.asarray(lse),
                                                       jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x_out), rtol=1e-5, atol=1e-6)
