"""`FuncMLAAttnBackend`: SGLang's `AttentionBackend` surface for absorbed MLA, with the
metadata and the persistent work plan built by funcmla (docs/sglang_backend.md).

Per step, the shim crosses DLPack twice, whatever the batch: the step's int32 inputs
(req_pool_indices | seq_lens [| extend_seq_lens] | filler) are concatenated in torch and
imported once; one jitted program (`funcmla.interop.sglang.step`) builds the metadata and the
work plan and returns them packed in one int32 buffer, exported once; torch reads every field
through a view. Host scalars come from the batch's CPU fields, checked first
(`funcmla.interop.sglang.host_checks`): a bad step raises before anything is launched.

Batch sizes are padded to buckets (SGLang's CUDA-graph batch sizes by default) and token counts
to powers of two, so one program serves every batch of a bucket; the views are cut to the live
batch, so padding never shows.

CUDA graphs: `init_cuda_graph_state` allocates one static packed buffer laid out for `max_bs`,
the token-granular `BufferPlan` capacity and the plan sizes of `max_bs` requests of
`max(1, num_draft_tokens)` queries; capture binds views to it once per (mode, bs); replay runs
the program for the new batch and copies its output into the static buffer with one `copy_`.
"""

from __future__ import annotations

import torch

from funcmla.compile_cache import enable_compilation_cache
from funcmla.interop.aiter_dispatch import AiterWorkPlan
from funcmla.interop.backend_select import (_launcher_reason, mla_attention, pallas_route,
                                            select_backend)
from funcmla.interop.dlpack import FP8_DTYPES, to_jax, to_torch
from funcmla.interop.sglang import host_checks as hc
from funcmla.interop.sglang.buckets import Buckets
from funcmla.interop.sglang.layer_launch import extend_launch, layer_launch
from funcmla.interop.sglang.mha_extend import is_mha_extend, mha_extend
from funcmla.interop.sglang.modes import resolve_mode
from funcmla.interop.sglang.step import StepSpec, build_step, num_parts, step_layout
from funcmla.interop.sglang.step_launch import StepLauncher, step_launch_unavailable
from funcmla.interop.sglang.types import (
    CudaGraphBufferOverflow,
    ForwardBatch,
    ForwardMetadata,
    MLATokenToKVPool,
    RadixAttention,
    SpecInfo,
)
from funcmla.interop.sglang.workplan import (
    PLAN_FIELDS,
    PlanSettings,
    device_profile_of,
    plan_shapes,
)
from funcmla.layout import next_power_of_two
from funcmla.metadata import BufferPlan, draft_keys

__all__ = ["FuncMLAAttnBackend"]


class _PointerStage:
    """`work_metadata` per eager step: two uint64 device pointers (&work_indptr,
    &work_info_set), copied from a ring of pinned host slots (no sync; a slot is reused only
    once its copy has completed)."""

    def __init__(self, device: torch.device, slots: int = 8):
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = [torch.zeros(2, dtype=torch.int64, pin_memory=self.cuda)
                      for _ in range(slots)]
        self.host = [t.numpy() for t in self.slots]  # NumPy views: cheap element writes
        self.events = [None] * slots
        self.i = 0

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.int64).view(torch.uint64)
        i = self.i = (self.i + 1) % len(self.slots)
        if self.events[i] is not None:
            self.events[i].synchronize()  # done long ago in practice; ordering made explicit
        self.host[i][0], self.host[i][1] = a.data_ptr(), b.data_ptr()
        out = torch.empty(2, dtype=torch.int64, device=self.device)
        out.copy_(self.slots[i], non_blocking=True)
        ev = self.events[i] = self.events[i] or torch.cuda.Event()
        ev.record()
        return out.view(torch.uint64)


class _LazyJaxMeta:
    """funcmla's ForwardMetadata of a launched step, imported into JAX only when a JAX
    attention path reads an array field (the static `mode` / `num_draft_tokens` need none)."""

    def __init__(self, launcher: StepLauncher, mode: str, num_draft_tokens: int):
        self._launcher, self.mode, self.num_draft_tokens = launcher, mode, num_draft_tokens
        self._meta = None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._meta is None:
            self._meta = self._launcher.jax_meta()
        return getattr(self._meta, name)


