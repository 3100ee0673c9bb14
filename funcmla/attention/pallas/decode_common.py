"""Backend-independent pieces of the paged MLA decode kernel.

* `DecodeKernelConfig`: static tiling (hashable, a jit static argument).
* `KVRows`: the one index form the kernel reads: token `t` of sequence `b` lives in pool row
  `table[table_start[b] + t // page_size] * page_size + t % page_size`. A token CSR
  (`kv_indptr`, `kv_indices`; page size 1, SGLang/AITER style) and a page table (page size 16/64,
  FlashMLA style) both map onto it without copying the index array.
* `choose_num_splits`: the documented split-KV rule.
* `merge_splits`: the log-sum-exp combine of per-split partial results.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from funcmla.layout import PageTable, TokenCSR, is_power_of_two

__all__ = [
    "DecodeKernelConfig",
    "KVRows",
    "kv_rows_from_csr",
    "kv_rows_from_page_table",
    "choose_num_splits",
    "merge_splits",
    "MAX_POOL_ROWS",
]

# Pool rows are addressed by int32 slot ids; the kernels compute element offsets
# (slot * row_width + col) in 64-bit once the pool exceeds 4 GiB (see decode_triton.py).
MAX_POOL_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Static tiling of the decode kernel.

    block_m:    query rows per program (rows = s_q * heads of one sequence, folded); a power of
                two >= 16. None: min(64, next power of two >= rows).
    block_kv:   KV tokens per inner-loop step; a power of two >= 16.
    num_warps:  warps per program. None: 4 when block_m <= 16, else 8.
    num_stages: software-pipelining depth of the KV loads (3 was fastest on H200 for 16 and
                128 heads; see docs/decode_kernel_notes.md).
    num_sms:    multiprocessors the split rule fills (132 on H200).
    waves:      programs per multiprocessor the split rule aims for.
    min_blocks_per_split: the split rule never makes a split shorter than this many KV blocks.
    evict_first: load KV rows with the evict-first cache policy (they are read once).
    """

    block_m: int | None = None
    block_kv: int = 64
    num_warps: int | None = None
    num_stages: int = 3
    num_sms: int = 132
    waves: int = 2
    min_blocks_per_split: int = 2
    evict_first: bool = True

    def __post_init__(self):
        if self.block_m is not None and not (is_power_of_two(self.block_m) and self.block_m >= 16):
            raise ValueError(
                f"DecodeKernelConfig.block_m must be a power of two >= 16, got {self.block_m!r}"
            )
        if not (is_power_of_two(self.block_kv) and self.block_kv >= 16):
            raise ValueError(
                f"DecodeKernelConfig.block_kv must be a power of two >= 16, got {self.block_kv!r}"
            )
        for name in ("num_stages", "num_sms", "waves", "min_blocks_per_split"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeKernelConfig.{name} must be a positive int, got {value!r}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"DecodeKernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}"
            )

    def resolved_block_m(self, rows: int) -> int:
        """Rows per program for `rows` folded query rows per sequence."""
        if self.block_m is not None:
            return self.block_m
        return min(64, max(16, 1 << (rows - 1).bit_length()))

    def resolved_num_warps(self, block_m: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 4 if block_m <= 16 else 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVRows:
    """Where each sequence's KV tokens live in the pool, in the kernel's one form.

    table:       int32 [n]          entries (token slots when page_size == 1, else page ids).
    table_start: int32 [num_seqs]   first entry of each sequence in `table`.
    kv_lens:     int32 [num_seqs]   KV tokens per sequence.
    page_size:   static int         tokens per entry.
    max_kv_len:  static int         upper bound on kv_lens (tokens), used by the split rule.
    """

    table: jax.Array
    table_start: jax.Array
    kv_lens: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))
    max_kv_len: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_seqs(self) -> int:
        return self.kv_lens.shape[0]


def _check_int32(value, name: str) -> None:
    if value.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got {value.dtype}")


def kv_rows_from_csr(kv_indptr: jax.Array, kv_indices: jax.Array,
                     max_kv_len: int | None = None) -> KVRows:
    """Token CSR (page size 1): kv_indptr int32 [B+1] in tokens, kv_indices int32 [capacity]."""
    _check_int32(kv_indptr, "kv_indptr")
    _check_int32(kv_indices, "kv_indices")
    if kv_indptr.ndim != 1 or kv_indptr.shape[0] < 2:
        raise ValueError(f"kv_indptr must have shape [num_seqs + 1], got {kv_indptr.shape}")
    if kv_indices.ndim != 1 or kv_indices.shape[0] < 1:
        raise ValueError(f"kv_indices must have shape [capacity >= 1], got {kv_indices.shape}")
    bound = kv_indices.shape[0] if max_kv_len is None else max_kv_len
    return KVRows(kv_indices, kv_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1], 1, int(bound))


def kv_rows_from_page_table(page_table: PageTable) -> KVRows:
    """Page table: table int32 [B, max_pages] of page ids, lengths int32 [B] in tokens."""
    if not isinstance(page_table, PageTable):
        raise TypeError(f"page_table must be a funcmla.layout.PageTable, got {type(page_table)}")
    _check_int32(page_table.table, "page_table.table")
    _check_int32(page_table.lengths, "page_table.lengths")
    b, max_pages = page_table.table.shape
    start = jnp.arange(b, dtype=jnp.int32) * max_pages
    return KVRows(page_table.table.reshape(-1), start, page_table.lengths, page_table.page_size,
                  max_pages * page_table.page_size)


def choose_num_splits(num_seqs: int, num_row_blocks: int, max_kv_len: int,
                      config: DecodeKernelConfig) -> int:
    """The split-KV rule (static: a function of shapes only).

    A program handles one (row block, split, sequence). Aim for `waves * num_sms` programs:

        splits = ceil(waves * num_sms / (num_seqs * num_row_blocks))

    then cap it so that no split is shorter than `min_blocks_per_split` KV blocks of the longest
    possible sequence (`max_kv_len`): splits <= max(1, ceil(max_kv_len / block_kv) //
    min_blocks_per_split). Each sequence's KV is cut into `splits` equal runs of whole blocks;
    splits past a sequence's end do no work and carry lse = -inf into the combine.
    """
    programs = num_seqs * num_row_blocks
    want = -(-config.waves * config.num_sms // programs)
    max_blocks = -(-max(max_kv_len, 1) // config.block_kv)
    cap = max(1, max_blocks // config.min_blocks_per_split)
    return int(max(1, min(want, cap)))


def merge_splits(o_part: jax.Array, lse_part: jax.Array, out_dtype) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp combine over axis 1.

    o_part:   f32 [B, S, R, Dv]  each split's normalized output (0 where the split is empty).
    lse_part: f32 [B, S, R]      each split's natural-log LSE (-inf where empty).
    Returns out [B, R, Dv] (out_dtype) and lse f32 [B, R]; rows with no KV at all get out 0 and
    lse +inf.
    """
    m = jnp.max(lse_part, axis=1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_part - m_safe[:, None])  # 0 for empty splits
    total = jnp.sum(w, axis=1)
    out = jnp.sum(w[..., None] * o_part, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), jnp.inf)
    return out.astype(out_dtype), lse


def num_row_blocks(rows: int, block_m: int) -> int:
    return math.ceil(rows / block_m)
