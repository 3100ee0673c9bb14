"""Prefill launcher: `mha_prefill`'s Mosaic GPU kernel on torch tensors and torch's stream.

A launcher serves every batch within its capacities (`PrefillLaunchConfig`: heads, up to
q_capacity q rows, kv_capacity k / v rows and `batch` requests), so one compile covers the
token counts of many serving steps (the buckets of `prefill_capacity`). Per step, the kernel's
index arrays (`funcmla.attention.pallas.prefill_layout`) are computed on the device in torch
ops (`prefill_layout.torch_prefill_layout`) and shared by the step's layers; per layer, q / k / v
reach the kernel as they are where they already have the capacity's rows (else one copy each
pads them to it: the compiled TMA descriptors carry static row counts), the kernel runs
through its Mosaic GPU host function in one foreign call (`interop/_launch.py`), and out and
lse are the first Tq rows of the kernel's (or the caller's own tensors, written by the kernel
where they have its rows). All of it is stream-ordered on `torch.cuda.current_stream()` and
capturable in a CUDA graph. The kernel is the module
`mha_prefill` lowers for the same geometry, compiled by jaxlib's own `MosaicGpuCompile`
(`mosaic.py`); the copies are exact, so outputs equal `mha_prefill` under jit bit for bit.
Design and numbers: docs/torch_launcher.md ("Prefill").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas.prefill_layout import (
    PrefillGeometry,
    PrefillLayout,
    prefill_batch_capacity,
    prefill_capacity,
    prefill_geometry,
)
from funcmla.attention.pallas.prefill import prefill_kernel_config
from funcmla.attention.pallas.prefill_mgpu import (
    HEAD_DIM,
    V_HEAD_DIM,
    MgpuPrefillConfig,
    prefill_kernel,
)
from funcmla.interop.launcher.checks import _SHORT_DTYPES, expect_tensor
from funcmla.interop.launcher.device import (
    cuda_device_index,
    current_raw_stream_fn,
    launch_device,
)
from funcmla.interop.launcher.errors import LauncherArgumentError, LauncherUnavailable
from funcmla.interop.launcher.extract import MosaicCall, extract_kernel_calls, lower_for_cuda
from funcmla.interop.launcher.prefill_layout import torch_prefill_layout
from funcmla.interop.launcher.support import jaxlib_unsupported_reason

__all__ = ["PrefillLaunchConfig", "PrefillPlan", "PrefillStep", "PrefillLauncher",
           "prefill_plan", "prefill_launcher", "prefill_capacity", "prefill_batch_capacity",
           "torch_mha_prefill"]

# The kernel's buffers in the host function's order: the six layout arrays, q / k / v padded
# to the geometry's rows, then its two results. They are also the program's per-call pointer slots.
BUFFERS = ("qo_indptr", "kv_indptr", "q_lens", "kv_lens", "tile_req", "tile_first", "q", "k",
           "v", "out", "lse")


@dataclasses.dataclass(frozen=True)
class PrefillLaunchConfig:
    """Static configuration of a prefill launcher (hashable: the cache key).

    num_heads: H (q, k and v alike). q_capacity / kv_capacity: the most q rows (Tq) and k / v
    rows (Tk) a call may pass; batch: the most requests. sm_scale: the softmax scale; causal:
    bottom-right causal (True) or full attention. kernel: `MgpuPrefillConfig`, as for
    `mha_prefill`. The operands' dtypes (bf16 or fp8) are per call, not part of the
    configuration: the kernel always reads bf16."""

    num_heads: int
    q_capacity: int
    kv_capacity: int
    batch: int
    sm_scale: float
    causal: bool = True
    kernel: MgpuPrefillConfig = MgpuPrefillConfig()

    def __post_init__(self):
        for name in ("num_heads", "q_capacity", "kv_capacity", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PrefillLaunchConfig.{name} must be an int >= 1, got "
                                 f"{value!r}")
        s = self.sm_scale
        if not (isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s)
                and s > 0):
            raise ValueError(f"PrefillLaunchConfig.sm_scale={s!r} must be a positive finite "
                             "float")
        if not isinstance(self.causal, bool):
            raise ValueError(f"PrefillLaunchConfig.causal must be a bool, got {self.causal!r}")
        if not isinstance(self.kernel, MgpuPrefillConfig):
            raise ValueError("PrefillLaunchConfig.kernel must be a MgpuPrefillConfig, got "
                             f"{type(self.kernel).__name__}")

    @property
    def geometry(self) -> PrefillGeometry:
        return prefill_geometry(self.q_capacity, self.kv_capacity, self.batch,
                                block_kv=self.kernel.block_kv)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """The kernel a `PrefillLaunchConfig` runs: `call`, read from `prefill_kernel`'s CUDA
    lowering for the config's geometry, with its nine operands and two results as `BUFFERS`
    orders them."""

    config: PrefillLaunchConfig
    geometry: PrefillGeometry
    call: MosaicCall


def _avals(config: PrefillLaunchConfig, g: PrefillGeometry) -> tuple:
    i32, bf16 = jnp.int32, jnp.bfloat16
    h, r, n = config.num_heads, g.num_reqs, g.num_slots
    sds = jax.ShapeDtypeStruct
    return (sds((r + 1,), i32), sds((r + 1,), i32), sds((r,), i32), sds((r,), i32),
            sds((n,), i32), sds((n,), i32), sds((g.q_rows, h, HEAD_DIM), bf16),
            sds((g.kv_rows, h, HEAD_DIM), bf16), sds((g.kv_rows, h, V_HEAD_DIM), bf16))


def _signature(a) -> tuple[tuple[int, ...], str]:
    return tuple(a.shape), _SHORT_DTYPES[jnp.dtype(a.dtype).name]


def prefill_plan(config: PrefillLaunchConfig) -> PrefillPlan:
    """Lower the prefill kernel for `config` for CUDA (no GPU needed) and read it back (cached).
    Raises LauncherUnavailable on an untested jaxlib or a lowering laid out otherwise."""
    why = jaxlib_unsupported_reason()
    if why is not None:
        raise LauncherUnavailable(why)
    return _prefill_plan(config)


@functools.lru_cache(maxsize=64)
def _prefill_plan(config: PrefillLaunchConfig) -> PrefillPlan:
    g = config.geometry
    fn = prefill_kernel(g.q_rows, config.num_heads, g.num_reqs, jnp.bfloat16,
                        sm_scale=float(config.sm_scale), causal=config.causal,
                        config=config.kernel, num_slots=g.num_slots)
    avals = _avals(config, g)
    calls = extract_kernel_calls(lower_for_cuda(fn, *avals))
    h = config.num_heads
    want = (tuple(_signature(a) for a in avals),
            (((g.q_rows, h, V_HEAD_DIM), "bf16"), ((g.q_rows, h), "f32")),
            tuple(range(len(avals))))
    got = [(c.operands, c.results, c.sources) if isinstance(c, MosaicCall) else c.name
           for c in calls]
    if got != [want]:
        raise LauncherUnavailable(
            f"the prefill kernel's lowering is not the one Mosaic GPU call this launcher "
            f"wires: got {got}, expected {want} (funcmla.attention.pallas.prefill_mgpu "
            "changed its kernel)")
    return PrefillPlan(config, g, calls[0])


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillStep:
    """One step's kernel index arrays on the device (`PrefillLauncher.layout`), for calls with
    num_q q rows and num_kv k / v rows; every layer of the step reuses it."""

    config: PrefillLaunchConfig
    num_q: int
    num_kv: int
    layout: PrefillLayout


class PrefillLauncher:
    """`mha_prefill` on torch tensors for every batch within a `PrefillLaunchConfig`.

    layout(qo_indptr, kv_indptr, num_q, num_kv) -> PrefillStep: the step's layout (int32
    token CSRs [B + 1] on the launcher's device, B <= batch; torch ops on the current stream).
    __call__(q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128] (any strides), qo_indptr=None,
    kv_indptr=None, *, step=None, out=None [Tq, H, 128] bf16, lse=None [Tq, H] float32,
    q_scale=None, k_scale=None, v_scale=None, return_lse=True, kv_laid_out=False) -> (out, lse):
    the CSRs or a step of this launcher for (Tq, Tk); return_lse=False returns (out, None);
    kv_laid_out=True (with step=) takes k / v already padded to the
    kernel's rows, [geometry.kv_rows, H, d] with row r holding token r of the step's num_kv
    (the rows past it unused), and skips their copies (a caller that makes k / v, as SGLang's
    prefix decompression does, makes them that size and saves a pass over both). q, k or v
    that has the kernel's rows (geometry.q_rows / kv_rows), contiguous, bf16 and 16-byte
    aligned is read in place. Each of q / k / v is bfloat16, or fp8 (float8_e4m3fn
    / float8_e4m3fnuz) standing for float(x) * its scale (None: 1; a positive float, or a
    float32 tensor of shape () or [1]), dequantized to bf16 as `mha_prefill` does. Semantics are
    `mha_prefill`'s (bottom-right causal or full; a query with no key: out 0, lse +inf). Tensors
    are checked (dtype, shape, device, capacity) before anything runs; index values are the
    caller's contract (reading them needs a device sync; `validate_prefill_inputs` checks host
    copies), and any value keeps every access in bounds.
    """

    def __init__(self, plan: PrefillPlan, device, *, kernel_factory=None, stream_fn=None,
                 launch_address: int | None = None, native: bool | None = None):
        """kernel_factory(call, device_index) -> an object with function, host, host_abi,
        num_params, grid, block, shared_mem_bytes, info() (default: `MosaicKernel`). Tests
        pass a stand-in, a CPU device, stream_fn and a launch_address."""
        import torch

        from funcmla.interop import _launch

        device, index = launch_device(torch, device, real=kernel_factory is None)
        if kernel_factory is None:
            from funcmla.interop.launcher.mosaic import MosaicKernel

            kernel_factory = MosaicKernel
        if launch_address is None:
            from funcmla.interop import _cuda_driver

            launch_address = _cuda_driver.driver().launch_address
        self.plan, self.config, self.geometry = plan, plan.config, plan.geometry
        self.device, self.device_index = device, index
        self.kernel = k = kernel_factory(plan.call, index)
        if k.num_params != len(BUFFERS):
            raise LauncherUnavailable(f"{plan.call.name} takes {k.num_params} buffers, not the "
                                      f"{len(BUFFERS)} the launcher wires")
        self.program = _launch.LaunchProgram(
            [_launch.ProgramKernel(plan.call.name, k.function, k.grid, k.block,
                                   k.shared_mem_bytes, list(range(len(BUFFERS))),
                                   host=getattr(k, "host", 0),
                                   host_abi=getattr(k, "host_abi", _launch.HOST_ABI_DIRECT))],
            len(BUFFERS), {}, launch_address, native=native)
        self._stream = stream_fn or current_raw_stream_fn(torch)
        self._lock = threading.Lock()
        self._torch = torch
        self._operand_dtypes = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz)

    # ------------------------------------------------------------------------ per step
    def layout(self, qo_indptr, kv_indptr, num_q: int, num_kv: int) -> PrefillStep:
        torch, c = self._torch, self.config
        for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
            self._expect(name, x, torch.int32)
            if x.ndim != 1 or not 2 <= x.shape[0] <= c.batch + 1:
                raise LauncherArgumentError(
                    f"{name} has shape {list(x.shape)}; the launcher takes [B + 1] with "
                    f"1 <= B <= batch = {c.batch}")
        if qo_indptr.shape != kv_indptr.shape:
            raise LauncherArgumentError(f"qo_indptr {list(qo_indptr.shape)} and kv_indptr "
                                        f"{list(kv_indptr.shape)} must be [B + 1] for one B")
        for name, n, cap in (("num_q (q rows)", num_q, c.q_capacity),
                             ("num_kv (k / v rows)", num_kv, c.kv_capacity)):
            if not isinstance(n, int) or not 0 <= n <= cap:
                raise LauncherArgumentError(f"{name} = {n!r} must be an int in [0, {cap}] "
                                            "(the launcher's capacity)")
        return PrefillStep(c, num_q, num_kv, torch_prefill_layout(
            qo_indptr.contiguous(), kv_indptr.contiguous(), num_q, num_kv, self.geometry))

    # ------------------------------------------------------------------------ per layer
    def __call__(self, q, k, v, qo_indptr=None, kv_indptr=None, *, step=None, out=None,
                 lse=None, q_scale=None, k_scale=None, v_scale=None, return_lse: bool = True,
                 kv_laid_out: bool = False):
        torch, c, g = self._torch, self.config, self.geometry
        h = c.num_heads
        scales = []
        for name, x, d, scale in (("q", q, HEAD_DIM, q_scale), ("k", k, HEAD_DIM, k_scale),
                                  ("v", v, V_HEAD_DIM, v_scale)):
            self._expect(name, x, self._operand_dtypes)
            if x.ndim != 3 or x.shape[1:] != (h, d):
                raise LauncherArgumentError(f"{name} has shape {list(x.shape)}; the launcher "
                                            f"takes [T, {h}, {d}]")
            scales.append(self._scale(f"{name}_scale", scale, x))
        tq, tk = q.shape[0], k.shape[0]
        if v.shape[0] != tk:
            raise LauncherArgumentError(f"k has {tk} rows and v {v.shape[0]}: one k / v row "
                                        "per token")
        if kv_laid_out:
            if not isinstance(step, PrefillStep):
                raise LauncherArgumentError("kv_laid_out=True needs step= (the layout k / v "
                                            "are in)")
            if tk != g.kv_rows:
                raise LauncherArgumentError(
                    f"k / v laid out have {tk} rows; the layout has geometry.kv_rows = "
                    f"{g.kv_rows}")
            tk = step.num_kv
        if step is None:
            if qo_indptr is None or kv_indptr is None:
                raise LauncherArgumentError("pass qo_indptr and kv_indptr, or step=")
            step = self.layout(qo_indptr, kv_indptr, tq, tk)
        elif qo_indptr is not None or kv_indptr is not None:
            raise LauncherArgumentError("pass qo_indptr and kv_indptr, or step=, not both (the "
                                        "step's layout was built from its own CSRs)")
        elif not (isinstance(step, PrefillStep) and step.config == c
                  and (step.num_q, step.num_kv) == (tq, tk)):
            raise LauncherArgumentError(
                f"step must be this launcher's layout for {tq} q rows and {tk} k / v rows, "
                f"got {self._describe(step)}")
        out_shape, lse_shape = (tq, h, V_HEAD_DIM), (tq, h)
        for name, x, dtype, shape in (("out", out, torch.bfloat16, out_shape),
                                      ("lse", lse, torch.float32, lse_shape)):
            if x is not None:
                self._expect(name, x, dtype)
                if tuple(x.shape) != shape or not x.is_contiguous():
                    raise LauncherArgumentError(f"{name} must be a contiguous {list(shape)}, got "
                                                f"{list(x.shape)} (strides {x.stride()})")
        if not return_lse and lse is not None:
            raise LauncherArgumentError("lse= is given with return_lse=False")
        dev = self.device
        if tq == 0:
            if out is None:
                out = torch.empty(out_shape, dtype=torch.bfloat16, device=dev)
            if lse is None and return_lse:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=dev)
            return out, lse
        lay = step.layout
        qp = _kernel_rows(torch, q, g.q_rows, scales[0])
        kp, vp = (_kernel_rows(torch, x, g.kv_rows, s)
                  for x, s in ((k, scales[1]), (v, scales[2])))
        # the kernel writes rows [0, Tq) of its out and lse in place; each is those rows (a
        # view of a fresh tensor), or the caller's tensor when it has the kernel's rows (out
        # 16-byte aligned for its TMA stores; lse takes 4-byte stores)
        direct_out = out is not None and tq == g.q_rows and out.data_ptr() % 16 == 0
        direct_lse = lse is not None and tq == g.q_rows
        out_p = out if direct_out else torch.empty((g.q_rows, h, V_HEAD_DIM),
                                                   dtype=torch.bfloat16, device=dev)
        lse_p = lse if direct_lse else torch.empty((g.q_rows, h), dtype=torch.float32,
                                                   device=dev)
        ptrs = [t.data_ptr() for t in (*lay, qp, kp, vp, out_p, lse_p)]
        p = self.program
        with self._lock:  # the program's slots are shared state
            p.pack(p.buffer, 0, self._stream(self.device_index), 1, *ptrs)
            rc = p.run(p.ref)
        if rc:
            from funcmla.interop import _cuda_driver as cd

            cd.driver().check_launch(rc, self.plan.call.name)
        if out is None:
            out = out_p[:tq]
        elif not direct_out:
            out.copy_(out_p[:tq])
        if not return_lse:
            return out, None
        if lse is None:
            lse = lse_p[:tq]
        elif not direct_lse:
            lse.copy_(lse_p[:tq])
        return out, lse

    def _expect(self, name, x, dtype) -> None:
        expect_tensor(name, x, dtype, self.device_index, self.device)

    def _scale(self, name: str, value, x):
        """An fp8 operand's scale as `_bf16` applies it: None, the float32 value of a real, or
        a float32 tensor of shape () or [1] on the device (read by the device, not checked on
        the host: that needs a sync). A scale of a bf16 operand is an error."""
        torch = self._torch
        if value is None:
            return None
        if x.dtype is torch.bfloat16:
            raise LauncherArgumentError(f"{name} applies to an fp8 operand; {name[0]} is "
                                        "torch.bfloat16")
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            with np.errstate(over="ignore"):  # beyond float32: inf, refused below
                f32 = float(np.float32(value))
            if not (math.isfinite(f32) and f32 > 0):
                raise LauncherArgumentError(f"{name}={value!r} must be a positive finite float "
                                            "(as float32)")
            return f32
        if not isinstance(value, torch.Tensor):
            raise LauncherArgumentError(f"{name} must be a float or a float32 torch tensor of "
                                        f"shape () or [1], got {type(value).__name__}")
        self._expect(name, value, torch.float32)
        if tuple(value.shape) not in ((), (1,)):
            raise LauncherArgumentError(f"{name} has shape {list(value.shape)}; one scale per "
                                        "tensor: [] or [1]")
        return value

    @staticmethod
    def _describe(step) -> str:
        if isinstance(step, PrefillStep):
            return f"a layout for {step.num_q} / {step.num_kv} rows of {step.config}"
        return type(step).__name__

    def info(self) -> dict:
        g = self.geometry
        return {"config": dataclasses.asdict(self.config), "q_rows": g.q_rows,
                "kv_rows": g.kv_rows, "num_reqs": g.num_reqs, "num_slots": g.num_slots,
                "launch": self.program.how, "kernel": self.kernel.info()}


def _kernel_rows(torch, x, rows: int, scale):
    """x [T, H, d] as the kernel reads it: bfloat16, contiguous, 16-byte aligned, `rows` rows
    (T <= rows). Such an x as it is; else a new tensor whose first T rows are x (an fp8 one as
    float(x) * scale rounded once to bf16, the float32 operations of `mha_prefill`'s
    dequantization: bit-equal) and whose other rows are left unset: they belong to no request,
    and the kernel never lets such rows reach an output (docs/prefill_kernel.md)."""
    if (x.dtype is torch.bfloat16 and x.shape[0] == rows and x.is_contiguous()
            and x.data_ptr() % 16 == 0):
        return x
    buf = torch.empty((rows,) + tuple(x.shape[1:]), dtype=torch.bfloat16, device=x.device)
    t = x.shape[0]
    if t and x.dtype is torch.bfloat16:
        buf[:t].copy_(x)
    elif t:
        y = x.float()
        if scale is not None:
            y.mul_(scale)
        buf[:t].copy_(y)  # float32 -> bf16, rounded once
    return buf


_LAUNCHERS: dict[tuple[PrefillLaunchConfig, int], PrefillLauncher] = {}
_LAUNCHERS_LOCK = threading.Lock()


def prefill_launcher(config: PrefillLaunchConfig, device=None) -> PrefillLauncher:
    """The launcher of `config` on `device` (a torch CUDA device, index or None: the current
    one), built (lowered, compiled by jaxlib, loaded) on first use and cached."""
    import torch

    index = cuda_device_index(device)
    key = (config, index)
    with _LAUNCHERS_LOCK:
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            launcher = PrefillLauncher(prefill_plan(config), torch.device("cuda", index))
            _LAUNCHERS[key] = launcher
    return launcher


def torch_mha_prefill(q, k, v, qo_indptr, kv_indptr, *, sm_scale: float, causal: bool = True,
                      kernel: MgpuPrefillConfig | None = None, max_kv_len: int | None = None,
                      out=None, lse=None, q_scale=None, k_scale=None, v_scale=None):
    """`mha_prefill` on torch CUDA tensors through the launcher of the smallest buckets
    (`prefill_capacity`, `prefill_batch_capacity`) that hold q's and k's rows and the request
    count. kernel: the tile configuration, or None: `prefill_kernel_config(max_kv_len)`, the
    longest request's kv_len as the host knows it (the CSRs are device tensors, never read here;
    None: the default config). Returns (out, lse) as `PrefillLauncher.__call__`; a caller with
    many layers per step builds the step once (`prefill_launcher(...).layout`)."""
    for name, x in (("q", q), ("k", k), ("qo_indptr", qo_indptr)):
        if not hasattr(x, "shape") or len(x.shape) < 1:
            raise LauncherArgumentError(f"{name} must be a torch.Tensor with a leading axis, "
                                        f"got {type(x).__name__}")
    if len(q.shape) != 3:
        raise LauncherArgumentError(f"q has shape {list(q.shape)}; the launcher takes "
                                    f"[T, H, {HEAD_DIM}]")
    if kernel is None:
        kernel = prefill_kernel_config(max_kv_len)
    elif max_kv_len is not None:
        raise LauncherArgumentError("max_kv_len picks the kernel config: pass one of kernel "
                                    "and max_kv_len")
    config = PrefillLaunchConfig(
        num_heads=int(q.shape[1]), q_capacity=prefill_capacity(q.shape[0]),
        kv_capacity=prefill_capacity(k.shape[0]),
        batch=prefill_batch_capacity(qo_indptr.shape[0] - 1), sm_scale=float(sm_scale),
        causal=causal, kernel=kernel)
    return prefill_launcher(config, q.device)(q, k, v, qo_indptr, kv_indptr, out=out, lse=lse,
                                              q_scale=q_scale, k_scale=k_scale,
                                              v_scale=v_scale)
