"""The backend's persistent work plan against the planner oracles, in every mode, eager and
under CUDA graphs; batch buckets compile once per bucket and never show in the outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcmla.interop.sglang import step as step_mod
from funcmla.interop.sglang_backend import (
    Buckets,
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    SpecInfo,
)
from funcmla.planners.oracle_decode import plan_mla_decode_reference
from funcmla.planners.oracle_prefill import ps_prefill_plan_oracle

MAX_CTX, ROWS, H, N_DRAFT = 256, 16, 16, 2
# one batch bucket (every batch below 8 is padded) and one token bucket: one compile per mode
BUCKETS = Buckets(batch_sizes=(8,), min_kv_tokens=4096, min_q_tokens=256)
LADDER = Buckets(batch_sizes=(2, 4, 8), min_kv_tokens=4096, min_q_tokens=256)


def _req_to_token():
    rng = np.random.default_rng(0)
    slots = rng.permutation(np.arange(64, 64 + ROWS * MAX_CTX)).reshape(ROWS, MAX_CTX)
    return torch.from_numpy(slots.astype(np.int32)).clone()  # torch-allocated: 64-byte aligned


_BACKENDS: dict = {}


def backend(buckets=BUCKETS) -> FuncMLAAttnBackend:
    if buckets not in _BACKENDS:
        r2t = _req_to_token()
        pool = MLATokenToKVPool(ROWS * MAX_CTX + 64, 1, torch.bfloat16, 1)
        _BACKENDS[buckets] = FuncMLAAttnBackend(r2t, pool, num_heads=H, buckets=buckets,
                                                num_draft_tokens=N_DRAFT,
                                                attention_backend="reference")
    return _BACKENDS[buckets]


MODES = ["DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2", "EXTEND", "MIXED", "DRAFT_EXTEND"]


@st.composite
def batches(draw, mode):
    b = draw(st.integers(1, 8))
    rows = draw(st.lists(st.integers(0, ROWS - 1), min_size=b, max_size=b, unique=True))
    lo = N_DRAFT if mode == "DRAFT_EXTEND_V2" else 1
    hi = MAX_CTX - N_DRAFT if mode == "TARGET_VERIFY" else MAX_CTX
    seq = draw(st.lists(st.integers(lo, hi), min_size=b, max_size=b))
    ext = [draw(st.integers(1, s)) for s in seq] if mode in ("EXTEND", "MIXED", "DRAFT_EXTEND") \
        else None
    return rows, seq, ext


def _fb(mode, rows, seq, ext):
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    b = len(rows)
    q = sum(ext) if ext is not None else b * (1 if mode == "DECODE" else N_DRAFT)
    return ForwardBatch(
        forward_mode=ForwardMode[mode], batch_size=b, req_pool_indices=t(rows), seq_lens=t(seq),
        seq_lens_cpu=t(seq), seq_lens_sum=sum(seq), out_cache_loc=torch.zeros(q, dtype=torch.int32),
        extend_seq_lens=None if ext is None else t(ext),
        extend_seq_lens_cpu=ext, spec_info=SpecInfo(N_DRAFT))


def _indptrs(mode, seq, ext):
    seq = np.asarray(seq)
    if mode in ("EXTEND", "MIXED", "DRAFT_EXTEND"):
        q = np.asarray(ext)
    else:
        q = np.full(len(seq), 1 if mode == "DECODE" else N_DRAFT)
    kv = seq + (N_DRAFT if mode == "TARGET_VERIFY" else 0)
    cat = lambda x: np.concatenate([[0], np.cumsum(x)]).astype(np.int32)  # noqa: E731
    return cat(q), cat(kv), kv


def _oracle(be, mode, seq, ext, batch_size):
    qo, kv, kv_lens = _indptrs(mode, seq, ext)
    if mode in ("EXTEND", "MIXED", "DRAFT_EXTEND"):
        cfg = be.plan.prefill_config(int(max(ext)))
        ref = ps_prefill_plan_oracle(
            qo, kv, kv_lens, num_cu=cfg.device.num_cu, num_heads_k=cfg.num_heads_k, gqa_ratio=1,
            qhead_granularity=cfg.qhead_granularity, qlen_granularity=cfg.qlen_granularity,
            kvlen_granularity=cfg.kvlen_granularity, block_size=1, is_causal=True,
            max_qlen=int(max(ext)))
        return {k: ref[k] for k in ("work_indptr", "work_info", "reduce_indptr",
                                     "reduce_final_map", "reduce_partial_map")}
    msq = 1 if mode == "DECODE" else N_DRAFT
    ref = plan_mla_decode_reference(qo, kv, np.ones(len(seq), np.int32),
                                    config=be.plan.decode_config(msq), batch_size=batch_size)
    return {k: np.asarray(getattr(ref, k)) for k in ("work_indptr", "work_info", "reduce_indptr",
                                                      "reduce_final_map", "reduce_partial_map")}


FIELDS = dict(work_indptr="work_indptr", work_info="work_info_set",
              reduce_indptr="reduce_indptr", reduce_final_map="reduce_final_map",
              reduce_partial_map="reduce_partial_map")


def _check_meta(fm, mode, rows, seq, ext, *, graph=False):
    qo, kv, kv_lens = _indptrs(mode, seq, ext)
    b = len(rows)
    assert fm.kv_indptr.tolist() == kv.tolist()
    assert fm.qo_indptr.tolist() == qo.tolist()
    r2t = _req_to_token().numpy()
    want = np.concatenate([r2t[r, :n] for r, n in zip(rows, kv_lens)])
    assert np.array_equal(fm.kv_indices[: kv[-1]].numpy(), want)
    assert fm.kv_last_page_len.tolist() == [1] * b
    assert fm.work_metadata.dtype == torch.uint64
    ptrs = fm.work_metadata.view(torch.int64).tolist()
    assert ptrs == [fm.work_indptr.data_ptr(), fm.work_info_set.data_ptr()]


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=6)
@given(data=st.data())
def test_eager_plan_equals_oracle(mode, data):
    be = backend()
    rows, seq, ext = data.draw(batches(mode))
    be.init_forward_metadata(_fb(mode, rows, seq, ext))
    fm = be.forward_metadata
    _check_meta(fm, mode, rows, seq, ext)
    ref = _oracle(be, mode, seq, ext, len(rows))
    for k, name in FIELDS.items():  # same sizes as SGLang's *_info_v1, same values
        got = getattr(fm, name).numpy()
        assert got.shape == ref[k].shape, (name, got.shape, ref[k].shape)
        np.testing.assert_array_equal(got, ref[k], err_msg=name)
    if mode in ("EXTEND", "MIXED", "DRAFT_EXTEND"):
        assert fm.fp8_prefill_kv_indices.tolist() == list(range(sum(seq)))
        assert fm.max_q_len == max(ext)
    assert fm.num_kv_splits == be.plan.max_split_per_batch


@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"])
@settings(max_examples=4)
@given(data=st.data())
def test_cuda_graph_plan_equals_oracle_in_static_buffers(mode, data):
    be = backend()
    max_bs = 8
    if be.buffer_plan is None:
        be.init_cuda_graph_state(max_bs, max_bs * N_DRAFT)
    rows, seq, _ = data.draw(batches(mode))
    bs = len(rows)
    fb = _fb(mode, rows, seq, None)
    be.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices, fb.seq_lens, None,
                                                fb.forward_mode, fb.spec_info)
    static = {name: getattr(be.forward_metadata, name).data_ptr() for name in FIELDS.values()}
    rows2, seq2, _ = data.draw(batches(mode).filter(lambda x: len(x[0]) == bs))
    fb2 = _fb(mode, rows2, seq2, None)
    be.init_forward_metadata_replay_cuda_graph(bs, fb2.req_pool_indices, fb2.seq_lens,
                                               sum(seq2), None, fb2.forward_mode, fb2.spec_info,
                                               fb2.seq_lens_cpu)
    fm = be.forward_metadata
    _check_meta(fm, mode, rows2, seq2, None, graph=True)
    ref = _oracle(be, mode, seq2, None, max_bs)
    for k, name in FIELDS.items():
        got = getattr(fm, name)
        assert got.data_ptr() == static[name]  # replay writes into the captured buffers
        got = got.numpy()
        n = ref[k].shape[0]
        np.testing.assert_array_equal(got[:n], ref[k], err_msg=name)
        assert not got[n:].any()  # the static buffer's tail (sized for max(1, n) queries)


def test_one_compile_per_bucket_and_padding_invisible():
    """A trace of random batch sizes compiles one program per (mode, batch bucket, kv bucket),
    and every step's exported metadata equals the unpadded NumPy restatement."""
    be = backend(LADDER)
    rng = np.random.default_rng(3)
    before = step_mod.build_step._cache_size()
    keys = set()
    for _ in range(24):
        mode = "DECODE"
        b = int(rng.integers(1, 9))
        rows = rng.choice(ROWS, b, replace=False).tolist()
        seq = rng.integers(1, 60, b).tolist()
        be.init_forward_metadata(_fb(mode, rows, seq, None))
        _check_meta(be.forward_metadata, mode, rows, seq, None)
        total = sum(seq) + (N_DRAFT * b if mode == "TARGET_VERIFY" else 0)
        keys.add((mode, LADDER.batch(b), LADDER.kv_tokens(total)))
    compiled = step_mod.build_step._cache_size() - before
    assert compiled <= len(keys) <= len(LADDER.batch_sizes)  # 24 steps, at most 3 programs


