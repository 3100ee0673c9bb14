"""SGLang's MHA extend for MLA models (DeepSeek's `attn_mha`), run by funcmla.

In SGLang, an extend without speculation runs multi-head attention on decompressed heads: the
model writes the step's latent rows to the pool itself and calls the backend with
`save_kv_cache=False`, q and k `[T, H, 192]` (128 nope + 64 rope), v `[T, H, 128]`,
`num_kv_heads = H`, `layer.qk_head_dim = 192` (not the pool's 576). What the attention covers
is the AITER backend's MLA-MHA path (docs/sglang_backend.md):

* no request has a prefix (`kv_indptr == qo_indptr`): causal attention over the new tokens,
  with the q, k and v the model passed;
* a prefix somewhere: k and v of every token of each sequence (prefix and new) come from the
  latent pool, `pool[kv_indices]` split into the compressed 512 columns and the 64 rope columns,
  the compressed part through `layer.kv_b_proj` (k_nope 128 and v 128 per head), k = k_nope
  with the rope columns broadcast over heads; then bottom-right causal attention of the new
  queries over the whole sequence (qo_indptr, kv_indptr). A layer without `kv_b_proj` cannot
  decompress the prefix: an error names it.

The attention itself is `funcmla.attention.pallas.mha_prefill`'s kernel (backend "pallas") or
the float32 `mha_attention_reference` (backend "reference"; AITER's own MHA is not wrapped, so
"aiter" runs the reference and records why). On an NVIDIA GPU with `torch_launcher` on, the
pallas path runs the kernel through the torch prefill launcher
(`funcmla.interop.launcher.prefill`: on torch's stream, no JAX dispatch, no DLPack): one
launcher per bucket of (q rows, k / v rows, requests), the step's kernel index arrays computed
once for all its layers (`_launched`). With a prefix, the latent rows are decompressed straight
into the kernel's row count (`kv_laid_out`: the bucket's capacity, at most 12.5% above the
token count, the rows past the tokens repeating the last one), so the launcher copies neither
k nor v: 1664 bytes move per row and head instead of 2944. Elsewhere, or where the launcher
cannot run (`backend.last_launcher_reason` says why), it runs `mha_prefill` through JAX by
DLPack at bucket shapes (`_bucket_rows`, `_bucket_indptrs`), so it compiles once per bucket
rather than once per step, with the step's `prefill_step` built at its first layer for all of
them (`_jax_step`). Either way a layer reads no device value on the host: the token counts,
whether any request has a prefix and the longest kv_len (which picks the kernel's tile config,
`prefill_kernel_config`) come from the step's host lengths (`backend._extend_rows`, set by
`init_forward_metadata`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from funcmla.interop.dlpack import FP8_DTYPES, to_jax, to_torch

__all__ = ["is_mha_extend", "mha_extend", "MHA_HEAD_DIMS"]

MHA_HEAD_DIMS = (192, 128)  # (q / k head dim, v head dim): DeepSeek's decompressed heads
_ROPE = 64


def is_mha_extend(layer) -> bool:
    """Whether the layer is SGLang's MHA attention of an MLA model (q/k 192, not the 576 of
    the absorbed path)."""
    return (layer.qk_head_dim, layer.v_head_dim) == MHA_HEAD_DIMS


@functools.lru_cache(maxsize=None)
def _pallas_step():
    """`prefill_step` jitted (imported on first use; tests swap in interpret mode or a
    stand-in): the step's schedule from its bucketed CSRs, built once for all its layers.
    Under jit the index values are not read on the host (no device-to-host sync): they are the
    step's metadata, built by funcmla and checked once from the batch's host fields in
    `init_forward_metadata`."""
    import jax

    from funcmla.attention.pallas import prefill_step

    return jax.jit(prefill_step, static_argnames=("num_q", "num_kv", "causal", "max_kv_len",
                                                  "interpret"))


@functools.lru_cache(maxsize=None)
def _pallas_prefill():
    """One layer of the Pallas prefill, jitted: `mha_prefill(q, k, v, step=step)` (imported
    on first use; tests swap in a stand-in)."""
    import jax

    from funcmla.attention.pallas import mha_prefill

    return jax.jit(mha_prefill, static_argnames=("sm_scale",))


def _heads(x: torch.Tensor, name: str, heads: int, d: int) -> torch.Tensor:
    if x is None or x.numel() % (heads * d) or x.shape[-1] not in (d, heads * d):
        raise ValueError(f"MHA extend: {name} must be [T, {heads}, {d}] or [T, {heads * d}] "
                         f"(num_kv_heads = H), got "
                         f"{None if x is None else tuple(x.shape)}")
    return x.reshape(-1, heads, d)


def _decompress(pool_rows: torch.Tensor, kv_b_proj, heads: int, dtype, k_scale):
    """k [N, H, 192] and v [N, H, 128] from latent rows [N, 576] (AITER's MLA-MHA prefix
    path): kv_b_proj of the 512 compressed columns, the 64 rope columns broadcast."""
    if pool_rows.dtype in FP8_DTYPES and k_scale is not None:
        # a tensor scale (SGLang's layer.k_scale, on the device) multiplies as a tensor: its
        # value is never read on the host (no sync); a float the same way, in float32
        scale = (k_scale.reshape(()).float() if isinstance(k_scale, torch.Tensor)
                 else float(k_scale))
        rows = (pool_rows.float() * scale).to(dtype)
    else:
        rows = pool_rows.to(dtype)
    kvc, k_pe = rows[:, :-_ROPE], rows[:, -_ROPE:]
    with torch.no_grad():  # inference: the result crosses DLPack, which refuses grad tensors
        kv = kv_b_proj(kvc.contiguous())
    kv = kv[0] if isinstance(kv, tuple) else kv  # SGLang's linear layers return (out, bias)
    nope, dv = MHA_HEAD_DIMS[0] - _ROPE, MHA_HEAD_DIMS[1]
    if kv.shape[-1] != heads * (nope + dv):
        raise ValueError(f"layer.kv_b_proj gives {kv.shape[-1]} columns; {heads} heads of "
                         f"k_nope {nope} + v {dv} need {heads * (nope + dv)}")
    kv = kv.view(-1, heads, nope + dv)
    k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, heads, _ROPE)], dim=-1)
    return k.contiguous(), kv[..., nope:].contiguous()


def mha_extend(backend, q, k, v, layer, forward_batch, save_kv_cache: bool) -> torch.Tensor:
    """SGLang's MHA extend (module docstring) on `backend`'s metadata -> [T, H * 128] in q's
    dtype. Sets backend.last_backend / last_via."""
    if save_kv_cache:
        raise ValueError("MHA extend (qk_head_dim 192): save_kv_cache must be False; SGLang's "
                         "model writes the latent rows to the pool itself before this call")
    fm = backend.forward_metadata
    if fm is None or backend._mode != "extend":
        raise RuntimeError("MHA extend needs init_forward_metadata of an extend batch first "
                           f"(mode now {backend._mode!r})")
    heads = layer.tp_q_head_num
    if layer.tp_k_head_num != heads:
        raise ValueError(f"MHA extend: layer.tp_k_head_num = {layer.tp_k_head_num} must equal "
                         f"tp_q_head_num = {heads} (num_kv_heads = H)")
    q3 = _heads(q, "q", heads, MHA_HEAD_DIMS[0])
    qo_indptr, kv_indptr = fm.qo_indptr, fm.kv_indptr
    # the step's host lengths, checked by init_forward_metadata: no device read per layer
    tokens, kv_tokens, has_prefix, max_kv_len = backend._extend_rows
    if q3.shape[0] != tokens:
        raise ValueError(f"MHA extend: q has {q3.shape[0]} tokens; the batch's extend_seq_lens "
                         f"sum to {tokens}")
    if not has_prefix:  # no prefix anywhere: the model's k and v
        k3 = _heads(k, "k", heads, MHA_HEAD_DIMS[0])
        v3 = _heads(v, "v", heads, MHA_HEAD_DIMS[1])
        if k3.shape[0] != q3.shape[0] or v3.shape[0] != q3.shape[0]:
            raise ValueError(f"MHA extend without a prefix: k ({k3.shape[0]} tokens) and v "
                             f"({v3.shape[0]}) must have q's {q3.shape[0]} tokens")
        kv, kv_ip, kv_tokens = (k3, v3), qo_indptr, tokens
    else:
        kv_b_proj = getattr(layer, "kv_b_proj", None)
        if kv_b_proj is None:
            raise ValueError("MHA extend over a prefix needs layer.kv_b_proj (SGLang attaches "
                             "the model's kv_b_proj to attn_mha) to decompress the prefix's "
                             "latent rows")
        pool = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
        flat, slots = pool.reshape(pool.shape[0], -1), fm.kv_indices[:kv_tokens]

        def kv(src=None):
            """k, v of the batch's tokens decompressed: all in order, or the tokens `src`
            (the launcher's k / v rows) in that order."""
            rows = flat[(slots if src is None else slots.index_select(0, src)).long()]
            return _decompress(rows, kv_b_proj, heads, q3.dtype, layer.k_scale)

        kv_ip = kv_indptr
    out, backend.last_backend, backend.last_fallback_reason, backend.last_via = _attend(
        backend, q3, kv, kv_tokens, qo_indptr, kv_ip, layer.scaling, max_kv_len)
    return out.reshape(q3.shape[0], heads * MHA_HEAD_DIMS[1])


def _attend(backend, q3, kv, kv_tokens: int, qo_indptr, kv_indptr, sm_scale,
            max_kv_len: int):
    """(out [T, H, 128] in q's dtype, the backend that ran, why the reference ran instead of
    the requested backend or None, how it ran: "launcher" or "jax"). kv: (k [Tk, H, 192],
    v [Tk, H, 128]), or a function of a row map making them (all Tk tokens for None); the
    launcher makes them with its kernel's row count. The prefill kernel's tile config is
    `prefill_kernel_config` of the step's longest kv_len (a host fact). Sets
    backend.last_launcher_reason."""
    reason = backend.last_launcher_reason = None
    requested = backend.attention_backend
    if requested == "pallas" and q3.dtype == torch.bfloat16 and backend.torch_launcher:
        out, backend.last_launcher_reason = _launched(backend, q3, kv, kv_tokens, qo_indptr,
                                                      kv_indptr, sm_scale, max_kv_len)
        if out is not None:
            return out, "pallas", None, "launcher"
    k3, v3 = kv if isinstance(kv, tuple) else kv()
    if requested == "pallas":
        if q3.dtype == torch.bfloat16:
            if not backend.torch_launcher:
                backend.last_launcher_reason = "torch_launcher is off"
            q_j, k_j, v_j = (to_jax(_bucket_rows(x)) for x in (q3, k3, v3))
            step = _jax_step(backend, qo_indptr, kv_indptr, q_j.shape[0], k_j.shape[0],
                             max_kv_len)
            out, _ = _pallas_prefill()(q_j, k_j, v_j, step=step, sm_scale=float(sm_scale))
            return to_torch(out)[:q3.shape[0]], "pallas", None, "jax"
        reason = f"this MHA extend runs the prefill kernel on bfloat16 q, q is {q3.dtype}"
    elif requested == "aiter":
        reason = "AITER's MHA prefill is not wrapped; the float32 reference runs"
    args = [to_jax(x.contiguous()) for x in (q3, k3, v3, qo_indptr, kv_indptr)]
    from funcmla.attention.reference import mha_attention_reference

    out, _ = mha_attention_reference(*args, sm_scale=float(sm_scale), causal=True)
    return to_torch(out).to(q3.dtype), "reference", reason, "jax"


def _prefill_launcher(config, device):
    """The cached torch prefill launcher of `config` on `device` (tests swap in a stand-in
    kernel); LauncherUnavailable where it cannot run."""
    from funcmla.interop.launcher.prefill import prefill_launcher

    return prefill_launcher(config, device)


def _kernel_config(max_kv_len: int):
    from funcmla.attention.pallas.prefill import prefill_kernel_config

    return prefill_kernel_config(max_kv_len)


def _per_step(backend, attr: str, qo_indptr, kv_indptr, key, build):
    """`build()`, kept in `backend.<attr>` for the step's CSRs (the same tensors: the step's
    metadata) and `key`; the forward_metadata setter drops it with the step."""
    cached = getattr(backend, attr)
    if cached is not None and cached[0] is qo_indptr and cached[1] is kv_indptr \
            and cached[2] == key:
        return cached[3]
    value = build()
    setattr(backend, attr, (qo_indptr, kv_indptr, key, value))
    return value


def _launched(backend, q3, kv, tk: int, qo_indptr, kv_indptr, sm_scale, max_kv_len: int):
    """(out [T, H, 128], None) through the torch prefill launcher of the step's buckets, or
    (None, why not). The launcher (or the reason it is unavailable) is cached per
    configuration, the step's layout for the step (`_per_step`): every layer after the step's
    first costs q's padding copy where q has fewer rows than the bucket, and one launch; no
    lse. k / v made here (`kv` a function) are made with the kernel's row count, so the
    launcher copies neither."""
    from funcmla.attention.pallas.prefill_layout import prefill_batch_capacity, prefill_capacity
    from funcmla.interop.launcher.errors import LauncherUnavailable
    from funcmla.interop.launcher.prefill import PrefillLaunchConfig

    tq, heads = q3.shape[0], q3.shape[1]

    def build():
        config = PrefillLaunchConfig(num_heads=heads, q_capacity=prefill_capacity(tq),
                                     kv_capacity=prefill_capacity(tk),
                                     batch=prefill_batch_capacity(qo_indptr.shape[0] - 1),
                                     sm_scale=float(sm_scale), causal=True,
                                     kernel=_kernel_config(max_kv_len))
        launcher = backend._mha_launchers.get((config, q3.device))
        if launcher is None:
            try:
                launcher = _prefill_launcher(config, q3.device)
            except LauncherUnavailable as err:
                launcher = f"the prefill launcher is unavailable: {err}"
            backend._mha_launchers[(config, q3.device)] = launcher
        if isinstance(launcher, str):
            return launcher, None, None
        # the token of each of the kernel's k / v rows: token r, then the last one repeated
        rows = torch.arange(launcher.geometry.kv_rows, dtype=torch.int32,
                            device=q3.device).clamp_(max=max(tk - 1, 0))
        return launcher, launcher.layout(qo_indptr, kv_indptr, tq, tk), rows

    key = (heads, float(sm_scale), tq, tk, qo_indptr.shape[0], max_kv_len)
    launcher, step, rows = _per_step(backend, "_mha_step", qo_indptr, kv_indptr, key, build)
    if isinstance(launcher, str):
        return None, launcher
    if isinstance(kv, tuple):
        out, _ = launcher(q3, *kv, step=step, return_lse=False)
    else:
        out, _ = launcher(q3, *kv(rows), step=step, return_lse=False, kv_laid_out=True)
    return out, None


def _jax_step(backend, qo_indptr, kv_indptr, q_rows: int, kv_rows: int, max_kv_len: int):
    """The step's `PrefillStep` for the JAX path over its bucketed CSRs and q / k / v rows,
    built at the step's first layer and kept for the step (`_per_step`), so each later layer
    runs the kernel and its copies alone."""
    def build():
        qo_b, kv_b = (to_jax(x) for x in _bucket_indptrs(qo_indptr, kv_indptr))
        return _pallas_step()(qo_b, kv_b, num_q=q_rows, num_kv=kv_rows, causal=True,
                              max_kv_len=max_kv_len)

    key = (q_rows, kv_rows, qo_indptr.shape[0], max_kv_len)
    return _per_step(backend, "_mha_jax_step", qo_indptr, kv_indptr, key, build)


def _bucket_rows(x):
    """x [T, H, d] with its rows padded to `prefill_capacity`, so that the jitted prefill
    compiles once per bucket, not per step (q rows past qo_indptr[-1] get out 0, k / v rows
    past kv_indptr[-1] are never read): one device copy, nothing read on the host."""
    from funcmla.attention.pallas.prefill_layout import prefill_capacity

    pad = prefill_capacity(x.shape[0]) - x.shape[0]
    return F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x.contiguous()


def _bucket_indptrs(qo_indptr, kv_indptr):
    """The CSRs over `prefill_batch_capacity` requests (the extra ones empty: the last entry
    repeated), the step's bucket; nothing read on the host."""
    from funcmla.attention.pallas.prefill_layout import prefill_batch_capacity

    extra = prefill_batch_capacity(qo_indptr.shape[0] - 1) + 1 - qo_indptr.shape[0]
    return [torch.cat([x, x[-1:].expand(extra)]) if extra else x.contiguous()
            for x in (qo_indptr, kv_indptr)]
