"""The persistent-kernel work plan SGLang's aiter backend puts in `ForwardMetadata`, built by
funcmla's planners inside the step's jitted metadata program.

What SGLang's `aiter_backend.py` does, and what is reproduced here:

* decode-like modes (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2): `get_mla_metadata_v1` over
  (qo_indptr, kv_indptr, ones) with `num_heads = num_head_padded` (16 below 16 heads),
  `kv_granularity = max(page_size, 16)` on token-granular indptrs (page_size 1 for the planner),
  `max_seqlen_qo = uni_seqlen_qo = max_q_len`, not causal, `max_split_per_batch` 64 without
  speculative decoding and 32 with it; buffers from `get_mla_metadata_info_v1` sized for the
  step's batch (eager) or for `max_bs` and `max(1, num_draft_tokens)` queries (CUDA graphs).
  funcmla's planner is AITER's fast mode (v1.2); SGLang's 16-head bf16 default runs the
  non-persistent kernel instead, so `persistent_plan` says whether to build a plan at all.
* extend (EXTEND, MIXED): the token-granular PS prefill plan (`get_ps_metadata_v1`, block_size
  1, kvlen_granularity 128, qlen_granularity 256, causal) over (qo_indptr, kv_indptr,
  seq_lens) for the MHA prefill's heads (`fp8_prefill_num_head`, the smallest head count of
  AITER's mla_reduce_v1 set >= H, as kv heads with gqa 1), sized by
  `get_ps_metadata_info_v1(bs, num_head_k, max_q_len, 256)`, plus
  `fp8_prefill_kv_indices = arange(seq_lens_sum)`.
* `work_metadata` holds two uint64 device pointers: `[&work_indptr, &work_info_set]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from funcmla.config import H200, DeviceProfile
from funcmla.planners import (
    DecodePlanConfig,
    PrefillPlanConfig,
    mla_decode_plan_sizes,
    plan_mla_decode,
    plan_ps_prefill,
    ps_prefill_plan_sizes,
)

__all__ = ["PLAN_FIELDS", "PlanSettings", "device_profile_of", "plan_shapes", "plan_arrays"]

# ForwardMetadata's plan fields, in the packed buffer's order (work_metadata is separate).
PLAN_FIELDS = ("work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
               "reduce_partial_map")
# AITER's mla_reduce_v1 head counts for a 128-wide v head (SGLang's _MLA_REDUCE_V1_HEADS[128]).
_PREFILL_HEADS = (1, 2, 4, 8, 10, 16, 32, 40, 64, 128)


def device_profile_of(device) -> DeviceProfile:
    """The planner's device (arch, CU count) for a torch device: the real SM / CU count on a
    GPU (SGLang passes the device's multiprocessor count); the H200 profile on the CPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return H200
    props = torch.cuda.get_device_properties(dev)
    gcn = getattr(props, "gcnArchName", "") or ""
    arch = "gfx950" if "gfx950" in gcn else "gfx942" if gcn.startswith("gfx") else "sm90"
    return DeviceProfile(props.name, arch, int(props.multi_processor_count))


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """Static inputs of the plans (hashable: part of the jitted step's static spec).

    num_heads: the layer's tp_q_head_num; kv_dtype: "bf16" or "fp8" (what the kernel sees);
    page_size: the allocator's (only sets kv_granularity); num_draft_tokens: 0 without
    speculative decoding."""

    device: DeviceProfile
    num_heads: int
    kv_dtype: str = "bf16"
    page_size: int = 1
    num_draft_tokens: int = 0

    def __post_init__(self):
        self.decode_config(max(1, self.num_draft_tokens))  # raises naming the field if invalid

    @property
    def num_heads_padded(self) -> int:
        return 16 if self.num_heads < 16 else self.num_heads

    @property
    def max_split_per_batch(self) -> int:
        return 32 if self.num_draft_tokens else 64

    @property
    def prefill_num_heads(self) -> int | None:
        return next((h for h in _PREFILL_HEADS if h >= self.num_heads), None)

    def decode_config(self, max_q_len: int) -> DecodePlanConfig:
        return DecodePlanConfig(
            device=self.device, num_heads=self.num_heads_padded, q_dtype=self.kv_dtype,
            kv_dtype=self.kv_dtype, max_seqlen_qo=max_q_len, uni_seqlen_qo=max_q_len,
            page_size=1, kv_granularity=max(self.page_size, 16),
            max_split_per_batch=self.max_split_per_batch, is_causal=False)

    def prefill_config(self, max_qlen: int) -> PrefillPlanConfig | None:
        heads = self.prefill_num_heads
        if heads is None:
            return None
        return PrefillPlanConfig(device=self.device, num_heads_k=heads, gqa_ratio=1,
                                 max_qlen=max_qlen)


@functools.lru_cache(maxsize=4096)  # per step on the host path: computed once per shape
def plan_shapes(settings: PlanSettings, kind: str, batch: int, max_q_len: int) -> dict | None:
    """Shapes of the plan fields as SGLang sizes them for `batch` requests of at most
    `max_q_len` queries (None: no plan for this kind / head count)."""
    if kind == "extend":
        cfg = settings.prefill_config(max_q_len)
        if cfg is None:
            return None
        s = ps_prefill_plan_sizes(batch, max_q_len, config=cfg)
        return dict(work_indptr=(s.num_cu + 1,), work_info_set=(s.max_works, 8),
                    reduce_indptr=(s.num_tiles + 1,), reduce_final_map=(s.num_tiles, 2),
                    reduce_partial_map=(s.max_partials,))
    s = mla_decode_plan_sizes(batch, settings.decode_config(max_q_len))
    return dict(work_indptr=s.work_indptr, work_info_set=s.work_info,
                reduce_indptr=s.reduce_indptr, reduce_final_map=s.reduce_final_map,
                reduce_partial_map=s.reduce_partial_map)


def plan_arrays(settings: PlanSettings, kind: str, qo_indptr, kv_indptr, kv_lens, live, *,
                max_q_len: int) -> dict[str, jax.Array]:
    """The plan of the live requests [0, live) of padded indptrs (JAX, jit-able).

    qo_indptr, kv_indptr: int32 [Bp + 1] (padded requests empty); kv_lens: int32 [Bp];
    live: int32 []; max_q_len: static (decode: queries per request; extend: the bucket)."""
    batch = kv_indptr.shape[0] - 1
    if kind == "extend":
        plan = plan_ps_prefill(qo_indptr, kv_indptr, kv_lens,
                               config=settings.prefill_config(max_q_len))
    else:
        plan = plan_mla_decode(qo_indptr, kv_indptr, jnp.ones((batch,), jnp.int32),
                               config=settings.decode_config(max_q_len), batch_size=batch,
                               num_requests=live)
    return dict(work_indptr=plan.work_indptr, work_info_set=plan.work_info,
                reduce_indptr=plan.reduce_indptr, reduce_final_map=plan.reduce_final_map,
                reduce_partial_map=plan.reduce_partial_map)
