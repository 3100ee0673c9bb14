"""Decode launchers: `mla_decode` on torch tensors, one foreign call per step."""

from __future__ import annotations

import dataclasses
import struct
import threading
from typing import Callable

from funcmla.interop.launcher.checks import TensorSpec
from funcmla.interop.launcher.compile import compile_plan
from funcmla.interop.launcher.device import (
    cuda_device_index,
    current_raw_stream_fn,
    launch_device,
)
from funcmla.interop.launcher.errors import LauncherArgumentError, LauncherUnavailable
from funcmla.interop.launcher.load import LoadedKernel
from funcmla.interop.launcher.extract import MosaicCall
from funcmla.interop.launcher.mosaic import MosaicKernel
from funcmla.interop.launcher.plan import DecodeLaunchConfig, DecodePlan, decode_plan
from funcmla.interop.launcher.scales import ScaleOperands


# Pointer slots of a decode program (interop/_launch.py). Per call: the two index tensors in
# argument order (x, y), q, kv_pool, out, lse, an fp8 pool's k_scale, v_scale (0 for other
# pools: no kernel reads them), all eight checked in C where it can; then the "lens" form's
# table (checked in Python; 0 for the other forms). Fixed: scratch buffers and a null pointer.
_X, _Y, _Q, _KV, _OUT, _LSE, _KS, _VS, _TABLE = range(9)
_PER_CALL = 9
_BAD_ARGUMENT = -1  # = _launch.BAD_ARGUMENT: a check in C refused an argument
_OPART, _LPART, _QPAD, _OUTPAD, _LSEPAD, _NULL = range(9, 15)


