"""The float64 NumPy attention each simulated step is compared with: computed on a dense,
unpaged copy of the keys, so no pool, page table or kernel is shared with the path under test."""

from __future__ import annotations

import numpy as np

__all__ = ["oracle_attention"]


def oracle_attention(q: np.ndarray, keys: list[np.ndarray], q_lens: list[int], scale: float,
                     v_dim: int) -> np.ndarray:
    """Float64 bottom-right-causal MLA attention, request by request on dense keys.

    q [T, H, D] (rows of request i follow those of i - 1); keys[i] [kv_len_i, D]."""
    out = np.zeros(q.shape[:2] + (v_dim,))
    q0 = 0
    for k, nq in zip(keys, q_lens):
        k = k.astype(np.float64)
        qq = q[q0:q0 + nq].astype(np.float64)
        s = np.einsum("thd,sd->ths", qq, k) * scale
        vis = len(k) - (nq - 1 - np.arange(nq))  # keys visible to each query
        s = np.where(np.arange(len(k))[None, None, :] < vis[:, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[q0:q0 + nq] = np.einsum("ths,sd->thd", p / p.sum(-1, keepdims=True), k[:, :v_dim])
        q0 += nq
    return out
