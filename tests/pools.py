"""Test helpers: lay logical sequences out in a paged pool, NumPy restatements of the formulas."""

from __future__ import annotations

import functools

import numpy as np

from funcmla.layout import next_power_of_two as next_pow2  # noqa: F401  (the tests' name)


def layout_requests(lens, page_size, *, rng, max_context_len, num_req_slots=None, extra_pages=3):
    """Place each request's tokens on randomly chosen pages (page 0 reserved).

    Returns (req_to_token [R, C] int32, req_pool_indices [B] int32, num_pages, owner) where
    owner[slot] = (request, position) for every live slot, (-1, -1) elsewhere.
    """
    lens = np.asarray(lens, np.int64)
    batch = len(lens)
    pages_per = -(-lens // page_size)
    num_pages = int(pages_per.sum()) + extra_pages
    perm = rng.permutation(np.arange(1, num_pages + 1))
    num_req_slots = num_req_slots or batch + 2
    req_pool_indices = rng.permutation(np.arange(1, num_req_slots))[:batch].astype(np.int32)
    req_to_token = np.zeros((num_req_slots, max_context_len), np.int32)
    owner = np.full(((num_pages + 1) * page_size, 2), -1, np.int64)
    k = 0
    for i, n in enumerate(lens):
        pages = perm[k : k + pages_per[i]]
        k += pages_per[i]
        t = np.arange(n)
        slots = pages[t // page_size] * page_size + t % page_size
        req_to_token[req_pool_indices[i], :n] = slots
        owner[slots, 0] = i
        owner[slots, 1] = t
    return req_to_token, req_pool_indices, num_pages, owner


def scattered_requests(rng, num_requests: int, max_len: int, num_slots: int, *, empty: int):
    """`num_requests` requests of 1..max_len tokens (request `empty` has none) on distinct random
    slots of 1..num_slots - 1, request i on req_to_token row i + 1 (row 0 unused).

    Returns (lens int32 [N], req_to_token int32 [N + 1, max_len], req_pool_indices int32 [N])."""
    lens = rng.integers(1, max_len + 1, num_requests).astype(np.int32)
    lens[empty] = 0
    req_to_token = np.zeros((num_requests + 1, max_len), np.int32)
    perm = rng.permutation(np.arange(1, num_slots))
    k = 0
    for i, n in enumerate(lens):
        req_to_token[i + 1, :n] = perm[k: k + n]
        k += n
    return lens, req_to_token, np.arange(1, num_requests + 1, dtype=np.int32)


def gather_oracle(req_to_token, req_pool_indices, kv_lens, kv_start=None):
    """Plain loops: SGLang's create_flashinfer_kv_indices semantics."""
    kv_lens = np.asarray(kv_lens)
    kv_start = np.zeros_like(kv_lens) if kv_start is None else np.asarray(kv_start)
    indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    out = np.zeros(int(indptr[-1]), np.int32)
    for i, (r, n, s) in enumerate(zip(req_pool_indices, kv_lens, kv_start)):
        for j in range(n):
            out[indptr[i] + j] = req_to_token[r, s + j]
    return indptr, out


@functools.lru_cache(maxsize=8)
def _latent_base(seed: int, dim: int):
    """The 4096 base rows of `latent_rows` (drawn once per (seed, dim); read-only)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((4096, dim)).astype(np.float32)
    base.flags.writeable = False
    return base, rng.bit_generator.state


def latent_rows(owner, dim, seed=0):
    """Deterministic latent row per (request, position); page 0 / free slots get noise too."""
    base, rng_state = _latent_base(seed, dim)
    rng = np.random.default_rng(seed)
    rng.bit_generator.state = rng_state  # continue the stream right after the base rows
    req, pos = owner[:, 0], owner[:, 1]
    key = np.where(req >= 0, (req * 7919 + pos * 31) % 4096, rng.integers(0, 4096, len(req)))
    rows = base[key] * 0.5
    rows += np.where(req[:, None] >= 0, (pos[:, None] % 97) * 1e-3, 0.0)
    return rows.astype(np.float32)


def attention_oracle_f64(q, pool, qo_indptr, kv_indptr, kv_indices, sm_scale, v_dim, causal=True):
    """Float64 NumPy restatement of bottom-right-causal absorbed MLA attention."""
    q = np.asarray(q, np.float64)
    pool = np.asarray(pool, np.float64)
    T, H, _ = q.shape
    out = np.zeros((T, H, v_dim))
    lse = np.full((T, H), np.inf)
    for b in range(len(qo_indptr) - 1):
        q0, q1 = qo_indptr[b], qo_indptr[b + 1]
        k0, k1 = kv_indptr[b], kv_indptr[b + 1]
        kv = pool[kv_indices[k0:k1]]
        for j in range(q1 - q0):
            vis = (k1 - k0) - ((q1 - q0) - 1 - j) if causal else (k1 - k0)
            vis = max(0, min(vis, k1 - k0))
            if vis == 0:
                continue
            s = q[q0 + j] @ kv[:vis].T * sm_scale  # [H, vis]
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m)
            out[q0 + j] = p @ kv[:vis, :v_dim] / p.sum(-1, keepdims=True)
            lse[q0 + j] = m[:, 0] + np.log(p.sum(-1))
    return out, lse


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
