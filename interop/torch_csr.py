"""A CUDA-graph-capturable torch consumer of token-granular metadata (static shapes, no syncs).

`csr_mla_attention_dense` reads `qo_indptr`, `kv_indptr` and the whole static `kv_indices`
buffer and computes absorbed MLA attention with dense masking: every query row scores every
buffer entry, and entries outside its request (or past its bottom-right causal limit, or past
`kv_indptr[-1]`) are masked. Work is O(T x capacity x H): it is a correctness consumer for
CUDA-graph capture / replay tests of the metadata buffers (shapes never change between replays,
only the values), not a fast kernel.

    q          [T, H, D]      T static; rows past qo_indptr[-1] get 0
    kv_rows    [slots, D]     latent pool rows (V = first v_head_dim columns)
    qo_indptr  int32 [B + 1]  query tokens
    kv_indptr  int32 [B + 1]  KV tokens
    kv_indices int32 [cap]    token slots; entries past kv_indptr[-1] must still be valid rows
                              (funcmla fills them with slot 0)
"""

from __future__ import annotations

import torch

__all__ = ["csr_mla_attention_dense"]


def csr_mla_attention_dense(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    sm_scale: float,
    v_head_dim: int = 512,
    causal: bool = True,
) -> torch.Tensor:
    """-> out float32 [T, H, v_head_dim]; a query with no visible key gets 0."""
    if kv_rows.dim() == 3 and kv_rows.shape[1] == 1:
        kv_rows = kv_rows[:, 0]
    num_q, num_heads, width = q.shape
    batch = qo_indptr.shape[0] - 1
    cap = kv_indices.shape[0]
    dev = q.device
    t = torch.arange(num_q, device=dev, dtype=torch.int32)
    e = torch.arange(cap, device=dev, dtype=torch.int32)
    # request of each query row / buffer entry (batch = past the live range)
    q_req = torch.searchsorted(qo_indptr[1:].contiguous(), t, right=True)
    e_req = torch.searchsorted(kv_indptr[1:].contiguous(), e, right=True)
    q_reqc = q_req.clamp(max=batch - 1)
    q_len = qo_indptr[q_reqc + 1] - qo_indptr[q_reqc]
    kv_len = kv_indptr[q_reqc + 1] - kv_indptr[q_reqc]
    j = t - qo_indptr[q_reqc]
    visible = kv_len - (q_len - 1 - j) if causal else kv_len  # [T]
    pos = e - kv_indptr[e_req.clamp(max=batch - 1)]  # [cap] position within its request
    mask = (q_req[:, None] == e_req[None, :]) & (q_req[:, None] < batch)
    mask &= pos[None, :] < visible[:, None]  # [T, cap]
    k = kv_rows[kv_indices.long()].float()  # [cap, D]
    s = torch.einsum("thd,ed->the", q.float(), k) * sm_scale  # [T, H, cap]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("the,ed->thd", p, k[:, :v_head_dim])
    return torch.where(denom > 0, out / denom.clamp_min(1e-30), torch.zeros_like(out))
