"""fp8 KV pools (float8_e4m3fn / e4m3fnuz with per-layer k_scale / v_scale): the reference, the
Triton decode kernel and both fp8 Mosaic GPU decode kernels against a float64 NumPy restatement
over the dequantized cache.

The kernels run in Pallas interpret mode on CPU (small shapes, a few calls; the Mosaic GPU ones
with an XLA:CPU worker a warpgroup, tests/conftest.py); unused pool rows hold fp8 NaN, so any
read past a sequence's end shows up. GPU tests are marked `gpu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.attention.pallas import (DecodeKernelConfig, decode_mgpu_fp8,
                                      decode_mgpu_fp8_wide, fp8_q_split, kernel_choice,
                                      mla_decode)
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from funcmla.attention.pallas.decode_common import (choose_num_splits, kv_rows_from_csr,
                                                    kv_rows_from_page_table)
from funcmla.attention.pallas.decode_mgpu import mgpu_split_config
from funcmla.layout import PageTable
from tests.pools import attention_oracle_f64, rel_err
from tests.trace_checks import assert_profiled_like_plain

pytestmark = pytest.mark.filterwarnings("ignore:.*Triton.*:DeprecationWarning")

D, DV = 576, 512
SCALE = MLADims().sm_scale
FP8 = jnp.float8_e4m3fn


def _problem(rng, *, batch, heads, s_q, page_size, lens, dtype=FP8):
    """q (bf16), an fp8 pool of values up to ~4 (NaN in every row no sequence uses, page 0
    included), a page table and per-sequence slot lists."""
    max_pages = max(1, max(-(-int(n) // page_size) for n in lens))
    n_pages = batch * max_pages + 1
    slots = n_pages * page_size
    pool = rng.standard_normal((slots, D)).astype(np.float32)
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = perm[: batch * max_pages].reshape(batch, max_pages).copy()
    slot_lists, live = [], np.zeros(slots, bool)
    for b in range(batch):
        table[b, -(-int(lens[b]) // page_size):] = 0
        pos = np.arange(lens[b])
        sl = (table[b, pos // page_size] * page_size + pos % page_size).astype(np.int32)
        slot_lists.append(sl)
        live[sl] = True
    pool[~live] = np.nan
    q = jnp.asarray(rng.standard_normal((batch * s_q, heads, D)), jnp.bfloat16)
    return dict(q=q, pool=jnp.asarray(pool, dtype), table=jnp.asarray(table),
                lens=jnp.asarray(np.asarray(lens, np.int32)), slot_lists=slot_lists)


def _csr(slot_lists, pad=5):
    lens = np.array([len(s) for s in slot_lists])
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(int(indptr[-1]) + pad, np.int32)
    if indptr[-1]:
        indices[: indptr[-1]] = np.concatenate(slot_lists)
    return indptr, indices


def oracle(q, pool, slot_lists, s_q, k_scale, v_scale):
    """float64: scores over k_scale * x, output over v_scale * x (linear in V, so the output
    over k-scaled rows times v_scale / k_scale)."""
    indptr, indices = _csr(slot_lists)
    qo = np.arange(len(slot_lists) + 1) * s_q
    deq = np.asarray(jnp.asarray(pool, jnp.float32), np.float64) * k_scale
    out, lse = attention_oracle_f64(np.asarray(jnp.asarray(q, jnp.float32)), deq, qo, indptr,
                                    indices, SCALE, DV)
    return out * (v_scale / k_scale), lse


# lse of the 64-row fp8 Mosaic GPU kernel on query rows of 2^17 and more: its q k^T chains 18
# fp8 wgmmas a part of q on an accumulator that keeps ~13-14 bits, so the score's relative
# error reaches ~4e-3 there; at such scores the softmax is an argmax and the output stays
# within the bound (`decode_mgpu_fp8_wide._scores`).
WIDE_HUGE_LSE_RTOL = 5e-3


def _check(out, lse, ref_out, ref_lse, tol=1e-2, lse_rtol=1e-3):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    assert np.isfinite(out).all(), "NaN/inf reached the output"
    live = np.isfinite(ref_lse)
    assert (lse[~live] == np.inf).all() and (out[~live] == 0).all()
    assert rel_err(out[live], ref_out[live]) < tol
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=lse_rtol, atol=2e-2)


# ------------------------------------------------------------------------------- reference

@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_reference_dequantizes_fp8(dtype):
    rng = np.random.default_rng(1)
    p = _problem(rng, batch=3, heads=4, s_q=2, page_size=16, lens=[40, 0, 17], dtype=dtype)
    # The reference reads dead keys from FILL_SLOT 0 (the reserved page): NaN masking there
    # is the reference's own rule (funcmla.checks); here page 0 holds zeros.
    p["pool"] = p["pool"].at[:16].set(0)
    indptr, indices = _csr(p["slot_lists"])
    qo = jnp.arange(4, dtype=jnp.int32) * 2
    ks, vs = 0.37, jnp.asarray([1.9], jnp.float32)
    out, lse = mla_attention_reference(p["q"], p["pool"], qo, jnp.asarray(indptr),
                                       jnp.asarray(indices), sm_scale=SCALE, k_scale=ks,
                                       v_scale=vs)
    ref_out, ref_lse = oracle(p["q"], p["pool"], p["slot_lists"], 2, 0.37, 1.9)
    fin = np.isfinite(ref_lse)
    assert rel_err(np.asarray(out)[fin], ref_out[fin]) < 1e-5
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-5)
    # v_scale defaults to k_scale; k_scale to 1
    out1, _ = mla_attention_reference(p["q"], p["pool"], qo, jnp.asarray(indptr),
                                      jnp.asarray(indices), sm_scale=SCALE)
    ref1, _ = oracle(p["q"], p["pool"], p["slot_lists"], 2, 1.0, 1.0)
    assert rel_err(np.asarray(out1)[fin], ref1[fin]) < 1e-5


# ------------------------------------------------------------------------------- interpret

@pytest.mark.parametrize("page_size,s_q,num_splits", [(1, 1, 2), (16, 2, None), (64, 1, 1)])
def test_triton_fp8_matches_dequantized_reference(page_size, s_q, num_splits):
    rng = np.random.default_rng(page_size)
    lens = [130, 0, 65]
    p = _problem(rng, batch=3, heads=16, s_q=s_q, page_size=page_size, lens=lens)
    ks, vs = jnp.float32(0.37), jnp.asarray([1.9], jnp.float32)
    if page_size == 1:
        indptr, indices = _csr(p["slot_lists"])
        out, lse = mla_decode(p["q"], p["pool"], kv_indptr=jnp.asarray(indptr),
                              kv_indices=jnp.asarray(indices), sm_scale=SCALE, s_q=s_q,
                              num_splits=num_splits, interpret=True, k_scale=ks, v_scale=vs)
    else:
        pt = PageTable(p["table"], p["lens"], page_size)
        out, lse = mla_decode(p["q"], p["pool"], page_table=pt, sm_scale=SCALE, s_q=s_q,
                              num_splits=num_splits, interpret=True, k_scale=ks, v_scale=vs)
    assert out.dtype == jnp.bfloat16 and out.shape == (3 * s_q, 16, DV)
    _check(out, lse, *oracle(p["q"], p["pool"], p["slot_lists"], s_q, 0.37, 1.9))


@pytest.mark.parametrize("heads", [16, 64])
def test_fp8_against_bf16_kernel_on_the_dequantized_pool(heads):
    """Power-of-two scales are exact, and bf16 holds every e4m3 value. At 64 rows (the wgmma
    tiling) the fp8 kernel converts to bf16 and must give the bf16 kernel's bits on the
    dequantized pool. Below 64 rows it runs f16 products over 64-column pieces (q scaled per
    row by a power of two): the same exact products summed in another order, so lse agrees to
    float32 rounding and out to the bf16 output's rounding."""
    rng = np.random.default_rng(7)
    p = _problem(rng, batch=2, heads=heads, s_q=1, page_size=16, lens=[100, 37])
    pt = PageTable(p["table"], p["lens"], 16)
    kw = dict(page_table=pt, sm_scale=SCALE, interpret=True, num_splits=2)
    out8, lse8 = mla_decode(p["q"], p["pool"], k_scale=0.5, v_scale=4.0, **kw)
    deq = p["pool"].astype(jnp.float32)
    out_k, lse_k = mla_decode(p["q"], (deq * 0.5).astype(jnp.bfloat16), **kw)
    # output: v_scale / k_scale = 8 times the output over the k-scaled pool
    out_k8 = np.asarray(out_k, np.float32) * 8.0
    if heads == 64:
        np.testing.assert_array_equal(np.asarray(lse8), np.asarray(lse_k))
        np.testing.assert_array_equal(np.asarray(out8, np.float32), out_k8)
    else:
        np.testing.assert_allclose(np.asarray(lse8), np.asarray(lse_k), rtol=1e-6, atol=1e-6)
        assert rel_err(np.asarray(out8, np.float32), out_k8) < 5e-3
    # v_scale defaults to k_scale
    out_d, lse_d = mla_decode(p["q"], p["pool"], k_scale=jnp.float32(0.5), **kw)
    np.testing.assert_array_equal(np.asarray(out_d, np.float32) * 8.0,
                                  np.asarray(out8, np.float32))
    np.testing.assert_array_equal(np.asarray(lse_d), np.asarray(lse8))


