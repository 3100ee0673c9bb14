"""Buffer sizes of the AITER decode work plan: a port of `get_mla_metadata_info_v1`.

AITER sizes the planner's output buffers on the host from static quantities only (batch size,
heads, `max_seqlen_qo`, dtypes, CU count); the planner then fills a prefix of each buffer. This is
the fast-mode (v1.2), non-sparse, non-intra-batch branch of `aiter/ops/attention.py:1136-1278`
at ROCm/aiter e4048607.
"""

from __future__ import annotations

import dataclasses

from funcmla.planners.decode_config import DecodePlanConfig

__all__ = ["DecodePlanSizes", "mla_decode_plan_sizes"]


@dataclasses.dataclass(frozen=True)
class DecodePlanSizes:
    """Static capacities of the decode plan buffers (all int32).

    work_indptr:        (num_cu + 1,)          num_cu = device CUs x occupancy (the clusters)
    work_info:          (max_work, 8)
    reduce_indptr:      (tile_cnt + 1,)
    reduce_final_map:   (tile_cnt, 2)
    reduce_partial_map: (max_split_tiles,)
    `max_qo_tiles_per_batch` is AITER's per-request qo tile bound
    (`DecodePlanConfig.sizes_max_qo_tiles_per_batch`); tile_cnt = batch_size * it.
    """

    batch_size: int
    num_cu: int
    max_qo_tiles_per_batch: int
    max_work: int
    max_split_tiles: int

    @property
    def tile_cnt(self) -> int:
        return self.batch_size * self.max_qo_tiles_per_batch

    @property
    def work_indptr(self) -> tuple[int]:
        return (self.num_cu + 1,)

    @property
    def work_info(self) -> tuple[int, int]:
        return (self.max_work, 8)

    @property
    def reduce_indptr(self) -> tuple[int]:
        return (self.tile_cnt + 1,)

    @property
    def reduce_final_map(self) -> tuple[int, int]:
        return (self.tile_cnt, 2)

    @property
    def reduce_partial_map(self) -> tuple[int]:
        return (self.max_split_tiles,)


def mla_decode_plan_sizes(batch_size: int, config: DecodePlanConfig) -> DecodePlanSizes:
    """`get_mla_metadata_info_v1(batch_size, ...)` for `config` (fast mode, not sparse).

    `batch_size` counts requests (pre-fold). `max_splits = num_cu * occupancy` sizes
    `work_indptr`; `max_work = (bs + max_splits - 1) * tiles` and
    `max_split_tiles = min(bs + max_splits - 1, 2 * (max_splits - 1)) * tiles`, enlarged to
    `tile_cnt + min(max_splits, max_split_per_batch * bs)` when `max_split_per_batch > 0`.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(config, DecodePlanConfig):  # validated there (num_heads % 8 == 0, ...)
        raise TypeError(f"config must be a DecodePlanConfig, got {type(config).__name__}")
    max_splits = config.device.num_cu * config.occupancy
    tiles = config.sizes_max_qo_tiles_per_batch
    tile_cnt = batch_size * tiles
    max_work = (batch_size + max_splits - 1) * tiles
    max_split_tiles = min(batch_size + max_splits - 1, (max_splits - 1) * 2) * tiles
    if config.max_split_per_batch > 0:
        per_tile_cap = min(max_splits, config.max_split_per_batch * batch_size)
        max_split_tiles = max(max_split_tiles, tile_cnt + per_tile_cap)
    return DecodePlanSizes(
        batch_size=batch_size,
        num_cu=max_splits,
        max_qo_tiles_per_batch=tiles,
        max_work=max_work,
        max_split_tiles=max_split_tiles,
    )
