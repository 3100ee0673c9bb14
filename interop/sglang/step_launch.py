"""The step's metadata program on torch's stream: XLA's own kernels, no JAX dispatch per step.

`build_step` (funcmla.interop.sglang.step) is compiled by XLA once per StepSpec, as for the
JAX path; its serialized executable is read back (`funcmla.interop._xla_program`: every thunk
a kernel launch or a device copy over the executable's buffer allocations), and `StepLauncher`
replays it with torch-owned buffers allocated once per spec:

  parameter 0 (req_to_token)  the backend's torch tensor itself (its address is fixed);
  parameter 1 (the inputs)    a static int32 buffer of the spec's length;
  outputs and temporaries     one arena tensor, each allocation at a 256-byte-aligned offset;
                              the packed output may instead be a caller's buffer (the CUDA-graph
                              static buffer), which the program then writes in place.

The steps (kernel launches, device copies) are captured once into a CUDA graph, after one run
checked against XLA's own run of the executable (a wrongly read program is refused, not run).
A step is one foreign call
(`_launch.StageProgram`): the step's index tensors copied into the input buffer (int64 tensors
through their low words), the live batch size written with a memset, then the graph launched,
all on torch's current stream, nothing waiting on the host. The outputs equal `build_step`'s
bit for bit (the same machine code on the same inputs; tests/test_interop_sglang_launch.py).

Where this cannot run (no CUDA device, JAX not on the GPU, an untested jaxlib, no C compiler,
a program holding something other than kernel launches) `step_launch_unavailable` says why and
the backend keeps the JAX path (`FuncMLAAttnBackend.metadata_launcher_reason`).
Host time per step: `python -m bench.interop --device cuda`; figures in docs/sglang_backend.md.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import torch

from funcmla.interop._xla_program import (
    CopyLaunch,
    UnsupportedProgram,
    XlaProgram,
    arena_layout,
    copy_pointers,
    kernel_pointers,
    parse_program,
    pointer_slots,
)
from funcmla.interop.sglang.step import StepSpec, build_step, num_parts, step_layout

__all__ = ["StepLauncher", "StepLauncherUnavailable", "step_launch_unavailable", "step_program"]

_DRIVER_SYMBOLS = ("cuMemcpy2DAsync_v2", "cuMemsetD32Async", "cuGraphLaunch")
_WORD = {torch.int32: 4, torch.int64: 8}  # dtypes read in place: bytes per element


class StepLauncherUnavailable(RuntimeError):
    """The step program cannot be launched on torch's stream here (the message says why)."""


def step_launch_unavailable(device) -> str | None:
    """None where StepLauncher can run on `device` (a torch device), else why not."""
    if os.environ.get("FUNCMLA_METADATA_LAUNCHER", "1") == "0":
        return "disabled by FUNCMLA_METADATA_LAUNCHER=0"
    if torch.device(device).type != "cuda":
        return f"the backend's device is {torch.device(device).type}, not CUDA"
    try:
        import jax

        if jax.default_backend() != "gpu":
            return f"JAX's default backend is {jax.default_backend()!r}, not the GPU"
    except Exception as err:  # noqa: BLE001 - no usable JAX backend
        return f"JAX has no backend here ({type(err).__name__}: {err})"
    from funcmla.interop._launch import native_library
    from funcmla.interop.launcher.support import jaxlib_unsupported_reason

    why = jaxlib_unsupported_reason()
    if why is not None:
        return why
    lib, how = native_library()
    if lib is None:
        return f"no native launch helper ({how})"
    if not hasattr(torch.cuda, "CUDAGraph"):
        return "this torch has no CUDA graphs"
    return None


