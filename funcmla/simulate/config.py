"""`SimulationConfig`: the seeded workload and the serving limits of a simulated trace, checked
when built, with the allocator and planner settings derived from it per page size."""

from __future__ import annotations

import dataclasses

import jax

from funcmla import allocator as alloc
from funcmla.config import MLADims, custom_device
from funcmla.layout import check_page_size

__all__ = ["SimulationConfig"]


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
