"""The ragged MHA prefill kernel (`mha_prefill`) and `merge_attention_states` against the float32
reference (`mha_attention_reference`), which is itself checked against a float64 NumPy
restatement.

On CPU the kernel runs in Mosaic GPU interpret mode (barriers, TMA copies and wgmma simulated;
q k^T is a plain dot there). The interpreter costs seconds per live block, so the CPU cases fold
many request shapes into one call each, on 1 or 2 heads: varlen, zero-length q and kv, q_len =
kv_len, q_len = 1, a prefix (kv_len > q_len), prefix only (q_len 0), a partial last KV tile,
rows past qo_indptr[-1], and k / v rows past kv_indptr[-1] holding NaN / Inf (which must not
reach any output). 16 and 128 heads run on CPU as a CUDA lowering (every head count lowers)
and, at 16 heads, in the interpreter (`slow`); compiled, on a GPU (`gpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jax.experimental import pallas as pl

from funcmla.attention.pallas import MgpuPrefillConfig, merge_attention_states, mha_prefill
from funcmla.attention.pallas.prefill import SHORT_CONFIG
from funcmla.attention.pallas.prefill_mgpu import item_kv_tiles, num_tile_slots, tile_schedule
from funcmla.attention.reference import mha_attention_reference
from tests.trace_checks import assert_profiled_like_plain

SCALE = 0.135234
WALK3 = MgpuPrefillConfig(block_kv=64, num_stages=3, tiles_per_cta=3)


def make(rng, heads, q_lens, kv_lens, *, extra_q=3, extra_kv=70, poison=np.nan):
    """q / k / v for requests of these lengths, plus `extra_q` q rows past qo_indptr[-1] and
    `extra_kv` k / v rows past kv_indptr[-1] holding `poison`."""
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    q = rng.standard_normal((qo[-1] + extra_q, heads, 192))
    k = rng.standard_normal((kv[-1] + extra_kv, heads, 192))
    v = rng.standard_normal((kv[-1] + extra_kv, heads, 128))
    k[kv[-1]:] = poison
    v[kv[-1]:] = poison
    bf = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return bf(q), bf(k), bf(v), jnp.asarray(qo), jnp.asarray(kv)


def check(out, lse, ref, ref_lse):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    lse, ref, ref_lse = np.asarray(lse), np.asarray(ref), np.asarray(ref_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isinf(ref_lse)
    np.testing.assert_array_equal(np.isposinf(lse), empty)  # no key: lse +inf ...
    assert not out[empty].any()  # ... and out exactly 0
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-2, err  # bf16 operands and output
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=2e-3)


def run_case(heads, q_lens, kv_lens, causal, *, seed=0, config=MgpuPrefillConfig(block_kv=64),
             interpret=True, poison=np.nan):
    q, k, v, qo, kv = make(np.random.default_rng(seed), heads, q_lens, kv_lens, poison=poison)
    out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=causal, config=config,
                           interpret=interpret)
    assert out.shape == (q.shape[0], heads, 128) and out.dtype == jnp.bfloat16
    assert lse.shape == (q.shape[0], heads) and lse.dtype == jnp.float32
    check(out, lse, *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=causal))


# (q_lens, kv_lens): a prefix with a partial tile and a q tile past 64 rows, a prefix-only
# request (no queries), q_len = 1 over a prefix (the fast case); an empty request and q_len =
# kv_len on a tile boundary (the slow one).
CAUSAL = ([70, 0, 1], [100, 5, 33])
CAUSAL_MORE = ([70, 0, 1, 64], [100, 0, 33, 64])
# kv_len 0 with queries (out 0, lse +inf), kv shorter than q, a long request over two tiles.
FULL = ([5, 9, 70], [0, 3, 130])


@pytest.mark.slow  # Mosaic GPU interpret mode: ~20 s of CPU (the fast set checks the layout)
def test_interpret_causal_varlen():
    """One head (the interpreter's cost grows with the blocks); two heads below."""
    run_case(1, *CAUSAL, causal=True)


@pytest.mark.slow
def test_interpret_causal_varlen_two_heads():
    run_case(2, *CAUSAL_MORE, causal=True, seed=1, poison=-np.inf)


@pytest.mark.slow
def test_interpret_non_causal_varlen():
    run_case(2, *FULL, causal=False, poison=np.inf)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_interpret_pingpong(causal):
    """The consumers' turns (`MgpuPrefillConfig.pingpong`) change the schedule, not the
    result: the same cases, 64-token tiles in 2 and 3 stages."""
    lens = CAUSAL if causal else FULL
    run_case(1, *lens, causal=causal, poison=np.inf,
             config=MgpuPrefillConfig(block_kv=64, num_stages=2 if causal else 3,
                                      pingpong=True))


@pytest.mark.slow
@pytest.mark.parametrize("tiles,causal", [(2, True), (3, True), (2, False)])
def test_interpret_several_tiles_a_cta(tiles, causal):
    """A CTA walking `tiles_per_cta` q tiles (the K/V ring running on across them, the next
    tile's q loading while this one finishes, the output staged apart from q): the same
    results as one tile a CTA, with CTAs whose last items are unused slots or past the grid."""
    lens = CAUSAL_MORE if causal else FULL
    run_case(2, *lens, causal=causal, seed=tiles, poison=np.nan,
             config=MgpuPrefillConfig(block_kv=64, num_stages=3, tiles_per_cta=tiles))


@pytest.mark.slow
def test_interpret_16_heads_block_kv_128():
    """16 heads (one block each: the interpreter's cost), the default 128-token tiles, 20
    queries over a 130-token prefix (an unmasked tile, then the diagonal and the tail)."""
    q, k, v, qo, kv = make(np.random.default_rng(2), 16, [20], [150], extra_q=0,
                           poison=-np.inf)
    out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=True,
                           config=MgpuPrefillConfig(), interpret=True)
    check(out, lse, *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=True))