def step_program(spec: StepSpec, req_to_token_shape: tuple[int, int]):
    """(XlaProgram, output leaves as jax.ShapeDtypeStruct, meta treedef, the compiled
    executable) of `build_step` for `spec` at req_to_token [pool, max_context_len], compiled
    by XLA on the default backend."""
    import jax
    import jax.numpy as jnp

    from funcmla.interop._xla_kernels import _serialized_executable

    r2t = jax.ShapeDtypeStruct(tuple(req_to_token_shape), jnp.int32)
    inputs = jax.ShapeDtypeStruct((num_parts(spec.kind) * spec.batch + 1,), jnp.int32)
    compiled = build_step.lower(r2t, inputs, spec=spec).compile()
    blob = _serialized_executable(compiled)
    if blob is None:
        raise UnsupportedProgram("this backend does not serialize its executables")
    meta, packed = jax.eval_shape(lambda a, b: build_step(a, b, spec=spec), r2t, inputs)
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    return parse_program(blob), leaves + [packed], treedef, compiled


def _check_outputs(program: XlaProgram, leaves) -> None:
    for i, leaf in enumerate(leaves):
        alloc = program.outputs.get(i)
        nbytes = int(leaf.size) * leaf.dtype.itemsize
        if alloc is None or program.allocations[alloc].kind != "output" or \
                program.allocations[alloc].size != nbytes:
            got = None if alloc is None else program.allocations[alloc]
            raise UnsupportedProgram(f"output {i} ({leaf.shape} {leaf.dtype}, {nbytes} bytes) is "
                                     f"not one allocation of its own: {got}")


