"""GPU checks of the torch shim on one NVIDIA GPU (torch CUDA + JAX CUDA), in one run.

    python bench/interop_gpu_check.py [--out out/]

1. zero_copy:  to_jax / to_torch on CUDA tensors of int32, bf16, fp32 and fp8 (as uint8) keep
               the device pointer, and round trips are bit-exact.
2. backend:    FuncMLAAttnBackend with attention_backend="auto" on random paged batches at page
               sizes 1, 16, 64 (decode and extend with prefixes): which backend ran, and the max
               relative error against SGLang's torch-native algorithm in float32 (bf16 inputs).
3. cuda_graph: a torch CUDA graph captured once over the static metadata views (consumer:
               `csr_mla_attention_dense`), replayed for batches of different lengths after
               `init_forward_metadata_replay_cuda_graph` rewrote the same buffers; each replay
               compared with torch-native. Then the overflow check (token-granular buffer and
               the seed's block-granular sizing).
Writes out/interop_gpu_check.json; prints PASS/FAIL per check. Without CUDA it runs on CPU and
skips the graph capture.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import host_us  # noqa: E402
from funcmla.config import deepseek_v3_sm_scale  # noqa: E402
from funcmla.interop.dlpack import data_ptr, to_jax, to_torch  # noqa: E402
from funcmla.interop.sglang_backend import (  # noqa: E402
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    RadixAttention,
)
from funcmla.interop.testing import random_paged_batch  # noqa: E402
from funcmla.interop.torch_csr import csr_mla_attention_dense  # noqa: E402
from funcmla.interop.torch_native import (  # noqa: E402
    torch_native_mla_decode,
    torch_native_mla_extend,
)

SCALE = deepseek_v3_sm_scale()
H = 16
MAX_CTX = 1024


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def check_zero_copy(dev):
    out = {}
    for dtype in (torch.int32, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        raw = torch.randint(0, 255, (4096, 576), dtype=torch.int32, device=dev)
        t = raw.to(torch.uint8).view(dtype) if dtype == torch.float8_e4m3fn else raw.to(dtype)
        x = to_jax(t, fp8="bits")
        back = to_torch(x, fp8_dtype=dtype if dtype == torch.float8_e4m3fn else None)
        same = data_ptr(x) == t.data_ptr() == back.data_ptr()
        exact = torch.equal(back.view(torch.uint8), t.view(torch.uint8)) if t.element_size() == 1 \
            else torch.equal(back, t)
        out[str(dtype)] = dict(same_pointer=bool(same), exact=bool(exact))
    return out, all(v["same_pointer"] and v["exact"] for v in out.values())


def _setup(rng, prefix, extend, page_size, dev, **kw):
    b = random_paged_batch(rng, prefix_lens=prefix, extend_lens=extend, page_size=page_size,
                           max_context_len=MAX_CTX, pool_size=len(prefix) + 4,
                           num_pages=16384 // page_size - 1)
    pool = MLATokenToKVPool(b.num_slots - page_size, page_size, torch.bfloat16, 1, device=dev)
    pool.kv_buffer[0].copy_(torch.randn(pool.kv_buffer[0].shape, device=dev))
    backend = FuncMLAAttnBackend(b.req_to_token.to(dev), pool, page_size=page_size, **kw)
    return b, pool, backend


def _fb(mode, b, dev):
    return ForwardBatch(mode, len(b.seq_lens), b.req_pool_indices.to(dev), b.seq_lens.to(dev),
                        b.seq_lens, int(b.seq_lens.sum()), b.out_cache_loc.to(dev),
                        b.extend_prefix_lens.to(dev), b.extend_seq_lens.to(dev),
                        b.extend_prefix_lens.tolist(), b.extend_seq_lens.tolist())


def check_backend(dev):
    rng = np.random.default_rng(0)
    rows = []
    ok = True
    for page_size in (1, 16, 64):
        for kind in ("decode", "extend"):
            bsz = 8
            prefix = rng.integers(0, 900, bsz).tolist()
            extend = [1] * bsz if kind == "decode" else rng.integers(1, 120, bsz).tolist()
            T = sum(extend)
            row = dict(page_size=page_size, kind=kind, batch=bsz, tokens=T)
            try:
                b, pool, backend = _setup(rng, prefix, extend, page_size, dev,
                                          attention_backend="auto")
                fb = _fb(ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND, b, dev)
                q = torch.randn(T, H, 576, device=dev).bfloat16()
                k = torch.randn(T, 1, 576, device=dev).bfloat16()
                backend.init_forward_metadata(fb)
                fwd = backend.forward_decode if kind == "decode" else backend.forward_extend
                out = fwd(q, k, None, RadixAttention(H, SCALE), fb).view(T, H, 512)
                args = (q, pool.kv_buffer[0], b.req_to_token.to(dev),
                        b.req_pool_indices.to(dev), b.seq_lens.to(dev))
                if kind == "decode":
                    want = torch_native_mla_decode(*args, sm_scale=SCALE,
                                                   compute_dtype=torch.float32)
                else:
                    want = torch_native_mla_extend(*args, b.extend_prefix_lens.to(dev),
                                                   b.extend_seq_lens.to(dev), sm_scale=SCALE,
                                                   compute_dtype=torch.float32)
                err = rel_err(out, want)
                ok &= err < 1e-2
                row.update(backend_selected=backend.attention_backend,
                           backend_ran=backend.last_backend, max_rel_err=err)
                print(f"  backend ps={page_size:2d} {kind:6s} selected={backend.attention_backend} "
                      f"ran={backend.last_backend:9s} max rel err {err:.2e}")
            except Exception:  # record and continue with the other cases
                row["error"] = traceback.format_exc()
                print(row["error"])
                ok = False
            rows.append(row)
    return rows, ok


def check_cuda_graph(dev):
    rng = np.random.default_rng(1)
    bs = 8
    b, pool, backend = _setup(rng, [10] * bs, [1] * bs, 16, dev, attention_backend="reference")
    backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    rpi = b.req_pool_indices.to(dev)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, rpi, b.seq_lens.to(dev), None,
                                                     ForwardMode.DECODE, None)
    fm = backend.forward_metadata
    q = torch.randn(bs, H, 576, device=dev)
    static_out = torch.empty(bs, H, 512, device=dev)

    def consumer():
        static_out.copy_(csr_mla_attention_dense(q, pool.kv_buffer[0], fm.qo_indptr,
                                                 fm.kv_indptr, fm.kv_indices, sm_scale=SCALE))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        consumer()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        consumer()
    # req_to_token rows were filled for 11 tokens; write full rows so any length is valid
    r2t = backend.req_to_token
    r2t.copy_(torch.randint(16, pool.kv_buffer[0].shape[0], r2t.shape, dtype=torch.int32,
                            device=dev))
    torch.cuda.synchronize()
    replays = []
    ok = True
    for lens in ([11] * bs, rng.integers(1, MAX_CTX + 1, bs).tolist(), [MAX_CTX] * bs,
                 [1, MAX_CTX, 2, 500, 3, 700, 4, 5]):
        seq = torch.tensor(lens, dtype=torch.int32)
        backend.init_forward_metadata_replay_cuda_graph(bs, rpi, seq.to(dev), int(seq.sum()),
                                                        None, ForwardMode.DECODE, None, seq)
        graph.replay()
        want = torch_native_mla_decode(q, pool.kv_buffer[0], r2t, rpi, seq.to(dev),
                                       sm_scale=SCALE, compute_dtype=torch.float32)
        err = rel_err(static_out, want)
        same = backend.forward_metadata is fm
        ok &= err < 1e-4 and same
        replays.append(dict(seq_lens=lens, tokens=int(seq.sum()), max_rel_err=err,
                            same_buffers=same))
        print(f"  graph replay tokens={int(seq.sum()):5d} max rel err {err:.2e} "
              f"same buffers {same}")
    overflow = {}

    def expect_overflow(label, replay):
        """Run a replay that must be refused; record the error text (or that it was missed)."""
        try:
            replay()
        except ValueError as err:  # CudaGraphBufferOverflow, or a length over max_context_len
            overflow[label] = str(err)
            return True
        overflow[label] = "NOT DETECTED"
        return False

    too_long = torch.tensor([MAX_CTX + 1] + [1] * (bs - 1), dtype=torch.int32)
    ok &= expect_overflow("too_long", lambda: backend.init_forward_metadata_replay_cuda_graph(
        bs, rpi, too_long.to(dev), int(too_long.sum()), None, ForwardMode.DECODE, None,
        too_long))
    _, _, legacy = _setup(rng, [10] * bs, [1] * bs, 64, dev, attention_backend="reference",
                          legacy_block_granular_kv_indices=True)
    legacy.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    small = torch.full((bs,), 2, dtype=torch.int32)
    legacy.init_forward_metadata_capture_cuda_graph(bs, bs, rpi, small.to(dev), None,
                                                    ForwardMode.DECODE, None)
    seq = torch.full((bs,), 100, dtype=torch.int32)
    ok &= expect_overflow("seed_block_granular",
                          lambda: legacy.init_forward_metadata_replay_cuda_graph(
                              bs, rpi, seq.to(dev), int(seq.sum()), None, ForwardMode.DECODE,
                              None, seq))
    for k, v in overflow.items():
        print(f"  overflow {k}: {v}")
    return dict(replays=replays, overflow=overflow), ok


def _median_us(fn):
    """Median host time of fn() (us) over 50 calls after 10 untimed, synced every 10."""
    return host_us(fn, 50, torch.cuda.synchronize, warmup=10, sync_every=10)


def _jax_path_breakdown(backend, q, layer):
    from funcmla.interop import backend_select as bsel

    kv, _ = backend._kv_pool_jax(0)
    meta = backend._jax_meta
    qj = to_jax(q)
    out, _ = bsel._pallas(qj, kv, meta.kv_indptr, meta.kv_indices, sm_scale=SCALE, s_q=1,
                          max_kv_len=backend._max_kv_bound, v_head_dim=512)
    parts = dict(
        select_backend=lambda: bsel.select_backend("pallas"),
        to_jax_q=lambda: to_jax(q),
        pallas_jit_dispatch=lambda: bsel._pallas(qj, kv, meta.kv_indptr, meta.kv_indices,
                                                 sm_scale=SCALE, s_q=1,
                                                 max_kv_len=backend._max_kv_bound,
                                                 v_head_dim=512),
        to_torch_out=lambda: to_torch(out),
        get_key_buffer=lambda: backend.token_to_kv_pool.get_key_buffer(0),
    )
    res = {k: _median_us(f) for k, f in parts.items()}
    print("  dlpack+jit per-layer breakdown (host us): "
          + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    return res


def check_launcher_path(dev):
    """Optional: the pallas torch-launcher path (interop.launcher, another engineer's module) vs
    the DLPack + jit path on one decode batch: result, which path ran, host time per layer."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 900, 8).tolist()
    out = {}
    ok = True
    for launch in (False, True):
        b, pool, backend = _setup(rng, prefix, [1] * 8, 16, dev, attention_backend="auto",
                                  torch_launcher=launch)
        fb = _fb(ForwardMode.DECODE, b, dev)
        q = torch.randn(8, H, 576, device=dev).bfloat16()
        backend.init_forward_metadata(fb)
        layer = RadixAttention(H, SCALE)
        res = backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
        want = torch_native_mla_decode(q, pool.kv_buffer[0], b.req_to_token.to(dev),
                                       b.req_pool_indices.to(dev), b.seq_lens.to(dev),
                                       sm_scale=SCALE, compute_dtype=torch.float32)
        err = rel_err(res.view(8, H, 512), want)
        per_layer = _median_us(
            lambda: backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False))
        key = "launcher" if launch else "dlpack_jit"
        out[key] = dict(backend=backend.last_backend, via=backend.last_via, max_rel_err=err,
                        host_us_per_layer=per_layer)
        if not launch:  # where the DLPack + jit path spends its host time, per layer
            out["dlpack_jit_breakdown_us"] = _jax_path_breakdown(backend, q, layer)
        ok &= err < 1e-2
        print(f"  {key}: ran {backend.last_backend} via {backend.last_via}, err {err:.2e}, "
              f"{out[key]['host_us_per_layer']:.1f} us/layer (host)")
    return out, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
    dev = "cuda" if cuda else "cpu"
    result = dict(env=dict(jax=jax.__version__, torch=torch.__version__,
                           device=str(jax.devices()[0].device_kind), torch_device=dev))
    checks = [("zero_copy", check_zero_copy), ("backend", check_backend)]
    if cuda:
        checks.append(("cuda_graph", check_cuda_graph))
        checks.append(("launcher_path (optional)", check_launcher_path))
    all_ok = True
    for name, fn in checks:
        try:
            data, ok = fn(dev)
        except Exception:  # report and go on: one run on the device must return every result
            data, ok = traceback.format_exc(), False
            print(data)
        result[name] = dict(ok=ok, data=data)
        all_ok &= ok or "optional" in name
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "interop_gpu_check.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    print("ALL PASS" if all_ok else "SOME FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
