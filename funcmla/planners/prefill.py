"""AITER's prefill persistent-scheduling planner (`get_ps_metadata_v1`) as a jit-able JAX function.

`plan_ps_prefill` computes the same `WorkPlan` as the host C++ planner (`v1_2_host.cuh`),
without a host round trip and with static shapes from
`ps_prefill_plan_sizes` (`get_ps_metadata_info_v1`).

Units: `qo_indptr` and `context_lens` count **tokens**; `kv_indptr` counts **entries of
`block_size` tokens** (AITER's `pages_kv_indptr`), and so do the works' `kv_start` / `kv_end`.

The granularity rule (README): the prefill kernel reads linear per-token K/V, so the planner must
count in tokens. `PrefillPlanConfig` therefore defaults to `block_size=1, kvlen_granularity=128`
(SGLang after #25556). The pre-fix pairing `block_size=page_size,
kvlen_granularity=max(128, page_size)` is available only by name,
`PrefillPlanConfig.legacy_page_granular(page_size, ...)`; its plans carry `legacy=True` and
`check_plan_matches_metadata` refuses them against token-granular metadata unless asked.

How the serial greedy becomes closed-form algebra. Every tile costs `units = ceil(eff_kv /
kvlen_granularity)`; lay the tiles end to end on one "unit stream" (tile i occupies
`[U_i, U_i + units_i)`). Thread group t of a cluster owns `[C_t, C_{t+1})` with
`C_t = t * avg + min(t, rem)`. Because a work always starts on a unit boundary, the C++ test
`remaining_kv <= capacity * block_size` is exactly `remaining_units <= capacity_units`, so a TG
never overfills; its works are the intersections of its interval with the tiles (plus one empty
work for a zero-unit tile that a TG with capacity left reaches). Stream order is emission order,
so work ids, partial ids and `work_indptr` are prefix sums and `searchsorted`s; nothing loops
over data.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

import numpy as np
from funcmla.checks import check_indptr
from funcmla.config import DeviceProfile
from funcmla.layout import PageTable, TokenCSR, check_page_size, expect_layout, is_power_of_two
from funcmla.planners.inputs import (
    EAGER,
    INT32_MAX,
    TRACED,
    Checker,
    check_no_wrap,
    check_prefix_sums_fit,
    is_concrete,
    to_int32,
)
from funcmla.planners.plan import WorkPlan
from funcmla.planners.search import searchsorted_i32

__all__ = [
    "PrefillPlanConfig",
    "PrefillPlanSizes",
    "ps_prefill_plan_sizes",
    "plan_ps_prefill",
    "plan_ps_prefill_jit",
    "pack_q_head_range",
    "check_plan_matches_metadata",
    "check_prefill_plan_inputs",
]

TILE_Q = 256  # rows of the prefill kernel's q tile; qlen_granularity = TILE_Q // gqa_ratio


def pack_q_head_range(start, end):
    """`(end << 16) | (start & 0xFFFF)`: AITER's `pack_dword` of a q head range (column 7)."""
    return (end << 16) | (start & 0xFFFF)


