"""The all-fp8 matrix path (`DecodeKernelConfig.fp8_products="fp8"`) of the 64-row fp8 Mosaic
GPU decode kernel: q and P rounded once to e4m3, q k^T and P V on fp8 `wgmma`s, V's bytes
transposed by `prmt` into shared memory with no conversion (`decode_mgpu_fp8_wide._transpose_v`).

Checked against independent restatements: the dispatch rule; the transpose's byte moves and
bank slots, emulated thread by thread with PTX `prmt` and Hopper's 64-byte swizzle restated;
in interpret mode on CPU an exact case (equal scores: every weight is 1, exact in e4m3)
against float64, and random cases against float64 with q rounded as the kernel rounds it (lse
tight; out within P's e4m3 rounding) and with q unrounded (the documented error). GPU tests
are marked `gpu`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcmla.attention.pallas import DecodeKernelConfig, decode_mgpu_fp8_wide, kernel_choice
from funcmla.attention.pallas import fp8_transpose, mla_decode
from funcmla.attention.pallas.decode_common import kv_rows_from_page_table
from funcmla.attention.pallas.extend import extend_kernel_config
from funcmla.attention.pallas.fp8_q_split import prepare_q
from funcmla.layout import PageTable
from tests.pools import rel_err
from tests.test_fp8_decode import D, FP8, SCALE, _csr, _problem, lowered_for_cuda, oracle

pytestmark = pytest.mark.filterwarnings("ignore:.*Triton.*:DeprecationWarning")

FP8_CONFIG = DecodeKernelConfig(fp8_products="fp8")
_LOG2E = 1.4426950408889634
_SLOW = pytest.mark.slow


# ------------------------------------------------------------------------------- dispatch

def _sds(heads, s_q=1, seqs=2, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((seqs * s_q, heads, D), dtype)


def test_fp8_products_run_the_64_row_fp8_mosaic_kernel_even_in_interpret_mode():
    """"auto" takes Triton in interpret mode; fp8 products exist only on the 64-row fp8 Mosaic
    GPU kernel, so with them that kernel runs (also at one block, below mgpu_min_blocks)."""
    config = dataclasses.replace(FP8_CONFIG, mgpu_min_blocks=99)
    for heads, s_q in ((64, 1), (128, 1), (32, 2)):
        pick, why = kernel_choice(config, _sds(heads, s_q), 64, s_q, interpret=True,
                                  kv_dtype=FP8)
        assert pick == "mgpu" and "fp8_products" in why
    # a bf16 pool has no fp8 products: the usual rule
    assert kernel_choice(FP8_CONFIG, _sds(128), 64, 1, interpret=True)[0] == "triton"
    assert kernel_choice(DecodeKernelConfig(), _sds(128), 64, 1, interpret=True,
                         kv_dtype=FP8)[0] == "triton"


@pytest.mark.parametrize("config,heads,page,match", [
    (FP8_CONFIG, 16, 64, "is not a multiple of 64"),
    (dataclasses.replace(FP8_CONFIG, kernel="triton"), 128, 64, "kernel='triton'"),
    (FP8_CONFIG, 128, 48, "page"),
])
def test_fp8_products_name_why_they_cannot_run(config, heads, page, match):
    with pytest.raises(ValueError, match=f"fp8_products='fp8'.*{match}"):
        kernel_choice(config, _sds(heads), page, 1, interpret=True, kv_dtype=FP8)


def test_extends_run_the_mixed_products():
    """fp8_products is a decode setting: an extend's config gets "mixed"."""
    for kernel in ("auto", "mgpu", "triton"):
        config = dataclasses.replace(FP8_CONFIG, kernel=kernel)
        got = extend_kernel_config(config, 128, 1, 8, 64, kv_dtype=FP8, interpret=True)
        assert got.fp8_products == "mixed" and (kernel == "auto" or got.kernel == kernel)


def test_config_names_an_unknown_fp8_products_value():
    with pytest.raises(ValueError, match="fp8_products must be one of .*'e5m2'"):
        DecodeKernelConfig(fp8_products="e5m2")


# ------------------------------------------------------------------ the V transpose, emulated

