"""An attention backend with SGLang's surface whose MLA metadata is built by funcmla.

`FuncMLAAttnBackend` follows SGLang's `AttentionBackend` methods for absorbed MLA
(`sglang-backend.md` §7, §8): `init_forward_metadata(forward_batch)`,
`init_cuda_graph_state(max_bs, max_num_tokens)`,
`init_forward_metadata_capture_cuda_graph(...)`, `init_forward_metadata_replay_cuda_graph(...)`,
`forward_decode(q, k, v, layer, forward_batch)` and `forward_extend(...)`. It exports a
`ForwardMetadata` with SGLang's field names and order (§2). SGLang is not a dependency: the
small `ForwardBatch`, `ForwardMode`, `RadixAttention` and `MLATokenToKVPool` here carry only the
fields the backend reads, under SGLang's names.

Per step, the shim crosses DLPack twice, whatever the batch:

1. in:  the step's int32 inputs (req_pool_indices, seq_lens[, extend_seq_lens]) are
        concatenated in torch and imported once (`to_jax`);
2. out: the jitted funcmla builder returns the metadata packed into one int32 buffer
        (`funcmla.interop.packed`), exported once (`to_torch`); torch reads it through views.

Long-lived buffers cross once: `req_to_token` at construction, each layer's KV buffer at first
use (re-imported only if its storage moves). Host scalars (`max_q_len`, `max_kv_len`, buffer
sizes) come from the batch's CPU fields, never from a device sync.

CUDA graphs: `init_cuda_graph_state` allocates one static packed buffer laid out for `max_bs`
and the token-granular capacity of `funcmla.metadata.BufferPlan`
(`max_bs * (ceil(max_ctx / ps) * ps + num_draft_tokens)`). Capture creates the views once per
(mode, bs); replay builds the new metadata in JAX, exports it and copies it into the static
buffer with a single `copy_`, so captured kernels read new values from unchanged addresses.
Before any device work, replay checks on the host that the batch fits the captured buffers and
raises `CudaGraphBufferOverflow` (the seed's second bug was a silent out-of-bounds write here).

The attention itself runs through `funcmla.interop.backend_select.mla_attention` (aiter, pallas
or reference; `last_backend` says which ran). JAX computations cannot be captured into a torch
CUDA graph, so under capture only the torch-launched aiter backend is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from funcmla.interop.backend_select import _launcher_reason, mla_attention, select_backend
from funcmla.interop.dlpack import FP8_DTYPES, to_jax, to_torch
from funcmla.interop.packed import PackedLayout
from funcmla.metadata import (
    BufferPlan,
    decode_metadata,
    draft_extend_metadata,
    extend_metadata,
    target_verify_metadata,
)

__all__ = [
    "ForwardMode",
    "SpecInfo",
    "ForwardBatch",
    "ForwardMetadata",
    "RadixAttention",
    "MLATokenToKVPool",
    "CudaGraphBufferOverflow",
    "FuncMLAAttnBackend",
]


class ForwardMode(enum.IntEnum):
    """The forward modes the MLA backend distinguishes (SGLang's names)."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND_V2


_MODE_NAMES = {
    ForwardMode.DECODE: "decode",
    ForwardMode.IDLE: "decode",
    ForwardMode.EXTEND: "extend",
    ForwardMode.TARGET_VERIFY: "target_verify",
    ForwardMode.DRAFT_EXTEND_V2: "draft_extend",
}


@dataclasses.dataclass
class SpecInfo:
    """Speculative-decoding info: the number of draft tokens per request."""

    draft_token_num: int


@dataclasses.dataclass
class ForwardBatch:
    """The fields of SGLang's ForwardBatch that this backend reads.

    Index tensors are on the model's device (int32 or int64); `*_cpu` fields are host copies.
    `seq_lens` counts tokens including this step's (SGLang writes the cache before attention);
    for TARGET_VERIFY it counts the tokens before the drafts.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    seq_lens_cpu: torch.Tensor  # [B] on the host
    seq_lens_sum: int
    out_cache_loc: Optional[torch.Tensor] = None  # [T] token slots written this step
    extend_prefix_lens: Optional[torch.Tensor] = None  # [B]
    extend_seq_lens: Optional[torch.Tensor] = None  # [B]
    extend_prefix_lens_cpu: Optional[list[int]] = None
    extend_seq_lens_cpu: Optional[list[int]] = None
    spec_info: Optional[SpecInfo] = None


@dataclasses.dataclass
class ForwardMetadata:
    """SGLang's ForwardMetadata (aiter_backend.py @003c5589): same field names, same order.

    MLA fields are token-granular: kv_indptr counts tokens, kv_indices are token slots,
    kv_last_page_len is all ones.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    qo_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    max_q_len: int
    max_kv_len: Optional[int]
    work_metadata: Optional[torch.Tensor] = None
    work_info_set: Optional[torch.Tensor] = None
    work_indptr: Optional[torch.Tensor] = None
    reduce_indptr: Optional[torch.Tensor] = None
    reduce_final_map: Optional[torch.Tensor] = None
    reduce_partial_map: Optional[torch.Tensor] = None
    num_kv_splits: Optional[int] = None
    run_graph: bool = True
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    max_extend_len: Optional[int] = None
    fp8_prefill_kv_indices: Optional[torch.Tensor] = None
    swa_page_table: Optional[torch.Tensor] = None
    swa_out_cache_loc: Optional[torch.Tensor] = None


@dataclasses.dataclass
class RadixAttention:
    """The layer attributes the backend reads (absorbed MLA: one 576-wide latent KV head)."""

    tp_q_head_num: int
    scaling: float
    layer_id: int = 0
    qk_head_dim: int = 576
    v_head_dim: int = 512
    tp_k_head_num: int = 1
    logit_cap: float = 0.0
    k_scale: Optional[float] = None


class MLATokenToKVPool:
    """SGLang's MLA latent KV pool: per layer a [size + page_size, 1, 576] buffer.

    Slots [0, page_size) are the reserved page 0. fp8 caches are stored as uint8 (as SGLang does,
    since index_put does not support fp8) and viewed as `dtype` on read.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int,
                 device="cpu", kv_lora_rank: int = 512, qk_rope_head_dim: int = 64):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.kv_lora_rank = kv_lora_rank
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        width = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [
            torch.zeros((size + page_size, 1, width), dtype=self.store_dtype, device=device)
            for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        buf = self.kv_buffer[layer_id]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer: RadixAttention, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None = None) -> None:
        """Write the latent rows `cache_k` [T, 1, 576] (or [T, 576]) at token slots `loc`."""
        del cache_v  # MLA: V is a prefix of the latent row in cache_k
        buf = self.kv_buffer[layer.layer_id]
        rows = cache_k.reshape(-1, 1, buf.shape[-1]).to(self.dtype)
        if self.store_dtype != self.dtype:
            rows = rows.view(self.store_dtype)
        buf[loc.long()] = rows


class CudaGraphBufferOverflow(ValueError):
    """A replayed batch does not fit the buffers captured by init_cuda_graph_state."""


@dataclasses.dataclass(frozen=True)
class _HostLens:
    """max / sum / count of a batch's host-side lengths, computed once per step in NumPy
    (iterating a torch tensor element by element costs about 1 us per element)."""

    max: int
    sum: int
    count: int

    @classmethod
    def of(cls, lens, batch: int) -> "_HostLens":
        if isinstance(lens, torch.Tensor):
            if lens.device.type != "cpu":
                raise ValueError(f"seq_lens_cpu must be a host tensor, got one on {lens.device}")
            arr = lens[:batch].numpy()
        else:
            arr = np.asarray(lens)[:batch]
        if arr.shape[0] != batch:
            raise ValueError(f"seq_lens_cpu has {arr.shape[0]} entries, the batch has {batch}")
        if batch == 0:
            return cls(0, 0, 0)
        return cls(int(arr.max()), int(arr.sum(dtype=np.int64)), batch)


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _step_fields(req_to_token, inputs, *, mode: str, batch: int, capacity: int, n: int,
                 pad_to: int):
    """Build funcmla metadata from the packed step inputs; pad the indptrs to `pad_to` requests.

    inputs: int32 [k * batch] = req_pool_indices | seq_lens [| extend_seq_lens].
    """
    rpi, seq = inputs[:batch], inputs[batch : 2 * batch]
    if mode == "decode":
        meta = decode_metadata(req_to_token, rpi, seq, capacity=capacity)
    elif mode == "extend":
        meta = extend_metadata(req_to_token, rpi, seq, inputs[2 * batch : 3 * batch],
                               capacity=capacity)
    elif mode == "target_verify":
        meta = target_verify_metadata(req_to_token, rpi, seq, num_draft_tokens=n,
                                      capacity=capacity)
    else:
        meta = draft_extend_metadata(req_to_token, rpi, seq, num_draft_tokens=n,
                                     capacity=capacity)
    extra = pad_to - batch

    def pad_edge(x):
        return jnp.concatenate([x, jnp.broadcast_to(x[-1], (extra,))]) if extra else x

    fields = dict(
        kv_indptr=pad_edge(meta.kv_indptr),
        kv_indices=meta.kv_indices,
        qo_indptr=pad_edge(meta.qo_indptr),
        kv_last_page_len=jnp.ones((pad_to,), jnp.int32),
        max_q_len=meta.max_q_len,
        max_kv_len=meta.max_kv_len,
    )
    return meta, fields


def _layout(batch_pad: int, capacity: int) -> PackedLayout:
    return PackedLayout.of(
        kv_indptr=(batch_pad + 1,),
        kv_indices=(capacity,),
        qo_indptr=(batch_pad + 1,),
        kv_last_page_len=(batch_pad,),
        max_q_len=(),
        max_kv_len=(),
    )


@functools.partial(jax.jit, static_argnames=("mode", "batch", "capacity", "n", "pad_to"))
def _build_step(req_to_token, inputs, *, mode, batch, capacity, n, pad_to):
    meta, fields = _step_fields(req_to_token, inputs, mode=mode, batch=batch, capacity=capacity,
                                n=n, pad_to=pad_to)
    return meta, _layout(pad_to, capacity).pack(fields)


def _eager_forward_metadata(buf: torch.Tensor, layout: PackedLayout, batch: int, total: int,
                            max_q_len: int, max_kv_len: int | None,
                            num_kv_splits: int | None) -> ForwardMetadata:
    """SGLang's ForwardMetadata as views of the exported packed buffer (kv_indices cut to the
    batch's `total` tokens, as SGLang sizes it). The hot path of the per-step hand-off."""
    off = layout.offsets
    return ForwardMetadata(
        buf.as_strided((batch + 1,), (1,), off["kv_indptr"]),
        buf.as_strided((total,), (1,), off["kv_indices"]),
        buf.as_strided((batch + 1,), (1,), off["qo_indptr"]),
        buf.as_strided((batch,), (1,), off["kv_last_page_len"]),
        max_q_len, max_kv_len, run_graph=False, num_kv_splits=num_kv_splits,
    )


class FuncMLAAttnBackend:
    """SGLang-style absorbed-MLA attention backend; metadata by funcmla (see module docstring).

    req_to_token:      int32 [pool, max_context_len] token slots (imported into JAX once).
    token_to_kv_pool:  MLATokenToKVPool (or anything with kv_buffer / get_key_buffer /
                       set_kv_buffer).
    page_size:         the allocator's page size (metadata stays token-granular at any size).
    num_draft_tokens:  speculative draft tokens (CUDA-graph slack; verify / draft-extend).
    attention_backend: "auto", "aiter", "pallas" or "reference" (see backend_select).
    num_kv_splits:     passed to AITER (required there).
    legacy_block_granular_kv_indices: size the CUDA-graph kv_indices buffer in blocks, as the
                       seed did, to reproduce its overflow (replay then raises).
    torch_launcher:    pallas only: launch the kernel on the torch tensors through
                       `funcmla.interop.launcher` (no DLPack per layer; capturable in a torch
                       CUDA graph) where it can run (the default; checked on an H200: 58 us of
                       host time per layer against 498 us for DLPack + jit); elsewhere, and with
                       False, the DLPack + jit path runs and `last_via` says which ran.
    """

    def __init__(self, req_to_token: torch.Tensor, token_to_kv_pool: MLATokenToKVPool, *,
                 page_size: int = 1, num_draft_tokens: int = 0,
                 attention_backend: str = "auto", num_kv_splits: int | None = None,
                 legacy_block_granular_kv_indices: bool = False, min_kv_bucket: int = 256,
                 torch_launcher: bool = True):
        if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
            raise TypeError(
                f"req_to_token must be int32 [pool, max_context_len], got {req_to_token.dtype} "
                f"{tuple(req_to_token.shape)}"
            )
        self.req_to_token = req_to_token
        self.token_to_kv_pool = token_to_kv_pool
        self.device = req_to_token.device
        self.page_size = page_size
        self.max_context_len = req_to_token.shape[1]
        self.num_draft_tokens = num_draft_tokens
        self.num_kv_splits = num_kv_splits
        self.legacy_block_granular_kv_indices = legacy_block_granular_kv_indices
        self.min_kv_bucket = min_kv_bucket
        self.attention_backend = select_backend(attention_backend)
        self.last_backend: str | None = None
        self.last_via: str | None = None
        self.torch_launcher = torch_launcher
        self._kv_indices_full: torch.Tensor | None = None  # static-capacity view (launcher)
        self._req_to_token_jax = to_jax(req_to_token)  # long-lived: imported once
        self._kv_jax: dict[int, tuple[int, jax.Array]] = {}
        self.forward_metadata: ForwardMetadata | None = None
        self._jax_meta = None
        self._mode: str | None = None
        self._max_kv_bound: int | None = None
        # CUDA-graph state
        self.buffer_plan: BufferPlan | None = None
        self._graph_layout: PackedLayout | None = None
        self._graph_buffer: torch.Tensor | None = None
        self._graph_views: dict[str, torch.Tensor] | None = None
        self._graph_meta: dict[tuple[str, int], ForwardMetadata] = {}

    # ---- helpers ---------------------------------------------------------------------------
    def _mode_of(self, forward_mode: ForwardMode) -> str:
        try:
            return _MODE_NAMES[ForwardMode(forward_mode)]
        except (KeyError, ValueError):
            raise ValueError(f"unsupported forward_mode {forward_mode!r}") from None

    def _draft_n(self, mode: str, spec_info: SpecInfo | None) -> int:
        if mode not in ("target_verify", "draft_extend"):
            return 0
        n = spec_info.draft_token_num if spec_info is not None else self.num_draft_tokens
        if not n or n <= 0:
            raise ValueError(f"{mode} needs spec_info.draft_token_num or num_draft_tokens > 0")
        return int(n)

    def _step_inputs(self, batch: int, req_pool_indices, seq_lens, extend_seq_lens=None):
        parts = [req_pool_indices[:batch], seq_lens[:batch]]
        if extend_seq_lens is not None:
            parts.append(extend_seq_lens[:batch])
        packed = torch.cat([p.to(device=self.device, dtype=torch.int32) for p in parts])
        return to_jax(packed)  # the step's one import

    def _kv_pool_jax(self, layer_id: int) -> tuple[jax.Array, object]:
        """(JAX alias of the layer's KV buffer, its fp8 dtype or None), imported once.

        fp8 pools are imported as their uint8 bytes and bitcast inside the jitted attention, so
        the alias stays live (an eager bitcast would be a stale copy)."""
        buf = self.token_to_kv_pool.get_key_buffer(layer_id)
        cached = self._kv_jax.get(layer_id)
        if cached is None or cached[0] != buf.data_ptr():
            fp8 = FP8_DTYPES.get(buf.dtype)
            cached = (buf.data_ptr(), to_jax(buf, fp8="bits"), fp8)  # once per storage
            self._kv_jax[layer_id] = cached
        return cached[1], cached[2]

    def _host_scalars(self, mode: str, seq: "_HostLens", n: int, extend_seq_lens_cpu=None):
        """(max_q_len, max_kv_len, kv tokens) from host lengths, as SGLang derives them."""
        if mode == "decode":
            return 1, seq.max, seq.sum
        if mode == "extend":
            if extend_seq_lens_cpu is None:
                raise ValueError("extend needs forward_batch.extend_seq_lens_cpu")
            return max(extend_seq_lens_cpu, default=0), seq.max, seq.sum
        if mode == "target_verify":
            return n, None, seq.sum + n * seq.count
        return n, seq.max, seq.sum

    def _kv_bound(self, mode: str, max_kv_len: int | None, seq: "_HostLens", n: int) -> int:
        """Static bound on KV tokens per request for the JAX attention (a power of two)."""
        longest = max_kv_len if max_kv_len is not None else seq.max + n
        return _next_pow2(longest, 16)

    # ---- eager metadata --------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build this step's metadata (one import, one jitted build, one export)."""
        fb = forward_batch
        mode = self._mode_of(fb.forward_mode)
        batch = int(fb.batch_size)
        if batch <= 0:
            raise ValueError(f"forward_batch.batch_size must be positive, got {batch}")
        if fb.seq_lens_cpu is None:
            raise ValueError("forward_batch.seq_lens_cpu is required (host sizes, no device sync)")
        n = self._draft_n(mode, fb.spec_info)
        seq = _HostLens.of(fb.seq_lens_cpu, batch)
        max_q, max_kv, total = self._host_scalars(mode, seq, n, fb.extend_seq_lens_cpu)
        if mode == "extend" and fb.extend_seq_lens is None:
            raise ValueError("extend needs forward_batch.extend_seq_lens")
        capacity = _next_pow2(total, self.min_kv_bucket)
        inputs = self._step_inputs(batch, fb.req_pool_indices, fb.seq_lens,
                                   fb.extend_seq_lens if mode == "extend" else None)
        meta, packed = _build_step(self._req_to_token_jax, inputs, mode=mode, batch=batch,
                                   capacity=capacity, n=n, pad_to=batch)
        layout = _layout(batch, capacity)
        buf = to_torch(packed)  # the step's one export, then 4 views
        self.forward_metadata = _eager_forward_metadata(buf, layout, batch, total, max_q, max_kv,
                                                        self.num_kv_splits)
        if self.torch_launcher:
            self._kv_indices_full = buf.as_strided((capacity,), (1,),
                                                   layout.offsets["kv_indices"])

        self._jax_meta, self._mode = meta, mode
        self._max_kv_bound = self._kv_bound(mode, max_kv, seq, n)

    # ---- CUDA graphs -----------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int,
                              kv_indices_buf: torch.Tensor | None = None) -> None:
        """Allocate the static packed metadata buffer (token-granular kv_indices capacity)."""
        if kv_indices_buf is not None:
            raise ValueError(
                "kv_indices_buf is not supported: the kv_indices buffer lives inside the static "
                "packed metadata buffer, so replay is a single copy"
            )
        del max_num_tokens  # no custom mask for MLA
        self.buffer_plan = BufferPlan(
            max_bs=max_bs, max_context_len=self.max_context_len, page_size=self.page_size,
            num_draft_tokens=self.num_draft_tokens,
            legacy_block_granular_kv_indices=self.legacy_block_granular_kv_indices,
        )
        self._graph_layout = _layout(max_bs, self.buffer_plan.kv_indices_capacity)
        self._graph_buffer = self._graph_layout.empty_torch(self.device)
        self._graph_views = self._graph_layout.torch_views(self._graph_buffer)
        self._graph_views["kv_last_page_len"].fill_(1)
        self._graph_meta = {}

    def _check_fits(self, mode: str, bs: int, seq_lens_cpu, n: int) -> "_HostLens":
        """Host-side check that the batch fits the captured buffers; returns its lengths."""
        plan = self.buffer_plan
        if plan is None:
            raise RuntimeError("call init_cuda_graph_state before capturing or replaying")
        if bs > plan.max_bs:
            raise CudaGraphBufferOverflow(
                f"batch size {bs} exceeds the captured max_bs={plan.max_bs}")
        seq = _HostLens.of(seq_lens_cpu, bs)
        extra = n if mode == "target_verify" else 0
        longest = seq.max + extra
        if longest > self.max_context_len:
            raise CudaGraphBufferOverflow(
                f"a request needs {longest} KV tokens (seq_len {longest - extra}"
                f"{f' + {extra} drafts' if extra else ''}) but req_to_token rows hold "
                f"max_context_len={self.max_context_len}")
        need = seq.sum + extra * bs
        cap = plan.kv_indices_capacity
        if need > cap:
            unit = ("blocks: the legacy block-granular sizing, the seed's overflow bug"
                    if plan.legacy_block_granular_kv_indices else "tokens")
            raise CudaGraphBufferOverflow(
                f"replayed {mode} batch needs {need} kv_indices entries (token slots) but the "
                f"captured buffer holds {cap} ({unit}; max_bs={plan.max_bs}, "
                f"max_context_len={plan.max_context_len}, page_size={plan.page_size}, "
                f"num_draft_tokens={plan.num_draft_tokens}); writing it would run out of bounds")
        return seq
        return need

    def _fill_graph_buffers(self, mode: str, bs: int, req_pool_indices, seq_lens, n: int):
        plan = self.buffer_plan
        inputs = self._step_inputs(bs, req_pool_indices, seq_lens)
        meta, packed = _build_step(self._req_to_token_jax, inputs, mode=mode, batch=bs,
                                   capacity=plan.kv_indices_capacity, n=n, pad_to=plan.max_bs)
        self._graph_buffer.copy_(to_torch(packed))  # one export, one device copy
        return meta

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int,
                                                 req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor, encoder_lens,
                                                 forward_mode: ForwardMode,
                                                 spec_info: SpecInfo | None) -> None:
        """Fill the static buffers for a capture of batch size `bs` and bind views to them."""
        del num_tokens, encoder_lens
        mode = self._mode_of(forward_mode)
        if mode == "extend":
            raise ValueError("CUDA-graph capture covers decode, target_verify and draft_extend")
        n = self._draft_n(mode, spec_info)
        # seq_lens.cpu(): capture time only (as SGLang does)
        seq_cpu = self._check_fits(mode, bs, seq_lens[:bs].cpu(), n)
        meta = self._fill_graph_buffers(mode, bs, req_pool_indices, seq_lens, n)
        v = self._graph_views
        max_q, max_kv, _ = self._host_scalars(mode, seq_cpu, n)
        fm = ForwardMetadata(v["kv_indptr"][: bs + 1], v["kv_indices"], v["qo_indptr"][: bs + 1],
                             v["kv_last_page_len"][:bs], max_q, max_kv, run_graph=True,
                             num_kv_splits=self.num_kv_splits)
        self._graph_meta[(mode, bs)] = fm
        self.forward_metadata = fm
        self._kv_indices_full = v["kv_indices"]
        self._jax_meta, self._mode = meta, mode
        self._max_kv_bound = self._kv_bound(mode, max_kv, seq_cpu, n)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                encoder_lens, forward_mode: ForwardMode,
                                                spec_info: SpecInfo | None,
                                                seq_lens_cpu: torch.Tensor | None) -> None:
        """Rebuild the metadata into the captured buffers; raise if the batch no longer fits."""
        del encoder_lens, seq_lens_sum  # recomputed from seq_lens_cpu (host) and checked
        mode = self._mode_of(forward_mode)
        if seq_lens_cpu is None:
            raise ValueError("seq_lens_cpu is required for replay (host-side fit check)")
        n = self._draft_n(mode, spec_info)
        seq = self._check_fits(mode, bs, seq_lens_cpu, n)
        fm = self._graph_meta.get((mode, bs))
        if fm is None:
            raise ValueError(f"no CUDA graph was captured for mode {mode!r} at batch size {bs}")
        self._jax_meta = self._fill_graph_buffers(mode, bs, req_pool_indices, seq_lens, n)
        _, max_kv, _ = self._host_scalars(mode, seq, n)
        fm.max_kv_len = max_kv
        self.forward_metadata, self._mode = fm, mode
        self._kv_indices_full = fm.kv_indices
        self._max_kv_bound = self._kv_bound(mode, max_kv, seq, n)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- attention -------------------------------------------------------------------------
    def _attend(self, q, layer: RadixAttention, causal: bool) -> torch.Tensor:
        if self.forward_metadata is None:
            raise RuntimeError("call init_forward_metadata (or a CUDA-graph init) first")
        heads = layer.tp_q_head_num
        q3 = q.reshape(-1, heads, layer.qk_head_dim)
        if self.attention_backend == "aiter":
            res = mla_attention(q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                self.forward_metadata, sm_scale=layer.scaling,
                                v_head_dim=layer.v_head_dim, causal=causal, backend="aiter",
                                mode=self._mode, num_kv_splits=self.num_kv_splits,
                                q_scale=layer.k_scale if q.dtype in FP8_DTYPES else None,
                                kv_scale=layer.k_scale)
        else:
            launch = self.torch_launcher and self.attention_backend == "pallas"
            inputs = ((self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                       self.forward_metadata.kv_indptr, self._kv_indices_full) if launch else None)
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if capturing:
                reason = _launcher_reason(q3, inputs) if launch else "torch_launcher is off"
                if reason is not None:
                    raise RuntimeError(
                        f"the {self.attention_backend!r} backend runs in JAX here ({reason}), "
                        "which a torch CUDA graph cannot capture; capture with the aiter backend "
                        "or the pallas torch launcher, or run eagerly")
            # under capture the launcher runs (checked above): no DLPack import of the pool
            kv, kv_fp8 = (None, None) if capturing else self._kv_pool_jax(layer.layer_id)
            res = mla_attention(q3, kv, self._jax_meta,
                                sm_scale=layer.scaling, v_head_dim=layer.v_head_dim,
                                causal=causal, backend=self.attention_backend,
                                max_kv_len=self._max_kv_bound, kv_fp8_dtype=kv_fp8,
                                kv_scale=layer.k_scale if kv_fp8 is not None else None,
                                return_lse=False, use_launcher=launch,
                                launcher_inputs=inputs)
        self.last_backend, self.last_via = res.backend, res.via
        return res.out.reshape(-1, heads * layer.v_head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Write this step's latent rows, then attend -> [T, H * v_head_dim] in q's dtype."""
        return self._save_and_attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Absorbed extend (bottom-right causal over prefix + new tokens)."""
        return self._save_and_attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _save_and_attend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                         save_kv_cache: bool) -> torch.Tensor:
        """SGLang's order for both modes: store the step's latent rows (out_cache_loc), then
        attend bottom-right causal over everything the metadata lists."""
        if save_kv_cache and k is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        return self._attend(q, layer, causal=True)

    def forward(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        """SGLang's dispatch: decode-like modes to forward_decode, extend to forward_extend."""
        if forward_batch.forward_mode.is_extend():
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
