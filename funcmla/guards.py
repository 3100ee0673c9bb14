"""When value checks run, and host-side integer inputs that must fit int32.

Entry points (metadata builders, index expansion, the reference, the executor) check their
values **when the values are concrete** (an eager call) and **inside `checks.checked(fn)`**
(under `jit`, as checkify checks); a plain jitted call checks nothing at run time, but still never
reads or writes out of bounds. `should_check(*arrays)` is that rule.

Integer inputs arrive as Python lists, NumPy arrays or JAX arrays. With x64 off, JAX narrows an
int64 array to int32 silently (2**32 + 1 becomes 1), so `int_array` checks the range on the
host value *before* conversion and names the field and the int32 limit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

__all__ = [
    "INT32_MAX", "Checker", "EAGER", "TRACED", "checking", "is_concrete", "should_check",
    "enforce", "int_array", "check_int32_total",
]

INT32_MAX = 2**31 - 1  # every index, length and offset in the metadata is int32



def _raise_now(ok, message: str, **fields) -> None:
    if not bool(np.all(ok)):
        raise ValueError(message.format(**{k: np.asarray(v).item() for k, v in fields.items()}))


@dataclasses.dataclass(frozen=True)
class Checker:
    """How a value rule runs: `xp` is the array module, `check(ok, message, **fields)` the check
    (`message` is a `str.format` template over the scalar fields, as in `checkify.check`).
    `TRACED` emits a checkify check (under `jit`, through `funcmla.checks.checked`); `EAGER`
    evaluates it in NumPy on concrete values and raises `ValueError` at the first failure, with
    the same message and no compilation. Each rule is written once, over a `Checker`."""

    xp: Any
    check: Callable[..., None]


EAGER = Checker(np, _raise_now)
TRACED = Checker(jnp, checkify.check)

_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("funcmla_checking", default=False)


@contextlib.contextmanager
def checking():
    """Inside this context (entered by `funcmla.checks.checked` while it traces), entry points
    emit their value checks as checkify checks even though their inputs are tracers."""
    token = _CHECKING.set(True)
    try:
        yield
    finally:
        _CHECKING.reset(token)


def is_concrete(*xs: Any) -> bool:
    """True when no argument is a JAX tracer (an eager call)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def should_check(*xs: Any) -> bool:
    """Value checks run on concrete values, and under `funcmla.checks.checked`."""
    return _CHECKING.get() or is_concrete(*xs)


@functools.lru_cache(maxsize=256)
def _compiled(fn: Callable, static: tuple) -> Callable:
    return jax.jit(checkify.checkify(functools.partial(fn, **dict(static)),
                                     errors=checkify.user_checks))


def enforce(fn: Callable, *arrays: Any, **static: Any) -> None:
    """Run the value check `fn(*arrays, **static)` (checkify checks; `static` hashable).

    Under `checks.checked` with traced inputs its checks join the traced program; otherwise (an
    eager call) it runs compiled once per shape and raises `checkify.JaxRuntimeError` (a
    ValueError) naming the first failed check, at about one dispatch of cost."""
    if _CHECKING.get() and not is_concrete(arrays):
        fn(*arrays, **static)
        return
    err, _ = _compiled(fn, tuple(sorted(static.items())))(*arrays)
    err.throw()


def int_array(x: Any, name: str, *, ndim: int | None = None) -> jax.Array:
    """`x` as an int32 JAX array, refusing what a silent conversion would corrupt.

    TypeError for a non-integer dtype (float, bool: a float index would be truncated);
    ValueError for the wrong rank, and for a concrete value outside int32 (with x64 off, JAX
    would narrow it modulo 2**32), naming `name`, the position, the value and the limit.
    """
    if not isinstance(x, (jax.core.Tracer, jax.Array)):
        x = np.asarray(x)
    dtype = x.dtype
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and dtype.itemsize > 4:
        x = np.asarray(x)  # x64 on: range-check on the host like any other 64-bit input
    if not (jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be an integer array, got dtype {dtype}")
    if ndim is not None and x.ndim != ndim:
        shape = {1: "[batch]", 2: "[rows, columns]"}.get(ndim, f"{ndim}-D")
        raise ValueError(f"{name} must be {ndim}-D {shape}, got shape {tuple(x.shape)}")
    if isinstance(x, np.ndarray) and dtype.itemsize > 4 and x.size:
        bad = (x > INT32_MAX) | (x < -INT32_MAX - 1)
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), x.shape)
            where = ", ".join(str(int(k)) for k in i)
            raise ValueError(
                f"{name}[{where}] = {int(x[i])} does not fit int32 (limit {INT32_MAX}); "
                "indices, lengths and offsets are int32"
            )
    return jnp.asarray(x).astype(jnp.int32)


def check_int32_total(lens: Any, name: str) -> None:
    """Host check: the cumulative sum of concrete non-negative `lens` fits int32 (summed in
    64 bits), so an indptr built from them cannot wrap. No-op for tracers."""
    if not is_concrete(lens):
        return
    v = np.asarray(lens).astype(np.int64)
    total = int(np.clip(v, 0, None).sum())
    if total > INT32_MAX:
        c = np.cumsum(np.clip(v, 0, None))
        i = int(np.argmax(c > INT32_MAX))
        raise ValueError(
            f"sum({name}) = {total} exceeds the int32 limit {INT32_MAX} (the cumulative offset "
            f"passes it at {name}[{i}]); split the batch"
        )
