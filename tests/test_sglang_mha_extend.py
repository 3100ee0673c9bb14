"""`FuncMLAAttnBackend.forward_extend` with SGLang's MHA shapes (DeepSeek's `attn_mha`: q / k
[T, H, 192], v [T, H, 128], num_kv_heads = H) against a torch float32 restatement of the same
step: per request, the keys and values of the whole sequence (from the model's k / v when no
request has a prefix, else decompressed from the latent pool through `kv_b_proj`), and SDPA on
a query padded to the sequence's length (bottom-right causal, as SGLang's torch-native backend
computes an extend)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from funcmla.attention.pallas import MgpuPrefillConfig
from funcmla.attention.pallas.prefill import SHORT_CONFIG, SHORT_KV_LEN
from funcmla.interop.sglang import mha_extend as mx
from funcmla.interop.sglang_backend import ForwardMode, RadixAttention
from tests.launcher_helpers import (bits, contract_prefill_launcher, needs_gpu,
                                    needs_launcher)
from tests.test_interop_sglang import SCALE, _fb, _setup, rel_err


def _layer(heads, rng):
    layer = RadixAttention(tp_q_head_num=heads, scaling=SCALE, qk_head_dim=192,
                           v_head_dim=128, tp_k_head_num=heads)
    proj = torch.nn.Linear(512, heads * 256, bias=False)
    with torch.no_grad():
        proj.weight.copy_(torch.from_numpy(
            rng.standard_normal(proj.weight.shape).astype(np.float32) / np.sqrt(512)))
    layer.kv_b_proj = proj.to(torch.bfloat16)
    return layer


def _torch_reference(q, k_seq, v_seq, prefix, extend):
    """float32: request r's queries (rows [p, s) of a zero query of its s = p + e rows) over
    its k_seq[r] / v_seq[r] [s, H, d], SDPA top-left causal per head, rows [p:] kept."""
    outs, start = [], 0
    for r, (p, e) in enumerate(zip(prefix, extend)):
        s = p + e
        qs = q.new_zeros((s,) + q.shape[1:], dtype=torch.float32)
        qs[p:] = q[start:start + e].float()
        o = F.scaled_dot_product_attention(qs.movedim(0, 1), k_seq[r].float().movedim(0, 1),
                                           v_seq[r].float().movedim(0, 1), is_causal=True,
                                           scale=SCALE)
        outs.append(o.movedim(1, 0)[p:])
        start += e
    return torch.cat(outs)


def _decompressed(b, pool, layer, prefix, extend):
    """Per request: k, v of its whole sequence from the latent pool (req_to_token slots)."""
    rows = pool.kv_buffer[0][:, 0, :].float()
    ks, vs = [], []
    for r, pool_idx in enumerate(b.req_pool_indices.tolist()):
        slots = b.req_to_token[pool_idx, :prefix[r] + extend[r]].long()
        lat = rows[slots]
        with torch.no_grad():
            kv = layer.kv_b_proj.float()(lat[:, :512]).view(-1, layer.tp_q_head_num, 256)
        pe = lat[:, None, 512:].expand(-1, layer.tp_q_head_num, 64)
        ks.append(torch.cat([kv[..., :128], pe], -1))
        vs.append(kv[..., 128:])
    layer.kv_b_proj.to(torch.bfloat16)
    return ks, vs


def _expected(b, pool, layer, prefix, extend, q, k, v):
    """The float32 restatement of one MHA extend step: each request's keys and values from the
    pool (a prefix anywhere) or from the model's k / v, then `_torch_reference`."""
    heads, t = layer.tp_q_head_num, sum(extend)
    if any(prefix):
        ks, vs = _decompressed(b, pool, layer, prefix, extend)
    else:
        ends = np.cumsum([0] + extend)
        k3, v3 = k.view(t, heads, 192), v.view(t, heads, 128)
        ks = [k3[a:e] for a, e in zip(ends[:-1], ends[1:])]
        vs = [v3[a:e] for a, e in zip(ends[:-1], ends[1:])]
    return _torch_reference(q.view(t, heads, 192), ks, vs, prefix, extend)