class StepLauncher:
    """`build_step` for one StepSpec on torch tensors (see the module docstring).

    req_to_token: the backend's int32 [pool, max_context_len] CUDA tensor (read in place).
    packed_out:   optional int32 tensor of `step_layout(spec).size` elements the program writes
                  its packed output into (the CUDA-graph static buffer); default: the arena.
    Raises StepLauncherUnavailable / UnsupportedProgram where it cannot be built.
    """

    def __init__(self, spec: StepSpec, req_to_token, packed_out=None):
        from funcmla.interop import _cuda_driver as cd
        from funcmla.interop._launch import LaunchProgram, ProgramKernel, StageProgram

        why = step_launch_unavailable(req_to_token.device)
        if why is not None:
            raise StepLauncherUnavailable(why)
        if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or \
                not req_to_token.is_contiguous():
            raise StepLauncherUnavailable("req_to_token must be a contiguous int32 2-D tensor")
        self.spec, self.device = spec, req_to_token.device
        self.layout = step_layout(spec)
        program, leaves, self._meta_tree, compiled = step_program(spec,
                                                                  tuple(req_to_token.shape))
        _check_outputs(program, leaves)
        self.program = program
        packed_alloc = program.outputs[len(leaves) - 1]
        n_in = num_parts(spec.kind) * spec.batch + 1
        self.inputs = torch.zeros(n_in, dtype=torch.int32, device=self.device)
        params = {0: req_to_token, 1: self.inputs}
        bases = {}
        for number, tensor in params.items():
            a = program.parameter_allocation(number)
            if a.size != tensor.numel() * tensor.element_size():
                raise UnsupportedProgram(f"parameter {number} holds {a.size} bytes; the tensor "
                                         f"has {tensor.numel() * tensor.element_size()}")
            bases[a.index] = tensor.data_ptr()
        exclude = ()
        if packed_out is not None:
            if packed_out.dtype != torch.int32 or packed_out.numel() != self.layout.size or \
                    not packed_out.is_contiguous() or packed_out.device != self.device:
                raise StepLauncherUnavailable(
                    f"packed_out must be a contiguous int32 tensor of {self.layout.size} "
                    f"elements on {self.device}")
            bases[packed_alloc] = packed_out.data_ptr()
            exclude = (packed_alloc,)
        offsets, total = arena_layout(program, exclude)
        self.arena = torch.empty(max(total, 256), dtype=torch.uint8, device=self.device)
        base = self.arena.data_ptr()
        bases.update({a: base + off for a, off in offsets.items()})
        self.packed = packed_out if packed_out is not None else self._view(
            bases[packed_alloc], leaves[-1])
        self._meta_views = [self._view(bases[program.outputs[i]], leaf)
                            for i, leaf in enumerate(leaves[:-1])]
        fixed, rows = pointer_slots(kernel_pointers(program, bases))
        drv = cd.driver()
        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        loaded: dict = {}
        kernels = []
        for k, row in zip(program.kernels, rows):
            key = (k.image, k.entry)
            if key not in loaded:
                loaded[key] = drv.load_function(k.image, k.entry, index)[1]
            fn = loaded[key]
            if k.shared_mem_bytes > 48 * 1024:
                drv.set_function_attribute(fn, cd.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           k.shared_mem_bytes)
            kernels.append(ProgramKernel(k.name, fn, k.grid, k.block, k.shared_mem_bytes, row))
        try:
            self.launch_program = LaunchProgram(kernels, 0, fixed, drv.launch_address,
                                                native=True)
        except ValueError as err:
            raise UnsupportedProgram(f"the step program does not fit a launch program: {err}")
        self._memcpy = drv.lib.cuMemcpyDtoDAsync_v2
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                 ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._segments = self._plan_segments(program, copy_pointers(program, bases))
        self.graph = self._capture()
        try:  # the instantiated graph, launched from C; else torch's replay() after the copies
            graph_exec = int(self.graph.raw_cuda_graph_exec())
        except (AttributeError, RuntimeError):
            graph_exec = 0
        self._replay = None if graph_exec else self.graph.replay
        addrs = tuple(ctypes.cast(getattr(drv.lib, name), ctypes.c_void_p).value
                      for name in _DRIVER_SYMBOLS)
        live_dst = self.inputs.data_ptr() + 4 * (n_in - 1)
        self.stage = StageProgram(live_dst, graph_exec, addrs)
        # under a caller's stream capture: the copies, then the kernels themselves (captured)
        self._stage_kernels = StageProgram(live_dst, 0, addrs)
        self._inputs_ptr = self.inputs.data_ptr()
        self._stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda i: torch.cuda.current_stream(i).cuda_stream)
        self._index = index
        self._lock = threading.Lock()
        self._check_against_xla(compiled, req_to_token)

    @staticmethod
    def _plan_segments(program: XlaProgram, copies) -> list[tuple]:
        """The steps as ("kernels", mask of launch-program kernels) and ("copy", src, dst,
        bytes) segments, in order."""
        segments, mask, k, c = [], 0, 0, 0
        for step in program.steps:
            if isinstance(step, CopyLaunch):
                if mask:
                    segments.append(("kernels", mask))
                    mask = 0
                segments.append(("copy", *copies[c]))
                c += 1
            else:
                mask |= 1 << k
                k += 1
        if mask:
            segments.append(("kernels", mask))
        return segments

    def _enqueue(self, stream: int) -> None:
        """Every step of the program on `stream`, one by one (capture time, or under a
        caller's capture)."""
        prog = self.launch_program
        for seg in self._segments:
            if seg[0] == "kernels":
                rc = prog.launch(stream, seg[1])
                if rc:
                    failed = prog.failed_kernel
                    raise StepLauncherUnavailable(
                        f"launching {failed.name if failed else '?'} failed: CUresult {rc}")
            else:
                _, src, dst, nbytes = seg
                rc = self._memcpy(dst, src, nbytes, stream)
                if rc:
                    raise StepLauncherUnavailable(f"cuMemcpyDtoDAsync failed: CUresult {rc}")

    def _check_against_xla(self, compiled, req_to_token) -> None:
        """Run the launched program once on a random full batch and compare its packed output
        with XLA's own run of the same executable (a sync, once per launcher): a program read
        wrongly is refused here instead of feeding wrong metadata to a step."""
        import jax.numpy as jnp

        from funcmla.interop.dlpack import to_jax
        from funcmla.metadata import draft_keys

        spec, (pool, ctx) = self.spec, req_to_token.shape
        rng = np.random.default_rng(0)
        bp, extra = spec.batch, draft_keys(spec.kind, spec.n)
        lo = {"decode": 1, "extend": 1, "target_verify": 0}.get(spec.kind, spec.n)
        hi = max(lo, min(ctx - extra, spec.capacity // bp - extra))
        seq = rng.integers(lo, hi + 1, bp)
        parts = [rng.integers(0, pool, bp), seq]
        if spec.kind == "extend":
            parts.append(rng.integers(0, np.minimum(seq, spec.max_q_len) + 1))
        flat = np.concatenate(parts + [np.array([bp])]).astype(np.int32)
        self(bp, [torch.tensor(p, dtype=torch.int32, device=self.device) for p in parts])
        got = self.packed.cpu().numpy()  # syncs torch's stream
        _, want = compiled(to_jax(req_to_token), jnp.asarray(flat))
        want = np.asarray(want)
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = int(np.flatnonzero(got.reshape(-1) != want.reshape(-1))[0]) \
                if got.shape == want.shape else -1
            raise UnsupportedProgram(
                f"the launched {spec.kind} program differs from XLA's run of it (first at "
                f"packed word {bad}): the executable was read wrongly; keeping the JAX path")

    def _view(self, address: int, leaf):
        """The int32 tensor of `leaf`'s shape at `address` inside a tensor this launcher holds."""
        for owner in (self.arena, self.inputs):
            start = owner.data_ptr()
            if start <= address < start + owner.numel() * owner.element_size():
                flat = owner.view(torch.uint8)[address - start:]
                n = int(leaf.size)
                return flat[:4 * n].view(torch.int32).view(tuple(leaf.shape))
        raise UnsupportedProgram(f"address {address:#x} is in none of the launcher's buffers")

    def _capture(self):
        """The program's steps captured once into a CUDA graph (on a side stream)."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, stream=side):
            self._enqueue(side.cuda_stream)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph

    def __call__(self, batch: int, parts) -> None:
        """Run the program for a batch of `batch` live requests on torch's current stream.

        parts: the step's index tensors in `build_step`'s input order (req_pool_indices,
        seq_lens[, extend_seq_lens]), each with at least `batch` entries, int32 or int64 on this
        device (others are converted first). Nothing is checked here beyond dtypes and
        devices: the caller checked the step (host_checks)."""
        bp = self.spec.batch
        if not 0 < batch <= bp:
            raise ValueError(f"batch {batch} is outside the program's [1, {bp}] requests")
        srcs, pitches, keep = [0, 0, 0, 0], [4, 4, 4, 4], []
        for i, t in enumerate(parts):
            if t.dtype not in _WORD or t.device != self.device:
                t = t[:batch].to(self.device, torch.int32)
                keep.append(t)  # freed after the call: the copy is ordered before any reuse
            srcs[i] = t.data_ptr()
            pitches[i] = t.stride(0) * _WORD.get(t.dtype, 4)
        k = len(parts)
        base = self._inputs_ptr
        stream = self._stream(self._index)
        capturing = torch.cuda.is_current_stream_capturing()
        stage = self._stage_kernels if capturing or self._replay is not None else self.stage
        with self._lock:  # the stage struct and the static buffers: one step at a time
            stage.pack(stage.buffer, 0, stream, k, batch, *srcs, *pitches,
                       batch, batch if k > 1 else 0, batch if k > 2 else 0, 0,
                       base, base + 4 * batch, base + 8 * batch, base + 12 * batch)
            rc = stage.run(stage.ref)
            if rc:
                raise RuntimeError(f"the step program's staging failed at step "
                                   f"{stage.failed} (0-3 copies, 4 memset, 5 graph): "
                                   f"CUresult {rc}")
            if capturing:
                self._enqueue(stream)
            elif self._replay is not None:
                self._replay()

    def jax_meta(self):
        """funcmla's ForwardMetadata of the padded batch as JAX arrays aliasing this launcher's
        outputs (one DLPack import per field), for the JAX attention paths; its values are
        the last call's until the next call."""
        import jax

        from funcmla.interop.dlpack import to_jax

        return jax.tree_util.tree_unflatten(self._meta_tree,
                                            [to_jax(v) for v in self._meta_views])