class _DecodeLauncherBase:
    """Shared body of the decode launchers (see `DecodeLauncher`)."""

    _x_name = _y_name = ""

    def __init__(self, plan: DecodePlan, device, *, kernel_factory: Callable | None = None,
                 stream_fn: Callable[[int], int] | None = None, launch_address: int | None = None,
                 native: bool | None = None, route: str | None = None):
        """device: a CUDA torch.device. kernel_factory(call, device_index, arch) -> an object
        with function, grid, block, shared_mem_bytes, num_params, info() (default: the plan's
        kernels compiled by `compile_plan(plan, arch, route)` and loaded). Tests pass fakes, a
        CPU device, stream_fn and a launch_address (a recording cuLaunchKernel stand-in)."""
        import torch

        from funcmla.interop import _launch

        c = plan.config
        device, device_index = launch_device(torch, device, real=kernel_factory is None)
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"{major}.{minor}"
        else:
            arch = "cpu"
        if kernel_factory is None:
            images = compile_plan(plan, arch, route)

            def kernel_factory(call, index, arch_name):
                if isinstance(call, MosaicCall):
                    return MosaicKernel(call, index)
                return LoadedKernel(call, index, arch_name, images[call.name])
        if launch_address is None:
            from funcmla.interop import _cuda_driver

            launch_address = _cuda_driver.driver().launch_address
        self.plan, self.config, self.device_index, self.device = plan, c, device_index, device
        self.decode = kernel_factory(plan.decode, device_index, arch)
        self.merge = (kernel_factory(plan.merge, device_index, arch)
                      if plan.merge is not None else None)
        tdt = getattr(torch, c.dtype)
        self._kv_dtype = getattr(torch, c.pool_dtype)
        self._scales = ScaleOperands(device) if c.fp8 else None
        b, t, h, dv = c.num_seqs, c.num_seqs * c.s_q, c.num_heads, c.v_head_dim
        s, rp, r = plan.num_splits, plan.rows_pad, c.rows
        self.padded = rp != r
        split = s > 1
        self._out_shape, self._lse_shape, self._dtype = (t, h, dv), (t, h), tdt
        # Triton IR declares each pointer's divisibility; TMA needs 16-byte global addresses.
        self.align = max([16] + [max(k.ptr_divisibility) for k in plan.triton_calls])
        fixed = {_NULL: 0}
        dev = device
        if split:
            self._o_part = torch.empty(b, s, rp, dv, dtype=getattr(torch, c.kernel.partial_dtype),
                                       device=dev)
            self._lse_part = torch.empty(b, s, rp, dtype=torch.float32, device=dev)
            fixed.update({_OPART: self._o_part.data_ptr(), _LPART: self._lse_part.data_ptr()})
        if self.padded:
            self._q_pad = torch.zeros(b, rp, c.head_dim, dtype=tdt, device=dev)
            self._out_pad = torch.empty(b, rp, dv, dtype=tdt, device=dev)
            self._lse_pad = torch.empty(b, rp, dtype=torch.float32, device=dev)
            fixed.update({_QPAD: self._q_pad.data_ptr(), _OUTPAD: self._out_pad.data_ptr(),
                          _LSEPAD: self._lse_pad.data_ptr()})
        out_slot = _OUTPAD if self.padded else _OUT
        lse_slot = _LSEPAD if self.padded else _LSE
        dec_params = self._input_slots(plan) + [_OPART if split else out_slot,
                                                _LPART if split else lse_slot]
        kernels = [self._program_kernel(self.decode, dec_params)]
        if split:
            kernels.append(self._program_kernel(self.merge, [_OPART, _LPART, out_slot,
                                                             lse_slot]))
        self.program = _launch.LaunchProgram(kernels, _PER_CALL, fixed, launch_address,
                                             native=native)
        p = self.program
        self._hot = (p.pack, p.buffer, (1 << len(kernels)) - 1, p.run, p.ref)
        self._lock = threading.Lock()
        self._empty = torch.empty
        self._stream = stream_fn or current_raw_stream_fn(torch)
        self._specs_setup(torch, tdt, device_index)
        self._checked_hot = None
        self.checks = self._enable_c_checks(torch)

    def _input_slots(self, plan: DecodePlan) -> list[int]:
        """The slot of each decode operand, from the plan's `decode_inputs` (which launcher
        input's bytes each operand is)."""
        slots = {"q": _Q, "q_pad": _QPAD, "kv_pool": _KV, self._x_name: _X, self._y_name: _Y,
                 "k_scale": _KS, "v_scale": _VS}
        if self.config.lens:
            slots["table"] = _TABLE
        if len(plan.decode_inputs) != len(plan.decode.operands) or not set(
                plan.decode_inputs) <= set(slots):
            raise LauncherUnavailable(
                f"{plan.decode.name}: operands wired to {plan.decode_inputs}; this launcher has "
                f"the inputs {sorted(slots)} for {len(plan.decode.operands)} operands")
        if ("q_pad" in plan.decode_inputs) != self.padded:
            raise LauncherUnavailable(
                f"{plan.decode.name}: operands wired to {plan.decode_inputs}, but q is "
                f"{'' if self.padded else 'not '}padded for these rows")
        return [slots[name] for name in plan.decode_inputs]

    def _enable_c_checks(self, torch) -> str:
        """Move the per-call tensor checks into the C helper where it can read torch tensors
        (see interop/_launch_program.c); returns which checks run."""
        from funcmla.interop import _launch

        if self.padded:
            return "python (padded rows: q is copied before the launch)"
        if not self.program.native:
            return "python (no native helper)"
        api, how = _launch.torch_api()
        if api is None:
            return f"python ({how})"
        codes = {}
        for dtype in (self._dtype, self._kv_dtype, torch.int32, torch.float32):
            got = _launch.describe(api, torch.empty(1, dtype=dtype, device=self.device))
            if got is None:
                return "python (the shim cannot read a tensor on this device)"
            codes[dtype] = got[:3]
        mask = self.align - 1
        specs = []
        checked = [self.x_spec, self.y_spec, self.q_spec, self.kv_spec, self.out_spec,
                   self.lse_spec]  # slot order: _X, _Y, _Q, _KV, _OUT, _LSE[, _KS, _VS]
        if self._scales is not None:
            checked += [self.k_scale_spec, self.v_scale_spec]
        for spec in checked:
            dtype_code, device_type, device_index = codes[spec.dtype]
            specs.append((dtype_code, device_type, device_index, mask, sorted(spec.shapes)))
        self.program.enable_checks(api, specs)
        p = self.program
        self._checked_hot = (p.pack, p.buffer, (1 << len(p.kernels)) - 1, p.run_checked, p.ref)
        return f"C ({how})"

    @staticmethod
    def _program_kernel(k, slots: list[int]):
        from funcmla.interop import _launch

        if k.num_params < len(slots):
            raise LauncherUnavailable(f"{k.call.name} takes {k.num_params} parameters, fewer "
                                      f"than its {len(slots)} buffers")
        return _launch.ProgramKernel(k.call.name, k.function, k.grid, k.block,
                                     k.shared_mem_bytes,
                                     slots + [_NULL] * (k.num_params - len(slots)),
                                     host=getattr(k, "host", 0),
                                     host_abi=getattr(k, "host_abi", 1))

    def _specs_setup(self, torch, tdt, di) -> None:
        c, a = self.config, self.align
        t, h, d = c.num_seqs * c.s_q, c.num_heads, c.head_dim
        pool_shapes = [(c.pool_rows, d), (c.pool_rows, 1, d)]
        page_size = c.page_size
        if page_size > 1 and c.pool_rows % page_size == 0:
            pages = c.pool_rows // page_size
            pool_shapes += [(pages, page_size, d), (pages, page_size, 1, d)]
        # q and out also as [T, H * D]: the same bytes, as SGLang's layers hand them over
        self.q_spec = TensorSpec("q", tdt, [(t, h, d), (t, h * d)], di, a)
        self.kv_spec = TensorSpec("kv_pool", self._kv_dtype, pool_shapes, di, a)
        self.k_scale_spec = TensorSpec("k_scale", torch.float32, [(), (1,)], di, a)
        self.v_scale_spec = TensorSpec("v_scale", torch.float32, [(), (1,)], di, a)
        self.x_spec = TensorSpec(self._x_name, torch.int32, [self._x_shape()], di, a)
        self.y_spec = TensorSpec(self._y_name, torch.int32, [self._y_shape()], di, a)
        self.out_spec = TensorSpec("out", tdt, [self._out_shape, (t, h * c.v_head_dim)], di, a)
        self.lse_spec = TensorSpec("lse", torch.float32, [self._lse_shape], di, a)
        self._i32, self._f32 = torch.int32, torch.float32
        self._set_fast(pool_shapes[0])

    def _set_fast(self, kv_shape) -> None:
        c = self.config
        self._fast = (self._dtype, self._kv_dtype, self._i32, self._f32, torch_size(kv_shape),
                      self.device_index, self.align - 1,
                      torch_size((c.num_seqs * c.s_q, c.num_heads, c.head_dim)),
                      torch_size(self._x_shape()), torch_size(self._y_shape()),
                      torch_size(self._out_shape), torch_size(self._lse_shape))

    def _checked(self, q, kv_pool, x, y, out, lse) -> tuple[int, ...]:
        """The per-argument checks (raise LauncherArgumentError naming the argument)."""
        ptrs = (self.q_spec.pointer(q), self.kv_spec.pointer(kv_pool), self.x_spec.pointer(x),
                self.y_spec.pointer(y), self.out_spec.pointer(out), self.lse_spec.pointer(lse))
        if tuple(kv_pool.shape) != tuple(self._fast[4]):  # another accepted pool view
            self._set_fast(tuple(kv_pool.shape))
        return ptrs

    def check_pool(self, kv_pool, k_scale=None, v_scale=None) -> None:
        """The checks a call makes of kv_pool and the scales, alone (LauncherArgumentError
        naming the argument): for a caller with nothing to launch (an empty extend step)."""
        self.kv_spec.pointer(kv_pool)
        self._scale_tensors(k_scale, v_scale)

    def _scale_tensors(self, k_scale, v_scale):
        """(k, v) scale tensors of an fp8 launcher (`ScaleOperands`), (None, None) otherwise;
        raises LauncherArgumentError for a scale given to a launcher whose pool is not fp8."""
        if self._scales is not None:
            return self._scales(k_scale, v_scale)
        if k_scale is not None or v_scale is not None:
            name = "k_scale" if k_scale is not None else "v_scale"
            raise LauncherArgumentError(
                f"{name} applies to an fp8 kv_pool; this launcher's pool is "
                f"{self.config.pool_dtype} (DecodeLaunchConfig.kv_dtype=None)")
        return None, None

    def _call(self, q, kv_pool, x, y, out, lse, k_scale=None, v_scale=None, table=0):
        """table: the lens form's table pointer (checked by the caller), else 0."""
        ks, vs = self._scale_tensors(k_scale, v_scale)
        hot = self._checked_hot
        if hot is not None:  # checks and launches in one foreign call (C helper + torch shim)
            try:
                if out is None:
                    out = self._empty(self._out_shape, dtype=self._dtype, device=self.device)
                if lse is None:
                    lse = self._empty(self._lse_shape, dtype=self._f32, device=self.device)
                cq, ck, cx, cy = q._cdata, kv_pool._cdata, x._cdata, y._cdata
                co, cl = out._cdata, lse._cdata
                cks, cvs = (0, 0) if ks is None else (ks._cdata, vs._cdata)
            except AttributeError:  # not a torch tensor: the Python checks say which
                hot = None
            if hot is not None:
                pack, buf, mask, run_checked, ref = hot
                stream = self._stream(self.device_index)
                with self._lock:
                    try:
                        pack(buf, 0, stream, mask, cx, cy, cq, ck, co, cl, cks, cvs, table)
                    except (struct.error, TypeError):  # a subclass's _cdata is no address
                        rc = _BAD_ARGUMENT
                    else:
                        rc = run_checked(ref)
                        if rc > 0:
                            self._launch_failed(rc, mask, ref)
                if rc >= 0:
                    return out, lse
                # a check failed in C (nothing launched): the Python checks name the argument
        return self._call_python(q, kv_pool, x, y, out, lse, ks, vs, table)

    def _call_python(self, q, kv_pool, x, y, out, lse, ks=None, vs=None, table=0):
        dt, kdt, i32, f32, kvs, di, m, qs, xs, ys, os_, ls = self._fast
        try:
            if out is None:
                out = self._empty(os_, dtype=dt, device=self.device)
            if lse is None:
                lse = self._empty(ls, dtype=f32, device=self.device)
            pq, pk, px, py = q.data_ptr(), kv_pool.data_ptr(), x.data_ptr(), y.data_ptr()
            po, pl = out.data_ptr(), lse.data_ptr()
            ok = (q.dtype is dt and kv_pool.dtype is kdt and x.dtype is i32 and y.dtype is i32
                  and out.dtype is dt and lse.dtype is f32
                  and q.shape == qs and kv_pool.shape == kvs and x.shape == xs and y.shape == ys
                  and out.shape == os_ and lse.shape == ls
                  and q.is_contiguous() and kv_pool.is_contiguous() and x.is_contiguous()
                  and y.is_contiguous() and out.is_contiguous() and lse.is_contiguous()
                  and q.get_device() == di and kv_pool.get_device() == di
                  and x.get_device() == di and y.get_device() == di
                  and out.get_device() == di and lse.get_device() == di
                  and not (pq | pk | px | py | po | pl) & m)
        except Exception:  # noqa: BLE001 - not a tensor, no storage, ...: the slow path says
            ok = False
        if not ok:
            pq, pk, px, py, po, pl = self._checked(q, kv_pool, x, y, out, lse)
        pks = pvs = 0
        if ks is not None:
            pks, pvs = self.k_scale_spec.pointer(ks), self.v_scale_spec.pointer(vs)
        if self.padded:
            c = self.config
            self._q_pad[:, :c.rows].copy_(q.view(c.num_seqs, c.rows, -1))
        stream = self._stream(di)
        pack, buf, mask, run, ref = self._hot
        with self._lock:
            pack(buf, 0, stream, mask, px, py, pq, pk, po, pl, pks, pvs, table)
            rc = run(ref)
            if rc:
                self._launch_failed(rc, mask, ref)
        if self.padded:
            r = self.config.rows
            out.view(self.config.num_seqs, r, -1).copy_(self._out_pad[:, :r])
            lse.view(self.config.num_seqs, r).copy_(self._lse_pad[:, :r])
        return out, lse

    def _launch_failed(self, rc: int, mask: int, ref) -> None:
        from funcmla.interop import _cuda_driver as cd

        k = self.program.failed_kernel
        first = (mask & -mask).bit_length() - 1
        if rc == cd.CUDA_ERROR_INVALID_CONTEXT and k is self.program.kernels[first]:
            # Nothing was launched: this thread had no current context. Use the primary one.
            cd.driver().make_current(self.device_index)
            rc = self.program.run(ref)
            if not rc:
                return
            k = self.program.failed_kernel
        cd.driver().check_launch(rc, k.name if k is not None else "?")

    def info(self) -> dict:
        kernels = [self.decode] + ([self.merge] if self.merge else [])
        return {"config": dataclasses.asdict(self.config), "num_splits": self.plan.num_splits,
                "kernel": self.plan.kernel, "kernel_reason": self.plan.kernel_reason,
                "padded": self.padded, "launch": self.program.how, "checks": self.checks,
                "kernels": [k.info() for k in kernels]}


