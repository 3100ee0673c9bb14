"""AITER's persistent decode work planner (`get_mla_metadata_v1`, fast mode = v1.2) in JAX.

`plan_mla_decode` turns `(qo_indptr, kv_indptr, kv_last_page_lens)` into a `WorkPlan` with static
shapes and no host round trip, bit-exact with AITER's device planner at ROCm/aiter e4048607
(`csrc/kernels/mla/metadata/v1_2_device.cuh`; docs/aiter-planners.md §4).

Units. `kv_indptr` counts entries of `kv_indices`: tokens when `page_size == 1`, pages otherwise;
it must start at 0. `kv_granularity` is in the same entries; a KV "block" is `kv_granularity`
entries. `qo_indptr` counts query tokens. `kv_offset` in the plan counts tokens.

How. The planner is a greedy bin-packer over qo tiles (one per folded request, or several when
the query is split). Each tile costs `ceil(kv_len / kv_granularity) + overhead` blocks; every CU
("cluster") gets a payload `P = ceil(sum / num_splits) + overhead`; clusters are filled in order
and a tile that does not fit is cut into split-KV fragments. Only the walk over tiles is
sequential; it carries only `(cu, R)` = (current cluster, payload left) with a short,
branch-free and division-free step (`fill_advance`; divisions by the runtime blocks-per-cluster
count are done vectorised beforehand, `fill_inputs`) and records the state before each tile
(`fill_tiles`: a `lax.scan`, or one Pallas program, `decode_fill_pallas.py`, which where it pays
off runs a chase over the rare *events* of the walk instead, `decode_chase.py`). From those states
`fill_step` derives, for all tiles at once, the start cluster, the end of the first fragment,
the number of fragments and whether the causal tail rule merged the last fragment. Everything
else (costs, prefix sums, fragment expansion, reduce maps) is vectorised `jnp`. On a GPU the
default (`fill_impl="fused"`) runs the walk and everything after it as two Pallas programs
(`decode_fused_pallas.py`): XLA's form of that tail is ~19 kernels of 1-2 us.

Parallel vs serial. AITER runs a "parallel" planner when `max_seqlen_qo == 1`, no qo split, no
head folding, `page_size == 1` and the batch fits in LDS, and a "serial" one otherwise. They
agree except for a zero-length KV tile met on a full cluster: the parallel planner emits no work
for it, the serial one an empty work on the next cluster (§4.4, §4.8). `zero_kv_behaviour`
selects which one is reproduced (`None`: the one AITER would run).

Out of scope: sparse (DSA `topk`), non-fast modes (v1.0, v1.1), context-parallel round robin,
mixed V40 dtypes, `num_heads_k > 1`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcmla.config import DeviceProfile
from funcmla.planners.decode_sizes import (
    DecodePlanSizes,
    mla_decode_plan_sizes,
    sizes_max_qo_tiles_per_batch,
)
from funcmla.planners.plan import WorkPlan

__all__ = [
    "DecodePlanConfig",
    "FillParams",
    "TILE_FIELDS",
    "FILL_OUT_FIELDS",
    "NEVER",
    "FILL_STATE_FIELDS",
    "WALKS",
    "fill_step",
    "fill_advance",
    "fill_inputs",
    "fill_tiles_scan",
    "fill_tiles",
    "decode_tiles",
    "plan_mla_decode",
    "plan_mla_decode_jit",
    "default_fill_impl",
]

DTYPES = ("bf16", "fp8")
ZERO_KV_BEHAVIOURS = (None, "parallel", "serial")
# maxSharedMemoryPerMultiProcessor, which bounds the batch the parallel planner accepts.
# sm90 is not an AITER target; its value (228 KiB) only matters for the planner choice.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "sm90": 228 * 1024}
NEVER = 2**30  # "no tail-merge point" sentinel, in blocks (larger than any block count)


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and (x & (x - 1)) == 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class DecodePlanConfig:
    """Everything AITER's decode planner decides on, except the batch data. Hashable (jit-static).

    device:              arch (gfx942 / gfx950 / sm90) and CU count (the clusters).
    num_heads:           query heads in total (`num_heads_k * num_heads_per_head_k`).
    num_heads_k:         KV heads; AITER's MLA kernels need 1.
    q_dtype, kv_dtype:   "bf16" or "fp8" (only fp8-vs-bf16 matters; pass what the kernel sees).
    max_seqlen_qo:       max query tokens per request (1 = decode, >1 = MTP / verify).
    uni_seqlen_qo:       uniform query length (1..max_seqlen_qo), or -1 to read `qo_indptr`.
                         Required (> 0) whenever heads are folded.
    page_size:           tokens per `kv_indices` entry (power of two; 1 is AITER's only
                         production path).
    kv_granularity:      split unit in `kv_indices` entries (power of two; callers use
                         `max(page_size, 16)`).
    max_split_per_batch: -1, or a positive cap: `num_splits = min(num_cu, cap * folded_batch)`.
    is_causal:           trims `kv_end` of causal qo tiles by the batch tail (page_size 1).
    experimental:        AITER_ENABLE_EXPERIMENTAL (HK kernels: occupancy 2, native heads).
    zero_kv_behaviour:   "parallel", "serial", or None (= the planner AITER would run).
    """

    device: DeviceProfile
    num_heads: int
    q_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    num_heads_k: int = 1
    max_seqlen_qo: int = 1
    uni_seqlen_qo: int = -1
    page_size: int = 1
    kv_granularity: int = 16
    max_split_per_batch: int = -1
    is_causal: bool = False
    experimental: bool = False
    zero_kv_behaviour: str | None = None

    def __post_init__(self):
        def bad(field, value, why):
            raise ValueError(f"DecodePlanConfig.{field}={value!r}: {why}")

        if not isinstance(self.device, DeviceProfile):
            bad("device", self.device, "must be a funcmla.config.DeviceProfile")
        for field in ("num_heads", "num_heads_k", "max_seqlen_qo", "uni_seqlen_qo",
                      "page_size", "kv_granularity", "max_split_per_batch"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                bad(field, value, "must be an int")
        for field in ("q_dtype", "kv_dtype"):
            if getattr(self, field) not in DTYPES:
                bad(field, getattr(self, field), f"must be one of {DTYPES}")
        for field in ("is_causal", "experimental"):
            if not isinstance(getattr(self, field), bool):
                bad(field, getattr(self, field), "must be a bool")
        if self.num_heads_k != 1:
            bad("num_heads_k", self.num_heads_k, "AITER's MLA decode kernels need num_heads_k == 1")
        if self.num_heads < 1:
            bad("num_heads", self.num_heads, "must be positive")
        if self.num_heads % 8 != 0:
            bad("num_heads", self.num_heads,
                "must be a multiple of 8 (get_mla_metadata_info_v1 asserts it)")
        if self.max_seqlen_qo < 1:
            bad("max_seqlen_qo", self.max_seqlen_qo, "must be >= 1")
        if not (self.uni_seqlen_qo == -1 or 1 <= self.uni_seqlen_qo <= self.max_seqlen_qo):
            bad("uni_seqlen_qo", self.uni_seqlen_qo,
                f"must be -1 (read qo_indptr) or in [1, max_seqlen_qo={self.max_seqlen_qo}]")
        if not _is_pow2(self.page_size):
            bad("page_size", self.page_size, "must be a power of two")
        if not _is_pow2(self.kv_granularity):
            bad("kv_granularity", self.kv_granularity, "must be a power of two")
        if not (self.max_split_per_batch == -1 or self.max_split_per_batch > 0):
            bad("max_split_per_batch", self.max_split_per_batch, "must be -1 or positive")
        if self.zero_kv_behaviour not in ZERO_KV_BEHAVIOURS:
            bad("zero_kv_behaviour", self.zero_kv_behaviour, f"must be one of {ZERO_KV_BEHAVIOURS}")
        if not self.heads_supported:
            bad("num_heads", self.num_heads,
                f"not supported by AITER's decode planner for arch={self.device.arch}, "
                f"q/kv={self.q_dtype}/{self.kv_dtype}, max_seqlen_qo={self.max_seqlen_qo}: "
                "it takes 16/64/128 heads, 16*N folded to 16, (8, msq 4, fp8, gfx950), "
                "(8, msq 2, bf16, gfx942), any count for bf16 on gfx950")
        if self.qk_batch_ratio > 1 and self.uni_seqlen_qo <= 0:
            bad("uni_seqlen_qo", self.uni_seqlen_qo,
                f"heads are folded ({self.num_heads} -> 16 x {self.qk_batch_ratio}) and AITER "
                "then indexes qo_indptr with folded batch ids; pass uni_seqlen_qo > 0 "
                "(e.g. = max_seqlen_qo)")
        if self.qk_batch_ratio > 1 and self.page_size > 1:
            bad("page_size", self.page_size,
                f"heads are folded ({self.num_heads} -> 16 x {self.qk_batch_ratio}) and AITER "
                "then reads kv_last_page_lens with folded batch ids (out of bounds); folding "
                "needs page_size == 1")
        if self.zero_kv_behaviour == "parallel" and not self.parallel_eligible:
            bad("zero_kv_behaviour", "parallel",
                "AITER runs its parallel planner only with max_seqlen_qo == 1, no qo split, "
                "no head folding and page_size == 1")
        slots = self.qk_batch_ratio * self.tile_slots_per_batch
        if slots > self.sizes_max_qo_tiles_per_batch:
            bad("num_heads", self.num_heads,
                f"the planner emits up to {slots} qo tiles per request but "
                f"get_mla_metadata_info_v1 sizes the reduce buffers for "
                f"{self.sizes_max_qo_tiles_per_batch}; AITER would write out of bounds")

    # ---- host-side decisions (v1_2_device.cuh:784-945), static w.r.t. the batch -------------

    @property
    def q_is_fp8(self) -> bool:
        return self.q_dtype == "fp8"

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def num_heads_per_head_k(self) -> int:
        return self.num_heads // self.num_heads_k

    @property
    def occupancy(self) -> int:
        """Cluster multiplier: 2 for the experimental HK m16x4 kernel (gfx950, fp8, H*msq 64)."""
        hk_m16x4 = (self.experimental and self.device.arch == "gfx950" and self.q_is_fp8
                    and self.kv_is_fp8 and self.num_heads * self.max_seqlen_qo == 64)
        return 2 if hk_m16x4 else 1

    @property
    def num_cu(self) -> int:
        """Clusters the plan spreads work over: `num_cu * occupancy // num_heads_k`."""
        return self.device.num_cu * self.occupancy // self.num_heads_k

    @property
    def natively_supported(self) -> bool:
        arch, h = self.device.arch, self.num_heads
        fp8 = self.q_is_fp8 and self.kv_is_fp8
        bf16 = not self.q_is_fp8 and not self.kv_is_fp8
        amd = arch in ("gfx942", "gfx950")
        hk_mtp = (amd and fp8 and h * self.max_seqlen_qo == 128 and h in (16, 32, 64, 128)
                  and self.experimental)
        return (
            h == 16
            or (amd and h == 64 and fp8 and self.max_seqlen_qo == 1)
            or (arch == "gfx950" and bf16)
            or (arch == "gfx942" and h == 128 and fp8)
            or (arch == "gfx950" and fp8 and h in (32, 64, 128))
            or hk_mtp
        )

    @property
    def qk_batch_ratio(self) -> int:
        """Head-folding ratio: non-native head counts that are multiples of 16 run as 16 heads
        over `ratio` times as many batches (folded batch `b` reads the KV of request
        `b // ratio`)."""
        if not self.natively_supported and self.num_heads % 16 == 0:
            return self.num_heads // 16
        return 1

    @property
    def planner_num_heads(self) -> int:
        """Head count the planner works with (16 after folding)."""
        return 16 if self.qk_batch_ratio > 1 else self.num_heads

    @property
    def heads_supported(self) -> bool:
        """AITER_CHECK at v1_2_device.cuh:872-888 (with the post-fold head count)."""
        arch, h = self.device.arch, self.planner_num_heads
        fp8 = self.q_is_fp8 and self.kv_is_fp8
        bf16 = not self.q_is_fp8 and not self.kv_is_fp8
        msq = self.max_seqlen_qo
        amd = arch in ("gfx942", "gfx950")
        hk_mtp = (amd and fp8 and h * msq == 128 and h in (16, 32, 64, 128) and self.experimental)
        return (
            self.natively_supported
            or h in (16, 128)
            or (h == 32 and fp8)
            or (h == 64 and fp8 and msq == 1)
            or (arch == "gfx950" and h == 8 and msq == 4 and fp8)
            or (arch == "gfx942" and h == 8 and msq == 2 and bf16)
            or (arch == "gfx950" and bf16)
            or (arch == "gfx950" and fp8 and ((h == 32 and msq == 4) or h in (64, 128)))
            or hk_mtp
        )

    @property
    def overhead(self) -> int:
        """Fixed cost of a work, in blocks: `max(1, ceil(16 / page_size))`."""
        return max(1, _ceil_div(16, self.page_size))

    @property
    def tail_done_threshold(self) -> int:
        return self.max_seqlen_qo

    @property
    def packed_qo_len_per_wg(self) -> int:
        """kPackedQoLenPerWg: query rows x heads one workgroup packs (128, or 64 on gfx950)."""
        h, msq, arch = self.planner_num_heads, self.max_seqlen_qo, self.device.arch
        bf16 = not self.q_is_fp8 and not self.kv_is_fp8
        fp8 = self.q_is_fp8 and self.kv_is_fp8
        if arch == "gfx950" and bf16 and h * msq >= 64 and h <= 64 and (h * msq < 128 or h == 48):
            return 64
        if arch == "gfx950" and fp8 and h == 32 and msq == 3:
            return 64
        return 128

    @property
    def qo_splits(self) -> bool:
        """kQoSplits: queries are cut into tiles unless `msq * heads_per_head_k <= packed/WG`
        (pre-fold head count)."""
        return not (0 < self.max_seqlen_qo * self.num_heads_per_head_k <= self.packed_qo_len_per_wg)

    def num_qo_tiles(self, seqlen_qo: int) -> int:
        """Tiles of a (folded) batch with `seqlen_qo` query tokens (mla_v12_num_qo_tiles)."""
        if not self.qo_splits:
            return 1
        if self.planner_num_heads * 2 > self.packed_qo_len_per_wg:
            return seqlen_qo
        return _ceil_div(seqlen_qo * self.planner_num_heads, self.packed_qo_len_per_wg)

    @property
    def uniform_qo(self) -> bool:
        return self.uni_seqlen_qo > 0

    @property
    def tile_slots_per_batch(self) -> int:
        """Static bound on qo tiles per folded batch (exact when `uniform_qo` or no qo split)."""
        seqlen = self.uni_seqlen_qo if self.uniform_qo else self.max_seqlen_qo
        return max(1, self.num_qo_tiles(seqlen))

    @property
    def all_slots_valid(self) -> bool:
        """True when every (folded batch, tile slot) is a real tile (tile id == slot id)."""
        return not self.qo_splits or self.uniform_qo

    @property
    def sizes_max_qo_tiles_per_batch(self) -> int:
        return sizes_max_qo_tiles_per_batch(self)

    @property
    def parallel_eligible(self) -> bool:
        return (self.max_seqlen_qo == 1 and not self.qo_splits and self.page_size == 1
                and self.qk_batch_ratio == 1)

    def folded_batch_size(self, batch_size: int) -> int:
        return batch_size * self.qk_batch_ratio

    def num_splits(self, batch_size: int) -> int:
        """Clusters the payload is computed for (only enlarges P when < num_cu)."""
        if self.max_split_per_batch < 0:
            return self.num_cu
        return min(self.num_cu, self.max_split_per_batch * self.folded_batch_size(batch_size))

    def planner(self, batch_size: int) -> Literal["parallel", "serial"]:
        """Which AITER planner's zero-length-KV behaviour applies for `batch_size` requests."""
        if self.zero_kv_behaviour is not None:
            return self.zero_kv_behaviour  # type: ignore[return-value]
        if not self.parallel_eligible:
            return "serial"
        nb = self.folded_batch_size(batch_size)
        scratch = 4 * (3 + 5 * nb)
        qo_bytes = 0 if self.uniform_qo else 4 * nb
        return "parallel" if scratch + qo_bytes <= LDS_BYTES[self.device.arch] else "serial"

    def sizes(self, batch_size: int) -> DecodePlanSizes:
        return mla_decode_plan_sizes(batch_size, self)