@dataclasses.dataclass(frozen=True)
class PrefillPlanConfig:
    """Static parameters of `get_ps_metadata_v1` (hashable: a jit static argument).

    device:            its `num_cu` is the number of thread groups (AITER: multiProcessorCount).
    num_heads_k:       KV heads; the CUs are split into gcd(num_heads_k, num_cu) clusters.
    gqa_ratio:         q heads per KV head.
    qhead_granularity: q heads per work (default gqa_ratio); column 7 packs
                       [kh * qhead_granularity, (kh + 1) * qhead_granularity).
    qlen_granularity:  query rows per tile (default 256 // gqa_ratio).
    kvlen_granularity: tokens per split unit (default 128).
    block_size:        tokens per kv_indptr entry (default 1: the kernel reads per-token K/V).
    is_causal:         bottom-right causal trim of each tile's KV length.
    max_qlen:          static bound on any request's query length (tokens); sizes the buffers.
    legacy:            the pre-#25556 pairing, set by `legacy_page_granular()`; allows block_size > 1.
    """

    device: DeviceProfile
    num_heads_k: int = 1
    gqa_ratio: int = 1
    qhead_granularity: int | None = None
    qlen_granularity: int | None = None
    kvlen_granularity: int = 128
    block_size: int = 1
    is_causal: bool = True
    max_qlen: int = TILE_Q
    legacy: bool = False

    def __post_init__(self):
        if not isinstance(self.device, DeviceProfile):
            raise TypeError(f"PrefillPlanConfig.device must be a DeviceProfile, got {self.device!r}")
        for name in ("num_heads_k", "gqa_ratio", "kvlen_granularity", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PrefillPlanConfig.{name} must be a positive int, got {v!r}")
        if self.qhead_granularity is None:
            object.__setattr__(self, "qhead_granularity", self.gqa_ratio)
        if self.qlen_granularity is None:
            if TILE_Q % self.gqa_ratio:
                raise ValueError(
                    f"PrefillPlanConfig.gqa_ratio={self.gqa_ratio} does not divide the q tile "
                    f"{TILE_Q}; pass qlen_granularity explicitly")
            object.__setattr__(self, "qlen_granularity", TILE_Q // self.gqa_ratio)
        for name in ("qhead_granularity", "qlen_granularity"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"PrefillPlanConfig.{name} must be a positive int, got {v!r}")
        for name in ("is_causal", "legacy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PrefillPlanConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.max_qlen, int) or self.max_qlen < 0:
            raise ValueError(f"PrefillPlanConfig.max_qlen must be an int >= 0, got {self.max_qlen!r}")
        if not is_power_of_two(self.block_size):
            raise ValueError(f"PrefillPlanConfig.block_size must be a power of two, got {self.block_size}")
        if self.kvlen_granularity % self.block_size:
            raise ValueError(
                f"PrefillPlanConfig.kvlen_granularity={self.kvlen_granularity} must be a multiple "
                f"of block_size={self.block_size}")
        if self.block_size != 1 and not self.legacy:
            raise ValueError(
                f"PrefillPlanConfig.block_size={self.block_size}: the prefill kernel reads "
                "per-token K/V, so the plan must count tokens (block_size=1). The pre-#25556 "
                "pairing is only available as PrefillPlanConfig.legacy_page_granular(page_size)")
        if (self.num_heads_k * self.qhead_granularity) >= 1 << 15:
            raise ValueError(
                f"q head range end {self.num_heads_k * self.qhead_granularity} does not fit the "
                "16-bit field of work_info column 7")

    @classmethod
    def legacy_page_granular(cls, page_size: int, *, device: DeviceProfile, **kwargs):
        """The pre-#25556 SGLang pairing: block_size=page_size, kvlen_granularity=max(128, page_size).

        Against token-granular metadata this plans `kv_len / page_size` entries per request
        (the seed's bug); it exists so the bug can be reproduced on purpose.
        """
        check_page_size(page_size)
        return cls(device=device, block_size=page_size, kvlen_granularity=max(128, page_size),
                   legacy=True, **kwargs)

    @property
    def num_clusters(self) -> int:
        return math.gcd(self.num_heads_k, self.device.num_cu)

    @property
    def tgs_per_cluster(self) -> int:
        return self.device.num_cu // self.num_clusters

    @property
    def kheads_per_cluster(self) -> int:
        return self.num_heads_k // self.num_clusters

    @property
    def blocks_per_unit(self) -> int:
        return self.kvlen_granularity // self.block_size


class PrefillPlanSizes(NamedTuple):
    """Static buffer sizes of a prefill plan (`get_ps_metadata_info_v1`)."""

    num_cu: int  # work_indptr has num_cu + 1 entries
    max_works: int  # rows of work_info
    num_tiles: int  # batch_size * ceil(max_qlen / qlen_granularity); reduce_indptr has + 1
    max_partials: int  # entries of reduce_partial_map
    max_qo_tiles: int  # ceil(max_qlen / qlen_granularity)

    @property
    def partial_rows(self) -> int:
        """Rows of the fp32 partial buffer (AITER allocates max_partials * 256)."""
        return self.max_partials * TILE_Q


def ps_prefill_plan_sizes(batch_size: int, max_qlen: int, *, config: PrefillPlanConfig) -> PrefillPlanSizes:
    """Port of `get_ps_metadata_info_v1(batch_size, num_heads_k, max_qlen, qlen_granularity)`.

    max_works    = (B + cpc - 1) * mq * num_heads_k
    max_partials = min(B + cpc - 1, 2 * (cpc - 1)) * mq
    with cpc = num_cu // gcd(num_heads_k, num_cu) and mq = ceil(max_qlen / qlen_granularity).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(max_qlen, int) or max_qlen < 0:
        raise ValueError(f"max_qlen must be an int >= 0, got {max_qlen!r}")
    cpc = config.tgs_per_cluster
    mq = -(-max_qlen // config.qlen_granularity)
    return PrefillPlanSizes(
        num_cu=config.device.num_cu,
        max_works=(batch_size + cpc - 1) * mq * config.num_heads_k,
        num_tiles=batch_size * mq,
        max_partials=min(batch_size + cpc - 1, 2 * (cpc - 1)) * mq,
        max_qo_tiles=mq,
    )


def _tile_grid(qo_indptr, context_lens, cfg: PrefillPlanConfig, mq: int, xp=jnp):
    """Step 1 of the planner: the tile grid [B, mq] in visiting (ping-pong) order. Returns
    (i, n, idx, local_end, qo_len, valid, units [B * mq] int32: KV split units per tile, 0 if
    invalid). `xp`: jax.numpy, or numpy for the eager input checks."""
    g, gran = cfg.qlen_granularity, cfg.kvlen_granularity
    qo_len = qo_indptr[1:] - qo_indptr[:-1]
    n_tiles = (qo_len + g - 1) // g  # [B]
    i = xp.arange(mq, dtype=xp.int32)[None, :]
    n = n_tiles[:, None]
    valid = i < n  # [B, mq]
    idx = xp.where(i % 2 == 0, i // 2, n - 1 - i // 2)
    local_end = xp.minimum(idx * g + g, qo_len[:, None])
    kv_len = context_lens[:, None]
    eff = xp.minimum(kv_len - qo_len[:, None] + local_end, kv_len) if cfg.is_causal else kv_len
    units = xp.where(valid, (eff + gran - 1) // gran, 0).reshape(-1)  # [T]
    return i, n, idx, local_end, qo_len, valid.reshape(-1), units


def plan_ps_prefill(
    qo_indptr: jax.Array,  # int32 [B + 1]  query tokens
    kv_indptr: jax.Array,  # int32 [B + 1]  entries of block_size tokens ("pages_kv_indptr")
    context_lens: jax.Array,  # int32 [B]   KV tokens per request
    *,
    config: PrefillPlanConfig,
) -> WorkPlan:
    """Port of `get_ps_metadata_v1`; returns a `WorkPlan(kind="prefill")`. jit-able with config
    static (`plan_ps_prefill_jit`); an eager call checks the values, then runs the jitted core.

    Inputs must satisfy `check_prefill_plan_inputs`: qo_indptr[0] == 0 and non-decreasing, every
    query length <= config.max_qlen, 0 <= qo_len <= context_len when causal, kv_indptr holding
    ceil(context_len / block_size) entries per request (not checked eagerly for a legacy config,
    which reproduces the pre-fix pairing on purpose), every length and offset within int32.
    They are checked when concrete (an eager call; host integers of any width are accepted when
    they fit int32); under jit run `funcmla.checks.checked(check_prefill_plan_inputs)`. Unused
    buffer tails are zero, as AITER leaves them.
    """
    if not isinstance(config, PrefillPlanConfig):
        raise TypeError(f"config must be a PrefillPlanConfig, got {type(config).__name__}")
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("context_lens", context_lens)):
        if np.ndim(x) != 1:
            raise ValueError(f"{name} must be a 1-D int32 array, got shape {np.shape(x)}")
    batch = np.shape(qo_indptr)[0] - 1
    if np.shape(kv_indptr)[0] != batch + 1 or np.shape(context_lens)[0] != batch:
        raise ValueError(
            f"inconsistent batch sizes: qo_indptr {np.shape(qo_indptr)}, kv_indptr "
            f"{np.shape(kv_indptr)}, context_lens {np.shape(context_lens)} (expected [B+1], "
            "[B+1], [B])")
    ps_prefill_plan_sizes(batch, config.max_qlen, config=config)  # batch >= 1
    concrete = is_concrete(qo_indptr, kv_indptr, context_lens)
    qo_indptr = to_int32(qo_indptr, "qo_indptr")
    kv_indptr = to_int32(kv_indptr, "kv_indptr")
    context_lens = to_int32(context_lens, "context_lens")
    if concrete:  # eager call: the values are known, check them (under jit: checkify variant)
        # A legacy config plans whatever kv_indptr holds (the pre-fix pairing, reproducible on
        # purpose); check_plan_matches_metadata refuses such a plan against token metadata.
        _prefill_input_checks(EAGER, *(np.asarray(x) for x in (qo_indptr, kv_indptr, context_lens)),
                              config=config, entries=not config.legacy)
    return _plan_ps_prefill(qo_indptr, kv_indptr, context_lens, config=config)


@functools.partial(jax.jit, static_argnames=("config",))
def _plan_ps_prefill(qo_indptr, kv_indptr, context_lens, *, config: PrefillPlanConfig) -> WorkPlan:
    batch = qo_indptr.shape[0] - 1
    cfg = config
    sizes = ps_prefill_plan_sizes(batch, cfg.max_qlen, config=cfg)
    mq, num_tiles = sizes.max_qo_tiles, sizes.num_tiles
    g, bs, bpu = cfg.qlen_granularity, cfg.block_size, cfg.blocks_per_unit
    tpc, khpc, nclusters = cfg.tgs_per_cluster, cfg.kheads_per_cluster, cfg.num_clusters
    if num_tiles == 0:  # max_qlen == 0: nothing to plan, all buffers zero
        z = jnp.zeros((), jnp.int32)
        return WorkPlan(
            work_indptr=jnp.zeros((sizes.num_cu + 1,), jnp.int32),
            work_info=jnp.zeros((sizes.max_works, 8), jnp.int32),
            reduce_indptr=jnp.zeros((1,), jnp.int32),
            reduce_final_map=jnp.zeros((0, 2), jnp.int32),
            reduce_partial_map=jnp.zeros((sizes.max_partials,), jnp.int32),
            num_works=z, num_partials=z, kind="prefill", block_size=cfg.block_size,
            legacy=cfg.legacy)

    # ---- Step 1: the tile grid [B, mq] in visiting (ping-pong) order, flattened to [T].
    i, n, idx, local_end, qo_len, valid, units = _tile_grid(qo_indptr, context_lens, cfg, mq)
    tile_batch = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), mq, total_repeat_length=num_tiles)
    tile_qs = (qo_indptr[:-1, None] + idx * g).reshape(-1)
    tile_qe = (qo_indptr[:-1, None] + local_end).reshape(-1)
    u_end = jnp.cumsum(units, dtype=jnp.int32)
    u_start = u_end - units  # U_i
    total = u_end[-1]

    # ---- Step 2: thread-group intervals [C_t, C_{t+1}) on the unit stream, and the works per tile.
    avg, rem = total // tpc, total % tpc
    t = jnp.arange(tpc + 1, dtype=jnp.int32)
    c_bound = t * avg + jnp.minimum(t, rem)  # [tpc + 1], C_tpc == total
    after_start = searchsorted_i32(c_bound, u_start, "right")  # first TG boundary > U_i
    inside = searchsorted_i32(c_bound, u_end, "left") - after_start  # boundaries strictly inside the tile
    k = jnp.where(units > 0, 1 + inside, (u_start < total).astype(jnp.int32))
    k = jnp.where(valid, k, 0)
    first_tg = after_start - 1
    split = k >= 2
    parts = jnp.where(split, k, 0)
    p_first = jnp.cumsum(parts, dtype=jnp.int32) - parts  # first partial id of each tile
    k_end = jnp.cumsum(k, dtype=jnp.int32)
    k_start = k_end - k
    w1 = k_end[-1]  # works of one k head in one cluster

    wmax1 = num_tiles + tpc - 1  # static bound on w1
    w = jnp.arange(wmax1, dtype=jnp.int32)
    w_live = w < w1
    # tile of work slot w = #tiles with k_end <= w (a histogram + cumsum: O(T + wmax1))
    ends_hist = jnp.zeros((wmax1 + 1,), jnp.int32).at[jnp.minimum(k_end, wmax1)].add(1)
    tile = jnp.minimum(jnp.cumsum(ends_hist, dtype=jnp.int32)[:wmax1], num_tiles - 1)
    j = w - k_start[tile]
    tg = first_tg[tile] + j
    tg_c = jnp.clip(tg, 0, tpc - 1)
    seg_start = jnp.where(j == 0, u_start[tile], c_bound[tg_c])
    seg_end = jnp.minimum(u_end[tile], c_bound[tg_c + 1])
    b = tile_batch[tile]
    kv_base = kv_indptr[b]
    kv_s = kv_base + (seg_start - u_start[tile]) * bpu
    kv_e = jnp.minimum(kv_base + (seg_end - u_start[tile]) * bpu, kv_indptr[b + 1])
    finish = seg_end == u_end[tile]
    kv_off = jnp.where(finish, 0, context_lens[b] - (kv_e - kv_base) * bs)
    ploc = jnp.where(split[tile], g * (p_first[tile] + j), -1)
    base = jnp.stack([b, ploc, tile_qs[tile], tile_qe[tile], kv_s, kv_e, kv_off], axis=-1)

    # Works of TG t are [tg_first[t], tg_first[t+1]) of the single-head list.
    tg_key = jnp.where(w_live, tg, tpc)
    tg_first = searchsorted_i32(tg_key, t, "left")  # [tpc + 1]

    # ---- Step 3: duplicate per k head (head-major inside a TG) and per cluster: scatter each
    # (cluster, k head, work) to its row; O(num_heads_k * (T + tpc)), not O(max_works).
    per_cluster = khpc * w1
    w_tg = jnp.clip(tg, 0, tpc - 1)
    cnt = tg_first[w_tg + 1] - tg_first[w_tg]
    c_ids = jnp.arange(nclusters, dtype=jnp.int32)[:, None, None]
    kh_off = jnp.arange(khpc, dtype=jnp.int32)[None, :, None]
    dst = c_ids * per_cluster + khpc * tg_first[w_tg] + kh_off * cnt + (w - tg_first[w_tg])
    dst = jnp.where(w_live, dst, sizes.max_works).reshape(-1)  # dead slots -> the spare row
    kh = c_ids * khpc + kh_off  # [nclusters, khpc, 1]
    qhr = pack_q_head_range(kh * cfg.qhead_granularity, (kh + 1) * cfg.qhead_granularity)
    rows = jnp.concatenate(
        [jnp.broadcast_to(base, (nclusters, khpc) + base.shape),
         jnp.broadcast_to(qhr, (nclusters, khpc, wmax1))[..., None]], axis=-1).reshape(-1, 8)
    work_info = jnp.zeros((sizes.max_works + 1, 8), jnp.int32).at[dst].set(rows)[:-1]

    cu = jnp.arange(1, cfg.device.num_cu + 1, dtype=jnp.int32)
    cu_cluster, cu_tg = (cu - 1) // tpc, (cu - 1) % tpc
    work_indptr = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), cu_cluster * per_cluster + khpc * tg_first[cu_tg + 1]])

    # ---- Step 4: reduce info. Groups are the split tiles in (qo_start, qo_end) order, i.e.
    # batch order then tile order: invert the ping-pong visit to walk the grid sorted.
    pos = jnp.where(i < (n + 1) // 2, 2 * i, 2 * (n - 1 - i) + 1)  # visit index of sorted tile i
    sorted_tile = (jnp.arange(batch, dtype=jnp.int32)[:, None] * mq + jnp.clip(pos, 0, mq - 1)).reshape(-1)
    s_split = split[sorted_tile] & (i < n).reshape(-1)
    s_parts = jnp.where(s_split, k[sorted_tile], 0)
    grp_end = jnp.cumsum(s_parts, dtype=jnp.int32)
    num_partials = grp_end[-1]
    grp_id = jnp.cumsum(s_split.astype(jnp.int32)) - 1
    num_groups = grp_id[-1] + 1
    dest = jnp.where(s_split, grp_id, num_tiles)
    group_tile = jnp.zeros((num_tiles + 1,), jnp.int32).at[dest].set(sorted_tile)[:-1]
    group_count = jnp.zeros((num_tiles + 1,), jnp.int32).at[dest].set(s_parts)[:-1]
    group_end = jnp.cumsum(group_count, dtype=jnp.int32)
    reduce_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), group_end])
    g_live = jnp.arange(num_tiles) < num_groups
    reduce_final_map = jnp.where(
        g_live[:, None], jnp.stack([tile_qs[group_tile], tile_qe[group_tile]], axis=-1), 0)
    # partial entries: each split fragment of the single-head list, at its group's slot
    tile_group = jnp.zeros((num_tiles + 1,), jnp.int32).at[jnp.where(s_split, sorted_tile, num_tiles)].set(
        grp_id)[:-1]
    grp_t = tile_group[tile]
    e_dst = jnp.where(w_live & split[tile], group_end[grp_t] - group_count[grp_t] + j, sizes.max_partials)
    reduce_partial_map = jnp.zeros((sizes.max_partials + 1,), jnp.int32).at[e_dst].set(
        g * (p_first[tile] + j))[:-1]

    return WorkPlan(
        work_indptr=work_indptr,
        work_info=work_info,
        reduce_indptr=reduce_indptr.astype(jnp.int32),
        reduce_final_map=reduce_final_map.astype(jnp.int32),
        reduce_partial_map=reduce_partial_map.astype(jnp.int32),
        num_works=work_indptr[-1],
        num_partials=num_partials.astype(jnp.int32),
        kind="prefill",
        block_size=cfg.block_size,
        legacy=cfg.legacy,
    )


def check_plan_matches_metadata(plan: WorkPlan, kv, *, allow_legacy_mismatch: bool = False) -> None:
    """Trace-time granularity check: the plan's `block_size` must equal the tokens per entry of
    the index stream the kernel will read (`TokenCSR` or token metadata: 1; `PageTable`: its
    page_size). A mismatch is the seed's bug; it raises `ValueError` unless
    `allow_legacy_mismatch=True` (only to reproduce the bug on purpose).
    """
    if not isinstance(plan, WorkPlan):
        raise TypeError(f"plan must be a WorkPlan, got {type(plan).__name__}")
    if isinstance(kv, PageTable):
        entry_tokens, what = kv.page_size, f"PageTable (page_size={kv.page_size})"
    elif isinstance(kv, TokenCSR) or getattr(kv, "granularity", None) == "token":
        entry_tokens, what = 1, f"{type(kv).__name__} (token-granular)"
    else:
        expect_layout(kv, TokenCSR, "kv")
    if plan.block_size != entry_tokens and not allow_legacy_mismatch:
        raise ValueError(
            f"{plan.kind} plan block_size={plan.block_size} (tokens per kv_indices entry) does not "
            f"match the metadata: {what} has {entry_tokens} token(s) per entry. Works would cover "
            f"kv_len / {plan.block_size} entries instead of kv_len tokens (the page_size > 1 bug of "
            "sglang#25556). Plan with block_size=1 (PrefillPlanConfig defaults)"
            + (" — this plan was built with the named legacy pairing" if plan.legacy else "")
            + "; pass allow_legacy_mismatch=True only to reproduce the bug.")


def check_prefill_plan_inputs(qo_indptr, kv_indptr, context_lens, *, config: PrefillPlanConfig) -> None:
    """checkify value checks of `plan_ps_prefill`'s inputs (run under `funcmla.checks.checked`;
    eager calls of `plan_ps_prefill` run the same checks in NumPy by default).

    qo_indptr and kv_indptr well formed and not wrapped past int32; 0 <= qo_len <= max_qlen;
    context_lens >= 0 (and >= qo_len when causal); each request has exactly
    ceil(context_len / block_size) kv_indptr entries; lengths leave room to round up to a whole
    split unit, and the unit stream's total fits int32.
    """
    _prefill_input_checks(TRACED, qo_indptr, kv_indptr, context_lens, config=config)


def _prefill_input_checks(c: Checker, qo_indptr, kv_indptr, context_lens, *,
                          config: PrefillPlanConfig, entries: bool = True) -> None:
    xp = c.xp
    check_no_wrap(c, qo_indptr, "qo_indptr")
    check_indptr(qo_indptr, "qo_indptr", checker=c)
    check_no_wrap(c, kv_indptr, "kv_indptr")
    check_indptr(kv_indptr, "kv_indptr", checker=c)
    qo_len = qo_indptr[1:] - qo_indptr[:-1]
    n_entries = kv_indptr[1:] - kv_indptr[:-1]

    def first(bad):
        return xp.argmax(bad).astype(xp.int32)

    bad = qo_len > config.max_qlen
    b = first(bad)
    c.check(~xp.any(bad), f"request {{b}} has {{q}} queries > config.max_qlen={config.max_qlen}",
            b=b, q=qo_len[b])
    bad = context_lens < (qo_len if config.is_causal else 0)
    b = first(bad)
    c.check(~xp.any(bad), "context_lens[{b}] = {c} is below the query length {q} (causal) or 0",
            b=b, c=context_lens[b], q=qo_len[b])
    room = INT32_MAX - (config.kvlen_granularity - 1)
    bad = context_lens > room
    b = first(bad)
    c.check(~xp.any(bad),
            f"context_lens[{{b}}] = {{c}} exceeds {room}: the int32 limit {INT32_MAX} less "
            f"kvlen_granularity - 1 (the planner rounds up to whole split units)",
            b=b, c=context_lens[b])
    room = INT32_MAX - (config.blocks_per_unit - 1)
    c.check(kv_indptr[-1] <= room,
            f"total kv length {{v}} (kv_indptr[-1]) exceeds {room}: the int32 limit "
            f"{INT32_MAX} of work_info less one split unit", v=kv_indptr[-1])
    if entries:
        want = (context_lens + config.block_size - 1) // config.block_size
        bad = n_entries != want
        b = first(bad)
        c.check(
            ~xp.any(bad),
            f"kv_indptr[{{b1}}] - kv_indptr[{{b}}] = {{e}} entries, but context_lens[{{b}}] = {{c}} "
            f"tokens needs {{w}} entries of block_size={config.block_size}",
            b1=b + 1, b=b, e=n_entries[b], c=context_lens[b], w=want[b])
    mq = -(-config.max_qlen // config.qlen_granularity)
    if mq:
        units = _tile_grid(qo_indptr, context_lens, config, mq, xp=xp)[-1]
        check_prefix_sums_fit(c, units, "the total of split units over all q tiles")


# `plan_ps_prefill` under `jax.jit` (config static): no value checks (the inputs are traced).
plan_ps_prefill_jit = jax.jit(plan_ps_prefill, static_argnames=("config",))
