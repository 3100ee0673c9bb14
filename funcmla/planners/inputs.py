"""Input rules shared by the planners: int32 limits, host inputs, checked-by-default eager calls.

AITER's plan buffers are int32 (`work_info`, the indptrs), so every cumulative length a planner
reads or writes must stay below 2**31. A cumulative sum built in int32 past that limit wraps to a
negative value, and a plan built from it is silently wrong; the planners therefore

* take host inputs (NumPy / Python integers of any width) only after checking that they fit
  (`to_int32`), so a 64-bit cumulative length past the limit is named as such;
* state each value precondition once, as a function of a `Checker`: `TRACED` runs it as a
  checkify check (under `jit`, through `funcmla.checks.checked`), `EAGER` evaluates it in NumPy
  on concrete inputs and raises `ValueError` at the first failure, with the same message and no
  compilation. Eager planner calls run the checks by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.guards import EAGER, INT32_MAX, TRACED, Checker, is_concrete

__all__ = ["INT32_MAX", "Checker", "EAGER", "TRACED", "is_concrete", "to_int32",
           "check_no_wrap", "check_prefix_sums_fit"]

# What a value past the limit is, per input name, for the error message.
_TOTALS = {"kv_indptr": "total kv length", "qo_indptr": "total qo length"}


def to_int32(x, name: str) -> jax.Array:
    """A 1-D integer input as int32. Traced inputs must already be int32. Concrete inputs of any
    integer width are accepted when every value fits int32, else `ValueError` names the value
    and the limit (a cumulative length computed in 64 bits past 2**31 - 1)."""
    if isinstance(x, jax.core.Tracer):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
        return x
    if isinstance(x, jax.Array) and x.dtype == jnp.int32:
        return x  # already on its device: no round trip
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if arr.dtype != np.int32 and arr.size:
        big = np.flatnonzero(arr > INT32_MAX)
        if big.size:
            i = int(big[0])
            what = _TOTALS.get(name, name)
            raise ValueError(f"{what} {int(arr[i])} ({name}[{i}]) exceeds the int32 limit "
                             f"{INT32_MAX} of work_info")
        small = np.flatnonzero(arr < -INT32_MAX - 1)
        if small.size:
            i = int(small[0])
            raise ValueError(f"{name}[{i}] = {int(arr[i])} is below the int32 limit "
                             f"{-INT32_MAX - 1}")
    return jnp.asarray(arr.astype(np.int32))


def _first(xp, bad):
    return xp.argmax(bad).astype(xp.int32)


def check_no_wrap(c: Checker, indptr, name: str) -> None:
    """No entry of an offset array is negative. A cumulative sum of non-negative int32 lengths
    that passes 2**31 - 1 first wraps to a negative value, so this catches every wrap."""
    bad = indptr < 0
    i = _first(c.xp, bad)
    c.check(~c.xp.any(bad),
            f"{name}[{{i}}] = {{v}} is negative: a cumulative length past the int32 limit "
            f"{INT32_MAX} wrapped around (build offsets in 64 bits; the plan cannot hold them)",
            i=i, v=indptr[i])


def check_prefix_sums_fit(c: Checker, values, what: str) -> None:
    """The running sum of non-negative int32 `values` stays within int32. Each value is below
    2**31, so a sum past the limit has a negative prefix (in int32) where it first overflows."""
    xp = c.xp
    run = xp.cumsum(values.astype(xp.int32), dtype=xp.int32)
    bad = run < 0
    c.check(~xp.any(bad), f"{what} exceeds the int32 limit {INT32_MAX} at element {{i}}",
            i=_first(xp, bad))
