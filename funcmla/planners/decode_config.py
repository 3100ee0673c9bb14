"""Static configuration of AITER's decode planner (`get_mla_metadata_v1`, fast mode / v1.2).

`DecodePlanConfig` holds every host-side decision AITER's planner makes before it looks at the
batch (`v1_2_device.cuh:784-945`): head folding, qo splitting,
overhead per work, cluster count, which planner (parallel or serial) runs. It is frozen and
hashable, so it is a `jax.jit` static argument; it refuses every combination AITER refuses or
would run out of bounds with.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from funcmla.config import DeviceProfile
from funcmla.layout import is_power_of_two

__all__ = ["DecodePlanConfig", "DTYPES", "ZERO_KV_BEHAVIOURS", "LDS_BYTES"]

DTYPES = ("bf16", "fp8")
ZERO_KV_BEHAVIOURS = (None, "parallel", "serial")
# maxSharedMemoryPerMultiProcessor, which bounds the batch the parallel planner accepts.
# sm90 is not an AITER target; its value (228 KiB) only matters for the planner choice.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "sm90": 228 * 1024}


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
        if not is_power_of_two(self.page_size):
            bad("page_size", self.page_size, "must be a power of two")
        if not is_power_of_two(self.kv_granularity):
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
        """AITER's sizing rule for qo tiles per request (`get_mla_metadata_info_v1`, pre-fold
        head count, arch/dtype overrides): sizes the reduce buffers (`decode_sizes`)."""
        arch, heads = self.device.arch, self.num_heads
        eff = self.max_seqlen_qo  # is_sparse=False
        packed = eff * heads
        bf16 = not self.q_is_fp8 and not self.kv_is_fp8
        fp8 = self.q_is_fp8 and self.kv_is_fp8
        if (arch == "gfx950" and bf16 and packed >= 64 and heads <= 64
                and (packed < 128 or heads == 48)) or (
                arch == "gfx950" and fp8 and heads == 32 and eff == 3):
            return eff if heads * 2 > 64 else _ceil_div(packed, 64)
        if (heads == 16
                or (arch == "gfx942" and heads == 128 and fp8)
                or (arch == "gfx942" and heads in (16, 32, 64) and heads * eff == 128 and fp8
                    and self.experimental)
                or (arch == "gfx950" and fp8 and ((heads == 32 and eff == 4)
                                                  or heads in (64, 128)))
                or (arch in ("gfx942", "gfx950") and heads == 64 and fp8 and eff == 1)):
            return _ceil_div(packed, 128)
        if arch == "gfx950" and (packed >= 128 or heads > 64) and bf16 and heads != 48:
            return eff if heads * 2 > 128 else _ceil_div(packed, 128)
        return _ceil_div(packed, 16)

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
