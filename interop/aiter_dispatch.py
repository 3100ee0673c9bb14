"""Thin wrappers that run AITER's MLA kernels on funcmla metadata and work plans (ROCm only).

CONTRACT-TESTED ONLY. No ROCm machine was available to this project: these wrappers have never
launched an AITER kernel. What the tests establish (tests/test_interop_aiter.py) is the argument
contract, checked against the signatures documented for the pinned AITER commit: argument names
and order, shapes, dtypes, strides and devices, with a fake `aiter` module that records the
calls. Verify on an MI300X / MI355X before relying on them.

Pinned AITER: ROCm/aiter @ e4048607a535ace3a2b51ded31b1c8c2d45c0879 (2026-08-22; for every MLA
metadata, reduce and `mla.py` file byte-identical to tag v0.1.20.post1). The PyPI wheel
`amd-aiter==0.1.7.post2.dev18` has different signatures and is not supported.

The call conventions (`aiter/mla.py`, `aiter/ops/attention.py` at the pinned commit; SGLang's
`aiter_backend.py`):

* every index tensor is int32, contiguous, on the kernel's device;
* the KV pool is presented as the page-1 view `[slots, 1, 1, 576]` (`page_size=1`,
  `nhead_kv=1`), with token-slot `kv_indices` and token-granular `kv_indptr` (AITER's bf16
  kernels ignore page_size > 1, aiter#2996 / #3095);
* `work_meta_data` is a uint64 [2] device tensor holding the device addresses of
  `work_indptr` and `work_info_set` (AITER's planner would write them; a JAX planner cannot);
* `num_kv_splits` is always passed (without it, gfx950 bf16 16-head decode at batch >= 32
  silently drops persistent mode, aiter `mla.py:585-590`);
* fp8 queries need `q_scale` and `kv_scale` as float32 [1] device tensors;
* the prefill PS plan must be token-granular (`block_size == 1`): the PS kernel reads linear
  per-token K/V (the seed's first bug was a plan counted in pages).

`amd-aiter` is imported lazily; without ROCm or without the package, `load_aiter` raises
`AiterUnavailable` saying what is missing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import torch

from funcmla.interop.dlpack import to_torch
from funcmla.interop.packed import PackedLayout
from funcmla.planners.plan import WorkPlan

__all__ = [
    "AITER_COMMIT",
    "AITER_VERSION",
    "AiterUnavailable",
    "AiterWorkPlan",
    "load_aiter",
    "aiter_available",
    "work_meta_data",
    "export_work_plan",
    "mla_decode",
    "mla_prefill",
    "mla_prefill_ps",
    "PS_TILE_Q",
]

AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
AITER_VERSION = "v0.1.20.post1"
PS_TILE_Q = 256  # rows per partial tile of the PS prefill kernel (the reduce's max_seqlen_q)

# Device types the kernels accept. ROCm torch names HIP devices "cuda". The contract tests add
# "cpu" here, because they check the argument contract with CPU tensors.
KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


class AiterUnavailable(RuntimeError):
    """AITER cannot run here (no ROCm torch, or amd-aiter not installed)."""


def load_aiter():
    """Import and return the `aiter` module, or raise AiterUnavailable naming what is missing."""
    if getattr(torch.version, "hip", None) is None:
        raise AiterUnavailable(
            f"AITER needs ROCm: this torch ({torch.__version__}) is not a ROCm build "
            "(torch.version.hip is None). Install a ROCm torch and amd-aiter built from "
            f"ROCm/aiter@{AITER_COMMIT[:12]} ({AITER_VERSION}) on an MI300X/MI355X machine."
        )
    try:
        import aiter  # noqa: F401  (PyPI `amd-aiter`; the PyPI `aiter` is unrelated)
        import aiter.mla  # noqa: F401
    except ImportError as err:
        raise AiterUnavailable(
            f"amd-aiter is not importable ({err}); install it from ROCm/aiter@{AITER_COMMIT[:12]} "
            f"({AITER_VERSION}): git clone --recursive, then `python3 setup.py develop`"
        ) from err
    return aiter


def aiter_available() -> bool:
    """True if `load_aiter()` would succeed (ROCm torch and amd-aiter importable)."""
    try:
        load_aiter()
    except AiterUnavailable:
        return False
    return True


# ---- argument checks -------------------------------------------------------------------------

def _check(name: str, t, *, dtype=None, ndim=None, shape=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(map(str, allowed))
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; dim {i} must be {want}")
        if len(shape) != t.dim():
            raise ValueError(f"{name} must be {len(shape)}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the kernel runs on {device}")


def _check_device(q: torch.Tensor) -> torch.device:
    if q.device.type not in KERNEL_DEVICE_TYPES:
        raise ValueError(
            f"AITER kernels run on a ROCm GPU (torch device 'cuda'); q is on {q.device}"
        )
    return q.device


def _scale(name: str, value, device) -> torch.Tensor | None:
    """A float or a float32 [1] tensor -> float32 [1] tensor on `device` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        _check(name, value, dtype=torch.float32, shape=(1,), device=device)
        return value
    return torch.tensor([float(value)], dtype=torch.float32, device=device)


