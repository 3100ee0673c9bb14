"""SGLang's forward modes by name (any release's numbering), IDLE, MIXED, and the plug-in:
construction from a ModelRunner stand-in with SGLang's attribute names, registry registration."""

from __future__ import annotations

import enum
import sys
import types

import numpy as np
import pytest
import torch

from funcmla.config import deepseek_v3_sm_scale
from funcmla.interop.sglang_backend import (
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    RadixAttention,
    register_with_sglang,
    resolve_mode,
)
from funcmla.interop.testing import random_paged_batch
from funcmla.interop.torch_native import torch_native_mla_extend

SCALE = deepseek_v3_sm_scale()
H = 16


class SGLangV04Mode(enum.IntEnum):
    """SGLang v0.4's numbering (PREFILL first): DECODE is 3 here, MIXED in the newer trees."""

    PREFILL = enum.auto()
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    DUMMY_FIRST = enum.auto()


class SGLangV05Mode(enum.IntEnum):
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()
    DUMMY_FIRST = enum.auto()


@pytest.mark.parametrize("mode, want", [
    (SGLangV04Mode.DECODE, "decode"), (SGLangV04Mode.MIXED, "extend"),
    (SGLangV04Mode.IDLE, "idle"), (SGLangV04Mode.EXTEND, "extend"),
    (SGLangV05Mode.TARGET_VERIFY, "target_verify"), (SGLangV05Mode.DRAFT_EXTEND, "extend"),
    (SGLangV05Mode.IDLE, "idle"), (ForwardMode.DRAFT_EXTEND_V2, "draft_extend"),
    (ForwardMode.MIXED, "extend"), ("decode", "decode"), ("target_verify", "target_verify"),
])
def test_modes_resolve_by_name_whatever_the_numbering(mode, want):
    assert resolve_mode(mode) == want


def test_stand_in_predicates_follow_sglangs_meaning():
    """The stand-in's predicates (what SGLang code calls on a ForwardMode) restated by hand from
    SGLang's: is_extend covers EXTEND, MIXED and DRAFT_EXTEND but not TARGET_VERIFY or
    DRAFT_EXTEND_V2 here (their own kinds); mode strings resolve by SGLang's upper-case names too."""
    want = {
        "EXTEND": dict(is_extend=True),
        "MIXED": dict(is_extend=True, is_mixed=True),
        "DRAFT_EXTEND": dict(is_extend=True),
        "DECODE": dict(is_decode=True, is_decode_or_idle=True),
        "IDLE": dict(is_idle=True, is_decode_or_idle=True),
        "TARGET_VERIFY": dict(is_target_verify=True),
        "DRAFT_EXTEND_V2": dict(is_draft_extend_v2=True),
    }
    preds = ("is_extend", "is_decode", "is_mixed", "is_idle", "is_decode_or_idle",
             "is_target_verify", "is_draft_extend_v2")
    for name, true in want.items():
        mode = ForwardMode[name]
        assert {p: getattr(mode, p)() for p in preds} == {p: true.get(p, False) for p in preds}
        assert resolve_mode(name) == resolve_mode(mode)
    with pytest.raises(ValueError, match="PREBUILT is not supported"):
        ForwardMode.PREBUILT.is_extend()


def test_same_number_different_mode():
    # the seed's bug: value 3 is DECODE in v0.4 and MIXED today; 4 is IDLE today
    assert int(SGLangV04Mode.DECODE) == int(ForwardMode.MIXED)
    assert resolve_mode(SGLangV04Mode.DECODE) != resolve_mode(ForwardMode.MIXED)
    assert resolve_mode(ForwardMode.IDLE) == "idle"
    assert resolve_mode(ForwardMode.TARGET_VERIFY) == "target_verify"


