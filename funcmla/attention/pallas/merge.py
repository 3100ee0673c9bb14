"""The split-KV log-sum-exp combine as one Pallas kernel (Triton lowering; interpret mode on CPU).

`merge_splits_pallas(o_part, lse_part, out_dtype)` computes what `decode_common.merge_splits`
(the XLA restatement) computes, in one launch instead of several XLA fusions:

    m      = max_s lse[s]                      (natural log; -inf for an empty split)
    m_safe = m if finite else 0
    w[s]   = exp(lse[s] - m_safe)              (0 for empty splits)
    total  = w[0] + w[1] + ...                 (left to right)
    acc    = w[0]*o[0] + w[1]*o[1] + ...       (left to right, one rounding per * and +)
    out    = acc / total   (total > 0)   else 0
    lse    = m_safe + log(total) (total > 0) else +inf

On the GPU every multiply, add and divide is one IEEE round-to-nearest PTX instruction
(`mul.rn.f32`, `add.rn.f32`, `div.rn.f32`), so the compiler can neither contract a*b+c into an FMA
nor use an approximate division: the result does not depend on the tiling or on compiler
choices, and equals the torch launcher's merge (`funcmla.interop.launcher`) element for element.
In interpret mode (CPU) the same sequence runs as float32 operations, each product kept
apart from its sum (an optimization barrier), so XLA:CPU contracts none into an FMA either.

An empty split carries lse = -inf and a partial the decode kernels write as 0, so its weight
0 multiplies a finite 0. Tiling: one program = `block_r` rows x `block_d` output columns of one
sequence, all splits unrolled (so past 64 splits registers spill: `max_splits`). `block_d`
shrinks until the grid has `min_programs` programs: one program reads its partials far below
HBM rate, so the merge is fast only when spread over many multiprocessors
(`python -m bench.decode --merge-alone`; figures in docs/decode_kernel.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.attention.pallas.decode_common import PARTIAL_DTYPES
from funcmla.layout import is_power_of_two

__all__ = ["merge_splits_pallas", "merge_attention_states", "merge_block_d", "merge_ops",
           "merge_weights", "merge_columns", "MERGE_BLOCK_R"]

MERGE_BLOCK_R = 16  # rows per program; partial row counts are multiples of it (block_m >= 16)
_MIN_BLOCK_D = 32  # narrowest tile the rule picks (16 was slower at every measured shape)


def _asm(op: str, *args):
    """One f32 PTX instruction applied elementwise (fixed rounding, no contraction)."""
    shape = args[0].shape
    regs = ", ".join(f"${i + 1}" for i in range(len(args)))
    [out] = pltriton.elementwise_inline_asm(
        f"{op} $0, {regs};", args=[jnp.broadcast_to(a, shape) for a in args],
        constraints="=r," + ",".join("r" for _ in args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def merge_ops(interpret: bool):
    """(mul, add, div) of the merge: IEEE round-to-nearest f32 PTX instructions on the GPU,
    float32 operations in interpret mode (products not contracted with their sums)."""
    if interpret:
        # the barrier keeps XLA:CPU from contracting a product and its sum into an FMA (which
        # jax 0.12's CPU backend does where the operands' fusion allows)
        return ((lambda a, b: lax.optimization_barrier(a * b)), (lambda a, b: a + b),
                (lambda a, b: a / b))
    return (lambda a, b: _asm("mul.rn.f32", a, b), lambda a, b: _asm("add.rn.f32", a, b),
            lambda a, b: _asm("div.rn.f32", a, b))


def merge_weights(lse: list, add) -> tuple[list, jax.Array, jax.Array]:
    """Per-row part of the combine, from each split's lse ([rows] f32 each, in split order):
    (w [S] x [rows], safe [rows] (the weight total, 1 where it is 0), lse_out [rows]).
    Operation order as in the module docstring."""
    m = lse[0]
    for x in lse[1:]:
        m = jnp.maximum(m, x)
    m_safe = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)
    w = [jnp.exp(x - m_safe) for x in lse]
    total = jnp.zeros_like(m)
    for x in w:
        total = add(total, x)
    has = total > 0.0
    safe = jnp.where(has, total, 1.0)
    return w, safe, jnp.where(has, m_safe + jnp.log(safe), jnp.inf)


def merge_columns(w: list, safe: jax.Array, load_split, shape: tuple[int, int], ops):
    """One [rows, cols] tile of the combined output (float32): sum over splits, in split
    order, of w[s] * load_split(s) (float32 or bf16 partials, widened to float32), divided by
    `safe`; `ops` = `merge_ops(...)`."""
    mul, add, div = ops
    acc = jnp.zeros(shape, jnp.float32)
    for s, ws in enumerate(w):
        part = load_split(s).astype(jnp.float32)
        acc = add(acc, mul(jnp.broadcast_to(ws[:, None], shape), part))
    return div(acc, jnp.broadcast_to(safe[:, None], shape))


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, num_splits: int, interpret: bool):
    # o_ref [S, block_r, block_d] f32 or bf16, lse_ref [S, block_r] f32
    ops = merge_ops(interpret)
    w, safe, lse_out = merge_weights([lse_ref[s, :] for s in range(num_splits)], ops[1])
    out = merge_columns(w, safe, lambda s: o_ref[s, :, :], out_ref.shape, ops)
    out_ref[...] = out.astype(out_ref.dtype)

    @pl.when(pl.program_id(2) == 0)
    def _():
        lse_out_ref[...] = lse_out


def merge_block_d(batch: int, rows: int, d_v: int, min_programs: int = 264) -> int:
    """Output columns per merge program: the widest power-of-two tile (<= d_v, >= 32 where d_v
    allows) that still gives `min_programs` programs (2 per multiprocessor on the H200), else
    the narrowest, 32."""
    def programs(bd):
        return batch * (rows // MERGE_BLOCK_R) * (d_v // bd)

    bd = d_v
    while bd > _MIN_BLOCK_D and bd % 2 == 0 and programs(bd) < min_programs:
        bd //= 2
    return bd


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_d", "num_warps", "interpret"))
def merge_splits_pallas(o_part: jax.Array, lse_part: jax.Array, out_dtype=jnp.bfloat16, *,
                        block_d: int | None = None, num_warps: int = 4,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp combine of split-KV partials in one Pallas launch.

    o_part:   f32 or bf16 [B, S, R, Dv]  each split's normalized output (finite; 0 where it is
              empty); combined in float32 either way.
    lse_part: f32 [B, S, R]      each split's natural-log LSE (-inf where it is empty).
    R must be a multiple of 16 and Dv a power of two (the decode kernel's partials are).
    Returns out [B, R, Dv] (out_dtype) and lse f32 [B, R]; a row whose splits are all empty gets
    out 0 and lse +inf. block_d: output columns per program (default `merge_block_d`).
    """
    if o_part.ndim != 4:
        raise ValueError(f"o_part must have shape [B, S, R, Dv], got {o_part.shape}")
    b, s, r, dv = o_part.shape
    if o_part.dtype.name not in PARTIAL_DTYPES or lse_part.dtype != jnp.float32:
        raise TypeError(f"o_part ({o_part.dtype}) must be float32 or bfloat16 and lse_part "
                        f"({lse_part.dtype}) float32")
    if lse_part.shape != (b, s, r):
        raise ValueError(f"lse_part has shape {lse_part.shape}; o_part {o_part.shape} needs "
                         f"{(b, s, r)}")
    if r % MERGE_BLOCK_R:
        raise ValueError(f"merge rows {r} (o_part.shape[2]) must be a multiple of {MERGE_BLOCK_R}")
    if not is_power_of_two(dv):
        raise ValueError(f"o_part.shape[3]={dv} must be a power of two")
    bd = merge_block_d(b, r, dv) if block_d is None else block_d
    if not is_power_of_two(bd) or dv % bd:
        raise ValueError(f"block_d={bd} must be a power of two dividing {dv}")
    br = MERGE_BLOCK_R
    kernel = functools.partial(_merge_kernel, num_splits=s, interpret=interpret)
    return pl.pallas_call(
        kernel,
        grid=(b, r // br, dv // bd),
        in_specs=[pl.BlockSpec((None, s, br, bd), lambda i, j, k: (i, 0, j, k)),
                  pl.BlockSpec((None, s, br), lambda i, j, k: (i, 0, j))],
        out_specs=[pl.BlockSpec((None, br, bd), lambda i, j, k: (i, j, k)),
                   pl.BlockSpec((None, br), lambda i, j, k: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((b, r, dv), out_dtype),
                   jax.ShapeDtypeStruct((b, r), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"funcmla_merge_s{s}_d{bd}" + ("_bf16" if o_part.dtype == jnp.bfloat16 else ""),
    )(o_part, lse_part)


def merge_attention_states(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                           lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combine two attention results over disjoint key sets (SGLang's `merge_state`: a prefix
    chunk and the new tokens of a chunked prefix cache) into the result over their union.

    out_a, out_b [..., D] (any float dtype, normalized); lse_a, lse_b [...] float32 natural
    log (+inf or -inf: that side saw no key, and its out is ignored whatever it holds).
    Returns out [..., D] (out_a's dtype) and lse [...] float32, +inf where neither side saw a
    key (out 0 there), as the kernels report an empty row. The rule is the split merge's
    (`merge_weights`, `merge_columns`: one home), in plain float32 XLA operations.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape \
            or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"merge_attention_states: out_a {out_a.shape}, out_b {out_b.shape} "
                         f"must be equal and [..., D] over lse_a {lse_a.shape}, lse_b "
                         f"{lse_b.shape}")
    if lse_a.dtype != jnp.float32 or lse_b.dtype != jnp.float32:
        raise TypeError(f"lse_a ({lse_a.dtype}) and lse_b ({lse_b.dtype}) must be float32")
    d = out_a.shape[-1]
    rows = lse_a.size
    lses = [jnp.where(jnp.isinf(x), -jnp.inf, x).reshape(rows) for x in (lse_a, lse_b)]
    # An empty side's out is selected away (never multiplied by its zero weight).
    outs = [jnp.where(jnp.isfinite(x)[:, None], o.reshape(rows, d).astype(jnp.float32), 0.0)
            for o, x in zip((out_a, out_b), lses)]
    ops = (lambda a, b: a * b), (lambda a, b: a + b), (lambda a, b: a / b)
    w, safe, lse = merge_weights(lses, ops[1])
    out = merge_columns(w, safe, lambda s: outs[s], (rows, d), ops)
    return out.astype(out_a.dtype).reshape(out_a.shape), lse.reshape(lse_a.shape)