def _kv_page1_view(kv_pool: torch.Tensor, width: int) -> torch.Tensor:
    """[slots, W], [slots, 1, W] or [slots, 1, 1, W] (contiguous) -> [slots, 1, 1, W] view."""
    if kv_pool.shape[-1] != width or any(d != 1 for d in kv_pool.shape[1:-1]) or kv_pool.dim() > 4:
        raise ValueError(
            f"kv_pool must be [slots, {width}], [slots, 1, {width}] or [slots, 1, 1, {width}] "
            f"(one latent row per token slot), got {tuple(kv_pool.shape)}"
        )
    if not kv_pool.is_contiguous():
        raise ValueError(f"kv_pool must be contiguous, got strides {tuple(kv_pool.stride())}")
    return kv_pool.view(-1, 1, 1, width)


def _check_token_metadata(meta, *, num_q: int, device) -> int:
    """Check the token-granular CSR of `meta`; return the batch size."""
    _check("qo_indptr", meta.qo_indptr, dtype=torch.int32, ndim=1, device=device)
    batch = meta.qo_indptr.shape[0] - 1
    _check("kv_indptr", meta.kv_indptr, dtype=torch.int32, shape=(batch + 1,), device=device)
    _check("kv_indices", meta.kv_indices, dtype=torch.int32, ndim=1, device=device)
    _check("kv_last_page_len", meta.kv_last_page_len, dtype=torch.int32, shape=(batch,),
           device=device)
    if num_q <= 0:
        raise ValueError(f"q has no rows ({num_q})")
    return batch


# ---- work plans ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AiterWorkPlan:
    """A funcmla WorkPlan as the torch tensors AITER reads, plus `work_meta_data`.

    work_meta_data:     uint64 [2]  = [work_indptr.data_ptr(), work_info_set.data_ptr()]
    work_indptr:        int32 [num_cu + 1]
    work_info_set:      int32 [max_work, 8]
    reduce_indptr:      int32 [num_tiles + 1]
    reduce_final_map:   int32 [num_tiles, 2]
    reduce_partial_map: int32 [max_partials]
    kind, block_size:   copied from the WorkPlan's static fields.
    """

    work_meta_data: torch.Tensor
    work_indptr: torch.Tensor
    work_info_set: torch.Tensor
    reduce_indptr: torch.Tensor
    reduce_final_map: torch.Tensor
    reduce_partial_map: torch.Tensor
    kind: str
    block_size: int = 1

    @classmethod
    def from_tensors(cls, *, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
                     reduce_partial_map, kind: str, block_size: int = 1) -> "AiterWorkPlan":
        """Wrap existing int32 tensors (e.g. static CUDA-graph buffers); fills work_meta_data."""
        device = work_indptr.device
        _check("work_indptr", work_indptr, dtype=torch.int32, ndim=1, device=device)
        _check("work_info_set", work_info_set, dtype=torch.int32, shape=(None, 8), device=device)
        _check("reduce_indptr", reduce_indptr, dtype=torch.int32, ndim=1, device=device)
        tiles = reduce_indptr.shape[0] - 1
        _check("reduce_final_map", reduce_final_map, dtype=torch.int32, shape=(tiles, 2),
               device=device)
        _check("reduce_partial_map", reduce_partial_map, dtype=torch.int32, ndim=1, device=device)
        if kind not in ("decode", "prefill"):
            raise ValueError(f"kind must be 'decode' or 'prefill', got {kind!r}")
        return cls(work_meta_data(work_indptr, work_info_set), work_indptr, work_info_set,
                   reduce_indptr, reduce_final_map, reduce_partial_map, kind, block_size)