# ---------------------------------------------------------------------------------------------
# The sequential fill: per-tile algebra shared by the scan and the Pallas kernel.

# Per-tile inputs of the fill, columns of an int32 [S, 8] array (`fill_inputs`). n = -1 marks
# an empty slot. fresh_remain / fresh_dcu: the state change when the tile starts on a fresh
# cluster (it does not depend on the incoming state, so it is precomputed).
TILE_FIELDS = ("n", "n_div", "n_mod", "e_min", "e_min_div", "e_min_mod", "fresh_remain",
               "fresh_dcu")
# How the Pallas fills reach the states: see `decode_fill_pallas.walk_or_chase`.
WALKS = ("auto", "chase", "tiles")
# What the sequential walk emits per tile: the state (cluster, payload left) BEFORE the tile.
FILL_STATE_FIELDS = ("cu", "remain")
# Per-tile placement derived from that state: start cluster, end of the first fragment (blocks),
# number of fragments, tail merged.
FILL_OUT_FIELDS = ("c0", "f", "m", "merged")


@dataclasses.dataclass(frozen=True)
class FillParams:
    """Static part of the fill.

    overhead:    fixed cost of a work (blocks).
    parallel:    the parallel planner's zero-length-KV rule applies.
    tail_rule:   a tail merge can happen (page_size 1 and max_seqlen_qo > 1); when False the
                 walk skips its arithmetic (with max_seqlen_qo 1 a cut always leaves >= 1 token).
    empty_slots: some slots before the last are empty (n = -1); when False the walk does not
                 test for them (trailing padding only affects discarded states).
    """

    overhead: int
    parallel: bool
    tail_rule: bool = True
    empty_slots: bool = True


