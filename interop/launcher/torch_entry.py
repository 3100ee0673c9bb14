"""torch entry points: `torch_decode` and `torch_extend` keyed by tensor shapes, and the
registered torch ops (decode, and `torch_mha_prefill` as `torch.ops.funcmla.mha_prefill`)."""

from __future__ import annotations

from funcmla.attention.pallas import DecodeKernelConfig
from funcmla.attention.pallas.prefill_layout import prefill_batch_capacity, prefill_capacity
from funcmla.interop.launcher import extend as _extend
from funcmla.interop.launcher.decode import decode_launcher
from funcmla.interop.launcher.device import launcher_unavailable_reason
from funcmla.interop.launcher.errors import LauncherArgumentError, LauncherUnavailable
from funcmla.interop.launcher.plan import DecodeLaunchConfig


_TORCH_KEYED: dict[tuple, object] = {}
_TORCH_EXTEND: dict[tuple, object] = {}
_FP8_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
_KV_FP8 = "float8_e4m3fn"  # the fp8 pool format the launcher reads (DecodeLaunchConfig.kv_dtype)


def torch_decode_unsupported_reason(q, kv_pool, kv_indptr, kv_indices) -> str | None:
    """None if `torch_decode` can run these inputs, else why not (the caller then falls back to
    the DLPack + jit path). Checks kinds only (torch CUDA tensors, bf16/f16 q, a pool of q's
    dtype or float8_e4m3fn, int32 metadata) and the launcher's availability; shapes, layout
    and scales are checked by the call."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    tensors = (("q", q), ("kv_pool", kv_pool), ("kv_indptr", kv_indptr),
               ("kv_indices", kv_indices))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor ({type(t).__name__})"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q ({q.dtype}) must be bf16 or f16"
    fp8 = {getattr(torch, n) for n in _FP8_NAMES if hasattr(torch, n)}
    if kv_pool.dtype in fp8 and kv_pool.dtype != getattr(torch, _KV_FP8):
        return (f"kv_pool is {kv_pool.dtype}: the launcher (as the Pallas kernels) reads "
                f"torch.{_KV_FP8} fp8 pools only")
    if kv_pool.dtype == torch.uint8:
        return (f"kv_pool is torch.uint8: view fp8 bytes as torch.{_KV_FP8} "
                f"(kv_pool.view(torch.{_KV_FP8}), no copy)")
    if kv_pool.dtype not in (q.dtype, getattr(torch, _KV_FP8)):
        return (f"kv_pool ({kv_pool.dtype}) must be q's dtype ({q.dtype}) or "
                f"torch.{_KV_FP8}")
    if kv_indptr.dtype != torch.int32 or kv_indices.dtype != torch.int32:
        return "kv_indptr and kv_indices must be int32"
    for name, t in tensors:
        if not t.is_cuda:
            return f"{name} is on {t.device}, not a CUDA device"
    return launcher_unavailable_reason()


def torch_extend_unsupported_reason(q, kv_pool, qo_indptr, kv_indptr,
                                    kv_indices) -> str | None:
    """`torch_decode_unsupported_reason` for `torch_extend`'s inputs: also qo_indptr, an int32
    torch tensor on q's device."""
    reason = torch_decode_unsupported_reason(q, kv_pool, kv_indptr, kv_indices)
    if reason is not None:
        return reason
    import torch

    if not isinstance(qo_indptr, torch.Tensor):
        return f"qo_indptr is not a torch.Tensor ({type(qo_indptr).__name__})"
    if qo_indptr.dtype != torch.int32:
        return f"qo_indptr must be int32, got {qo_indptr.dtype}"
    if qo_indptr.device != q.device:
        return f"qo_indptr is on {qo_indptr.device}, q on {q.device}"
    return None