def _step(heads, prefix, extend, seed, backend_name="reference", *, monkeypatch=None):
    """One MHA extend step: (backend, out [T, H, 128], the float32 restatement, layer, fb,
    (q, k, v)). With `monkeypatch` the pallas path runs through JAX (torch_launcher off) and
    the layer is checked to read no device value on the host."""
    rng, b, pool, backend = _setup(seed, prefix, extend, 16, attention_backend="reference")
    backend.attention_backend = backend_name  # "pallas": as selected on an NVIDIA GPU
    if monkeypatch is not None:
        backend.torch_launcher = False
    layer = _layer(heads, rng)
    t = sum(extend)
    q, k = (torch.from_numpy(rng.standard_normal((t, heads * 192)).astype(np.float32))
            .bfloat16() for _ in range(2))
    v = torch.from_numpy(rng.standard_normal((t, heads * 128)).astype(np.float32)).bfloat16()
    fb = _fb(ForwardMode.EXTEND, b, extend)
    backend.init_forward_metadata(fb)
    with contextlib.ExitStack() as stack:
        if monkeypatch is not None:
            _no_host_reads(stack.enter_context(monkeypatch.context()))
        out = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert out.shape == (t, heads * 128) and out.dtype == torch.bfloat16
    want = _expected(b, pool, layer, prefix, extend, q, k, v)
    return backend, out.view(t, heads, 128), want, layer, fb, (q, k, v)


@pytest.mark.parametrize("prefix,extend", [([0, 23, 64, 5], [17, 1, 40, 30]),
                                           ([0, 0, 0], [17, 40, 30])])
def test_mha_extend_equals_torch_float32(prefix, extend):
    """The reference backend on CPU: with a prefix (decompressed from the pool) and without
    (the model's k and v)."""
    backend, out, want, *_ = _step(16, prefix, extend, 3)
    assert backend.last_backend == "reference" and backend.last_fallback_reason is None
    assert rel_err(out, want) < 8e-3


@pytest.mark.slow
def test_mha_extend_runs_the_prefill_kernel_in_interpret_mode(monkeypatch):
    """The pallas path as the backend calls it, the kernel in Mosaic GPU interpret mode (2
    heads, a prefix in one request)."""
    from funcmla.attention.pallas import mha_prefill, prefill_step

    # the step's config comes from its lengths (64-token tiles here)
    monkeypatch.setattr(mx, "_pallas_step", lambda: functools.partial(
        prefill_step, interpret=True))
    monkeypatch.setattr(mx, "_pallas_prefill", lambda: mha_prefill)
    backend, out, want, *_ = _step(2, [0, 70], [9, 20], 5, backend_name="pallas")
    assert backend.last_backend == "pallas" and backend.last_fallback_reason is None
    assert rel_err(out, want) < 8e-3


def _no_host_reads(m):
    def no_host_read(*a, **k):
        raise AssertionError("a device value was read on the host in a layer")

    for name in ("__int__", "__bool__", "__index__", "item", "tolist"):
        m.setattr(torch.Tensor, name, no_host_read)
    m.setattr(torch, "equal", no_host_read)


@needs_launcher
@pytest.mark.parametrize("prefix,extend", [([0, 23, 64, 5], [17, 1, 40, 30]),
                                           ([0, 0, 0], [17, 40, 30])])
def test_mha_extend_through_the_torch_launcher(prefix, extend, monkeypatch):
    """With torch_launcher on (the default), the pallas MHA extend runs the torch prefill
    launcher of the step's buckets (here built on a stand-in kernel that computes the kernel's
    contract in float64 from its eleven buffers): out equals the float32 restatement; the
    step's layout is computed once for all its layers and again for the next step; each layer
    is one launch and reads nothing on the host; a prefix's k / v are made in the layout's
    row order."""
    from funcmla.interop.launcher import prefill as lp

    built, layouts = [], []
    real_layout = lp.PrefillLauncher.layout

    def counted_layout(self, *a):
        layouts.append(a[2:])
        return real_layout(self, *a)

    def stand_in(config, device):
        assert device.type == "cpu" and config.num_heads == 4 and config.causal
        lau, log = contract_prefill_launcher(config)
        built.append((config, log))
        return lau

    laid_out = []
    real_call = lp.PrefillLauncher.__call__

    def recorded_call(self, *a, **kw):
        laid_out.append(kw.get("kv_laid_out", False))
        return real_call(self, *a, **kw)

    monkeypatch.setattr(mx, "_prefill_launcher", stand_in)
    monkeypatch.setattr(lp.PrefillLauncher, "layout", counted_layout)
    monkeypatch.setattr(lp.PrefillLauncher, "__call__", recorded_call)
    backend, out, want, layer, fb, (q, k, v) = _step(4, prefix, extend, 8,
                                                     backend_name="pallas")
    assert (backend.last_backend, backend.last_via) == ("pallas", "launcher")
    assert backend.last_launcher_reason is None and backend.last_fallback_reason is None
    assert rel_err(out, want) < 8e-3
    (config, log), = built
    t, t_kv = sum(extend), sum(p + e for p, e in zip(prefix, extend))
    assert (config.q_capacity, config.batch) == (128, 8) and layouts == [(t, t_kv)]
    assert config.kernel == SHORT_CONFIG  # every request's kv_len <= SHORT_KV_LEN
    assert len(log) == 1
    # a prefix's k / v are decompressed in the layout's row order (no launcher gather); the
    # model's own k / v are gathered by the launcher
    assert laid_out == [any(prefix)]
    with monkeypatch.context() as m:  # a second layer of the step: one launch, no host read
        _no_host_reads(m)
        again = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert len(log) == 2 and len(layouts) == 1 and len(built) == 1
    assert torch.equal(again, out.reshape(again.shape))
    backend.init_forward_metadata(fb)  # the next step: its own layout, the same launcher
    backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert len(layouts) == 2 and len(built) == 1 and len(log) == 3


