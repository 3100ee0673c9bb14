"""Two MLA layers through extend, decode and a CUDA-graph replay with FuncMLAAttnBackend,
each step compared with SGLang's torch-native algorithm (docs/sglang_backend.md).

    PYTHONPATH=. python docs/examples/sglang_two_layers.py   # max relative error per step
"""

import numpy as np
import torch

from funcmla.config import deepseek_v3_sm_scale
from funcmla.interop.sglang_backend import (
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    RadixAttention,
)
from funcmla.interop.testing import random_paged_batch
from funcmla.interop.torch_native import torch_native_mla_decode, torch_native_mla_extend

H, PAGE, LAYERS, SCALE = 16, 16, 2, deepseek_v3_sm_scale()


def rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main() -> dict[str, float]:
    rng = np.random.default_rng(0)
    # 1. an allocator's layout: 3 requests with cached prefixes, extended by 20 / 5 / 33 tokens
    b = random_paged_batch(rng, prefix_lens=[0, 40, 17], extend_lens=[20, 5, 33], page_size=PAGE,
                           max_context_len=256, pool_size=8, num_pages=120)
    pool = MLATokenToKVPool(b.num_slots - PAGE, PAGE, torch.bfloat16, LAYERS)
    for buf in pool.kv_buffer:  # the cached prefixes' latent rows
        buf.copy_(torch.randn(buf.shape, dtype=torch.float32))
    backend = FuncMLAAttnBackend(b.req_to_token, pool, page_size=PAGE, num_heads=H,
                                 attention_backend="reference")
    layers = [RadixAttention(H, SCALE, layer_id=i) for i in range(LAYERS)]
    errors = {}

    # 2. extend: write each layer's new latent rows, attend over prefix + new tokens
    fb = ForwardBatch(ForwardMode.EXTEND, 3, b.req_pool_indices, b.seq_lens, b.seq_lens,
                      int(b.seq_lens.sum()), b.out_cache_loc, b.extend_prefix_lens,
                      b.extend_seq_lens, b.extend_prefix_lens.tolist(),
                      b.extend_seq_lens.tolist())
    backend.init_forward_metadata(fb)  # metadata + PS prefill plan, once for all layers
    t = int(b.extend_seq_lens.sum())
    for layer in layers:
        q = torch.randn(t, H * 576).to(torch.bfloat16)
        k = torch.randn(t, 1, 576).to(torch.bfloat16)
        out = backend.forward(q, k, None, layer, fb)
        want = torch_native_mla_extend(q.view(t, H, 576), pool.kv_buffer[layer.layer_id],
                                       b.req_to_token, b.req_pool_indices, b.seq_lens,
                                       b.extend_prefix_lens, b.extend_seq_lens, sm_scale=SCALE,
                                       compute_dtype=torch.float32)
        errors[f"extend layer {layer.layer_id}"] = rel_err(out.view(t, H, 512), want)

    # 3. decode: one new token per request (the allocator's next slot), then attention
    def decode_step(seq_lens):
        slots = torch.stack([b.req_to_token[r, s - 1] for r, s in
                             zip(b.req_pool_indices.tolist(), seq_lens.tolist())])
        return ForwardBatch(ForwardMode.DECODE, 3, b.req_pool_indices, seq_lens, seq_lens,
                            int(seq_lens.sum()), slots.to(torch.int32))

    def run_layers(fb, tag):
        for layer in layers:
            q = torch.randn(3, H * 576).to(torch.bfloat16)
            k = torch.randn(3, 1, 576).to(torch.bfloat16)
            out = backend.forward(q, k, None, layer, fb)
            want = torch_native_mla_decode(q.view(3, H, 576), pool.kv_buffer[layer.layer_id],
                                           b.req_to_token, b.req_pool_indices, fb.seq_lens,
                                           sm_scale=SCALE, compute_dtype=torch.float32)
            errors[f"{tag} layer {layer.layer_id}"] = rel_err(out.view(3, H, 512), want)

    used = set((b.req_to_token[b.req_pool_indices] // PAGE).flatten().tolist())
    free = [p for p in range(1, 121) if p not in used]  # the allocator's free pages
    for i, (r, s) in enumerate(zip(b.req_pool_indices.tolist(), b.seq_lens.tolist())):
        b.req_to_token[r, s:s + 2] = free[i] * PAGE + torch.arange(2)  # 2 decode tokens
    seq1 = b.seq_lens + 1
    fb1 = decode_step(seq1)
    backend.init_forward_metadata(fb1)
    run_layers(fb1, "decode")

    # 4. CUDA graphs: static buffers for up to 4 requests, capture at bs 3, replay a new step.
    #    (On a GPU the layers' kernels are captured between capture and replay; the metadata
    #    path, shown here, is the same on every device.)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(3, 3, b.req_pool_indices, seq1, None,
                                                     ForwardMode.DECODE, None)
    captured = backend.forward_metadata.kv_indices.data_ptr()
    seq2 = b.seq_lens + 2
    fb2 = decode_step(seq2)
    backend.init_forward_metadata_replay_cuda_graph(3, b.req_pool_indices, seq2,
                                                    int(seq2.sum()), None, ForwardMode.DECODE,
                                                    None, seq2)
    assert backend.forward_metadata.kv_indices.data_ptr() == captured  # same static buffer
    run_layers(fb2, "replay")
    return errors


if __name__ == "__main__":
    for step, err in main().items():
        print(f"{step:18s} max relative error vs torch-native float32: {err:.2e}")