def _keyed_launcher(q, kv_pool, x, y, *, sm_scale: float, s_q: int, page_size: int,
                    max_kv_len: int | None, num_splits: int | None, v_head_dim: int,
                    kernel: DecodeKernelConfig):
    """The cached launcher for these tensors' static configuration (x, y: kv_indptr and
    kv_indices at page size 1, else page_table [B, max_pages] and lengths [B])."""
    key = (tuple(q.shape), kv_pool.shape[0], kv_pool.shape[-1], tuple(x.shape), tuple(y.shape),
           q.dtype, kv_pool.dtype, float(sm_scale), s_q, page_size, max_kv_len, num_splits,
           v_head_dim, kernel, q.get_device())
    launcher = _TORCH_KEYED.get(key)
    if launcher is not None:
        return launcher
    reason = torch_decode_unsupported_reason(q, kv_pool, x, y)
    if reason is not None:
        raise LauncherUnavailable(reason)
    if page_size == 1:
        b = x.shape[0] - 1 if x.dim() == 1 else -1
        capacity = y.shape[0] if y.dim() == 1 else -1
        layout = "kv_indptr [B+1], kv_indices [capacity]"
    else:
        b = x.shape[0] if x.dim() == 2 else -1
        capacity = x.shape[0] * x.shape[1] if x.dim() == 2 else -1
        layout = "page_table [B, max_pages], lengths [B]"
        if y.dim() != 1 or y.shape[0] != b:
            b = -1
    if b <= 0 or capacity <= 0 or q.dim() != 3 or q.shape[0] != b * s_q:
        raise LauncherArgumentError(
            f"q {list(q.shape)} must be [B * s_q, H, D] with s_q = {s_q} and B from {layout}; "
            f"got index tensors {list(x.shape)} and {list(y.shape)}")
    config = DecodeLaunchConfig(
        num_seqs=b, num_heads=q.shape[1], pool_rows=kv_pool.shape[0], kv_capacity=capacity,
        sm_scale=float(sm_scale), s_q=s_q, max_kv_len=max_kv_len if page_size == 1 else None,
        num_splits=num_splits, head_dim=q.shape[2], v_head_dim=v_head_dim,
        dtype=str(q.dtype).removeprefix("torch."), kernel=kernel, page_size=page_size,
        kv_dtype=str(kv_pool.dtype).removeprefix("torch."))
    launcher = decode_launcher(config, q.device)
    _TORCH_KEYED[key] = launcher
    return launcher


def torch_decode_launcher(q, kv_pool, kv_indptr, kv_indices, *, sm_scale: float, s_q: int = 1,
                          max_kv_len: int | None = None, num_splits: int | None = None,
                          v_head_dim: int = 512,
                          kernel: DecodeKernelConfig = DecodeKernelConfig()):
    """The cached launcher `torch_decode` runs for these tensors' shapes (token CSR), for a
    caller that launches many calls of one configuration (the layers of a step) and skips the
    per-call key; call it as `launcher(q, kv_pool, kv_indptr, kv_indices, out=, lse=)`.
    Raises as `torch_decode` does."""
    return _keyed_launcher(q, kv_pool, kv_indptr, kv_indices, sm_scale=sm_scale, s_q=s_q,
                           page_size=1, max_kv_len=max_kv_len, num_splits=num_splits,
                           v_head_dim=v_head_dim, kernel=kernel)


