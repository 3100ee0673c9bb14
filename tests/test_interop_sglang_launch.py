"""The step program on torch's stream (funcmla.interop._xla_program, interop/sglang/step_launch).

CPU: the parser and the program builder against the step programs' serialized executables
XLA built on the H200 with jaxlib 0.11.2 (tests/data/xla_step_*.bin: `python -m bench.step_dump`'s
step_decode_b64_p1.bin, step_verify_b64_n4.bin and step_decode_b64_noplan.bin, renamed), and
edited copies of them for each refusal and for the device-to-device copy steps.
GPU (`gpu` marker): the launched program's outputs equal `build_step`'s bit for bit for random
batches in every mode, eager and through CUDA-graph capture / replay, via the backend.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from funcmla.config import H200
from funcmla.interop._containers import try_proto_fields
from funcmla.interop._xla_kernels import cubin_entries, executable_records
from funcmla.interop._xla_program import (
    CopyLaunch,
    UnsupportedProgram,
    arena_layout,
    copy_pointers,
    kernel_pointers,
    parse_gpu_executable,
    parse_program,
    pointer_slots,
)
from funcmla.interop.sglang.step import StepSpec, build_step, num_parts, step_layout
from funcmla.interop.sglang.step_launch import (
    StepLauncher,
    StepLauncherUnavailable,
    _check_outputs,
)
from funcmla.interop.sglang.workplan import PlanSettings

_DATA = pathlib.Path(__file__).parent / "data"
POOL, CTX = 256, 4096  # bench.step_dump's req_to_token shape
FIXTURES = {
    "xla_step_decode_b64_jaxlib0112.bin": StepSpec(
        "decode", 64, 1 << 18, 0, 1, PlanSettings(device=H200, num_heads=16, page_size=1)),
    "xla_step_verify_b64_n4_jaxlib0112.bin": StepSpec(
        "target_verify", 64, 1 << 18, 4, 4,
        PlanSettings(device=H200, num_heads=16, page_size=1, num_draft_tokens=4)),
    "xla_step_decode_noplan_jaxlib0112.bin": StepSpec("decode", 64, 1 << 18, 0, 1, None),
}


def _leaves(spec):
    r2t = jax.ShapeDtypeStruct((POOL, CTX), jnp.int32)
    inputs = jax.ShapeDtypeStruct((num_parts(spec.kind) * spec.batch + 1,), jnp.int32)
    meta, packed = jax.eval_shape(lambda a, b: build_step(a, b, spec=spec), r2t, inputs)
    return jax.tree_util.tree_leaves(meta) + [packed]


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def fixture(request):
    blob = (_DATA / request.param).read_bytes()
    return FIXTURES[request.param], blob, parse_program(blob)


def test_step_programs_are_kernel_launches_over_their_allocations(fixture):
    spec, _blob, prog = fixture
    assert 10 <= len(prog.kernels) <= 32
    r2t = prog.parameter_allocation(0)
    inputs = prog.parameter_allocation(1)
    assert r2t.size == POOL * CTX * 4
    assert inputs.size == (num_parts(spec.kind) * spec.batch + 1) * 4
    leaves = _leaves(spec)
    _check_outputs(prog, leaves)  # each output leaf is one output allocation of its size
    assert prog.allocations[prog.outputs[len(leaves) - 1]].size == step_layout(spec).size * 4
    for k in prog.kernels:
        decls, _block = cubin_entries(k.image)[k.entry]
        assert len(decls) == len(k.args) and all(".u64" in d for d in decls)
        assert all(g >= 1 for g in k.grid) and 1 <= k.block[0] * k.block[1] * k.block[2] <= 1024
        assert len(k.written) == len(k.args) and any(k.written)
        for alloc, offset, size in k.args:
            a = prog.allocations[alloc]
            assert a.kind in ("parameter", "output", "temp") and 0 <= offset <= offset + size <= a.size
    # some kernel writes the whole packed output
    packed = prog.outputs[len(leaves) - 1]
    whole = (packed, 0, prog.allocations[packed].size)
    assert any(w and arg == whole for k in prog.kernels for arg, w in zip(k.args, k.written))


def test_arena_places_outputs_and_temps_without_overlap(fixture):
    _spec, _blob, prog = fixture
    offsets, total = arena_layout(prog)
    used = {a for k in prog.kernels for a, _, _ in k.args}
    want = {a.index for a in prog.allocations if a.kind in ("output", "temp")
            and (a.index in used or a.index in prog.outputs.values())}
    assert set(offsets) == want
    spans = sorted((off, off + prog.allocations[a].size) for a, off in offsets.items())
    assert all(off % 256 == 0 for off, _ in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:])) and spans[-1][1] <= total
    packed = prog.outputs[max(i for i in prog.outputs)]
    kept, total2 = arena_layout(prog, exclude=(packed,))
    assert packed not in kept and total2 < total


def test_kernel_pointers_are_base_plus_slice_offset(fixture):
    _spec, _blob, prog = fixture
    offsets, _ = arena_layout(prog)
    bases = {a: 0x7F00_0000_0000 + off for a, off in offsets.items()}
    bases[prog.parameter_allocation(0).index] = 0x1000_0000
    bases[prog.parameter_allocation(1).index] = 0x2000_0000
    rows = kernel_pointers(prog, bases)
    for k, row in zip(prog.kernels, rows):
        assert row == tuple(bases[a] + off for a, off, _ in k.args)
    fixed, slots = pointer_slots(rows)
    assert len(fixed) == len({p for row in rows for p in row})
    assert all(tuple(fixed[s] for s in srow) == row for srow, row in zip(slots, rows))
    del bases[prog.parameter_allocation(0).index]
    with pytest.raises(UnsupportedProgram, match=r"allocation #\d+ \(parameter\)"):
        kernel_pointers(prog, bases)


# ---- refusals: edited copies of a real executable --------------------------------------------
def _encode(fields) -> bytes:
    def varint(v):
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)
    out = bytearray()
    for f, w, v in fields:
        out += varint(f << 3 | w)
        out += varint(v) if w == 0 else (varint(len(v)) + v if w == 2 else v)
    return bytes(out)


def _record():
    blob = (_DATA / "xla_step_decode_noplan_jaxlib0112.bin").read_bytes()
    return max(executable_records(blob), key=len)


def _edit_first_thunk(edit) -> bytes:
    rec = try_proto_fields(_record())
    i = next(i for i, (f, _, _) in enumerate(rec) if f == 13)
    f, w, thunk = rec[i]
    rec[i] = (f, w, _encode(edit(try_proto_fields(thunk))))
    return _encode(rec)


def test_a_while_thunk_is_refused_naming_it():
    rec = _edit_first_thunk(lambda t: [t[0], (7, 2, b"")])
    with pytest.raises(UnsupportedProgram, match=r"is a while thunk; only custom kernel"):
        parse_gpu_executable(rec)


def _slice_msg(alloc, offset, size, shaped):
    sl = _encode([(1, 0, offset), (2, 0, size), (3, 0, alloc)])
    return _encode([(1, 2, sl)]) if shaped else sl


@pytest.mark.parametrize("kind,shaped", [(13, False), (13, True), (3, False)])
def test_a_device_to_device_copy_becomes_a_copy_step(kind, shaped):
    prog0 = parse_gpu_executable(_record())
    temp = next(a for a in prog0.allocations if a.kind == "temp")
    out = prog0.outputs[0]
    copy = _encode([(1, 2, _slice_msg(temp.index, 64, 256, shaped)),
                    (2, 2, _slice_msg(out, 0, 256, shaped)), (3, 0, 200)])
    body = _encode([(1, 2, copy)]) if kind == 13 else copy
    prog = parse_gpu_executable(_edit_first_thunk(lambda t: [t[0], (kind, 2, body)]))
    step = prog.steps[0]
    assert isinstance(step, CopyLaunch)
    assert (step.src, step.dst, step.nbytes) == ((temp.index, 64, 256), (out, 0, 256), 200)
    assert len(prog.kernels) == len(prog0.kernels) - 1
    offsets, _ = arena_layout(prog)
    bases = {a: 1 << 40 | off for a, off in offsets.items()}
    assert copy_pointers(prog, bases) == [(bases[temp.index] + 64, bases[out], 200)]
    # launch segments: the copy first, then one mask over every kernel
    segs = StepLauncher._plan_segments(prog, copy_pointers(prog, bases))
    assert segs == [("copy", bases[temp.index] + 64, bases[out], 200),
                    ("kernels", (1 << len(prog.kernels)) - 1)]
    # a copy between kernels splits the kernels' mask around it
    steps = prog.steps[1:3] + prog.steps[:1] + prog.steps[3:]
    mid = type(prog)(prog.allocations, prog.outputs, steps)
    segs = StepLauncher._plan_segments(mid, copy_pointers(mid, bases))
    assert [s[0] for s in segs] == ["kernels", "copy", "kernels"]
    assert segs[0][1] == 0b11 and segs[2][1] == ((1 << len(prog.kernels)) - 1) & ~0b11


def test_a_copy_larger_than_its_slices_is_refused():
    copy = _encode([(1, 2, _slice_msg(1, 0, 16, False)), (2, 2, _slice_msg(2, 0, 8, False)),
                    (3, 0, 16)])
    with pytest.raises(UnsupportedProgram, match=r"16 bytes from a 16-byte to a 8-byte slice"):
        parse_gpu_executable(_edit_first_thunk(lambda t: [t[0], (13, 2, _encode([(1, 2, copy)]))]))
    odd = copy + _encode([(7, 0, 1)])
    with pytest.raises(UnsupportedProgram, match=r"fields \[1, 2, 3, 7\] are not understood"):
        parse_gpu_executable(_edit_first_thunk(lambda t: [t[0], (3, 2, odd)]))


def test_constants_are_refused():
    rec = try_proto_fields(_record()) + [(12, 2, b"\x0a\x01x")]
    with pytest.raises(UnsupportedProgram, match=r"1 constants"):
        parse_gpu_executable(_encode(rec))


def _edit_kernel(edit):
    def on_thunk(t):
        return [(f, w, _encode(edit(try_proto_fields(v))) if f == 36 else v) for f, w, v in t]
    return _edit_first_thunk(on_thunk)


def test_a_slice_past_its_allocation_is_refused():
    def grow(k):  # the first argument's slice gets an offset past its allocation's end
        out, done = [], False
        for f, w, v in k:
            if f == 1 and not done:
                arg = try_proto_fields(v)
                sl = try_proto_fields(arg[0][2])
                sl = [(g, x, y) for g, x, y in sl if g != 1] + [(1, 0, 1 << 30)]
                v = _encode([(1, 2, _encode(sl))] + arg[1:])
                done = True
            out.append((f, w, v))
        return out
    with pytest.raises(UnsupportedProgram, match=r"slice \[1073741824, .*outside allocation"):
        parse_gpu_executable(_edit_kernel(grow))


def test_a_kernel_whose_parameters_are_not_its_arguments_is_refused():
    def drop_arg(k):  # one argument fewer than the cubin's parameters and the arity
        firsts = [i for i, (f, _, _) in enumerate(k) if f == 1]
        return [x for i, x in enumerate(k) if i != firsts[-1]]
    with pytest.raises(UnsupportedProgram, match=r"arity \d+ != \d+ arguments"):
        parse_gpu_executable(_edit_kernel(drop_arg))


def test_unknown_kernel_fields_are_refused():
    with pytest.raises(UnsupportedProgram, match=r"custom kernel fields \[9\]"):
        parse_gpu_executable(_edit_kernel(lambda k: k + [(9, 0, 1)]))


def test_an_executable_without_thunks_is_refused():
    blob = (_DATA / "xla_executable_probe_jaxlib0112.bin").read_bytes()
    assert len(parse_program(blob).kernels) == 1  # the probe is one Pallas launch
    with pytest.raises(UnsupportedProgram, match=r"no GpuExecutableProto"):
        parse_program(b"not an executable")


def test_the_launcher_names_why_it_cannot_run_on_the_cpu():
    spec = FIXTURES["xla_step_decode_noplan_jaxlib0112.bin"]
    with pytest.raises(StepLauncherUnavailable, match=r"device is cpu, not CUDA"):
        StepLauncher(spec, torch.zeros((4, 8), dtype=torch.int32))


# ---- GPU: bit-identical to build_step, eager and CUDA graphs --------------------------------
def _gpu_ready():
    if not torch.cuda.is_available():
        return False
    try:
        return jax.default_backend() == "gpu"
    except Exception:  # noqa: BLE001
        return False


def gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not _gpu_ready(),
                                              reason="needs torch + JAX CUDA")(fn))


def _random_inputs(rng, kind, batch, bp, pool, ctx, n):
    rpi = rng.permutation(pool)[:batch].astype(np.int32)
    lo = {"decode": 1, "target_verify": 0, "draft_extend": n, "extend": 1}[kind]
    hi = ctx - (n if kind == "target_verify" else 0)
    seq = rng.integers(lo, hi + 1, batch).astype(np.int32)
    parts = [rpi, seq]
    if kind == "extend":
        parts.append(rng.integers(0, np.minimum(seq, 16) + 1).astype(np.int32))
    k = len(parts)
    flat = np.concatenate(parts + [np.full(k * (bp - batch), 7, np.int32),
                                   np.array([batch], np.int32)])
    return parts, flat


@gpu
@pytest.mark.parametrize("kind,n", [("decode", 0), ("target_verify", 4), ("draft_extend", 2),
                                    ("extend", 0)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_launched_step_equals_build_step(kind, n, dtype):
    from funcmla.interop.dlpack import to_jax

    rng = np.random.default_rng(len(kind) * 10 + n + (dtype == torch.int64))
    pool, ctx, bp = 24, 96, 16
    r2t = torch.tensor(rng.integers(0, 1 << 20, (pool, ctx)), dtype=torch.int32, device="cuda")
    plan = PlanSettings(device=H200, num_heads=16, page_size=1, num_draft_tokens=n)
    q = 16 if kind == "extend" else max(1, n)
    spec = StepSpec(kind, bp, 2048, n, q, plan)
    try:
        launcher = StepLauncher(spec, r2t)
    except UnsupportedProgram as err:  # a program the launcher refuses keeps the JAX path
        pytest.skip(f"{kind}: {err}")
    for batch in (1, 5, bp):
        parts, flat = _random_inputs(rng, kind, batch, bp, pool, ctx, n)
        launcher(batch, [torch.tensor(p, dtype=dtype, device="cuda") for p in parts])
        meta, packed = build_step(to_jax(r2t), jnp.asarray(flat), spec=spec)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(launcher.packed.cpu().numpy(), np.asarray(packed))
        got = launcher.jax_meta()
        for name in ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len", "max_kv_len"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                          np.asarray(getattr(meta, name)))
    with pytest.raises(ValueError, match=r"batch 17 is outside the program's \[1, 16\]"):
        launcher(bp + 1, [torch.zeros(bp + 1, dtype=dtype, device="cuda")] * 2)


def _backend(launch: bool, pool, ctx, n=0):
    from funcmla.interop.sglang_backend import FuncMLAAttnBackend, MLATokenToKVPool

    rng = np.random.default_rng(7)
    r2t = torch.tensor(rng.integers(0, 1 << 20, (pool, ctx)), dtype=torch.int32, device="cuda")
    kv = MLATokenToKVPool(64, 16, torch.bfloat16, 1, device="cuda")
    return FuncMLAAttnBackend(r2t, kv, page_size=16, num_heads=16, num_draft_tokens=n,
                              attention_backend="reference", metadata_launcher=launch)


_FIELDS = ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len", "work_indptr",
           "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")


def _same_metadata(a, b):
    for name in _FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        assert torch.equal(x.cpu(), y.cpu()), name
    assert (a.max_q_len, a.max_kv_len) == (b.max_q_len, b.max_kv_len)
    ptrs = a.work_metadata.view(torch.int64).tolist()
    assert ptrs == [a.work_indptr.data_ptr(), a.work_info_set.data_ptr()]


@gpu
@pytest.mark.parametrize("mode,n", [("DECODE", 0), ("TARGET_VERIFY", 3)])
def test_backend_launched_metadata_equals_the_jax_path(mode, n):
    """Eager steps and CUDA-graph capture / replay: the launched metadata equals the JAX path's
    field for field (the JAX path is checked against the planner oracles in
    test_interop_sglang_plan.py)."""
    from funcmla.interop.sglang_backend import ForwardBatch, ForwardMode, SpecInfo

    pool, ctx = 40, 512
    fast, ref = _backend(True, pool, ctx, n), _backend(False, pool, ctx, n)
    assert fast.metadata_launcher_reason is None
    assert ref.metadata_launcher_reason == "metadata_launcher=False"
    rng = np.random.default_rng(3)
    fm = getattr(ForwardMode, mode)
    spec = SpecInfo(draft_token_num=n) if n else None
    for b in (fast, ref):
        b.init_cuda_graph_state(max_bs=24, max_num_tokens=24 * max(1, n))
    for step in range(6):
        bs = int(rng.integers(1, 25))
        seq = torch.tensor(rng.integers(1, ctx - n, bs), dtype=torch.int64)
        rpi = torch.tensor(rng.permutation(pool)[:bs], dtype=torch.int64)
        tokens = bs * max(1, n)
        fb = ForwardBatch(fm, bs, rpi.cuda(), seq.cuda(), seq, int(seq.sum()),
                          torch.zeros(tokens, dtype=torch.int64, device="cuda"), spec_info=spec)
        fast.init_forward_metadata(fb)
        ref.init_forward_metadata(fb)
        _same_metadata(fast.forward_metadata, ref.forward_metadata)
        if step == 0:  # capture at this bs, then replay new steps at it
            cap = bs
            for b in (fast, ref):
                b.init_forward_metadata_capture_cuda_graph(bs, tokens, rpi.cuda(), seq.cuda(),
                                                           None, fm, spec)
            captured = fast.forward_metadata.kv_indices.data_ptr()
        seq2 = torch.tensor(rng.integers(1, ctx - n, cap), dtype=torch.int64)
        rpi2 = torch.tensor(rng.permutation(pool)[:cap], dtype=torch.int64)
        for b in (fast, ref):
            b.init_forward_metadata_replay_cuda_graph(cap, rpi2.cuda(), seq2.cuda(),
                                                      int(seq2.sum()), None, fm, spec, seq2)
        assert fast.forward_metadata.kv_indices.data_ptr() == captured
        _same_metadata(fast.forward_metadata, ref.forward_metadata)
        assert fast.forward_metadata.run_graph


class _StandInLauncher:
    """StepLauncher's surface on the CPU: `build_step` through JAX, written into a static
    buffer (its own, or the CUDA-graph buffer), as the launched program writes its output."""

    def __init__(self, spec, req_to_token, packed_out=None):
        from funcmla.interop.dlpack import to_jax

        self.spec, self.r2t = spec, to_jax(req_to_token)
        self.packed = packed_out if packed_out is not None else torch.full(
            (step_layout(spec).size,), -7, dtype=torch.int32)
        self.calls = 0

    def __call__(self, batch, parts):
        k, bp = num_parts(self.spec.kind), self.spec.batch
        flat = np.concatenate([np.asarray(p[:batch], np.int32) for p in parts]
                              + [np.full(k * (bp - batch), 3, np.int32), [batch]])
        self.meta, packed = build_step(self.r2t, jnp.asarray(flat.astype(np.int32)),
                                       spec=self.spec)
        self.packed.copy_(torch.from_numpy(np.array(packed)))
        self.calls += 1

    def jax_meta(self):
        return self.meta


@pytest.mark.slow  # ~10 s a mode: every random batch bucket compiles its step program
@pytest.mark.parametrize("mode,n", [("DECODE", 0), ("TARGET_VERIFY", 2)])
def test_backend_launch_path_with_a_stand_in_launcher(mode, n, monkeypatch):
    """The backend's launched path (static buffers, cached views, in-place CUDA-graph fill)
    against its JAX path, on the CPU with a stand-in for the launcher."""
    from funcmla.interop.sglang import backend as backend_mod
    from funcmla.interop.sglang_backend import (
        ForwardBatch,
        ForwardMode,
        FuncMLAAttnBackend,
        MLATokenToKVPool,
        SpecInfo,
    )

    rng = np.random.default_rng(11)
    pool, ctx = 12, 64
    r2t = torch.tensor(rng.integers(0, 1 << 12, (pool, ctx)), dtype=torch.int32)
    kv = MLATokenToKVPool(64, 16, torch.bfloat16, 1)

    def make():
        return FuncMLAAttnBackend(r2t, kv, page_size=16, num_heads=16, num_draft_tokens=n,
                                  attention_backend="reference")

    ref, fast = make(), make()
    monkeypatch.setattr(backend_mod, "StepLauncher", _StandInLauncher)
    fast._launch_env_reason = fast.metadata_launcher_reason = None
    fm, spec = getattr(ForwardMode, mode), (SpecInfo(draft_token_num=n) if n else None)
    for b in (ref, fast):
        b.init_cuda_graph_state(max_bs=6, max_num_tokens=6 * max(1, n))
    for step in range(4):
        bs = int(rng.integers(1, 7))
        seq = torch.tensor(rng.integers(1, ctx - n, bs), dtype=torch.int32)
        rpi = torch.tensor(rng.permutation(pool)[:bs], dtype=torch.int32)
        fb = ForwardBatch(fm, bs, rpi, seq, seq, int(seq.sum()),
                          torch.zeros(bs * max(1, n), dtype=torch.int64), spec_info=spec)
        ref.init_forward_metadata(fb)
        fast.init_forward_metadata(fb)
        a, b = fast.forward_metadata, ref.forward_metadata
        for name in _FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.max_q_len, a.max_kv_len) == (b.max_q_len, b.max_kv_len)
        assert a.work_metadata.view(torch.int64).tolist() == [a.work_indptr.data_ptr(),
                                                              a.work_info_set.data_ptr()]
        bufs = [launcher.packed for _, launcher in fast._launch_fast.values()]
        assert any(t.data_ptr() <= a.kv_indices.data_ptr() < t.data_ptr() + 4 * t.numel()
                   for t in bufs)  # views of a launcher's static output
        assert fast._jax_meta.mode == ref._jax_meta.mode  # static: no import needed
        if step == 0:
            cap = bs
            for be in (ref, fast):
                be.init_forward_metadata_capture_cuda_graph(bs, bs * max(1, n), rpi, seq, None,
                                                            fm, spec)
        seq2 = torch.tensor(rng.integers(1, ctx - n, cap), dtype=torch.int32)
        rpi2 = torch.tensor(rng.permutation(pool)[:cap], dtype=torch.int32)
        for be in (ref, fast):
            be.init_forward_metadata_replay_cuda_graph(cap, rpi2, seq2, int(seq2.sum()), None,
                                                       fm, spec, seq2)
        a, b = fast.forward_metadata, ref.forward_metadata
        for name in _FIELDS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        graph = fast._graph_launch[(fast._graph_kind(fm), n)][1]
        assert graph.packed is fast._graph_buffer  # filled in place: no copy
    assert fast.metadata_launcher_reason is None


class _RefusesBatchOne(_StandInLauncher):
    """A launcher that cannot replay the batch-1 programs (on the H200 they read an XLA
    constant), as StepLauncher refuses them."""

    def __init__(self, spec, req_to_token, packed_out=None):
        if spec.batch == 1 and packed_out is None:
            raise UnsupportedProgram("thunk copy.1 reads a constant allocation (#12, color 0)")
        super().__init__(spec, req_to_token, packed_out)


def test_a_bucket_the_launcher_refuses_is_served_by_the_next_one(monkeypatch):
    from funcmla.interop.sglang import backend as backend_mod
    from funcmla.interop.sglang_backend import (
        ForwardBatch,
        ForwardMode,
        FuncMLAAttnBackend,
        MLATokenToKVPool,
    )

    rng = np.random.default_rng(5)
    r2t = torch.tensor(rng.integers(0, 1 << 12, (8, 64)), dtype=torch.int32)
    kv = MLATokenToKVPool(64, 16, torch.bfloat16, 1)
    make = lambda: FuncMLAAttnBackend(r2t, kv, page_size=16, num_heads=16,  # noqa: E731
                                      attention_backend="reference")
    ref, fast = make(), make()
    monkeypatch.setattr(backend_mod, "StepLauncher", _RefusesBatchOne)
    fast._launch_env_reason = fast.metadata_launcher_reason = None
    seq, rpi = torch.tensor([37], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    fb = ForwardBatch(ForwardMode.DECODE, 1, rpi, seq, seq, 37, torch.zeros(1, dtype=torch.int64))
    ref.init_forward_metadata(fb)
    fast.init_forward_metadata(fb)
    (spec, launcher), = fast._launch_fast.values()
    assert spec.batch == 2 and launcher.calls == 1  # the batch-2 program, launched
    assert "batch 1" in fast.metadata_launcher_reason
    for name in _FIELDS:
        assert torch.equal(getattr(fast.forward_metadata, name),
                           getattr(ref.forward_metadata, name)), name
