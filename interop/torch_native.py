"""A torch re-statement of SGLang's torch-native MLA attention (`torch_native_backend.py`).

No metadata is built: for every request r the KV is gathered straight from the request table,
`cache[req_to_token[req_pool_indices[r], :seq_lens[r]]]`, and attended with
`scaled_dot_product_attention(..., scale=sm_scale, enable_gqa=True)` (H query heads, one latent
KV head; K = the 576-wide latent row, V = its first `v_head_dim` columns). This is what a user
compares funcmla against (SGLang's `torch_native_backend.py`).

* decode: one query per request, `is_causal=False` over all `seq_lens[r]` keys.
* extend: the `extend_seq_lens[r]` queries are placed at rows `[prefix, seq_len)` of a
  `seq_len`-row scratch query (prefix = `extend_prefix_lens[r]`), SDPA runs with
  `is_causal=True` (top-left aligned), and rows `[prefix:]` are kept: on the padded query this
  equals bottom-right causal attention over the prefix.

`compute_dtype=None` computes in the query dtype, as SGLang does (bf16 SDPA); pass
`torch.float32` for a float32 restatement. fp8 caches are cast to the compute dtype (the newer
SGLang variant). The per-request Python loop syncs to the host (`.tolist()`); this is a
reference, not a fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["torch_native_mla_decode", "torch_native_mla_extend"]


def _latent_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """[slots, 1, D] (SGLang's MLA pool layout) or [slots, D] -> [slots, D]."""
    if kv_cache.dim() == 3 and kv_cache.shape[1] == 1:
        return kv_cache[:, 0, :]
    if kv_cache.dim() == 2:
        return kv_cache
    raise ValueError(f"kv_cache must be [slots, 1, D] or [slots, D], got {tuple(kv_cache.shape)}")


def _sdpa(q, k, v, *, scale, causal):
    """q [L, H, D], k [S, D], v [S, Dv] -> [L, H, Dv] (one KV head shared by all H heads)."""
    qh = q.movedim(0, 1)  # [H, L, D]
    kh = k.unsqueeze(0)  # [1, S, D]
    vh = v.unsqueeze(0)  # [1, S, Dv]
    out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, is_causal=causal,
                                         enable_gqa=True)
    return out.movedim(1, 0)


def _check_common(q, req_to_token, req_pool_indices, seq_lens, v_head_dim, d):
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, D], got {tuple(q.shape)}")
    if q.shape[-1] != d:
        raise ValueError(f"q width {q.shape[-1]} != cache row width {d}")
    if not 0 < v_head_dim <= d:
        raise ValueError(f"v_head_dim={v_head_dim} must be in (0, {d}]")
    if req_pool_indices.shape != seq_lens.shape or req_pool_indices.dim() != 1:
        raise ValueError(
            f"req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must both be [batch]"
        )
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [pool, max_context_len], got {req_to_token.shape}")


def torch_native_mla_decode(
    q: torch.Tensor,  # [B, H, D]  one query per request
    kv_cache: torch.Tensor,  # [slots, 1, D] or [slots, D]
    req_to_token: torch.Tensor,  # int [pool, max_context_len]  token slots
    req_pool_indices: torch.Tensor,  # int [B]
    seq_lens: torch.Tensor,  # int [B]  tokens, including the one being decoded
    *,
    sm_scale: float,
    v_head_dim: int = 512,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode attention per SGLang's torch-native backend -> [B, H, v_head_dim] (compute dtype)."""
    rows = _latent_rows(kv_cache)
    _check_common(q, req_to_token, req_pool_indices, seq_lens, v_head_dim, rows.shape[-1])
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"decode needs one query per request: q has {q.shape[0]} rows, "
                         f"batch is {seq_lens.shape[0]}")
    dtype = compute_dtype or q.dtype
    out = q.new_zeros((q.shape[0], q.shape[1], v_head_dim), dtype=dtype)
    for r, (pool_idx, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        if seq_len == 0:
            continue
        slots = req_to_token[pool_idx, :seq_len].long()
        k = rows[slots].to(dtype)
        out[r] = _sdpa(q[r : r + 1].to(dtype), k, k[:, :v_head_dim], scale=sm_scale,
                       causal=False)[0]
    return out


def torch_native_mla_extend(
    q: torch.Tensor,  # [T, H, D]  T = sum(extend_seq_lens), requests in batch order
    kv_cache: torch.Tensor,  # [slots, 1, D] or [slots, D]
    req_to_token: torch.Tensor,  # int [pool, max_context_len]
    req_pool_indices: torch.Tensor,  # int [B]
    seq_lens: torch.Tensor,  # int [B]  prefix + new tokens
    extend_prefix_lens: torch.Tensor,  # int [B]
    extend_seq_lens: torch.Tensor,  # int [B]  new tokens (queries)
    *,
    sm_scale: float,
    v_head_dim: int = 512,
    causal: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Extend attention per SGLang's torch-native backend -> [T, H, v_head_dim] (compute dtype).

    Checks `extend_prefix_lens + extend_seq_lens == seq_lens` and `T == sum(extend_seq_lens)`.
    """
    rows = _latent_rows(kv_cache)
    _check_common(q, req_to_token, req_pool_indices, seq_lens, v_head_dim, rows.shape[-1])
    seq = seq_lens.tolist()
    pre = extend_prefix_lens.tolist()
    ext = extend_seq_lens.tolist()
    for r, (s, p, e) in enumerate(zip(seq, pre, ext)):
        if p + e != s or p < 0 or e < 0:
            raise ValueError(
                f"request {r}: extend_prefix_lens ({p}) + extend_seq_lens ({e}) must equal "
                f"seq_lens ({s})"
            )
    if q.shape[0] != sum(ext):
        raise ValueError(f"q has {q.shape[0]} rows, sum(extend_seq_lens) is {sum(ext)}")
    dtype = compute_dtype or q.dtype
    out = q.new_zeros((q.shape[0], q.shape[1], v_head_dim), dtype=dtype)
    start = 0
    for r, pool_idx in enumerate(req_pool_indices.tolist()):
        s, p, e = seq[r], pre[r], ext[r]
        if e == 0:
            continue
        slots = req_to_token[pool_idx, :s].long()
        k = rows[slots].to(dtype)
        q_scratch = q.new_zeros((s, q.shape[1], q.shape[2]), dtype=dtype)
        q_scratch[p:] = q[start : start + e].to(dtype)
        o = _sdpa(q_scratch, k, k[:, :v_head_dim], scale=sm_scale, causal=causal)
        out[start : start + e] = o[p:]
        start += e
    return out
