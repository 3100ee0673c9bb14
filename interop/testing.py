"""Random paged batches for comparing funcmla's backend with SGLang's torch-native algorithm.

`random_paged_batch` lays requests out the way SGLang's paged allocator does: whole pages drawn
at random from pages 1..num_pages (page 0 reserved), token t of a request at slot
`page[t // page_size] * page_size + t % page_size`, and `req_to_token[r, t]` holding that slot.
The last `extend_seq_lens[i]` tokens of request i are this step's (their slots are
`out_cache_loc`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = ["PagedBatch", "random_paged_batch"]


@dataclasses.dataclass
class PagedBatch:
    """One step's request layout (torch int32 tensors on the host)."""

    req_to_token: torch.Tensor  # [pool, max_context_len]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]  prefix + new tokens
    extend_prefix_lens: torch.Tensor  # [B]
    extend_seq_lens: torch.Tensor  # [B]
    out_cache_loc: torch.Tensor  # [sum(extend_seq_lens)]  slots of the new tokens, batch order
    num_slots: int  # rows of the KV pool: (num_pages + 1) * page_size
    page_size: int


def random_paged_batch(
    rng: np.random.Generator,
    *,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    max_context_len: int,
    pool_size: int | None = None,
    num_pages: int | None = None,
) -> PagedBatch:
    """Allocate pages for `len(prefix_lens)` requests of `prefix + extend` tokens each."""
    if len(prefix_lens) != len(extend_lens):
        raise ValueError("prefix_lens and extend_lens must have the same length")
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    if max(seq) > max_context_len:
        raise ValueError(f"a request has {max(seq)} tokens > max_context_len={max_context_len}")
    batch = len(seq)
    pool_size = pool_size or batch + 3
    pages_needed = [-(-s // page_size) for s in seq]
    num_pages = num_pages or sum(pages_needed) + 8
    if num_pages < sum(pages_needed):
        raise ValueError(f"num_pages={num_pages} < {sum(pages_needed)} pages needed")
    free = rng.permutation(np.arange(1, num_pages + 1))
    req_to_token = np.zeros((pool_size, max_context_len), np.int32)
    rows = rng.choice(pool_size, size=batch, replace=False).astype(np.int32)
    out_loc = []
    taken = 0
    for i, (s, npg) in enumerate(zip(seq, pages_needed)):
        pages = free[taken : taken + npg]
        taken += npg
        t = np.arange(s)
        req_to_token[rows[i], :s] = pages[t // page_size] * page_size + t % page_size
        out_loc.append(req_to_token[rows[i], prefix_lens[i] : s])
    as_t = lambda a: torch.from_numpy(np.asarray(a, np.int32)).clone()  # noqa: E731  (aligned)
    return PagedBatch(
        req_to_token=as_t(req_to_token),
        req_pool_indices=as_t(rows),
        seq_lens=as_t(seq),
        extend_prefix_lens=as_t(prefix_lens),
        extend_seq_lens=as_t(extend_lens),
        out_cache_loc=as_t(np.concatenate(out_loc) if out_loc else np.zeros(0)),
        num_slots=(num_pages + 1) * page_size,
        page_size=page_size,
    )
