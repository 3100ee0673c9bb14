"""The SGLang-compatible backend: funcmla metadata + attention == SGLang's torch-native algorithm.

Random paged batches at page sizes 1, 16 and 64 (decode, extend with prefixes, target verify,
draft extend), bf16 inputs, compared in float32. CUDA-graph capture / replay of the metadata path
into static buffers (addresses fixed, values new), and the overflow check on replay.
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from funcmla.config import deepseek_v3_sm_scale
from funcmla.interop import backend_select, dlpack
from funcmla.interop.sglang import backend as sbk
from funcmla.interop.backend_select import mla_attention, select_backend
from funcmla.interop.sglang_backend import (
    CudaGraphBufferOverflow,
    ForwardBatch,
    ForwardMetadata,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    RadixAttention,
    SpecInfo,
)
from funcmla.interop.testing import random_paged_batch
from funcmla.interop.torch_csr import csr_mla_attention_dense
from funcmla.interop.torch_native import torch_native_mla_decode, torch_native_mla_extend

SCALE = deepseek_v3_sm_scale()
H = 16
MAX_CTX = 320
ON_GPU = jax.devices()[0].platform == "gpu" and torch.cuda.is_available()
ERRORS: dict[str, float] = {}  # max relative errors, printed at the end of the module


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _setup(seed, prefix, extend, page_size, *, layers=1, device="cpu", **kw):
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, prefix_lens=prefix, extend_lens=extend, page_size=page_size,
                           max_context_len=MAX_CTX, pool_size=8,
                           num_pages=4096 // page_size - 1)  # 4096 slots at every page size
    pool = MLATokenToKVPool(b.num_slots - page_size, page_size, torch.bfloat16, layers,
                            device=device)
    for buf in pool.kv_buffer:
        buf.copy_(torch.from_numpy(rng.standard_normal(buf.shape).astype(np.float32)))
    backend = FuncMLAAttnBackend(b.req_to_token.to(device), pool, page_size=page_size, **kw)
    return rng, b, pool, backend


def _fb(mode, b, extend, device="cpu", spec=None):
    d = lambda t: t.to(device)  # noqa: E731
    return ForwardBatch(
        forward_mode=mode, batch_size=len(extend), req_pool_indices=d(b.req_pool_indices),
        seq_lens=d(b.seq_lens), seq_lens_cpu=b.seq_lens, seq_lens_sum=int(b.seq_lens.sum()),
        out_cache_loc=d(b.out_cache_loc), extend_prefix_lens=d(b.extend_prefix_lens),
        extend_seq_lens=d(b.extend_seq_lens), extend_prefix_lens_cpu=b.extend_prefix_lens.tolist(),
        extend_seq_lens_cpu=b.extend_seq_lens.tolist(), spec_info=spec,
    )


BATCHES = {
    "decode": ([37, 0, 140, 9], [1, 1, 1, 1]),
    "extend": ([0, 23, 64, 5], [17, 1, 40, 30]),
}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("kind", ["decode", "extend"])
def test_backend_equals_torch_native(kind, page_size):
    prefix, extend = BATCHES[kind]
    rng, b, pool, backend = _setup(page_size, prefix, extend, page_size,
                                   attention_backend="reference")
    layer = RadixAttention(tp_q_head_num=H, scaling=SCALE)
    T = sum(extend)
    q = torch.from_numpy(rng.standard_normal((T, H * 576)).astype(np.float32)).bfloat16()
    k = torch.from_numpy(rng.standard_normal((T, 1, 576)).astype(np.float32)).bfloat16()
    mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
    fb = _fb(mode, b, extend)
    backend.init_forward_metadata(fb)
    fwd = backend.forward_decode if kind == "decode" else backend.forward_extend
    out = fwd(q, k, None, layer, fb)
    assert backend.last_backend == "reference"
    assert out.shape == (T, H * 512) and out.dtype == torch.bfloat16
    # the new tokens were written at out_cache_loc before attention
    assert torch.equal(pool.kv_buffer[0][b.out_cache_loc.long()], k)
    q3 = q.view(T, H, 576)
    args = (q3, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices, b.seq_lens)
    if kind == "decode":
        want = torch_native_mla_decode(*args, sm_scale=SCALE, compute_dtype=torch.float32)
        sglang_bf16 = torch_native_mla_decode(*args, sm_scale=SCALE)
    else:
        more = (b.extend_prefix_lens, b.extend_seq_lens)
        want = torch_native_mla_extend(*args, *more, sm_scale=SCALE, compute_dtype=torch.float32)
        sglang_bf16 = torch_native_mla_extend(*args, *more, sm_scale=SCALE)
    # float32 all the way (same bf16 inputs): only summation order differs
    res = mla_attention(q3.float(), pool.kv_buffer[0].float(), backend._jax_meta, sm_scale=SCALE,
                        backend="reference")
    e32 = rel_err(res.out, want)
    # the backend's bf16 output, and SGLang's own bf16 SDPA, against the float32 reference
    e_out = rel_err(out.view(T, H, 512), want)
    e_sgl = rel_err(sglang_bf16, want)
    ERRORS[f"{kind} ps={page_size}"] = (e32, e_out, e_sgl)
    assert e32 < 1e-5
    assert e_out < 4e-3  # one bf16 rounding of the output (2**-8 relative)
    assert e_sgl < 3e-2


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_speculative_modes_equal_torch_native_extend(mode):
    n = 3
    prefix = [40, 7, 90]
    rng, b, pool, backend = _setup(7, prefix, [n] * 3, 16, attention_backend="reference")
    layer = RadixAttention(tp_q_head_num=H, scaling=SCALE)
    q = torch.from_numpy(rng.standard_normal((3 * n, H, 576)).astype(np.float32)).bfloat16()
    fb = _fb(mode, b, [n] * 3, spec=SpecInfo(draft_token_num=n))
    if mode == ForwardMode.TARGET_VERIFY:  # seq_lens counts the tokens before the drafts
        fb = dataclasses.replace(fb, seq_lens=b.seq_lens - n, seq_lens_cpu=b.seq_lens - n,
                                 seq_lens_sum=int(b.seq_lens.sum()) - 3 * n)
    backend.init_forward_metadata(fb)
    fm = backend.forward_metadata
    assert fm.max_q_len == n and fm.qo_indptr.tolist() == [0, n, 2 * n, 3 * n]
    assert fm.kv_indptr.tolist() == [0] + np.cumsum(b.seq_lens.tolist()).tolist()
    verify = mode == ForwardMode.TARGET_VERIFY
    assert fm.max_kv_len == (None if verify else max(b.seq_lens.tolist()))
    out = backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    want = torch_native_mla_extend(q, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices,
                                   b.seq_lens, b.extend_prefix_lens, b.extend_seq_lens,
                                   sm_scale=SCALE, compute_dtype=torch.float32)
    assert rel_err(out.view(3 * n, H, 512), want) < 4e-3


def test_forward_metadata_has_sglangs_fields_in_order():
    assert [f.name for f in dataclasses.fields(ForwardMetadata)] == [
        "kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len", "max_q_len", "max_kv_len",
        "work_metadata", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "num_kv_splits", "run_graph", "custom_mask", "mask_indptr",
        "max_extend_len", "fp8_prefill_kv_indices", "swa_page_table", "swa_out_cache_loc",
    ]


def test_eager_metadata_values_sizes_and_one_crossing_each_way(monkeypatch):
    prefix, extend = [0, 23, 64, 5], [17, 1, 40, 30]
    _, b, _, backend = _setup(11, prefix, extend, 16, attention_backend="reference")
    counts = {"to_jax": 0, "to_torch": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(sbk, "to_jax", counting("to_jax", sbk.to_jax))
    monkeypatch.setattr(sbk, "to_torch", counting("to_torch", sbk.to_torch))
    backend.init_forward_metadata(_fb(ForwardMode.EXTEND, b, extend))
    assert counts == {"to_jax": 1, "to_torch": 1}  # one packed import, one packed export
    fm = backend.forward_metadata
    seq = b.seq_lens.tolist()
    assert fm.kv_indptr.tolist() == [0] + np.cumsum(seq).tolist()
    assert fm.qo_indptr.tolist() == [0] + np.cumsum(extend).tolist()
    want = torch.cat([b.req_to_token[r, :s] for r, s in zip(b.req_pool_indices.tolist(), seq)])
    assert torch.equal(fm.kv_indices, want)  # exactly seq_lens_sum token slots, as SGLang
    assert fm.kv_last_page_len.tolist() == [1] * 4
    assert (fm.max_q_len, fm.max_kv_len, fm.run_graph) == (40, 104, False)
    bases = {t.untyped_storage().data_ptr() for t in
             (fm.kv_indptr, fm.kv_indices, fm.qo_indptr, fm.kv_last_page_len)}
    assert len(bases) == 1  # all views of the one packed buffer


def test_long_lived_buffers_cross_once(monkeypatch):
    rng, b, pool, backend = _setup(12, [5, 9], [1, 1], 16, layers=2,
                                   attention_backend="reference")
    imported = []

    def recording(t, **k):
        imported.append(tuple(t.shape))
        return dlpack.to_jax(t, **k)

    monkeypatch.setattr(sbk, "to_jax", recording)
    monkeypatch.setattr(backend_select, "to_jax", recording)
    q = torch.zeros(2, H, 576, dtype=torch.bfloat16)
    for _ in range(3):
        fb = _fb(ForwardMode.DECODE, b, [1, 1])
        backend.init_forward_metadata(fb)
        for layer_id in (0, 1):
            backend.forward_decode(q, None, None, RadixAttention(H, SCALE, layer_id=layer_id), fb,
                                   save_kv_cache=False)
    pool_shape = tuple(pool.kv_buffer[0].shape)
    assert imported.count(pool_shape) == 2  # each layer's KV buffer: once, not per step
    assert imported.count((5,)) == 3  # the packed step inputs (2 x 2 + the live count): once a step
    # q is imported once per layer call (the ordering fence for the KV writes)
    assert imported.count((2, H, 576)) == 6


def _graph_backend(page_size=16, legacy=False, max_bs=4):
    rng, b, pool, backend = _setup(13, [30, 7, 90, 12], [1, 1, 1, 1], page_size,
                                   attention_backend="reference",
                                   legacy_block_granular_kv_indices=legacy)
    backend.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_bs)
    return rng, b, pool, backend


def _decode_consumer(backend, q, pool, bs):
    """What a captured kernel does: read the static views (the same addresses every replay)."""
    fm = backend.forward_metadata
    return csr_mla_attention_dense(q, pool.kv_buffer[0], fm.qo_indptr, fm.kv_indptr,
                                   fm.kv_indices, sm_scale=SCALE)


def test_cuda_graph_capture_then_replay_new_lengths_into_the_same_buffers():
    rng, b, pool, backend = _graph_backend()
    cap = backend.buffer_plan.kv_indices_capacity
    assert cap == 4 * 320  # token-granular: max_bs * ceil(max_ctx / page_size) * page_size
    for bs in (4, 2):
        backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None)
    fm4 = backend._graph_meta[("decode", 4)]
    ptrs = [t.data_ptr() for t in (fm4.kv_indptr, fm4.kv_indices, fm4.qo_indptr,
                                   fm4.kv_last_page_len)]
    assert fm4.kv_indices.shape == (cap,) and fm4.run_graph
    q = torch.from_numpy(rng.standard_normal((4, H, 576)).astype(np.float32)).bfloat16().float()
    for step, lens in enumerate([[31, 8, 91, 13], [200, 1, 5, 77], [320, 320, 320, 320],
                                 [2, 3]]):
        bs = len(lens)
        seq = torch.tensor(lens, dtype=torch.int32)
        backend.init_forward_metadata_replay_cuda_graph(
            bs, b.req_pool_indices, seq, int(seq.sum()), None, ForwardMode.DECODE, None, seq)
        fm = backend.forward_metadata
        assert fm is backend._graph_meta[("decode", bs)]
        if bs == 4:
            assert [t.data_ptr() for t in (fm.kv_indptr, fm.kv_indices, fm.qo_indptr,
                                           fm.kv_last_page_len)] == ptrs
        assert fm.kv_indptr.tolist() == [0] + np.cumsum(lens).tolist()
        assert fm.max_kv_len == max(lens)
        # req_to_token rows are random slots past the live lengths of the batch: fine here,
        # the consumer only needs valid rows
        got = _decode_consumer(backend, q[:bs], pool, bs)
        want = torch_native_mla_decode(q[:bs], pool.kv_buffer[0], b.req_to_token,
                                       b.req_pool_indices[:bs], seq, sm_scale=SCALE,
                                       compute_dtype=torch.float32)
        assert rel_err(got, want) < 5e-5, step  # float32, different summation order
        # the JAX path after replay reads the same metadata
        out = backend.forward_decode(q[:bs].bfloat16(), None, None, RadixAttention(H, SCALE),
                                     None, save_kv_cache=False)
        assert rel_err(out.view(bs, H, 512), want) < 4e-3


def test_replay_overflow_is_detected_before_any_write():
    rng, b, pool, backend = _graph_backend()
    backend.init_forward_metadata_capture_cuda_graph(
        4, 4, b.req_pool_indices, b.seq_lens, None, ForwardMode.DECODE, None)
    before = backend._graph_buffer.clone()
    too_long = torch.tensor([321, 1, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[0\] = 321 exceeds max_context_len = 320"):
        backend.init_forward_metadata_replay_cuda_graph(
            4, b.req_pool_indices, too_long, 324, None, ForwardMode.DECODE, None, too_long)
    with pytest.raises(CudaGraphBufferOverflow, match="bs = 5 exceeds the captured max_bs = 4"):
        backend.init_forward_metadata_replay_cuda_graph(
            5, b.req_pool_indices, too_long, 0, None, ForwardMode.DECODE, None, too_long)
    short = torch.tensor([5, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="no CUDA graph was captured for mode 'decode' at bs = 3"):
        backend.init_forward_metadata_replay_cuda_graph(
            3, b.req_pool_indices, short, 7, None, ForwardMode.DECODE, None, short)
    assert torch.equal(backend._graph_buffer, before)


def test_seed_block_granular_buffer_overflow_is_reported_not_written():
    """The seed's second bug: kv_indices sized in blocks (max_bs * ceil(ctx / page_size)) while the
    writer writes tokens. funcmla's replay refuses the batch with a clear error."""
    rng, b, pool, backend = _graph_backend(page_size=64, legacy=True)
    cap = backend.buffer_plan.kv_indices_capacity
    assert cap == 4 * 5  # 4 requests * ceil(320 / 64) blocks: far too small for tokens
    small = torch.tensor([2, 3, 4, 5], dtype=torch.int32)  # 14 tokens fit in 20 entries
    backend.init_forward_metadata_capture_cuda_graph(
        4, 4, b.req_pool_indices, small, None, ForwardMode.DECODE, None)
    before = backend._graph_buffer.clone()
    seq = torch.tensor([30, 7, 90, 12], dtype=torch.int32)
    with pytest.raises(CudaGraphBufferOverflow,
                       match=r"needs 139 kv_indices entries \(token slots\) but the captured "
                             r"buffer holds 20 \(blocks: the legacy block-granular sizing"):
        backend.init_forward_metadata_replay_cuda_graph(
            4, b.req_pool_indices, seq, 139, None, ForwardMode.DECODE, None, seq)
    assert torch.equal(backend._graph_buffer, before)
    # the token-granular plan takes the same batch
    _, _, _, ok = _graph_backend(page_size=64)
    ok.init_forward_metadata_capture_cuda_graph(4, 4, b.req_pool_indices, small, None,
                                                ForwardMode.DECODE, None)
    ok.init_forward_metadata_replay_cuda_graph(4, b.req_pool_indices, seq, 139, None,
                                               ForwardMode.DECODE, None, seq)
    assert ok.forward_metadata.kv_indptr[-1].item() == 139