@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float16])
def test_fp8_q_beyond_f16_range_and_tiny(q_dtype):
    """Below 64 rows the products run in f16: each q row is scaled by a power of two so that
    f16 holds it. Rows far above f16's range (bf16 q only) and far below its normal range must
    match the oracle, with NaN in every unused pool row; an f16 q runs unscaled."""
    rng = np.random.default_rng(5)
    p = _problem(rng, batch=2, heads=16, s_q=1, page_size=1, lens=[150, 70])
    mag = np.array([2.0**40, 2.0**-40, 2.0**17, 1.0] * 4, np.float32)
    if q_dtype == jnp.float16:
        mag = np.array([2.0**10, 2.0**-10, 1.0, 1.0] * 4, np.float32)
    q = (p["q"].astype(jnp.float32) * mag[None, :, None]).astype(q_dtype)
    indptr, indices = _csr(p["slot_lists"])
    out, lse = mla_decode(q, p["pool"], kv_indptr=jnp.asarray(indptr),
                          kv_indices=jnp.asarray(indices), sm_scale=SCALE, interpret=True,
                          k_scale=0.37, v_scale=1.9)
    assert out.dtype == q_dtype
    _check(out, lse, *oracle(q, p["pool"], p["slot_lists"], 1, 0.37, 1.9))


def test_fp8_dispatch_runs_the_fp8_mosaic_kernel_where_it_applies(monkeypatch):
    q = jax.ShapeDtypeStruct((4, 128, D), jnp.bfloat16)  # 128 folded rows: the wide kernel
    assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q, 64, 1, kv_dtype=FP8)[0] == "mgpu"
    assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q, 64, 1)[0] == "mgpu"
    q40 = jax.ShapeDtypeStruct((4, 40, D), jnp.bfloat16)  # 40 rows: neither fp8 kernel
    name, why = kernel_choice(DecodeKernelConfig(), q40, 64, 1, kv_dtype=FP8)
    assert name == "triton" and "float8_e4m3fn" in why and "40 is not a multiple of 16" in why
    with pytest.raises(ValueError, match="kernel='mgpu'.*float8_e4m3fn.*40"):
        kernel_choice(DecodeKernelConfig(kernel="mgpu"), q40, 64, 1, kv_dtype=FP8)
    q32 = jax.ShapeDtypeStruct((4, 32, D), jnp.bfloat16)  # 32 rows: 2 row groups of 16
    assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q32, 64, 1, kv_dtype=FP8)[0] == (
        "mgpu")
    q16 = jax.ShapeDtypeStruct((4, 16, D), jnp.bfloat16)
    assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q16, 1, 1, kv_dtype=FP8)[0] == "mgpu"
    q8 = jax.ShapeDtypeStruct((4, 8, D), jnp.bfloat16)  # s_q 2 x 8 heads = 16 rows
    assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), q8, 16, 2, kv_dtype=FP8)[0] == "mgpu"
    # auto: the fp8 Mosaic GPU kernels on a GPU backend
    name, why = kernel_choice(DecodeKernelConfig(), q16, 1, 1, kv_dtype=FP8)
    assert name == "triton" and "no GPU backend" in why  # this host
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    name, why = kernel_choice(DecodeKernelConfig(), q16, 1, 1, kv_dtype=FP8)
    assert name == "triton" and "4 sequences < fp8_mgpu_min_seqs = 16" in why
    big = jax.ShapeDtypeStruct((16, 16, D), jnp.bfloat16)
    name, why = kernel_choice(DecodeKernelConfig(), big, 1, 1, kv_dtype=FP8)
    assert name == "mgpu" and "fp8 Mosaic GPU kernel" in why and "16 folded rows" in why
    name, _ = kernel_choice(DecodeKernelConfig(fp8_mgpu_min_seqs=4), q16, 1, 1, kv_dtype=FP8)
    assert name == "mgpu"
    # at 64-row blocks fp8 follows the bf16 rule (mgpu_min_blocks), as the products are its own
    name, why = kernel_choice(DecodeKernelConfig(), q, 64, 1, kv_dtype=FP8)
    assert name == "mgpu" and "8 blocks of 64 rows >= mgpu_min_blocks" in why
    name, why = kernel_choice(DecodeKernelConfig(mgpu_min_blocks=16), q, 64, 1, kv_dtype=FP8)
    assert name == "triton" and "8 blocks of 64 rows < mgpu_min_blocks = 16" in why
    with pytest.raises(ValueError, match="page size 3"):
        kernel_choice(DecodeKernelConfig(kernel="mgpu"), q16, 3, 1, kv_dtype=FP8)
    # interpret mode: forced, both run there (the suite gives XLA:CPU a worker a warpgroup)
    for qq in (q16, q):
        assert kernel_choice(DecodeKernelConfig(kernel="mgpu"), qq, 64, 1, kv_dtype=FP8,
                             interpret=True)[0] == "mgpu"