def torch_decode(q, kv_pool, kv_indptr, kv_indices, *, sm_scale: float, s_q: int = 1,
                 max_kv_len: int | None = None, num_splits: int | None = None,
                 v_head_dim: int = 512, out=None, lse=None,
                 kernel: DecodeKernelConfig = DecodeKernelConfig(), k_scale=None, v_scale=None):
    """`mla_decode` on torch CUDA tensors through the launcher of their static configuration
    (derived from the shapes and dtypes; built once per configuration and cached).

    q [B*s_q, H, D], kv_pool [rows, D] / [rows, 1, D] of q's dtype or float8_e4m3fn,
    kv_indptr int32 [B+1], kv_indices int32 [capacity] -> (out [B*s_q, H, v_head_dim],
    lse float32 [B*s_q, H]). k_scale / v_scale: an fp8 pool's scales (floats or float32
    device tensors of shape () or [1]; `DecodeLauncher`).
    Raises LauncherUnavailable where the launcher cannot run (see
    `torch_decode_unsupported_reason`), LauncherArgumentError for misuse.
    """
    launcher = _keyed_launcher(q, kv_pool, kv_indptr, kv_indices, sm_scale=sm_scale, s_q=s_q,
                               page_size=1, max_kv_len=max_kv_len, num_splits=num_splits,
                               v_head_dim=v_head_dim, kernel=kernel)
    return launcher(q, kv_pool, kv_indptr, kv_indices, out=out, lse=lse, k_scale=k_scale,
                    v_scale=v_scale)


def torch_extend_config(q, kv_pool, kv_indices, *, batch: int, sm_scale: float,
                        causal: bool = True, max_kv_len: int | None = None,
                        v_head_dim: int = 512):
    """The `ExtendLaunchConfig` of these torch tensors' shapes and dtypes for up to `batch`
    requests: q [T, H, D] (q_capacity: T's `prefill_capacity`), kv_pool [rows, ...] of q's
    dtype or an fp8 dtype (validated by the configuration), kv_indices [capacity]."""
    if q.dim() != 3:
        raise LauncherArgumentError(f"q has shape {list(q.shape)}; the extend launcher takes "
                                    "[T, H, D]")
    kv_dtype = str(kv_pool.dtype).removeprefix("torch.")
    return _extend.ExtendLaunchConfig(
        num_heads=q.shape[1], q_capacity=prefill_capacity(q.shape[0]), batch=batch,
        pool_rows=kv_pool.shape[0], kv_capacity=kv_indices.shape[0], sm_scale=float(sm_scale),
        max_kv_len=max_kv_len, causal=causal, head_dim=q.shape[2], v_head_dim=v_head_dim,
        dtype=str(q.dtype).removeprefix("torch."),
        kv_dtype=kv_dtype if kv_dtype in _FP8_NAMES else None)


def torch_extend_key(q, kv_pool, kv_indices, *, batch: int, sm_scale: float,
                     causal: bool = True, max_kv_len: int | None = None,
                     v_head_dim: int = 512) -> tuple:
    """The key of the extend launcher these tensors run (one home of its bucketing rule): q
    rows at their `prefill_capacity`, `batch` requests at its `prefill_batch_capacity`, and the
    other static shapes, dtypes and options as they are. Calls with one key share a launcher,
    so a serving run builds a bounded set of them."""
    return (prefill_capacity(q.shape[0]), tuple(q.shape[1:]), q.dtype, tuple(kv_pool.shape),
            kv_pool.dtype, tuple(kv_indices.shape), prefill_batch_capacity(batch),
            float(sm_scale), bool(causal), max_kv_len, v_head_dim, q.get_device())


def torch_extend_launcher(q, kv_pool, kv_indices, *, batch: int, sm_scale: float,
                          causal: bool = True, max_kv_len: int | None = None,
                          v_head_dim: int = 512):
    """The cached extend launcher (`ExtendLauncher`) `torch_extend` runs, one per
    `torch_extend_key`: `torch_extend_config` with `batch` at its `prefill_batch_capacity`
    (q rows are bucketed by `prefill_capacity` there). Raises LauncherUnavailable where it
    cannot run, ValueError for a configuration it does not take."""
    key = torch_extend_key(q, kv_pool, kv_indices, batch=batch, sm_scale=sm_scale,
                           causal=causal, max_kv_len=max_kv_len, v_head_dim=v_head_dim)
    launcher = _TORCH_EXTEND.get(key)
    if launcher is None:
        config = torch_extend_config(q, kv_pool, kv_indices,
                                     batch=prefill_batch_capacity(batch), sm_scale=sm_scale,
                                     causal=causal, max_kv_len=max_kv_len,
                                     v_head_dim=v_head_dim)
        launcher = _TORCH_EXTEND[key] = _extend.extend_launcher(config, q.device)
    return launcher


