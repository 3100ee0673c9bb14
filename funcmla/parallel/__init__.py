"""Attention across devices through JAX sharding: tensor parallelism over heads, data-parallel
attention over ranks, the same code in one process or many (`jax.distributed`).

* `mesh`: ("dp", "tp") meshes in SGLang's rank order, `sglang_mesh(--tp, --dp,
  --enable-dp-attention)`, the `shard_map` compatibility point.
* `tp`: `tp_mla_decode`, `tp_attention_reference`, `tp_run_work_plan` (q and outputs split by
  heads, pool and metadata replicated).
* `dp_schedule`: how a global batch is split over DP ranks (SGLang's round robin and shortest
  queue dispatch).
* `dp`: per-rank static capacities, per-rank metadata and work plans from the single-device
  builders, padding to one shape; `dp_attention`: each rank attends over its own requests, the
  outputs gathered to the global request order.

See docs/scale_out.md.
"""

from funcmla.parallel.mesh import (  # noqa: F401
    DP_AXIS,
    TP_AXIS,
    make_mesh,
    require_axis,
    sglang_mesh,
    shard_map,
)
from funcmla.parallel.tp import (  # noqa: F401
    local_heads,
    tp_attention_reference,
    tp_mla_decode,
    tp_run_work_plan,
)
from funcmla.parallel.dp_schedule import POLICIES, DPSplit, split_batch  # noqa: F401
from funcmla.parallel.dp import DPLayout, DPRank, DPStep, check_split, pad_step, rank_step  # noqa: F401,E501
from funcmla.parallel.dp_attention import (  # noqa: F401
    build_dp_step,
    dp_attention,
    gather_global,
    rank_rows,
    stack_pools,
    stack_rows,
)