@pytest.mark.parametrize("rows,page,d,dv,qd,kd,match", [
    (40, 64, 576, 512, jnp.bfloat16, FP8, "40 is not a multiple of 16"),
    (8, 64, 576, 512, jnp.bfloat16, FP8, "8 is not a multiple of 16"),
    (16, 64, 576, 512, jnp.bfloat16, jnp.float8_e4m3fnuz, "float8_e4m3fnuz"),
    (16, 64, 576, 512, jnp.float32, FP8, "float32"),
    (16, 64, 320, 256, jnp.bfloat16, FP8, "head dims"),
    (16, 96, 576, 512, jnp.bfloat16, FP8, "page size 96"),
])
def test_fp8_mosaic_kernel_names_what_it_does_not_take(rows, page, d, dv, qd, kd, match):
    why = decode_mgpu_fp8.fp8_narrow_supported(rows, page, d, dv, qd, kd)
    assert why is not None and match in why
    assert decode_mgpu_fp8.fp8_narrow_supported(16, 1, 576, 512, jnp.bfloat16, FP8) is None


@pytest.mark.parametrize("rows,page,d,dv,qd,kd,match", [
    (16, 64, 576, 512, jnp.bfloat16, FP8, "16 is not a multiple of 64"),
    (96, 64, 576, 512, jnp.bfloat16, FP8, "96 is not a multiple of 64"),
    (64, 64, 576, 512, jnp.bfloat16, jnp.float8_e4m3fnuz, "float8_e4m3fnuz"),
    (128, 64, 576, 512, jnp.float32, FP8, "float32"),
    (64, 64, 320, 256, jnp.bfloat16, FP8, "head dims"),
    (64, 96, 576, 512, jnp.bfloat16, FP8, "page size 96"),
    (64, 3, 576, 512, jnp.bfloat16, FP8, "page size 3"),
])
def test_fp8_wide_mosaic_kernel_names_what_it_does_not_take(rows, page, d, dv, qd, kd, match):
    why = decode_mgpu_fp8_wide.fp8_wide_supported(rows, page, d, dv, qd, kd)
    assert why is not None and match in why
    for ok_rows, ok_page in ((64, 1), (128, 64), (256, 16), (128, 128)):
        assert decode_mgpu_fp8_wide.fp8_wide_supported(ok_rows, ok_page, 576, 512,
                                                       jnp.bfloat16, FP8) is None


@pytest.mark.parametrize("kernel,page_size,s_q,heads,splits", [
    # the 16-row kernel: q k^T transposed, V^T from registers (204 of 227 KB shared memory)
    ("narrow", 64, 1, 16, 1), ("narrow", 16, 1, 16, 2), ("narrow", 1, 1, 16, 2),
    ("narrow", 4, 2, 8, 1),
    # the 64-row kernel: q8 72 KB, two fp8 stages 72 KB, f16 V 64 KB, P 8 KB
    ("wide", 64, 1, 128, 1), ("wide", 16, 1, 64, 2), ("wide", 1, 1, 128, 2), ("wide", 4, 2, 64, 1),
    # the 16-row kernel in row groups (32 heads: 2 groups; 24 heads x s_q 2: 3)
    ("narrow", 64, 1, 32, 1), ("narrow", 1, 2, 24, 2)])
def test_fp8_mosaic_kernel_lowers_for_cuda(kernel, page_size, s_q, heads, splits):
    """The compiled fp8 Mosaic GPU kernels lower for CUDA on any host: layouts, the inline
    Mosaic GPU pieces (q split, row gather, V conversion, column reductions, stores) and the
    shared-memory budget are checked at lowering, which the interpreter does not model."""
    module = {"narrow": decode_mgpu_fp8, "wide": decode_mgpu_fp8_wide}[kernel]
    text = lowered_for_cuda(module, page_size, s_q, heads, splits)
    assert "mosaic_gpu" in text
    # the row gather's copies signal their stage as they land; the producer never waits
    assert ("nvvm.cp.async.mbarrier.arrive" in text) == (page_size < 8)
    assert "nvvm.cp.async.wait.group" not in text


def test_fp8_mosaic_kernel_refuses_an_odd_stage_count(monkeypatch):
    """Tiles alternate consumers and go through stage t % _STAGES; each consumer's barrier
    waits track the phases of the stages it alone fills, so an odd count would put a stage's
    fills on both consumers (their waits out of step): refused, naming the knob."""
    monkeypatch.setattr(decode_mgpu_fp8, "_STAGES", 5)
    with pytest.raises(ValueError, match=r"_STAGES = 5 must be a multiple of 2"):
        lowered_for_cuda(decode_mgpu_fp8, 64, 1, 16, 1)


