"""How evenly the prefill kernel's q tiles spread over the SMs, by a schedule simulation (no GPU).

Each q tile of a batch costs its KV tiles (`tile_schedule`, causal, 64-token tiles) plus a
fixed start; the simulation runs the grid as the hardware does (each CTA, in launch order, to
the SM that frees first) and as a persistent grid in snake-ordered rounds would (CTA c taking
position c of even rounds and C - 1 - c of odd ones, a static assignment), and prints each
one's makespan over the mean load (1.0: perfectly even):

    python -m bench.prefill_schedule
    python -m bench.prefill_schedule --sms 132 --start 3 --next 0.5

`--start`: a CTA's fixed start in KV-tile units; `--next`: what each further tile of a CTA
walking several (`MgpuPrefillConfig.tiles_per_cta`) pays instead. The decision log of
docs/prefill_kernel.md quotes it for the snake-ordered persistent grid (dropped) and the
tiles a CTA (kept).
"""

from __future__ import annotations

import argparse
import heapq

import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas.prefill_layout import slot_count
from funcmla.attention.pallas.prefill_mgpu import item_kv_tiles, tile_counts

from .prefill import RAGGED_1K

__all__ = ["item_costs", "hardware_makespan", "snake_makespan", "main"]

BATCHES = {"16 x 1024": [1024] * 16, "ragged 16 x ~1k": RAGGED_1K,
           "7 x 1024 + 40 x 64 + 3 x 1500": [1024] * 7 + [64] * 40 + [1500] * 3,
           "3 x 1536 + 100 x 8": [1536] * 3 + [8] * 100}


def item_costs(lens: list[int], heads: int, block_kv: int = 64) -> np.ndarray:
    """KV tiles of each (head, slot) item in the kernel's walk order (heads outer, slots last
    to first; 0 for an unused slot), causal requests with q_len = kv_len: the kernel's own
    count (`item_kv_tiles`)."""
    qo = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    n = slot_count(int(np.asarray(tile_counts(qo)).sum()))
    q_lens = jnp.asarray(lens, jnp.int32)
    return np.asarray(item_kv_tiles(qo, qo, q_lens, q_lens, heads=heads, num_slots=n,
                                    causal=True, block_kv=block_kv), np.float64)


def _cta_costs(costs: np.ndarray, tiles: int, start: float, nxt: float) -> np.ndarray:
    pad = np.zeros(-(-len(costs) // tiles) * tiles)
    pad[:len(costs)] = costs
    chunks = pad.reshape(-1, tiles)
    live = (chunks > 0).sum(axis=1)
    return chunks.sum(axis=1) + np.where(live > 0, start + nxt * (live - 1), 0.0)


def hardware_makespan(costs, sms: int, tiles: int, start: float, nxt: float) -> float:
    """Each CTA of `tiles` consecutive items, in launch order, to the SM that frees first."""
    free = [0.0] * sms
    for c in _cta_costs(costs, tiles, start, nxt):
        if c > 0:
            heapq.heapreplace(free, free[0] + c)
    return max(free)


def snake_makespan(costs, sms: int, start: float, nxt: float) -> float:
    """One CTA per SM, round k's items [k C, (k + 1) C) taken in snake order."""
    load, seen = np.zeros(sms), np.zeros(sms, bool)
    for k in range(0, len(costs), sms):
        r = costs[k:k + sms]
        idx = np.arange(len(r)) if (k // sms) % 2 == 0 else sms - 1 - np.arange(len(r))
        load[idx] += r + np.where(r > 0, np.where(seen[idx], nxt, start), 0.0)
        seen[idx] |= r > 0
    return float(load.max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--start", type=float, default=3.0)
    ap.add_argument("--next", type=float, default=0.5)
    args = ap.parse_args(argv)
    print(f"makespan over the one-tile grid's (hardware scheduling), {args.sms} SMs")
    for name, lens in BATCHES.items():
        for heads in (16, 128):
            c = item_costs(lens, heads)
            base = hardware_makespan(c, args.sms, 1, args.start, args.next)
            cells = [f"G{g} {hardware_makespan(c, args.sms, g, args.start, args.next) / base:.3f}"
                     for g in (2, 3, 4, 8)]
            snake = snake_makespan(c, args.sms, args.start, args.next) / base
            print(f"  H{heads:<3} {name:<30} " + "  ".join(cells) + f"  snake {snake:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
