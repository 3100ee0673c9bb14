"""A deterministic serving-trace simulation: allocator -> metadata -> (plan ->) attention.

Requests arrive, are prefilled (reusing page-aligned prefixes of running requests through
`share_prefix`), decode one token per step (or verify `num_draft_tokens` draft tokens per step
and keep the accepted ones), and finish. Every step goes through the functional allocator
(`funcmla.allocator`), a metadata builder (`funcmla.metadata`, value-checked with
`funcmla.checks`) and the reference attention over the paged latent pool
(`funcmla.attention.reference`), or, with `use_plans`, the AITER work planners
(`funcmla.planners.decode` / `prefill`) and the plan executor (`funcmla.attention.executor`).
On a GPU, decode and verify steps run funcmla's Pallas decode kernel
(`funcmla.attention.pallas`, bf16 operands; `pallas_decode`, interpret mode when forced on a CPU).
Each step's output is compared with a float64 NumPy oracle computed on a dense, unpaged copy
of the same keys (`StepStats.max_rel_err`).

Page-size invariance is the point: the latent row of a token is a pure function of (token id,
position) and the query a pure function of (request id, position) (`hashed_uniform`), so what a
request computes cannot depend on the page size, on where its pages landed, on prefix hits, or
on being retracted after an out-of-memory and recomputed. `SimulationResult.outputs_identical()`
checks that the outputs agree bit for bit across page sizes.

The host loop is plain Python over steps calling jitted pure functions with static shapes: the
batch is padded to `max_running` rows (prefill rows with zero tokens; decode/verify rows replay
the first request, with ignored queries, so that every kv_indices entry is a live slot and the
metadata value checks hold), prefill queries to `max_prefill_tokens`, KV gathers to
`max_context_len`. The pool array has
`pool_tokens + max(64, *page_sizes)` rows at every page size, so one compiled forward per
mode serves all page sizes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from funcmla import allocator as alloc
from funcmla import metadata as md
from funcmla.attention.reference import mla_attention_reference
from funcmla.checks import check_metadata, check_page_contiguity, checked
from funcmla.config import MLADims, custom_device
from funcmla.layout import PoolSpec, check_page_size

__all__ = [
    "SimulationConfig",
    "RequestSpec",
    "StepStats",
    "PageSizeRun",
    "SimulationResult",
    "hashed_uniform",
    "make_workload",
    "run_simulation",
]

_KV_STREAM, _Q_STREAM = 1, 2


@dataclasses.dataclass(frozen=True)
class SimulationConfig:
    """A seeded workload and the serving limits. Defaults run in seconds on a 2-core CPU.

    Lengths are tokens. `pool_tokens` is the usable KV pool (page 0 comes on top); at page
    size `page_size` it holds `pool_tokens // page_size` pages, so larger pages waste more of it
    and run out of memory sooner (then prefill candidates are deferred and running requests
    retracted, as SGLang does, never corrupted).
    """

    seed: int = 0
    num_requests: int = 12
    arrival_every: float = 2.0  # mean steps between arrivals (geometric gaps)
    prompt_len: tuple[int, int] = (16, 112)  # inclusive; grouped prompts exceed the prefix
    output_len: tuple[int, int] = (4, 16)  # inclusive
    num_prefix_groups: int = 2  # requests of a group share a system prompt
    shared_prefix_len: int = 72  # tokens of that system prompt
    shared_prefix_prob: float = 0.6  # chance that a request belongs to a group
    max_running: int = 4  # decode batch (max_bs) and request-table rows
    max_prefill_tokens: int = 256  # new tokens per prefill step (static query bucket)
    max_context_len: int = 256  # req_to_token columns
    pool_tokens: int = 384  # usable KV slots (a multiple of every simulated page size)
    num_draft_tokens: int = 0  # > 0: decode steps verify this many draft tokens
    num_heads: int = 8  # a multiple of 8 for the decode planner
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    v_head_dim: int = 64
    vocab_size: int = 512
    check: bool = True  # funcmla.checks value checks (checkify) on every step's metadata
    use_plans: bool = False  # run attention through the work planners + plan executor
    # Decode / verify steps through funcmla's Pallas decode kernel (bf16 operands):
    # "auto" = on a GPU backend, "on" = always (Pallas interpret mode off a GPU), "off" = never.
    pallas_decode: str = "auto"
    plan_num_cu: int = 16  # compute units of the (gfx950) device the plans are made for
    # The seed's two bugs, reproducible on purpose (README): a prefill plan counting pages
    # (block_size = page_size) against token-granular metadata (needs use_plans), and a
    # kv_indices buffer sized in pages while it is written per token. Garbage at page size > 1.
    legacy_prefill_plan: bool = False
    legacy_kv_indices_buffer: bool = False
    max_steps: int = 10_000

    def __post_init__(self):
        positive = ("num_requests", "num_prefix_groups", "max_running", "max_prefill_tokens",
                    "max_context_len", "pool_tokens", "num_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "vocab_size", "plan_num_cu", "max_steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SimulationConfig.{name} must be a positive int, got {value!r}")
        for name in ("seed", "shared_prefix_len", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SimulationConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("prompt_len", "output_len"):
            rng = getattr(self, name)
            if not (isinstance(rng, tuple) and len(rng) == 2
                    and all(isinstance(v, int) for v in rng) and 1 <= rng[0] <= rng[1]):
                raise ValueError(
                    f"SimulationConfig.{name} must be a (lo, hi) tuple of ints with "
                    f"1 <= lo <= hi, got {rng!r}"
                )
        if not 0.0 <= self.shared_prefix_prob <= 1.0:
            raise ValueError(
                "SimulationConfig.shared_prefix_prob must be in [0, 1], "
                f"got {self.shared_prefix_prob!r}"
            )
        if not self.arrival_every >= 0:
            raise ValueError(
                f"SimulationConfig.arrival_every must be >= 0, got {self.arrival_every!r}"
            )
        if self.shared_prefix_prob > 0 and self.shared_prefix_len >= self.prompt_len[1]:
            raise ValueError(
                f"SimulationConfig.shared_prefix_len={self.shared_prefix_len} must be shorter "
                f"than the longest prompt (prompt_len[1]={self.prompt_len[1]})"
            )
        if self.prompt_len[1] > self.max_prefill_tokens:
            raise ValueError(
                f"SimulationConfig.prompt_len[1]={self.prompt_len[1]} exceeds "
                f"max_prefill_tokens={self.max_prefill_tokens} (there is no chunked prefill)"
            )
        if self.max_request_len > self.max_context_len:
            raise ValueError(
                "SimulationConfig: prompt_len[1] + output_len[1] + num_draft_tokens = "
                f"{self.max_request_len} exceeds max_context_len={self.max_context_len}"
            )
        self.dims  # validates the MLA dimensions
        if self.pallas_decode not in ("auto", "on", "off"):
            raise ValueError(
                "SimulationConfig.pallas_decode must be 'auto', 'on' or 'off', "
                f"got {self.pallas_decode!r}"
            )
        if self.legacy_prefill_plan and not self.use_plans:
            raise ValueError("SimulationConfig.legacy_prefill_plan=True needs use_plans=True")
        if self.use_plans:
            self.plan_configs(1)  # validates them (e.g. AITER's head counts) before any run

    @property
    def uses_pallas_decode(self) -> bool:
        """Whether decode / verify steps run the Pallas kernel (resolves "auto")."""
        if self.pallas_decode == "auto":
            return jax.default_backend() == "gpu"
        return self.pallas_decode == "on"

    @property
    def max_request_len(self) -> int:
        """Most slots one request can hold (tokens): longest prompt + output + drafts."""
        return self.prompt_len[1] + self.output_len[1] + self.num_draft_tokens

    @property
    def dims(self) -> MLADims:
        return MLADims(num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)

    def plan_configs(self, page_size: int):
        """(prefill, decode) planner configs for a `plan_num_cu`-CU gfx950 device at
        `page_size`. The decode one has `max_seqlen_qo = num_draft_tokens` (verify) or 1; the
        prefill one counts tokens, or pages with `legacy_prefill_plan` (the seed's bug)."""
        from funcmla.planners.decode import DecodePlanConfig
        from funcmla.planners.prefill import PrefillPlanConfig

        device = custom_device(self.plan_num_cu, "gfx950", name="sim")
        msq = max(1, self.num_draft_tokens)
        prefill = dict(device=device, gqa_ratio=self.num_heads, max_qlen=self.prompt_len[1])
        if self.legacy_prefill_plan:
            prefill_cfg = PrefillPlanConfig.legacy_page_granular(page_size, **prefill)
        else:
            prefill_cfg = PrefillPlanConfig(**prefill)
        return (
            prefill_cfg,
            DecodePlanConfig(device=device, num_heads=self.num_heads, max_seqlen_qo=msq,
                             is_causal=msq > 1),
        )

    def allocator_spec(self, page_size: int) -> alloc.AllocatorSpec:
        """The allocator at `page_size`; checks that the pool is a whole number of pages and
        holds the longest request."""
        check_page_size(page_size)
        if self.pool_tokens % page_size:
            raise ValueError(
                f"SimulationConfig.pool_tokens={self.pool_tokens} is not a multiple of "
                f"page_size={page_size}"
            )
        num_pages = self.pool_tokens // page_size
        need = -(-self.max_request_len // page_size)
        if need > num_pages:
            raise ValueError(
                f"SimulationConfig.pool_tokens={self.pool_tokens} holds {num_pages} pages of "
                f"{page_size} tokens, fewer than the {need} the longest request needs"
            )
        return alloc.AllocatorSpec(num_pages=num_pages, page_size=page_size,
                                   num_req_slots=self.max_running,
                                   max_context_len=self.max_context_len)


# --------------------------------------------------------------------------------------------
# deterministic data


def _fmix(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser (a bijection on uint32; arrays wrap silently)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def hashed_uniform(seed: int, stream: int, a, b, width: int) -> np.ndarray:
    """float32 [N, width], uniform on [-sqrt(3), sqrt(3)) (mean 0, variance 1): a pure function
    of (seed, stream, a[i], b[i], column). Used as latent row (token id, position) and query
    (request id, position), so values never depend on where a token is stored."""
    a = np.asarray(a, np.int64).astype(np.uint32)
    b = np.asarray(b, np.int64).astype(np.uint32)
    h0 = _fmix(np.full(a.shape, (seed * 0x9E3779B1 + stream * 0x632BE5AB) % 2**32, np.uint32))
    h = _fmix(_fmix(h0 ^ a) + b * np.uint32(0x9E3779B1))
    cols = np.arange(width, dtype=np.uint32) * np.uint32(0x27D4EB2F)
    x = _fmix(_fmix(h[:, None] ^ cols[None, :]) + h[:, None])
    u = (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    return ((u * 2.0 - 1.0) * np.float32(math.sqrt(3.0))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of the workload. `token_ids` covers prompt and output (int32)."""

    rid: int
    arrival_step: int
    prompt_len: int
    output_len: int
    group: int  # prefix group, -1 for none
    token_ids: np.ndarray

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def make_workload(config: SimulationConfig) -> list[RequestSpec]:
    """The seeded request list (independent of page size)."""
    rng = np.random.default_rng(config.seed)
    prefixes = rng.integers(0, config.vocab_size,
                            (config.num_prefix_groups, config.shared_prefix_len))
    p_arrive = 1.0 / (1.0 + config.arrival_every)
    step, out = 0, []
    for rid in range(config.num_requests):
        if rid:
            step += int(rng.geometric(p_arrive)) - 1
        group = -1
        if config.shared_prefix_len and rng.random() < config.shared_prefix_prob:
            group = int(rng.integers(0, config.num_prefix_groups))
        lo = config.prompt_len[0]
        if group >= 0:
            lo = max(lo, config.shared_prefix_len + 1)
        prompt = int(rng.integers(lo, config.prompt_len[1] + 1))
        output = int(rng.integers(config.output_len[0], config.output_len[1] + 1))
        tokens = rng.integers(0, config.vocab_size, prompt + output).astype(np.int32)
        if group >= 0:
            tokens[: config.shared_prefix_len] = prefixes[group]
        out.append(RequestSpec(rid, step, prompt, output, group, tokens))
    return out


def _accepted_drafts(seed: int, rid: int, pos: int, n: int) -> int:
    """Draft tokens (0 .. n-1) a verify step starting at `pos` accepts: seeded, page-free."""
    return int(np.random.default_rng([seed, rid, pos]).integers(0, n))


def _oracle(q, keys, q_lens, scale: float, v_dim: int) -> np.ndarray:
    """Float64 bottom-right-causal MLA attention, request by request on dense keys.

    q [T, H, D] (rows of request i follow those of i - 1); keys[i] [kv_len_i, D]."""
    out = np.zeros(q.shape[:2] + (v_dim,))
    q0 = 0
    for k, nq in zip(keys, q_lens):
        k = k.astype(np.float64)
        qq = q[q0:q0 + nq].astype(np.float64)
        s = np.einsum("thd,sd->ths", qq, k) * scale
        vis = len(k) - (nq - 1 - np.arange(nq))  # keys visible to each query
        s = np.where(np.arange(len(k))[None, None, :] < vis[:, None, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[q0:q0 + nq] = np.einsum("ths,sd->thd", p / p.sum(-1, keepdims=True), k[:, :v_dim])
        q0 += nq
    return out


# --------------------------------------------------------------------------------------------
# results


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One forward step. Token counts are tokens; pages are pages of this run's page size."""

    step: int
    mode: str  # "extend" | "decode" | "target_verify"
    batch_size: int  # live requests in the batch
    num_q_tokens: int
    num_kv_tokens: int  # kv_indptr[-1] of the live requests
    kv_indices_capacity: int  # static length of kv_indices (BufferPlan, token-granular)
    pages_in_use: int  # after the step
    num_free_pages: int
    prefix_hit_tokens: int  # tokens reused through share_prefix in this step
    oom_events: int  # prefill candidates deferred or running requests retracted
    plan_works: int  # live rows of the work plan (0 without use_plans)
    plan_partials: int  # partial outputs the plan's reduce merges (0 without use_plans)
    max_rel_err: float  # max |out - float64 oracle| / max |oracle| over the step's queries


@dataclasses.dataclass(frozen=True)
class PageSizeRun:
    """One simulated trace at one page size."""

    page_size: int
    num_pages: int
    steps: tuple[StepStats, ...]
    outputs: dict[int, np.ndarray]  # rid -> float32 [output_len + 1, H, v_head_dim]
    wall_s: float

    def summary(self) -> dict:
        s = self.steps
        return dict(
            page_size=self.page_size,
            steps=len(s),
            extend_steps=sum(x.mode == "extend" for x in s),
            q_tokens=sum(x.num_q_tokens for x in s),
            kv_tokens=sum(x.num_kv_tokens for x in s),
            num_pages=self.num_pages,
            max_pages_in_use=max((x.pages_in_use for x in s), default=0),
            prefix_hit_tokens=sum(x.prefix_hit_tokens for x in s),
            oom_events=sum(x.oom_events for x in s),
            plan_works=sum(x.plan_works for x in s),
            max_rel_err=max((x.max_rel_err for x in s), default=0.0),
            wall_s=self.wall_s,
        )


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Runs by page size. `outputs[rid][k]` is the attention output of the query at position
    `prompt_len - 1 + k` of request `rid` (the last prompt token, then every generated one)."""

    config: SimulationConfig
    runs: dict[int, PageSizeRun]

    def max_output_diff(self) -> float:
        """Max |difference| of any output between any run and the first."""
        runs = list(self.runs.values())
        return max((float(np.max(np.abs(run.outputs[rid] - out)))
                    for run in runs[1:] for rid, out in runs[0].outputs.items()), default=0.0)

    def outputs_identical(self) -> bool:
        """Bitwise equal outputs at every simulated page size."""
        runs = list(self.runs.values())
        return all(np.array_equal(run.outputs[rid], out)
                   for run in runs[1:] for rid, out in runs[0].outputs.items())

    def summary(self) -> list[dict]:
        return [run.summary() for run in self.runs.values()]

    def to_dict(self) -> dict:
        """JSON-ready: the config, and per page size the summary and every step's stats
        (outputs are left out; compare them with `outputs_identical`)."""
        return dict(
            config=dataclasses.asdict(self.config),
            outputs_identical=self.outputs_identical(),
            max_output_diff=self.max_output_diff(),
            runs=[dict(summary=run.summary(), steps=[dataclasses.asdict(x) for x in run.steps])
                  for run in self.runs.values()],
        )


# --------------------------------------------------------------------------------------------
# jitted step functions (static arguments are hashable dataclasses)


@dataclasses.dataclass(frozen=True)
class _Forward:
    mode: str  # "extend" | "decode" | "target_verify"
    num_draft_tokens: int
    kv_capacity: int
    max_context_len: int
    dims: MLADims
    plan_config: object | None  # PrefillPlanConfig (extend) / DecodePlanConfig; None: no plans
    pallas: bool = False  # decode / verify through the Pallas kernel (interpret off-GPU)


def _attend_with_plan(f: _Forward, q, kv_pool, meta):
    from funcmla.attention.executor import run_work_plan
    from funcmla.planners.decode import plan_mla_decode
    from funcmla.planners.prefill import plan_ps_prefill

    dims, cfg = f.dims, f.plan_config
    if f.mode == "extend":
        plan = plan_ps_prefill(meta.qo_indptr, meta.kv_indptr, meta.kv_lens, config=cfg)
        max_qo_span, legacy = cfg.qlen_granularity, cfg.legacy
    else:
        plan = plan_mla_decode(meta.qo_indptr, meta.kv_indptr, meta.kv_last_page_len,
                               config=cfg, fill_impl="scan")
        max_qo_span, legacy = cfg.max_seqlen_qo, False
    # A legacy (page-counting) plan runs literally against the token-granular metadata.
    out, _ = run_work_plan(q, kv_pool, meta, plan, sm_scale=dims.sm_scale,
                           max_qo_span=max_qo_span, max_kv_span=f.max_context_len,
                           v_head_dim=dims.v_head_dim, causal=True,
                           allow_legacy_mismatch=legacy)
    return out, plan.num_works, plan.num_partials


@functools.partial(jax.jit, static_argnames=("f",))
def _attend_with_pallas(f: _Forward, q, kv_pool, meta):
    """Decode / target-verify attention through the Pallas decode kernel: bf16 q and pool,
    token-granular kv_indices, `s_q` queries per request (bottom-right causal). float32 out."""
    from funcmla.attention.pallas import mla_decode

    s_q = max(1, f.num_draft_tokens)
    out, _ = mla_decode(q.astype(jnp.bfloat16), kv_pool.astype(jnp.bfloat16),
                        kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                        sm_scale=f.dims.sm_scale, s_q=s_q, max_kv_len=f.max_context_len,
                        v_head_dim=f.dims.v_head_dim,
                        interpret=jax.default_backend() != "gpu")
    return out.astype(jnp.float32)


def _forward(f: _Forward, req_to_token, kv_pool, write_loc, write_rows, batch, q):
    """Write the step's latent rows at their slots, build metadata, attend.

    write_loc [N] token slots (0 = padding, the reserved slot), write_rows [N, D];
    batch = (req_pool_indices [B], seq_lens [B], extend_seq_lens [B]); q [T, H, D].
    Returns (kv_pool, metadata, out [T, H, v_head_dim], plan works, plan partials).
    """
    kv_pool = kv_pool.at[write_loc].set(write_rows)
    rpi, seq_lens, extend_lens = batch
    meta = md.build_metadata(f.mode, req_to_token, rpi, seq_lens, extend_lens,
                             capacity=f.kv_capacity, num_draft_tokens=f.num_draft_tokens)
    if f.pallas and f.mode != "extend":
        out = _attend_with_pallas(f, q, kv_pool, meta)
        works = partials = jnp.int32(0)
    elif f.plan_config is not None:
        out, works, partials = _attend_with_plan(f, q, kv_pool, meta)
    else:
        out, _ = mla_attention_reference(q, kv_pool, meta.qo_indptr, meta.kv_indptr,
                                         meta.kv_indices, sm_scale=f.dims.sm_scale,
                                         v_head_dim=f.dims.v_head_dim, causal=True,
                                         max_kv_len=f.max_context_len)
        works = partials = jnp.int32(0)
    return kv_pool, meta, out, works, partials


@functools.lru_cache(maxsize=None)
def _metadata_checker(pool: PoolSpec, max_context_len: int):
    """A jitted, checkified validator of one step's metadata for one pool."""

    def check(meta):
        check_metadata(meta, pool=pool, max_context_len=max_context_len)
        check_page_contiguity(meta.kv, page_size=pool.page_size)

    return jax.jit(checked(check))


# --------------------------------------------------------------------------------------------
# the host loop


@dataclasses.dataclass
class _Live:
    spec: RequestSpec
    row: int
    cur_len: int  # tokens whose KV is in the pool (between steps: true tokens only)


class _Trace:
    """Host state of one run: queues, request rows, the allocator state and the KV pool."""

    def __init__(self, config: SimulationConfig, page_size: int, pool_rows: int, workload):
        self.cfg = config
        self.page_size = page_size
        self.spec = config.allocator_spec(page_size)
        self.state = alloc.init_allocator(self.spec)
        dims = config.dims
        self.kv_pool = jnp.zeros((pool_rows, dims.head_dim_qk), jnp.float32)
        self.pending = collections.deque(sorted(workload, key=lambda r: (r.arrival_step, r.rid)))
        self.waiting: collections.deque[RequestSpec] = collections.deque()
        self.running: list[_Live] = []
        self.free_rows = list(range(config.max_running))
        self.outputs = {
            r.rid: np.full((r.output_len + 1, dims.num_heads, dims.v_head_dim), np.nan,
                           np.float32)
            for r in workload
        }
        self.finished = 0
        self.steps: list[StepStats] = []
        # Token-granular kv_indices capacity with draft slack (the seed's fix), or, with
        # legacy_kv_indices_buffer, the page-granular size the seed's bug had.
        self.kv_capacity = md.BufferPlan(
            max_bs=config.max_running, max_context_len=config.max_context_len,
            page_size=page_size, num_draft_tokens=config.num_draft_tokens,
            legacy_block_granular_kv_indices=config.legacy_kv_indices_buffer,
        ).kv_indices_capacity

    # -- small helpers
    def _pad(self, values, fill, n=None):
        n = self.cfg.max_running if n is None else n
        return np.array(list(values) + [fill] * (n - len(values)), np.int32)

    def _mask(self, k, n=None):
        return np.arange(self.cfg.max_running if n is None else n) < k

    def _free_rows(self, rows) -> None:
        res = alloc.free_requests(self.state, self._pad(rows, 0), self._mask(len(rows)))
        alloc.raise_for_status(res, "free_requests")
        self.state = res.state
        self.free_rows = sorted(self.free_rows + list(rows))

    def _retract_last(self) -> None:
        """Out of pages while decoding: free the newest running request and requeue it."""
        if len(self.running) <= 1:
            raise RuntimeError(
                f"page_size={self.page_size}: out of pages with a single running request; "
                f"SimulationConfig.pool_tokens={self.cfg.pool_tokens} is too small"
            )
        victim = self.running.pop()
        self._free_rows([victim.row])
        self.waiting.appendleft(victim.spec)

    def _match(self, req: RequestSpec) -> tuple[int, int]:
        """(src row, tokens) of the longest page-aligned prefix a running request holds; at
        most prompt_len - 1 tokens (the last prompt token is always computed)."""
        best = (0, 0)
        for live in self.running:
            n = min(live.cur_len, req.prompt_len - 1)
            diff = np.flatnonzero(live.spec.token_ids[:n] != req.token_ids[:n])
            m = (int(diff[0]) if diff.size else n) // self.page_size * self.page_size
            if m > best[1]:
                best = (live.row, m)
        return best

    def _tokens(self, live: _Live, n: int, drafts=None) -> np.ndarray:
        """Token ids at positions [0, n) of a request (drafts over [cur_len, cur_len + k))."""
        ids = np.zeros(n, np.int32)
        have = min(n, live.spec.total_len)
        ids[:have] = live.spec.token_ids[:have]
        if drafts is not None:
            ids[live.cur_len:live.cur_len + len(drafts)] = drafts
        return ids

    def _latent(self, token_ids, positions) -> np.ndarray:
        return hashed_uniform(self.cfg.seed, _KV_STREAM, token_ids, positions,
                              self.cfg.dims.head_dim_qk)

    def _queries(self, rids, positions) -> np.ndarray:
        dims = self.cfg.dims
        flat = hashed_uniform(self.cfg.seed, _Q_STREAM, rids, positions,
                              dims.num_heads * dims.head_dim_qk)
        return flat.reshape(len(rids), dims.num_heads, dims.head_dim_qk)

    def _step(self, mode, write_loc, write_tok, write_pos, batch, q_rid, q_pos, q_valid,
              oracle_keys, oracle_qlens):
        """Run one forward; returns (out [T, H, v] numpy, max rel err, kv tokens, works,
        partials)."""
        cfg = self.cfg
        rows = self._latent(write_tok, write_pos)
        rows[write_loc == 0] = 0.0  # padding writes zeros into the reserved slot 0
        q = self._queries(q_rid, q_pos)
        q[~q_valid] = 0.0
        plan_config = None
        if cfg.use_plans:
            prefill_cfg, decode_cfg = cfg.plan_configs(self.page_size)
            plan_config = prefill_cfg if mode == "extend" else decode_cfg
        f = _Forward(mode, cfg.num_draft_tokens if mode == "target_verify" else 0,
                     self.kv_capacity, cfg.max_context_len, cfg.dims, plan_config,
                     cfg.uses_pallas_decode)
        kv_pool, meta, out, works, partials = _forward(
            f, self.state.req_to_token, self.kv_pool, write_loc, rows, batch, q)
        if cfg.check:  # the value checks ignore the mode: one compiled checker per pool
            unmoded = dataclasses.replace(meta, mode="extend", num_draft_tokens=0)
            err, _ = _metadata_checker(self.spec.pool, cfg.max_context_len)(unmoded)
            err.throw()
        self.kv_pool = kv_pool
        out = np.asarray(out)
        n_q = int(q_valid.sum())
        ref = _oracle(q[:n_q], oracle_keys, oracle_qlens, cfg.dims.sm_scale, cfg.dims.v_head_dim)
        scale = max(float(np.max(np.abs(ref))), 1e-30)
        rel = float(np.max(np.abs(out[:n_q] - ref))) / scale
        kv_tokens = sum(len(k) for k in oracle_keys)
        return out, rel, kv_tokens, int(works), int(partials)

    def _record(self, live: _Live, pos: int, out_row: np.ndarray) -> None:
        k = pos - (live.spec.prompt_len - 1)
        if 0 <= k <= live.spec.output_len:
            self.outputs[live.spec.rid][k] = out_row

    def _stats(self, step, mode, batch_size, q_tokens, kv_tokens, hits, ooms, rel, works,
               partials) -> None:
        self.steps.append(StepStats(
            step=step, mode=mode, batch_size=batch_size, num_q_tokens=q_tokens,
            num_kv_tokens=kv_tokens, kv_indices_capacity=self.kv_capacity,
            pages_in_use=int(alloc.pages_in_use(self.state)),
            num_free_pages=int(alloc.num_free_pages(self.state)),
            prefix_hit_tokens=hits, oom_events=ooms, plan_works=works, plan_partials=partials,
            max_rel_err=rel,
        ))

    # -- steps
    def try_prefill(self, step: int) -> bool:
        """Admit waiting requests (FIFO) that fit the batch, the token budget and the pool."""
        cfg = self.cfg
        cands, budget = [], cfg.max_prefill_tokens
        for req in self.waiting:
            if len(self.running) + len(cands) >= cfg.max_running:
                break
            src, m = self._match(req)
            if req.prompt_len - m > budget:
                break
            cands.append((req, src, m))
            budget -= req.prompt_len - m
        ooms = 0
        while cands:
            k = len(cands)
            rows = self.free_rows[:k]
            shared = alloc.share_prefix(
                self.state, self._pad([s for _, s, _ in cands], 0), self._pad(rows, 0),
                self._pad([m for _, _, m in cands], 0), self._mask(k))
            alloc.raise_for_status(shared, "share_prefix")
            res = alloc.alloc_extend(
                shared.state, self._pad(rows, 0), self._pad([m for _, _, m in cands], 0),
                self._pad([r.prompt_len for r, _, _ in cands], 0), self._mask(k),
                capacity=cfg.max_prefill_tokens)
            if bool(res.ok):
                break
            if not bool(res.oom):
                alloc.raise_for_status(res, "alloc_extend")
            cands.pop()  # out of pages: defer the newest candidate (self.state is untouched)
            ooms += 1
        if not cands:
            return False
        self.state = res.state
        lives = []
        for (req, _, _), row in zip(cands, rows):
            self.waiting.remove(req)
            self.free_rows.remove(row)
            lives.append(_Live(req, row, req.prompt_len))
        ms = [m for _, _, m in cands]
        cap = cfg.max_prefill_tokens
        w_tok = np.concatenate([x.spec.token_ids[m:x.cur_len] for x, m in zip(lives, ms)])
        w_pos = np.concatenate([np.arange(m, x.cur_len) for x, m in zip(lives, ms)])
        q_rid = np.concatenate([np.full(x.cur_len - m, x.spec.rid) for x, m in zip(lives, ms)])
        n_tok = len(w_tok)
        batch = (self._pad(rows, 0), self._pad([x.cur_len for x in lives], 0),
                 self._pad([x.cur_len - m for x, m in zip(lives, ms)], 0))
        out, rel, kv_tokens, works, partials = self._step(
            "extend", np.asarray(res.out_cache_loc), self._pad(w_tok, 0, cap),
            self._pad(w_pos, 0, cap), batch, self._pad(q_rid, 0, cap), self._pad(w_pos, 0, cap),
            self._mask(n_tok, cap),
            [self._latent(self._tokens(x, x.cur_len), np.arange(x.cur_len)) for x in lives],
            [x.cur_len - m for x, m in zip(lives, ms)])
        k = 0
        for x, m in zip(lives, ms):
            for pos in range(m, x.cur_len):
                self._record(x, pos, out[k])
                k += 1
        self.running.extend(lives)
        self._stats(step, "extend", len(lives), n_tok, kv_tokens, sum(ms), ooms, rel, works,
                    partials)
        return True

    def decode(self, step: int) -> None:
        """One decode (or target-verify) step of every running request."""
        cfg = self.cfg
        n = cfg.num_draft_tokens
        ooms = 0
        while True:
            lives = list(self.running)
            rows = [x.row for x in lives]
            valid = self._mask(len(lives))
            if n == 0:
                res = alloc.alloc_decode(self.state, self._pad(rows, 0),
                                         self._pad([x.cur_len + 1 for x in lives], 0), valid)
            else:
                res = alloc.alloc_extend(self.state, self._pad(rows, 0),
                                         self._pad([x.cur_len for x in lives], 0),
                                         self._pad([x.cur_len + n for x in lives], 0), valid,
                                         capacity=cfg.max_running * n)
            if bool(res.ok):
                break
            if not bool(res.oom):
                alloc.raise_for_status(res, "alloc_decode")
            self._retract_last()
            ooms += 1
        self.state = res.state
        everyone = lives + [lives[0]] * (cfg.max_running - len(lives))  # padding replays row 0
        per = max(n, 1)
        cap = cfg.max_running * per
        i32 = functools.partial(np.array, dtype=np.int32)
        batch_rows = i32([x.row for x in everyone])
        if n == 0:
            mode, drafts, accepted = "decode", [None] * len(lives), []
            w_tok = [int(x.spec.token_ids[x.cur_len]) for x in lives]
            w_pos = [x.cur_len for x in lives]
            batch = (batch_rows, i32([x.cur_len + 1 for x in everyone]), i32([1] * len(everyone)))
        else:
            mode, drafts, accepted = "target_verify", [], []
            for x in lives:
                a = _accepted_drafts(cfg.seed, x.spec.rid, x.cur_len, n)
                true = self._tokens(x, x.cur_len + n)[x.cur_len:]
                wrong = (true + 1 + np.arange(n)) % cfg.vocab_size
                drafts.append(np.where(np.arange(n) <= a, true, wrong).astype(np.int32))
                accepted.append(a)
            w_tok = np.concatenate(drafts)
            w_pos = np.concatenate([np.arange(x.cur_len, x.cur_len + n) for x in lives])
            batch = (batch_rows, i32([x.cur_len for x in everyone]), i32([n] * len(everyone)))
        q_rid = np.repeat([x.spec.rid for x in lives], per)
        out, rel, kv_tokens, works, partials = self._step(
            mode, np.asarray(res.out_cache_loc), self._pad(w_tok, 0, cap), self._pad(w_pos, 0, cap),
            batch, self._pad(q_rid, 0, cap), self._pad(w_pos, 0, cap), self._mask(len(w_tok), cap),
            [self._latent(self._tokens(x, x.cur_len + per, d), np.arange(x.cur_len + per))
             for x, d in zip(lives, drafts)],
            [per] * len(lives))
        if n == 0:
            for i, x in enumerate(lives):
                self._record(x, x.cur_len, out[i])
                x.cur_len += 1
        else:
            keep = []
            for i, (x, a) in enumerate(zip(lives, accepted)):
                new_len = min(x.cur_len + 1 + a, x.spec.total_len)
                for j in range(new_len - x.cur_len):
                    self._record(x, x.cur_len + j, out[i * n + j])
                x.cur_len = new_len
                keep.append(new_len)
            # rejected drafts give their slots back (whole pages no longer touched are freed)
            tr = alloc.truncate_requests(self.state, self._pad(rows, 0), self._pad(keep, 0), valid)
            alloc.raise_for_status(tr, "truncate_requests")
            self.state = tr.state
        done = [x for x in self.running if x.cur_len >= x.spec.total_len]
        if done:
            self.running = [x for x in self.running if x not in done]
            self._free_rows([x.row for x in done])
            self.finished += len(done)
        self._stats(step, mode, len(lives), len(lives) * per, kv_tokens, 0, ooms, rel, works,
                    partials)


def _run_one(config, page_size, pool_rows, workload, progress) -> PageSizeRun:
    t0 = time.perf_counter()
    tr = _Trace(config, page_size, pool_rows, workload)
    step = 0
    while tr.finished < config.num_requests:
        if step >= config.max_steps:
            raise RuntimeError(
                f"page_size={page_size}: {tr.finished}/{config.num_requests} requests finished "
                f"after SimulationConfig.max_steps={config.max_steps} steps"
            )
        if not tr.running and not tr.waiting:
            step = max(step, tr.pending[0].arrival_step)  # idle: jump to the next arrival
        while tr.pending and tr.pending[0].arrival_step <= step:
            tr.waiting.append(tr.pending.popleft())
        prefilled = (bool(tr.waiting) and len(tr.running) < config.max_running
                     and tr.try_prefill(step))
        if not prefilled:
            if not tr.running:
                raise RuntimeError(
                    f"page_size={page_size}: the next request does not fit the empty pool "
                    f"(SimulationConfig.pool_tokens={config.pool_tokens})"
                )
            tr.decode(step)
        step += 1
        if progress is not None:
            progress(page_size, tr.finished, config.num_requests)
    missing = [rid for rid, o in tr.outputs.items() if np.isnan(o).any()]
    if missing:
        raise RuntimeError(f"page_size={page_size}: outputs never computed for {missing}")
    if int(alloc.pages_in_use(tr.state)) != 0:
        raise RuntimeError(f"page_size={page_size}: pages still in use after the last request")
    return PageSizeRun(page_size, tr.spec.num_pages, tuple(tr.steps), tr.outputs,
                       time.perf_counter() - t0)


def run_simulation(
    config: SimulationConfig = SimulationConfig(),
    page_sizes: tuple[int, ...] = (1, 16, 64),
    progress: Callable[[int, int, int], None] | None = None,
) -> SimulationResult:
    """Run the seeded trace once per page size and return per-step stats and outputs.

    `progress(page_size, finished_requests, num_requests)` is called after every step.
    Raises ValueError for a config that cannot run at a page size (pool not a whole number of
    pages, or smaller than one request), RuntimeError if a run stalls, and checkify's
    JaxRuntimeError if a metadata value check fails (`config.check`).
    """
    page_sizes = tuple(page_sizes)
    if not page_sizes:
        raise ValueError("run_simulation: page_sizes is empty")
    for page_size in page_sizes:
        config.allocator_spec(page_size)  # validate every page size before running any
    workload = make_workload(config)
    # (num_pages + 1) * page_size <= pool_rows at every page size; the same rows for any page sizes
    # up to 64, so the compiled forwards are shared between calls too.
    pool_rows = config.pool_tokens + max(64, *page_sizes)
    runs = {page_size: _run_one(config, page_size, pool_rows, workload, progress)
            for page_size in page_sizes}
    return SimulationResult(config, runs)
