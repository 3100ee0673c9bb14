"""One simulated forward step on device: write the step's latent rows into the pool, build the
metadata, attend (reference, work plan + executor, or the Pallas decode kernel); and the
jitted, checkified validator of a step's metadata.

`Forward` holds the step's static choices, hashable so that it can be a jit static argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from funcmla import metadata as md
from funcmla.attention.reference import mla_attention_reference
from funcmla.checks import check_metadata, check_page_contiguity, checked
from funcmla.config import MLADims
from funcmla.layout import PoolSpec

__all__ = ["Forward", "forward", "metadata_checker"]


@dataclasses.dataclass(frozen=True)
class Forward:
    """A step's static choices: mode, draft tokens, kv_indices capacity, KV span, dimensions,
    plan config and kernel."""

    mode: str  # "extend" | "decode" | "target_verify"
    num_draft_tokens: int
    kv_capacity: int
    max_context_len: int
    dims: MLADims
    plan_config: object | None  # PrefillPlanConfig (extend) / DecodePlanConfig; None: no plans
    pallas: bool = False  # decode / verify through the Pallas kernel (interpret off-GPU)


def _attend_with_plan(f: Forward, q, kv_pool, meta):
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
def _attend_with_pallas(f: Forward, q, kv_pool, meta):
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


def forward(f: Forward, req_to_token: jax.Array, kv_pool: jax.Array, write_loc: np.ndarray,
            write_rows: np.ndarray, batch: tuple[np.ndarray, np.ndarray, np.ndarray],
            q: np.ndarray) -> tuple[jax.Array, md.ForwardMetadata, jax.Array, jax.Array,
                                    jax.Array]:
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
def metadata_checker(pool: PoolSpec, max_context_len: int) -> Callable:
    """A jitted, checkified validator of one step's metadata for one pool."""

    def check(meta):
        check_metadata(meta, pool=pool, max_context_len=max_context_len)
        check_page_contiguity(meta.kv, page_size=pool.page_size)

    return jax.jit(checked(check))