def test_mha_extend_says_why_the_launcher_did_not_run(monkeypatch):
    """On a machine without CUDA the pallas MHA extend runs through JAX (here the jitted
    prefill's stand-in); last_launcher_reason says why, or that torch_launcher is off."""
    _reference_as_kernel(monkeypatch, [])
    backend, out, want, layer, fb, (q, k, v) = _step(2, [0, 3], [9, 4], 9, backend_name="pallas")
    assert (backend.last_backend, backend.last_via) == ("pallas", "jax")
    assert "prefill launcher is unavailable" in backend.last_launcher_reason
    assert "CUDA" in backend.last_launcher_reason
    backend.torch_launcher = False
    backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert backend.last_launcher_reason == "torch_launcher is off"


def test_mha_extend_refuses_what_it_cannot_do():
    """save_kv_cache=True (MHA rows do not fit the latent pool), grouped heads, and a prefix
    without kv_b_proj: each an error naming the field."""
    backend, _, _, layer, fb, (q, k, v) = _step(16, [0, 23], [17, 1], 4)
    with pytest.raises(ValueError, match="save_kv_cache"):
        backend.forward_extend(q, k, v, layer, fb, save_kv_cache=True)
    layer.tp_k_head_num = 1
    with pytest.raises(ValueError, match="tp_k_head_num = 1"):
        backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    layer.tp_k_head_num = 16
    del layer.kv_b_proj
    with pytest.raises(ValueError, match="kv_b_proj"):
        backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)


def test_mha_extend_records_why_the_reference_ran():
    """AITER's MHA prefill is not wrapped: the aiter backend runs the float32 reference for the
    MHA extend and says so."""
    backend, out, want, *_ = _step(16, [5, 0], [17, 9], 6, backend_name="aiter")
    assert backend.last_backend == "reference"
    assert "AITER" in backend.last_fallback_reason
    assert rel_err(out, want) < 8e-3


def test_fp8_prefix_rows_scale_without_a_host_read(monkeypatch):
    """An fp8 latent pool's prefix rows are dequantized by the layer's k_scale: a tensor scale
    multiplies as a tensor (never read on the host: no device sync on a GPU) and gives the
    float scale's bits; both equal float32 dequantization followed by kv_b_proj."""
    rng = np.random.default_rng(5)
    layer = _layer(4, rng)
    rows = torch.from_numpy(rng.standard_normal((9, 576)).astype(np.float32)).to(
        torch.float8_e4m3fn)
    k_f, v_f = mx._decompress(rows, layer.kv_b_proj, 4, torch.bfloat16, 0.375)

    def no_host_read(self, *a):
        raise AssertionError("k_scale was read on the host")

    monkeypatch.setattr(torch.Tensor, "__float__", no_host_read)
    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    k_t, v_t = mx._decompress(rows, layer.kv_b_proj, 4, torch.bfloat16, torch.tensor([0.375]))
    monkeypatch.undo()
    assert torch.equal(k_t, k_f) and torch.equal(v_t, v_f)
    lat = (rows.float() * 0.375).bfloat16()
    with torch.no_grad():
        kv = layer.kv_b_proj(lat[:, :512]).view(9, 4, 256)
    assert torch.equal(v_f, kv[..., 128:])
    assert torch.equal(k_f[..., 128:], lat[:, None, 512:].expand(9, 4, 64))


def _reference_as_kernel(monkeypatch, seen, configs=None, steps=None):
    """Stand-ins for the jitted step and prefill: the step keeps the bucketed CSRs it is
    built from (each build recorded in `steps`) and the config `prefill_step` would pick; a
    layer runs the float32 reference on exactly the inputs the backend hands the kernel (their
    shapes recorded in `seen`, the config in `configs`), out in bf16 as the kernel's."""
    configs = [] if configs is None else configs
    steps = [] if steps is None else steps
    from funcmla.attention.pallas.prefill import prefill_kernel_config
    from funcmla.attention.reference import mha_attention_reference

    def build(qo, kv, *, num_q, num_kv, causal, max_kv_len):
        steps.append((num_q, num_kv))
        return dict(qo=qo, kv=kv, causal=causal, config=prefill_kernel_config(max_kv_len))

    def run(q, k, v, *, step, sm_scale):
        seen.append(tuple(tuple(x.shape) for x in (q, k, v, step["qo"], step["kv"])))
        configs.append(step["config"])
        out, lse = mha_attention_reference(q, k, v, step["qo"], step["kv"], sm_scale=sm_scale,
                                           causal=step["causal"])
        return out.astype(q.dtype), lse

    monkeypatch.setattr(mx, "_pallas_step", lambda: build)
    monkeypatch.setattr(mx, "_pallas_prefill", lambda: run)