@pytest.mark.slow
@pytest.mark.parametrize("pingpong,tiles", [(False, 1), (True, 1), (True, 2)])
def test_interpret_has_no_data_race(pingpong, tiles):
    """Mosaic GPU's interpreter, with its race detector on, finds no unordered shared-memory
    access between the producer and the consumers: stage refills (4 tiles in 2 stages), the
    zeroed V tail, the output staging over q, with and without the consumers' turns; with two
    q tiles a CTA, the next tile's q landing over the last one's and the output staging
    reused. The detector is a private jax API: skip where it has moved."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        pytest.skip(f"Mosaic GPU interpreter's race detector not importable: {e}")
    q, k, v, qo, kv = make(np.random.default_rng(3), 1, [70, 130], [230, 130])
    config = MgpuPrefillConfig(block_kv=64, num_stages=2 if tiles == 1 else 3,
                               pingpong=pingpong, tiles_per_cta=tiles)
    out, _ = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=True, config=config,
                         interpret=InterpretGPUParams(detect_races=True))
    jax.block_until_ready(out)
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("heads,causal,config", [
    (16, True, MgpuPrefillConfig()), (128, False, MgpuPrefillConfig(64, 3)),
    (128, True, MgpuPrefillConfig(pingpong=True)), (16, True, SHORT_CONFIG),
    (128, True, WALK3)])
def test_lowers_for_cuda(heads, causal, config):
    """The compiled kernel lowers for CUDA on any host (Mosaic GPU's code generation runs here;
    only ptxas needs the GPU), at 16 and 128 heads and a row count that needs padding."""
    q = jax.ShapeDtypeStruct((300, heads, 192), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((901, heads, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((901, heads, 128), jnp.bfloat16)
    ip = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = functools.partial(mha_prefill, sm_scale=SCALE, causal=causal, config=config)
    text = jax.jit(fn).trace(q, k, v, ip, ip).lower(lowering_platforms=("cuda",)).as_text()
    assert "mha_prefill_mgpu" in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=8), st.integers(0, 7))
def test_tile_schedule_covers_each_request_once(q_lens, offset):
    """Counted from the 8-row group of its first row (`row_leads`), every query row of every
    request is in exactly one (slot, 128-row tile) of that request's, every tile starts on a
    multiple of 8 in q's rows and not before row 0, a request's tiles end on its last row's
    8-row group (the partial tile first, `tile_shifts`) unless that would start before row 0,
    unused slots are -1, and the static slot count `num_tile_slots` suffices for any lengths
    and starts (`offset`: rows before the first)."""
    starts = offset + np.concatenate([[0], np.cumsum(q_lens)])
    qo = jnp.asarray(starts, jnp.int32)
    slots = num_tile_slots(int(starts[-1]), len(q_lens))
    req, first = map(np.asarray, tile_schedule(qo, slots))
    leads = starts[:-1] % 8
    live = [(int(r), int(f)) for r, f in zip(req, first) if r >= 0]
    assert len(live) == len(set(live)) <= slots
    assert all(leads[r] - 128 < f < leads[r] + q_lens[r] for r, f in live)
    assert all((starts[r] - leads[r] + f) % 8 == 0 and starts[r] - leads[r] + f >= 0
               for r, f in live)
    for r, n in enumerate(q_lens):
        firsts = [f for rr, f in live if rr == r]
        if n:
            end = -(-(leads[r] + n) // 8) * 8
            moved = max(firsts) + 128 == end
            assert moved or (min(firsts) == 0 and starts[r] - leads[r] - (
                len(firsts) * 128 - end) < 0), (r, firsts, end)
    covered = [(r, f + j - leads[r]) for r, f in live for j in range(128)
               if leads[r] <= f + j < leads[r] + q_lens[r]]
    assert sorted(covered) == [(b, j) for b, n in enumerate(q_lens) for j in range(n)]
    assert all(r == -1 and f == 0 for r, f in zip(req, first) if r < 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 200)), min_size=1, max_size=6),
       st.integers(0, 7), st.integers(0, 7), st.booleans(), st.sampled_from([32, 64]))
@example([(200, 64)], 0, 0, True, 64)  # the first tile's last row sees exactly 192 keys
def test_item_kv_tiles_cover_every_key_a_tile_sees(lens, q_off, kv_off, causal, block_kv):
    """`item_kv_tiles` (the kernel's per-item count) against a brute force: for each (head,
    slot) item of the walk (heads outer, slots last to first), the block_kv-key tiles counted
    from the request's 8-key group up to the last key any of the tile's rows sees (bottom-right
    causal, or all of them), 0 for an unused slot and an empty KV. Requests have kv_len >=
    q_len (a prefix, maybe empty), so every row sees a key."""
    q_lens = [q for q, _ in lens]
    kv_lens = [q + extra for q, extra in lens]
    qo = q_off + np.concatenate([[0], np.cumsum(q_lens)])
    kv = kv_off + np.concatenate([[0], np.cumsum(kv_lens)])
    heads, slots = 2, num_tile_slots(int(qo[-1]), len(lens))
    got = np.asarray(item_kv_tiles(jnp.asarray(qo, jnp.int32), jnp.asarray(kv, jnp.int32),
                                   jnp.asarray(q_lens, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                                   heads=heads, num_slots=slots, causal=causal,
                                   block_kv=block_kv))
    req, first = map(np.asarray, tile_schedule(jnp.asarray(qo, jnp.int32), slots))
    want = np.zeros(slots, np.int64)
    for s in range(slots):
        r = req[s]
        if r < 0 or kv_lens[r] == 0:
            continue
        q_lead, kv_lead = qo[r] % 8, kv[r] % 8
        rows = [j for j in range(first[s], first[s] + 128) if q_lead <= j < q_lead + q_lens[r]]
        seen = [kv_lead + k for j in rows for k in range(kv_lens[r])
                if not causal or k < kv_lens[r] - q_lens[r] + 1 + (j - q_lead)]
        want[s] = -(-(max(seen) + 1) // block_kv) if seen else 0
    assert got.tolist() == np.tile(want[::-1], heads).tolist()


def _np_attention(q, k, v, qo, kv, causal):
    """float64 NumPy restatement of ragged MHA (bottom-right causal)."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    lse = np.full(q.shape[:2], np.inf)
    for b in range(len(qo) - 1):
        ql, kl = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        for j in range(ql):
            n = min(kl - ql + 1 + j, kl) if causal else kl
            if n <= 0:
                continue
            s = np.einsum("hd,shd->hs", q[qo[b] + j], k[kv[b]:kv[b] + n]) * SCALE
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            out[qo[b] + j] = np.einsum("hs,shd->hd", p, v[kv[b]:kv[b] + n]) / p.sum(1)[:, None]
            lse[qo[b] + j] = m[:, 0] + np.log(p.sum(1))
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_numpy(causal):
    lens = CAUSAL if causal else FULL
    q, k, v, qo, kv = make(np.random.default_rng(7), 3, *lens)
    out, lse = mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=causal)
    ref, ref_lse = _np_attention(q, k, v, np.asarray(qo), np.asarray(kv), causal)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=1e-5)


