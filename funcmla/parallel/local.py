"""What one device computes: the attention bodies that `shard_map` runs per device.

Each body takes the device's block of q `[T, H_local, D]`, its KV pool, its metadata and (for
the executor) its work plan, and returns `(out [T, H_local, Dv], lse [T, H_local])` from the
single-device public functions, unchanged: parallel code adds layout, never attention math.
"""

from __future__ import annotations

from typing import Any

import jax

from funcmla.attention.executor import run_work_plan
from funcmla.attention.pallas import mla_decode
from funcmla.attention.reference import mla_attention_reference

__all__ = ["IMPLS", "local_attention"]

IMPLS = ("pallas", "executor", "reference")


def local_attention(impl: str, q: jax.Array, kv_pool: jax.Array, metadata: Any, plan: Any,
                    **static) -> tuple[jax.Array, jax.Array]:
    """One device's decode attention by `impl`:

    pallas     `mla_decode` over the token CSR (`metadata.kv_indptr`, `.kv_indices`)
               ("pallas_pages": over a `PageTable` passed as `metadata`)
    executor   `run_work_plan(q, kv_pool, metadata, plan)` (AITER's reading of the plan)
    reference  `mla_attention_reference` (dense float32)
    """
    if impl == "pallas":
        return mla_decode(q, kv_pool, kv_indptr=metadata.kv_indptr,
                          kv_indices=metadata.kv_indices, **static)
    if impl == "pallas_pages":  # metadata is a funcmla.layout.PageTable
        return mla_decode(q, kv_pool, page_table=metadata, **static)
    if impl == "executor":
        return run_work_plan(q, kv_pool, metadata, plan, **static)
    if impl == "reference":
        return mla_attention_reference(q, kv_pool, metadata.qo_indptr, metadata.kv_indptr,
                                       metadata.kv_indices, **static)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
