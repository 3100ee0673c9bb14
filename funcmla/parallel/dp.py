"""Data-parallel attention ranks: per-rank static capacities, per-rank metadata and work plans
from the single-device builders, and the padding that lets one SPMD program run them all.

Each DP rank (SGLang `--enable-dp-attention`) owns its requests, its KV pool and its buffers:

    DPRank(buffers=BufferPlan(max_bs, max_context_len), device=DeviceProfile)

`rank_step` builds a rank's `ForwardMetadata` (`funcmla.metadata.decode_metadata`, at the
rank's own `kv_indices_capacity`) and its `WorkPlan` (`funcmla.planners.plan_mla_decode`, over
the rank's own CU count), padded to the rank's `max_bs` with empty requests, as a CUDA graph
pads its batch. An IDLE rank (no requests) builds the same, all padding: its outputs are zero
and nothing it computes reaches the global output.

One program runs on every rank, so `pad_step` brings every rank's buffers to the layout's
common shape (the maxima over ranks): padded requests have no KV and no queries, padded CUs
no works, padded reduce groups no partials; the plan stays a valid plan of the same meaning.
SGLang pads the same way across DP ranks (`DpPaddingMode.MAX_LEN`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from funcmla.config import DeviceProfile
from funcmla.metadata import BufferPlan, ForwardMetadata, decode_metadata
from funcmla.parallel.dp_schedule import DPSplit
from funcmla.parallel.mesh import DP_AXIS, require_axis
from funcmla.planners import DecodePlanConfig, WorkPlan, mla_decode_plan_sizes, plan_mla_decode

__all__ = ["DPRank", "DPLayout", "DPStep", "rank_step", "pad_step", "check_split"]


@dataclasses.dataclass(frozen=True)
class DPRank:
    """One DP rank's static capacities: its metadata buffers (`buffers.max_bs` requests,
    `buffers.kv_indices_capacity` token slots; page_size 1, token-granular) and the device its
    work plan spreads over (`device.num_cu`)."""

    buffers: BufferPlan
    device: DeviceProfile

    def __post_init__(self):
        if not isinstance(self.buffers, BufferPlan):
            raise TypeError(f"DPRank.buffers must be a funcmla.metadata.BufferPlan, got "
                            f"{type(self.buffers).__name__}")
        if not isinstance(self.device, DeviceProfile):
            raise TypeError(f"DPRank.device must be a funcmla.config.DeviceProfile, got "
                            f"{type(self.device).__name__}")
        if self.buffers.num_draft_tokens:
            raise ValueError(f"DPRank.buffers.num_draft_tokens={self.buffers.num_draft_tokens}:"
                             " DP ranks run decode steps (one query per request)")

    @property
    def max_bs(self) -> int:
        return self.buffers.max_bs

    @property
    def kv_capacity(self) -> int:
        return self.buffers.kv_indices_capacity


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DPStep:
    """One decode step's metadata and work plan (of one rank, or rank-stacked `[dp, ...]`)."""

    metadata: ForwardMetadata
    plan: WorkPlan | None