@pytest.mark.parametrize("kernel,products,registers,expected", [
    ("narrow", "mixed", None, (40, 232, 232)),
    ("narrow", "mixed", (24, 240, 240), (24, 240, 240)),
    ("wide", "mixed", None, (64, 240, 200)),
    ("wide", "fp8", None, (40, 232, 232)),
    ("wide", "mixed", (24, 240, 240), (24, 240, 240)),
])
def test_fp8_mosaic_kernels_set_their_register_budgets(setmaxnreg_calls, kernel, products,
                                                       registers, expected):
    """Each warpgroup's `setmaxnreg` (recorded while the kernel is traced for CUDA): the
    kernel's own budgets (producer, consumer 0, consumer 1) unless the config names others."""
    from funcmla.attention.pallas.decode_mgpu import MgpuDecodeConfig

    module = {"narrow": decode_mgpu_fp8, "wide": decode_mgpu_fp8_wide}[kernel]
    kw = dict(products=products) if kernel == "wide" else {}
    lowered_for_cuda(module, 64, 1, 128 if kernel == "wide" else 16, 1,
                     config=MgpuDecodeConfig(registers=registers), **kw)
    producer, *consumers = expected
    assert sorted(setmaxnreg_calls) == sorted([("decrease", producer)]
                                              + [("increase", n) for n in consumers])


def lowered_for_cuda(module, page_size: int, s_q: int, heads: int, splits: int, **kw) -> str:
    """The StableHLO text of `module.decode_call` exported for CUDA (2 sequences of 1024 tokens
    over a 4096-row fp8 pool, unit scales; `kw`: more decode_call arguments)."""
    b = 2
    q = jax.ShapeDtypeStruct((b * s_q, heads, D), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64 * 64, D), FP8)
    if page_size == 1:
        kv = kv_rows_from_csr(jnp.zeros((b + 1,), jnp.int32), jnp.zeros((b * 1024,), jnp.int32))
    else:
        kv = kv_rows_from_page_table(PageTable(jnp.zeros((b, 1024 // page_size), jnp.int32),
                                               jnp.zeros((b,), jnp.int32), page_size))
    one = jnp.ones((1,), jnp.float32)
    fn = jax.jit(lambda q, pool, kv: module.decode_call(
        q, pool, kv, sm_scale=SCALE, s_q=s_q, num_splits=splits, k_scale=one, v_scale=one, **kw))
    return jax.export.export(fn, platforms=["cuda"])(q, pool, kv).mlir_module()


def test_fp8_mosaic_output_rows_are_a_permutation_of_the_latent_columns():
    """The fp8 Mosaic GPU kernel's O^T rows hold latent columns in `latent_column` order (its
    V^T operand's arrangement): a bijection of [0, 512), and each thread's 16 rows (fixed warp
    and lane, 8 row blocks x 2 halves) are 16 contiguous columns starting at a multiple of 16,
    which its vector output stores rely on."""
    cols = [decode_mgpu_fp8.latent_column(m) for m in range(512)]
    assert sorted(cols) == list(range(512))
    for w in range(4):
        for g in range(8):
            mine = sorted(decode_mgpu_fp8.latent_column(64 * mb + 16 * w + 8 * h + g)
                          for mb in range(8) for h in range(2))
            assert mine == list(range(128 * w + 16 * g, 128 * w + 16 * g + 16))


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX `prmt.b32` (default mode): result byte i is byte (sel >> 4 i) & 7 of b:a."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_fp8_mosaic_integer_pipe_conversion_is_the_value_times_2_to_the_minus_8():
    """The 16-row kernel's integer-pipe V conversion (`_v_operand` on the odd row blocks):
    for every e4m3fn byte but NaN, in either column of a pair word and for either token, the
    f16 it builds is the byte's value times 2^-8 exactly (subnormals included), which the
    kernel's 2^8 row factor undoes. NumPy restatement of prmt and the masks."""
    f8 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    value = f8.astype(np.float64)
    rng = np.random.default_rng(5)
    for half in range(2):
        for tok in range(2):
            for b in range(256):
                if np.isnan(value[b]):
                    continue
                others = rng.integers(0, 256, 4)
                pair = [int(x) for x in others]
                pair[2 * half + tok] = b  # bytes: (c even, c odd, c + 1 even, c + 1 odd)
                word = sum(x << (8 * i) for i, x in enumerate(pair))
                w = _prmt(word, 0, decode_mgpu_fp8.INT_PAIR_SELECT[half])
                mag, sign = decode_mgpu_fp8.INT_MAG_MASK, decode_mgpu_fp8.INT_SIGN_MASK
                f16 = ((w & mag) >> 1) | (w & sign)
                got = np.array([f16 & 0xFFFF, f16 >> 16], np.uint16).view(np.float16)
                assert float(got[tok]) == value[b] * 2.0**-8, (half, tok, b)
    rows = np.arange(512)
    assert (decode_mgpu_fp8.latent_row_block(decode_mgpu_fp8.latent_column(rows))
            == rows // 64).all()


# a power-of-two row scale 2^exp that the q dtype holds (f16: ~2^-24..2^16) beside the draw
_Q_DTYPE_AND_EXP = st.sampled_from(["bfloat16", "float16"]).flatmap(lambda dt: st.tuples(
    st.just(dt), st.integers(-60, 60) if dt == "bfloat16" else st.integers(-12, 8)))


@settings(max_examples=25, deadline=None)
@given(dtype_exp=_Q_DTYPE_AND_EXP, seed=st.integers(0, 2**16))
def test_fp8_mosaic_q_split_into_high_and_low_e4m3_parts(dtype_exp, seed):
    """The fp8 Mosaic GPU kernels' q (`fp8_q_split.prepare_q`): per row a power of two `up`
    takes the row's largest |q| into [2^7, 2^8); hi = e4m3(q up), lo = e4m3(q up - hi). For
    bf16 q, hi + lo is q up exactly for every element within 2^9 of its row's largest, and
    within 2^-10 (in units of q up) for the rest; the score factor is sm_scale k_scale
    log2(e) / up, NaN for a row holding Inf or NaN. NumPy restatement."""
    q_dtype, exp = dtype_exp
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 16, D)) * rng.choice([1.0, 1e-3, 30.0], (2, 16, 1)) * 2.0**exp
    q = jnp.asarray(q, q_dtype)
    q = q.at[1, 3, 7].set(jnp.inf).at[1, 5, 0].set(jnp.nan)
    q8, scales = fp8_q_split.prepare_q(q, sm_scale=SCALE, k_scale=jnp.asarray([0.5]),
                                           v_scale=jnp.asarray([2.0]))
    assert q8.shape == (2, 32, D) and q8.dtype == FP8 and scales.shape == (2, 2, 16)
    qf = np.asarray(q, np.float64)
    amax = np.abs(qf).max(-1)
    finite = np.isfinite(amax)
    up = 2.0 ** (7 - np.floor(np.log2(np.where(finite, amax, 1.0))))
    factor = np.asarray(scales[:, 0], np.float64)
    np.testing.assert_array_equal(np.isnan(factor), ~finite)
    np.testing.assert_allclose(factor[finite], (SCALE * 0.5 * np.log2(np.e) / up)[finite],
                               rtol=1e-6)
    assert (np.asarray(scales[:, 1]) == 2.0).all()
    x = qf * up[..., None]
    hi = np.asarray(q8[:, :16], np.float64)
    lo = np.asarray(q8[:, 16:], np.float64)
    err = np.abs(hi + lo - x)[finite]
    rowmax = np.abs(x).max(-1, keepdims=True)[finite]
    assert (rowmax >= 128).all() and (rowmax < 256).all()
    near = np.abs(x)[finite] >= rowmax * 2.0**-9
    if q_dtype == "bfloat16":
        assert (err[near] == 0).all()
    else:  # f16 keeps 11 bits, the pair at least 8
        assert (err[near] <= np.abs(x)[finite][near] * 2.0**-8).all()
    assert (err[~near] <= 2.0**-10).all()


def _fp8_mosaic(p, *, page_size, s_q, num_splits, interpret, ks=0.37, vs=1.9):
    """The fp8 Mosaic GPU kernel + merge over problem `p` (token CSR at page 1)."""
    if page_size == 1:
        indptr, indices = _csr(p["slot_lists"])
        meta = dict(kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(indices))
    else:
        meta = dict(page_table=PageTable(p["table"], p["lens"], page_size))
    return mla_decode(p["q"], p["pool"], sm_scale=SCALE, s_q=s_q, num_splits=num_splits,
                      config=DecodeKernelConfig(kernel="mgpu"), interpret=interpret,
                      k_scale=ks, v_scale=jnp.asarray([vs], jnp.float32), **meta)


# Interpret mode (CPU): each case is 3-15 s there, so most are `slow`. The interpreter runs the
# kernels' barriers, pipelining, masking, splits and q preparation; its q k^T is a plain float32
# product of q's two e4m3 parts, and V's conversion a plain cast.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("page_size,s_q,heads,lens,num_splits", [
    # `decode_mgpu_fp8` (16 folded rows)
    (64, 1, 16, [70, 0, 20], 2),
    pytest.param(1, 1, 16, [70, 1, 64], 1, marks=_SLOW),
    pytest.param(16, 2, 8, [100, 3], 1, marks=_SLOW),
    pytest.param(4, 2, 8, [100, 0], 1, marks=_SLOW),
    # `decode_mgpu_fp8` in row groups: 2 at 32 heads, 2 of one token each at 16 heads x s_q 2,
    # 3 at 24 heads x s_q 2 (one straddling two tokens)
    (64, 1, 32, [70, 0, 20], 2),
    pytest.param(16, 2, 16, [100, 5], 1, marks=_SLOW),
    pytest.param(1, 2, 24, [77, 3], 2, marks=_SLOW),
    # `decode_mgpu_fp8_wide` (64-row blocks)
    (1, 1, 64, [70, 0, 20], 2),
    pytest.param(64, 1, 64, [200, 1], None, marks=_SLOW),
    pytest.param(16, 2, 32, [100, 3], 1, marks=_SLOW),
    pytest.param(8, 1, 64, [77, 129], 3, marks=_SLOW)])
