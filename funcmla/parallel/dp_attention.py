"""DP attention: every rank attends over its own requests with its own metadata, plan and KV
pool, in one SPMD program over the mesh's "dp" axis (heads further split over "tp" when the
mesh has one: SGLang's attention TP inside a DP rank); the outputs then come back in the global
request order (SGLang's gather of hidden states across DP ranks after attention).

    step = build_dp_step(layout, mesh, inputs)         per rank: rank_step, pad_step, on the
                                                       rank's own devices; stacked [dp, ...]
    q    = stack_rows(rank_rows(q_global, split, layout), mesh)      [dp, max_bs, H, 576]
    pool = stack_pools(pools, mesh)                                  [dp, slots, 576]
    out, lse = dp_attention(q, pool, step, mesh=mesh, layout=layout, impl="pallas", ...)
    out, lse = gather_global(out, lse, split, mesh=mesh)             [N, H, 512], [N, H]

Under `jax.distributed` every process calls the same functions; `build_dp_step` and the
`stack_*` helpers touch only the ranks with devices in this process (others may be None).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from funcmla.parallel.dp import DPLayout, DPStep, pad_step, rank_step
from funcmla.parallel.dp_schedule import DPSplit
from funcmla.parallel.local import local_attention
from funcmla.parallel.mesh import DP_AXIS, TP_AXIS, require_axis, shard_map
from funcmla.parallel.placement import local_ranks, rank_devices, stack_ranks
from funcmla.parallel.tp import local_heads

__all__ = ["build_dp_step", "rank_rows", "stack_rows", "stack_pools", "dp_attention",
           "gather_global", "head_axis_of"]


def head_axis_of(mesh: Mesh, head_axis: str | None) -> str | None:
    """The head (TP) axis: the named one (which must exist), else the mesh's "tp" if any."""
    if head_axis is not None:
        require_axis(mesh, head_axis)
        return head_axis
    return TP_AXIS if TP_AXIS in mesh.axis_names else None


def _first_local_device(mesh: Mesh, rank: int, axis: str) -> jax.Device:
    me = jax.process_index()
    return next(d for d in rank_devices(mesh, rank, axis) if d.process_index == me)


def build_dp_step(layout: DPLayout, mesh: Mesh,
                  inputs: Sequence[tuple[Any, Any, Any] | None], *,
                  axis: str = DP_AXIS) -> DPStep:
    """Rank-stacked `DPStep` (`[dp, ...]`, sharded over `axis`). inputs[r] is rank r's
    `(req_to_token, req_pool_indices, seq_lens)` (None for ranks held by other processes).
    Each rank is built by `rank_step` on its own first device, then padded (`pad_step`)."""
    layout.check_mesh(mesh, axis)
    if len(inputs) != layout.dp:
        raise ValueError(f"build_dp_step got inputs for {len(inputs)} ranks, DPLayout has "
                         f"{layout.dp}")
    per_rank: list[DPStep | None] = [None] * layout.dp
    for r in local_ranks(mesh, axis):
        if inputs[r] is None:
            raise ValueError(f"DP rank {r} has devices in this process but its inputs are None")
        rank = layout.ranks[r]
        req_to_token, rpi, lens = inputs[r]
        if np.shape(rpi)[0] > rank.max_bs:
            raise ValueError(f"DP rank {r}: {np.shape(rpi)[0]} requests exceed its buffers' "
                             f"max_bs={rank.max_bs}")
        dev = _first_local_device(mesh, r, axis)
        args = jax.device_put((jnp.asarray(req_to_token, jnp.int32), jnp.asarray(rpi, jnp.int32),
                               jnp.asarray(lens, jnp.int32)), dev)
        step = rank_step(*args, rank=rank, plan_config=layout.plan_config(r))
        per_rank[r] = pad_step(step, layout=layout)
    return stack_ranks(per_rank, mesh, axis=axis)


def rank_rows(x: Any, split: DPSplit, layout: DPLayout, *, rows_per_request: int = 1
              ) -> list[np.ndarray]:
    """Host: the rows of a global `[N * rows_per_request, ...]` array that each rank holds,
    in rank order, zero-padded to `layout.max_bs * rows_per_request` rows."""
    x = np.asarray(x)
    s = rows_per_request
    if x.shape[0] != split.rank_of.shape[0] * s:
        raise ValueError(f"x has {x.shape[0]} rows; {split.rank_of.shape[0]} requests of "
                         f"{s} rows need {split.rank_of.shape[0] * s}")
    out = []
    for ids in split.requests:
        rows = (ids[:, None] * s + np.arange(s)[None, :]).reshape(-1)
        block = np.zeros((layout.max_bs * s,) + x.shape[1:], x.dtype)
        block[: len(rows)] = x[rows]
        out.append(block)
    return out


