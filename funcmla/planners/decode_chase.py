"""The decode planner's greedy fill as a chase over *events* instead of a walk over tiles.

The walk (`decode_fill.fill_advance`, one tile at a time) is sequential: its cost grows with the
tile count whatever surrounds it. Between two events the fill is a prefix sum, so it can be
computed for a whole segment of tiles at once (docs/planners.md, "The chase"):

* An *anchor* `(k, C, R)` is a known state before tile k: cluster C with R blocks of payload left
  (0 <= R <= payload). Write `sigma = payload - R` and `Q` for the exclusive prefix sum of each
  tile's cost `w = n + overhead` (0 for an empty slot, n = -1). For the tiles j >= k that follow
  without an event, with `s_j = sigma + Q_j - Q_k`:

      remain_j = payload - s_j                 if s_j <= overhead
                 (overhead - s_j) mod bpc      otherwise
      cu_j     = C + max(0, (s_j - overhead - 1) // bpc)

* An *event* is a tile whose step does not follow that formula: a non-empty tile met with
  `remain <= overhead` (the cluster is abandoned: the tile restarts fresh on cluster `cu + 1`,
  which is the anchor `(j, cu_j + 1, payload)`), and a zero-length tile met with
  `remain < overhead` (the anchor after it is `(j + 1, cu_j, 0)` under the parallel planner's
  rule, `(j + 1, cu_j + 1, bpc)` under the serial one).

Each round of the chase is vector work over every tile (costs modulo bpc, the first event after
the anchor by a min-reduction) plus a few scalars; there are as many rounds as events plus one.
It needs `bpc > overhead` (then a cut always leaves less than a cluster, so the formula holds
mid-segment) and no tail merge (`FillParams.tail_rule` False); `chase_pays_off` says when it
beats the tile walk (events are rare when `bpc` is large against the overhead).
The same function runs inside the Pallas walk kernel (`decode_fill_pallas`) and under plain jit;
tests compare it with `fill_tiles_scan` (tests/test_planner_decode.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from funcmla.planners.decode_fill import FillParams

__all__ = ["chase_states", "chase_pays_off", "CHASE_MIN_BPC_PER_OVERHEAD"]

# The chase runs when bpc > CHASE_MIN_BPC_PER_OVERHEAD * (overhead + 1): a cut leaves a uniform
# remainder, so about (overhead + 1) / bpc of the tiles are events, and a round of the chase
# costs about as much as three or four tile steps of the walk
# (`python -m bench.planners --fills fused/tiles,fused/chase`, docs/planners.md).
CHASE_MIN_BPC_PER_OVERHEAD = 4


def chase_pays_off(bpc, overhead: int):
    """Runtime choice (a traced bool): chase when events are expected to be rare."""
    return bpc > CHASE_MIN_BPC_PER_OVERHEAD * (overhead + 1)


def chase_states(n: jax.Array, payload, bpc, *, params: FillParams):
    """States `(cu, remain)` before each tile, equal to the tile walk's.

    n: int32 [S] blocks per tile (-1: empty slot); payload, bpc: int32 scalars (blocks).
    Requires params.tail_rule False (checked) and bpc > params.overhead (a run-time value, not
    checked here: `decode_fill_pallas.walk_or_chase` chases only when it holds). Returns int32
    [S] cu, int32 [S] remain.
    """
    if params.tail_rule:
        raise ValueError("chase_states: the tail-merge rule needs the tile walk")
    i32 = jnp.int32
    ov = params.overhead
    S = n.shape[0]
    n = n.astype(i32)
    payload = jnp.asarray(payload, i32)
    bpc = jnp.asarray(bpc, i32)
    idx = lax.iota(i32, S)
    w = jnp.where(n >= 0, n + ov, 0)
    q = jnp.cumsum(w) - w  # exclusive prefix sum of the costs
    qm = q % bpc
    # With s > overhead (else remain = payload - s > overhead: never an event), remain <= ov
    # iff s mod bpc <= overhead, and then remain = overhead - s mod bpc. So a non-empty tile is an
    # event iff lo <= s mod bpc <= overhead with lo = 0, a zero-length one with lo = 1 (remain
    # < overhead), an empty slot never (lo = bpc).
    lo_mod = jnp.where(n >= 1, 0, jnp.where(n == 0, 1, bpc))
    key_t = 2 * idx + (n == 0).astype(i32)  # first event and its kind in one min-reduction
    never = jnp.iinfo(jnp.int32).max

    def cond(carry):
        return carry[0] < S

    def body(carry):
        # The anchor is at k; its states are recorded from lo on (lo = k + 1 after an abandon:
        # the state recorded before the abandoning tile is the one that abandons).
        k, lo, c, sigma, qk, base, seg_c = carry
        x = qm + (sigma % bpc - qk % bpc)  # s mod bpc, up to one wrap: x in (-bpc, 2 bpc)
        xm = jnp.where(x < 0, x + bpc, jnp.where(x >= bpc, x - bpc, x))
        s = q + (sigma - qk)
        event = (idx >= k) & (s > ov) & (xm >= lo_mod) & (xm <= ov)
        # Two independent reductions: the first event (with its kind) and its s (s does not
        # decrease along the tiles, so the smallest s among events is the first event's).
        key = jnp.min(jnp.where(event, key_t, 2 * S))
        s_e = jnp.min(jnp.where(event, s, never))
        e = key // 2
        mine = (idx >= lo) & (idx <= e)
        base = jnp.where(mine, sigma - qk, base)
        seg_c = jnp.where(mine, c, seg_c)
        # The event tile's state, then the next anchor (unused when there is no event, e = S).
        q_e = s_e - sigma + qk
        cu_e = c + jnp.maximum(0, (s_e - ov - 1) // bpc)
        abandon = key % 2 == 0
        zero_c, zero_r = (cu_e, i32(0)) if params.parallel else (cu_e + 1, bpc)
        k2 = jnp.where(abandon, e, e + 1)
        c2 = jnp.where(abandon, cu_e + 1, zero_c)
        sigma2 = jnp.where(abandon, 0, payload - zero_r)
        qk2 = jnp.where(abandon, q_e, q_e + ov)
        return k2, e + 1, c2, sigma2, qk2, base, seg_c

    zeros = jnp.zeros((S,), i32)
    init = (i32(0), i32(0), i32(0), i32(0), i32(0), zeros, zeros)
    _, _, _, _, _, base, seg_c = lax.while_loop(cond, body, init)
    s = base + q
    xm = s % bpc
    remain = jnp.where(s <= ov, payload - s, jnp.where(xm <= ov, ov - xm, ov - xm + bpc))
    cu = seg_c + jnp.maximum(0, (s - ov - 1) // bpc)
    return cu, remain