def _split_prefix(q, k, v, qo, kv, prefix):
    """Request i's keys split into its first prefix[i] (the cached prefix) and the rest (the
    new tokens, as many as its queries): ((k, v, indptr) of each part)."""
    kvn = np.asarray(kv)
    pre = np.concatenate([np.arange(kvn[i], kvn[i] + p) for i, p in enumerate(prefix)])
    new = np.concatenate([np.arange(kvn[i] + p, kvn[i + 1]) for i, p in enumerate(prefix)])
    pre_ip = jnp.asarray(np.concatenate([[0], np.cumsum(prefix)]), jnp.int32)
    return (k[pre], v[pre], pre_ip), (k[new], v[new], qo)


@pytest.mark.slow  # the Hypothesis merge property below checks the same split, faster
def test_merge_of_reference_parts_is_one_shot_attention():
    """SGLang's chunked prefix cache: attention over the prefix (not causal) merged with causal
    attention over the new tokens equals bottom-right causal attention over prefix + new, also
    where a side is empty (no prefix, lse +inf); the merge rule alone, in float32."""
    new, prefix = [40, 7, 12], [33, 0, 64]
    q, k, v, qo, kv = make(np.random.default_rng(5), 2, new, [n + p for n, p in
                                                              zip(new, prefix)], extra_q=0,
                           extra_kv=0)
    (kp, vp, ip_p), (kn, vn, ip_n) = _split_prefix(q, k, v, qo, kv, prefix)
    o1, l1 = mha_attention_reference(q, kp, vp, qo, ip_p, sm_scale=SCALE, causal=False)
    o2, l2 = mha_attention_reference(q, kn, vn, qo, ip_n, sm_scale=SCALE, causal=True)
    out, lse = merge_attention_states(o1, l1, o2, l2)
    ref, ref_lse = mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-6)


# Fixed data for the property below (Hypothesis draws the lengths and splits; the values are
# constant, so every example runs the same two compiled references).
_PQ, _PK = 18, 36
_PROP = make(np.random.default_rng(11), 2, [_PQ], [_PK], extra_q=0, extra_kv=0)