@pytest.mark.parametrize("prefix,extends", [
    ([0, 0, 0], ([17, 40, 30], [20, 41, 40])),   # 87 and 101 tokens: one 128-row bucket
    ([0, 23], ([17, 1], [30, 5])),               # a prefix: 41 and 58 k / v rows, one bucket
])
def test_pallas_path_compiles_once_per_bucket_and_reads_nothing_on_the_host(
        prefix, extends, monkeypatch):
    """Two steps with other token counts in one bucket hand the kernel the same shapes (q / k
    / v rows at `prefill_capacity`, CSRs at `prefill_batch_capacity` requests), so the jitted
    prefill compiles once; the padded rows and requests change nothing (out equals the float32
    restatement); and a layer reads no device value on the host (no sync per layer)."""
    seen, steps = [], []
    _reference_as_kernel(monkeypatch, seen, steps=steps)
    for extend in extends:
        backend, out, want, layer, fb, (q, k, v) = _step(4, prefix, extend, 7, "pallas",
                                                         monkeypatch=monkeypatch)
        assert backend.last_backend == "pallas" and rel_err(out, want) < 8e-3
    assert len(seen) == 2 and seen[0] == seen[1], seen
    assert len(steps) == 2  # one step schedule a step ...
    with monkeypatch.context() as m:  # ... which its next layer reuses, reading nothing
        _no_host_reads(m)
        again = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert len(steps) == 2 and len(seen) == 3 and torch.equal(again, out.reshape(again.shape))
    (qs, ks_, vs_, qos, kvs), = set(seen)
    assert qs[0] == 128 and qos == kvs == (9,)  # 8 requests + 1


@pytest.mark.parametrize("prefix,extend,want", [
    ([0, 23], [17, 1], SHORT_CONFIG),                      # longest kv_len 40
    ([SHORT_KV_LEN - 3, 0], [3, 5], SHORT_CONFIG),         # exactly SHORT_KV_LEN
    ([SHORT_KV_LEN - 2, 0], [3, 5], MgpuPrefillConfig()),  # one key more: 128-token tiles
])
def test_the_step_s_longest_kv_len_picks_the_kernel_config(prefix, extend, want, monkeypatch):
    """The kernel's tile config is `prefill_kernel_config` of the step's longest kv_len, a host
    fact of init_forward_metadata (no device read in the layer)."""
    import tests.test_interop_sglang as tis

    configs = []
    _reference_as_kernel(monkeypatch, [], configs)
    monkeypatch.setattr(tis, "MAX_CTX", 2048)  # room for requests past SHORT_KV_LEN
    _step(2, prefix, extend, 4, "pallas", monkeypatch=monkeypatch)
    assert configs == [want]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefix,extend", [([0, 23, 64, 5], [17, 1, 40, 30]),
                                           ([0, 0, 0], [300, 129, 77])])
def test_gpu_mha_extend_launcher_equals_the_jax_path(prefix, extend):
    """On the GPU the pallas MHA extend runs the torch prefill launcher; its out has the bits
    of the same step through JAX (torch_launcher=False) where k / v are the model's, and
    matches float32. With a prefix the launcher decompresses the layout's rows (more than the
    tokens), a GEMM of another row count that may take another cuBLAS kernel, so there the two
    paths agree to bf16 rounding."""
    rng, b, pool, backend = _setup(11, prefix, extend, 16, device="cuda",
                                   attention_backend="pallas")
    layer = _layer(16, rng)
    layer.kv_b_proj.cuda()
    t = sum(extend)
    q, k = (torch.from_numpy(rng.standard_normal((t, 16 * 192)).astype(np.float32))
            .bfloat16().cuda() for _ in range(2))
    v = torch.from_numpy(rng.standard_normal((t, 16 * 128)).astype(np.float32)).bfloat16().cuda()
    fb = _fb(ForwardMode.EXTEND, b, extend, device="cuda")
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert backend.last_via == "launcher", backend.last_launcher_reason
    backend.torch_launcher = False
    via_jax = backend.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
    assert backend.last_via == "jax"
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    if any(prefix):
        assert rel_err(out.float(), via_jax.float()) < 4e-3
    else:
        assert torch.equal(bits(out), bits(via_jax))
    want = _expected(b, pool, layer, prefix, extend, q, k, v)
    assert rel_err(out.view(t, 16, 128).float(), want.float()) < 8e-3
