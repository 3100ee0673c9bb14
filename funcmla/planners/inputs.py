"""Input rules shared by the planners: int32 limits, host inputs, checked-by-default eager calls.

AITER's plan buffers are int32 (`work_info`, the indptrs), so every cumulative length a planner
reads or writes must stay below 2**31. A cumulative sum built in int32 past that limit wraps to a
negative value, and a plan built from it is silently wrong; the planners therefore

* take host inputs (NumPy / Python integers of any width) only after checking that they fit
  (`to_int32`), so a 64-bit cumulative length past the limit is named as such;
* state their value preconditions once, as checkify checks (`check_decode_plan_inputs`,
  `check_prefill_plan_inputs`), usable under `jit` through `funcmla.checks.checked`; and
* run those checks by default wherever the inputs are concrete (`raise_if_invalid`), raising
  `ValueError` with the failing check's message. Under `jit` the inputs are tracers and nothing
  is checked unless the caller asks for the checkify variant.
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from funcmla.checks import checked

__all__ = ["INT32_MAX", "is_concrete", "to_int32", "raise_if_invalid", "check_no_wrap",
           "check_prefix_sums_fit"]

INT32_MAX = int(np.iinfo(np.int32).max)  # 2147483647: the int32 fields of work_info

# What a value past the limit is, per input name, for the error message.
_TOTALS = {"kv_indptr": "total kv length", "qo_indptr": "total qo length"}


def is_concrete(*xs) -> bool:
    """True when no input is a tracer (an eager call: the values can be checked)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def to_int32(x, name: str) -> jax.Array:
    """A 1-D integer input as int32. Traced inputs must already be int32. Concrete inputs of any
    integer width are accepted when every value fits int32, else `ValueError` names the value
    and the limit (a cumulative length computed in 64 bits past 2**31 - 1)."""
    if isinstance(x, jax.core.Tracer):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
        return x
    arr = np.asarray(x)
    if arr.dtype == np.int32:
        return jnp.asarray(arr)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if arr.size:
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


def raise_if_invalid(check: Callable[..., None], *args) -> None:
    """Run the checkify checks `check(*args)` on concrete values; raise `ValueError` with the
    first failing check's message."""
    err, _ = checked(check)(*args)
    msg = err.get()
    if msg is not None:
        raise ValueError(re.sub(r"\s*\(`?check`? failed[^)]*\)\s*$", "", msg))


def check_no_wrap(indptr: jax.Array, name: str) -> None:
    """checkify: no entry of an offset array is negative. A cumulative sum of non-negative int32
    lengths that passes 2**31 - 1 first wraps to a negative value, so this catches every wrap."""
    bad = indptr < 0
    i = jnp.argmax(bad).astype(jnp.int32)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} is negative: a cumulative length past the int32 limit "
        f"{INT32_MAX} wrapped around (build offsets in 64 bits; the plan cannot hold them)",
        i=i, v=indptr[i])


def check_prefix_sums_fit(values: jax.Array, what: str) -> None:
    """checkify: the running sum of non-negative int32 `values` stays within int32. Each value is
    below 2**31, so a sum past the limit has a negative prefix (in int32) right where it first
    overflows."""
    run = jnp.cumsum(values.astype(jnp.int32), dtype=jnp.int32)
    bad = run < 0
    i = jnp.argmax(bad).astype(jnp.int32)
    checkify.check(~jnp.any(bad),
                   f"{what} exceeds the int32 limit {INT32_MAX} at element {{i}}", i=i)
