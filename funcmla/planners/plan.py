"""The work-plan pytree shared by the decode and prefill planners (AITER's output contract).

A work is one row of `work_info` (8 int32, `MlaWorkInfo` in AITER):

    [batch_idx, partial_qo_loc, qo_start, qo_end, kv_start, kv_end, kv_offset, pad_or_q_head_range]

* `partial_qo_loc == -1`: the work covers its qo tile's whole KV range and writes the final output;
  otherwise it is the row offset of its partial result in the fp32 partial buffer.
* `qo_start`, `qo_end`: global query rows (half-open).
* `kv_start`, `kv_end`: half-open range of **entries of kv_indices**, relative to kv_indptr[0]
  (which must be 0). One entry is `block_size` tokens: the plan's granularity.
* `kv_offset`: KV **tokens** of the batch after `kv_end` (the causal shift).
* column 7: 0 for decode; `(q_head_end << 16) | q_head_start` for prefill.

`work_indptr[c] .. work_indptr[c + 1]` are the works of compute unit `c`. `reduce_indptr`,
`reduce_final_map` and `reduce_partial_map` describe the log-sum-exp merges (`mla_reduce_v1`).

Buffers have static capacities; the live counts are device values. Unused tails are zero.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = [
    "WorkPlan",
    "WORK_INFO_FIELDS",
    "BATCH_IDX",
    "PARTIAL_QO_LOC",
    "QO_START",
    "QO_END",
    "KV_START",
    "KV_END",
    "KV_OFFSET",
    "Q_HEAD_RANGE",
]

WORK_INFO_FIELDS = (
    "batch_idx",
    "partial_qo_loc",
    "qo_start",
    "qo_end",
    "kv_start",
    "kv_end",
    "kv_offset",
    "q_head_range",
)
(BATCH_IDX, PARTIAL_QO_LOC, QO_START, QO_END, KV_START, KV_END, KV_OFFSET, Q_HEAD_RANGE) = range(8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkPlan:
    """A persistent-kernel work plan (AITER `get_mla_metadata_v1` / `get_ps_metadata_v1` output).

    work_indptr:        int32 [num_cu + 1]
    work_info:          int32 [max_work, 8]
    reduce_indptr:      int32 [num_tiles + 1]
    reduce_final_map:   int32 [num_tiles, 2]     (qo_start, qo_end) of split tiles
    reduce_partial_map: int32 [max_partials]     partial row offsets, in KV order
    num_works:          int32 []                 live rows of work_info (== work_indptr[-1])
    num_partials:       int32 []                 live entries of reduce_partial_map

    Static (meta) fields:
    kind:       "decode" or "prefill".
    block_size: tokens per kv_indices entry that kv_start/kv_end count in (1 = token-granular).
    legacy:     True when built with a named legacy option that may mismatch the metadata.
    """

    work_indptr: jax.Array
    work_info: jax.Array
    reduce_indptr: jax.Array
    reduce_final_map: jax.Array
    reduce_partial_map: jax.Array
    num_works: jax.Array
    num_partials: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    legacy: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def num_cu(self) -> int:
        return self.work_indptr.shape[0] - 1

    @property
    def max_work(self) -> int:
        return self.work_info.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.reduce_indptr.shape[0] - 1