def _prmt(a: int, b: int, sel: int) -> int:
    """PTX `prmt.b32` (default mode): result byte i is byte (sel >> 4 i) & 7 of b:a."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _swizzled64(row: int, col: int, cols: int) -> int:
    """Byte of element (row, col) in an (8, 64)-tiled, 64-byte swizzled 8-bit buffer of `cols`
    columns: 512-byte tiles row-major, a tile row 64 bytes, its 16-byte chunks XORed with
    (row % 8) // 2 (Hopper's 64-byte swizzle, as TMA and wgmma read it)."""
    tile = (row // 8) * (cols // 64) + col // 64
    chunk = ((col % 64) // 16) ^ ((row % 8) // 2)
    return tile * 512 + (row % 8) * 64 + chunk * 16 + col % 16


def test_v_transpose_moves_every_byte_once_without_bank_conflicts():
    """`_transpose_v`'s algorithm thread by thread (its thread map, 8-byte loads at base
    registers plus constants, the selectors and `fp8_transpose.transpose_4x4` over PTX `prmt`
    restated, the token masks, 16-byte stores): V^T equals the stage's first 512 columns
    transposed with tokens at or past `valid` zeroed, every byte written once, and each load
    phase (16 lanes of 8 bytes) and store phase (8 lanes of 16 bytes) touches distinct bank
    slots."""
    for valid in (64, 37, 1):
        _transpose_emulated(valid)


def _transpose_emulated(valid: int):
    w = decode_mgpu_fp8_wide
    rng = np.random.default_rng(valid)
    v = rng.integers(0, 256, (64, 576), dtype=np.uint8)
    stage = np.zeros(64 * 576, np.uint8)
    for r in range(64):
        for c in range(576):
            stage[_swizzled64(r, c, 576)] = v[r, c]
    vt = np.zeros(512 * 64, np.int32) - 1
    loads, stores = {}, {}
    for t in range(128):
        for p in range(2):
            cb8, tb16, flip, rot = w.transpose_thread_map(t, p)
            hb = tb16 >> 1
            for kk in range(16):  # the load addresses: base registers + constants
                c, odd, imm = w.transpose_load_offset(kk, p)
                base = ((cb8 >> 3) * 512 + (cb8 & 1) * 8 + hb * 4 * (576 // 64) * 512
                        + ((((cb8 >> 1) & 3) ^ c) << 4) + (-64 if odd else 64) * flip)
                assert base + imm == _swizzled64(16 * tb16 + (kk ^ flip), 8 * cb8, 576)
            masks = [w.transpose_token_mask(valid - 16 * tb16, quad) for quad in range(4)]
            words = []
            for kk in range(16):
                tok = 16 * tb16 + (kk ^ flip)
                addr = _swizzled64(tok, 8 * cb8, 576)
                assert addr % 8 == 0
                loads.setdefault((t // 32, p, kk, (t % 32) // 16), []).append(addr)
                x = int.from_bytes(stage[addr:addr + 8].tobytes(), "little")
                words.append((x & 0xFFFFFFFF, x >> 32))
            sel_x = fp8_transpose.pair_select(rot, rot ^ 1, flip)
            sel_y = fp8_transpose.pair_select(rot ^ 2, rot ^ 3, flip)
            for g in range(2):
                quads = [fp8_transpose.transpose_4x4(
                    _prmt, [words[4 * quad + j][g] for j in range(4)], sel_x, sel_y, int)
                    for quad in range(4)]
                cols = [[quads[quad][i] & masks[quad] for quad in range(4)] for i in range(4)]
                for i in range(4):
                    c = 8 * cb8 + 4 * g + (i ^ rot)
                    addr = _swizzled64(c, 16 * tb16, 64)
                    stores.setdefault((t // 32, p, g, i, (t % 32) // 8), []).append(addr)
                    data = b"".join(word.to_bytes(4, "little") for word in cols[i])
                    assert (vt[addr:addr + 16] == -1).all(), "a byte of V^T written twice"
                    vt[addr:addr + 16] = np.frombuffer(data, np.uint8)
    got = np.array([[vt[_swizzled64(c, k, 64)] for k in range(64)] for c in range(512)])
    want = np.where(np.arange(64)[:, None] < valid, v[:, :512], 0).T
    np.testing.assert_array_equal(got, want)
    for addrs in loads.values():
        assert len({(a % 128) // 8 for a in addrs}) == 16, addrs
    for addrs in stores.values():
        assert len({(a % 128) // 16 for a in addrs}) == 8, addrs


# ------------------------------------------------------------------------------- interpret

def _decode(p, page_size, s_q, num_splits, ks, vs, interpret, config=FP8_CONFIG):
    if page_size == 1:
        indptr, indices = _csr(p["slot_lists"])
        meta = dict(kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(indices))
    else:
        meta = dict(page_table=PageTable(p["table"], p["lens"], page_size))
    return mla_decode(p["q"], p["pool"], sm_scale=SCALE, s_q=s_q, num_splits=num_splits,
                      config=config, interpret=interpret, k_scale=ks,
                      v_scale=jnp.asarray([vs], jnp.float32), **meta)


def _equal_scores(p, heads):
    """p with every used pool row's rope columns (512-575) set to 1 and q zero outside them:
    all of a row's scores are equal, so every softmax weight is exactly 1 (256 in e4m3 after
    the 2^8 scale) and out is the mean of the visible V rows; q's rope values are powers of
    two, exact in e4m3."""
    pool = np.array(p["pool"].astype(jnp.float32))
    used = np.isfinite(pool[:, 0])
    pool[used, 512:] = 1.0
    q = np.zeros(p["q"].shape, np.float32)
    q[:, :, 512:] = (2.0 ** -(np.arange(heads) % 5))[None, :, None]
    return dict(p, pool=jnp.asarray(pool, FP8), q=jnp.asarray(q, jnp.bfloat16))


def _check_exact(out, lse, p, s_q, ks, vs, tol):
    ref_out, ref_lse = oracle(p["q"], p["pool"], p["slot_lists"], s_q, ks, vs)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    live = np.isfinite(ref_lse)
    assert np.isfinite(out).all(), "NaN/inf reached the output"
    assert (lse[~live] == np.inf).all() and (out[~live] == 0).all()
    assert rel_err(out[live], ref_out[live]) < tol
    np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-4, atol=1e-4)


def _q_as_rounded(q, s_q, ks):
    """q as the kernel sees it: each row scaled by its power of two, rounded once to e4m3 (the
    high part of `prepare_q`) and scaled back."""
    t, h, _ = q.shape
    q8, scales = prepare_q(q.reshape(t // s_q, s_q * h, D), sm_scale=SCALE,
                           k_scale=jnp.float32(ks), v_scale=jnp.float32(1.0))
    down = scales[:, 0] / (SCALE * _LOG2E * ks)
    hi = q8[:, :s_q * h].astype(jnp.float32) * down[..., None]
    return hi.reshape(t, h, D)


def _check_rounded(out, lse, p, s_q, ks, vs, out_tol, lse_atol, lse_rtol=1e-4):
    """lse against float64 over q rounded as the kernel rounds it (P's rounding does not reach
    lse: the row sums add unrounded weights), out within P's e4m3 rounding of it; then both
    against the unrounded q with the documented error."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    assert np.isfinite(out).all(), "NaN/inf reached the output"
    q_hat = _q_as_rounded(p["q"], s_q, ks)
    for q, o_tol, l_tol in ((q_hat, out_tol, lse_rtol), (p["q"], out_tol, lse_atol)):
        ref_out, ref_lse = oracle(q, p["pool"], p["slot_lists"], s_q, ks, vs)
        live = np.isfinite(ref_lse)
        assert (lse[~live] == np.inf).all() and (out[~live] == 0).all()
        assert rel_err(out[live], ref_out[live]) < o_tol
        np.testing.assert_allclose(lse[live], ref_lse[live], rtol=l_tol, atol=l_tol)


# out: P's e4m3 rounding (relative 2^-4 at most, ~3.6% rms) weighs each visible V row, so on
# near-uniform softmaxes over random V the output's relative error is ~3e-2; lse: q's e4m3
# rounding moves each score by ~3.6% of its own spread (~0.1 on these rows).
OUT_TOL, LSE_ATOL = 6e-2, 0.25


@pytest.mark.parametrize("page_size,s_q,heads,lens,num_splits", [
    (64, 1, 64, [70, 0, 20], 2),
    pytest.param(1, 2, 32, [130, 3], 1, marks=_SLOW),
    pytest.param(16, 1, 128, [200, 64], None, marks=_SLOW)])
def test_interpret_fp8_products_exact_on_equal_scores(page_size, s_q, heads, lens, num_splits):
    """Every weight 1: no rounding anywhere but the bf16 output, so the V^T path, masking,
    splits and the 2^-8 output scale are checked to bf16 precision (NaN in unused rows)."""
    rng = np.random.default_rng(page_size + heads)
    p = _equal_scores(_problem(rng, batch=len(lens), heads=heads, s_q=s_q,
                               page_size=page_size, lens=lens), heads)
    out, lse = _decode(p, page_size, s_q, num_splits, 0.37, 1.9, interpret=True)
    _check_exact(out, lse, p, s_q, 0.37, 1.9, tol=4e-3)


@pytest.mark.parametrize("page_size,s_q,heads,lens,num_splits", [
    (1, 1, 64, [200, 1, 0], 1),
    pytest.param(64, 2, 32, [150, 2], 3, marks=_SLOW),
    pytest.param(8, 1, 64, [77, 129], 2, marks=_SLOW)])
def test_interpret_fp8_products_within_e4m3_error(page_size, s_q, heads, lens, num_splits):
    rng = np.random.default_rng(page_size * 3 + heads)
    p = _problem(rng, batch=len(lens), heads=heads, s_q=s_q, page_size=page_size, lens=lens)
    out, lse = _decode(p, page_size, s_q, num_splits, 0.37, 1.9, interpret=True)
    _check_rounded(out, lse, p, s_q, 0.37, 1.9, OUT_TOL, LSE_ATOL)


@_SLOW
def test_interpret_fp8_products_have_no_data_race():
    """The interpreter's race detector over 5 tiles and 3 stages of the fp8-products kernel:
    the V^T and P8 hand-offs and the refills are ordered (private jax API: skip if moved)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the jax version
        pytest.skip(f"Mosaic GPU interpreter's race detector not importable: {e}")
    p = _problem(np.random.default_rng(5), batch=1, heads=64, s_q=1, page_size=64, lens=[300])
    kv = kv_rows_from_page_table(PageTable(p["table"], p["lens"], 64))
    o, _ = decode_mgpu_fp8_wide.decode_call(
        p["q"], p["pool"], kv, sm_scale=SCALE, s_q=1, num_splits=1,
        k_scale=jnp.asarray([0.37], jnp.float32), v_scale=jnp.asarray([1.9], jnp.float32),
        products="fp8", interpret=InterpretGPUParams(detect_races=True))
    jax.block_until_ready(o)
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("page_size,s_q,heads,splits", [(64, 1, 128, 1), (1, 2, 32, 3)])
def test_fp8_products_lower_for_cuda(page_size, s_q, heads, splits):
    """The compiled form lowers for CUDA on any host: the fp8 P store, the inline V^T
    transpose, the fp8 wgmmas with P8 and V^T from shared memory, three stages in budget."""
    text = lowered_for_cuda(decode_mgpu_fp8_wide, page_size, s_q, heads, splits, products="fp8")
    assert f"mla_decode_mgpu_fp8wa_ps{page_size}" in text


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_fp8_products_exact_on_equal_scores(page_size):
    """Compiled: the weights are exact, so what is left is the fp8 wgmma's accumulation of P V
    (its fp32 accumulator keeps ~13-14 bits a chain) and the bf16 output."""
    p = _equal_scores(_problem(np.random.default_rng(page_size), batch=16, heads=128, s_q=1,
                               page_size=page_size, lens=[1000, 0, 513, 7] * 4), 128)
    out, lse = _decode(p, page_size, 1, None, 0.37, 1.9, interpret=False)
    _check_exact(out, lse, p, 1, 0.37, 1.9, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,s_q,heads", [(1, 1, 128), (64, 1, 128), (64, 2, 32)])
def test_gpu_fp8_products_within_e4m3_error(page_size, s_q, heads):
    p = _problem(np.random.default_rng(page_size + heads), batch=16, heads=heads, s_q=s_q,
                 page_size=page_size, lens=[1000, 0, 513, 7 * s_q] * 4)
    out, lse = _decode(p, page_size, s_q, None, 0.37, 1.9, interpret=False)
    # compiled: approximate exp2 / log2 and the fp8 wgmma's accumulation of q k^T
    _check_rounded(out, lse, p, s_q, 0.37, 1.9, OUT_TOL, LSE_ATOL, lse_rtol=2e-3)