def test_interpret_fp8_mosaic_kernel_matches_dequantized_reference(page_size, s_q, heads, lens,
                                                                   num_splits):
    """Both fp8 Mosaic GPU kernels in interpret mode (the 16-row one in row groups too): pages 1
    (row gather), 4, 8, 16, 64, s_q 2, empty sequences, splits, scales 0.37 / 1.9, against
    float64 over the dequantized pool with NaN in every unused row."""
    rng = np.random.default_rng(page_size * 7 + s_q + heads)
    p = _problem(rng, batch=len(lens), heads=heads, s_q=s_q, page_size=page_size, lens=lens)
    out, lse = _fp8_mosaic(p, page_size=page_size, s_q=s_q, num_splits=num_splits,
                           interpret=True)
    _check(out, lse, *oracle(p["q"], p["pool"], p["slot_lists"], s_q, 0.37, 1.9))


def test_fp8_row_groups_dispatch_and_split_rule():
    """Which fp8 kernel takes a row count, and the split rule's blocks: multiples of 64 on the
    64-row kernel (fp8 products always there), other multiples of 16 on the 16-row kernel in
    row groups (one block a group), the rest nowhere."""
    from funcmla.attention.pallas import api

    cfg = DecodeKernelConfig()
    for rows in (16, 32, 48, 96):
        assert api.fp8_mgpu_kernel(rows, cfg) is decode_mgpu_fp8, rows
        assert api.fp8_mgpu_supported(rows, 64, D, 512, jnp.bfloat16, FP8) is None
    for rows in (64, 128):
        assert api.fp8_mgpu_kernel(rows, cfg) is decode_mgpu_fp8_wide, rows
    assert api.fp8_mgpu_kernel(32, dataclasses.replace(cfg, fp8_products="fp8")) is (
        decode_mgpu_fp8_wide)
    assert "40 is not a multiple of 16" in api.fp8_mgpu_supported(40, 64, D, 512,
                                                                  jnp.bfloat16, FP8)
    # 8 sequences of 32 rows: 16 blocks of 16 rows; of 128 rows: 16 blocks of 64 rows
    assert api.decode_num_splits(cfg, 8, 32, 4096, mgpu=True, kv_fp8=True) == (
        choose_num_splits(8, 2, 4096, mgpu_split_config(cfg), 64))
    assert api.decode_num_splits(cfg, 8, 128, 4096, mgpu=True, kv_fp8=True) == (
        choose_num_splits(8, 2, 4096, mgpu_split_config(cfg), 64))