def _check_absorbed_call(q, kv_pool, meta, out, num_kv_splits, v_head_dim, *, dtypes):
    """Checks shared by the absorbed-MLA wrappers: q [T, H, 576] and the pool in `dtypes`, the
    page-1 pool view, token metadata, out (allocated if None, bf16 [T, H, v_head_dim]) and
    num_kv_splits. Returns (device, kv page-1 view, out)."""
    device = _check_device(q)
    _check("q", q, dtype=dtypes, ndim=3, device=device)
    num_q, num_heads, width = q.shape
    kv = _kv_page1_view(kv_pool, width)
    _check("kv_pool", kv, dtype=dtypes, device=device)
    _check_token_metadata(meta, num_q=num_q, device=device)
    if out is None:
        out = torch.empty((num_q, num_heads, v_head_dim), dtype=torch.bfloat16, device=device)
    _check("out", out, dtype=torch.bfloat16, shape=(num_q, num_heads, v_head_dim), device=device)
    if not isinstance(num_kv_splits, int) or isinstance(num_kv_splits, bool) or num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be a positive int, got {num_kv_splits!r}")
    return device, kv, out


def work_meta_data(work_indptr: torch.Tensor, work_info_set: torch.Tensor) -> torch.Tensor:
    """uint64 [2] on their device: the two device addresses the persistent kernel reads.

    The addresses stay valid as long as both tensors (or their base buffer) live; for static
    CUDA-graph buffers build it once.
    """
    if work_indptr.device != work_info_set.device:
        raise ValueError(
            f"work_indptr ({work_indptr.device}) and work_info_set ({work_info_set.device}) "
            "must be on one device"
        )
    return torch.tensor([work_indptr.data_ptr(), work_info_set.data_ptr()], dtype=torch.uint64,
                        device=work_indptr.device)


def _plan_layout(plan: WorkPlan) -> PackedLayout:
    return PackedLayout.of(
        work_indptr=tuple(plan.work_indptr.shape),
        work_info_set=tuple(plan.work_info.shape),
        reduce_indptr=tuple(plan.reduce_indptr.shape),
        reduce_final_map=tuple(plan.reduce_final_map.shape),
        reduce_partial_map=tuple(plan.reduce_partial_map.shape),
    )


@functools.partial(jax.jit, static_argnames=("layout",))
def _pack_plan(plan: WorkPlan, layout: PackedLayout) -> jax.Array:
    return layout.pack(dict(
        work_indptr=plan.work_indptr,
        work_info_set=plan.work_info,
        reduce_indptr=plan.reduce_indptr,
        reduce_final_map=plan.reduce_final_map,
        reduce_partial_map=plan.reduce_partial_map,
    ))


def export_work_plan(plan: WorkPlan) -> AiterWorkPlan:
    """Move a funcmla WorkPlan to torch in one DLPack crossing (packed int32, views)."""
    if not isinstance(plan, WorkPlan):
        raise TypeError(f"expected a funcmla WorkPlan, got {type(plan).__name__}")
    layout = _plan_layout(plan)
    buf = to_torch(_pack_plan(plan, layout))
    views = layout.torch_views(buf)
    return AiterWorkPlan.from_tensors(**views, kind=plan.kind, block_size=plan.block_size)