def _ceil_div_shifted(qx, rx, f, bpc):
    """ceil((x - f) / bpc) for x = qx * bpc + rx, 0 <= rx < bpc, 1 <= f <= bpc, x > f - bpc."""
    return qx + (rx > f).astype(jnp.int32) - ((rx == 0) & (f == bpc)).astype(jnp.int32)


def fill_step(params: FillParams, payload, bpc, cu, remain, tile):
    """One tile of the greedy fill, in full: (cu', remain', (c0, f, m, merged)).

    `cu`, `remain`: current cluster and its payload left (blocks). `tile`: the first six
    TILE_FIELDS. Scalars or arrays (elementwise); no division, no branch.

    Cases (docs/aiter-planners.md §4.3/4.4): the tile fits (one fragment on `cu`); it is cut now
    (`remain > overhead`: first fragment of `remain - overhead` blocks on `cu`, then `bpc`
    blocks per fresh cluster); or the cluster is abandoned and the tile starts on `cu + 1`.
    Tail rule: the first cut point `e` with `kv_len - e * gran < max_seqlen_qo` (precomputed as
    `e >= e_min`) ends the tile there; its fragment takes the rest and over-fills its cluster.
    """
    n, n_div, n_mod, e_min, e_div, e_mod = tile[:6]
    ov = params.overhead
    valid = n >= 0
    fits = n + ov <= remain
    fresh = jnp.logical_not(fits) & (remain <= ov)
    r0 = jnp.where(fresh, payload, remain)
    c0 = jnp.where(fresh, cu + 1, cu)
    f = jnp.where(fits, n, r0 - ov)
    single = fits | (n <= f)
    m = jnp.where(single, 1, 1 + _ceil_div_shifted(n_div, n_mod, f, bpc))
    # First cut point at or past e_min; a merge happens if it is a real cut (index <= m - 2).
    js = jnp.where(e_min <= f, 0, _ceil_div_shifted(e_div, e_mod, f, bpc))
    merged = (m >= 2) & (js <= m - 2)
    m = jnp.where(merged, js + 1, m)
    last_begin = jnp.where(m == 1, 0, f + (m - 2) * bpc)
    new_remain = jnp.where(m == 1, r0, payload) - (n - last_begin) - ov
    new_cu = c0 + m - 1
    live = valid
    if params.parallel:  # zero-length KV on an abandoned cluster: no work, payload left 0
        zskip = valid & fresh & (n == 0)
        new_remain = jnp.where(zskip, 0, new_remain)
        live = valid & jnp.logical_not(zskip)
    new_cu = jnp.where(live, new_cu, cu)
    new_remain = jnp.where(valid, new_remain, remain)
    m = jnp.where(live, m, 0)
    return new_cu, new_remain, (c0, f, m, (live & merged).astype(jnp.int32))