@st.composite
def _mosaic_fp8_cases(draw):
    """A shape either fp8 Mosaic GPU kernel takes: 16 to 64 folded rows (s_q 1, 2, 4; 32 and
    48 run as row groups of the 16-row kernel), a page size of 1 to 64, 1-3 sequences of 0 to
    260 tokens (at least s_q when not empty), a split count (None: the rule's), scales."""
    rows = draw(st.sampled_from([16, 32, 48, 64]))
    s_q = draw(st.sampled_from([1, 2, 4]))
    length = st.one_of(st.just(0), st.integers(s_q, 260), st.sampled_from([63, 64, 65]))
    lens = draw(st.lists(length, min_size=1, max_size=3))
    return dict(heads=rows // s_q, s_q=s_q, lens=[max(n, s_q) if n else 0 for n in lens],
                page_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64])),
                num_splits=draw(st.sampled_from([None, 1, 2, 3, 5])),
                ks=draw(st.sampled_from([1.0, 0.37, 4.0])),
                vs=draw(st.sampled_from([1.0, 1.9, 0.125])),
                seed=draw(st.integers(0, 2**16)))


@_SLOW
@settings(max_examples=6, deadline=None)
@given(case=_mosaic_fp8_cases())
def test_interpret_fp8_mosaic_kernels_on_drawn_shapes(case):
    """Both fp8 Mosaic GPU kernels in interpret mode on drawn shapes, against float64 over the
    dequantized pool (NaN in unused rows); a few examples, ~20 s each on 2 CPUs."""
    p = _problem(np.random.default_rng(case["seed"]), batch=len(case["lens"]),
                 heads=case["heads"], s_q=case["s_q"], page_size=case["page_size"],
                 lens=case["lens"])
    out, lse = _fp8_mosaic(p, page_size=case["page_size"], s_q=case["s_q"],
                           num_splits=case["num_splits"], interpret=True, ks=case["ks"],
                           vs=case["vs"])
    _check(out, lse, *oracle(p["q"], p["pool"], p["slot_lists"], case["s_q"], case["ks"],
                             case["vs"]))


@pytest.mark.parametrize("kernel,heads,page_size,splits", [
    pytest.param(decode_mgpu_fp8, 16, 64, 1, id="narrow-p64"),
    pytest.param(decode_mgpu_fp8_wide, 64, 64, 1, id="wide-p64"),
    pytest.param(decode_mgpu_fp8, 16, 1, 2, marks=_SLOW, id="narrow-p1-splits"),
    pytest.param(decode_mgpu_fp8_wide, 64, 1, 2, marks=_SLOW, id="wide-p1-splits"),
    pytest.param(decode_mgpu_fp8, 32, 64, 2, marks=_SLOW, id="narrow-row-groups")])