class FuncMLAAttnBackend:
    """SGLang-style absorbed-MLA attention backend; metadata and work plan by funcmla.

    req_to_token:      int32 [pool, max_context_len] token slots (imported into JAX once).
    token_to_kv_pool:  MLATokenToKVPool (or anything with kv_buffer / get_key_buffer /
                       set_kv_buffer).
    page_size:         the allocator's page size (metadata stays token-granular at any size).
    num_draft_tokens:  speculative draft tokens (CUDA-graph slack; verify / draft-extend).
    num_heads:         the layers' tp_q_head_num; with it (and persistent_plan) the metadata
                       carries the persistent work plan; None: plan fields stay None.
    persistent_plan:   build the work plan (needs num_heads).
    buckets:           batch / token buckets (default: SGLang's CUDA-graph batch sizes to 512).
    device_profile:    the planner's device (default: this device's SM / CU count).
    attention_backend: "auto", "aiter", "pallas" or "reference" (see backend_select).
    num_kv_splits:     passed to AITER (default: the plan's max_split_per_batch when planning).
    legacy_block_granular_kv_indices: size the CUDA-graph kv_indices buffer in blocks, as the
                       seed did, to reproduce its overflow (replay then raises).
    torch_launcher:    pallas only: launch the kernel on the torch tensors (no DLPack per
                       layer; capturable in a torch CUDA graph) where it can run.
    compilation_cache_dir: JAX's persistent compilation cache (funcmla.compile_cache: default
                       $FUNCMLA_COMPILATION_CACHE or ~/.cache/funcmla/jax; "off" disables).
    metadata_launcher: run each step's metadata program as XLA's kernels on torch's stream
                       (funcmla.interop.sglang.step_launch: no JAX dispatch, no DLPack per
                       step) where it can run; `metadata_launcher_reason` says why not.
    """

    def __init__(self, req_to_token: torch.Tensor, token_to_kv_pool: MLATokenToKVPool, *,
                 page_size: int = 1, num_draft_tokens: int = 0, num_heads: int | None = None,
                 persistent_plan: bool = True, buckets: Buckets | None = None,
                 device_profile=None, attention_backend: str = "auto",
                 num_kv_splits: int | None = None,
                 legacy_block_granular_kv_indices: bool = False,
                 min_kv_bucket: int | None = None, torch_launcher: bool = True,
                 compilation_cache_dir: str | None = None, metadata_launcher: bool = True):
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dtype != torch.int32 \
                or req_to_token.dim() != 2:
            raise TypeError(
                f"req_to_token must be int32 [pool, max_context_len], got "
                f"{getattr(req_to_token, 'dtype', type(req_to_token).__name__)} "
                f"{tuple(getattr(req_to_token, 'shape', ()))}")
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}")
        self.compilation_cache_dir = enable_compilation_cache(compilation_cache_dir)
        self.req_to_token = req_to_token
        self.token_to_kv_pool = token_to_kv_pool
        self.device = req_to_token.device
        self.page_size = page_size
        self.max_context_len = req_to_token.shape[1]
        self.num_req_rows = req_to_token.shape[0]
        self.num_draft_tokens = num_draft_tokens
        self.buckets = buckets or Buckets()
        if min_kv_bucket is not None:
            self.buckets = Buckets(self.buckets.batch_sizes, min_kv_bucket,
                                   self.buckets.min_q_tokens)
        self.plan: PlanSettings | None = None
        if persistent_plan and num_heads is not None:
            pool_dtype = token_to_kv_pool.get_key_buffer(0).dtype
            self.plan = PlanSettings(
                device=device_profile or device_profile_of(self.device), num_heads=num_heads,
                kv_dtype="fp8" if pool_dtype in FP8_DTYPES else "bf16", page_size=page_size,
                num_draft_tokens=num_draft_tokens)
        self.num_kv_splits = num_kv_splits
        self.legacy_block_granular_kv_indices = legacy_block_granular_kv_indices
        self.attention_backend = select_backend(attention_backend)
        self.last_backend: str | None = None
        self.last_via: str | None = None
        self.last_fallback_reason: str | None = None  # set by the MHA extend
        self.last_launcher_reason: str | None = None  # an extend's, where JAX ran it
        self._mha_launchers: dict = {}  # (PrefillLaunchConfig, device) -> launcher or reason
        self._mha_step = None  # this step's MHA extend layout (mha_extend._launched)
        self._mha_jax_step = None  # this step's MHA extend PrefillStep (mha_extend._jax_step)
        self._ext_step = None  # this step's extend-launcher layout (layer_launch.extend_launch)
        self.torch_launcher = torch_launcher
        self._kv_indices_full: torch.Tensor | None = None  # static-capacity view (launcher)
        # kv_indptr over the batch bucket (padded requests empty): the decode launcher's shape
        self._kv_indptr_full: torch.Tensor | None = None
        self._req_to_token_jax = to_jax(req_to_token)  # long-lived: imported once
        self._kv_jax: dict = {}
        self._decode_launchers: dict = {}  # (step shapes, layer shapes) -> launcher or False
        self._decode_q_pads: dict = {}  # the same keys -> q rows of a batch bucket (eager)
        self._fillers: dict = {}
        self._pointers = _PointerStage(self.device)
        self._layer_launch: dict = {}  # layer id -> (layer, step key, launch)
        self._step_key_now = None  # this step's `_step_key` (None until a layer asks)
        self._step_key_last = None
        self.forward_metadata: ForwardMetadata | None = None
        self._jax_meta = None
        self._mode: str | None = None
        self._max_kv_bound: int | None = None
        self._extend_rows: tuple[int, int, bool, int] | None = None
        self.buffer_plan: BufferPlan | None = None
        self._graph_buffer: torch.Tensor | None = None
        self._graph_views: dict | None = None
        self._graph_meta: dict = {}
        # why the metadata runs through JAX here (None: launched on torch's stream); a program
        # the launcher refuses keeps the JAX path for its spec only, and its reason lands here
        self._launch_env_reason = (step_launch_unavailable(self.device) if metadata_launcher
                                   else "metadata_launcher=False")
        self.metadata_launcher_reason: str | None = self._launch_env_reason
        self._step_launchers: dict = {}  # spec (or graph key) -> StepLauncher | None
        self._launch_fast: dict = {}     # (kind, bucket, capacity, n, q) -> (spec, launcher)
        self._launch_views: dict = {}    # (that key, batch, max_q) -> views of the output
        self._graph_launch: dict = {}    # (kind, n) -> (spec, launcher) of the static buffer

    @classmethod
    def from_model_runner(cls, model_runner, **overrides) -> "FuncMLAAttnBackend":
        """Build from SGLang's ModelRunner (its attribute names; see
        funcmla.interop.sglang.plugin.backend_kwargs_from_model_runner)."""
        from funcmla.interop.sglang.plugin import backend_kwargs_from_model_runner

        req_to_token, pool, kwargs = backend_kwargs_from_model_runner(model_runner)
        kwargs.update(overrides)
        return cls(req_to_token, pool, **kwargs)

    # ---- helpers ---------------------------------------------------------------------------
    def _draft_n(self, kind: str, spec_info: SpecInfo | None) -> int:
        if kind not in ("target_verify", "draft_extend"):
            return 0
        n = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        n = self.num_draft_tokens if n is None else n
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"{kind} needs spec_info.draft_token_num or num_draft_tokens > 0, "
                             f"got {n!r}")
        return n

    # the fewest keys a request may have: one per query (bottom-right causal)
    _MIN_SEQ = {"decode": 1, "extend": 1, "target_verify": 0}

    def _check_step(self, kind: str, batch: int, req_pool_indices, seq_lens, seq_lens_cpu,
                    seq_lens_sum, n: int) -> hc.HostLens:
        """Every check readable without a device sync (see host_checks). The common case (device
        tensors of integer dtype, lengths in range) is one test; anything else takes the
        field-by-field checks, which raise naming the field."""
        seq = hc.host_lens(seq_lens_cpu, batch, lo=self._MIN_SEQ.get(kind, n))
        extra = draft_keys(kind, n)
        if seq.max + extra > self.max_context_len:
            hc.check_max(seq, field="seq_lens_cpu", hi=self.max_context_len, extra=extra,
                         extra_what="draft tokens")
        if seq_lens_sum is not None and seq_lens_sum != seq.sum:
            raise ValueError(f"seq_lens_sum = {int(seq_lens_sum)} disagrees with "
                             f"sum(seq_lens_cpu) = {seq.sum}")
        ints = hc.INT_DTYPES
        if not (isinstance(req_pool_indices, torch.Tensor) and isinstance(seq_lens, torch.Tensor)
                and req_pool_indices.dtype in ints and seq_lens.dtype in ints
                and req_pool_indices.shape[0] >= batch and seq_lens.shape[0] >= batch
                and req_pool_indices.device.type != "cpu" and seq_lens.device.type != "cpu"):
            hc.check_int_tensor(seq_lens, "seq_lens")
            hc.check_rows(req_pool_indices, batch, self.num_req_rows)
            hc.check_same(seq_lens, seq, "seq_lens", "seq_lens_cpu")
        return seq

    @staticmethod
    def _host_scalars(kind: str, seq: hc.HostLens, n: int, ext: hc.HostLens | None = None):
        """(max_q_len, max_kv_len, kv tokens) from host lengths, as SGLang derives them."""
        if kind == "decode":
            return 1, seq.max, seq.sum
        if kind == "extend":
            return ext.max, seq.max, seq.sum
        if kind == "target_verify":
            return n, None, seq.sum + n * seq.count
        return n, seq.max, seq.sum

    def _filler(self, k: int, bp: int, batch: int) -> torch.Tensor:
        key = (k, bp, batch)
        t = self._fillers.get(key)
        if t is None:
            t = torch.zeros(k * (bp - batch) + 1, dtype=torch.int32, device=self.device)
            t[-1] = batch
            self._fillers[key] = t
        return t

    def _step_inputs(self, kind: str, batch: int, bp: int, req_pool_indices, seq_lens,
                     extend_seq_lens=None):
        """The step's one import: req_pool_indices | seq_lens [| extend_seq_lens] | filler."""
        dev = self.device
        parts = [req_pool_indices[:batch], seq_lens[:batch]]
        if extend_seq_lens is not None:
            parts.append(extend_seq_lens[:batch])
        parts = [p if p.device == dev else p.to(dev) for p in parts]
        parts.append(self._filler(num_parts(kind), bp, batch))
        packed = torch.cat(parts)
        if packed.dtype != torch.int32:
            packed = packed.to(torch.int32)
        return to_jax(packed)

    def _spec(self, kind: str, bp: int, capacity: int, n: int, max_q: int,
              graph: bool = False) -> StepSpec:
        override = self._graph_override if self.plan is not None and graph else None
        return StepSpec(kind=kind, batch=bp, capacity=capacity, n=n, max_q_len=max_q,
                        plan=self.plan, plan_shapes_override=override)

    def _plan_views(self, views: dict, shapes: dict | None) -> dict:
        """ForwardMetadata's plan fields as views cut to `shapes` (SGLang's sizes)."""
        if shapes is None:
            return {}
        out = {}
        for name in PLAN_FIELDS:
            shape = tuple(shapes[name])
            full = views[name]
            out[name] = full[: shape[0]] if full.shape != shape else full
        out["work_metadata"] = self._pointers(out["work_indptr"], out["work_info_set"])
        return out

    def _kv_bound(self, max_kv_len: int | None, seq: hc.HostLens, n: int) -> int:
        longest = max_kv_len if max_kv_len is not None else seq.max + n
        return next_power_of_two(longest, 16)

    def _num_kv_splits(self):
        if self.num_kv_splits is not None or self.plan is None:
            return self.num_kv_splits
        return self.plan.max_split_per_batch

    def _launcher(self, spec: StepSpec, packed_out: torch.Tensor | None = None):
        """The StepLauncher of `spec` (built once), or None where the JAX path runs (the
        reason is kept in metadata_launcher_reason)."""
        key = spec if packed_out is None else (spec, packed_out.data_ptr())
        launcher = self._step_launchers.get(key, False)
        if launcher is False:
            launcher = None
            if self._launch_env_reason is None:
                try:
                    launcher = StepLauncher(spec, self.req_to_token, packed_out)
                except Exception as err:  # noqa: BLE001 - the JAX path always serves the spec
                    # (StepLauncherUnavailable, UnsupportedProgram, a driver error: recorded)
                    self.metadata_launcher_reason = (
                        f"{spec.kind} program at batch {spec.batch}: {type(err).__name__}: {err}")
            self._step_launchers[key] = launcher
        return launcher

    def _launchable_spec(self, kind: str, bp: int, capacity: int, n: int, plan_q: int):
        """(spec, launcher or None) for a step of batch bucket `bp`. A bucket whose program the
        launcher cannot replay is served by the next bucket's program when that one can be
        (batch 1's programs read an XLA constant); padding is invisible in the outputs."""
        spec = self._spec(kind, bp, capacity, n, plan_q)
        if self._launch_env_reason is not None:
            return spec, None
        launcher = self._launcher(spec)
        sizes = self.buckets.batch_sizes
        for larger in sizes[sizes.index(bp) + 1:sizes.index(bp) + 3]:
            if launcher is not None:
                break
            wider = self._spec(kind, larger, capacity, n, plan_q)
            launcher = self._launcher(wider)
            if launcher is not None:
                spec = wider
        return spec, launcher

    # ---- eager metadata --------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Check the step from its host fields, then build its metadata and work plan (one
        import, one jitted program per bucket, one export)."""
        fb = forward_batch
        kind = resolve_mode(fb.forward_mode)
        batch = fb.batch_size
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise ValueError(f"forward_batch.batch_size must be an int >= 0, got {batch!r}")
        if kind == "idle":
            return self._init_idle(fb)
        if batch == 0:
            raise ValueError(f"forward_batch.batch_size is 0 in mode {fb.forward_mode!r}; "
                             "an empty batch must be IDLE")
        bp = self.buckets.batch(batch)
        n = self._draft_n(kind, fb.spec_info)
        seq = self._check_step(kind, batch, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu,
                               fb.seq_lens_sum, n)
        ext = None
        if kind == "extend":
            if fb.extend_seq_lens is None:
                raise ValueError("forward_batch.extend_seq_lens is required in extend modes")
            ext = hc.host_lens(fb.extend_seq_lens_cpu, batch, "extend_seq_lens_cpu")
            over = ext.arr > seq.arr
            if over.any():
                i = int(over.argmax())
                raise ValueError(f"extend_seq_lens_cpu[{i}] = {int(ext.arr[i])} exceeds "
                                 f"seq_lens_cpu[{i}] = {int(seq.arr[i])}")
            hc.check_same(fb.extend_seq_lens, ext, "extend_seq_lens", "extend_seq_lens_cpu")
        max_q, max_kv, total = self._host_scalars(kind, seq, n, ext)
        # the MHA extend's layers read these host facts: (q tokens, kv tokens, any prefix,
        # the longest request's kv_len: its kernel config, `prefill_kernel_config`)
        self._extend_rows = (None if ext is None
                             else (ext.sum, total, bool((seq.arr > ext.arr).any()), seq.max))
        tokens = ext.sum if kind == "extend" else batch * max_q
        hc.check_out_cache_loc(fb.out_cache_loc, tokens)
        capacity = self.buckets.kv_tokens(total)
        plan_q = self.buckets.q_tokens(max_q) if kind == "extend" else max_q
        fast_key = (kind, bp, capacity, n, plan_q)  # a plain tuple: cheaper than the spec's hash
        spec, launcher = self._launch_fast.get(fast_key, (None, None))
        if spec is None:
            spec, launcher = self._launchable_spec(kind, bp, capacity, n, plan_q)
            self._launch_fast[fast_key] = (spec, launcher)
        if launcher is not None:
            parts = (fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens) \
                if kind == "extend" else (fb.req_pool_indices, fb.seq_lens)
            launcher(batch, parts)
            self.forward_metadata = self._launched_metadata(launcher, spec, fast_key, batch,
                                                            total, max_q, max_kv)
            self._jax_meta, self._mode = _LazyJaxMeta(launcher, kind, n), kind
            self._max_kv_bound = self._kv_bound(max_kv, seq, n)
            return
        inputs = self._step_inputs(kind, batch, bp, fb.req_pool_indices, fb.seq_lens,
                                   fb.extend_seq_lens if kind == "extend" else None)
        meta, packed = build_step(self._req_to_token_jax, inputs, spec=spec)
        self.forward_metadata = self._eager_metadata(to_torch(packed), spec, kind, batch,
                                                     total, max_q, max_kv)
        self._jax_meta, self._mode = meta, kind
        self._max_kv_bound = self._kv_bound(max_kv, seq, n)

    def _eager_metadata(self, buf: torch.Tensor, spec: StepSpec, kind: str, batch: int,
                        total: int, max_q: int, max_kv: int | None) -> ForwardMetadata:
        """SGLang's ForwardMetadata as one view per field of the exported buffer, cut to the
        live batch and SGLang's plan sizes (the hot path of the hand-off)."""
        off = step_layout(spec).offsets
        view = lambda name, *shape: buf.as_strided(  # noqa: E731
            shape, (shape[1], 1) if len(shape) == 2 else (1,), off[name])
        plan = {}
        if self.plan is not None:
            shapes = plan_shapes(self.plan, kind, batch, max_q)  # SGLang's sizes for the step
            plan = {name: view(name, *shapes[name]) for name in PLAN_FIELDS}
            plan["work_metadata"] = self._pointers(plan["work_indptr"], plan["work_info_set"])
            if kind == "extend":
                plan["fp8_prefill_kv_indices"] = view("fp8_prefill_kv_indices", total)
        if self.torch_launcher:
            self._kv_indices_full = view("kv_indices", spec.capacity)
            self._kv_indptr_full = view("kv_indptr", spec.batch + 1)
        return ForwardMetadata(
            view("kv_indptr", batch + 1), view("kv_indices", total),
            view("qo_indptr", batch + 1), view("kv_last_page_len", batch), max_q, max_kv,
            run_graph=False, num_kv_splits=self._num_kv_splits(), **plan)

    def _launched_metadata(self, launcher: StepLauncher, spec: StepSpec, fast_key: tuple,
                           batch: int, total: int, max_q: int,
                           max_kv: int | None) -> ForwardMetadata:
        """ForwardMetadata over a launcher's static output: the views of a (spec, batch) are
        made once (work_metadata too: the plan's addresses never move); per step only
        kv_indices (and the extend's fp8_prefill_kv_indices) is cut to the step's total."""
        kind = spec.kind
        key = (fast_key, batch, max_q)
        cached = self._launch_views.get(key)
        buf = launcher.packed
        if cached is None:
            off = step_layout(spec).offsets
            view = lambda name, *shape: buf.as_strided(  # noqa: E731
                shape, (shape[1], 1) if len(shape) == 2 else (1,), off[name])
            plan = {}
            if self.plan is not None:
                shapes = plan_shapes(self.plan, kind, batch, max_q)
                plan = {name: view(name, *shapes[name]) for name in PLAN_FIELDS}
                plan["work_metadata"] = torch.tensor(
                    [plan["work_indptr"].data_ptr(), plan["work_info_set"].data_ptr()],
                    dtype=torch.int64).to(self.device).view(torch.uint64)
            cached = (view("kv_indptr", batch + 1), view("qo_indptr", batch + 1),
                      view("kv_last_page_len", batch), plan, view("kv_indices", spec.capacity),
                      view("kv_indptr", spec.batch + 1))
            self._launch_views[key] = cached
        kv_indptr, qo_indptr, last, plan, full, indptr_full = cached
        if kind == "extend" and plan:
            plan = dict(plan, fp8_prefill_kv_indices=buf.as_strided(
                (total,), (1,), step_layout(spec).offsets["fp8_prefill_kv_indices"]))
        if self.torch_launcher:
            self._kv_indices_full, self._kv_indptr_full = full, indptr_full
        return ForwardMetadata(kv_indptr, full[:total], qo_indptr, last, max_q, max_kv,
                               run_graph=False, num_kv_splits=self._num_kv_splits(), **plan)

    def _init_idle(self, fb: ForwardBatch) -> None:
        """IDLE (DP attention, nothing scheduled here): batch 0, empty metadata, no work."""
        if fb.batch_size != 0:
            raise ValueError(f"an IDLE batch must have batch_size 0, got {fb.batch_size}")
        for field in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc"):
            t = getattr(fb, field, None)
            size = None if t is None else (t.numel() if isinstance(t, torch.Tensor) else len(t))
            if size:
                raise ValueError(f"an IDLE batch must be empty: forward_batch.{field} has "
                                 f"{size} entries")
        z = torch.zeros(1, dtype=torch.int32, device=self.device)
        e = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.forward_metadata = ForwardMetadata(z, e, z, e, 0, 0, run_graph=False,
                                                num_kv_splits=self._num_kv_splits())
        self._jax_meta, self._mode, self._max_kv_bound = None, "idle", None

    # ---- CUDA graphs -----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int,
                              kv_indices_buf: torch.Tensor | None = None) -> None:
        """Allocate the static packed buffer: indptrs for max_bs, token-granular kv_indices
        (BufferPlan), the plan buffers of max_bs requests of max(1, num_draft_tokens) queries."""
        if kv_indices_buf is not None:
            raise ValueError(
                "kv_indices_buf is not supported: the kv_indices buffer lives inside the static "
                "packed metadata buffer, so replay is a single copy")
        del max_num_tokens  # no custom mask for MLA
        self.buffer_plan = BufferPlan(
            max_bs=max_bs, max_context_len=self.max_context_len, page_size=self.page_size,
            num_draft_tokens=self.num_draft_tokens,
            legacy_block_granular_kv_indices=self.legacy_block_granular_kv_indices)
        self._graph_plan_shapes = (plan_shapes(self.plan, "decode", max_bs,
                                               max(1, self.num_draft_tokens))
                                   if self.plan is not None else None)
        self._graph_override = (tuple(sorted(self._graph_plan_shapes.items()))
                                if self.plan is not None else None)
        layout = step_layout(self._spec("decode", max_bs, self.buffer_plan.kv_indices_capacity,
                                        0, 1, graph=True))
        self._step_launchers = {k: v for k, v in self._step_launchers.items()
                                if not isinstance(k, tuple)}  # the old static buffer's
        self._graph_launch = {}
        self._graph_buffer = layout.empty_torch(self.device)
        self._graph_views = layout.torch_views(self._graph_buffer)
        self._graph_views["kv_last_page_len"].fill_(1)
        self._graph_plan = self._plan_views(self._graph_views, self._graph_plan_shapes)
        self._graph_meta = {}

    def _graph_kind(self, forward_mode) -> str:
        kind = resolve_mode(forward_mode)
        if kind == "idle":  # SGLang: is_decode_or_idle -> the decode graph
            return "decode"
        if kind == "extend":
            raise ValueError(f"forward_mode {getattr(forward_mode, 'name', forward_mode)}: "
                             "CUDA graphs cover DECODE, IDLE, TARGET_VERIFY and DRAFT_EXTEND_V2")
        return kind

    def _check_graph_step(self, kind: str, bs: int, req_pool_indices, seq_lens, seq_lens_cpu,
                          seq_lens_sum, n: int) -> hc.HostLens:
        plan = self.buffer_plan
        if plan is None:
            raise RuntimeError("call init_cuda_graph_state before capturing or replaying")
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"bs must be a positive int, got {bs!r}")
        if bs > plan.max_bs:
            raise CudaGraphBufferOverflow(f"bs = {bs} exceeds the captured max_bs = {plan.max_bs}")
        seq = self._check_step(kind, bs, req_pool_indices, seq_lens, seq_lens_cpu, seq_lens_sum,
                               n)
        need = seq.sum + draft_keys(kind, n) * bs
        cap = plan.kv_indices_capacity
        if need > cap:
            unit = ("blocks: the legacy block-granular sizing, the seed's overflow bug"
                    if plan.legacy_block_granular_kv_indices else "tokens")
            raise CudaGraphBufferOverflow(
                f"replayed {kind} batch needs {need} kv_indices entries (token slots) but the "
                f"captured buffer holds {cap} ({unit}; max_bs={plan.max_bs}, "
                f"max_context_len={plan.max_context_len}, page_size={plan.page_size}, "
                f"num_draft_tokens={plan.num_draft_tokens}); writing it would run out of bounds")
        return seq

    def _fill_graph_buffers(self, kind: str, bs: int, req_pool_indices, seq_lens, n: int):
        plan = self.buffer_plan
        spec, launcher = self._graph_launch.get((kind, n), (None, None))
        if spec is None:
            max_q = 1 if kind == "decode" else n
            spec = self._spec(kind, plan.max_bs, plan.kv_indices_capacity, n, max_q, graph=True)
            launcher = (self._launcher(spec, self._graph_buffer)
                        if self._launch_env_reason is None else None)
            self._graph_launch[(kind, n)] = (spec, launcher)
        if launcher is not None:  # written in place: the static buffer is the program's output
            launcher(bs, (req_pool_indices, seq_lens))
            return _LazyJaxMeta(launcher, kind, n)
        inputs = self._step_inputs(kind, bs, plan.max_bs, req_pool_indices, seq_lens)
        meta, packed = build_step(self._req_to_token_jax, inputs, spec=spec)
        self._graph_buffer.copy_(to_torch(packed))  # one export, one device copy
        return meta

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int,
                                                 req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        """Fill the static buffers for a capture of batch size `bs` and bind views to them."""
        del num_tokens, encoder_lens
        kind = self._graph_kind(forward_mode)
        n = self._draft_n(kind, spec_info)
        seq_cpu = seq_lens[:bs].cpu()  # capture time only (as SGLang does)
        seq = self._check_graph_step(kind, bs, req_pool_indices, seq_lens, seq_cpu, None, n)
        meta = self._fill_graph_buffers(kind, bs, req_pool_indices, seq_lens, n)
        v = self._graph_views
        max_q, max_kv, _ = self._host_scalars(kind, seq, n)
        fm = ForwardMetadata(v["kv_indptr"][: bs + 1], v["kv_indices"], v["qo_indptr"][: bs + 1],
                             v["kv_last_page_len"][:bs], max_q, max_kv, run_graph=True,
                             num_kv_splits=self._num_kv_splits(), **self._graph_plan)
        self._graph_meta[(kind, bs)] = fm
        self.forward_metadata = fm
        self._kv_indices_full, self._kv_indptr_full = v["kv_indices"], fm.kv_indptr
        self._jax_meta, self._mode = meta, kind
        self._max_kv_bound = self._kv_bound(max_kv, seq, n)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                encoder_lens, forward_mode, spec_info,
                                                seq_lens_cpu: torch.Tensor | None) -> None:
        """Check the new batch on the host, then rebuild its metadata into the captured
        buffers (nothing is written if a check fails)."""
        del encoder_lens
        kind = self._graph_kind(forward_mode)
        if seq_lens_cpu is None:
            raise ValueError("seq_lens_cpu is required for replay (host-side checks)")
        n = self._draft_n(kind, spec_info)
        seq = self._check_graph_step(kind, bs, req_pool_indices, seq_lens, seq_lens_cpu,
                                     seq_lens_sum, n)
        fm = self._graph_meta.get((kind, bs))
        if fm is None:
            raise ValueError(f"no CUDA graph was captured for mode {kind!r} at bs = {bs}")
        self._jax_meta = self._fill_graph_buffers(kind, bs, req_pool_indices, seq_lens, n)
        _, max_kv, _ = self._host_scalars(kind, seq, n)
        fm.max_kv_len = max_kv
        self.forward_metadata, self._mode = fm, kind
        self._kv_indices_full, self._kv_indptr_full = fm.kv_indices, fm.kv_indptr
        self._max_kv_bound = self._kv_bound(max_kv, seq, n)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    @property
    def forward_metadata(self) -> ForwardMetadata | None:
        """This step's metadata (SGLang's field). Every step init sets it, which makes the
        next layer recompute the step's launch key (`_step_key`)."""
        return self._forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, fm: ForwardMetadata | None) -> None:
        self._forward_metadata = fm
        # a new step's values
        self._step_key_now = self._mha_step = self._mha_jax_step = self._ext_step = None

    def _step_key(self) -> tuple:
        """What a decode launch depends on from the step: (s_q, kv_indptr, kv_indices at
        the capacity, the kv-length bound, kv_indptr over the batch bucket), as one object
        that stays the same across steps while these do (the launched metadata's views are
        made once per bucket and batch), so a layer's launch (`_launch_decode`) is resolved
        once, not once a step."""
        s_q = pallas_route(self._mode, self._jax_meta)[1]
        key = (s_q, self.forward_metadata.kv_indptr, self._kv_indices_full, self._max_kv_bound,
               self._kv_indptr_full)
        last = self._step_key_last
        if last is not None and last[0] == key[0] and last[1] is key[1] and last[2] is key[2] \
                and last[3] == key[3] and last[4] is key[4]:
            key = last
        self._step_key_now = self._step_key_last = key
        return key

    # ---- attention -------------------------------------------------------------------------
    def _kv_pool_jax(self, layer_id: int):
        """(JAX alias of the layer's KV buffer, its fp8 dtype or None), imported once per
        storage; fp8 pools are imported as their uint8 bytes and bitcast inside the jit."""
        buf = self.token_to_kv_pool.get_key_buffer(layer_id)
        cached = self._kv_jax.get(layer_id)
        if cached is None or cached[0] != buf.data_ptr():
            fp8 = FP8_DTYPES.get(buf.dtype)
            cached = (buf.data_ptr(), to_jax(buf, fp8="bits"), fp8)
            self._kv_jax[layer_id] = cached
        return cached[1], cached[2]

    def _attend(self, q, layer: RadixAttention, causal: bool) -> torch.Tensor:
        if self.forward_metadata is None:
            raise RuntimeError("call init_forward_metadata (or a CUDA-graph init) first")
        heads = layer.tp_q_head_num
        if self._mode == "idle":
            if q.numel():
                raise ValueError(f"an IDLE step got q with {q.shape[0]} rows; it must be empty")
            return q.new_empty((0, heads * layer.v_head_dim))
        launch = self.torch_launcher and self.attention_backend == "pallas"
        if launch and causal:
            out = self._launch_decode(q, layer)
            if out is not None:
                self.last_backend, self.last_via = "pallas", "launcher"
                return out
        q3 = q.reshape(-1, heads, layer.qk_head_dim)
        if self.attention_backend == "aiter":
            res = mla_attention(q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                self.forward_metadata, plan=self._aiter_plan(),
                                sm_scale=layer.scaling,
                                v_head_dim=layer.v_head_dim, causal=causal, backend="aiter",
                                mode=self._mode, num_kv_splits=self._num_kv_splits(),
                                q_scale=layer.k_scale if q.dtype in FP8_DTYPES else None,
                                kv_scale=layer.k_scale)
        else:
            pool = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            kv_fp8 = FP8_DTYPES.get(pool.dtype)  # the torch pool's own dtype: no import needed
            inputs = (pool, self.forward_metadata.kv_indptr, self._kv_indices_full) if launch \
                else None
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if capturing:
                s_q = pallas_route(self._mode, self._jax_meta)[1]
                reason = (_launcher_reason(q3, inputs, s_q=s_q) if launch
                          else "torch_launcher is off")
                if reason is not None:
                    raise RuntimeError(
                        f"the {self.attention_backend!r} backend runs in JAX here ({reason}), "
                        "which a torch CUDA graph cannot capture; capture with the aiter backend "
                        "or the pallas torch launcher, or run eagerly")
            kv = None if capturing else self._kv_pool_jax(layer.layer_id)[0]
            res = mla_attention(q3, kv, self._jax_meta, sm_scale=layer.scaling,
                                v_head_dim=layer.v_head_dim, causal=causal,
                                backend=self.attention_backend, max_kv_len=self._max_kv_bound,
                                kv_fp8_dtype=kv_fp8,
                                kv_scale=layer.k_scale if kv_fp8 is not None else None,
                                return_lse=False, use_launcher=launch, launcher_inputs=inputs)
        self.last_backend, self.last_via = res.backend, res.via
        return res.out.reshape(-1, heads * layer.v_head_dim)

    def _launch_decode(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor | None:
        """out [T, H * v_head_dim] of this layer through the step's decode launcher (the
        extend launcher for an extend-shaped step: `layer_launch.extend_launch`), or None where
        `mla_attention` decides (a refusal: it records the reason).

        q: [T, H, qk_head_dim] or [T, H * qk_head_dim], as SGLang's layers pass it. A layer's
        launch is resolved once per step key (`_step_key`: it stays while the step's bucket,
        batch and bounds do) and the launcher itself once per (step shapes, layer shapes);
        every later call costs the step key (computed once a step), one dict lookup, the
        output's allocation and one launch
        (`python -m bench.interop --device cuda`, part 4: host time per layer). A layer the
        launcher refuses is resolved again on each call, by `mla_attention`, which records the
        reason."""
        step = self._step_key_now or self._step_key()
        if step[0] is None:  # extend-shaped: its token count changes from step to step
            return extend_launch(self, q, layer, step)
        entry = self._layer_launch.get(layer.layer_id)
        if entry is not None and entry[0] is layer and entry[1] is step:
            return entry[2](q)  # resolved in this step or an earlier one of the same key
        launch = layer_launch(self, q, layer, step)
        if launch is None:
            return None
        self._layer_launch[layer.layer_id] = (layer, step, launch)
        return launch(q)

    def _aiter_plan(self):
        """The decode work plan of forward_metadata as AITER's persistent kernel reads it (the
        PS prefill plan feeds SGLang's fp8 MHA prefill, not the absorbed extend run here)."""
        fm = self.forward_metadata
        if fm.work_info_set is None or self._mode == "extend":
            return None
        return AiterWorkPlan(work_meta_data=fm.work_metadata, work_indptr=fm.work_indptr,
                             work_info_set=fm.work_info_set, reduce_indptr=fm.reduce_indptr,
                             reduce_final_map=fm.reduce_final_map,
                             reduce_partial_map=fm.reduce_partial_map, kind="decode")

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Write this step's latent rows, then attend -> [T, H * v_head_dim] in q's dtype."""
        return self._save_and_attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Absorbed extend (bottom-right causal over prefix + new tokens); a layer with SGLang's
        MHA shapes (q / k 192, v 128, num_kv_heads = H) runs the MHA extend instead
        (`funcmla.interop.sglang.mha_extend`)."""
        if is_mha_extend(layer):
            return mha_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        return self._save_and_attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _save_and_attend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                         save_kv_cache: bool) -> torch.Tensor:
        """SGLang's order for every mode: store the step's latent rows (out_cache_loc), then
        attend bottom-right causal over everything the metadata lists."""
        if save_kv_cache and k is not None and k.numel():
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        return self._attend(q, layer, causal=True)

    def forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        """SGLang's dispatch: extend-like modes to forward_extend, the others to decode."""
        if resolve_mode(forward_batch.forward_mode) == "extend":
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