def fill_advance(params: FillParams, payload, bpc, cu, remain, tile):
    """Only the carry of `fill_step`: (cu', remain'), with a short dependency chain.

    The walk over tiles runs this; `fill_step` is then applied to all tiles at once, from the
    states the walk recorded. The fresh-cluster case is precomputed (`fill_inputs`); the
    cut-now case is closed form: with n = q * bpc + r and f = remain - overhead blocks taken now,
    the last fragment leaves `f - r + bpc * ([r > f] - [r == 0 and f == bpc])` and the tile
    ends `q + [r > f] - [r == 0 and f == bpc]` clusters further on.
    """
    n, q, r, e_min, e_div, e_mod, fresh_remain, fresh_dcu = tile
    ov = params.overhead
    fits = n + ov <= remain
    cut_now = remain > ov
    # d = f - r. [r > f] is d < 0; [r == 0 and f == bpc] is d == bpc (remain <= payload), so
    # the cut leaves d mod bpc (d in (-bpc, bpc]) without a multiply.
    d = remain - (r + ov)
    gt = d < 0
    z = d == bpc
    cut_remain = jnp.where(gt, d + bpc, jnp.where(z, 0, d))
    cut_dcu = q + gt.astype(jnp.int32) - z.astype(jnp.int32)
    new_remain = jnp.where(fits, remain - (n + ov),
                           jnp.where(cut_now, cut_remain, fresh_remain))
    new_cu = cu + jnp.where(fits, 0, jnp.where(cut_now, cut_dcu, fresh_dcu))
    if params.tail_rule:  # tail merge, computed alongside and selected at the end
        new_cu, new_remain = _tail_merge(params, payload, bpc, cu, remain, tile, fits, cut_now,
                                         new_cu, new_remain)
    if not params.empty_slots:
        return new_cu, new_remain
    valid = n >= 0
    return jnp.where(valid, new_cu, cu), jnp.where(valid, new_remain, remain)


