"""Absorbed MLA extend (`mla_extend`: the decode kernels over query chunks) against the float32
reference (`funcmla.attention.reference`) and a float64 NumPy restatement.

CPU runs use Pallas interpret mode on small, fixed shapes (the Triton-lowered kernel; the
Mosaic GPU kernel in interpret mode is a `slow` test); the compiled kernels are tested where a
GPU is present (`gpu`). Every pool row no request uses (page 0 included, where padded table
entries point) holds NaN, so a read past a request's keys shows up in the result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas import DecodeKernelConfig, chunk_tokens, mla_extend
from funcmla.attention.pallas.extend import extend_chunks, num_pseudo_seqs
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from funcmla.layout import PageTable
from tests.pools import attention_oracle_f64, rel_err

pytestmark = pytest.mark.filterwarnings("ignore:.*Triton.*:DeprecationWarning")

D, DV = 576, 512
SCALE = MLADims().sm_scale


def make_extend(rng, *, heads, page_size, q_lens, kv_lens, pad_tokens=2, max_pages=None,
                pool_dtype=jnp.bfloat16, poison=np.nan, capacity_pad=7):
    """Requests of q_lens queries over kv_lens keys (prefix = kv - q) on random pages; q has
    `pad_tokens` rows past the last request. Returns the page table, the token CSR, q, the
    pool (NaN in every unused row) and the indptrs."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    batch = len(q_lens)
    need = max(1, max(-(-int(n) // page_size) for n in kv_lens))
    max_pages = max_pages or need + 1  # a padded column at least
    n_pages = batch * max_pages + 1
    slots = n_pages * page_size
    pool = rng.standard_normal((slots, D)).astype(np.float32)
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = perm[: batch * max_pages].reshape(batch, max_pages).copy()
    slot_lists, live = [], np.zeros(slots, bool)
    for b in range(batch):
        table[b, -(-int(kv_lens[b]) // page_size):] = 0  # padding points at page 0
        pos = np.arange(kv_lens[b])
        sl = (table[b, pos // page_size] * page_size + pos % page_size).astype(np.int32)
        slot_lists.append(sl)
        live[sl] = True
    pool[~live] = poison
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    kv_indices = np.zeros(int(kv_indptr[-1]) + capacity_pad, np.int32)
    if kv_indptr[-1]:
        kv_indices[: kv_indptr[-1]] = np.concatenate(slot_lists)
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(qo_indptr[-1]) + pad_tokens
    q = rng.standard_normal((t, heads, D)).astype(np.float32)
    return dict(q=jnp.asarray(q, jnp.bfloat16), pool=jnp.asarray(pool, pool_dtype),
                table=jnp.asarray(table), kv_lens=jnp.asarray(kv_lens.astype(np.int32)),
                kv_indptr=jnp.asarray(kv_indptr), kv_indices=jnp.asarray(kv_indices),
                qo_indptr=jnp.asarray(qo_indptr), page_size=page_size)


def run(p, form, **kw):
    args = {"sm_scale": SCALE, "interpret": True, **kw}
    if form == "csr":
        return mla_extend(p["q"], p["pool"], qo_indptr=p["qo_indptr"], kv_indptr=p["kv_indptr"],
                          kv_indices=p["kv_indices"], **args)
    pt = PageTable(p["table"], p["kv_lens"], p["page_size"])
    return mla_extend(p["q"], p["pool"], qo_indptr=p["qo_indptr"], page_table=pt, **args)


def reference(p, causal=True, pool=None):
    """The float32 reference on the same bf16 values (NaN rows are never selected)."""
    pool = p["pool"] if pool is None else pool
    return mla_attention_reference(p["q"].astype(jnp.float32), pool.astype(jnp.float32),
                                   p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                                   sm_scale=SCALE, causal=causal)


def check(out, lse, ref_out, ref_lse, tol=1e-2):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse, ref_out, ref_lse = (np.asarray(x, np.float64) for x in (lse, ref_out, ref_lse))
    assert np.isfinite(out).all(), "NaN/Inf in out"
    live = np.isfinite(ref_lse)
    assert (lse[~live] == np.inf).all(), "rows that see no key must have lse +inf"
    assert (out[~live] == 0).all(), "rows that see no key must have out 0"
    assert live.any()
    assert rel_err(out[live], ref_out[live]) < tol
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-3, atol=2e-2)


# One batch covers the shapes of an extend: a prefix (5 queries over 20 keys), a request with
# keys but no queries, q_len = kv_len = 1, q_len = kv_len (no prefix: 9 / 9), a long prefix
# with a partial last tile (3 over 70), a request with neither, q_len = 1 over a prefix, and
# 2 padded q rows.
Q_LENS = [5, 0, 1, 9, 3, 0, 1]
KV_LENS = [20, 3, 1, 9, 70, 0, 33]


@pytest.mark.parametrize("heads,page_size,form", [
    (16, 1, "csr"), (16, 16, "pages"),
    pytest.param(128, 64, "pages", marks=pytest.mark.slow),
    pytest.param(128, 1, "csr", marks=pytest.mark.slow),
    pytest.param(16, 64, "pages", marks=pytest.mark.slow)])
def test_extend_matches_reference(heads, page_size, form):
    rng = np.random.default_rng(heads + page_size)
    p = make_extend(rng, heads=heads, page_size=page_size, q_lens=Q_LENS, kv_lens=KV_LENS)
    out, lse = run(p, form)
    t = p["q"].shape[0]
    assert out.shape == (t, heads, DV) and out.dtype == jnp.bfloat16
    assert lse.shape == (t, heads) and lse.dtype == jnp.float32
    check(out, lse, *reference(p))


@pytest.mark.slow  # two interpret runs (split and unsplit); the reference cases stay fast
def test_extend_matches_float64_oracle_and_splits_agree():
    """Against an independent float64 restatement; a forced split count (three KV splits,
    merged by log-sum-exp) gives the same result within bf16 rounding."""
    rng = np.random.default_rng(3)
    p = make_extend(rng, heads=16, page_size=1, q_lens=[7, 2], kv_lens=[150, 2], pad_tokens=0)
    want = attention_oracle_f64(np.asarray(p["q"], np.float32),
                                np.nan_to_num(np.asarray(p["pool"], np.float32)),
                                np.asarray(p["qo_indptr"]), np.asarray(p["kv_indptr"]),
                                np.asarray(p["kv_indices"]), SCALE, DV)
    one = run(p, "csr", num_splits=1)
    three = run(p, "csr", num_splits=3)
    check(*one, *want)
    check(*three, *want)
    assert rel_err(np.asarray(three[0], np.float32), np.asarray(one[0], np.float32)) < 1e-2


def test_non_causal_sees_every_key():
    rng = np.random.default_rng(4)
    p = make_extend(rng, heads=16, page_size=16, q_lens=[4, 6], kv_lens=[2, 30])
    out, lse = run(p, "pages", causal=False)
    check(out, lse, *reference(p, causal=False))


def test_poison_never_reaches_output():
    """Unused rows holding NaN, +Inf or -Inf give bitwise the output of a clean pool."""
    outs = []
    for poison in (0.0, np.nan, np.inf, -np.inf):
        p = make_extend(np.random.default_rng(5), heads=16, page_size=16, q_lens=[5, 3],
                        kv_lens=[20, 3], poison=poison)
        outs.append([np.asarray(x, np.float32) for x in run(p, "pages")])
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            np.testing.assert_array_equal(a, b)


def test_fp8_pool_with_scale():
    """An fp8 (float8_e4m3fn) pool with a per-layer scale: against the reference over the
    dequantized cache."""
    rng = np.random.default_rng(6)
    p = make_extend(rng, heads=16, page_size=1, q_lens=[6, 1], kv_lens=[40, 5],
                    pool_dtype=jnp.float8_e4m3fn)
    out, lse = run(p, "csr", k_scale=0.5)
    want = mla_attention_reference(p["q"].astype(jnp.float32), p["pool"], p["qo_indptr"],
                                   p["kv_indptr"], p["kv_indices"], sm_scale=SCALE,
                                   k_scale=0.5)
    check(out, lse, *want)


def test_empty_q_and_all_empty_requests():
    rng = np.random.default_rng(7)
    p = make_extend(rng, heads=16, page_size=1, q_lens=[0, 0], kv_lens=[4, 0], pad_tokens=3)
    out, lse = run(p, "csr")
    assert (np.asarray(out, np.float32) == 0).all() and (np.asarray(lse) == np.inf).all()
    q0 = p["q"][:0]
    out, lse = mla_extend(q0, p["pool"], qo_indptr=jnp.zeros(3, jnp.int32),
                          kv_indptr=p["kv_indptr"], kv_indices=p["kv_indices"], sm_scale=SCALE,
                          interpret=True)
    assert out.shape == (0, 16, DV) and lse.shape == (0, 16)


def test_under_jit_bad_values_stay_in_bounds():
    """Unchecked under jit, kv_len < q_len does not read out of bounds: the early queries see
    no keys, as the reference defines them (eagerly, the same call raises)."""
    rng = np.random.default_rng(8)
    p = make_extend(rng, heads=16, page_size=1, q_lens=[6], kv_lens=[3], pad_tokens=0)
    with pytest.raises(ValueError, match="only 3 keys"):
        run(p, "csr")
    out, lse = jax.jit(lambda q, qo, ki, kx: mla_extend(
        q, p["pool"], qo_indptr=qo, kv_indptr=ki, kv_indices=kx, sm_scale=SCALE,
        interpret=True))(p["q"], p["qo_indptr"], p["kv_indptr"], p["kv_indices"])
    check(out, lse, *reference(p))
    assert (np.asarray(lse)[:3] == np.inf).all()


@pytest.mark.slow  # each example traces the interpret kernel on new lengths
@settings(max_examples=3)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=3, max_size=3))
def test_random_ragged_batches(lens):
    """Hypothesis draws (q_len, prefix) per request: fixed shapes (T = 30 rows, capacity 160,
    pool 3 x 50 + 1 rows), so one compiled program serves every example."""
    q_lens = [q for q, _ in lens]
    kv_lens = [q + pre for q, pre in lens]
    rng = np.random.default_rng(9)
    p = make_extend(rng, heads=16, page_size=1, q_lens=q_lens, kv_lens=kv_lens,
                    pad_tokens=30 - sum(q_lens), capacity_pad=160 - sum(kv_lens),
                    max_pages=50)
    if not any(q and kv for q, kv in zip(q_lens, kv_lens)):
        out, lse = run(p, "csr")
        assert (np.asarray(lse) == np.inf).all()
        return
    check(*run(p, "csr"), *reference(p))


_chunks = jax.jit(lambda qo, start, kv, *, chunk: extend_chunks(
    qo, start, kv, num_pseudo=408, chunk=chunk, causal=True), static_argnames="chunk")


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.sampled_from([1, 4, 8]))
def test_pseudo_sequence_bound_and_lengths(q_lens, chunk):
    """P bounds the chunks of any batch of T tokens; each pseudo-sequence's KV length is the
    keys its last query sees, and the lengths of one request step by C up to its kv_len."""
    t, b = sum(q_lens), len(q_lens)
    prefix = 7
    n = [-(-q // chunk) for q in q_lens]
    assert sum(n) <= num_pseudo_seqs(t, b, chunk)
    # fixed shapes (8 requests, the trailing ones empty; 408 pseudo-sequences): one program
    lens = np.zeros(8, np.int32)
    lens[:b] = q_lens
    qo = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    kv = jnp.asarray(np.where(np.arange(8) < b, lens + prefix, 0).astype(np.int32))
    start = jnp.arange(8, dtype=jnp.int32) * 100
    ts, kl, ci = _chunks(qo, start, kv, chunk=chunk)
    ts, kl = np.asarray(ts), np.asarray(kl)
    k = 0
    for i, q in enumerate(q_lens):
        want = [prefix + q - (n[i] - 1 - c) * chunk for c in range(n[i])]
        assert list(kl[k:k + n[i]]) == want and (ts[k:k + n[i]] == 100 * i).all()
        k += n[i]
    assert (kl[k:] == 0).all() and int(ci[-1]) == k


def test_extend_kernel_rule(monkeypatch):
    """On a GPU, "auto" runs the Mosaic GPU kernel from `mgpu_min_blocks` 64-row blocks (the
    decode rule) where it takes the shape, fp8 pools alike; explicit choices and interpret mode
    keep theirs."""
    from funcmla.attention.pallas.extend import extend_kernel_config

    auto = DecodeKernelConfig(mgpu_min_blocks=16)
    assert extend_kernel_config(auto, 128, 1, 100, 64) is auto  # CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    n = auto.mgpu_min_blocks
    assert extend_kernel_config(auto, 128, 1, n // 2, 64).kernel == "mgpu"  # 2 blocks each
    assert extend_kernel_config(auto, 128, 1, n // 2 - 1, 64) is auto
    assert extend_kernel_config(auto, 16, 4, n, 1).kernel == "mgpu"
    assert extend_kernel_config(auto, 16, 4, n - 1, 1) is auto
    assert extend_kernel_config(auto, 24, 2, 1000, 1) is auto  # 48 rows: not a 64-row block
    for h, c in ((128, 1), (16, 4)):  # fp8 pools at 64-row blocks: the 64-row fp8 kernel
        fp8 = extend_kernel_config(auto, h, c, 1000, 1, kv_dtype=jnp.float8_e4m3fn)
        assert fp8.kernel == "mgpu"
        few = extend_kernel_config(auto, h, c, n // (h * c // 64) - 1, 1,
                                   kv_dtype=jnp.float8_e4m3fn)
        assert few is auto  # under mgpu_min_blocks
    # 16 rows (not causal: one token a pseudo-sequence): the decode's rule, the 16-row kernel
    assert extend_kernel_config(auto, 16, 1, 1000, 1, kv_dtype=jnp.float8_e4m3fn).kernel == "mgpu"
    assert extend_kernel_config(auto, 128, 1, 1000, 1, interpret=True) is auto
    tri = DecodeKernelConfig(kernel="triton")
    assert extend_kernel_config(tri, 128, 1, 1000, 64) is tri


def test_chunk_rule():
    assert [chunk_tokens(h) for h in (128, 64, 32, 16, 8)] == [1, 1, 2, 4, 8]
    assert chunk_tokens(16, causal=False) == 1


@pytest.mark.slow  # 10 s cold; the fast set reaches mla_extend through mla_attention in
# tests/test_interop_sglang.py::test_pallas_backend_wiring_in_interpret_mode
def test_through_mla_attention_on_a_ragged_batch(monkeypatch):
    """`mla_attention(backend="pallas")` runs the extend kernel path (interpret mode here) on a
    ragged extend batch, a target-verify of 6 draft tokens and a non-causal decode: no
    fallback."""
    import functools

    from funcmla.interop import backend_select
    from funcmla.metadata import ForwardMetadata

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    monkeypatch.setattr(backend_select, "_pallas_extend",
                        lambda: functools.partial(mla_extend, interpret=True))
    rng = np.random.default_rng(10)
    p = make_extend(rng, heads=16, page_size=1, q_lens=[5, 0, 9, 3], kv_lens=[20, 3, 9, 70],
                    pad_tokens=0)
    meta = ForwardMetadata(p["kv_indptr"], p["kv_indices"], p["qo_indptr"],
                           jnp.ones(4, jnp.int32), jnp.int32(9), jnp.int32(70), mode="extend")
    res = backend_select.mla_attention(p["q"], p["pool"], meta, sm_scale=SCALE,
                                       backend="pallas")
    assert (res.backend, res.fallback_reason) == ("pallas", None)
    check(res.out, res.lse, *reference(p))
    v = make_extend(rng, heads=16, page_size=1, q_lens=[6, 6], kv_lens=[6, 40], pad_tokens=0)
    vmeta = ForwardMetadata(v["kv_indptr"], v["kv_indices"], v["qo_indptr"],
                            jnp.ones(2, jnp.int32), jnp.int32(6), jnp.int32(40),
                            mode="target_verify", num_draft_tokens=6)
    res = backend_select.mla_attention(v["q"], v["pool"], vmeta, sm_scale=SCALE,
                                       backend="pallas")
    assert (res.backend, res.fallback_reason) == ("pallas", None)
    check(res.out, res.lse, *reference(v))
    d = make_extend(rng, heads=16, page_size=1, q_lens=[1, 1], kv_lens=[6, 40], pad_tokens=0)
    dmeta = dataclasses.replace(vmeta, kv_indptr=d["kv_indptr"], kv_indices=d["kv_indices"],
                                qo_indptr=d["qo_indptr"], mode="decode", num_draft_tokens=0)
    res = backend_select.mla_attention(d["q"], d["pool"], dmeta, sm_scale=SCALE,
                                       backend="pallas", causal=False)
    assert (res.backend, res.fallback_reason) == ("pallas", None)
    check(res.out, res.lse, *reference(d, causal=False))
    assert backend_select.pallas_route("decode", dmeta) == ("decode", 1)
    assert backend_select.pallas_route("target_verify", vmeta) == ("extend", None)


@pytest.mark.slow  # Mosaic GPU interpret mode: ~40 s of CPU
def test_mosaic_gpu_kernel_in_interpret_mode():
    """The chunked path on the Mosaic GPU kernel (C = 4 at 16 heads: 64-row blocks of four
    tokens with four causal limits), pages of 16."""
    rng = np.random.default_rng(11)
    p = make_extend(rng, heads=16, page_size=16, q_lens=[5, 1], kv_lens=[70, 1])
    check(*run(p, "pages", config=DecodeKernelConfig(kernel="mgpu")), *reference(p))


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("heads,page_size", [(128, 1), (128, 64), (16, 1), (16, 64), (64, 16)])
def test_gpu_extend_matches_reference(heads, page_size):
    """Compiled kernels (the auto dispatch: Mosaic GPU where the pseudo-sequences fill a
    quarter of the GPU) on a ragged batch with prefixes, zero-length requests and NaN in every
    unused pool row."""
    rng = np.random.default_rng(heads * 3 + page_size)
    q_lens = [300, 0, 1, 77, 129, 64]
    kv_lens = [1000, 5, 1, 77, 1500, 64]
    p = make_extend(rng, heads=heads, page_size=page_size, q_lens=q_lens, kv_lens=kv_lens)
    form = "csr" if page_size == 1 else "pages"
    check(*run(p, form, interpret=False), *reference(p))


def _fp8_extend_on_the_64_row_kernel(heads, page_size, q_lens, kv_lens, interpret):
    """The 64-row fp8 Mosaic GPU kernel (asked for explicitly) under an extend's
    pseudo-sequences, against the reference over the dequantized cache (k_scale 0.5), NaN in
    every unused pool row."""
    rng = np.random.default_rng(heads + page_size)
    p = make_extend(rng, heads=heads, page_size=page_size, q_lens=q_lens, kv_lens=kv_lens,
                    pool_dtype=jnp.float8_e4m3fn)
    form = "csr" if page_size == 1 else "pages"
    out, lse = run(p, form, interpret=interpret, k_scale=0.5,
                   config=DecodeKernelConfig(kernel="mgpu"))
    want = mla_attention_reference(p["q"].astype(jnp.float32), p["pool"], p["qo_indptr"],
                                   p["kv_indptr"], p["kv_indices"], sm_scale=SCALE,
                                   k_scale=0.5)
    check(out, lse, *want)


@pytest.mark.parametrize("heads,page_size", [(16, 64),
                                             pytest.param(64, 1, marks=pytest.mark.slow)])
def test_interpret_fp8_extend_on_the_64_row_fp8_kernel(heads, page_size):
    """In interpret mode (16 heads: four tokens a pseudo-sequence, causal within it; 64 heads:
    one), with prefixes and an empty request; the compiled kernel: the GPU test below."""
    _fp8_extend_on_the_64_row_kernel(heads, page_size, [9, 0, 1, 6], [40, 5, 1, 6],
                                     interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,page_size", [(128, 1), (128, 64), (16, 16), (16, 64)])
def test_gpu_fp8_extend_on_the_64_row_fp8_kernel(heads, page_size):
    """fp8 extends at 64-row blocks (128 heads, one token a pseudo-sequence; 16 heads, four)
    compiled on the 64-row fp8 Mosaic GPU kernel (what `extend_kernel_config`'s auto runs
    there), with prefixes and empty requests."""
    _fp8_extend_on_the_64_row_kernel(heads, page_size, [300, 0, 1, 77, 129, 64],
                                     [1000, 5, 1, 77, 1500, 64], interpret=False)


@pytest.mark.parametrize("page_size", [1, 64])
def test_sglang_backend_forward_extend_runs_pallas(monkeypatch, page_size):
    """`FuncMLAAttnBackend.forward_extend` with the absorbed shapes (576 / 512) on an extend
    step with prefixes (one request without) runs the pallas extend (interpret mode here), no
    fallback, and equals SGLang's torch-native extend computed in float32."""
    import functools

    torch = pytest.importorskip("torch")
    from funcmla.interop import backend_select
    from funcmla.interop.sglang_backend import ForwardMode, RadixAttention
    from funcmla.interop.torch_native import torch_native_mla_extend
    from tests.test_interop_sglang import _fb, _setup
    from tests.test_interop_sglang import rel_err as torch_rel_err

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    monkeypatch.setattr(backend_select, "_pallas_extend",
                        lambda: functools.partial(mla_extend, interpret=True))
    prefix, extend = [0, 23, 64, 5], [17, 1, 40, 30]
    rng, b, pool, backend = _setup(page_size + 1, prefix, extend, page_size,
                                   attention_backend="pallas", torch_launcher=False)
    heads, t = 16, sum(extend)
    layer = RadixAttention(tp_q_head_num=heads, scaling=SCALE)
    q = torch.from_numpy(rng.standard_normal((t, heads * 576)).astype(np.float32)).bfloat16()
    k = torch.from_numpy(rng.standard_normal((t, 1, 576)).astype(np.float32)).bfloat16()
    fb = _fb(ForwardMode.EXTEND, b, extend)
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q, k, None, layer, fb)
    assert backend.last_backend == "pallas"
    assert out.shape == (t, heads * 512) and out.dtype == torch.bfloat16
    want = torch_native_mla_extend(q.view(t, heads, 576), pool.kv_buffer[0], b.req_to_token,
                                   b.req_pool_indices, b.seq_lens, b.extend_prefix_lens,
                                   b.extend_seq_lens, sm_scale=SCALE,
                                   compute_dtype=torch.float32)
    assert torch_rel_err(out.view(t, heads, 512), want) < 8e-3