def _check_plan(plan: AiterWorkPlan, *, kind: str, device) -> None:
    if not isinstance(plan, AiterWorkPlan):
        raise TypeError(f"plan must be an AiterWorkPlan (see export_work_plan), got {type(plan)}")
    if plan.kind != kind:
        raise ValueError(f"plan.kind is {plan.kind!r}, this kernel needs a {kind!r} plan")
    if plan.block_size != 1:
        raise ValueError(
            f"plan.block_size is {plan.block_size}; AITER's MLA kernels read token-granular "
            "kv_indptr/kv_indices (page-1 view), so the plan must count tokens (block_size=1). "
            "A plan counted in pages is the seed's prefill bug (sglang #25556)."
        )
    for name in ("work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map",
                 "reduce_partial_map"):
        t = getattr(plan, name)
        _check(f"plan.{name}", t, dtype=torch.int32, device=device)
    _check("plan.work_meta_data", plan.work_meta_data, dtype=torch.uint64, shape=(2,),
           device=device)
    if device.type == "cuda" and torch.cuda.is_available():
        num_cu = torch.cuda.get_device_properties(device).multi_processor_count
        if plan.work_indptr.shape[0] - 1 != num_cu:
            raise ValueError(
                f"plan.work_indptr has {plan.work_indptr.shape[0] - 1} compute units, the device "
                f"has {num_cu}; plan with the matching DeviceProfile"
            )


# ---- kernels ---------------------------------------------------------------------------------