@dataclasses.dataclass(frozen=True)
class DPLayout:
    """The ranks of a DP group and the decode plan they share (`plan.device` is replaced by
    each rank's device; `plan.num_heads` is the heads of one rank: H / attention TP). Static
    and hashable; `plan=None` builds metadata only (no executor path)."""

    ranks: tuple[DPRank, ...]
    plan: DecodePlanConfig | None = None

    def __post_init__(self):
        if not isinstance(self.ranks, tuple) or not self.ranks:
            raise ValueError(f"DPLayout.ranks must be a non-empty tuple of DPRank, got "
                             f"{self.ranks!r}")
        for r, rank in enumerate(self.ranks):
            if not isinstance(rank, DPRank):
                raise TypeError(f"DPLayout.ranks[{r}] must be a DPRank, got "
                                f"{type(rank).__name__}")
        if self.plan is not None:
            if not isinstance(self.plan, DecodePlanConfig):
                raise TypeError("DPLayout.plan must be a DecodePlanConfig or None")
            if self.plan.page_size != 1 or self.plan.max_seqlen_qo != 1:
                raise ValueError(
                    f"DPLayout.plan must plan token-granular decode (page_size=1, "
                    f"max_seqlen_qo=1), got page_size={self.plan.page_size}, "
                    f"max_seqlen_qo={self.plan.max_seqlen_qo}")

    @property
    def dp(self) -> int:
        return len(self.ranks)

    @property
    def max_bs(self) -> int:
        return max(r.max_bs for r in self.ranks)

    @property
    def kv_capacity(self) -> int:
        return max(r.kv_capacity for r in self.ranks)

    @property
    def max_context_len(self) -> int:
        return max(r.buffers.max_context_len for r in self.ranks)

    def plan_config(self, rank: int) -> DecodePlanConfig | None:
        if self.plan is None:
            return None
        return dataclasses.replace(self.plan, device=self.ranks[rank].device)

    def plan_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The common (padded) shape of each plan buffer: the maxima over ranks."""
        if self.plan is None:
            return None
        sizes = [mla_decode_plan_sizes(r.max_bs, self.plan_config(i))
                 for i, r in enumerate(self.ranks)]
        names = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
                 "reduce_partial_map")
        return {n: tuple(max(s) for s in zip(*(getattr(z, n) for z in sizes))) for n in names}

    def check_mesh(self, mesh: Mesh, axis: str = DP_AXIS) -> None:
        dp = require_axis(mesh, axis)
        if dp != self.dp:
            raise ValueError(f"DPLayout has {self.dp} ranks but the mesh's {axis!r} axis has "
                             f"size {dp}")

    def check_heads(self, local_heads: int) -> None:
        if self.plan is not None and self.plan.num_heads != local_heads:
            raise ValueError(
                f"DPLayout.plan.num_heads={self.plan.num_heads} but each device holds "
                f"{local_heads} heads (q heads / the 'tp' axis size): plan for the local heads")


def check_split(layout: DPLayout, split: DPSplit, seq_lens: Any) -> None:
    """Host check that every rank's batch fits its capacities; a ValueError naming the rank and
    the field (`max_bs`, `max_context_len`; these two bound `kv_indices_capacity`)."""
    if split.dp != layout.dp:
        raise ValueError(f"the split has {split.dp} ranks, DPLayout.ranks has {layout.dp}")
    seq_lens = np.asarray(seq_lens)
    if seq_lens.shape != split.rank_of.shape:
        raise ValueError(f"seq_lens has shape {seq_lens.shape}; the split has "
                         f"{split.rank_of.shape[0]} requests")
    for r, (rank, ids) in enumerate(zip(layout.ranks, split.requests)):
        lens = seq_lens[ids]
        if len(ids) > rank.max_bs:
            raise ValueError(f"DP rank {r}: {len(ids)} requests exceed its buffers' "
                             f"max_bs={rank.max_bs}")
        if len(ids) and lens.max() > rank.buffers.max_context_len:
            raise ValueError(f"DP rank {r}: seq_lens max {lens.max()} exceeds its buffers' "
                             f"max_context_len={rank.buffers.max_context_len}")


@functools.partial(jax.jit, static_argnames=("rank", "plan_config"))
def rank_step(req_to_token: jax.Array, req_pool_indices: jax.Array, seq_lens: jax.Array, *,
              rank: DPRank, plan_config: DecodePlanConfig | None) -> DPStep:
    """One rank's decode metadata and plan at its own static capacities.

    req_to_token [slots, max_context_len] int32; req_pool_indices, seq_lens int32 [b] with
    b <= rank.max_bs (padded here to max_bs with empty requests; b may be 0: an IDLE rank).
    """
    b = req_pool_indices.shape[0]
    if b > rank.max_bs or seq_lens.shape != (b,):
        raise ValueError(f"DP rank batch: req_pool_indices {req_pool_indices.shape}, seq_lens "
                         f"{seq_lens.shape}; at most max_bs={rank.max_bs} requests")
    pad = rank.max_bs - b
    rpi = jnp.pad(req_pool_indices.astype(jnp.int32), (0, pad))
    lens = jnp.pad(seq_lens.astype(jnp.int32), (0, pad))
    md = decode_metadata(req_to_token, rpi, lens, capacity=rank.kv_capacity)
    plan = None
    if plan_config is not None:
        plan = plan_mla_decode(md.qo_indptr, md.kv_indptr, md.kv_last_page_len,
                               config=plan_config, batch_size=rank.max_bs)
    return DPStep(metadata=md, plan=plan)


def _pad_edge(x: jax.Array, n: int) -> jax.Array:
    return jnp.pad(x, (0, n - x.shape[0]), mode="edge")


def _pad_zero(x: jax.Array, shape: Sequence[int], value=0) -> jax.Array:
    return jnp.pad(x, [(0, s - d) for s, d in zip(shape, x.shape)], constant_values=value)


@functools.partial(jax.jit, static_argnames=("layout",))
def pad_step(step: DPStep, *, layout: DPLayout) -> DPStep:
    """A rank's step padded to the layout's common shapes (same meaning, see the module doc)."""
    md = step.metadata
    b = layout.max_bs
    md = dataclasses.replace(
        md,
        kv_indptr=_pad_edge(md.kv_indptr, b + 1),
        qo_indptr=_pad_edge(md.qo_indptr, b + 1),
        kv_indices=_pad_zero(md.kv_indices, (layout.kv_capacity,)),
        kv_last_page_len=_pad_zero(md.kv_last_page_len, (b,), 1),
    )
    plan = step.plan
    if plan is not None:
        s = layout.plan_shapes()
        plan = dataclasses.replace(
            plan,
            work_indptr=_pad_edge(plan.work_indptr, s["work_indptr"][0]),
            work_info=_pad_zero(plan.work_info, s["work_info"]),
            reduce_indptr=_pad_edge(plan.reduce_indptr, s["reduce_indptr"][0]),
            reduce_final_map=_pad_zero(plan.reduce_final_map, s["reduce_final_map"]),
            reduce_partial_map=_pad_zero(plan.reduce_partial_map, s["reduce_partial_map"]),
        )
    return DPStep(metadata=md, plan=plan)
