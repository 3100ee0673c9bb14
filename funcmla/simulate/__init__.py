"""A deterministic serving-trace simulation: allocator -> metadata -> (plan ->) attention.

Requests arrive, are prefilled (reusing page-aligned prefixes of running requests through
`share_prefix`), decode one token per step (or verify `num_draft_tokens` draft tokens per step
and keep the accepted ones), and finish. Every step goes through the functional allocator
(`funcmla.allocator`), a metadata builder (`funcmla.metadata`, value-checked with
`funcmla.checks`) and the reference attention over the paged latent pool
(`funcmla.attention.reference`), or, with `use_plans`, the AITER work planners
(`funcmla.planners.decode` / `prefill`) and the plan executor (`funcmla.attention.executor`).
On a GPU, decode and verify steps run funcmla's Pallas decode kernel
(`funcmla.attention.pallas`, bf16 operands; `pallas_decode`, interpret mode when forced on a CPU).
Each step's output is compared with a float64 NumPy oracle computed on a dense, unpaged copy
of the same keys (`StepStats.max_rel_err`).

Page-size invariance is the point: the latent row of a token is a pure function of (token id,
position) and the query a pure function of (request id, position) (`hashed_uniform`), so what a
request computes cannot depend on the page size, on where its pages landed, on prefix hits, or
on being retracted after an out-of-memory and recomputed. `SimulationResult.outputs_identical()`
checks that the outputs agree bit for bit across page sizes.

The host loop is plain Python over steps calling jitted pure functions with static shapes: the
batch is padded to `max_running` rows (prefill rows with zero tokens; decode/verify rows replay
the first request, with ignored queries, so that every kv_indices entry is a live slot and the
metadata value checks hold), prefill queries to `max_prefill_tokens`, KV gathers to
`max_context_len`. The pool array has `pool_tokens + max(64, *page_sizes)` rows at every page
size, so the programs compiled for a mode serve all page sizes.

Modules, in the order of the data flow: `config` (`SimulationConfig`), `workload` (requests,
latent rows and queries), `forward` (one step on device), `oracle` (the float64 check),
`trace` (one run's host state and its steps), `run` (the scheduler loop, `run_simulation`),
`results` (what a run returns).
"""

from funcmla.simulate.config import SimulationConfig
from funcmla.simulate.results import PageSizeRun, SimulationResult, StepStats
from funcmla.simulate.run import run_simulation
from funcmla.simulate.workload import RequestSpec, hashed_uniform, make_workload

__all__ = [
    "SimulationConfig",
    "RequestSpec",
    "StepStats",
    "PageSizeRun",
    "SimulationResult",
    "hashed_uniform",
    "make_workload",
    "run_simulation",
]
