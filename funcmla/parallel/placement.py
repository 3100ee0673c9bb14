"""Putting host or device data onto a mesh, the same way in one process and in many.

`place` lays a whole (global) value out with a `NamedSharding`; under `jax.distributed` every
process passes the same value and keeps only its own devices' blocks
(`jax.make_array_from_callback`). `stack_ranks` builds a rank-stacked global array
`[dp, ...]` from the blocks of the ranks this process holds
(`jax.make_array_from_single_device_arrays`): no process needs another's data.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from funcmla.parallel.mesh import DP_AXIS

__all__ = ["place", "place_tree", "rank_devices", "local_ranks", "stack_ranks"]


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` (NumPy or jax.Array, the global value) laid out with `sharding`."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if x.is_fully_addressable and sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place_tree(tree: Any, mesh: Mesh, spec: P = P()) -> Any:
    """`place` on every leaf of a pytree with one spec (default: replicated)."""
    sharding = NamedSharding(mesh, spec)
    return jax.tree_util.tree_map(lambda x: place(x, sharding), tree)


def rank_devices(mesh: Mesh, rank: int, axis: str = DP_AXIS) -> list[jax.Device]:
    """The devices of DP rank `rank` (its row of the mesh), addressable or not."""
    index = mesh.axis_names.index(axis)
    return list(np.take(mesh.devices, rank, axis=index).reshape(-1))


def local_ranks(mesh: Mesh, axis: str = DP_AXIS) -> list[int]:
    """The DP ranks with at least one device in this process."""
    me = jax.process_index()
    return [r for r in range(mesh.shape[axis])
            if any(d.process_index == me for d in rank_devices(mesh, r, axis))]


def stack_ranks(per_rank: Sequence[Any], mesh: Mesh, *, axis: str = DP_AXIS,
                spec_tail: Callable[[int], tuple] | None = None) -> Any:
    """Rank-stacked global pytree `[dp, ...]` from one pytree per rank (None for ranks this
    process does not hold). Every held rank's leaves must have the same shapes (pad first).

    spec_tail(ndim) gives the partition of a leaf's own dims (default: replicated), so a leaf
    of rank r becomes block r of a `P(axis, *spec_tail)` array, copied to each local device
    of the rank's mesh row.
    """
    dp = mesh.shape[axis]
    if len(per_rank) != dp:
        raise ValueError(f"stack_ranks got {len(per_rank)} ranks for the {axis!r} axis of "
                         f"size {dp}")
    held = local_ranks(mesh, axis)
    missing = [r for r in held if per_rank[r] is None]
    if missing:
        raise ValueError(f"ranks {missing} have devices in this process but no data")
    template = per_rank[held[0]]
    leaves0, treedef = jax.tree_util.tree_flatten(template)
    per_leaf = [jax.tree_util.tree_leaves(per_rank[r]) for r in held]
    out = []
    for i, leaf0 in enumerate(leaves0):
        shape = tuple(np.shape(leaf0))
        tail = spec_tail(len(shape)) if spec_tail is not None else (None,) * len(shape)
        sharding = NamedSharding(mesh, P(axis, *tail))
        global_shape = (dp,) + shape
        blocks = []
        index_map = sharding.addressable_devices_indices_map(global_shape)
        for dev, idx in index_map.items():
            r = idx[0].start or 0
            leaf = per_leaf[held.index(r)][i]
            if tuple(np.shape(leaf)) != shape:
                raise ValueError(f"rank {r}: leaf {i} has shape {np.shape(leaf)}, rank "
                                 f"{held[0]} has {shape}; pad every rank to one shape first")
            block = jnp.asarray(leaf)[None][(slice(None),) + tuple(idx[1:])]
            blocks.append(jax.device_put(block, dev))
        out.append(jax.make_array_from_single_device_arrays(global_shape, sharding, blocks))
    return jax.tree_util.tree_unflatten(treedef, out)