def test_interpret_fp8_mosaic_kernel_has_no_data_race(kernel, heads, page_size, splits):
    """Mosaic GPU's interpreter with its happens-before race detector on finds no unordered
    shared-memory access in either fp8 kernel (5 tiles of 300 tokens over 2 stages: refills, the
    P / alpha and V hand-offs, the final exchange); its barrier bookkeeping also finds every
    barrier phase observed (dropping consumer 1's wait for P fails it). The detector is a
    private jax API: skip where it has moved."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        pytest.skip(f"Mosaic GPU interpreter's race detector not importable: {e}")
    p = _problem(np.random.default_rng(5), batch=1, heads=heads, s_q=1, page_size=page_size,
                 lens=[300])
    if page_size == 1:
        indptr, indices = _csr(p["slot_lists"])
        kv = kv_rows_from_csr(jnp.asarray(indptr), jnp.asarray(indices))
    else:
        kv = kv_rows_from_page_table(PageTable(p["table"], p["lens"], page_size))
    o, _ = kernel.decode_call(p["q"], p["pool"], kv, sm_scale=SCALE, s_q=1, num_splits=splits,
                              k_scale=jnp.asarray([0.37], jnp.float32),
                              v_scale=jnp.asarray([1.9], jnp.float32),
                              interpret=InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not interpret_pallas_call.get_races().races_found


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("heads,page_size", [(16, 1), (16, 16), (16, 64), (128, 64)])
def test_gpu_fp8_matches_dequantized_reference(heads, page_size):
    rng = np.random.default_rng(heads + page_size)
    p = _problem(rng, batch=4, heads=heads, s_q=1, page_size=page_size, lens=[1000, 0, 513, 7])
    # rows above f16's range and far below it (the f16 products scale q per row)
    mag = np.array([2.0**40, 2.0**-40, 2.0**17, 1.0] * (heads // 4), np.float32)
    p["q"] = (p["q"].astype(jnp.float32) * mag[None, :, None]).astype(jnp.bfloat16)
    if page_size == 1:
        indptr, indices = _csr(p["slot_lists"])
        out, lse = mla_decode(p["q"], p["pool"], kv_indptr=jnp.asarray(indptr),
                              kv_indices=jnp.asarray(indices), sm_scale=SCALE, k_scale=0.37,
                              v_scale=1.9)
    else:
        pt = PageTable(p["table"], p["lens"], page_size)
        out, lse = mla_decode(p["q"], p["pool"], page_table=pt, sm_scale=SCALE, k_scale=0.37,
                              v_scale=1.9)
    # 128 heads run the 64-row fp8 Mosaic GPU kernel; 4 sequences at 16 heads, Triton
    _check(out, lse, *oracle(p["q"], p["pool"], p["slot_lists"], 1, 0.37, 1.9),
           lse_rtol=WIDE_HUGE_LSE_RTOL if heads == 128 else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,lse_tol", [("triton", 1e-5), ("mgpu", 1e-4)])
def test_gpu_fp8_against_bf16_kernel_on_dequantized_pool(kernel, lse_tol):
    """Each compiled fp8 kernel against the bf16 kernel on the dequantized pool (power-of-two
    scales): the same exact products (f16) summed in another order, so lse agrees to float32
    rounding (the Mosaic GPU kernel's exp2 / log2 are approximate: 1e-4); P V is rounded
    differently (f16 P, another operand layout), so out is compared with a tolerance."""
    rng = np.random.default_rng(3)
    p = _problem(rng, batch=3, heads=16, s_q=1, page_size=64, lens=[700, 64, 5])
    pt = PageTable(p["table"], p["lens"], 64)
    out8, lse8 = mla_decode(p["q"], p["pool"], page_table=pt, sm_scale=SCALE, k_scale=0.25,
                            v_scale=0.25, config=DecodeKernelConfig(kernel=kernel))
    deq = (p["pool"].astype(jnp.float32) * 0.25).astype(jnp.bfloat16)
    out, lse = mla_decode(p["q"], deq, page_table=pt, sm_scale=SCALE,
                          config=DecodeKernelConfig(kernel="triton"))
    np.testing.assert_allclose(np.asarray(lse8), np.asarray(lse), rtol=lse_tol, atol=lse_tol)
    assert rel_err(np.asarray(out8, np.float32), np.asarray(out, np.float32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,heads,products,phases", [
    ("narrow", 16, "mixed", {"qk", "wait_kv", "softmax", "p_store", "pv", "finish",
                             "prepare_q", "copy"}),
    ("wide", 128, "mixed", {"qk", "wait_kv", "softmax", "wait_v", "hand_off", "pv", "finish",
                            "wait_free", "wait_v_free", "convert", "wait_p", "prepare_q",
                            "copy"}),
    ("wide", 128, "fp8", {"qk", "softmax", "wait_v", "hand_off", "pv", "transpose", "wait_p"}),
])
def test_gpu_fp8_profile_names_every_phase(tmp_path, kernel, heads, products, phases):
    """`MgpuDecodeConfig.profile_space` reaches both fp8 Mosaic GPU kernels: Mosaic GPU's
    per-warpgroup trace holds the kernel's named phases, and the output is the same bits as
    without the profiler."""
    from funcmla.attention.pallas.decode_mgpu import MgpuDecodeConfig

    rng = np.random.default_rng(7)
    p = _problem(rng, batch=2, heads=heads, s_q=1, page_size=64, lens=[300, 130])
    kv = kv_rows_from_page_table(PageTable(p["table"], p["lens"], 64))
    module = {"narrow": decode_mgpu_fp8, "wide": decode_mgpu_fp8_wide}[kernel]
    extra = {} if kernel == "narrow" else {"products": products}
    one = jnp.ones((1,), jnp.float32)

    def call(config):
        return jax.jit(lambda q, pool: module.decode_call(
            q, pool, kv, sm_scale=SCALE, s_q=1, num_splits=1, k_scale=one, v_scale=one,
            config=config, **extra))(p["q"], p["pool"])

    assert_profiled_like_plain(
        call(MgpuDecodeConfig(profile_space=64, profile_dir=str(tmp_path))),
        call(MgpuDecodeConfig()), tmp_path, phases)


def _query_rows_far_above_f16_range(heads, interpret):
    """Scores of ~2^45 in log2 units: the column scale multiplies s - max, so no multiply-add
    contraction leaves a rounding residual of ~2^21 in exp2's argument (which gave +inf). At
    such scores the softmax is an argmax, which a relative score error (the fp8
    accumulation's, up to ~7e-4: `decode_mgpu_fp8._PROMOTE`) may move to a near tie: rows of
    2^17 and 2^40 are held to finite outputs inside the range of their sequence's V, and lse
    (the largest score) to 1e-3 (16 heads: `decode_mgpu_fp8`) or `WIDE_HUGE_LSE_RTOL` (64-row
    blocks: `decode_mgpu_fp8_wide`); rows of 1 and 2^-40 to the reference."""
    rng = np.random.default_rng(80)
    lens = [1000, 0, 513, 7] if not interpret else [130, 0, 65, 7]
    p = _problem(rng, batch=4, heads=heads, s_q=1, page_size=64, lens=lens)
    mag = np.array([2.0**40, 2.0**-40, 2.0**17, 1.0] * (heads // 4), np.float32)
    p["q"] = (p["q"].astype(jnp.float32) * mag[None, :, None]).astype(jnp.bfloat16)
    out, lse = _fp8_mosaic(p, page_size=64, s_q=1, num_splits=None, interpret=interpret)
    ref_out, ref_lse = oracle(p["q"], p["pool"], p["slot_lists"], 1, 0.37, 1.9)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    huge = mag >= 2.0**17
    _check(out[:, ~huge], lse[:, ~huge], ref_out[:, ~huge], ref_lse[:, ~huge])
    pool = np.asarray(jnp.asarray(p["pool"], jnp.float32), np.float64)[:, :DV] * 1.9
    for b, sl in enumerate(p["slot_lists"]):
        if len(sl) == 0:
            assert (lse[b] == np.inf).all() and (out[b] == 0).all()
            continue
        o = out[b, huge]
        assert np.isfinite(o).all()
        v = pool[sl]
        tol = 1e-2 * np.abs(v).max()  # the bf16 output's rounding
        assert (o >= v.min(0) - tol).all() and (o <= v.max(0) + tol).all()
        np.testing.assert_allclose(lse[b, huge], ref_lse[b, huge],
                                   rtol=1e-3 if heads == 16 else WIDE_HUGE_LSE_RTOL)


@_SLOW
@pytest.mark.parametrize("heads", [16, 64])
def test_interpret_fp8_mosaic_kernel_on_query_rows_far_above_f16_range(heads):
    """In interpret mode: the kernels' row factors and softmax on huge and tiny rows (q k^T a
    float32 product of q's e4m3 parts there)."""
    _query_rows_far_above_f16_range(heads, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_fp8_mosaic_kernel_on_query_rows_far_above_f16_range(heads):
    """Compiled: the fp8 wgmma accumulation on huge rows too."""
    _query_rows_far_above_f16_range(heads, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,s_q,heads,lens,num_splits", [
    (64, 1, 16, [130, 0, 65, 2000], None), (64, 1, 16, [130, 0, 65], 2),
    (16, 2, 8, [200, 3, 64], 1), (1, 1, 16, [130, 0, 65], 2), (1, 1, 16, [1000, 1, 64, 63], 1),
    (8, 1, 16, [77, 129], 3), (4, 2, 8, [100, 0], 1),
    # the 16-row kernel in row groups: 32 heads, 24 heads x s_q 2 (a group on two tokens)
    (64, 1, 32, [130, 0, 65, 2000], None), (1, 1, 32, [130, 0, 65], 2),
    (16, 2, 24, [200, 3, 64], 1),
    # the 64-row kernel (`decode_mgpu_fp8_wide`): 128 heads, or 64 rows from s_q 2 x 32 heads
    (64, 1, 128, [130, 0, 65, 2000], None), (64, 1, 128, [130, 0, 65], 2),
    (16, 2, 32, [200, 3, 64], 1), (1, 1, 128, [130, 0, 65], 2), (1, 1, 64, [1000, 1, 64, 63], 1),
    (8, 1, 128, [77, 129], 3), (4, 2, 64, [100, 0], 1)])
def test_gpu_fp8_mosaic_kernel_matches_dequantized_reference(page_size, s_q, heads, lens,
                                                             num_splits):
    """The compiled fp8 Mosaic GPU kernel: pages 1 (row gather), 4, 8, 16, 64 (TMA), s_q 2
    (causal columns), empty sequences, splits, against float64 over the dequantized pool with
    NaN in every unused row."""
    rng = np.random.default_rng(page_size * 7 + s_q)
    p = _problem(rng, batch=len(lens), heads=heads, s_q=s_q, page_size=page_size, lens=lens)
    out, lse = _fp8_mosaic(p, page_size=page_size, s_q=s_q, num_splits=num_splits,
                           interpret=False)
    _check(out, lse, *oracle(p["q"], p["pool"], p["slot_lists"], s_q, 0.37, 1.9))


def test_uint8_bytes_with_kv_dtype_equal_the_fp8_pool():
    """A uint8 pool of fp8 bytes (DLPack's zero-copy form) with kv_dtype gives the fp8 pool's
    bits (the bitcast happens inside the jit)."""
    rng = np.random.default_rng(11)
    p = _problem(rng, batch=2, heads=16, s_q=1, page_size=64, lens=[90, 3])
    pt = PageTable(p["table"], p["lens"], 64)
    kw = dict(page_table=pt, sm_scale=SCALE, interpret=True, k_scale=0.37)
    out, lse = mla_decode(p["q"], p["pool"], **kw)
    bits = jax.lax.bitcast_convert_type(p["pool"], jnp.uint8)
    out_b, lse_b = mla_decode(p["q"], bits, kv_dtype="float8_e4m3fn", **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_b, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_b))


def test_launcher_takes_e4m3fn_pools_and_names_other_formats():
    """The torch launcher reads float8_e4m3fn pools (then its other checks apply: here the CPU
    device refuses); another fp8 format, or uint8 bytes, gets a reason naming what it reads."""
    torch = pytest.importorskip("torch")
    from funcmla.interop.launcher.torch_entry import torch_decode_unsupported_reason

    q = torch.zeros(2, 16, D, dtype=torch.bfloat16)
    pool = torch.zeros(64, D, dtype=torch.float8_e4m3fn)
    ind = torch.zeros(3, dtype=torch.int32)
    assert torch_decode_unsupported_reason(q, pool, ind, ind) == "q is on cpu, not a CUDA device"
    why = torch_decode_unsupported_reason(q, pool.view(torch.float8_e5m2), ind, ind)
    assert "torch.float8_e5m2" in why and "float8_e4m3fn fp8 pools only" in why
    why = torch_decode_unsupported_reason(q, pool.view(torch.uint8), ind, ind)
    assert "torch.uint8" in why and "kv_pool.view(torch.float8_e4m3fn)" in why
    why = torch_decode_unsupported_reason(q, pool.view(torch.float16).view(64, D // 2), ind, ind)
    assert "must be q's dtype (torch.bfloat16) or torch.float8_e4m3fn" in why


def test_mla_attention_hands_the_launcher_an_fp8_view_and_reads_host_scales_only():
    """backend_select: a uint8 pool of fp8 bytes with kv_fp8_dtype reaches the launcher's
    checks as its float8_e4m3fn view (the same memory), without kv_fp8_dtype it is refused
    naming the view to take; a host scale tensor is read as a float (a device one never is:
    tests/test_launcher_gpu.py)."""
    torch = pytest.importorskip("torch")
    from funcmla.interop import backend_select as bs

    q = torch.zeros(2, 16, D, dtype=torch.bfloat16)
    bits = torch.zeros(64, D, dtype=torch.uint8)
    ind = torch.zeros(3, dtype=torch.int32)
    view = bs._launcher_pool_view((bits, ind, ind), FP8)
    assert view[0].dtype == torch.float8_e4m3fn and view[0].data_ptr() == bits.data_ptr()
    assert bs._launcher_pool_view((bits, ind, ind), None)[0] is bits
    assert bs._launcher_reason(q, (bits, ind, ind), kv_fp8_dtype=FP8) == (
        "q is on cpu, not a CUDA device")
    assert "kv_pool is torch.uint8" in bs._launcher_reason(q, (bits, ind, ind))
    assert bs._host_scale(torch.tensor([0.375])) == 0.375
    got = bs._scale_array(torch.tensor(0.375))
    assert got.shape == () and got.dtype == jnp.float32 and float(got) == 0.375


def test_per_layer_scales_share_one_program_in_mla_attention():
    """SGLang passes each layer's k_scale: through `mla_attention` the scale is a traced
    argument, so layers with different scales run one compiled program, each with its scale."""
    from funcmla.interop import backend_select as bs
    from funcmla.metadata import decode_metadata

    rng = np.random.default_rng(3)
    rows, heads = 40, 16
    pool = jnp.asarray(rng.standard_normal((rows, 576)) * 0.5, jnp.float32).astype(FP8)
    bits = jax.lax.bitcast_convert_type(pool, jnp.uint8)
    r2t = jnp.asarray(rng.permutation(rows)[:32].reshape(2, 16), jnp.int32)
    meta = decode_metadata(r2t, jnp.array([0, 1]), jnp.array([9, 16]), capacity=32)
    q = jnp.asarray(rng.standard_normal((2, heads, 576)), jnp.bfloat16)
    before = bs._reference._cache_size()
    for k_scale in (0.5, 2.0, 1.25):
        res = bs.mla_attention(q, bits, meta, sm_scale=SCALE, backend="reference", mode="decode",
                               kv_fp8_dtype=FP8, kv_scale=k_scale, max_kv_len=16)
        dequant = pool.astype(jnp.float32) * k_scale
        want, _ = mla_attention_reference(q.astype(jnp.float32), dequant, meta.qo_indptr,
                                          meta.kv_indptr, meta.kv_indices, sm_scale=SCALE,
                                          max_kv_len=16)
        assert rel_err(np.asarray(res.out, np.float32), np.asarray(want)) < 1e-2
    assert bs._reference._cache_size() - before == 1
    with pytest.raises(ValueError, match=r"kv_scale=\[-1.0\] must be a positive finite float"):
        bs.mla_attention(q, bits, meta, sm_scale=SCALE, backend="reference", mode="decode",
                         kv_fp8_dtype=FP8, kv_scale=-1.0, max_kv_len=16)