@pytest.mark.slow  # every example is a new trace (16 s cold); test_merge_empty_sides stays fast
@settings(max_examples=6)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3))
def test_merge_property_any_prefix_split(lens):
    """For any requests of (new, prefix) lengths: the prefix part (not causal) merged with
    the new-token part (causal) equals bottom-right causal attention over prefix + new. Key
    rows past each part's last request hold NaN, so a part's unused rows are never read."""
    q, k, v, _, _ = _PROP
    new = [n for n, _ in lens]
    prefix = [p for _, p in lens]
    qo = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)

    def part(lengths, rows):  # k / v rows `rows` first, NaN after; its indptr
        idx = np.concatenate([np.asarray(rows, int), np.zeros(_PK - len(rows), int)])
        keep = (np.arange(_PK) < len(rows))[:, None, None]
        pk = jnp.where(keep, k[idx], jnp.nan)
        pv = jnp.where(keep, v[idx], jnp.nan)
        return pk, pv, jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)

    # request i's keys: prefix rows then new rows, taken from disjoint ranges of k / v
    pre_rows, new_rows, all_rows, at = [], [], [], 0
    for n, p in lens:
        pre_rows += range(at, at + p)
        new_rows += range(at + p, at + p + n)
        all_rows += range(at, at + p + n)
        at += p + n
    kp, vp, ip_p = part(prefix, pre_rows)
    kn, vn, ip_n = part(new, new_rows)
    ka, va, ip_a = part([n + p for n, p in lens], all_rows)
    o1, l1 = mha_attention_reference(q, kp, vp, qo, ip_p, sm_scale=SCALE, causal=False)
    o2, l2 = mha_attention_reference(q, kn, vn, qo, ip_n, sm_scale=SCALE, causal=True)
    out, lse = merge_attention_states(o1, l1, o2, l2)
    ref, ref_lse = mha_attention_reference(q, ka, va, qo, ip_a, sm_scale=SCALE, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=3e-6)


def test_merge_empty_sides():
    """+inf or -inf lse means "no key": that side's out is ignored (even NaN), both empty gives
    out 0 and lse +inf, as the kernels report it; otherwise the log-sum-exp weights."""
    oa = jnp.array([[1.0, 2.0], [np.nan, np.nan], [3.0, 4.0], [1.0, 1.0]])
    ob = jnp.array([[5.0, 6.0], [7.0, 8.0], [np.nan, 0.0], [3.0, 5.0]])
    la = jnp.array([np.inf, -np.inf, 0.5, np.log(1.0)], jnp.float32)
    lb = jnp.array([np.inf, 1.25, np.inf, np.log(3.0)], jnp.float32)
    out, lse = merge_attention_states(oa, la, ob, lb)
    np.testing.assert_array_equal(np.asarray(out[:3]), [[0, 0], [7, 8], [3, 4]])
    np.testing.assert_allclose(np.asarray(out[3]), [2.5, 4.0], rtol=1e-6)  # weights 1/4, 3/4
    np.testing.assert_allclose(np.asarray(lse), [np.inf, 1.25, 0.5, np.log(4.0)], rtol=1e-6)


@pytest.mark.slow
def test_interpret_merge_of_kernel_parts():
    """The same split through the kernel: prefix part and new-token part, merged."""
    new, prefix = [70, 5], [40, 0]
    q, k, v, qo, kv = make(np.random.default_rng(9), 2, new, [n + p for n, p in
                                                              zip(new, prefix)], extra_q=0,
                           extra_kv=0)
    (kp, vp, ip_p), (kn, vn, ip_n) = _split_prefix(q, k, v, qo, kv, prefix)
    cfg = MgpuPrefillConfig(block_kv=64)
    o1, l1 = mha_prefill(q, kp, vp, qo, ip_p, sm_scale=SCALE, causal=False, config=cfg,
                         interpret=True)
    o2, l2 = mha_prefill(q, kn, vn, qo, ip_n, sm_scale=SCALE, causal=True, config=cfg,
                         interpret=True)
    check(*merge_attention_states(o1, l1, o2, l2),
          *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=True))


def run_growing_maxima(interpret: bool):
    """Running maxima that grow far from tile to tile in some warps' rows and little in
    others': one request, 64 queries over 256 keys whose 64-key tiles are scaled by 1, 3, 5,
    7; the first warp's 16 query rows are scaled down by 20, so their maxima move by less than
    8 base-2 units a tile, while most other rows' grow by more. Every rescale of the
    accumulator and the row sums counts (a kernel that skipped them fails)."""
    q, k, v, qo, kv = make(np.random.default_rng(11), 1, [64], [256], extra_q=0)
    qf, kf = np.asarray(q, np.float32), np.asarray(k, np.float32)
    qf[:16] /= 20
    kf[:256] *= np.repeat(1.0 + 2.0 * np.arange(4), 64)[:, None, None]
    q, k = jnp.asarray(qf, jnp.bfloat16), jnp.asarray(kf, jnp.bfloat16)
    # the premise: per row, the growth of the running max over tiles 0-2 (all rows see them)
    s = np.einsum("qd,kd->qk", np.asarray(q, np.float32)[:, 0], np.asarray(k, np.float32)[:192, 0])
    run_max = np.maximum.accumulate(s.reshape(64, 3, 64).max(axis=2), axis=1)
    growth = np.diff(run_max, axis=1).max(axis=1) * SCALE * np.log2(np.e)
    assert (growth[16:] > 8).mean() > 0.5 and (growth[:16] < 8).all()
    out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=True,
                           config=MgpuPrefillConfig(block_kv=64), interpret=interpret)
    check(out, lse, *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=True))


@pytest.mark.slow
def test_interpret_running_maxima_growing_between_tiles():
    run_growing_maxima(interpret=True)


@pytest.mark.gpu
def test_gpu_running_maxima_growing_between_tiles():
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    run_growing_maxima(interpret=False)