def torch_size(shape):
    import torch

    return torch.Size(shape)


class DecodeLauncher(_DecodeLauncherBase):
    """`mla_decode` on torch tensors for one static configuration (token CSR, page size 1).

    __call__(q [T, H, 576] (or [T, H * 576]), kv_pool [pool_rows, 576] (or [pool_rows, 1,
    576]), kv_indptr int32 [B+1] (tokens), kv_indices int32 [kv_capacity] (token slots),
    out=None [T, H, 512] (or [T, H * 512]), lse=None float32 [T, H], k_scale=None,
    v_scale=None) -> (out, lse), written on torch's
    current stream: the decode kernel `mla_decode` picks (Mosaic GPU or Triton; `plan.kernel`),
    then the merge kernel when the configuration splits the KV (one foreign call). out/lse are
    allocated (torch.empty) unless given; give them for the fastest call. Results equal
    `mla_decode` on the same inputs bit for bit (Triton kernels on the "xla" route).
    k_scale / v_scale: an fp8 pool's (DecodeLaunchConfig.kv_dtype) per-layer scales, each a
    float or a float32 tensor of shape () or [1] on the launcher's device (v_scale defaults to
    k_scale, k_scale to 1; `funcmla.interop.launcher.scales`); an error for other pools.
    """

    _x_name, _y_name = "kv_indptr", "kv_indices"

    def _x_shape(self):
        return (self.config.num_seqs + 1,)

    def _y_shape(self):
        return (self.config.kv_capacity,)

    def __call__(self, q, kv_pool, kv_indptr, kv_indices, *, out=None, lse=None, k_scale=None,
                 v_scale=None):
        return self._call(q, kv_pool, kv_indptr, kv_indices, out, lse, k_scale, v_scale)


