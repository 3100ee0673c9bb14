"""Tensor parallelism over query heads: SGLang's `--tp` for MLA attention.

Each device of the mesh axis `axis` gets `H / tp` consecutive heads of q; the latent KV pool,
the metadata and the work plan are replicated (MLA has one latent KV head, so every TP rank
reads the whole pool, as SGLang's MLA backends do); out and lse come back sharded by heads,
`P(None, axis)`, equal to the single-device call. No communication: heads are independent.

    tp_mla_decode           funcmla.attention.pallas.mla_decode
    tp_attention_reference  funcmla.attention.mla_attention_reference
    tp_run_work_plan        funcmla.attention.executor.run_work_plan; the plan is built for the
                            local head count (`DecodePlanConfig(num_heads=H // tp)`), as each
                            SGLang TP rank plans for its own heads

Bad layouts (heads not divisible, a mesh without the axis) fail before any compile.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from funcmla.layout import PageTable
from funcmla.parallel.local import local_attention
from funcmla.parallel.mesh import TP_AXIS, require_axis, shard_map
from funcmla.parallel.placement import place, place_tree

__all__ = ["local_heads", "tp_mla_decode", "tp_attention_reference", "tp_run_work_plan"]


def local_heads(num_heads: int, mesh: Mesh, axis: str = TP_AXIS) -> int:
    """Heads per device: `num_heads // tp`; a ValueError naming the axis unless it divides."""
    tp = require_axis(mesh, axis)
    if num_heads % tp:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the {axis!r} axis size "
            f"{tp}: tensor parallelism gives every device the same number of heads")
    return num_heads // tp


def _check_q(q) -> None:
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be [T, H, D], got shape {getattr(q, 'shape', None)}")


@functools.lru_cache(maxsize=64)
def _head_sharded(impl: str, mesh: Mesh, axis: str, static: tuple) -> Any:
    kw = dict(static)

    def body(q, kv_pool, metadata, plan):
        return local_attention(impl, q, kv_pool, metadata, plan, **kw)

    q_spec = P(None, axis, None)
    return jax.jit(shard_map(body, mesh=mesh, in_specs=(q_spec, P(), P(), P()),
                             out_specs=(q_spec, P(None, axis))))


def _run(impl: str, q, kv_pool, metadata, plan, *, mesh: Mesh, axis: str, static: dict):
    _check_q(q)
    local_heads(q.shape[1], mesh, axis)
    q = place(q, NamedSharding(mesh, P(None, axis, None)))
    kv_pool, metadata, plan = place_tree((kv_pool, metadata, plan), mesh)
    fn = _head_sharded(impl, mesh, axis, tuple(sorted(static.items())))
    return fn(q, kv_pool, metadata, plan)


class _CSR(NamedTuple):
    """The token CSR with the metadata field names (`local_attention` reads them)."""

    qo_indptr: Any
    kv_indptr: Any
    kv_indices: Any


def tp_mla_decode(q: jax.Array, kv_pool: jax.Array, *, mesh: Mesh, axis: str = TP_AXIS,
                  kv_indptr: jax.Array | None = None, kv_indices: jax.Array | None = None,
                  page_table: PageTable | None = None, **kwargs) -> tuple[jax.Array, jax.Array]:
    """`mla_decode` with q `[T, H, 576]` split by heads over `axis`: out `[T, H, 512]` and lse
    `[T, H]` sharded `P(None, axis)`. Other keyword arguments as `mla_decode` (static)."""
    if page_table is not None:
        if kv_indptr is not None or kv_indices is not None:
            raise ValueError("pass either page_table or (kv_indptr, kv_indices), not both")
        return _run("pallas_pages", q, kv_pool, page_table, None, mesh=mesh, axis=axis,
                    static=kwargs)
    if kv_indptr is None or kv_indices is None:
        raise ValueError("pass kv_indptr and kv_indices (token CSR) or page_table")
    return _run("pallas", q, kv_pool, _CSR(None, kv_indptr, kv_indices), None,
                mesh=mesh, axis=axis, static=kwargs)


def tp_attention_reference(q: jax.Array, kv_pool: jax.Array, qo_indptr: jax.Array,
                           kv_indptr: jax.Array, kv_indices: jax.Array, *, mesh: Mesh,
                           axis: str = TP_AXIS, **kwargs) -> tuple[jax.Array, jax.Array]:
    """`mla_attention_reference` with q split by heads over `axis` (kwargs static, as there)."""
    return _run("reference", q, kv_pool, _CSR(qo_indptr, kv_indptr, kv_indices), None,
                mesh=mesh, axis=axis, static=kwargs)


def tp_run_work_plan(q: jax.Array, kv_pool: jax.Array, metadata: Any, plan: Any, *,
                     mesh: Mesh, axis: str = TP_AXIS, **kwargs) -> tuple[jax.Array, jax.Array]:
    """`run_work_plan` with q split by heads over `axis`; `plan` is the local-heads plan
    (replicated), kwargs static as in `run_work_plan`."""
    return _run("executor", q, kv_pool, metadata, plan, mesh=mesh, axis=axis, static=kwargs)