def _tail_merge(params, payload, bpc, cu, remain, tile, fits, cut_now, new_cu, new_remain):
    n, q, r, e_min, e_div, e_mod = tile[:6]
    ov = params.overhead
    f = remain - ov
    f_eff = jnp.where(cut_now, f, bpc)
    m = 1 + _ceil_div_shifted(q, r, f_eff, bpc)
    js = jnp.where(e_min <= f_eff, 0, _ceil_div_shifted(e_div, e_mod, f_eff, bpc))
    merged = jnp.logical_not(fits) & (m >= 2) & (js <= m - 2)
    last_begin = jnp.where(js == 0, 0, f_eff + (js - 1) * bpc)
    merge_remain = jnp.where((js == 0) & cut_now, remain, payload) - (n - last_begin) - ov
    merge_cu = cu + (1 - cut_now.astype(jnp.int32)) + js
    return jnp.where(merged, merge_cu, new_cu), jnp.where(merged, merge_remain, new_remain)


def fill_inputs(n, e_min, payload, bpc, *, params: FillParams) -> jax.Array:
    """The fill's per-tile inputs (TILE_FIELDS) from block counts n (-1: empty slot) and tail
    points e_min (blocks; >= NEVER: none). int32 [S] -> int32 [S, 8]."""
    q, r = n // bpc, n % bpc
    nf = q + (r > 0).astype(jnp.int32)  # fragments when starting fresh (n >= 1)
    fresh_remain = bpc - (n - (nf - 1) * bpc)
    fresh_dcu = nf
    zero_remain, zero_dcu = (0, 0) if params.parallel else (bpc, 1)
    fresh_remain = jnp.where(n == 0, zero_remain, fresh_remain)
    fresh_dcu = jnp.where(n == 0, zero_dcu, fresh_dcu)
    return jnp.stack([n, q, r, e_min, e_min // bpc, e_min % bpc, fresh_remain, fresh_dcu],
                     axis=1).astype(jnp.int32)


def fill_tiles_scan(tiles: jax.Array, payload: jax.Array, bpc: jax.Array, *,
                    params: FillParams, unroll: int = 1) -> jax.Array:
    """The walk as a `lax.scan`. tiles: int32 [S, 8] -> states before each tile int32 [S, 2]."""

    def body(carry, tile):
        cu, remain = carry
        new = fill_advance(params, payload, bpc, cu, remain, tuple(tile))
        return new, jnp.stack([cu, remain])

    init = (jnp.int32(0), jnp.asarray(payload, jnp.int32))
    _, out = lax.scan(body, init, tiles, unroll=max(1, min(unroll, tiles.shape[0])))
    return out


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def default_fill_impl() -> str:
    """What fill_impl="auto" runs: on a GPU the fused Pallas programs (H200, profiler, mi300x-h16
    config: 11.0 / 14.3 / 71.0 us per plan at 64 / 256 / 1024 tile slots against 26.1 / 36.2 /
    87.0 us for the Pallas walk with XLA's tail); the scan elsewhere."""
    return "fused" if _on_gpu() else "scan"


def fill_tiles(tiles, payload, bpc, *, params: FillParams, fill_impl: str = "auto",
               walk: str = "auto"):
    """The walk: "scan", "pallas" (interpret mode off-GPU) or "auto" (pallas on GPU).
    tiles: int32 [S, 8] (TILE_FIELDS) -> int32 [S, 2] (FILL_STATE_FIELDS, before each tile).
    walk: how the Pallas fill gets there (`decode_fill_pallas.walk_or_chase`)."""
    if fill_impl == "auto":
        fill_impl = "pallas" if _on_gpu() else "scan"
    if fill_impl == "scan":
        return fill_tiles_scan(tiles, payload, bpc, params=params)
    if fill_impl == "pallas":
        from funcmla.planners.decode_fill_pallas import fill_tiles_pallas

        return fill_tiles_pallas(tiles, payload, bpc, params=params, walk=walk)
    raise ValueError(f"fill_impl must be 'scan', 'pallas' or 'auto', got {fill_impl!r}")


# ---------------------------------------------------------------------------------------------
# Vectorised parts.


def _check_inputs(qo_indptr, kv_indptr, kv_last_page_lens):
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens)):
        if x.ndim != 1:
            raise ValueError(f"{name} must be a vector, got shape {x.shape}")
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    b = kv_indptr.shape[0] - 1
    if b < 1:
        raise ValueError(f"kv_indptr must have batch_size + 1 >= 2 entries, got {kv_indptr.shape}")
    if qo_indptr.shape != kv_indptr.shape:
        raise ValueError(f"qo_indptr shape {qo_indptr.shape} != kv_indptr shape {kv_indptr.shape}")
    if kv_last_page_lens.shape != (b,):
        raise ValueError(f"kv_last_page_lens must have shape ({b},), got {kv_last_page_lens.shape}")
    return b


