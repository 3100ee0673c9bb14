"""SGLang's torch-native MLA algorithm (torch) and the graph-safe CSR consumer vs float64 NumPy."""

import numpy as np
import pytest
import torch

from funcmla.config import deepseek_v3_sm_scale
from funcmla.interop.testing import random_paged_batch
from funcmla.interop.torch_csr import csr_mla_attention_dense
from funcmla.interop.torch_native import torch_native_mla_decode, torch_native_mla_extend

SCALE = deepseek_v3_sm_scale()


def dense_oracle(q, rows, slots_per_req, q_lens, *, causal, v_head_dim=512):
    """float64 loop: query j of a request with q_len queries and kv_len keys sees
    keys [0, kv_len - (q_len - 1 - j)) when causal (bottom-right)."""
    q = q.astype(np.float64)
    rows = rows.astype(np.float64)
    out = np.zeros((q.shape[0], q.shape[1], v_head_dim))
    t = 0
    for slots, q_len in zip(slots_per_req, q_lens):
        kv = rows[slots]
        for j in range(q_len):
            vis = len(slots) - (q_len - 1 - j) if causal else len(slots)
            if vis > 0:
                s = q[t] @ kv[:vis].T * SCALE  # [H, vis]
                p = np.exp(s - s.max(-1, keepdims=True))
                out[t] = (p / p.sum(-1, keepdims=True)) @ kv[:vis, :v_head_dim]
            t += 1
    return out


def _setup(seed, prefix, extend, page_size=16, heads=4):
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, prefix_lens=prefix, extend_lens=extend, page_size=page_size,
                           max_context_len=160)
    rows = rng.standard_normal((b.num_slots, 576)).astype(np.float32)
    q = rng.standard_normal((sum(extend), heads, 576)).astype(np.float32)
    slots = [b.req_to_token[r, :s].numpy() for r, s in
             zip(b.req_pool_indices.tolist(), b.seq_lens.tolist())]
    return b, rows, q, slots


@pytest.mark.parametrize("seed", [0, 1])
def test_extend_matches_float64_oracle(seed):
    prefix, extend = [0, 7, 30, 5], [5, 1, 12, 0]
    b, rows, q, slots = _setup(seed, prefix, extend)
    got = torch_native_mla_extend(torch.from_numpy(q), torch.from_numpy(rows)[:, None, :],
                                  b.req_to_token, b.req_pool_indices, b.seq_lens,
                                  b.extend_prefix_lens, b.extend_seq_lens, sm_scale=SCALE)
    want = dense_oracle(q, rows, slots, extend, causal=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5)


def test_decode_matches_float64_oracle_and_bf16_is_sglangs_dtype():
    prefix, extend = [9, 0, 40], [1, 1, 1]
    b, rows, q, slots = _setup(3, prefix, extend)
    got = torch_native_mla_decode(torch.from_numpy(q), torch.from_numpy(rows), b.req_to_token,
                                  b.req_pool_indices, b.seq_lens, sm_scale=SCALE)
    want = dense_oracle(q, rows, slots, extend, causal=False)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5)
    bf = torch_native_mla_decode(torch.from_numpy(q).bfloat16(),
                                 torch.from_numpy(rows).bfloat16(), b.req_to_token,
                                 b.req_pool_indices, b.seq_lens, sm_scale=SCALE)
    assert bf.dtype == torch.bfloat16
    rel = np.abs(bf.float().numpy() - want).max() / np.abs(want).max()
    assert 0 < rel < 3e-2  # bf16 rounding of inputs, SDPA in bf16


def test_extend_padded_query_trick_is_bottom_right_causal():
    # the first new token of a request with prefix 6 must see exactly 7 keys
    b, rows, q, slots = _setup(4, [6], [3])
    got = torch_native_mla_extend(torch.from_numpy(q), torch.from_numpy(rows), b.req_to_token,
                                  b.req_pool_indices, b.seq_lens, b.extend_prefix_lens,
                                  b.extend_seq_lens, sm_scale=SCALE)
    only_7 = dense_oracle(q[:1], rows, [slots[0][:7]], [1], causal=False)
    np.testing.assert_allclose(got[:1].numpy(), only_7, rtol=2e-5, atol=2e-5)


def test_extend_rejects_inconsistent_lengths():
    b, rows, q, _ = _setup(5, [2, 3], [1, 1])
    with pytest.raises(ValueError, match=r"request 1: extend_prefix_lens \(3\) \+ extend_seq_lens"
                                         r" \(2\) must equal seq_lens \(4\)"):
        torch_native_mla_extend(torch.from_numpy(q), torch.from_numpy(rows), b.req_to_token,
                                b.req_pool_indices, b.seq_lens, b.extend_prefix_lens,
                                torch.tensor([1, 2], dtype=torch.int32), sm_scale=SCALE)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_csr_dense_consumer_matches_oracle_on_padded_static_buffers(mode):
    prefix, extend = ([12, 0, 33, 4], [1, 1, 1, 1]) if mode == "decode" else ([3, 0, 20], [4, 6, 2])
    b, rows, q, slots = _setup(6, prefix, extend, page_size=1)
    kv_lens = [len(s) for s in slots]
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(extend)]).astype(np.int32)
    cap = kv_indptr[-1] + 37  # a static buffer larger than the batch, tail filled with slot 0
    kv_indices = np.zeros(cap, np.int32)
    kv_indices[: kv_indptr[-1]] = np.concatenate(slots)
    q_pad = np.concatenate([q, np.ones((3,) + q.shape[1:], np.float32)])  # 3 padded rows
    got = csr_mla_attention_dense(torch.from_numpy(q_pad), torch.from_numpy(rows),
                                  torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr),
                                  torch.from_numpy(kv_indices), sm_scale=SCALE)
    want = dense_oracle(q, rows, slots, extend, causal=True)
    np.testing.assert_allclose(got[: len(q)].numpy(), want, rtol=2e-5, atol=2e-5)
    assert not got[len(q):].any()
