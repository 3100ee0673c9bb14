"""The decode planner's sequential fill as ONE Pallas program (Triton backend on GPU).

A single program walks the qo tiles in order, carrying `(cu, remain)` in registers, and writes
the state before each tile (see `funcmla.planners.decode.fill_advance`, which it shares with
the `lax.scan` fallback, so both run the same arithmetic). Tiles are visited in chunks of `chunk`:
the chunk's inputs are loaded as independent scalar loads (so their latencies overlap), one
chunk ahead of the walk (software pipelining), then the chunk's steps run unrolled; only the
carry is sequential.

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

from funcmla.planners.decode import FILL_STATE_FIELDS, TILE_FIELDS, FillParams, fill_advance

__all__ = ["fill_tiles_pallas", "walk_tiles", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 16


def walk_tiles(payload, bpc, tiles_ref, out_ref, *, params: FillParams, chunk: int,
               num_chunks: int, prefetch: bool = True) -> None:
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

    if not prefetch:
        def body(ci, carry):
            return walk(ci, *carry, load(ci))

        lax.fori_loop(0, num_chunks, body, (jnp.int32(0), payload))
        return

    # Software pipelining: the loads of chunk ci + 1 are issued before chunk ci's steps, so
    # their latency hides behind the walk (the last iteration re-loads its own chunk).
    def body_pf(ci, carry):
        cu, remain, flat = carry
        nxt = load(jnp.minimum(ci + 1, num_chunks - 1))
        cu, remain = walk(ci, cu, remain, flat)
        return cu, remain, nxt

    lax.fori_loop(0, num_chunks, body_pf, (jnp.int32(0), payload, load(0)))


def _fill_kernel(scalars_ref, tiles_ref, out_ref, *, params: FillParams, chunk: int,
                 prefetch: bool):
    walk_tiles(scalars_ref[0], scalars_ref[1], tiles_ref, out_ref, params=params, chunk=chunk,
               num_chunks=tiles_ref.shape[0] // chunk, prefetch=prefetch)


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def fill_tiles_pallas(tiles: jax.Array, payload: jax.Array, bpc: jax.Array, *,
                      params: FillParams, chunk: int = DEFAULT_CHUNK, prefetch: bool = True,
                      interpret: bool | None = None) -> jax.Array:
    """The walk in one Pallas program. tiles: int32 [S, 8] (TILE_FIELDS) -> int32 [S, 2]
    (FILL_STATE_FIELDS, before each tile). `prefetch`: load chunk i + 1 while walking chunk i.
    `interpret=None`: compiled (Triton) on GPU, interpreted elsewhere."""
    if interpret is None:
        interpret = not _on_gpu()
    num_slots = tiles.shape[0]
    chunk = max(1, min(chunk, num_slots))
    padded = -(-num_slots // chunk) * chunk
    if padded != num_slots:  # empty slots (n = -1) leave the carry unchanged
        pad = jnp.zeros((padded - num_slots, tiles.shape[1]), jnp.int32).at[:, 0].set(-1)
        tiles = jnp.concatenate([tiles, pad])
    scalars = jnp.stack([jnp.asarray(payload, jnp.int32), jnp.asarray(bpc, jnp.int32)])
    kwargs = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=1, num_stages=1)
    call = pl.pallas_call(
        functools.partial(_fill_kernel, params=params, chunk=chunk, prefetch=prefetch),
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
