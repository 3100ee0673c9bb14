"""What a simulation returns: per-step statistics, one run per page size with its outputs, and
the cross-page-size comparison (`SimulationResult.outputs_identical`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from funcmla.simulate.config import SimulationConfig

__all__ = ["PageSizeRun", "SimulationResult", "StepStats"]


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One forward step. Token counts are tokens; pages are pages of this run's page size."""

    step: int
    mode: str  # "extend" | "decode" | "target_verify"
    batch_size: int  # live requests in the batch
    num_q_tokens: int
    num_kv_tokens: int  # kv_indptr[-1] of the live requests
    kv_indices_capacity: int  # static length of kv_indices (BufferPlan, token-granular)
    pages_in_use: int  # after the step
    num_free_pages: int
    prefix_hit_tokens: int  # tokens reused through share_prefix in this step
    oom_events: int  # prefill candidates deferred or running requests retracted
    plan_works: int  # live rows of the work plan (0 without use_plans)
    plan_partials: int  # partial outputs the plan's reduce merges (0 without use_plans)
    max_rel_err: float  # max |out - float64 oracle| / max |oracle| over the step's queries


@dataclasses.dataclass(frozen=True)
class PageSizeRun:
    """One simulated trace at one page size."""

    page_size: int
    num_pages: int
    steps: tuple[StepStats, ...]
    outputs: dict[int, np.ndarray]  # rid -> float32 [output_len + 1, H, v_head_dim]
    wall_s: float

    def summary(self) -> dict:
        s = self.steps
        return dict(
            page_size=self.page_size,
            steps=len(s),
            extend_steps=sum(x.mode == "extend" for x in s),
            q_tokens=sum(x.num_q_tokens for x in s),
            kv_tokens=sum(x.num_kv_tokens for x in s),
            num_pages=self.num_pages,
            max_pages_in_use=max((x.pages_in_use for x in s), default=0),
            prefix_hit_tokens=sum(x.prefix_hit_tokens for x in s),
            oom_events=sum(x.oom_events for x in s),
            plan_works=sum(x.plan_works for x in s),
            max_rel_err=max((x.max_rel_err for x in s), default=0.0),
            wall_s=self.wall_s,
        )


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Runs by page size. `outputs[rid][k]` is the attention output of the query at position
    `prompt_len - 1 + k` of request `rid` (the last prompt token, then every generated one)."""

    config: SimulationConfig
    runs: dict[int, PageSizeRun]

    def max_output_diff(self) -> float:
        """Max |difference| of any output between any run and the first."""
        runs = list(self.runs.values())
        return max((float(np.max(np.abs(run.outputs[rid] - out)))
                    for run in runs[1:] for rid, out in runs[0].outputs.items()), default=0.0)

    def outputs_identical(self) -> bool:
        """Bitwise equal outputs at every simulated page size."""
        runs = list(self.runs.values())
        return all(np.array_equal(run.outputs[rid], out)
                   for run in runs[1:] for rid, out in runs[0].outputs.items())

    def summary(self) -> list[dict]:
        return [run.summary() for run in self.runs.values()]

    def to_dict(self) -> dict:
        """JSON-ready: the config, and per page size the summary and every step's stats
        (outputs are left out; compare them with `outputs_identical`)."""
        return dict(
            config=dataclasses.asdict(self.config),
            outputs_identical=self.outputs_identical(),
            max_output_diff=self.max_output_diff(),
            runs=[dict(summary=run.summary(), steps=[dataclasses.asdict(x) for x in run.steps])
                  for run in self.runs.values()],
        )
