"""What both decode kernels share: the static tiling (`DecodeKernelConfig`), the one index form
they read (`KVRows`), the split rule (`choose_num_splits`) and the split-KV combine as XLA ops
(`merge_splits`, the reference restatement of `merge.merge_splits_pallas`).

A token CSR (page size 1) and a page table both map onto `KVRows` without copying the index
array. Design and measurements: docs/decode_kernel.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from funcmla.layout import PageTable, is_power_of_two, next_power_of_two

__all__ = [
    "DecodeKernelConfig",
    "FP8_PRODUCTS",
    "seq_start_and_len",
    "block_coords",
    "split_tile_range",
    "causal_limit",
    "f16_row_scales",
    "pow2_row_scales",
    "KVRows",
    "kv_rows_from_csr",
    "kv_rows_from_page_table",
    "check_kv_form",
    "choose_num_splits",
    "merge_splits",
    "num_row_blocks",
    "fp8_triton_config",
    "FP8_WIDE_TILING",
    "FP8_NARROW_TILING",
    "FP8_CHUNK",
    "MAX_POOL_ROWS",
    "PARTIAL_DTYPES",
]

# Storage dtypes of split partials that both decode kernels write and the merges read.
PARTIAL_DTYPES = ("float32", "bfloat16")
# `DecodeKernelConfig.fp8_products`: q and P at bf16 accuracy, or rounded once to e4m3.
FP8_PRODUCTS = ("mixed", "fp8")

# Slot ids are int32 (the kernels form 64-bit element offsets from them).
MAX_POOL_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Static tiling of the decode kernels and the split rule (hashable: a jit static argument).

    Each default is the fastest setting measured on the H200 (`python -m bench.decode_sweep`,
    `python -m bench.decode --variants`); docs/decode_kernel.md gives the figures.

    block_m:    query rows per Triton program (rows = s_q * heads of one sequence, folded); a
                power of two >= 16. None: min(64, next power of two >= rows).
    block_kv:   KV tokens per Triton inner-loop step; a power of two >= 16.
    num_warps:  warps per Triton program. None: 4 when block_m <= 16, else 8.
    num_stages: Triton pipelining depth. None: 5 below 64 rows (two KV tiles in flight), 2 at
                64 rows (the wgmma path keeps q in shared memory).
    num_sms:    multiprocessors the split rule fills (132 on the H200).
    waves:      the split rule never makes more than `waves` full waves of programs.
    min_blocks_per_split: the split rule never makes a split shorter than this many KV blocks.
    max_splits: the most splits the split rule picks (an explicit `num_splits` may exceed it):
                the merge unrolls its loop over splits and spills registers past 64.
    evict_first: load KV rows with the evict-first cache policy (they are read once).
    programs_per_sm: programs resident per multiprocessor, for the split rule. None: estimated
                (`resolved_programs_per_sm`) from shared memory and registers.
    merge_block_d: output columns per program of the merge kernel (None: `merge.merge_block_d`).
    kernel:     which decode kernel `mla_decode` runs: "triton" (every shape), "mgpu" (the
                warp-specialized Mosaic GPU kernels: sm_90a, s_q * H a multiple of 64 for a bf16
                pool, 16 or a multiple of 64 for an fp8 one, a page size that divides 64 tokens
                or is a multiple of 64), or "auto" (default):
                "mgpu" where it applies on a GPU (not interpret mode) and the batch gives at
                least `mgpu_min_blocks` blocks of 64 rows, else "triton" (`api.uses_mgpu`).
    mgpu_min_blocks: the fewest 64-row blocks (sequences x s_q * H / 64; an extend's
                pseudo-sequences alike) at which "auto" runs the Mosaic GPU kernel. 1: wherever
                it applies; on the H200 it is faster than Triton at every batch measured, from
                2 blocks (H128 B1 L4k p64: 15.1 us against 18.3) to 32 (B16: 42.1 against
                105.9) (`python -m bench.decode_dispatch`).
    fp8_mgpu_min_seqs: the fewest sequences at which "auto" runs an fp8 pool on the 16-row
                fp8 Mosaic GPU kernel (a multiple of 16 folded rows that is not one of 64; a
                block a sequence, split and row group), else Triton. 16 (measured at 16
                rows; not re-tuned for row groups): on the H200 Triton is faster at batch
                1-4 (B1 L4k 11.6 us against 16.4), even at 8 (20.9-22.3 against 22.3-22.6),
                the Mosaic GPU kernel at 32 (46.5-47.9 against 63.7-66.4) and 128 (447
                against 927); 16 is not measured
                (`docs/results/decode_fp8_dispatch_h200.json`).
    program_overhead_blocks: fixed cost of one program (q load, pipeline fill, partial store)
                in units of one KV block, for the split rule.
    merge_overhead_blocks: cost of the merge launch (num_splits > 1) in KV blocks.
    partial_dtype: storage of per-split partial outputs ("bfloat16", default, or "float32").
                bf16 halves the bytes the decode writes and the merge reads; the merge still
                combines in float32 and the lse partials stay float32. "float32" keeps the
                extra bits (each partial is otherwise rounded to bf16 once).
    fp8_products: the products of a decode over an fp8 pool. "mixed" (default): q k^T with q
                as two e4m3 parts and P V with P in f16, the bf16 kernels' error (< 3e-3
                against float32 over the dequantized cache). "fp8": the all-fp8 matrix path,
                q and P each rounded once to e4m3 and both products on fp8 `wgmma`s: on the
                H200 0.68-0.80x the time of "mixed" at 128 heads, with e4m3's error, 5.7-5.8e-2
                on the output (`python -m bench.decode --kv-dtype fp8`; docs/decode_kernel.md,
                "fp8 products"). Only the 64-row fp8 Mosaic GPU kernel has it (s_q * H a multiple of
                64), so "fp8" runs that kernel wherever it applies, also under "auto", and
                raises elsewhere (`api.kernel_choice`). A bf16 pool ignores it; extends
                (`mla_extend`) run "mixed".
    """

    block_m: int | None = None
    block_kv: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    num_sms: int = 132
    waves: int = 2
    min_blocks_per_split: int = 1
    max_splits: int = 64
    evict_first: bool = True
    programs_per_sm: int | None = None
    program_overhead_blocks: int = 2
    merge_overhead_blocks: int = 1
    merge_block_d: int | None = None
    kernel: str = "auto"
    partial_dtype: str = "bfloat16"
    mgpu_min_blocks: int = 1
    fp8_mgpu_min_seqs: int = 16
    fp8_products: str = "mixed"

    def __post_init__(self):
        if self.block_m is not None and not (is_power_of_two(self.block_m) and self.block_m >= 16):
            raise ValueError(
                f"DecodeKernelConfig.block_m must be a power of two >= 16, got {self.block_m!r}"
            )
        if not (is_power_of_two(self.block_kv) and self.block_kv >= 16):
            raise ValueError(
                f"DecodeKernelConfig.block_kv must be a power of two >= 16, got {self.block_kv!r}"
            )
        if self.num_stages is not None and (not isinstance(self.num_stages, int)
                                            or self.num_stages <= 0):
            raise ValueError("DecodeKernelConfig.num_stages must be None or a positive int, got "
                             f"{self.num_stages!r}")
        for name in ("num_sms", "waves", "min_blocks_per_split", "max_splits",
                     "mgpu_min_blocks", "fp8_mgpu_min_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeKernelConfig.{name} must be a positive int, got {value!r}")
        for name in ("program_overhead_blocks", "merge_overhead_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"DecodeKernelConfig.{name} must be an int >= 0, got {value!r}")
        if self.programs_per_sm is not None and (
                not isinstance(self.programs_per_sm, int) or self.programs_per_sm <= 0):
            raise ValueError("DecodeKernelConfig.programs_per_sm must be None or a positive int, "
                             f"got {self.programs_per_sm!r}")
        if self.merge_block_d is not None and not is_power_of_two(self.merge_block_d):
            raise ValueError("DecodeKernelConfig.merge_block_d must be None or a power of two, "
                             f"got {self.merge_block_d!r}")
        if self.partial_dtype not in PARTIAL_DTYPES:
            raise ValueError("DecodeKernelConfig.partial_dtype must be 'float32' or 'bfloat16', "
                             f"got {self.partial_dtype!r}")
        if self.fp8_products not in FP8_PRODUCTS:
            raise ValueError(f"DecodeKernelConfig.fp8_products must be one of {FP8_PRODUCTS}, "
                             f"got {self.fp8_products!r}")
        if self.kernel not in ("auto", "triton", "mgpu"):
            raise ValueError("DecodeKernelConfig.kernel must be 'auto', 'triton' or 'mgpu', got "
                             f"{self.kernel!r}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError("DecodeKernelConfig.num_warps must be one of 1, 2, 4, 8, 16, got "
                             f"{self.num_warps!r}")

    def resolved_block_m(self, rows: int) -> int:
        """Rows per program for `rows` folded query rows per sequence."""
        if self.block_m is not None:
            return self.block_m
        return min(64, next_power_of_two(rows, 16))

    def resolved_num_warps(self, block_m: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 4 if block_m <= 16 else 8

    def resolved_num_stages(self, block_m: int) -> int:
        if self.num_stages is not None:
            return self.num_stages
        return 2 if block_m >= 64 else 5

    def kv_buffers(self, block_m: int = 16) -> int:
        """KV tiles the Triton pipeliner keeps in shared memory: the slot ids load one stage
        ahead of the rows they address, so `num_stages` stages hold (num_stages - 1) // 2
        tiles, at least 1 (read off the compiled kernels, triton 3.6, sm_90a)."""
        return max(1, (self.resolved_num_stages(block_m) - 1) // 2)

    def resolved_programs_per_sm(self, block_m: int | None = None, head_dim: int = 576) -> int:
        """Programs per multiprocessor the split rule assumes (`programs_per_sm`; block_m None:
        16 rows): as many as shared memory (q and `kv_buffers()` KV tiles in 227 KiB) and
        registers (~255 a thread, 128 at block_kv 16) allow, and 1 at block_m >= 64."""
        if self.programs_per_sm is not None:
            return self.programs_per_sm
        bm = 16 if block_m is None else block_m
        if bm >= 64:
            return 1
        warps = self.resolved_num_warps(bm)
        smem = (bm + self.kv_buffers(bm) * self.block_kv) * head_dim * 2 + 1024
        regs = 128 if self.block_kv <= 16 else 255
        by_regs = max(1, 65536 // (warps * 32 * regs))
        return max(1, min(8, (227 * 1024) // smem, by_regs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVRows:
    """Where each sequence's KV tokens live in the pool, in the kernel's one form.

    Token t of sequence b lives in pool row table[start[b] + t // page_size] * page_size +
    t % page_size, for t < kv_len[b]. Three ways to give start and kv_len (the kernel reads
    them in-kernel; none needs an XLA op before the launch):

      "lens"    table_start int32 [B] (entries), kv_lens int32 [B] (tokens).
      "indptr"  table_start int32 [B+1], kv_lens None: a token CSR's kv_indptr (page size 1);
                start[b] = indptr[b], kv_len[b] = indptr[b+1] - indptr[b].
      "strided" table_start None, kv_lens int32 [B], entries_per_seq static: a page table
                [B, entries_per_seq] flattened; start[b] = b * entries_per_seq.

    table:       int32 [n]  entries (token slots when page_size == 1, else page ids).
    page_size:   static int tokens per entry.
    max_kv_len:  static int upper bound on kv_len (tokens), used by the split rule.
    """

    table: jax.Array
    table_start: jax.Array | None
    kv_lens: jax.Array | None
    page_size: int = dataclasses.field(metadata=dict(static=True))
    max_kv_len: int = dataclasses.field(metadata=dict(static=True))
    entries_per_seq: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def form(self) -> str:
        if self.kv_lens is None:
            return "indptr"
        if self.table_start is None:
            return "strided"
        return "lens"

    def meta_operands(self) -> list[jax.Array]:
        """The kernel operands ahead of the table, by form: [kv_indptr] ("indptr"),
        [kv_lens] ("strided"), [table_start, kv_lens] ("lens")."""
        if self.form == "indptr":
            return [self.table_start]
        if self.form == "strided":
            return [self.kv_lens]
        return [self.table_start, self.kv_lens]

    @property
    def num_seqs(self) -> int:
        if self.kv_lens is None:
            return self.table_start.shape[0] - 1
        return self.kv_lens.shape[0]

    def check(self) -> None:
        """Static checks (shapes, dtypes, which fields are set); raises naming the field."""
        _check_int32(self.table, "KVRows.table")
        if self.table.ndim != 1 or self.table.shape[0] < 1:
            raise ValueError(f"KVRows.table must have shape [n >= 1], got {self.table.shape}")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ValueError(f"KVRows.page_size must be a positive int, got {self.page_size!r}")
        if self.kv_lens is None and self.table_start is None:
            raise ValueError("KVRows needs table_start (indptr form) or kv_lens")
        if self.table_start is not None:
            _check_int32(self.table_start, "KVRows.table_start")
        if self.kv_lens is not None:
            _check_int32(self.kv_lens, "KVRows.kv_lens")
        form = self.form
        if form == "indptr" and (self.table_start.ndim != 1 or self.table_start.shape[0] < 2):
            raise ValueError("KVRows.table_start (indptr form) must have shape [B+1], got "
                             f"{self.table_start.shape}")
        if form == "lens" and self.table_start.shape != self.kv_lens.shape:
            raise ValueError(f"KVRows.table_start {self.table_start.shape} and kv_lens "
                             f"{self.kv_lens.shape} must both be [B]")
        if form == "strided" and (not isinstance(self.entries_per_seq, int)
                                  or self.entries_per_seq <= 0):
            raise ValueError("KVRows.entries_per_seq must be a positive int when table_start is "
                             f"None, got {self.entries_per_seq!r}")
        if form != "strided" and self.entries_per_seq is not None:
            raise ValueError("KVRows.entries_per_seq is only for the strided form "
                             "(table_start None)")
        if self.kv_lens is not None and self.kv_lens.ndim != 1:
            raise ValueError(f"KVRows.kv_lens must have shape [B], got {self.kv_lens.shape}")


def seq_start_and_len(form: str, meta_refs, b, entries_per_seq: int | None):
    """In a kernel: (first table entry, KV length in tokens) of sequence b, read from the refs
    of `KVRows.meta_operands()` (so no XLA op runs before the launch)."""
    if form == "indptr":
        (indptr_ref,) = meta_refs
        start = indptr_ref[b]
        return start, indptr_ref[b + 1] - start
    if form == "strided":
        (kv_lens_ref,) = meta_refs
        return b * entries_per_seq, kv_lens_ref[b]
    table_start_ref, kv_lens_ref = meta_refs
    return table_start_ref[b], kv_lens_ref[b]


def block_coords(blk, num_splits: int, row_blocks: int):
    """In a Mosaic GPU decode kernel: (b, split, rb) of flat block index blk = (b * num_splits
    + split) * row_blocks + rb, so the row blocks of a sequence and split launch side by side
    and read each KV tile together (all but the first from L2). One flat grid axis: CUDA's x
    takes 2**31 - 1 blocks, y and z stop at 65535, which an extend's pseudo-sequences pass."""
    rb = lax.rem(blk, row_blocks)
    split = lax.rem(lax.div(blk, row_blocks), num_splits)
    b = lax.div(blk, row_blocks * num_splits)
    return b, split, rb


def split_tile_range(kv_len, split, num_splits: int, block_kv: int):
    """In a kernel: the KV tiles [first, last) of split `split` (of `num_splits`) for a sequence
    of kv_len tokens in tiles of block_kv tokens: each split takes the next ceil(tiles / S)
    tiles, so trailing splits may be empty (last <= first). Both decode kernels cut the KV this
    way, so their partials line up for the same merge."""
    n_tiles = (kv_len + block_kv - 1) // block_kv
    per_split = (n_tiles + num_splits - 1) // num_splits
    first = split * per_split
    return first, jnp.minimum(first + per_split, n_tiles)


def causal_limit(kv_len, s_q: int, row_token):
    """In a kernel: the bottom-right causal bound of a query row (tokens j < bound are
    visible), for the row's token index among the sequence's s_q query tokens; rows past the
    last token (padding) clamp to kv_len."""
    return jnp.minimum(kv_len - s_q + 1 + row_token, kv_len)


def pow2_row_scales(amax, top: int):
    """Per-row powers of two (up, down = 1 / up) from each row's largest |q| (`amax`, fp32),
    the row's largest |q| * up landing in [2^top, 2^(top + 1)). Built from the exponent bits,
    so both are exact (q * up rounds nothing) and down undoes up on the float32 scores."""
    e = lax.shift_right_logical(lax.bitcast_convert_type(amax, jnp.int32), 23) & 0xFF
    e = jnp.clip(e, top + 1, 254)  # biased exponent; clipped so both scales stay normal floats
    up = lax.bitcast_convert_type(lax.shift_left(254 + top - e, 23), jnp.float32)
    down = lax.bitcast_convert_type(lax.shift_left(e - top, 23), jnp.float32)
    return up, down


def f16_row_scales(amax):
    """`pow2_row_scales` for f16 products: the row's largest |q| lands in [2^14, 2^15), so q *
    up fits f16 and keeps every bit bf16 holds (f16 has more mantissa bits). The fp8 Triton
    loop runs f16 products (e4m3 -> f16 is one exact `cvt` a pair on sm_90; -> bf16 is not)."""
    return pow2_row_scales(amax, 14)


# The Triton tiling of an fp8 pool where the defaults would give 64-row blocks (128 heads):
# the wgmma path keeps both converted bf16 tiles in shared memory beside the fp8 stages, 276 KB
# at two stages (an SM has 227 KB), so fp8 runs one stage, faster than 32-row blocks
# (`python -m bench.decode --kv-dtype fp8 --fp8-variants`; docs/decode_kernel.md, "fp8 KV").
FP8_WIDE_TILING = dict(num_stages=1)
# Below 64 rows (mma.sync): 8 warps. The fp8 loop converts every byte on chip and stages V in
# shared memory as f16; 8 warps split that work (174 registers, no spills) where 4 spill
# (H16 B128 L16k: 1116.8 us at 8 warps vs 1158.1 at 4, 128-column pieces).
FP8_NARROW_TILING = dict(num_warps=8)
# Columns of the pieces the fp8 loop below 64 rows splits each 512-column tile into (one fp8
# load each, feeding q k^T and P V): 64 beat 128 / 256 / 512 (docs/decode_kernel.md, "fp8 KV").
FP8_CHUNK = 64


def fp8_triton_config(config: DecodeKernelConfig, rows: int) -> DecodeKernelConfig:
    """`config` for the Triton kernel over an fp8 pool of `rows` folded query rows: the
    defaults, except `FP8_WIDE_TILING` where they would give 64-row blocks and
    `FP8_NARROW_TILING` below 64 rows (unless the config sets num_warps); a config that sets
    block_m or num_stages at 64 rows is kept as is."""
    if config.resolved_block_m(rows) < 64:
        if config.num_warps is not None:
            return config
        return dataclasses.replace(config, **FP8_NARROW_TILING)
    if config.block_m is not None or config.num_stages is not None:
        return config
    return dataclasses.replace(config, **FP8_WIDE_TILING)


def _check_int32(value, name: str) -> None:
    if value.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got {value.dtype}")


def check_kv_form(page_table, kv_indptr, kv_indices, max_kv_len) -> None:
    """Exactly one KV form: a page table, or a token CSR (kv_indptr and kv_indices); max_kv_len
    only with the CSR (a table's width implies it)."""
    if page_table is not None:
        if kv_indptr is not None or kv_indices is not None:
            raise ValueError("pass either page_table or (kv_indptr, kv_indices), not both")
        if max_kv_len is not None:
            raise ValueError(f"max_kv_len={max_kv_len!r}: with a page_table it is implied by "
                             "the table's width")
    elif kv_indptr is None or kv_indices is None:
        raise ValueError("pass kv_indptr and kv_indices (token CSR) or page_table")


def kv_rows_from_csr(kv_indptr: jax.Array, kv_indices: jax.Array,
                     max_kv_len: int | None = None) -> KVRows:
    """Token CSR (page size 1): kv_indptr int32 [B+1] in tokens, kv_indices int32 [capacity].
    The indptr form: the kernel reads kv_indptr directly (no XLA op before the launch)."""
    _check_int32(kv_indptr, "kv_indptr")
    _check_int32(kv_indices, "kv_indices")
    if kv_indptr.ndim != 1 or kv_indptr.shape[0] < 2:
        raise ValueError(f"kv_indptr must have shape [num_seqs + 1], got {kv_indptr.shape}")
    if kv_indices.ndim != 1 or kv_indices.shape[0] < 1:
        raise ValueError(f"kv_indices must have shape [capacity >= 1], got {kv_indices.shape}")
    bound = kv_indices.shape[0] if max_kv_len is None else max_kv_len
    if not isinstance(bound, int) or bound <= 0:
        raise ValueError(f"max_kv_len must be a positive int, got {max_kv_len!r}")
    return KVRows(kv_indices, kv_indptr, None, 1, int(bound))


def kv_rows_from_page_table(page_table: PageTable) -> KVRows:
    """Page table: table int32 [B, max_pages] of page ids, lengths int32 [B] in tokens.
    The strided form: the table is used as is (flattened, a bitcast)."""
    if not isinstance(page_table, PageTable):
        raise TypeError(f"page_table must be a funcmla.layout.PageTable, got {type(page_table)}")
    _check_int32(page_table.table, "page_table.table")
    _check_int32(page_table.lengths, "page_table.lengths")
    if page_table.table.ndim != 2 or page_table.table.shape[1] < 1:
        raise ValueError(f"page_table.table must have shape [B, max_pages >= 1], got "
                         f"{page_table.table.shape}")
    b, max_pages = page_table.table.shape
    if page_table.lengths.shape != (b,):
        raise ValueError(f"page_table.lengths has shape {page_table.lengths.shape}; the table "
                         f"has {b} rows")
    return KVRows(page_table.table.reshape(-1), None, page_table.lengths, page_table.page_size,
                  max_pages * page_table.page_size, entries_per_seq=max_pages)


def choose_num_splits(num_seqs: int, num_row_blocks: int, max_kv_len: int,
                      config: DecodeKernelConfig, block_m: int | None = None) -> int:
    """The split-KV rule (static: a function of shapes only).

    A program is one (row block, split, sequence); `slots = num_sms * programs_per_sm` run at
    once. With n = ceil(max_kv_len / block_kv) KV blocks, the rule picks the `s` (smallest on a
    tie) that minimises the makespan in KV blocks,

        waves(s) = ceil(num_seqs * num_row_blocks * s / slots)
        cost(s)  = waves(s) * (ceil(n / s) + program_overhead_blocks)
                   + (merge_overhead_blocks if s > 1 else 0),

    over 1 <= s <= min(n // min_blocks_per_split, ceil(waves * slots / programs), max_splits):
    a batch too small to fill the chip is split until it does, a full batch is not split.
    Splits past a sequence's end do no work and carry lse = -inf into the merge.
    """
    programs = num_seqs * num_row_blocks
    slots = config.num_sms * config.resolved_programs_per_sm(block_m)
    n_blocks = -(-max(max_kv_len, 1) // config.block_kv)
    cap = max(1, min(n_blocks // config.min_blocks_per_split,
                     -(-config.waves * slots // programs), config.max_splits))
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        waves = -(-programs * s // slots)
        cost = waves * (-(-n_blocks // s) + config.program_overhead_blocks)
        if s > 1:
            cost += config.merge_overhead_blocks
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return int(best)


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
    """Row blocks of `block_m` rows that cover `rows` folded query rows."""
    return math.ceil(rows / block_m)