def test_target_verify_capture_has_draft_slack():
    n = 2
    rng, b, pool, backend = _setup(14, [30, 7], [1, 1], 16, attention_backend="reference",
                                   num_draft_tokens=n)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2 * n)
    assert backend.buffer_plan.kv_indices_capacity == 2 * (320 + n)
    spec = SpecInfo(draft_token_num=n)
    backend.init_forward_metadata_capture_cuda_graph(2, 2 * n, b.req_pool_indices, b.seq_lens,
                                                     None, ForwardMode.TARGET_VERIFY, spec)
    full = torch.tensor([320 - n, 320 - n], dtype=torch.int32)  # full rows + drafts fit
    backend.init_forward_metadata_replay_cuda_graph(2, b.req_pool_indices, full, 636, None,
                                                    ForwardMode.TARGET_VERIFY, spec, full)
    fm = backend.forward_metadata
    assert fm.kv_indptr.tolist() == [0, 320, 640] and fm.qo_indptr.tolist() == [0, n, 2 * n]
    over = torch.tensor([320 - n + 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[0\] = 319 \+ 2 draft tokens exceeds "
                                         r"max_context_len = 320"):
        backend.init_forward_metadata_replay_cuda_graph(2, b.req_pool_indices, over, 320, None,
                                                        ForwardMode.TARGET_VERIFY, spec, over)


def test_backend_selection_on_this_machine():
    if ON_GPU:
        assert select_backend() in ("pallas", "reference")
        return
    assert select_backend() == "reference"
    with pytest.raises(RuntimeError, match="'pallas' was requested but cannot run: JAX's default"
                                           " device is 'cpu'"):
        select_backend("pallas")
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        select_backend("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs torch CUDA + JAX CUDA")
def test_torch_cuda_graph_replays_metadata_of_new_lengths():
    rng, b, pool, backend = _setup(15, [30, 7, 90, 12], [1, 1, 1, 1], 16, device="cuda",
                                   attention_backend="reference")
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(
        4, 4, b.req_pool_indices.cuda(), b.seq_lens.cuda(), None, ForwardMode.DECODE, None)
    q = torch.randn(4, H, 576, device="cuda")
    static_out = torch.empty(4, H, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static_out.copy_(_decode_consumer(backend, q, pool, 4))  # warm up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(_decode_consumer(backend, q, pool, 4))
    for lens in ([31, 8, 91, 13], [200, 1, 5, 77], [320, 2, 320, 9]):
        seq = torch.tensor(lens, dtype=torch.int32)
        backend.init_forward_metadata_replay_cuda_graph(
            4, b.req_pool_indices.cuda(), seq.cuda(), int(seq.sum()), None, ForwardMode.DECODE,
            None, seq)
        graph.replay()
        want = torch_native_mla_decode(q, pool.kv_buffer[0], b.req_to_token.cuda(),
                                       b.req_pool_indices.cuda(), seq.cuda(), sm_scale=SCALE,
                                       compute_dtype=torch.float32)
        assert rel_err(static_out, want) < 1e-4


def teardown_module(module):
    if ERRORS:
        print("\nmax relative error vs torch-native float32 (funcmla f32, backend bf16 out, "
              "SGLang bf16 SDPA):")
        for k, (a, b, c) in ERRORS.items():
            print(f"  {k:16s} {a:.2e}  {b:.2e}  {c:.2e}")


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_pool_imported_once_stays_live_across_steps(kv_dtype):
    """The pool crosses DLPack once; later torch writes (new tokens) must be seen, also for an
    fp8 pool, which travels as uint8 and is bitcast inside jit (not an eager snapshot)."""
    rng = np.random.default_rng(16)
    b = random_paged_batch(rng, prefix_lens=[20, 50], extend_lens=[2, 2], page_size=16,
                           max_context_len=MAX_CTX, pool_size=8, num_pages=4096 // 16 - 1)
    pool = MLATokenToKVPool(b.num_slots - 16, 16, kv_dtype, 1)
    vals = torch.from_numpy(rng.standard_normal(pool.kv_buffer[0].shape).astype(np.float32))
    pool.set_kv_buffer(RadixAttention(H, SCALE), torch.arange(vals.shape[0]), vals)
    backend = FuncMLAAttnBackend(b.req_to_token, pool, page_size=16,
                                 attention_backend="reference")
    layer = RadixAttention(tp_q_head_num=H, scaling=SCALE)
    slots = b.out_cache_loc.view(2, 2)
    for step in range(2):  # decode the two new tokens of each request, one per step
        seq = b.seq_lens - 1 + step
        fb = ForwardBatch(ForwardMode.DECODE, 2, b.req_pool_indices, seq, seq, int(seq.sum()),
                          out_cache_loc=slots[:, step].contiguous())
        backend.init_forward_metadata(fb)
        q = torch.from_numpy(rng.standard_normal((2, H, 576)).astype(np.float32)).bfloat16()
        k = torch.from_numpy(rng.standard_normal((2, 1, 576)).astype(np.float32) * 3)
        out = backend.forward_decode(q, k.bfloat16(), None, layer, fb)
        want = torch_native_mla_decode(q, pool.get_key_buffer(0), b.req_to_token,
                                       b.req_pool_indices, seq, sm_scale=SCALE,
                                       compute_dtype=torch.float32)
        assert rel_err(out.view(2, H, 512), want) < 4e-3, step
    assert len(backend._kv_jax) == 1


@pytest.mark.parametrize("batch", [4, 3])  # 3: metadata padded to the batch bucket 4
def test_pallas_backend_wiring_in_interpret_mode(monkeypatch, batch):
    """The pallas path as the backend calls it (kernels in Pallas interpret mode on CPU): decode
    runs the decode kernel, the same step as an extend runs `mla_extend`, no fallback."""
    import functools

    from funcmla.attention.pallas import mla_decode, mla_extend

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    monkeypatch.setattr(backend_select, "_pallas_decode",
                        lambda: functools.partial(mla_decode, interpret=True))
    monkeypatch.setattr(backend_select, "_pallas_extend",
                        lambda: functools.partial(mla_extend, interpret=True))
    assert select_backend() == "pallas"
    prefix, extend = [37, 0, 140, 9][:batch], [1, 1, 1, 1][:batch]
    rng, b, pool, backend = _setup(17, prefix, extend, 16, attention_backend="auto")
    assert backend.attention_backend == "pallas"
    q = torch.from_numpy(rng.standard_normal((batch, H, 576)).astype(np.float32)).bfloat16()
    fb = _fb(ForwardMode.DECODE, b, extend)
    backend.init_forward_metadata(fb)
    out = backend.forward_decode(q, None, None, RadixAttention(H, SCALE), fb, save_kv_cache=False)
    assert backend.last_backend == "pallas"
    want = torch_native_mla_decode(q, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices,
                                   b.seq_lens, sm_scale=SCALE, compute_dtype=torch.float32)
    assert rel_err(out.view(batch, H, 512), want) < 8e-3
    res = mla_attention(q, pool.kv_buffer[0], dataclasses.replace(backend._jax_meta,
                                                                  mode="extend"),
                        sm_scale=SCALE, backend="pallas")
    assert res.backend == "pallas" and res.fallback_reason is None
    assert rel_err(res.out.view(batch, H, 512), want) < 8e-3


def _stand_in_launcher(builds: list, calls: list):
    """A stand-in for `launcher.torch_decode_launcher`: records each build (q shape, capacity,
    s_q, max_kv_len) and each call (pool, kv_indptr, kv_indices, s_q, max_kv_len, k_scale), and
    computes the decode with the dense torch restatement (an fp8 pool dequantized by k_scale);
    the lse it is handed must be the backend's [T, H] scratch."""
    def build(q, kv_pool, kv_indptr, kv_indices, *, sm_scale, s_q, max_kv_len, v_head_dim):
        builds.append((tuple(q.shape), tuple(kv_indices.shape), s_q, max_kv_len))

        t, h, d = built = tuple(q.shape)

        def run(q, kv_pool, kv_indptr, kv_indices, out=None, lse=None, k_scale=None):
            # the launcher's contract: q and out as [T, H, D] or [T, H * D], out written
            calls.append((kv_pool, kv_indptr, kv_indices, s_q, max_kv_len, k_scale))
            assert tuple(q.shape) in (built, (t, h * d)) and q.is_contiguous()
            assert lse is not None and lse.shape == (t, h)
            assert out is not None and tuple(out.shape) in ((t, h, v_head_dim),
                                                            (t, h * v_head_dim))
            kv = kv_pool if k_scale is None else kv_pool.float() * k_scale
            got = csr_mla_attention_dense(q.view(t, h, d).to(kv.dtype), kv,
                                          torch.arange(t + 1, dtype=torch.int32),
                                          kv_indptr, kv_indices, sm_scale=sm_scale)
            out.copy_(got.to(out.dtype).view(out.shape))
            return out, lse
        return run
    return build


def test_torch_launcher_path_gets_static_capacity_inputs(monkeypatch):
    """With torch_launcher=True and pallas selected, the backend hands the launcher torch
    tensors: the pool, kv_indptr and kv_indices at the bucketed capacity (a stable shape, so one
    compiled launcher serves many steps); the launcher is resolved once per (step shapes, layer
    shapes) and every layer launches it; where the launcher cannot run, the DLPack path runs
    and says why."""
    from funcmla.interop import launcher

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    builds, calls = [], []
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(launcher, "torch_decode_launcher", _stand_in_launcher(builds, calls))
    rng, b, pool, backend = _setup(18, [37, 0, 140, 9], [1, 1, 1, 1], 16, layers=3,
                                   attention_backend="pallas", torch_launcher=True)
    q = torch.from_numpy(rng.standard_normal((4, H, 576)).astype(np.float32)).bfloat16()
    for step in range(2):
        seq = b.seq_lens + step
        fb = ForwardBatch(ForwardMode.DECODE, 4, b.req_pool_indices, seq, seq, int(seq.sum()))
        backend.init_forward_metadata(fb)
        want = torch_native_mla_decode(q, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices,
                                       seq, sm_scale=SCALE, compute_dtype=torch.float32)
        for layer_id in range(3):
            out = backend.forward_decode(q, None, None, RadixAttention(H, SCALE, layer_id), fb,
                                         save_kv_cache=False)
            assert (backend.last_backend, backend.last_via) == ("pallas", "launcher")
            kv_pool, kv_indptr, kv_indices, s_q, _, k_scale = calls[-1]
            assert k_scale is None  # a bf16 pool takes no scale
            assert kv_pool.data_ptr() == pool.kv_buffer[layer_id].data_ptr() and s_q == 1
            assert kv_indices.shape == (256,)  # the capacity bucket, not this step's tokens
            assert kv_indices.data_ptr() == backend.forward_metadata.kv_indices.data_ptr()
            assert kv_indptr is backend._kv_indptr_full  # batch 4 is its own bucket
            assert torch.equal(kv_indptr, backend.forward_metadata.kv_indptr)
            if layer_id == 0:
                assert rel_err(out.view(4, H, 512), want) < 4e-3
    assert len(calls) == 6
    assert len(builds) == len(set(builds))  # one build per distinct launcher configuration
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason",
                        lambda *a: "q is on cpu, not a CUDA device")
    monkeypatch.setattr(backend_select, "_pallas_decode", lambda: __import__(
        "functools").partial(__import__("funcmla.attention.pallas", fromlist=["x"]).mla_decode,
                             interpret=True))
    res = mla_attention(q, backend._kv_pool_jax(0)[0], backend._jax_meta, sm_scale=SCALE,
                        backend="pallas", use_launcher=True,
                        launcher_inputs=(pool.kv_buffer[0], backend.forward_metadata.kv_indptr,
                                         backend._kv_indices_full))
    assert res.via == "jax" and res.launcher_reason == "q is on cpu, not a CUDA device"
    assert len(calls) == 6


def test_eager_decode_of_new_batch_sizes_shares_the_bucket_launcher(monkeypatch):
    """Eager decode steps of 5, 7 and 6 requests (one batch bucket, 8; one KV bucket) run one
    launcher built for the bucket: q copied into the bucket's rows, kv_indptr over the bucket
    (the padded requests empty), out cut to the live rows, each equal to SGLang's torch-native
    decode."""
    from funcmla.interop import launcher

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    builds, calls = [], []
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(launcher, "torch_decode_launcher", _stand_in_launcher(builds, calls))
    rng, b, pool, backend = _setup(23, [37, 0, 40, 9, 60, 3, 20], [1] * 7, 16,
                                   attention_backend="pallas", torch_launcher=True)
    layer = RadixAttention(H, SCALE, 0)
    for n in (5, 7, 6):
        rpi, seq = b.req_pool_indices[:n], b.seq_lens[:n]
        fb = ForwardBatch(ForwardMode.DECODE, n, rpi, seq, seq, int(seq.sum()))
        backend.init_forward_metadata(fb)
        q = torch.from_numpy(rng.standard_normal((n, H * 576)).astype(np.float32)).bfloat16()
        out = backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
        assert (backend.last_backend, backend.last_via) == ("pallas", "launcher")
        assert out.shape == (n, H * 512)
        kv_indptr = calls[-1][1]
        assert kv_indptr.shape == (9,) and int(kv_indptr[n]) == int(kv_indptr[8])
        want = torch_native_mla_decode(q.view(n, H, 576), pool.kv_buffer[0], b.req_to_token,
                                       rpi, seq, sm_scale=SCALE, compute_dtype=torch.float32)
        assert rel_err(out.view(n, H, 512), want) < 4e-3
    assert len(builds) == 1 and builds[0][:3] == ((8, H, 576), (256,), 1)  # one KV bucket too


def test_layer_launch_is_resolved_once_per_step_key_and_layer(monkeypatch):
    """Each layer resolves its launch once per step key (s_q, the kv_indptr / kv_indices views,
    the kv bound); later calls launch directly (q as [T, H * 576] or [T, H, 576], out
    [T, H * 512] either way, written by the launcher), in this step and in later steps whose
    metadata keeps those views (as the launched metadata does per bucket and batch). New views
    (the eager metadata makes them each step), another layer object with the same id, or
    torch_launcher turned off do not reuse it."""
    from funcmla.interop import launcher

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    builds, calls = [], []
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(launcher, "torch_decode_launcher", _stand_in_launcher(builds, calls))
    monkeypatch.setattr(backend_select, "_pallas_decode", lambda: __import__(
        "functools").partial(__import__("funcmla.attention.pallas", fromlist=["x"]).mla_decode,
                             interpret=True))
    rng, b, pool, backend = _setup(21, [37, 0, 140, 9], [1, 1, 1, 1], 16, layers=2,
                                   attention_backend="pallas", torch_launcher=True)
    resolved = []
    from funcmla.interop.sglang import backend as backend_module

    real = backend_module.layer_launch
    monkeypatch.setattr(backend_module, "layer_launch", lambda be, q, layer, step: resolved.append(
        layer.layer_id) or real(be, q, layer, step))
    q = torch.from_numpy(rng.standard_normal((4, H, 576)).astype(np.float32)).bfloat16()
    layers = [RadixAttention(H, SCALE, layer_id) for layer_id in range(2)]
    fb = _fb(ForwardMode.DECODE, b, [1, 1, 1, 1])
    want = [torch_native_mla_decode(q, pool.kv_buffer[i], b.req_to_token, b.req_pool_indices,
                                    b.seq_lens, sm_scale=SCALE, compute_dtype=torch.float32)
            for i in range(2)]
    for step in range(2):
        backend.init_forward_metadata(fb)
        for qq in (q.view(4, H * 576), q, q.view(4, H * 576)):
            for i, layer in enumerate(layers):
                out = backend.forward_decode(qq, None, None, layer, fb, save_kv_cache=False)
                assert out.shape == (4, H * 512) and out.dtype == q.dtype
                assert (backend.last_backend, backend.last_via) == ("pallas", "launcher")
                assert calls[-1][0].data_ptr() == pool.kv_buffer[i].data_ptr()
                assert rel_err(out.view(4, H, 512), want[i]) < 4e-3
        assert resolved == [0, 1] * (step + 1), resolved  # new views each eager step
    assert len(calls) == 12 and len(builds) == 1  # one launcher for both layers' shapes
    backend.forward_metadata = backend.forward_metadata  # a step that keeps the views
    for layer in layers:
        backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    assert len(resolved) == 4 and len(calls) == 14  # the same step key: no resolve
    twin = RadixAttention(H, SCALE, 0)  # same id, another layer object: resolved for itself
    backend.forward_decode(q, None, None, twin, fb, save_kv_cache=False)
    assert resolved[-1] == 0 and len(resolved) == 5
    backend.torch_launcher = False  # read on every call
    out = backend.forward_decode(q, None, None, layers[1], fb, save_kv_cache=False)
    assert backend.last_via == "jax" and len(calls) == 15
    assert rel_err(out.view(4, H, 512), want[1]) < 8e-3


def test_refused_decode_launcher_falls_back_to_mla_attention(monkeypatch):
    """A launcher the backend cannot build (LauncherUnavailable) is remembered as refused for
    those shapes, and each call then runs `mla_attention`, which records why."""
    from funcmla.interop import launcher

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason", lambda *a: None)
    builds = []

    def refuse(*a, **k):
        builds.append(1)
        raise launcher.LauncherUnavailable("no Mosaic GPU compiler here")

    monkeypatch.setattr(launcher, "torch_decode_launcher", refuse)
    monkeypatch.setattr(launcher, "torch_decode", refuse)
    monkeypatch.setattr(backend_select, "_pallas_decode", lambda: __import__(
        "functools").partial(__import__("funcmla.attention.pallas", fromlist=["x"]).mla_decode,
                             interpret=True))
    rng, b, pool, backend = _setup(19, [37, 0, 140, 9], [1, 1, 1, 1], 16,
                                   attention_backend="pallas", torch_launcher=True)
    q = torch.from_numpy(rng.standard_normal((4, H, 576)).astype(np.float32)).bfloat16()
    fb = _fb(ForwardMode.DECODE, b, [1, 1, 1, 1])
    backend.init_forward_metadata(fb)
    want = torch_native_mla_decode(q, pool.kv_buffer[0], b.req_to_token, b.req_pool_indices,
                                   b.seq_lens, sm_scale=SCALE, compute_dtype=torch.float32)
    for _ in range(2):
        out = backend.forward_decode(q, None, None, RadixAttention(H, SCALE), fb,
                                     save_kv_cache=False)
        assert (backend.last_backend, backend.last_via) == ("pallas", "jax")
        assert rel_err(out.view(4, H, 512), want) < 8e-3
    assert False in backend._decode_launchers.values()
    assert len(builds) == 3  # the backend's resolve once, then mla_attention's try per call


def test_torch_launcher_path_takes_fp8_pools_with_the_layer_scale(monkeypatch):
    """An fp8 pool (stored as uint8, read as float8_e4m3fn) reaches the launcher too: the
    backend hands it the pool's fp8 view and the layer's k_scale (a float, or a host tensor
    read as a float; a device tensor would be passed as it is), and the output equals SGLang's
    algorithm over the dequantized pool."""
    from funcmla.interop import launcher

    monkeypatch.setitem(backend_select._REASONS, "pallas", lambda: None)
    calls = []
    monkeypatch.setattr(launcher, "torch_decode_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(launcher, "torch_decode_launcher", _stand_in_launcher([], calls))
    rng = np.random.default_rng(19)
    b = random_paged_batch(rng, prefix_lens=[37, 0, 140, 9], extend_lens=[1, 1, 1, 1],
                           page_size=16, max_context_len=MAX_CTX, pool_size=8, num_pages=255)
    pool = MLATokenToKVPool(b.num_slots - 16, 16, torch.float8_e4m3fn, 1)
    pool.kv_buffer[0].copy_(torch.from_numpy(rng.standard_normal(pool.kv_buffer[0].shape)
                                             .astype(np.float32)).to(torch.float8_e4m3fn)
                            .view(torch.uint8))
    backend = FuncMLAAttnBackend(b.req_to_token, pool, page_size=16,
                                 attention_backend="pallas", torch_launcher=True)
    q = torch.from_numpy(rng.standard_normal((4, H, 576)).astype(np.float32)).bfloat16()
    fb = ForwardBatch(ForwardMode.DECODE, 4, b.req_pool_indices, b.seq_lens, b.seq_lens,
                      int(b.seq_lens.sum()))
    backend.init_forward_metadata(fb)
    fp8_view = pool.get_key_buffer(0)
    for k_scale, passed in ((0.375, 0.375), (torch.tensor([1.5]), 1.5)):
        layer = RadixAttention(H, SCALE, k_scale=k_scale)
        out = backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
        assert (backend.last_backend, backend.last_via) == ("pallas", "launcher")
        kv_pool, *_, got_scale = calls[-1]
        assert kv_pool.dtype == torch.float8_e4m3fn
        assert kv_pool.data_ptr() == pool.kv_buffer[0].data_ptr()
        assert type(got_scale) is float and got_scale == passed
        want = torch_native_mla_decode(q, fp8_view.float() * passed,
                                       b.req_to_token, b.req_pool_indices, b.seq_lens,
                                       sm_scale=SCALE, compute_dtype=torch.float32)
        assert rel_err(out.view(4, H, 512), want) < 4e-3