GPU_CASES = [  # heads, q_lens, kv_lens, causal, config
    (16, [1000, 1, 0, 300, 129], [1000, 700, 0, 4000, 129], True, MgpuPrefillConfig()),
    (128, [64, 200, 1], [64, 1200, 33], True, MgpuPrefillConfig()),
    (16, [77, 0, 513], [5, 9, 513], False, MgpuPrefillConfig()),
    (128, [257, 3], [900, 3], True, MgpuPrefillConfig(block_kv=64, num_stages=3)),
    (16, [1000, 1, 0, 300, 129], [1000, 700, 0, 4000, 129], True,
     MgpuPrefillConfig(pingpong=True)),
    (16, [77, 0, 513], [5, 9, 513], False, MgpuPrefillConfig(block_kv=64, num_stages=4,
                                                            pingpong=True)),
    (16, [300, 1, 129, 64], [1500, 700, 129, 64], True, SHORT_CONFIG),  # what short runs get
    (16, [300, 1, 129, 64, 0, 1000], [1500, 700, 129, 64, 5, 1000], True, WALK3),
    (128, [77, 0, 513], [5, 9, 513], False, WALK3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_lens,kv_lens,causal,config", GPU_CASES)
def test_gpu_matches_reference(heads, q_lens, kv_lens, causal, config):
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    run_case(heads, q_lens, kv_lens, causal, config=config, interpret=False)


@pytest.mark.gpu
def test_gpu_profile_names_every_phase(tmp_path):
    """`MgpuPrefillConfig.profile_space` writes Mosaic GPU's per-warpgroup trace with the
    kernel's named phases (summarized by `bench.kernel_trace`) and leaves out and lse as they
    are without the profiler."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs an NVIDIA GPU")
    from bench.kernel_trace import _block_traces, summarize

    q, k, v, qo, kv = make(np.random.default_rng(3), 16, [300, 129], [1000, 129])
    cfg = MgpuPrefillConfig(profile_space=64, profile_dir=str(tmp_path))
    profiled = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=True, config=cfg)
    plain = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=True, config=MgpuPrefillConfig())
    events = assert_profiled_like_plain(profiled, plain, tmp_path, set())
    summary = summarize(events)
    names = set(summary["warpgroups"][0]["phases"]) | set(summary["warpgroups"][2]["phases"])
    assert {"wait_q", "wait_k", "qk", "softmax", "wait_v", "turn", "pv", "finish",
            "store_wait", "copy_q", "copy"} <= names
    # 16 heads x 6 live q tiles run a phase of the kernel: 3 + 2 of the requests and 1 of the
    # rows past the last one (the layout's spare-rows request: q_len 3, no keys, out 0). The
    # grid's empty slots record at most Mosaic GPU's own prologue region ("Init", jax >= 0.11).
    blocks, _ = _block_traces(events, warpgroups=3)
    working = [b for b, wgs in blocks.items()
               if any(name != "Init" for _, evs in wgs.values() for name, _, _ in evs)]
    assert len(working) == 16 * 6


def _kernel_inputs(monkeypatch, run) -> tuple[dict, object]:
    """(what `run()`, an `mha_prefill` call, hands the kernel: its nine operands by name,
    "qo" ... "vp", run()'s result). The kernel is replaced by zeros of its output shapes (these
    tests check its inputs; its results: the interpret cases)."""
    from funcmla.attention.pallas import prefill as prefill_mod

    seen = {}
    real_kernel = prefill_mod.prefill_kernel
    names = ("qo", "kv", "q_lens", "kv_lens", "tile_req", "tile_first", "qp", "kp", "vp")

    def spy(*args, **kw):  # runs while `_mha_prefill` traces
        def call(*ops):
            jax.debug.callback(lambda *xs: seen.update(zip(names, xs)), *ops)
            shapes = jax.eval_shape(real_kernel(*args, **kw), *ops)
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return call

    monkeypatch.setattr(prefill_mod, "prefill_kernel", spy)
    _clear_caches(prefill_mod)
    try:
        result = jax.block_until_ready(run())
    finally:
        _clear_caches(prefill_mod)
    return seen, result


def _clear_caches(prefill_mod):
    """Forget the traced schedule and kernel calls (a monkeypatched callee runs again)."""
    prefill_mod._mha_prefill.clear_cache()
    prefill_mod._schedule.clear_cache()


class _RecordingTMA:
    """`plgpu` as the prefill kernel sees it, recording the first row of every TMA copy of a
    row range of q / k / v / out (`jax.debug.callback`, so the interpreter reports the traced
    value) as (kind, row, rows): "read" for q / k / v into 8-row-tiled shared memory, "write"
    for out (a 64-row copy is the swizzled, 8-row-tiled staging; shorter ones row-major)."""

    def __init__(self, plgpu):
        self._plgpu, self.seen = plgpu, []

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    def _record(self, kind, gmem):
        first = gmem.transforms[-1].indices[0]
        if isinstance(first, type(pl.ds(0, 1))):  # a row range
            jax.debug.callback(lambda row, n=first.size: self.seen.append((kind, int(row), n)),
                               first.start)

    def copy_gmem_to_smem(self, src, dst, *args, **kw):
        self._record("read", src)
        return self._plgpu.copy_gmem_to_smem(src, dst, *args, **kw)

    def copy_smem_to_gmem(self, src, dst, *args, **kw):
        self._record("write", dst)
        return self._plgpu.copy_smem_to_gmem(src, dst, *args, **kw)


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_tma_copies_of_tiled_rows_start_on_8_row_boundaries(causal, monkeypatch):
    """Mosaic GPU's TMA copies a row range into 8-row-tiled shared memory from the tensor viewed
    as 8-row groups, so a copy starting mid-group reads (or writes) the wrong rows on the GPU;
    the interpreter moves exact rows, so only the kernel's copies show it on a CPU. With every
    start off 8 rows, the kernel reads q / k / v and writes full 64-row halves of out from
    multiples of 8 only, writes each output row once (the rows past qo_indptr[-1] too), and
    matches the float32 reference."""
    from funcmla.attention.pallas import prefill_mgpu

    q_lens, kv_lens = [70, 3, 1, 60], [100, 5, 33, 61]  # q starts 70, 73, 74; kv 100, 105, 138
    rec = _RecordingTMA(prefill_mgpu.plgpu)
    monkeypatch.setattr(prefill_mgpu, "plgpu", rec)
    q, k, v, qo, kv = make(np.random.default_rng(2), 1, q_lens, kv_lens, poison=np.nan)
    out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, causal=causal,
                           config=MgpuPrefillConfig(block_kv=64), interpret=True)
    check(out, lse, *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE, causal=causal))
    reads = [r for kind, r, _ in rec.seen if kind == "read"]
    tiled_writes = [r for kind, r, n in rec.seen if kind == "write" and n == 64]
    assert reads and all(r % 8 == 0 for r in reads + tiled_writes), rec.seen
    written = sorted(r + i for kind, r, n in rec.seen if kind == "write" for i in range(n))
    assert written == list(range(q.shape[0])), written  # each row of q's once (no key: 0)


@pytest.mark.parametrize("q_lens,kv_lens", [([70, 0, 1], [100, 5, 33]),
                                            ([64, 8, 16], [64, 8, 16])])
def test_a_step_serves_every_layer_with_the_schedule_built_once(q_lens, kv_lens, monkeypatch):
    """`prefill_step` builds the schedule once; each layer's `mha_prefill(step=...)` hands the
    kernel what the call with the indptrs does, for its own q / k / v (as they are, padded to
    the kernel's rows), and builds no layout of its own."""
    from funcmla.attention.pallas import prefill as prefill_mod

    rng = np.random.default_rng(4)
    layers = [make(rng, 1, q_lens, kv_lens) for _ in range(2)]
    qo, kv = layers[0][3], layers[0][4]
    cfg = MgpuPrefillConfig(block_kv=64)
    built = []
    real_layout = prefill_mod.prefill_layout
    monkeypatch.setattr(prefill_mod, "prefill_layout",
                        lambda *a: built.append(1) or real_layout(*a))
    _clear_caches(prefill_mod)
    step = prefill_mod.prefill_step(qo, kv, layers[0][0].shape[0], layers[0][1].shape[0],
                                    config=cfg, interpret=True)
    assert len(built) == 1
    for q, k, v, _, _ in layers:
        before = len(built)
        with_step, _ = _kernel_inputs(monkeypatch, lambda: mha_prefill(
            q, k, v, step=step, sm_scale=SCALE))
        assert len(built) == before  # the layer built no layout
        direct, _ = _kernel_inputs(monkeypatch, lambda: mha_prefill(
            q, k, v, qo, kv, sm_scale=SCALE, config=cfg, interpret=True))
        assert with_step.keys() == direct.keys()
        for name in direct:
            np.testing.assert_array_equal(np.asarray(with_step[name]),
                                          np.asarray(direct[name]), err_msg=name)
        for name, x in (("qp", q), ("kp", k), ("vp", v)):  # in place: row r is row r
            np.testing.assert_array_equal(np.asarray(with_step[name][:x.shape[0]]),
                                          np.asarray(x), err_msg=name)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=8), st.integers(0, 40))
def test_a_step_of_known_lengths_sizes_the_grid_to_its_tiles(q_lens, extra):
    """Concrete indptrs: the tile slots are the batch's live tiles (`tile_counts`, the rows past
    the last request included) rounded by `slot_count`, every one of them scheduled, at most
    12.5% idle and never more than the bound for any batch, which traced indptrs get."""
    from funcmla.attention.pallas.prefill import prefill_step
    from funcmla.attention.pallas.prefill_layout import slot_count

    qo = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tk = int(qo[-1])
    num_q = tk + extra
    step = prefill_step(qo, qo, num_q, tk)
    live = int(np.sum([-(-(s % 8 + n) // 128) for s, n in zip(
        np.append(np.asarray(qo[:-1]), qo[-1]), [*q_lens, extra]) if n]))
    bound = num_tile_slots(step.geometry.q_rows, step.geometry.num_reqs)
    assert step.geometry.num_slots == min(slot_count(live), bound)
    assert live <= step.geometry.num_slots <= max(live, live * 9 // 8, 15)
    if num_q:
        req = np.asarray(step.operands[4])
        assert (req[:live] >= 0).all() and (req[live:] == -1).all()
    traced = jax.jit(lambda a: prefill_step(a, a, num_q, tk, max_kv_len=1))(qo)
    assert traced.geometry.num_slots == bound


@pytest.mark.slow  # Mosaic GPU interpret mode, twice
def test_interpret_grid_of_the_batch_s_tiles_gives_the_bound_s_bits():
    """The kernel on a grid of the batch's live tiles (concrete indptrs) and on the bound's
    (traced ones, two idle slots more here) gives the same bits: idle slots only exit."""
    q, k, v, qo, kv = make(np.random.default_rng(5), 1, [70, 3, 1], [100, 5, 33])
    call = functools.partial(mha_prefill, sm_scale=SCALE, causal=True,
                             config=MgpuPrefillConfig(block_kv=64), interpret=True)
    out, lse = call(q, k, v, qo, kv)
    out_j, lse_j = jax.jit(call)(q, k, v, qo, kv)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_j, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_j))