class PagedDecodeLauncher(_DecodeLauncherBase):
    """`mla_decode(page_table=...)` on torch tensors for one static configuration (page size
    > 1; FlashMLA-style block table).

    __call__(q [T, H, 576] (or [T, H * 576]), kv_pool [pool_rows, 576] (or [pool_rows, 1, 576],
    [pool_rows / page_size, page_size, 576], [pool_rows / page_size, page_size, 1, 576]),
    page_table int32 [B, max_pages] (page ids), lengths int32 [B] (tokens), out=None, lse=None,
    k_scale=None, v_scale=None) -> (out, lse).
    """

    _x_name, _y_name = "page_table", "lengths"

    def _x_shape(self):
        return (self.config.num_seqs, self.config.max_pages)

    def _y_shape(self):
        return (self.config.num_seqs,)

    def __call__(self, q, kv_pool, page_table, lengths, *, out=None, lse=None, k_scale=None,
                 v_scale=None):
        return self._call(q, kv_pool, page_table, lengths, out, lse, k_scale, v_scale)


class LensDecodeLauncher(_DecodeLauncherBase):
    """The decode kernels over the "lens" form of `KVRows` (DecodeLaunchConfig.lens): the
    extend launcher's pseudo-sequences, which share their request's table entries.

    __call__(q [T, H, 576] (or [T, H * 576]), kv_pool (as `PagedDecodeLauncher` takes it at
    page_size > 1, else as `DecodeLauncher`), table_start int32 [B] (entries), kv_lens int32
    [B] (tokens, <= max_kv_len), table int32 [kv_capacity] (token slots, or page ids), out=None,
    lse=None, k_scale=None, v_scale=None) -> (out, lse). Sequence b reads entries
    table[table_start[b] + t // page_size] for t < kv_lens[b].
    """

    _x_name, _y_name = "table_start", "kv_lens"

    def _x_shape(self):
        return (self.config.num_seqs,)

    def _y_shape(self):
        return (self.config.num_seqs,)

    def _specs_setup(self, torch, tdt, di) -> None:
        super()._specs_setup(torch, tdt, di)
        self.table_spec = TensorSpec("table", torch.int32, [(self.config.kv_capacity,)], di,
                                     self.align)

    def __call__(self, q, kv_pool, table_start, kv_lens, table, *, out=None, lse=None,
                 k_scale=None, v_scale=None):
        return self._call(q, kv_pool, table_start, kv_lens, out, lse, k_scale, v_scale,
                          self.table_spec.pointer(table))


_LAUNCHERS: dict[tuple[DecodeLaunchConfig, int], _DecodeLauncherBase] = {}
_LAUNCHERS_LOCK = threading.Lock()


def decode_launcher(config: DecodeLaunchConfig, device=None):
    """The launcher of `config` on `device` (a torch device, index or None for the current
    CUDA device): built (lowered, compiled, loaded) on first use and cached. A
    `LensDecodeLauncher` for config.lens, else a `DecodeLauncher` for page_size 1 and a
    `PagedDecodeLauncher` above."""
    import torch

    index = cuda_device_index(device)
    key = (config, index)
    with _LAUNCHERS_LOCK:
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            cls = (LensDecodeLauncher if config.lens else
                   DecodeLauncher if config.page_size == 1 else PagedDecodeLauncher)
            launcher = cls(decode_plan(config), torch.device("cuda", index))
            _LAUNCHERS[key] = launcher
    return launcher

