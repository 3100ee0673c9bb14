"""The scheduler loop: arrivals join the waiting queue, a step prefills waiting requests when
the batch has room and they fit, and decodes the running ones otherwise; once per page size,
each run checked for stalls, missing outputs and leaked pages."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from funcmla import allocator as alloc
from funcmla.simulate.config import SimulationConfig
from funcmla.simulate.results import PageSizeRun, SimulationResult
from funcmla.simulate.trace import Trace
from funcmla.simulate.workload import RequestSpec, make_workload

__all__ = ["run_page_size", "run_simulation"]


def run_page_size(config: SimulationConfig, page_size: int, pool_rows: int,
                  workload: list[RequestSpec],
                  progress: Callable[[int, int, int], None] | None) -> PageSizeRun:
    """The trace at one page size, step by step until every request has finished; raises
    RuntimeError on a stall, an output never computed, or pages left in use at the end."""
    t0 = time.perf_counter()
    tr = Trace(config, page_size, pool_rows, workload)
    step = 0
    while tr.finished < config.num_requests:
        if step >= config.max_steps:
            raise RuntimeError(
                f"page_size={page_size}: {tr.finished}/{config.num_requests} requests finished "
                f"after SimulationConfig.max_steps={config.max_steps} steps"
            )
        if not tr.running and not tr.waiting:
            step = max(step, tr.pending[0].arrival_step)  # idle: jump to the next arrival
        while tr.pending and tr.pending[0].arrival_step <= step:
            tr.waiting.append(tr.pending.popleft())
        prefilled = (bool(tr.waiting) and len(tr.running) < config.max_running
                     and tr.try_prefill(step))
        if not prefilled:
            if not tr.running:
                raise RuntimeError(
                    f"page_size={page_size}: the next request does not fit the empty pool "
                    f"(SimulationConfig.pool_tokens={config.pool_tokens})"
                )
            tr.decode(step)
        step += 1
        if progress is not None:
            progress(page_size, tr.finished, config.num_requests)
    missing = [rid for rid, o in tr.outputs.items() if np.isnan(o).any()]
    if missing:
        raise RuntimeError(f"page_size={page_size}: outputs never computed for {missing}")
    if int(alloc.pages_in_use(tr.state)) != 0:
        raise RuntimeError(f"page_size={page_size}: pages still in use after the last request")
    return PageSizeRun(page_size, tr.spec.num_pages, tuple(tr.steps), tr.outputs,
                       time.perf_counter() - t0)


def run_simulation(
    config: SimulationConfig = SimulationConfig(),
    page_sizes: tuple[int, ...] = (1, 16, 64),
    progress: Callable[[int, int, int], None] | None = None,
) -> SimulationResult:
    """Run the seeded trace once per page size and return per-step stats and outputs.

    `progress(page_size, finished_requests, num_requests)` is called after every step.
    Raises ValueError for a config that cannot run at a page size (pool not a whole number of
    pages, or smaller than one request), RuntimeError if a run stalls, and checkify's
    JaxRuntimeError if a metadata value check fails (`config.check`).
    """
    page_sizes = tuple(page_sizes)
    if not page_sizes:
        raise ValueError("run_simulation: page_sizes is empty")
    for page_size in page_sizes:
        config.allocator_spec(page_size)  # validate every page size before running any
    workload = make_workload(config)
    # (num_pages + 1) * page_size <= pool_rows at every page size; the same rows for any page sizes
    # up to 64, so the compiled forwards are shared between calls too.
    pool_rows = config.pool_tokens + max(64, *page_sizes)
    runs = {page_size: run_page_size(config, page_size, pool_rows, workload, progress)
            for page_size in page_sizes}
    return SimulationResult(config, runs)