def test_a_jit_over_known_csrs_holds_the_schedule_as_constants():
    """Indptrs the host knows (closed over by a jit) give a program with the schedule as
    constants: no cumsum of the tile counts runs in it, as it does for traced indptrs."""
    q, k, v, qo, kv = make(np.random.default_rng(0), 1, [70, 3, 1], [100, 5, 33])

    def prims(jaxpr, seen):
        for e in jaxpr.eqns:
            seen.add(e.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                prims(sub, seen)
        return seen

    call = functools.partial(mha_prefill, sm_scale=SCALE, interpret=True)
    known = jax.jit(lambda q_, k_, v_: call(q_, k_, v_, qo, kv)).trace(q, k, v).jaxpr
    traced = jax.jit(lambda *a: call(*a, max_kv_len=100)).trace(q, k, v, qo, kv).jaxpr
    assert "cumsum" not in prims(known.jaxpr, set())
    assert "cumsum" in prims(traced.jaxpr, set())


def test_slot_count_rounds_to_an_eighth_of_a_power_of_two():
    from funcmla.attention.pallas.prefill_layout import slot_count

    assert [slot_count(n) for n in (0, 1, 15, 16, 17, 128, 129, 146, 1000)] == [
        1, 1, 15, 16, 18, 128, 144, 160, 1024]
    for lo in (16, 256, 4096):  # 8 counts per doubling
        assert len({slot_count(n) for n in range(lo + 1, 2 * lo + 1)}) == 8


def test_a_step_builds_under_jit_from_traced_indptrs():
    """Under jit the indptrs are traced: the step takes the config of its `max_kv_len` hint and
    comes out of the jit as a pytree of its arrays."""
    from funcmla.attention.pallas.prefill import PrefillStep, prefill_step

    qo = jnp.asarray([0, 64, 72], jnp.int32)
    step = jax.jit(lambda a, b: prefill_step(a, b, 80, 80, max_kv_len=64,
                                             interpret=True))(qo, qo)
    assert isinstance(step, PrefillStep) and len(step.operands) == 6
    assert step.config == SHORT_CONFIG and step.num_q == 80


@pytest.mark.slow  # Mosaic GPU interpret mode
def test_interpret_step_reused_by_two_layers_matches_reference():
    """One step, two layers of other q / k / v: each layer's output and lse match the float32
    reference of its own tensors."""
    from funcmla.attention.pallas.prefill import prefill_step

    rng = np.random.default_rng(6)
    q_lens, kv_lens = [70, 0, 1], [100, 5, 33]
    layers = [make(rng, 1, q_lens, kv_lens) for _ in range(2)]
    qo, kv = layers[0][3], layers[0][4]
    step = prefill_step(qo, kv, layers[0][0].shape[0], layers[0][1].shape[0],
                        config=MgpuPrefillConfig(block_kv=64), interpret=True)
    for q, k, v, _, _ in layers:
        out, lse = mha_prefill(q, k, v, step=step, sm_scale=SCALE)
        check(out, lse, *mha_attention_reference(q, k, v, qo, kv, sm_scale=SCALE,
                                                 causal=True))


def _fp8_case(rng, heads, q_lens, kv_lens, dtype=jnp.float8_e4m3fn):
    """fp8 q / k / v of these lengths (NaN in the k / v rows past kv_indptr[-1]) and their
    float32 values (the fp8 values, unscaled)."""
    q, k, v, qo, kv = make(rng, heads, q_lens, kv_lens, poison=np.nan)
    # Rounded by ml_dtypes, not XLA: conftest's XLA:CPU emitters round tiny negative values to
    # e4m3fnuz's NaN (0x80) instead of to 0.
    q8, k8, v8 = (jnp.asarray(np.asarray(x, np.float32).astype(dtype)) for x in (q, k, v))
    return (q8, k8, v8, qo, kv), [np.asarray(x.astype(jnp.float32)) for x in (q8, k8, v8)]


FP8_SCALES = dict(q_scale=0.5, k_scale=jnp.asarray([1.75], jnp.float32), v_scale=3.0)


@pytest.mark.parametrize("scales", [{}, FP8_SCALES])
def test_fp8_operands_reach_the_kernel_dequantized(scales, monkeypatch):
    """fp8 q / k / v (SGLang's fp8 prefill, unit scales, or per-tensor scales as floats or
    float32 arrays) reach the kernel as bfloat16 float(x) * scale: exact at scale 1, one bf16
    rounding otherwise; out is bfloat16. The kernel's own results: the interpret case below."""
    (q8, k8, v8, qo, kv), f32 = _fp8_case(np.random.default_rng(5), 1, [64, 8], [64, 16])
    got_in, (out, _) = _kernel_inputs(monkeypatch, lambda: mha_prefill(
        q8, k8, v8, qo, kv, sm_scale=SCALE, causal=True, interpret=True, **scales))
    seen = {name: got_in[f"{name}p"] for name in "qkv"}
    assert out.dtype == jnp.bfloat16
    live = {"q": int(qo[-1]), "k": int(kv[-1]), "v": int(kv[-1])}
    for name, x in zip("qkv", f32):
        s = np.float32(np.asarray(scales.get(f"{name}_scale", 1.0)).reshape(-1)[0])
        want = np.asarray(jnp.asarray(x * s).astype(jnp.bfloat16).astype(jnp.float32))
        got = np.asarray(jnp.asarray(seen[name]).astype(jnp.float32))
        assert seen[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(got[:live[name]], want[:live[name]], err_msg=name)
        if not scales:  # every fp8 value is a bf16 value
            np.testing.assert_array_equal(got[:live[name]], x[:live[name]], err_msg=name)


@pytest.mark.slow  # Mosaic GPU interpret mode
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_interpret_fp8_against_reference_on_dequantized_values(dtype):
    """fp8 inputs with scales other than 1 against the float32 reference over the dequantized
    values (float(x) * scale); NaN in the k / v rows no request uses."""
    (q8, k8, v8, qo, kv), (q, k, v) = _fp8_case(np.random.default_rng(6), 2, *CAUSAL_MORE,
                                                dtype=dtype)
    out, lse = mha_prefill(q8, k8, v8, qo, kv, sm_scale=SCALE, causal=True,
                           config=MgpuPrefillConfig(block_kv=64), interpret=True, **FP8_SCALES)
    ks = float(FP8_SCALES["k_scale"][0])
    deq = [jnp.asarray(x * s) for x, s in ((q, FP8_SCALES["q_scale"]), (k, ks),
                                          (v, FP8_SCALES["v_scale"]))]
    check(out, lse, *mha_attention_reference(*deq, qo, kv, sm_scale=SCALE, causal=True))


# ----------------------------------------------------------------------------- config choice

def test_prefill_config_by_the_longest_kv_len():
    """`prefill_kernel_config`: 64-token tiles in 3 stages, two q tiles a CTA, up to
    SHORT_KV_LEN keys, the default 128-token tiles past it and where the lengths are unknown
    (None)."""
    from funcmla.attention.pallas.prefill import SHORT_CONFIG, SHORT_KV_LEN, prefill_kernel_config

    assert (SHORT_CONFIG.block_kv, SHORT_CONFIG.num_stages, SHORT_CONFIG.tiles_per_cta) == \
        (64, 3, 2)
    for n in (0, 1, 1024, SHORT_KV_LEN):
        assert prefill_kernel_config(n) == SHORT_CONFIG
    for n in (SHORT_KV_LEN + 1, 16384):
        assert prefill_kernel_config(n) == MgpuPrefillConfig()
    assert prefill_kernel_config(None) == MgpuPrefillConfig()
    assert prefill_kernel_config(np.int64(100)) == SHORT_CONFIG


def _config_used(monkeypatch, run) -> list:
    """The configs `run()` (mha_prefill calls, eager or under jit) hands the jitted prefill,
    which is replaced by a stand-in of its output shapes: no kernel runs."""
    from funcmla.attention.pallas import prefill as prefill_mod

    used = []

    def stand_in(q, k, v, step, *a, **kw):
        used.append(step.config)
        return q[:, :, :128], q[:, :, 0].astype(jnp.float32)

    with monkeypatch.context() as m:
        m.setattr(prefill_mod, "_mha_prefill", stand_in)
        run()
    return used


def test_mha_prefill_picks_the_config_from_the_host_lengths(monkeypatch):
    """config=None: `prefill_kernel_config` of the longest kv_len from concrete indptrs, of a
    `max_kv_len` hint under jit, and the default with neither; an explicit config is kept."""
    from funcmla.attention.pallas.prefill import SHORT_CONFIG, SHORT_KV_LEN

    def call(kv_lens, **kw):
        q, k, v, qo, kv = make(np.random.default_rng(0), 1, [1] * len(kv_lens), kv_lens,
                               extra_kv=0)
        return lambda: mha_prefill(q, k, v, qo, kv, sm_scale=SCALE, **kw)

    assert _config_used(monkeypatch, call([3, SHORT_KV_LEN])) == [SHORT_CONFIG]
    assert _config_used(monkeypatch, call([3, SHORT_KV_LEN + 1])) == [MgpuPrefillConfig()]
    explicit = MgpuPrefillConfig(block_kv=64, num_stages=2)
    assert _config_used(monkeypatch, call([3, 5], config=explicit)) == [explicit]
    q, k, v, qo, kv = make(np.random.default_rng(0), 1, [1, 1], [3, 5], extra_kv=0)

    def traced(**kw):  # indptrs traced: the host cannot read them
        return _config_used(monkeypatch, lambda: jax.jit(
            lambda qo_, kv_: mha_prefill(q, k, v, qo_, kv_, sm_scale=SCALE, **kw)[0])(qo, kv))

    assert traced() == [MgpuPrefillConfig()]
    assert traced(max_kv_len=5) == [SHORT_CONFIG]
    assert traced(max_kv_len=SHORT_KV_LEN + 1) == [MgpuPrefillConfig()]
