"""Device meshes for attention across devices, and the one `shard_map` compatibility point.

A funcmla mesh has two named axes, in SGLang's rank order (tp fastest):

    "dp"   attention data parallelism: each index is a rank with its own batch, metadata,
           work plan and KV pool (`--enable-dp-attention`, `--dp`)
    "tp"   tensor parallelism over query heads inside a rank: q and the outputs are split by
           heads, the latent pool and the metadata are replicated (`--tp / --dp`)

SGLang numbers a GPU `tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank`
(`compute_dp_attention_world_info`), so `devices.reshape(dp, tp)` puts global device `i` at the
same place SGLang puts GPU `i`. Everything here is static Python: errors come before any compile.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = [
    "DP_AXIS",
    "TP_AXIS",
    "make_mesh",
    "sglang_mesh",
    "axis_size",
    "require_axis",
    "shard_map",
]

DP_AXIS = "dp"
TP_AXIS = "tp"


def shard_map(f: Callable, *, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`jax.shard_map` (jax >= 0.6) or `jax.experimental.shard_map.shard_map` (older).

    The replication check is off: Pallas calls (interpret mode included) carry no
    varying-manual-axes rule, and every output here is explicitly sharded or gathered.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                  check_rep=False)  # pragma: no cover


def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def make_mesh(*, dp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("dp", "tp") mesh over the first `dp * tp` devices (default: `jax.devices()`, every
    process's devices in global order, as `jax.distributed` numbers them)."""
    _positive("dp", dp)
    _positive("tp", tp)
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ValueError(
            f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, {len(devices)} available "
            "(on CPU: jax.config.update('jax_num_cpu_devices', N) before first use)")
    grid = np.asarray(devices[: dp * tp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP_AXIS, TP_AXIS))


def sglang_mesh(tp_size: int, dp_size: int = 1, enable_dp_attention: bool = False,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The attention mesh of one SGLang server launched with `--tp tp_size --dp dp_size
    [--enable-dp-attention]`: dp = dp_size and tp = tp_size // dp_size with DP attention, else
    dp = 1 and tp = tp_size.

    Without `--enable-dp-attention`, `--dp N` starts N independent servers (each its own
    `--tp` group, its own mesh); that is not one mesh, so it is refused here.
    """
    _positive("tp_size", tp_size)
    _positive("dp_size", dp_size)
    if not enable_dp_attention:
        if dp_size != 1:
            raise ValueError(
                f"dp_size={dp_size} without enable_dp_attention means {dp_size} independent "
                "replicas (SGLang's data-parallel controller), one mesh each: call "
                "sglang_mesh(tp_size) once per replica with its own devices")
        return make_mesh(dp=1, tp=tp_size, devices=devices)
    if tp_size % dp_size:
        raise ValueError(
            f"enable_dp_attention needs tp_size divisible by dp_size (SGLang's attention TP "
            f"size is tp_size // dp_size); got tp_size={tp_size}, dp_size={dp_size}")
    return make_mesh(dp=dp_size, tp=tp_size // dp_size, devices=devices)


def require_axis(mesh: Mesh, axis: str) -> int:
    """The size of `axis` in `mesh`; a ValueError naming the axis if the mesh lacks it."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has no axis {axis!r} (its axes: {tuple(mesh.axis_names)}); build it with "
            "funcmla.parallel.make_mesh or name the axis explicitly")
    return int(mesh.shape[axis])


def axis_size(mesh: Mesh, axis: str | None) -> int:
    """`require_axis`, with None meaning "no such axis" (size 1)."""
    return 1 if axis is None else require_axis(mesh, axis)