def decode_tiles(qo_indptr, kv_indptr, *, config: DecodePlanConfig) -> dict[str, jax.Array]:
    """Per tile slot (folded batch b, qo tile t), row-major, int32 [S]: the planner's view.

    Keys: valid, batch (folded b), req (b // ratio), kv_begin, kv_end (kv_indices entries,
    relative to kv_indptr[0]), kv_len, n (blocks), qo_tile_size, qo_start, qo_end,
    batch_tail (causal kv trim, entries).
    """
    cfg = config
    b_req = kv_indptr.shape[0] - 1
    ratio, slots = cfg.qk_batch_ratio, cfg.tile_slots_per_batch
    s = jnp.arange(b_req * ratio * slots, dtype=jnp.int32)
    b = s // slots
    t = s % slots
    req = b // ratio
    kv_begin = kv_indptr[req] - kv_indptr[0]
    kv_end = kv_indptr[req + 1] - kv_indptr[0]
    kv_len = kv_end - kv_begin
    if cfg.uniform_qo:
        uni = cfg.uni_seqlen_qo
        seqlen = jnp.full_like(b, uni)
        qo_begin, qo_end_b = uni * b, uni * (b + 1)
    else:  # ratio == 1 here (checked by the config)
        qo_begin, qo_end_b = qo_indptr[b], qo_indptr[b + 1]
        seqlen = qo_end_b - qo_begin
    if not cfg.qo_splits:
        ntiles = jnp.ones_like(b)
    elif cfg.planner_num_heads * 2 > cfg.packed_qo_len_per_wg:
        ntiles = seqlen
    else:
        wg = cfg.packed_qo_len_per_wg
        ntiles = (seqlen * cfg.planner_num_heads + wg - 1) // wg
    valid = t < ntiles
    ts = (seqlen + jnp.maximum(ntiles, 1) - 1) // jnp.maximum(ntiles, 1)
    qo_start = qo_begin + t * ts
    qo_end = jnp.minimum(qo_start + ts, qo_end_b)
    if cfg.page_size == 1 and cfg.is_causal:
        if ratio == 1:
            bt = ntiles - 1 - t
        else:
            bt = ntiles - (qo_start // ratio) % cfg.uni_seqlen_qo - 1
        bt = jnp.maximum(bt, 0)
    else:
        bt = jnp.zeros_like(b)
    gran_log2 = cfg.kv_granularity.bit_length() - 1
    n = (kv_len + cfg.kv_granularity - 1) >> gran_log2
    return dict(valid=valid, batch=b, req=req, kv_begin=kv_begin, kv_end=kv_end, kv_len=kv_len,
                n=n, qo_tile_size=ts, qo_start=qo_start, qo_end=qo_end, batch_tail=bt)


def _searchsorted(a, v, side):
    # Binary search; unrolled on GPU (one fused kernel), a loop elsewhere (faster to compile).
    method = "scan_unrolled" if _on_gpu() else "scan"
    return jnp.searchsorted(a, v, side=side, method=method).astype(jnp.int32)


def plan_mla_decode(
    qo_indptr: jax.Array,
    kv_indptr: jax.Array,
    kv_last_page_lens: jax.Array,
    *,
    config: DecodePlanConfig,
    batch_size: int | None = None,
    fill_impl: str = "auto",
    walk: str = "auto",
    num_requests: jax.Array | None = None,
) -> WorkPlan:
    """AITER `get_mla_metadata_v1` (fast mode) as a pure function. jit with config, batch_size,
    fill_impl and walk static.

    qo_indptr:         int32 [B+1] query tokens (ignored when config.uni_seqlen_qo > 0).
    kv_indptr:         int32 [B+1] kv_indices entries (tokens if page_size 1, else pages);
                       kv_indptr[0] must be 0.
    kv_last_page_lens: int32 [B]   tokens in each request's last page (page_size > 1 only).
    batch_size:        request capacity the buffers are sized for (>= B; default B), as in
                       `get_mla_metadata_info_v1(batch_size, ...)`.
    fill_impl:         "scan" | "pallas" (walk only) | "fused" (walk, then everything after
                       it, as two Pallas programs) | "auto" (`default_fill_impl`).
    walk:              for the Pallas fills: "auto" (the chase over events where it pays
                       off, decided in the kernel) | "chase" | "tiles" (one step per tile);
                       see `decode_fill_pallas.walk_or_chase`. Same plan either way.
    num_requests:      optional int32 [] (traced): only requests [0, num_requests) are live;
                       the rest are padding (a shape bucket) and get no tiles, so the plan is
                       the plan of the live prefix (buffers keep the padded sizes; the
                       parallel/serial choice stays the padded batch's).

    Returns a WorkPlan (kind="decode", block_size=page_size) whose buffers have the shapes of
    `mla_decode_plan_sizes(batch_size, config)`. Unused tails are zero (AITER leaves them
    untouched). Checked at trace time: ranks, dtypes, shapes. Preconditions not checked here
    (see funcmla.checks): indptrs non-decreasing; with uni_seqlen_qo == -1 and qo splits,
    1 <= qo_len <= max_seqlen_qo.
    """
    cfg = config
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    b_req = _check_inputs(qo_indptr, kv_indptr, kv_last_page_lens)
    if batch_size is None:
        batch_size = b_req
    if batch_size < b_req:
        raise ValueError(
            f"batch_size={batch_size} is smaller than the batch in kv_indptr ({b_req})")
    sizes = mla_decode_plan_sizes(batch_size, cfg)
    num_cu, max_work = sizes.num_cu, sizes.max_work
    tile_cnt, max_split_tiles = sizes.tile_cnt, sizes.max_split_tiles
    ov, gran = cfg.overhead, cfg.kv_granularity
    page1 = cfg.page_size == 1
    i32 = jnp.int32

    tl = decode_tiles(qo_indptr, kv_indptr, config=cfg)
    if num_requests is not None:
        tl = dict(tl, valid=tl["valid"] & (tl["req"] < num_requests))
    valid, n = tl["valid"], tl["n"]
    num_slots = n.shape[0]

    # Payload per cluster and blocks per fresh cluster.
    sum_blocks = jnp.sum(jnp.where(valid, n + ov, 0))
    num_splits = cfg.num_splits(b_req)
    if num_requests is not None and cfg.max_split_per_batch > 0:
        num_splits = jnp.minimum(cfg.num_cu, cfg.max_split_per_batch * cfg.qk_batch_ratio
                                 * jnp.maximum(num_requests, 1))
    payload = (sum_blocks + num_splits - 1) // num_splits + ov
    bpc = payload - ov

    # Tail rule (page_size 1): a cut at block e ends the tile if it leaves < msq tokens.
    thr = cfg.tail_done_threshold
    kv_len, bt = tl["kv_len"], tl["batch_tail"]
    gran_log2 = gran.bit_length() - 1
    e_min = jnp.where(kv_len >= thr, ((kv_len - thr) >> gran_log2) + 1, 0)
    e_min = jnp.where((bt < thr) & page1, e_min, NEVER)
    all_valid = cfg.all_slots_valid and num_requests is None
    params = FillParams(overhead=ov, parallel=cfg.planner(b_req) == "parallel",
                        tail_rule=page1 and thr > 1, empty_slots=not all_valid)
    tiles = fill_inputs(jnp.where(valid, n, -1), e_min, payload, bpc, params=params)
    if fill_impl == "auto":
        fill_impl = default_fill_impl()
    if fill_impl == "fused":
        return _plan_tail_fused(tl, tiles, payload, bpc, kv_last_page_lens, params=params,
                                cfg=cfg, sizes=sizes, walk=walk, all_slots_valid=all_valid)
    states = fill_tiles(tiles, payload, bpc, params=params, fill_impl=fill_impl, walk=walk)
    _, _, (c0, f, m, _) = fill_step(params, payload, bpc, states[:, 0], states[:, 1],
                                    tuple(tiles.T))

    # Fragments -> works (work order = tile order, then fragment order).
    split = m > 1
    ts = tl["qo_tile_size"]
    works_incl = jnp.cumsum(m, dtype=i32)
    num_works = works_incl[-1]
    works_before = works_incl - m
    red_cnt = jnp.where(split, m, 0)
    red_incl = jnp.cumsum(red_cnt, dtype=i32)
    red_before = red_incl - red_cnt
    num_partials = red_incl[-1]
    partial_before = jnp.cumsum(red_cnt * ts, dtype=i32) - red_cnt * ts

    w = jnp.arange(max_work, dtype=i32)
    slot = jnp.minimum(_searchsorted(works_incl, w, "right"), num_slots - 1)
    live = w < num_works
    j = w - works_before[slot]
    m_w, f_w = m[slot], f[slot]
    kb, ke, bt_w = tl["kv_begin"][slot], tl["kv_end"][slot], bt[slot]
    last = j == m_w - 1
    begin_blk = jnp.where(j == 0, 0, f_w + (j - 1) * bpc)
    end_tok = kb + (f_w + j * bpc) * gran
    kv_start = kb + begin_blk * gran
    if page1:
        kv_stop = jnp.where(last, ke - bt_w, jnp.minimum(end_tok, ke - bt_w))
        kv_offset = ke - kv_stop
    else:
        kv_stop = jnp.where(last, ke, jnp.minimum(end_tok, ke))
        lpl = kv_last_page_lens[tl["req"][slot]]
        kv_offset = jnp.where(kv_stop == ke, 0, (ke - kv_stop - 1) * cfg.page_size + lpl)
    partial_qo_loc = jnp.where(split[slot], partial_before[slot] + j * ts[slot], -1)
    cols = [tl["batch"][slot], partial_qo_loc, tl["qo_start"][slot], tl["qo_end"][slot],
            kv_start, kv_stop, kv_offset, jnp.zeros_like(w)]
    work_info = jnp.where(live[:, None], jnp.stack(cols, axis=1), 0).astype(i32)

    cluster = jnp.where(live, c0[slot] + j, np.iinfo(np.int32).max)
    work_indptr = jnp.concatenate(
        [jnp.zeros((1,), i32), _searchsorted(cluster, jnp.arange(num_cu, dtype=i32), "right")])

    # Reduce maps, indexed by global qo tile (valid slots in order).
    if all_valid:
        tile_slot = jnp.arange(min(tile_cnt, num_slots), dtype=i32)
        num_tiles = jnp.int32(num_slots)
    else:
        valid_incl = jnp.cumsum(valid.astype(i32), dtype=i32)
        num_tiles = valid_incl[-1]
        k = jnp.arange(tile_cnt, dtype=i32)
        tile_slot = jnp.minimum(_searchsorted(valid_incl, k + 1, "left"), num_slots - 1)
    k = jnp.arange(tile_slot.shape[0], dtype=i32)
    tile_live = k < num_tiles
    ri_tile = jnp.where(tile_live, red_incl[tile_slot], num_partials)
    reduce_indptr = jnp.full((tile_cnt + 1,), num_partials, i32)
    reduce_indptr = reduce_indptr.at[0].set(0).at[1:1 + tile_slot.shape[0]].set(ri_tile)
    final_live = tile_live & split[tile_slot]
    fm = jnp.stack([tl["qo_start"][tile_slot], tl["qo_end"][tile_slot]], axis=1)
    reduce_final_map = jnp.zeros((tile_cnt, 2), i32)
    reduce_final_map = reduce_final_map.at[:tile_slot.shape[0]].set(
        jnp.where(final_live[:, None], fm, 0))

    p = jnp.arange(max_split_tiles, dtype=i32)
    pslot = jnp.minimum(_searchsorted(red_incl, p, "right"), num_slots - 1)
    reduce_partial_map = jnp.where(
        p < num_partials, partial_before[pslot] + (p - red_before[pslot]) * ts[pslot], 0)

    return WorkPlan(
        work_indptr=work_indptr,
        work_info=work_info,
        reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map,
        reduce_partial_map=reduce_partial_map.astype(i32),
        num_works=num_works,
        num_partials=num_partials,
        kind="decode",
        block_size=cfg.page_size,
    )


def _plan_tail_fused(tl, tiles, payload, bpc, kv_last_page_lens, *, params, cfg, sizes, walk,
                     all_slots_valid):
    """The walk and everything after it as Pallas programs (decode_fused_pallas)."""
    from funcmla.planners.decode_fused_pallas import plan_tail_pallas

    lpl = (jnp.zeros_like(tl["req"]) if cfg.page_size == 1
           else kv_last_page_lens[tl["req"]])
    info = jnp.stack([tl["batch"], lpl, tl["kv_begin"], tl["kv_end"], tl["batch_tail"],
                      tl["qo_tile_size"], tl["qo_start"], tl["qo_end"],
                      tl["valid"].astype(jnp.int32)], axis=1).astype(jnp.int32)
    (work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map, num_works,
     num_partials, _) = plan_tail_pallas(
        tiles, info, payload, bpc, params=params, sizes=sizes, page_size=cfg.page_size,
        kv_granularity=cfg.kv_granularity, all_slots_valid=all_slots_valid, walk=walk)
    return WorkPlan(work_indptr=work_indptr, work_info=work_info, reduce_indptr=reduce_indptr,
                    reduce_final_map=reduce_final_map, reduce_partial_map=reduce_partial_map,
                    num_works=num_works, num_partials=num_partials, kind="decode",
                    block_size=cfg.page_size)


# `plan_mla_decode` under `jax.jit` (config, batch_size, fill_impl and walk static).
plan_mla_decode_jit = jax.jit(plan_mla_decode,
                              static_argnames=("config", "batch_size", "fill_impl", "walk"))
