"""Splitting a global batch over DP-attention ranks, as SGLang's data-parallel controller
dispatches requests (`python/sglang/srt/managers/data_parallel_controller.py`).

Two of its `--load-balance-method`s, restated on a batch of requests (host NumPy, as SGLang's
controller is host Python):

round_robin     (SGLang's default) request k of the stream goes to rank
                `(counter + k) % dp`; the counter carries over to the next batch.
shortest_queue  from the ranks' current loads (live requests), the least loaded ranks are
                filled up to the next load level, level by level, until all are level
                (`DPBudget.update_budget`); after that, and whenever the budget is spent,
                dispatch is round robin over all ranks in rank order (`DPBudget.dispatch`).

A request may be pinned to a rank (SGLang's `data_parallel_rank` on the request, "external
routing"): it goes there and does not advance the counter nor spend budget.

Which one, and why: decode attention time per rank follows its live requests and their KV,
and a DP step lasts as long as its slowest rank. Round robin balances request counts only
when every rank starts level; shortest queue levels the ranks first, so it is the one to use
when ranks drain unevenly (requests finish at different times), and `split_batch`'s default.
Neither looks at KV length, as in SGLang.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

__all__ = ["POLICIES", "DPSplit", "split_batch", "shortest_queue_budget"]

POLICIES = ("round_robin", "shortest_queue")


@dataclasses.dataclass(frozen=True)
class DPSplit:
    """Where each request of a global batch goes.

    rank_of:  int [N]      the DP rank of global request g
    slot_of:  int [N]      its position in that rank's batch (arrival order)
    requests: tuple of int arrays, one per rank: the global ids of the rank's requests, in
              rank order (`requests[r][slot_of[g]] == g` for `rank_of[g] == r`)
    counter:  the round-robin counter after this batch (pass it to the next call)
    """

    rank_of: np.ndarray
    slot_of: np.ndarray
    requests: tuple[np.ndarray, ...]
    counter: int

    @property
    def dp(self) -> int:
        return len(self.requests)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.requests)


def shortest_queue_budget(loads: Sequence[int]) -> list[int]:
    """The ranks, in dispatch order, that level `loads` (lowest first, then the next level)."""
    loads = [int(x) for x in loads]
    budget: list[int] = []
    while len(set(loads)) > 1:
        low = min(loads)
        nxt = min(x for x in loads if x > low)
        lowest = [r for r, x in enumerate(loads) if x == low]
        budget.extend(lowest * (nxt - low))
        for r in lowest:
            loads[r] = nxt
    return budget


def split_batch(num_requests: int, dp: int, *, policy: str = "shortest_queue",
                loads: Sequence[int] | None = None, counter: int = 0,
                pinned: Sequence[int] | None = None) -> DPSplit:
    """Dispatch requests 0..num_requests-1 (arrival order) to `dp` ranks.

    loads:   live requests per rank before this batch (shortest_queue; default all 0).
    counter: round-robin position (round_robin; also shortest_queue's fallback).
    pinned:  per request, a rank to send it to, or -1 (SGLang's `data_parallel_rank`).
    """
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive int, got {dp!r}")
    if not isinstance(num_requests, (int, np.integer)) or num_requests < 0:
        raise ValueError(f"num_requests must be an int >= 0, got {num_requests!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(counter, (int, np.integer)) or not 0 <= counter < dp:
        raise ValueError(f"counter must be a round-robin position in [0, {dp}), got {counter!r}")
    loads = [0] * dp if loads is None else [int(x) for x in loads]
    if len(loads) != dp or min(loads) < 0:
        raise ValueError(f"loads must be {dp} counts >= 0 (one per rank), got {loads}")
    pins = np.full(num_requests, -1) if pinned is None else np.asarray(pinned, np.int64)
    if pins.shape != (num_requests,) or ((pins < -1) | (pins >= dp)).any():
        raise ValueError(f"pinned must hold {num_requests} ranks in [-1, {dp}), got {pins}")
    budget = shortest_queue_budget(loads) if policy == "shortest_queue" else []
    budget.reverse()  # pop from the end
    rank_of = np.empty(num_requests, np.int64)
    for g in range(num_requests):
        if pins[g] >= 0:
            rank_of[g] = pins[g]
        elif budget:
            rank_of[g] = budget.pop()
        else:
            rank_of[g] = counter
            counter = (counter + 1) % dp
    requests = tuple(np.flatnonzero(rank_of == r) for r in range(dp))
    slot_of = np.empty(num_requests, np.int64)
    for ids in requests:
        slot_of[ids] = np.arange(len(ids))
    return DPSplit(rank_of=rank_of, slot_of=slot_of, requests=requests, counter=counter)
