"""Granularity-typed index layouts.

Two different things can describe where a batch's KV lives, and confusing them is the bug this
project grew from (README: sglang#25556):

* `TokenCSR`: `indptr` counts **tokens**, `indices[indptr[i] + t]` is the **token slot** (row of
  the KV pool) of token `t` of sequence `i`. Static `capacity = indices.shape[0]`.
* `PageTable`: `table[i, p]` is the **page id** of page `p` of sequence `i`, `lengths[i]` counts
  **tokens**, and `page_size` is static. Token `t` lives at slot
  `table[i, t // page_size] * page_size + t % page_size`.

They are distinct pytrees; functions that take one check it with `expect_layout`, so passing the
other fails at trace time. Conversions are explicit (`funcmla.indices`).

Static sizes (`page_size`) are pytree meta fields and therefore part of the jit cache key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "TokenCSR", "PageTable", "PoolSpec", "expect_layout", "expect_index_array", "is_power_of_two",
    "check_page_size", "next_power_of_two",
]


def is_power_of_two(n: Any) -> bool:
    """True for a Python int (not bool) that is a positive power of two."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int, floor: int = 1) -> int:
    """The smallest power of two >= n, and at least `floor` (bucket and tile sizes: Triton
    vectors and jit cache keys both want power-of-two sizes)."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def check_page_size(page_size: Any, name: str = "page_size") -> None:
    """The one home of the page-size rule: a positive power of two (Python int), because slots
    split into (page, offset) by shift and mask. Raises ValueError naming `name` and the value."""
    if not is_power_of_two(page_size):
        raise ValueError(f"{name} must be a power of two, got {page_size!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCSR:
    """Token-granular CSR over a KV pool.

    indptr:  int32 [num_seqs + 1]  token offsets; indptr[0] == 0, indptr[-1] = live tokens.
    indices: int32 [capacity]      token slots; entries past indptr[-1] are fill (see
                                   `funcmla.indices.FILL_SLOT`) and must never be read.
    """

    indptr: jax.Array
    indices: jax.Array

    granularity = "token"

    @property
    def capacity(self) -> int:
        """Static length of `indices`, in tokens."""
        return self.indices.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.indptr.shape[0] - 1

    @property
    def lengths(self) -> jax.Array:
        """int32 [num_seqs]: tokens per sequence."""
        return self.indptr[1:] - self.indptr[:-1]

    @property
    def num_tokens(self) -> jax.Array:
        """int32 scalar: live tokens (indptr[-1])."""
        return self.indptr[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Page-granular block table (FlashMLA / FlashInfer style).

    table:   int32 [num_seqs, max_pages]  page ids; columns past ceil(lengths / page_size) are
                                          padding (they point at the reserved page 0).
    lengths: int32 [num_seqs]             tokens per sequence.
    page_size: static int, power of two.
    """

    table: jax.Array
    lengths: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    granularity = "page"

    def __post_init__(self):
        check_page_size(self.page_size, "PageTable.page_size")

    @property
    def num_seqs(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    @property
    def num_pages(self) -> jax.Array:
        """int32 [num_seqs]: pages in use per sequence, ceil(lengths / page_size)."""
        return (self.lengths + self.page_size - 1) // self.page_size

    @property
    def kv_last_page_len(self) -> jax.Array:
        """int32 [num_seqs]: tokens in the last page ((len - 1) % page_size + 1; 0 for empty)."""
        return jnp.where(self.lengths > 0, (self.lengths - 1) % self.page_size + 1, 0)


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """Static shape of a paged latent KV pool, in token slots.

    `num_slots = (num_pages + 1) * page_size` rows: page 0 (slots `[0, page_size)`) is reserved
    for padded tokens, as in SGLang, so `num_pages` usable pages hold slots
    `[page_size, num_slots)`.
    """

    num_pages: int
    page_size: int

    def __post_init__(self):
        check_page_size(self.page_size, "PoolSpec.page_size")
        if not isinstance(self.num_pages, int) or self.num_pages <= 0:
            raise ValueError(f"PoolSpec.num_pages must be a positive int, got {self.num_pages!r}")

    @property
    def num_slots(self) -> int:
        return (self.num_pages + 1) * self.page_size

    @property
    def first_usable_slot(self) -> int:
        return self.page_size


def expect_layout(value: Any, cls: type, name: str) -> None:
    """Trace-time type check: raise TypeError naming `name` if `value` is not a `cls`.

    This is what makes a PageTable passed where a TokenCSR is expected (or the reverse) fail at
    trace time instead of being silently reinterpreted.
    """
    if not isinstance(value, cls):
        got = getattr(value, "granularity", None)
        what = f"{type(value).__name__}" + (f" ({got}-granular)" if got else "")
        raise TypeError(
            f"{name}: expected a {cls.__name__} ({cls.granularity}-granular), got {what}; "
            "convert explicitly with funcmla.indices"
        )


def expect_index_array(value: Any, name: str) -> None:
    """Trace-time check that `value` is a raw integer array (a token-granular index stream such
    as `kv_indices`), not a layout object or a float array: raise TypeError naming `name`."""
    got = getattr(value, "granularity", None)
    if got is not None:
        raise TypeError(
            f"{name}: expected an int32 array of token slots or offsets (token-granular), got "
            f"{type(value).__name__} ({got}-granular); pass its arrays (a TokenCSR's "
            ".indptr / .indices) or convert explicitly with funcmla.indices"
        )
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {dtype or type(value).__name__}")
