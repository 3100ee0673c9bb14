"""The decode planner's sequential fill as ONE Pallas program (Triton backend on GPU).

Two ways to the same states (the state before each tile, `FILL_STATE_FIELDS`):

* the *tile walk*: a single program walks the qo tiles in order, carrying `(cu, remain)` in
  registers (`decode_fill.fill_advance`, shared with the `lax.scan` fallback, so
  both run the same arithmetic). Tiles are visited in chunks of `chunk`: the chunk's inputs are
  loaded as independent scalar loads (so their latencies overlap), one chunk ahead of the walk
  (software pipelining), then the chunk's steps run unrolled; only the carry is sequential.
* the *chase* (`decode_chase.chase_states`): one round of vector work per event (a cluster
  abandoned, a zero-length tile that does not fit) instead of one step per tile. It holds all
  tiles in registers, so it runs up to CHASE_MAX_SLOTS slots, without the tail-merge rule, and
  when `chase_pays_off(bpc, overhead)` (decided at run time, in the kernel).

The Triton backend is deprecated in JAX 0.11 (still shipped); it is the simplest way to run a
scalar loop over global int32 arrays in one GPU thread block. Off-GPU the same kernel runs in
Pallas interpret mode.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.layout import is_power_of_two, next_power_of_two
from funcmla.planners.decode_chase import chase_pays_off, chase_states
from funcmla.planners.decode_fill import FILL_STATE_FIELDS, TILE_FIELDS, FillParams, fill_advance
from funcmla.planners.search import on_gpu

__all__ = ["fill_tiles_pallas", "walk_tiles", "walk_or_chase", "chase_allowed", "on_gpu",
           "DEFAULT_CHUNK", "INTERPRET_CHUNK", "CHASE_MAX_SLOTS", "WALKS", "padded_slots"]

# How the Pallas fills reach the states (`walk_or_chase`): "auto" (the chase where it pays off,
# decided in the kernel), "chase", "tiles" (one step per tile).
WALKS = ("auto", "chase", "tiles")
# Tiles per chunk of the tile walk: the chunk's loads are issued one chunk ahead, so they
# overlap the previous chunk's steps (`python -m bench.planners --fill-only`).
DEFAULT_CHUNK = 16
# Interpret mode (off-GPU, tests) unrolls 2 steps per chunk: the same code path (unrolled steps,
# prefetch, padding) at a small fraction of the 16-step unroll's XLA:CPU compile time.
INTERPRET_CHUNK = 2
# The chase keeps ~6 int32 vectors of the padded slot count in one warp's registers (16 values
# per lane each at 512).
CHASE_MAX_SLOTS = 512


def chase_allowed(params: FillParams, num_slots_padded: int) -> bool:
    """Static part of the choice: the chase can run (no tail rule, power-of-two slot count up to
    CHASE_MAX_SLOTS, as Triton needs power-of-two vectors)."""
    s = num_slots_padded
    return (not params.tail_rule) and s <= CHASE_MAX_SLOTS and is_power_of_two(s)


def walk_tiles(payload, bpc, tiles_ref, out_ref, *, params: FillParams, chunk: int,
               num_chunks: int) -> None:
    """Kernel body: walk `num_chunks * chunk` rows of `tiles_ref` (int32 [>= that, 8]), writing
    the state before each tile to `out_ref` (int32 [>= that, 2]). Shared with the fused planner
    kernel (`decode_fused_pallas`)."""
    nf = len(TILE_FIELDS)

    def load(ci):
        base = ci * chunk
        return tuple(tiles_ref[base + k, c] for k in range(chunk) for c in range(nf))

    def walk(ci, cu, remain, flat):
        base = ci * chunk
        for k in range(chunk):
            out_ref[base + k, 0] = cu
            out_ref[base + k, 1] = remain
            cu, remain = fill_advance(params, payload, bpc, cu, remain,
                                      flat[k * nf:(k + 1) * nf])
        return cu, remain

    # Software pipelining: the loads of chunk ci + 1 are issued before chunk ci's steps, so
    # their latency hides behind the walk (the last iteration re-loads its own chunk).
    def body_pf(ci, carry):
        cu, remain, flat = carry
        nxt = load(jnp.minimum(ci + 1, num_chunks - 1))
        cu, remain = walk(ci, cu, remain, flat)
        return cu, remain, nxt

    lax.fori_loop(0, num_chunks, body_pf, (jnp.int32(0), payload, load(0)))


def walk_or_chase(payload, bpc, tiles_ref, out_ref, *, params: FillParams, chunk: int,
                  num_chunks: int, walk: str = "auto") -> None:
    """Kernel body: states before each of the first `num_chunks * chunk` rows of `tiles_ref`
    into `out_ref`, by the tile walk or the chase. walk: "tiles"; "chase" (only where
    `chase_allowed`, the caller checks; at run time the tile walk still runs where the chase's
    precondition bpc > overhead fails); "auto" (the chase where allowed and, at run time,
    `chase_pays_off`)."""
    def tiles():
        walk_tiles(payload, bpc, tiles_ref, out_ref, params=params, chunk=chunk,
                   num_chunks=num_chunks)

    def chase():
        cu, remain = chase_states(tiles_ref[:, 0], payload, bpc, params=params)
        out_ref[:, 0] = cu
        out_ref[:, 1] = remain

    if walk == "tiles" or (walk == "auto" and not chase_allowed(params, tiles_ref.shape[0])):
        tiles()
    elif walk == "chase":
        lax.cond(bpc > params.overhead, chase, tiles)
    else:
        lax.cond(chase_pays_off(bpc, params.overhead), chase, tiles)


def _fill_kernel(scalars_ref, tiles_ref, out_ref, *, params: FillParams, chunk: int,
                 num_chunks: int, walk: str):
    walk_or_chase(scalars_ref[0], scalars_ref[1], tiles_ref, out_ref, params=params, chunk=chunk,
                  num_chunks=num_chunks, walk=walk)


def padded_slots(num_slots: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Rows the walk kernel runs over: a power of two up to CHASE_MAX_SLOTS (the chase's
    vectors), a multiple of `chunk` beyond."""
    if num_slots <= CHASE_MAX_SLOTS:
        return next_power_of_two(num_slots, chunk)
    return -(-num_slots // chunk) * chunk


def fill_tiles_pallas(tiles: jax.Array, payload: jax.Array, bpc: jax.Array, *,
                      params: FillParams, chunk: int | None = None,
                      walk: str = "auto", live_slots: int | None = None,
                      interpret: bool | None = None) -> jax.Array:
    """The walk in one Pallas program. tiles: int32 [S, >= 8] (TILE_FIELDS first) -> int32
    [S, 2] (FILL_STATE_FIELDS, before each tile). `chunk`: tiles per unrolled chunk, whose
    loads are issued while the previous chunk walks (None: DEFAULT_CHUNK compiled,
    INTERPRET_CHUNK interpreted). walk: "auto" | "chase" | "tiles" (see `walk_or_chase`;
    "chase" raises where the chase cannot run). live_slots: only the first `live_slots` rows
    hold tiles, the rest are empty slots (n = -1) whose states are not needed: the tile walk
    stops after them (their rows of the result are left unwritten). `interpret=None`: compiled
    (Triton) on GPU, interpreted elsewhere."""
    if interpret is None:
        interpret = not on_gpu()
    if chunk is None:
        chunk = INTERPRET_CHUNK if interpret else DEFAULT_CHUNK
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    num_slots = tiles.shape[0]
    live = num_slots if live_slots is None else live_slots
    if not 1 <= live <= num_slots:
        raise ValueError(f"live_slots must be in [1, {num_slots}], got {live_slots}")
    chunk = max(1, min(chunk, num_slots))
    padded = padded_slots(num_slots, chunk)
    if walk == "chase" and not chase_allowed(params, padded):
        raise ValueError(f"walk='chase' needs no tail rule and <= {CHASE_MAX_SLOTS} slots "
                         f"(tail_rule={params.tail_rule}, slots={num_slots})")
    if padded != num_slots:  # empty slots (n = -1) leave the carry unchanged
        pad = jnp.zeros((padded - num_slots, tiles.shape[1]), jnp.int32).at[:, 0].set(-1)
        tiles = jnp.concatenate([tiles, pad])
    scalars = jnp.stack([jnp.asarray(payload, jnp.int32), jnp.asarray(bpc, jnp.int32)])
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=1, num_stages=1)
    call = pl.pallas_call(
        functools.partial(_fill_kernel, params=params, chunk=chunk,
                          walk=walk, num_chunks=-(-live // chunk)),
        out_shape=jax.ShapeDtypeStruct((padded, len(FILL_STATE_FIELDS)), jnp.int32),
        grid=(1,),
        interpret=interpret,
        name="mla_decode_plan_fill",
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
        out = call(scalars, tiles)
    return out[:num_slots]
