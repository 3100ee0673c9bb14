"""AITER dispatch: the argument contract, checked against the documented signatures.

No ROCm machine is available, so a fake `aiter` module is injected. Its functions are written out
from the signatures documented for the pinned AITER commit (`aiter/mla.py`,
`aiter/ops/attention.py`, SGLang's `aiter_backend.py` calls); calling one with a wrong keyword
fails, and each call is recorded so the test can check names, order, shapes, dtypes, strides and
devices. The fake decode / prefill kernels also compute attention from the metadata they receive,
the way the documented contract says the kernel reads it (page-1 view, token slots), so a mis-wired
argument shows up as a wrong result too.
"""

import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from funcmla.config import deepseek_v3_sm_scale
from funcmla.interop import aiter_dispatch as ad
from funcmla.interop.backend_select import mla_attention, select_backend
from funcmla.interop.testing import random_paged_batch
from funcmla.interop.torch_csr import csr_mla_attention_dense
from funcmla.interop.torch_native import torch_native_mla_decode, torch_native_mla_extend
from funcmla.planners.plan import WorkPlan

SCALE = deepseek_v3_sm_scale()
H = 16


def _fake_aiter(calls):
    mla = types.ModuleType("aiter.mla")

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                       max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                       num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                       work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, q_scale=None,
                       kv_scale=None, intra_batch_mode=False, return_logits=False,
                       return_lse=False, g_kv_indptr=None, cp_world_size=1, cp_rank=0,
                       causal=True):
        calls.append(("mla_decode_fwd", dict(locals())))
        rows = kv_buffer.reshape(-1, kv_buffer.shape[-1])  # page_size 1: a page is a slot
        o.copy_(csr_mla_attention_dense(q, rows, qo_indptr, kv_indptr, kv_indices,
                                        sm_scale=sm_scale, v_head_dim=o.shape[-1]))
        return None, torch.zeros(q.shape[0], q.shape[1])

    def mla_prefill_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                        max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None):
        calls.append(("mla_prefill_fwd", dict(locals())))
        rows = kv_buffer.reshape(-1, kv_buffer.shape[-1])
        o.copy_(csr_mla_attention_dense(q, rows, qo_indptr, kv_indptr, kv_indices,
                                        sm_scale=sm_scale, v_head_dim=o.shape[-1]))

    mla.mla_decode_fwd = mla_decode_fwd
    mla.mla_prefill_fwd = mla_prefill_fwd
    aiter = types.ModuleType("aiter")
    aiter.mla = mla

    def mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr,
                               work_info_set, max_seqlen_q, softmax_scale, is_causal, splitData,
                               splitLse, output, q_scale=None, k_scale=None, v_scale=None):
        calls.append(("mla_prefill_ps_asm_fwd", dict(locals())))

    def mla_reduce_v1(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                      reduce_partial_map, max_seqlen_q, num_kv_splits, final_output,
                      final_lse=None):
        calls.append(("mla_reduce_v1", dict(locals())))

    aiter.mla_prefill_ps_asm_fwd = mla_prefill_ps_asm_fwd
    aiter.mla_reduce_v1 = mla_reduce_v1
    return aiter


