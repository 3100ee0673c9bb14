"""The per-step metadata program: metadata + work plan, packed into one int32 buffer.

One jitted program per `StepSpec` (mode, batch bucket, token buckets): the step's inputs arrive
as one int32 vector (padded to the bucket, live count last), the program builds funcmla's
metadata for the padded batch with the padded requests empty, the work plan of the live
requests, and packs everything (`funcmla.interop.packed`) so it leaves JAX as one array.

inputs: int32 [k * B + (k * (Bp - B) + 1)] = req_pool_indices[:B] | seq_lens[:B]
        [| extend_seq_lens[:B]] | filler, whose last element is B (the live count). Entries past
        B of each part are masked in the program, so the filler's values never matter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from funcmla.interop.packed import PackedLayout
from funcmla.interop.sglang.workplan import PLAN_FIELDS, PlanSettings, plan_arrays, plan_shapes
from funcmla.metadata import build_metadata, draft_keys

__all__ = ["StepSpec", "build_step", "step_layout", "num_parts"]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of one compiled metadata program.

    kind:      "decode" | "extend" | "target_verify" | "draft_extend".
    batch:     the batch bucket Bp (requests the buffers are laid out for).
    capacity:  kv_indices entries (tokens; the KV token bucket or the CUDA-graph capacity).
    n:         draft tokens per request (target_verify / draft_extend), else 0.
    max_q_len: extend: the query-length bucket; others: queries per request.
    plan:      PlanSettings, or None for no work plan.
    plan_shapes_override: CUDA graphs: the static plan buffer shapes (plans are zero-padded to
               them), else None (the shapes of the bucket's own plan).
    """

    kind: str
    batch: int
    capacity: int
    n: int = 0
    max_q_len: int = 1
    plan: PlanSettings | None = None
    plan_shapes_override: tuple | None = None

    @property
    def plan_shapes(self) -> dict | None:
        if self.plan is None:
            return None
        if self.plan_shapes_override is not None:
            return dict(self.plan_shapes_override)
        return plan_shapes(self.plan, self.kind, self.batch, self.max_q_len)


def num_parts(kind: str) -> int:
    return 3 if kind == "extend" else 2


@functools.lru_cache(maxsize=1024)  # one layout object per spec: its offsets are cached on it
def step_layout(spec: StepSpec) -> PackedLayout:
    b, fields = spec.batch, {}
    fields.update(kv_indptr=(b + 1,), kv_indices=(spec.capacity,), qo_indptr=(b + 1,),
                  kv_last_page_len=(b,), max_q_len=(), max_kv_len=())
    shapes = spec.plan_shapes
    if shapes is not None:
        fields.update({name: tuple(shapes[name]) for name in PLAN_FIELDS})
        if spec.kind == "extend":
            fields["fp8_prefill_kv_indices"] = (spec.capacity,)
    return PackedLayout.of(**fields)


def _unpack_inputs(inputs, spec: StepSpec):
    """(req_pool_indices, seq_lens, extend_seq_lens | None, live) of the padded batch; padded
    requests are row 0 with no KV (and no queries)."""
    bp, k = spec.batch, num_parts(spec.kind)
    live = inputs[-1]
    mask = jnp.arange(bp, dtype=jnp.int32) < live
    part = lambda i: jax.lax.dynamic_slice(inputs, (i * live,), (bp,))  # noqa: E731
    rpi = jnp.where(mask, part(0), 0)
    # a request reads seq_lens + draft_keys (target verify: n) keys; a padded one gets
    # -draft_keys so that it reads none
    pad_seq = -draft_keys(spec.kind, spec.n)
    seq = jnp.where(mask, part(1), pad_seq)
    ext = jnp.where(mask, part(2), 0) if k == 3 else None
    return rpi, seq, ext, live, mask


def _metadata(req_to_token, rpi, seq, ext, mask, spec: StepSpec):
    n = spec.n
    meta = build_metadata(spec.kind, req_to_token, rpi, seq, ext, capacity=spec.capacity,
                          num_draft_tokens=n)
    if spec.kind in ("target_verify", "draft_extend", "decode"):
        # padded requests get no queries either (qo_indptr flat past the live batch)
        q = 1 if spec.kind == "decode" else n
        qo = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              jnp.cumsum(jnp.where(mask, q, 0), dtype=jnp.int32)])
        meta = dataclasses.replace(meta, qo_indptr=qo)
    return meta


@functools.partial(jax.jit, static_argnames=("spec",))
def build_step(req_to_token, inputs, *, spec: StepSpec):
    """-> (funcmla ForwardMetadata of the padded batch, packed int32 buffer of step_layout)."""
    rpi, seq, ext, live, mask = _unpack_inputs(inputs, spec)
    meta = _metadata(req_to_token, rpi, seq, ext, mask, spec)
    fields = dict(kv_indptr=meta.kv_indptr, kv_indices=meta.kv_indices,
                  qo_indptr=meta.qo_indptr, kv_last_page_len=meta.kv_last_page_len,
                  max_q_len=meta.max_q_len, max_kv_len=meta.max_kv_len)
    shapes = spec.plan_shapes
    if shapes is not None:
        kv_lens = meta.kv_indptr[1:] - meta.kv_indptr[:-1]
        plan = plan_arrays(spec.plan, spec.kind, meta.qo_indptr, meta.kv_indptr, kv_lens, live,
                           max_q_len=spec.max_q_len)
        for name in PLAN_FIELDS:
            fields[name] = _pad_to(plan[name], tuple(shapes[name]))
        if spec.kind == "extend":
            fields["fp8_prefill_kv_indices"] = jnp.arange(spec.capacity, dtype=jnp.int32)
    return meta, step_layout(spec).pack(fields)


def _pad_to(x, shape):
    if x.shape == shape:
        return x
    if any(a > b for a, b in zip(x.shape, shape)):
        raise ValueError(f"plan field of shape {x.shape} does not fit the static {shape}")
    return jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, shape)])