def torch_extend(q, kv_pool, qo_indptr, kv_indptr, kv_indices, *, sm_scale: float,
                 causal: bool = True, max_kv_len: int | None = None, v_head_dim: int = 512,
                 out=None, lse=None, k_scale=None, v_scale=None, return_lse: bool = True):
    """`mla_extend` on torch CUDA tensors through the extend launcher of their buckets
    (`torch_extend_launcher`; the decode kernels over query chunks, on torch's stream).

    q [T, H, D], kv_pool [rows, D] / [rows, 1, D] of q's dtype or float8_e4m3fn, qo_indptr
    int32 [B+1] (queries), kv_indptr int32 [B+1] (keys, kv_len >= q_len for a causal request,
    bottom-right aligned), kv_indices int32 [capacity] (token slots) -> (out [T, H,
    v_head_dim], lse float32 [T, H], or None with return_lse=False). A query with no key gets
    out 0 and lse +inf. The step's layout is computed per call (a caller running many layers
    of one step keeps `torch_extend_launcher(...).layout(...)` and calls the launcher).
    Raises LauncherUnavailable where the launcher cannot run, LauncherArgumentError for
    misuse."""
    reason = torch_extend_unsupported_reason(q, kv_pool, qo_indptr, kv_indptr, kv_indices)
    if reason is not None:
        raise LauncherUnavailable(reason)
    if qo_indptr.dim() != 1 or qo_indptr.shape[0] < 2:
        raise LauncherArgumentError(f"qo_indptr has shape {list(qo_indptr.shape)}; it must be "
                                    "[B + 1] with B >= 1")
    launcher = torch_extend_launcher(q, kv_pool, kv_indices, batch=qo_indptr.shape[0] - 1,
                                     sm_scale=sm_scale, causal=causal, max_kv_len=max_kv_len,
                                     v_head_dim=v_head_dim)
    step = launcher.layout(qo_indptr, kv_indptr, kv_indices, num_q=q.shape[0])
    return launcher(q, kv_pool, step, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale,
                    return_lse=return_lse)


_REGISTERED: dict[str, object] = {}