@pytest.mark.parametrize("fill_impl", ["scan", "fused"])  # fused: the GPU default (interpreted)
def test_decode_planner_masks_padded_requests(fill_impl):
    """plan_mla_decode(num_requests=B) on a batch padded to 16 == the oracle's plan of the B
    live requests (the padded requests get no tiles; num_splits follows B)."""
    import jax
    import jax.numpy as jnp

    from funcmla.planners import plan_mla_decode

    cfg = backend().plan.decode_config(N_DRAFT)
    plan = jax.jit(lambda q, k, n: plan_mla_decode(q, k, jnp.ones(16, jnp.int32), config=cfg,
                                                   num_requests=n, fill_impl=fill_impl))
    rng = np.random.default_rng(4)
    for b in (1, 2, 9):
        kv = np.concatenate([rng.integers(0, 3000, b), np.zeros(16 - b, int)])
        kvi = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
        qoi = (np.arange(17) * N_DRAFT).astype(np.int32)
        got = plan(jnp.asarray(qoi), jnp.asarray(kvi), jnp.int32(b))
        ref = plan_mla_decode_reference(qoi[: b + 1], kvi[: b + 1], np.ones(b, np.int32),
                                        config=cfg)
        for k in FIELDS:
            want = np.asarray(getattr(ref, k))
            np.testing.assert_array_equal(np.asarray(getattr(got, k))[: want.shape[0]], want)