@pytest.mark.parametrize("mode, match", [
    (SGLangV04Mode.PREFILL, "PREFILL is not supported"),
    (SGLangV04Mode.DUMMY_FIRST, "DUMMY_FIRST is not supported"),
    (ForwardMode.DLLM_EXTEND, "DLLM_EXTEND is not supported"),
    (enum.Enum("Other", "SOMETHING").SOMETHING, "SOMETHING.*unknown"),
    (3, "forward_mode=3: pass SGLang's ForwardMode"),
])
def test_unknown_and_unsupported_modes_name_the_mode(mode, match):
    with pytest.raises(ValueError, match=match):
        resolve_mode(mode)


def _setup(seed, prefix, extend, page_size=16, **kw):
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, prefix_lens=prefix, extend_lens=extend, page_size=page_size,
                           max_context_len=320, pool_size=8, num_pages=4096 // page_size - 1)
    pool = MLATokenToKVPool(b.num_slots - page_size, page_size, torch.bfloat16, 1)
    pool.kv_buffer[0].copy_(torch.from_numpy(
        rng.standard_normal(pool.kv_buffer[0].shape).astype(np.float32)))
    be = FuncMLAAttnBackend(b.req_to_token, pool, page_size=page_size, num_heads=H,
                            attention_backend="reference", **kw)
    return rng, b, pool, be


def _fb(mode, b):
    return ForwardBatch(
        forward_mode=mode, batch_size=len(b.seq_lens), req_pool_indices=b.req_pool_indices,
        seq_lens=b.seq_lens, seq_lens_cpu=b.seq_lens, seq_lens_sum=int(b.seq_lens.sum()),
        out_cache_loc=b.out_cache_loc, extend_prefix_lens=b.extend_prefix_lens,
        extend_seq_lens=b.extend_seq_lens, extend_prefix_lens_cpu=b.extend_prefix_lens.tolist(),
        extend_seq_lens_cpu=b.extend_seq_lens.tolist())


def test_mixed_runs_the_extend_path_and_equals_torch_native():
    """MIXED (chunked prefill + decode requests, one query each) is an extend for attention."""
    rng, b, pool, be = _setup(5, [0, 40, 100, 7], [30, 1, 1, 12])
    q = torch.from_numpy(rng.standard_normal((int(b.extend_seq_lens.sum()), H, 576))
                         .astype(np.float32)).to(torch.bfloat16)
    layer = RadixAttention(H, SCALE)
    fb = _fb(SGLangV04Mode.MIXED, b)
    be.init_forward_metadata(fb)
    assert be.forward_metadata.qo_indptr.tolist() == [0, 30, 31, 32, 44]
    assert be.forward_metadata.fp8_prefill_kv_indices is not None  # the PS prefill plan
    out = be.forward(q, None, None, layer, fb, save_kv_cache=False)
    want = torch_native_mla_extend(q, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices,
                                   b.seq_lens, b.extend_prefix_lens, b.extend_seq_lens,
                                   sm_scale=SCALE, compute_dtype=torch.float32)
    err = (out.float().view_as(want) - want).abs().max() / want.abs().max()
    assert float(err) < 4e-3


def test_idle_is_an_empty_step():
    _, b, pool, be = _setup(6, [5], [1])
    e = torch.zeros(0, dtype=torch.int32)
    fb = ForwardBatch(ForwardMode.IDLE, 0, e, e, e, 0, out_cache_loc=e)
    be.init_forward_metadata(fb)
    fm = be.forward_metadata
    assert fm.kv_indptr.tolist() == [0] and fm.qo_indptr.tolist() == [0]
    assert fm.kv_indices.numel() == 0 and fm.kv_last_page_len.numel() == 0
    out = be.forward(torch.zeros(0, H * 576, dtype=torch.bfloat16), torch.zeros(0, 1, 576),
                     None, RadixAttention(H, SCALE), fb)
    assert out.shape == (0, H * 512) and out.dtype == torch.bfloat16


class _Namespace(types.SimpleNamespace):
    pass


def _model_runner(pool, req_to_token, *, tp=8, heads=128, page_size=16, mla=True):
    """A stand-in carrying SGLang's ModelRunner attribute names."""
    return _Namespace(
        use_mla_backend=mla, device="cpu", tp_size=tp, page_size=page_size,
        req_to_token_pool=_Namespace(req_to_token=req_to_token), token_to_kv_pool=pool,
        model_config=_Namespace(num_attention_heads=heads),
        server_args=_Namespace(page_size=page_size, speculative_num_draft_tokens=None,
                               enable_dp_attention=False, dp_size=1, attention_backend="funcmla"))