def register_torch_ops() -> dict[str, object]:
    """Register the launcher as torch ops (idempotent) and return them by name:

    torch.ops.funcmla.mla_decode(q, kv_pool, index_a, index_b, sm_scale, s_q, page_size,
        max_kv_len, num_splits, v_head_dim, k_scale=None, v_scale=None) -> (out, lse)
    torch.ops.funcmla.mla_decode_out(q, kv_pool, index_a, index_b, out, lse, ...same) -> ()
        (writes out / lse in place)

    torch.ops.funcmla.mha_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale, causal,
        q_scale=None, k_scale=None, v_scale=None, max_kv_len=0) -> (out, lse)
        (`torch_mha_prefill`; max_kv_len: the longest request's kv_len as the host knows it,
        which picks the tile config, `prefill_kernel_config`; 0 for None)

    index_a / index_b: kv_indptr / kv_indices at page_size 1, else page_table / lengths;
    max_kv_len / num_splits: 0 for None; k_scale / v_scale: an fp8 pool's scales as float32
    tensors of shape () or [1] (optional, last: calls without them are unchanged). Each has a
    fake implementation (shapes only), so torch.compile and piecewise CUDA graphs trace them
    as one opaque op; the real one is the cached launcher (one foreign call). The default
    `DecodeKernelConfig` applies."""
    if _REGISTERED:
        return _REGISTERED
    import torch

    def launcher(q, kv_pool, a, b, sm_scale, s_q, page_size, max_kv_len, num_splits, v_head_dim):
        return _keyed_launcher(q, kv_pool, a, b, sm_scale=sm_scale, s_q=s_q, page_size=page_size,
                               max_kv_len=max_kv_len or None, num_splits=num_splits or None,
                               v_head_dim=v_head_dim, kernel=DecodeKernelConfig())

    statics = "float sm_scale, int s_q, int page_size, int max_kv_len, int num_splits, " \
              "int v_head_dim, Tensor? k_scale=None, Tensor? v_scale=None"

    @torch.library.custom_op("funcmla::mla_decode", mutates_args=(), device_types="cuda",
                             schema=f"(Tensor q, Tensor kv_pool, Tensor index_a, Tensor index_b, "
                                    f"{statics}) -> (Tensor, Tensor)")
    def mla_decode_op(q, kv_pool, index_a, index_b, sm_scale, s_q, page_size, max_kv_len,
                      num_splits, v_head_dim, k_scale=None, v_scale=None):
        run = launcher(q, kv_pool, index_a, index_b, sm_scale, s_q, page_size, max_kv_len,
                       num_splits, v_head_dim)
        return run(q, kv_pool, index_a, index_b, k_scale=k_scale, v_scale=v_scale)

    @mla_decode_op.register_fake
    def _(q, kv_pool, index_a, index_b, sm_scale, s_q, page_size, max_kv_len, num_splits,
          v_head_dim, k_scale=None, v_scale=None):
        t, h = q.shape[0], q.shape[1]
        return q.new_empty((t, h, v_head_dim)), q.new_empty((t, h), dtype=torch.float32)

    @torch.library.custom_op("funcmla::mla_decode_out", mutates_args=("out", "lse"),
                             device_types="cuda",
                             schema=f"(Tensor q, Tensor kv_pool, Tensor index_a, Tensor index_b, "
                                    f"Tensor(a!) out, Tensor(b!) lse, {statics}) -> ()")
    def mla_decode_out_op(q, kv_pool, index_a, index_b, out, lse, sm_scale, s_q, page_size,
                          max_kv_len, num_splits, v_head_dim, k_scale=None, v_scale=None):
        run = launcher(q, kv_pool, index_a, index_b, sm_scale, s_q, page_size, max_kv_len,
                       num_splits, v_head_dim)
        run(q, kv_pool, index_a, index_b, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)

    @mla_decode_out_op.register_fake
    def _(q, kv_pool, index_a, index_b, out, lse, sm_scale, s_q, page_size, max_kv_len,
          num_splits, v_head_dim, k_scale=None, v_scale=None):
        return None

    @torch.library.custom_op("funcmla::mha_prefill", mutates_args=(), device_types="cuda",
                             schema="(Tensor q, Tensor k, Tensor v, Tensor qo_indptr, "
                                    "Tensor kv_indptr, float sm_scale, bool causal, "
                                    "Tensor? q_scale=None, Tensor? k_scale=None, "
                                    "Tensor? v_scale=None, int max_kv_len=0) -> (Tensor, Tensor)")
    def mha_prefill_op(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, q_scale=None,
                       k_scale=None, v_scale=None, max_kv_len=0):
        from funcmla.interop.launcher.prefill import torch_mha_prefill

        return torch_mha_prefill(q, k, v, qo_indptr, kv_indptr, sm_scale=sm_scale,
                                 causal=causal, q_scale=q_scale, k_scale=k_scale,
                                 v_scale=v_scale, max_kv_len=max_kv_len or None)

    @mha_prefill_op.register_fake
    def _(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, q_scale=None, k_scale=None,
          v_scale=None, max_kv_len=0):
        t, h = q.shape[0], q.shape[1]
        return (q.new_empty((t, h, v.shape[2]), dtype=torch.bfloat16),
                q.new_empty((t, h), dtype=torch.float32))

    _REGISTERED.update(mla_decode=mla_decode_op, mla_decode_out=mla_decode_out_op,
                       mha_prefill=mha_prefill_op)
    return _REGISTERED
