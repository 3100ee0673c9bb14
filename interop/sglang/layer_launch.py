"""A layer's attention through the torch launchers: the `FuncMLAAttnBackend` side.

Decode-shaped steps (s_q <= 4 per request) run the decode launcher of the step's batch bucket:
`layer_launch` resolves a closure q -> out once per step key and layer (the backend caches
it), which then costs one dict lookup, out's allocation and one launch (and a copy of q into
the bucket's rows when the live batch is below it). Extend-shaped steps (an extend with a
prefix, target-verify or draft-extend with more draft tokens) run the extend launcher
(`funcmla.interop.launcher.extend`, `mla_extend` on torch's stream): `extend_launch` finds the
launcher of the step's buckets (q rows at `prefill_capacity`, requests at
`prefill_batch_capacity`, the kv_indices capacity) and the step's pseudo-sequence layout,
computed once per step for all layers (and once more inside a CUDA-graph capture, whose
replays then recompute it from the captured metadata buffers). Either returns None where its
launcher cannot run these inputs; `mla_attention` then runs the layer and records why.
"""

from __future__ import annotations

import torch

from funcmla.interop.backend_select import _launcher_reason, launcher_scale
from funcmla.interop.dlpack import FP8_DTYPES
from funcmla.interop.launcher.torch_entry import torch_extend_key

__all__ = ["layer_launch", "extend_launch"]


def layer_launch(backend, q: torch.Tensor, layer, step: tuple):
    """q -> out [T, H * v_head_dim] for the decode step key `step` (`_step_key`) and this
    layer (the cached launcher of their shapes on the layer's pool), or None where the
    launcher does not run it. The launcher is the one of the step's batch bucket (kv_indptr
    over it, the padded requests empty), so an eager step of a new batch size compiles nothing
    new: a live batch below its bucket copies q into the bucket's rows (one device copy) and
    returns the live rows of out."""
    s_q, kv_indptr, kv_indices, max_kv, indptr_full = step
    if s_q is None or kv_indices is None:
        return None
    heads, dv = layer.tp_q_head_num, layer.v_head_dim
    q3 = q.reshape(-1, heads, layer.qk_head_dim)
    t = q3.shape[0]
    if indptr_full is None or (indptr_full.shape[0] - 1) * s_q < t:
        indptr_full = kv_indptr
    t_full = (indptr_full.shape[0] - 1) * s_q
    pool = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    key = (s_q, indptr_full.shape, kv_indices.shape, max_kv, (t_full,) + q3.shape[1:],
           q3.dtype, pool.shape, pool.dtype, q3.device, dv, layer.scaling)
    entry = backend._decode_launchers.get(key)
    if entry is None:
        q_like = q3 if t_full == t else q3[:1].expand((t_full,) + q3.shape[1:])  # its shape
        entry = _resolve_decode_launcher(q_like, pool, indptr_full, kv_indices, s_q=s_q,
                                         max_kv=max_kv, layer=layer)
        backend._decode_launchers[key] = entry
    if entry is False:
        return None
    run, lse, fp8 = entry
    pad = None
    if t_full != t:  # the bucket's q rows, zeroed once and shared by the key's layers
        pad = backend._decode_q_pads.get(key)
        if pad is None:
            pad = backend._decode_q_pads[key] = q3.new_zeros((t_full, q3[0].numel()))
    pool_of, layer_id = backend.token_to_kv_pool.get_key_buffer, layer.layer_id
    # out's allocation: empty_like of a zero-memory [T, H * dv] view (one element, expanded),
    # a fresh contiguous tensor of q's dtype and device at less host cost than torch.empty
    like = torch.empty((1, 1), dtype=q3.dtype, device=q3.device).expand(t_full, heads * dv)
    empty_like, contiguous = torch.empty_like, torch.contiguous_format

    def launch(q):
        # q as it came (either shape is the same bytes); a strided q is copied, as the
        # reshape of the general path does
        q = q if q.is_contiguous() else q.contiguous()
        if pad is not None:  # the live rows into the bucket's; the rows past them belong to
            # the bucket's empty requests (out 0), so what they hold never reaches an output
            pad[:t].copy_(q.view(t, -1))
            q = pad
        out = empty_like(like, memory_format=contiguous)
        if fp8:  # the layer's scale: a float (one cached device copy) or a device tensor
            run(q, pool_of(layer_id), indptr_full, kv_indices, out=out, lse=lse,
                k_scale=launcher_scale(layer.k_scale))
        else:
            run(q, pool_of(layer_id), indptr_full, kv_indices, out=out, lse=lse)
        return out if pad is None else out[:t]

    return launch


