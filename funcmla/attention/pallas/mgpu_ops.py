"""Mosaic GPU building blocks shared by the Pallas kernels, each also running in Mosaic GPU's
interpreter (which has no register layouts, no `run_state` accumulators and no `plgpu.load`,
jax 0.10.2): a load in a layout, a store of registers, a layout cast, an iota, accumulating
`wgmma`s, a warpgroup barrier, a producer's wait for its stages' last releases, the
transforms of a swizzled shared-memory operand, the compiler parameters every kernel here
uses, and the interpreter parameters with the rule for where the interpreter can run. Used by
`decode_mgpu`, `decode_mgpu_fp8`, `decode_mgpu_fp8_wide`, `mgpu_kv_copy` and `prefill_mgpu`.
"""

from __future__ import annotations

import inspect
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["load", "store", "in_layout", "iota", "mma_acc", "mma_acc_and", "release_seen",
           "wait_last_releases", "swizzled", "warpgroup_sync", "compiler_params",
           "check_warpgroup_registers", "check_warpgroup_budgets", "check_profile",
           "mgpu_params", "REGISTER_BUDGET",
           "interpreter_unsupported", "xla_cpu_threads", "WARPGROUPS"]


# jax 0.10.2's `plgpu.load(src, idx, ...)` needs the index; 0.11 deprecates passing it (the ref
# is indexed with `.at` first) and lets it be left out.
_LOAD_NEEDS_INDEX = getattr(inspect.signature(plgpu.load).parameters.get("idx"), "default",
                            None) is inspect.Parameter.empty


def load(ref, layout, interpret: bool):
    """ref[...] in `layout`. Mosaic GPU's interpreter has no `plgpu.load` (jax 0.10.2), and
    layouts do not exist there, so interpret mode reads the ref plainly."""
    if interpret:
        return ref[...]
    if _LOAD_NEEDS_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


# jax 0.12 lowers `ref[...] = x` as a transfer that must avoid shared-memory bank conflicts
# and refuses one it cannot plan (TransferPlanDerivationError, e.g. the WGMMA layout into an
# unswizzled output stage); its `plgpu.store(..., optimized=False)` is the plain transfer that
# jax 0.10 / 0.11 lower `ref[...] = x` to, and which they have no `plgpu.store` for.
_HAS_STORE = hasattr(plgpu, "store")


def store(ref, x, interpret: bool) -> None:
    """ref[...] = x from registers as a plain transfer (the one jax 0.10-0.11 emit, on jax 0.12
    too, where `ref[...] =` demands a bank-conflict-free plan)."""
    if interpret or not _HAS_STORE:
        ref[...] = x
    else:
        plgpu.store(ref, x, optimized=False)


def in_layout(x, layout, interpret: bool):
    """x with register layout `layout` (the interpreter has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dim: int, interpret: bool):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def mma_acc(acc, a, b, interpret: bool):
    """acc + a @ b on the matrix units (`wgmma`, waited). Compiled, the accumulator enters the
    wgmma in registers (`pl.run_state`). Mosaic GPU's interpreter has neither run_state nor
    accumulator stores (jax 0.10.2), so there the product goes to a fresh accumulator and is
    added (the same sum, in another order)."""
    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(0)
        if interpret:
            return acc_ref[...]

    if interpret:
        return acc + pl.run_scoped(body, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(body)(plgpu.ACC.init(acc))


def mma_acc_and(acc, a, b, x, under, interpret: bool):
    """(acc + a @ b, under(x)), with `under` (which may also store and arrive on barriers)
    run while the `wgmma` does; `a` is a shared-memory ref or a bf16 array in registers. The
    interpreter has no run_state or register operands, so there `under` runs after a plain
    fp32 dot."""
    if interpret:
        a = a if isinstance(a, jax.Array) else a[...]
        acc = acc + lax.dot_general(a, b[...], (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        return acc, under(x)

    def body(refs):
        acc_ref, x_ref = refs
        plgpu.wgmma(acc_ref, a, b)
        x_ref[...] = under(x_ref[...])

    return pl.run_state(body)((plgpu.ACC.init(acc), x))


def release_seen(interpret: bool) -> None:
    """A producer's step after waiting for a stage's release and before its TMA copy into the
    stage. The interpreter (jax >= 0.12) orders the consumers' plain reads of the stage
    before that async-proxy write only through a proxy fence; on the GPU the barrier orders
    them (the reads completed before the release), so compiled kernels carry no fence."""
    if interpret:
        plgpu.commit_smem()


def wait_last_releases(empties, filled, num_stages: int) -> None:
    """A producer's last step: waits on each of `empties` (barriers [num_stages] each) for the
    last release of every stage a ring filled `filled` times (stage i % num_stages at fill i,
    from 0). Every wait then sees every phase (Mosaic GPU's interpreter checks it), and the
    block's shared memory is not left while a consumer may still read it."""
    for back in range(num_stages):
        @pl.when(filled > back)
        def _():
            st = lax.rem(filled - 1 - back, num_stages)
            for empty in empties:
                plgpu.barrier_wait(empty.at[st])


def swizzled(swizzle: int, itemsize: int) -> tuple:
    """Shared-memory transforms of a `swizzle`-byte swizzled operand of `itemsize`-byte
    elements: (8, swizzle / itemsize) tiles, each row of a tile one swizzle span (what `wgmma`
    and the TMA read and write)."""
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def warpgroup_sync(interpret: bool) -> None:
    """This warpgroup's threads meet (`bar.sync` on the warpgroup's own barrier): orders their
    shared-memory stores (fenced by `plgpu.commit_smem`) before a `wgmma` of theirs reads them.
    A no-op in the interpreter, which runs a warpgroup as one program."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def sync(ctx):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu

        mu.warpgroup_barrier()

    sync()


# Warpgroups a block of every Mosaic GPU kernel here: a producer and two consumers.
WARPGROUPS = 3


def xla_cpu_threads() -> int:
    """XLA:CPU's worker threads in this process, by XLA's rule: `PJRT_NPROC`, else `NPROC`,
    else the CPUs the process may run on. XLA reads it once, when JAX starts its CPU backend."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if re.fullmatch(r"\s*[+-]?\d+\s*", value):  # what XLA parses as a number; else the next
            return max(0, int(value))
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def interpreter_unsupported() -> str | None:
    """None when Mosaic GPU's interpreter can run a `WARPGROUPS`-warpgroup kernel in this
    process, else why not. The interpreter runs each warpgroup as its own XLA:CPU execution
    whose barrier waits block a worker thread: with fewer workers than warpgroups, the waiting
    ones can hold every worker while the one they wait for gets none, and the call hangs (2
    workers on 2 CPUs; docs/decode_kernel.md, "Interpret mode")."""
    threads = xla_cpu_threads()
    if threads >= WARPGROUPS:
        return None
    return (f"Mosaic GPU interpret mode runs a kernel's {WARPGROUPS} warpgroups on XLA:CPU "
            f"worker threads, one each, and this process has {threads} (PJRT_NPROC, else "
            f"NPROC, else its CPUs), so it could hang: set PJRT_NPROC={WARPGROUPS} or more "
            "before JAX starts")


def compiler_params(profile_space: int = 0, profile_dir: str = "") -> plgpu.CompilerParams:
    """Mosaic GPU compiler parameters of every kernel here: approximate `ex2` / `lg2` (the
    softmax's exponentials, the lse's log), no built-in reduction scratch (the kernels reduce
    across threads through their own shared memory), lane semantics (register layouts
    explicit); `profile_space` / `profile_dir`: the in-kernel profiler (off at 0)."""
    return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                lowering_semantics=plgpu.LoweringSemantics.Lane,
                                profile_space=profile_space, profile_dir=profile_dir)