def mla_decode(
    q: torch.Tensor,  # [T, H, 576] bf16 or fp8
    kv_pool: torch.Tensor,  # [slots, 576] / [slots, 1, 576] / [slots, 1, 1, 576], bf16 or fp8
    meta,  # qo_indptr, kv_indptr, kv_indices, kv_last_page_len (int32 tensors), max_q_len (int)
    plan: AiterWorkPlan | None,
    *,
    sm_scale: float,
    num_kv_splits: int,
    v_head_dim: int = 512,
    q_scale=None,
    kv_scale=None,
    intra_batch_mode: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`aiter.mla.mla_decode_fwd` on token-granular metadata -> (o [T, H, v_head_dim], lse).

    `plan` is a decode work plan (persistent kernel) or None (AITER's non-persistent kernel).
    Heads must already be padded to a count AITER supports (16..128; SGLang pads 4/8/12 to 16).
    Contract-tested only (module docstring).
    """
    device, kv, out = _check_absorbed_call(q, kv_pool, meta, out, num_kv_splits, v_head_dim,
                                           dtypes=(torch.bfloat16,) + _FP8)
    if q.dtype in _FP8 and (q_scale is None or kv_scale is None):
        raise ValueError("fp8 q needs q_scale and kv_scale (float32 [1]); got "
                         f"q_scale={q_scale!r}, kv_scale={kv_scale!r}")
    q_scale_t = _scale("q_scale", q_scale, device)
    kv_scale_t = _scale("kv_scale", kv_scale, device)
    work = {}
    if plan is not None:
        _check_plan(plan, kind="decode", device=device)
        work = dict(
            work_meta_data=plan.work_meta_data,
            work_indptr=plan.work_indptr,
            work_info_set=plan.work_info_set,
            reduce_indptr=plan.reduce_indptr,
            reduce_final_map=plan.reduce_final_map,
            reduce_partial_map=plan.reduce_partial_map,
        )
    aiter = load_aiter()
    _, lse = aiter.mla.mla_decode_fwd(
        q, kv, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
        int(meta.max_q_len),
        page_size=1,
        nhead_kv=1,
        sm_scale=float(sm_scale),
        logit_cap=0.0,
        num_kv_splits=num_kv_splits,
        **work,
        q_scale=q_scale_t,
        kv_scale=kv_scale_t,
        intra_batch_mode=bool(intra_batch_mode),
    )
    return out, lse


def mla_prefill(
    q: torch.Tensor,  # [T, H, 576] bf16
    kv_pool: torch.Tensor,  # [slots, 576] / [slots, 1, 576] / [slots, 1, 1, 576] bf16
    meta,  # qo_indptr, kv_indptr, kv_indices, kv_last_page_len, max_q_len
    *,
    sm_scale: float,
    num_kv_splits: int,
    v_head_dim: int = 512,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`aiter.mla.mla_prefill_fwd` (absorbed, non-persistent, bf16) -> o [T, H, v_head_dim].

    Bottom-right causal over each request's prefix + new tokens. Contract-tested only.
    """
    device, kv, out = _check_absorbed_call(q, kv_pool, meta, out, num_kv_splits, v_head_dim,
                                           dtypes=torch.bfloat16)
    aiter = load_aiter()
    aiter.mla.mla_prefill_fwd(
        q, kv, out, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
        int(meta.max_q_len),
        sm_scale=float(sm_scale),
        logit_cap=0.0,
        num_kv_splits=num_kv_splits,
    )
    return out


def mla_prefill_ps(
    q: torch.Tensor,  # [T, Hq, Dqk] fp8 (Dqk = 192 for DeepSeek's MHA prefill)
    k: torch.Tensor,  # [N, Hkv, Dqk] fp8, linear tokens in kv_indptr order
    v: torch.Tensor,  # [N, Hkv, Dv] fp8
    qo_indptr: torch.Tensor,  # int32 [B + 1]
    kv_indptr: torch.Tensor,  # int32 [B + 1]  tokens
    kv_page_indices: torch.Tensor,  # int32 [N]  token indices into k/v (arange(N) when linear)
    plan: AiterWorkPlan,  # prefill plan, block_size 1
    *,
    max_seqlen_q: int,
    softmax_scale: float,
    is_causal: bool = True,
    q_scale=1.0,
    k_scale=1.0,
    v_scale=1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent fp8 prefill (`aiter.mla_prefill_ps_asm_fwd`) then `aiter.mla_reduce_v1`.

    Returns (output bf16 [T, Hq, Dv], final_lse fp32 [T, Hq]). Partial buffers are sized from
    the plan: `reduce_partial_map.shape[0] * 256` rows. gfx950 only. Contract-tested only.
    """
    device = _check_device(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(name, t, dtype=_FP8, ndim=3, device=device)
    num_q, num_heads, dqk = q.shape
    num_kv, num_kv_heads, dv = v.shape
    _check("k", k, shape=(num_kv, num_kv_heads, dqk))
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads})")
    _check("qo_indptr", qo_indptr, dtype=torch.int32, ndim=1, device=device)
    batch = qo_indptr.shape[0] - 1
    _check("kv_indptr", kv_indptr, dtype=torch.int32, shape=(batch + 1,), device=device)
    _check("kv_page_indices", kv_page_indices, dtype=torch.int32, ndim=1, device=device)
    _check_plan(plan, kind="prefill", device=device)
    scales = [_scale(n, s, device) for n, s in
              (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))]
    if any(s is None for s in scales):
        raise ValueError("the fp8 PS prefill kernel needs q_scale, k_scale and v_scale")
    rows = plan.reduce_partial_map.shape[0] * PS_TILE_Q
    logits = torch.empty((rows, num_heads, dv), dtype=torch.float32, device=device)
    attn_lse = torch.empty((rows, num_heads), dtype=torch.float32, device=device)
    output = torch.empty((num_q, num_heads, dv), dtype=torch.bfloat16, device=device)
    final_lse = torch.empty((num_q, num_heads), dtype=torch.float32, device=device)
    aiter = load_aiter()
    aiter.mla_prefill_ps_asm_fwd(
        q, k, v, qo_indptr, kv_indptr, kv_page_indices, plan.work_indptr, plan.work_info_set,
        int(max_seqlen_q), float(softmax_scale), bool(is_causal), logits, attn_lse, output,
        *scales,
    )
    aiter.mla_reduce_v1(
        logits, attn_lse, plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map,
        PS_TILE_Q, 0, output, final_lse,
    )
    return output, final_lse