def _resolve_decode_launcher(q3, pool, kv_indptr, kv_indices, *, s_q: int,
                             max_kv: int | None, layer):
    """(launcher, lse scratch [T, H] float32, fp8 pool?) for `layer_launch`, or False where
    the launcher does not run these inputs (`mla_attention` then runs and says why). q3: the
    launcher's q shape, dtype and device (read, never kept). The lse scratch is never
    returned: the backend's attention output is out alone."""
    if _launcher_reason(q3, (pool, kv_indptr, kv_indices), s_q=s_q) is not None:
        return False
    from funcmla.interop import launcher

    try:
        run = launcher.torch_decode_launcher(q3, pool, kv_indptr, kv_indices,
                                             sm_scale=float(layer.scaling), s_q=s_q,
                                             max_kv_len=max_kv, v_head_dim=layer.v_head_dim)
    except launcher.LauncherUnavailable:
        return False
    return (run, torch.empty(q3.shape[:2], dtype=torch.float32, device=q3.device),
            pool.dtype in FP8_DTYPES)


def _extend_launcher(q3, pool, kv_indices, *, batch: int, max_kv: int | None, layer):
    """The extend launcher of these shapes (`torch_extend_launcher`: q rows and requests
    bucketed, so eager steps of new batch sizes reuse a compiled launcher), or a string saying
    why there is none."""
    from funcmla.interop.launcher import LauncherUnavailable, torch_extend_launcher

    try:
        return torch_extend_launcher(q3, pool, kv_indices, batch=batch,
                                     sm_scale=float(layer.scaling), max_kv_len=max_kv,
                                     v_head_dim=layer.v_head_dim)
    except LauncherUnavailable as err:
        return f"the extend launcher is unavailable: {err}"
    except (ValueError, TypeError, RuntimeError) as err:  # a shape or dtype it does not take
        return f"the extend launcher does not take these inputs: {err}"


def extend_launch(backend, q: torch.Tensor, layer, step: tuple) -> torch.Tensor | None:
    """out [T, H * v_head_dim] of an extend-shaped step through the extend launcher, or None
    (`backend.last_launcher_reason` says why). The step's layout is kept until the next
    step's metadata (the forward_metadata setter drops it) and recomputed once inside a CUDA
    graph capture."""
    _, kv_indptr, kv_indices, max_kv, _ = step
    fm = backend.forward_metadata
    if kv_indices is None:
        backend.last_launcher_reason = "no kv_indices view of the step's capacity"
        return None
    heads = layer.tp_q_head_num
    q3 = q.reshape(-1, heads, layer.qk_head_dim)
    pool = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    batch = fm.qo_indptr.shape[0] - 1  # the live batch: the views are cut to it
    # the extend launcher's own key (its buckets): a failure is kept under it too
    key = ("extend",) + torch_extend_key(q3, pool, kv_indices, batch=batch,
                                         sm_scale=float(layer.scaling), max_kv_len=max_kv,
                                         v_head_dim=layer.v_head_dim)
    launcher = backend._decode_launchers.get(key)
    if launcher is None:
        launcher = _extend_launcher(q3, pool, kv_indices, batch=batch, max_kv=max_kv,
                                    layer=layer)
        backend._decode_launchers[key] = launcher
    if isinstance(launcher, str):
        backend.last_launcher_reason = launcher
        return None
    capturing = q3.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = backend._ext_step
    if cached is not None and cached[0] is launcher and cached[1] == capturing:
        layout = cached[2]
    else:
        layout = launcher.layout(fm.qo_indptr, kv_indptr, kv_indices, num_q=q3.shape[0])
        backend._ext_step = (launcher, capturing, layout)
    q3 = q3 if q3.is_contiguous() else q3.contiguous()
    scale = launcher_scale(layer.k_scale) if pool.dtype in FP8_DTYPES else None
    out, _ = launcher(q3, pool, layout, k_scale=scale, return_lse=False)
    backend.last_launcher_reason = None
    return out.reshape(q3.shape[0], heads * layer.v_head_dim)