# setmaxnreg budgets of a block's three warpgroups sum to at most 3 x 168: ptxas compiles a
# 384-thread block at 168 registers a thread, and an increase is served only from the block's
# own decreases (a 160 / 160 / 192 split, 512 in all, hung: docs/decode_kernel.md).
REGISTER_BUDGET = 504


def _is_budget(value) -> bool:
    """Whether `value` is a `setmaxnreg` budget: an int, a multiple of 8 in [24, 256]."""
    return isinstance(value, int) and value % 8 == 0 and 24 <= value <= 256


def check_warpgroup_registers(owner: str, consumer: int, producer: int) -> None:
    """`setmaxnreg` budgets of a two-consumer, one-producer kernel: each a multiple of 8 in
    [24, 256], and 2 x consumer + producer <= REGISTER_BUDGET. Raises ValueError naming
    `owner`'s field and value."""
    for name, value in (("consumer_registers", consumer), ("producer_registers", producer)):
        if not _is_budget(value):
            raise ValueError(f"{owner}.{name} must be a multiple of 8 in [24, 256] "
                             f"(setmaxnreg), got {value!r}")
    if 2 * consumer + producer > REGISTER_BUDGET:
        raise ValueError(f"{owner}: 2 x consumer_registers={consumer} + producer_registers="
                         f"{producer} = {2 * consumer + producer} exceeds {REGISTER_BUDGET} "
                         "(3 warpgroups x the 168 registers a thread ptxas gives a 384-thread "
                         "block)")


def check_warpgroup_budgets(owner: str, field: str, registers) -> None:
    """(producer, consumer 0, consumer 1) `setmaxnreg` budgets: three ints, each a multiple
    of 8 in [24, 256], summing to at most REGISTER_BUDGET. Raises ValueError naming `owner`'s
    `field` and the value."""
    if (not isinstance(registers, tuple) or len(registers) != 3
            or not all(isinstance(n, int) for n in registers)):
        raise ValueError(f"{owner}.{field} must be a tuple of three ints (producer, consumer 0, "
                         f"consumer 1), got {registers!r}")
    for name, value in zip(("producer", "consumer 0", "consumer 1"), registers):
        if not _is_budget(value):
            raise ValueError(f"{owner}.{field}: the {name} budget must be a multiple of 8 in "
                             f"[24, 256] (setmaxnreg), got {value} in {registers!r}")
    if sum(registers) > REGISTER_BUDGET:
        raise ValueError(f"{owner}.{field}={registers!r} sums to {sum(registers)}, over "
                         f"{REGISTER_BUDGET} (3 warpgroups x the 168 registers a thread ptxas "
                         "gives a 384-thread block)")


def check_profile(owner: str, space, directory: str, limit: int | None = None) -> None:
    """The in-kernel profiler's settings (`compiler_params`): space an int in [0, limit] (>= 0
    without a limit), and a directory for the traces when space > 0. Raises ValueError naming
    `owner`'s field."""
    if not isinstance(space, int) or space < 0 or (limit is not None and space > limit):
        bound = ("an int >= 0" if limit is None
                 else f"in [0, {limit}] (its trace buffer lives in shared memory)")
        raise ValueError(f"{owner}.profile_space={space!r} must be {bound}")
    if space and not directory:
        raise ValueError(f"{owner}.profile_space > 0 needs a profile_dir for the traces")


def mgpu_params(interpret):
    """Pallas's `interpret` argument: None (compiled), default interpreter parameters for True,
    else the caller's own (e.g. with the race detector on). Raises RuntimeError where the
    interpreter could hang (`interpreter_unsupported`)."""
    if not interpret:
        return None
    why = interpreter_unsupported()
    if why is not None:
        raise RuntimeError(why)
    if interpret is not True:
        return interpret
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