def stack_rows(per_rank: Sequence[Any], mesh: Mesh, *, axis: str = DP_AXIS,
               head_axis: str | None = None) -> jax.Array:
    """Rank-stacked q `[dp, T, H, D]`, sharded `P(axis, None, head_axis)`."""
    ha = head_axis_of(mesh, head_axis)
    return stack_ranks(per_rank, mesh, axis=axis,
                       spec_tail=lambda nd: (None, ha) + (None,) * (nd - 2))


def stack_pools(per_rank: Sequence[Any], mesh: Mesh, *, axis: str = DP_AXIS) -> jax.Array:
    """Rank-stacked KV pools `[dp, slots, D]` (each rank's own cache; smaller ones are padded
    with zero rows, which no index of theirs reaches)."""
    held = [p for p in per_rank if p is not None]
    slots = max(np.shape(p)[0] for p in held)
    padded = [None if p is None else
              jnp.pad(jnp.asarray(p), ((0, slots - np.shape(p)[0]), (0, 0))) for p in per_rank]
    return stack_ranks(padded, mesh, axis=axis)


@functools.lru_cache(maxsize=64)
def _rank_program(impl: str, mesh: Mesh, axis: str, head_axis: str | None, static: tuple):
    kw = dict(static)

    def body(q, kv_pool, step):
        step = jax.tree_util.tree_map(lambda x: x[0], step)
        out, lse = local_attention(impl, q[0], kv_pool[0], step.metadata, step.plan, **kw)
        return out[None], lse[None]

    q_spec = P(axis, None, head_axis, None)
    return jax.jit(shard_map(body, mesh=mesh, in_specs=(q_spec, P(axis), P(axis)),
                             out_specs=(q_spec, P(axis, None, head_axis))))


def dp_attention(q: jax.Array, kv_pools: jax.Array, step: DPStep, *, mesh: Mesh,
                 layout: DPLayout, impl: str = "pallas", axis: str = DP_AXIS,
                 head_axis: str | None = None, **static) -> tuple[jax.Array, jax.Array]:
    """Each rank's decode attention over its own batch.

    q [dp, max_bs, H, 576] (`stack_rows`), kv_pools [dp, slots, 576] (`stack_pools`), step
    (`build_dp_step`). impl: "pallas" (`mla_decode`), "executor" (`run_work_plan` over the
    rank's plan) or "reference". static: the single-device function's static keywords
    (`sm_scale`, `interpret`, ...); KV bounds default to the layout's `max_context_len` and
    the executor's head folding to the plan's.
    Returns out [dp, max_bs, H, 512] and lse [dp, max_bs, H], rank-stacked.
    """
    layout.check_mesh(mesh, axis)
    ha = head_axis_of(mesh, head_axis)
    if getattr(q, "ndim", None) != 4 or q.shape[:2] != (layout.dp, layout.max_bs):
        raise ValueError(f"q must be [dp, max_bs, H, D] = [{layout.dp}, {layout.max_bs}, H, D],"
                         f" got {getattr(q, 'shape', None)}")
    layout.check_heads(local_heads(q.shape[2], mesh, ha) if ha else q.shape[2])
    if impl == "executor":
        if layout.plan is None:
            raise ValueError("impl='executor' needs DPLayout.plan (a DecodePlanConfig)")
        static.setdefault("max_qo_span", 1)
        static.setdefault("max_kv_span", layout.max_context_len)
        if layout.plan.qk_batch_ratio > 1:
            static.setdefault("qk_batch_ratio", layout.plan.qk_batch_ratio)
            static.setdefault("uni_seqlen_qo", 1)
    else:
        static.setdefault("max_kv_len", layout.max_context_len)
    fn = _rank_program(impl, mesh, axis, ha, tuple(sorted(static.items())))
    return fn(q, kv_pools, step)


@functools.lru_cache(maxsize=64)
def _gather_program(mesh: Mesh, head_axis: str | None):
    out_s = NamedSharding(mesh, P(None, head_axis, None))
    lse_s = NamedSharding(mesh, P(None, head_axis))

    def gather(out, lse, rows):
        flat_out = out.reshape((-1,) + out.shape[2:])
        flat_lse = lse.reshape((-1,) + lse.shape[2:])
        return flat_out[rows], flat_lse[rows]

    return jax.jit(gather, out_shardings=(out_s, lse_s))


def gather_global(out: jax.Array, lse: jax.Array, split: DPSplit, *, mesh: Mesh,
                  head_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Rank-stacked outputs back in the global request order: out [N, H, Dv], lse [N, H],
    replicated over the DP axis (an all-gather), heads still split over the head axis."""
    ha = head_axis_of(mesh, head_axis)
    rows = split.rank_of * out.shape[1] + split.slot_of
    rows_arr = jax.make_array_from_callback(
        rows.shape, NamedSharding(mesh, P()), lambda idx: rows.astype(np.int32)[idx])
    return _gather_program(mesh, ha)(out, lse, rows_arr)