@pytest.fixture
def fake_aiter(monkeypatch):
    calls = []
    aiter = _fake_aiter(calls)
    monkeypatch.setitem(sys.modules, "aiter", aiter)
    monkeypatch.setitem(sys.modules, "aiter.mla", aiter.mla)
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setattr(ad, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    return calls


def _plan(kind="decode", block_size=1, num_cu=8, max_work=12, tiles=4, partials=6):
    rng = np.random.default_rng(0)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return WorkPlan(
        work_indptr=i32(np.sort(rng.integers(0, max_work, num_cu + 1))),
        work_info=i32(rng.integers(-1, 50, (max_work, 8))),
        reduce_indptr=i32(np.arange(tiles + 1)),
        reduce_final_map=i32(rng.integers(0, 9, (tiles, 2))),
        reduce_partial_map=i32(rng.integers(0, 99, partials)),
        num_works=jnp.int32(5), num_partials=jnp.int32(3),
        kind=kind, block_size=block_size,
    )


class _Meta:
    """SGLang-named token-granular metadata (torch), built directly for the contract test."""

    def __init__(self, b, q_lens, capacity_slack=5):
        kv_lens = b.seq_lens.tolist()
        self.kv_indptr = torch.tensor(np.concatenate([[0], np.cumsum(kv_lens)]), dtype=torch.int32)
        self.qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
        idx = [b.req_to_token[r, :s] for r, s in zip(b.req_pool_indices.tolist(), kv_lens)]
        self.kv_indices = torch.cat(idx + [torch.zeros(capacity_slack, dtype=torch.int32)])
        self.kv_last_page_len = torch.ones(len(kv_lens), dtype=torch.int32)
        self.max_q_len = max(q_lens)


def _batch(prefix, extend, page_size=16, seed=0):
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, prefix_lens=prefix, extend_lens=extend, page_size=page_size,
                           max_context_len=128)
    kv = torch.from_numpy(rng.standard_normal((b.num_slots, 1, 576)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((sum(extend), H, 576)).astype(np.float32))
    return b, kv.bfloat16(), q.bfloat16()


def test_decode_call_matches_the_documented_contract(fake_aiter):
    b, kv, q = _batch([10, 0, 47], [1, 1, 1])
    meta = _Meta(b, [1, 1, 1])
    plan = ad.export_work_plan(_plan())
    out, _ = ad.mla_decode(q, kv, meta, plan, sm_scale=SCALE, num_kv_splits=32)
    (name, a), = fake_aiter
    assert name == "mla_decode_fwd"
    assert a["q"] is q and a["o"] is out
    assert a["kv_buffer"].shape == (b.num_slots, 1, 1, 576)  # page-1 view of the pool
    assert a["kv_buffer"].data_ptr() == kv.data_ptr()  # a view, not a copy
    assert (a["page_size"], a["nhead_kv"]) == (1, 1)
    for k in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens"):
        assert a[k].dtype == torch.int32 and a[k].is_contiguous() and a[k].device == q.device
    assert a["kv_indices"] is meta.kv_indices and a["kv_indptr"] is meta.kv_indptr
    assert a["max_seqlen_q"] == 1 and a["num_kv_splits"] == 32 and a["logit_cap"] == 0.0
    assert a["sm_scale"] == pytest.approx(SCALE)
    # persistent mode: work_meta_data holds the two device addresses, uint64 [2]
    assert a["work_meta_data"].dtype == torch.uint64 and a["work_meta_data"].shape == (2,)
    assert a["work_meta_data"].tolist() == [plan.work_indptr.data_ptr(),
                                           plan.work_info_set.data_ptr()]
    assert a["work_info_set"].shape == (12, 8) and a["work_indptr"].shape == (9,)
    assert a["reduce_final_map"].shape == (4, 2) and a["reduce_partial_map"].shape == (6,)
    assert a["q_scale"] is None and a["kv_scale"] is None and a["intra_batch_mode"] is False
    # and the kernel, reading the metadata as documented, gives SGLang's torch-native result
    want = torch_native_mla_decode(q, kv, b.req_to_token, b.req_pool_indices, b.seq_lens,
                                   sm_scale=SCALE, compute_dtype=torch.float32)
    rel = (out.float() - want).abs().max() / want.abs().max()
    assert out.dtype == torch.bfloat16 and rel < 8e-3


def test_exported_plan_is_one_buffer_with_exact_values(fake_aiter):
    plan = _plan()
    ap = ad.export_work_plan(plan)
    np.testing.assert_array_equal(ap.work_info_set.numpy(), np.asarray(plan.work_info))
    np.testing.assert_array_equal(ap.work_indptr.numpy(), np.asarray(plan.work_indptr))
    np.testing.assert_array_equal(ap.reduce_final_map.numpy(), np.asarray(plan.reduce_final_map))
    base = ap.work_indptr.untyped_storage().data_ptr()
    for t in (ap.work_info_set, ap.reduce_indptr, ap.reduce_final_map, ap.reduce_partial_map):
        assert t.untyped_storage().data_ptr() == base  # views of one packed buffer


def test_fp8_decode_passes_float32_1_scales(fake_aiter):
    b, kv, q = _batch([5, 9], [1, 1], seed=1)
    meta = _Meta(b, [1, 1])
    q8, kv8 = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 q needs q_scale and kv_scale"):
        ad.mla_decode(q8, kv8, meta, None, sm_scale=SCALE, num_kv_splits=8)
    ad.mla_decode(q8, kv8, meta, None, sm_scale=SCALE, num_kv_splits=8, q_scale=0.5,
                  kv_scale=torch.tensor([2.0]))
    (_, a), = fake_aiter
    for k, v in (("q_scale", 0.5), ("kv_scale", 2.0)):
        assert a[k].dtype == torch.float32 and a[k].shape == (1,) and a[k].item() == v
    assert a["work_meta_data"] is None  # non-persistent without a plan
    assert a["num_kv_splits"] == 8  # ... but num_kv_splits is still passed


def test_prefill_call_matches_contract_and_torch_native(fake_aiter):
    prefix, extend = [0, 20, 6], [7, 3, 11]
    b, kv, q = _batch(prefix, extend, page_size=64, seed=2)
    meta = _Meta(b, extend)
    out = ad.mla_prefill(q, kv, meta, sm_scale=SCALE, num_kv_splits=1)
    (name, a), = fake_aiter
    assert name == "mla_prefill_fwd"
    assert a["kv_buffer"].shape == (b.num_slots, 1, 1, 576) and a["max_seqlen_q"] == 11
    assert a["num_kv_splits"] == 1 and a["logit_cap"] == 0.0
    want = torch_native_mla_extend(q, kv, b.req_to_token, b.req_pool_indices, b.seq_lens,
                                   b.extend_prefix_lens, b.extend_seq_lens, sm_scale=SCALE,
                                   compute_dtype=torch.float32)
    assert (out.float() - want).abs().max() / want.abs().max() < 8e-3


def test_prefill_ps_then_reduce(fake_aiter):
    T, N, Hq = 40, 64, 8
    q = torch.zeros(T, Hq, 192).to(torch.float8_e4m3fn)
    k = torch.zeros(N, Hq, 192).to(torch.float8_e4m3fn)
    v = torch.zeros(N, Hq, 128).to(torch.float8_e4m3fn)
    qo = torch.tensor([0, 15, 40], dtype=torch.int32)
    kvp = torch.tensor([0, 30, 64], dtype=torch.int32)
    plan = ad.export_work_plan(_plan(kind="prefill", partials=3))
    out, lse = ad.mla_prefill_ps(q, k, v, qo, kvp, torch.arange(N, dtype=torch.int32), plan,
                                 max_seqlen_q=25, softmax_scale=SCALE)
    (n1, a), (n2, r) = fake_aiter
    assert (n1, n2) == ("mla_prefill_ps_asm_fwd", "mla_reduce_v1")
    assert a["splitData"].shape == (3 * 256, Hq, 128) and a["splitData"].dtype == torch.float32
    assert a["splitLse"].shape == (3 * 256, Hq)
    assert a["output"] is out and out.shape == (T, Hq, 128) and out.dtype == torch.bfloat16
    assert a["work_indptr"] is plan.work_indptr and a["work_info_set"] is plan.work_info_set
    assert a["max_seqlen_q"] == 25 and a["is_causal"] is True
    for s in ("q_scale", "k_scale", "v_scale"):
        assert a[s].dtype == torch.float32 and a[s].shape == (1,)
    assert r["partial_output"] is a["splitData"] and r["partial_lse"] is a["splitLse"]
    assert r["max_seqlen_q"] == 256 and r["num_kv_splits"] == 0
    assert r["final_output"] is out and r["final_lse"] is lse and lse.shape == (T, Hq)
    assert r["reduce_partial_map"] is plan.reduce_partial_map


def test_page_granular_prefill_plan_is_refused(fake_aiter):
    """The seed's first bug: a PS plan counted in pages (block_size = page_size)."""
    plan = ad.export_work_plan(_plan(kind="prefill", block_size=64))
    q = torch.zeros(4, 8, 192).to(torch.float8_e4m3fn)
    v = torch.zeros(4, 8, 128).to(torch.float8_e4m3fn)
    i = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size is 64.*token-granular.*#25556"):
        ad.mla_prefill_ps(q, q, v, i, i, torch.arange(4, dtype=torch.int32), plan,
                          max_seqlen_q=4, softmax_scale=SCALE)
    assert fake_aiter == []


def test_contract_violations_are_named(fake_aiter):
    b, kv, q = _batch([3, 4], [1, 1], seed=3)
    meta = _Meta(b, [1, 1])
    with pytest.raises(ValueError, match="num_kv_splits must be a positive int"):
        ad.mla_decode(q, kv, meta, None, sm_scale=SCALE, num_kv_splits=None)
    meta.kv_indices = meta.kv_indices.long()
    with pytest.raises(TypeError, match="kv_indices must have dtype torch.int32"):
        ad.mla_decode(q, kv, meta, None, sm_scale=SCALE, num_kv_splits=4)
    meta = _Meta(b, [1, 1])
    with pytest.raises(ValueError, match=r"kv_pool must be contiguous"):
        padded_rows = torch.zeros(kv.shape[0], 1, 640, dtype=kv.dtype)[..., :576]
        ad.mla_decode(q, padded_rows, meta, None, sm_scale=SCALE, num_kv_splits=4)
    with pytest.raises(ValueError, match=r"kv_pool must be \[slots, 576\]"):
        ad.mla_decode(q, kv[..., :512].contiguous(), meta, None, sm_scale=SCALE,
                      num_kv_splits=4)
    with pytest.raises(ValueError, match="plan.kind is 'prefill'"):
        ad.mla_decode(q, kv, meta, ad.export_work_plan(_plan(kind="prefill")), sm_scale=SCALE,
                      num_kv_splits=4)
    with pytest.raises(TypeError, match="q must have dtype"):
        ad.mla_decode(q.float(), kv, meta, None, sm_scale=SCALE, num_kv_splits=4)
    assert fake_aiter == []


def test_without_rocm_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(ad.AiterUnavailable, match=r"needs ROCm.*torch.version.hip is None"):
        ad.load_aiter()
    assert not ad.aiter_available()
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    monkeypatch.setitem(sys.modules, "aiter", None)  # ROCm torch, amd-aiter not installed
    with pytest.raises(ad.AiterUnavailable, match=r"amd-aiter is not importable.*e4048607a535"):
        ad.load_aiter()
    with pytest.raises(RuntimeError, match="'aiter' was requested but cannot run"):
        select_backend("aiter")


def test_backend_selection_prefers_aiter_when_present_and_reports_it(fake_aiter):
    assert select_backend() == "aiter"
    assert select_backend("reference") == "reference"
    b, kv, q = _batch([8, 2], [1, 1], seed=4)
    res = mla_attention(q, kv, _Meta(b, [1, 1]), sm_scale=SCALE, mode="decode",
                        num_kv_splits=16)
    assert res.backend == "aiter" and fake_aiter[0][0] == "mla_decode_fwd"
    res = mla_attention(q, kv, _Meta(b, [1, 1]), sm_scale=SCALE, mode="extend",
                        num_kv_splits=16)
    assert res.backend == "aiter" and fake_aiter[1][0] == "mla_prefill_fwd"


def test_real_planner_outputs_flow_into_the_kernels(fake_aiter):
    """funcmla metadata -> funcmla planners -> export (one crossing) -> the AITER calls."""
    import jax

    from funcmla.config import MI300X, MI355X
    from funcmla.metadata import decode_metadata
    from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode
    from funcmla.planners.decode_sizes import mla_decode_plan_sizes
    from funcmla.planners.prefill import PrefillPlanConfig, plan_ps_prefill

    b, kv, q = _batch([100, 3, 47, 0], [1, 1, 1, 1], seed=5)
    meta = decode_metadata(jnp.asarray(b.req_to_token.numpy()),
                           jnp.asarray(b.req_pool_indices.numpy()),
                           jnp.asarray(b.seq_lens.numpy()), capacity=256)
    cfg = DecodePlanConfig(device=MI300X, num_heads=H)
    plan = jax.jit(plan_mla_decode, static_argnames=("config",))(
        meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len, config=cfg)
    ap = ad.export_work_plan(plan)
    sizes = mla_decode_plan_sizes(4, cfg)
    assert ap.work_indptr.shape == sizes.work_indptr == (MI300X.num_cu + 1,)
    assert ap.work_info_set.shape == sizes.work_info
    np.testing.assert_array_equal(ap.work_info_set.numpy(), np.asarray(plan.work_info))
    out, _ = ad.mla_decode(q, kv, _Meta(b, [1, 1, 1, 1]), ap, sm_scale=SCALE, num_kv_splits=32)
    (_, a), = fake_aiter
    assert a["work_info_set"] is ap.work_info_set
    assert a["work_meta_data"].tolist() == [ap.work_indptr.data_ptr(),
                                           ap.work_info_set.data_ptr()]
    # prefill PS: the token-granular default plan passes, the legacy page-granular one is refused
    qo = jnp.array([0, 40, 100], jnp.int32)
    kvp = jnp.array([0, 300, 400], jnp.int32)
    ctx = jnp.array([300, 100], jnp.int32)
    for legacy in (False, True):
        pcfg = (PrefillPlanConfig.legacy_page_granular(64, device=MI355X, gqa_ratio=8)
                if legacy else PrefillPlanConfig(device=MI355X, gqa_ratio=8))
        pap = ad.export_work_plan(plan_ps_prefill(qo, kvp, ctx, config=pcfg))
        q8 = torch.zeros(100, 8, 192).to(torch.float8_e4m3fn)
        k8 = torch.zeros(400, 1, 192).to(torch.float8_e4m3fn)
        v8 = torch.zeros(400, 1, 128).to(torch.float8_e4m3fn)
        args = (q8, k8, v8, torch.tensor([0, 40, 100], dtype=torch.int32),
                torch.tensor([0, 300, 400], dtype=torch.int32),
                torch.arange(400, dtype=torch.int32), pap)
        if legacy:
            with pytest.raises(ValueError, match="block_size is 64"):
                ad.mla_prefill_ps(*args, max_seqlen_q=60, softmax_scale=SCALE)
        else:
            ad.mla_prefill_ps(*args, max_seqlen_q=60, softmax_scale=SCALE)
            name, a = fake_aiter[-2]
            assert name == "mla_prefill_ps_asm_fwd"
            assert a["splitData"].shape[0] == pap.reduce_partial_map.shape[0] * 256