def test_from_model_runner_reads_sglangs_attributes():
    _, b, pool, _ = _setup(7, [5], [1])
    be = FuncMLAAttnBackend.from_model_runner(_model_runner(pool, b.req_to_token),
                                              attention_backend="reference")
    assert be.page_size == 16 and be.req_to_token is b.req_to_token
    assert be.token_to_kv_pool is pool and be.num_draft_tokens == 0
    assert be.plan.num_heads == 16  # 128 heads over attention TP 8
    with pytest.raises(ValueError, match="use_mla_backend is False"):
        FuncMLAAttnBackend.from_model_runner(_model_runner(pool, b.req_to_token, mla=False))


def test_register_without_sglang_is_a_clear_error():
    if "sglang" in sys.modules or __import__("importlib").util.find_spec("sglang"):
        pytest.skip("SGLang is importable here")
    with pytest.raises(ImportError, match="SGLang is not importable here"):
        register_with_sglang()


def test_register_into_sglangs_registry(monkeypatch):
    """Against a stand-in of SGLang's registry module (its API: ATTENTION_BACKENDS and the
    register_attention_backend(name) decorator)."""
    registry = types.ModuleType("sglang.srt.layers.attention.attention_registry")
    registry.ATTENTION_BACKENDS = {}

    def register_attention_backend(name):
        def decorator(fn):
            registry.ATTENTION_BACKENDS[name] = fn
            return fn
        return decorator

    registry.register_attention_backend = register_attention_backend
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ATTENTION_BACKEND_CHOICES = ["aiter", "triton"]
    names = ["sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["sglang.srt.layers.attention"].attention_registry = registry
    mods["sglang.srt"].server_args = server_args
    for n, m in {**mods, registry.__name__: registry, server_args.__name__: server_args}.items():
        monkeypatch.setitem(sys.modules, n, m)
    register_with_sglang(attention_backend="reference")
    assert "funcmla" in server_args.ATTENTION_BACKEND_CHOICES
    _, b, pool, _ = _setup(8, [5], [1])
    be = registry.ATTENTION_BACKENDS["funcmla"](_model_runner(pool, b.req_to_token))
    assert isinstance(be, FuncMLAAttnBackend) and be.attention_backend == "reference"


def test_aiter_path_gets_the_metadata_work_plan(monkeypatch):
    """With the aiter backend, decode hands AITER the persistent plan of forward_metadata
    (same tensors, AiterWorkPlan's contract) and num_kv_splits = max_split_per_batch."""
    from funcmla.interop import aiter_dispatch, backend_select

    seen = {}

    def fake_decode(q, kv_pool, meta, plan, *, num_kv_splits, v_head_dim, **kw):
        aiter_dispatch._check_plan(plan, kind="decode", device=q.device)
        seen.update(plan=plan, splits=num_kv_splits, meta=meta)
        return q.new_zeros(q.shape[0], q.shape[1], v_head_dim), None

    monkeypatch.setitem(backend_select._REASONS, "aiter", lambda: None)
    monkeypatch.setattr(aiter_dispatch, "mla_decode", fake_decode)
    _, b, pool, _ = _setup(9, [30, 7, 50], [1, 1, 1])
    be = FuncMLAAttnBackend(b.req_to_token, pool, page_size=16, num_heads=H,
                            attention_backend="aiter")
    fb = _fb(ForwardMode.DECODE, b)
    be.init_forward_metadata(fb)
    be.forward(torch.zeros(3, H * 576, dtype=torch.bfloat16), None, None,
               RadixAttention(H, SCALE), fb, save_kv_cache=False)
    fm, plan = be.forward_metadata, seen["plan"]
    assert seen["meta"] is fm and seen["splits"] == 64
    assert plan.work_info_set is fm.work_info_set and plan.work_meta_data is fm.work_metadata
