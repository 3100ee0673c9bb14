"""Extend launcher: `mla_extend` on torch tensors and torch's stream.

`mla_extend` runs a ragged extend as a decode over query chunks: each request's queries are cut
into chunks of C = `chunk_tokens(H)` tokens aligned to its end, each chunk a pseudo-sequence of
the "lens" `KVRows` form (the request's first table entry, the keys its last query sees). This
launcher computes that per-step metadata in torch ops (`torch_extend_chunks`, a restatement of
`extend_chunks` held equal to it by tests), and per layer gathers q into the chunks (C > 1, or
fewer q rows than the configuration's capacity), runs the decode kernels `mla_extend` picks for
the same shapes through a `LensDecodeLauncher` (one foreign call: the decode kernel, and the
merge where the KV is split), and gathers out / lse back to the caller's tokens. Everything is
stream-ordered on `torch.cuda.current_stream()` with no host sync, so a CUDA graph captures a
step. Design and numbers: docs/torch_launcher.md ("Extend").
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp

from funcmla.attention.pallas import KV_FP8_DTYPE, DecodeKernelConfig
from funcmla.attention.pallas.extend import chunk_tokens, extend_kernel_config, num_pseudo_seqs
from funcmla.interop.launcher.checks import expect_tensor
from funcmla.interop.launcher.decode import LensDecodeLauncher, decode_launcher
from funcmla.interop.launcher.device import cuda_device_index, launcher_unavailable_reason
from funcmla.interop.launcher.errors import LauncherArgumentError, LauncherUnavailable
from funcmla.interop.launcher.plan import DecodeLaunchConfig
from funcmla.interop.launcher.segments import segment_positions

__all__ = ["ExtendLaunchConfig", "ExtendStep", "ExtendLauncher", "extend_launcher",
           "torch_extend_chunks", "torch_chunk_rows"]


@dataclasses.dataclass(frozen=True)
class ExtendLaunchConfig:
    """Static configuration of an extend launcher (hashable: the cache key).

    num_heads: H. q_capacity: the most query rows a call passes (T <= q_capacity); batch: the
    most requests (qo_indptr [B + 1], B <= batch). pool_rows: kv_pool's rows (token slots).
    page_size 1: a token CSR (kv_indptr [B + 1], kv_indices [kv_capacity] token slots); > 1:
    a page table [batch, kv_capacity // batch] of page ids and lengths [batch] (tokens).
    max_kv_len: token CSR only, the static bound on keys per request for the split rule (None:
    kv_capacity, as `mla_extend`); max_q_len: a static bound on queries per request, which
    tightens the pseudo-sequence count where C > 1. causal, num_splits, head_dim, v_head_dim,
    dtype, kv_dtype ("float8_e4m3fn": an fp8 pool with per-call k_scale / v_scale) and kernel
    as `mla_extend` / `DecodeLaunchConfig`."""

    num_heads: int
    q_capacity: int
    batch: int
    pool_rows: int
    kv_capacity: int
    sm_scale: float
    page_size: int = 1
    max_kv_len: int | None = None
    max_q_len: int | None = None
    causal: bool = True
    num_splits: int | None = None
    head_dim: int = 576
    v_head_dim: int = 512
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    kernel: DecodeKernelConfig = DecodeKernelConfig()

    def __post_init__(self):
        for name in ("num_heads", "q_capacity", "batch", "pool_rows", "kv_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ExtendLaunchConfig.{name} must be an int >= 1, got "
                                 f"{value!r}")
        for name in ("max_kv_len", "max_q_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"ExtendLaunchConfig.{name} must be None or an int >= 1, "
                                 f"got {value!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"ExtendLaunchConfig.causal must be a bool, got {self.causal!r}")
        if self.page_size > 1:
            if self.kv_capacity % self.batch:
                raise ValueError(f"ExtendLaunchConfig.kv_capacity={self.kv_capacity} must be "
                                 f"batch * max_pages (batch={self.batch}) for a page table")
            if self.max_kv_len is not None:
                raise ValueError("ExtendLaunchConfig.max_kv_len is implied by the page table "
                                 "(max_pages * page_size); leave it None")
        self.decode_config  # the decode configuration's own checks (page size, dtypes, ...)

    @property
    def chunk(self) -> int:
        """C, the query tokens of one pseudo-sequence (`chunk_tokens`)."""
        return chunk_tokens(self.num_heads, self.causal)

    @property
    def num_pseudo(self) -> int:
        """P, the pseudo-sequences of a call at the capacities (`num_pseudo_seqs`)."""
        return num_pseudo_seqs(self.q_capacity, self.batch, self.chunk, self.max_q_len)

    @property
    def max_pages(self) -> int:
        return self.kv_capacity // self.batch

    @property
    def kv_bound(self) -> int:
        """The static bound on a request's keys (`mla_extend`'s)."""
        if self.page_size > 1:
            return self.max_pages * self.page_size
        return self.kv_capacity if self.max_kv_len is None else self.max_kv_len

    @property
    def decode_config(self) -> DecodeLaunchConfig:
        """The "lens" decode over the P pseudo-sequences, with the kernel `mla_extend` picks
        for them (`extend_kernel_config`)."""
        c, p = self.chunk, self.num_pseudo
        kv_dtype = KV_FP8_DTYPE if self.kv_dtype == KV_FP8_DTYPE.name else jnp.dtype(
            self.kv_dtype or self.dtype)
        kernel = extend_kernel_config(self.kernel, self.num_heads, c, p, self.page_size,
                                      head_dim=self.head_dim, v_head_dim=self.v_head_dim,
                                      dtype=jnp.dtype(self.dtype), kv_dtype=kv_dtype,
                                      pool_rows=self.pool_rows)
        return DecodeLaunchConfig(
            num_seqs=p, num_heads=self.num_heads, pool_rows=self.pool_rows,
            kv_capacity=self.kv_capacity, sm_scale=self.sm_scale, s_q=c,
            max_kv_len=self.kv_bound, num_splits=self.num_splits, head_dim=self.head_dim,
            v_head_dim=self.v_head_dim, dtype=self.dtype, kernel=kernel,
            page_size=self.page_size, kv_dtype=self.kv_dtype, lens=True)


def torch_extend_chunks(qo_indptr, req_start, req_kv_lens, *, num_pseudo: int, chunk: int,
                        causal: bool):
    """`funcmla.attention.pallas.extend.extend_chunks` for int32 torch tensors on one device:
    (table_start [P], kv_lens [P], chunk_indptr [B + 1]), int32."""
    import torch

    i32 = torch.int32
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    n = (q_lens.clamp(min=0) + chunk - 1) // chunk
    chunk_indptr = torch.cat([torch.zeros(1, dtype=i32, device=qo_indptr.device),
                              torch.cumsum(n, 0, dtype=i32)])
    req, c, live = segment_positions(chunk_indptr, num_pseudo)
    kv = req_kv_lens[req]
    if causal:
        kv = kv - (n[req] - 1 - c) * chunk
    kv_lens = torch.where(live, kv.clamp(min=0), 0).to(i32)
    table_start = torch.where(live, req_start[req], 0).to(i32)
    return table_start, kv_lens, chunk_indptr.to(i32)


def torch_chunk_rows(qo_indptr, chunk_indptr, *, num_pseudo: int, chunk: int, num_q: int):
    """(q_rows [P * C], out_rows [num_q]), int32: the query token of each pseudo-sequence
    row (-1: padding) and the pseudo-sequence row of each token (-1: past qo_indptr[-1]);
    `_chunk_tokens_of_pseudo` and `_pseudo_of_tokens` of funcmla.attention.pallas.extend in
    torch ops."""
    import torch

    i32 = torch.int32
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    n = chunk_indptr[1:] - chunk_indptr[:-1]
    req, k, live = segment_positions(chunk_indptr, num_pseudo)
    j = (q_lens[req] - (n[req] - k) * chunk)[:, None] + torch.arange(
        chunk, dtype=i32, device=qo_indptr.device)
    q_rows = torch.where(live[:, None] & (j >= 0), qo_indptr[req][:, None] + j, -1)
    req, j, live = segment_positions(qo_indptr, num_q)
    back = q_lens[req] - 1 - j
    pseudo = chunk_indptr[req] + n[req] - 1 - torch.div(back, chunk, rounding_mode="floor")
    row = pseudo * chunk + chunk - 1 - torch.remainder(back, chunk)
    out_rows = torch.where(live & (pseudo >= 0), row, -1)
    return q_rows.reshape(-1).to(i32), out_rows.to(i32)


@dataclasses.dataclass(frozen=True, eq=False)
class ExtendStep:
    """One step's pseudo-sequences on the device (`ExtendLauncher.layout`) for calls with
    num_q query rows: table_start / kv_lens [P] and the table; q_rows [P * C] (the query token
    of each pseudo-sequence row, -1: padding) and out_rows [num_q] (the pseudo-sequence row of
    each token, -1: a token past qo_indptr[-1]), None where q and out are used as they lie;
    `gathers` holds what a call's gathers read (sources clamped into range, the mask of the
    tokens whose out / lse are 0 / +inf), computed once for the step's layers."""

    config: ExtendLaunchConfig
    num_q: int
    table_start: object
    kv_lens: object
    table: object
    q_rows: object | None
    out_rows: object | None
    gathers: tuple | None = None


class ExtendLauncher:
    """`mla_extend` on torch tensors for every batch within an `ExtendLaunchConfig`.

    layout(qo_indptr [B + 1], kv_indptr=None [B + 1], kv_indices=None [kv_capacity],
    page_table=None [batch, max_pages], lengths=None [batch], *, num_q) -> ExtendStep: a token
    CSR (page_size 1) or a page table (page_size > 1), int32 tensors on the launcher's device
    (torch ops on the current stream; every layer of the step reuses the result).
    __call__(q [num_q, H, 576] (or [num_q, H * 576]), kv_pool, step, *, out=None, lse=None,
    k_scale=None, v_scale=None, return_lse=True) -> (out [num_q, H, 512], lse [num_q, H]
    float32; None with return_lse=False, which skips its gather), semantics
    `mla_extend`'s: bottom-right causal (or full), a query with no key gets out 0 and lse
    +inf, pool rows no request uses never reach an output. Tensors are checked (dtype, shape,
    device) before anything runs; index values are the caller's contract, and any value keeps
    every access in bounds (the decode kernels clamp table entries and never read past
    kv_len)."""

    def __init__(self, config: ExtendLaunchConfig, decode: LensDecodeLauncher):
        import torch

        if decode.config != config.decode_config:
            raise ValueError("the decode launcher is not the one of this extend configuration")
        self.config, self.decode, self.device = config, decode, decode.device
        self.device_index = decode.device_index
        self._torch, self._i32 = torch, torch.int32
        if (config.head_dim * 2) % 8 or (config.v_head_dim * 2) % 8:
            raise ValueError("the extend launcher's gathers move 8-byte words: head_dim and "
                             "v_head_dim must be multiples of 4")
        self._words = torch.int64

    # ------------------------------------------------------------------------ per step
    def layout(self, qo_indptr, kv_indptr=None, kv_indices=None, page_table=None,
               lengths=None, *, num_q: int) -> ExtendStep:
        torch, c = self._torch, self.config
        self._vector("qo_indptr", qo_indptr, None)
        b = qo_indptr.shape[0] - 1
        if not 1 <= b <= c.batch:
            raise LauncherArgumentError(f"qo_indptr has {b + 1} entries; the launcher takes "
                                        f"[B + 1] with 1 <= B <= batch = {c.batch}")
        if not isinstance(num_q, int) or isinstance(num_q, bool) or not 0 <= num_q <= \
                c.q_capacity:
            raise LauncherArgumentError(f"num_q = {num_q!r} must be an int in [0, "
                                        f"{c.q_capacity}] (the launcher's q_capacity)")
        if c.page_size == 1:
            if page_table is not None or lengths is not None:
                raise LauncherArgumentError("a page_size-1 launcher takes kv_indptr and "
                                            "kv_indices, not page_table / lengths")
            self._vector("kv_indptr", kv_indptr, b + 1)
            self._vector("kv_indices", kv_indices, c.kv_capacity)
            req_start, req_kv = kv_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1]
            table = kv_indices.contiguous()
        else:
            if kv_indptr is not None or kv_indices is not None:
                raise LauncherArgumentError(f"a page_size-{c.page_size} launcher takes "
                                            "page_table and lengths, not kv_indptr / kv_indices")
            self._vector("lengths", lengths, b)
            self._expect("page_table", page_table)
            if tuple(page_table.shape) != (b, c.max_pages):
                raise LauncherArgumentError(f"page_table has shape {list(page_table.shape)}; "
                                            f"the launcher takes [B, {c.max_pages}] for B = {b}")
            req_kv = lengths
            req_start = torch.arange(b, dtype=self._i32, device=self.device) * c.max_pages
            table = page_table.reshape(-1)
            if b < c.batch:  # the table at its static size: the spare rows are never read
                table = torch.cat([table, table.new_zeros((c.batch - b) * c.max_pages)])
            table = table.contiguous()
        p, ch = c.num_pseudo, c.chunk
        table_start, kv_lens, chunk_indptr = torch_extend_chunks(
            qo_indptr, req_start, req_kv, num_pseudo=p, chunk=ch, causal=c.causal)
        q_rows = out_rows = gathers = None
        if ch > 1 or num_q != p:
            q_rows, out_rows = torch_chunk_rows(qo_indptr, chunk_indptr, num_pseudo=p,
                                                chunk=ch, num_q=num_q)
            # sources clamped into both tensors: CSR values past their rows (the caller's
            # contract) gather some row, never one outside
            gathers = (q_rows.clamp(0, max(num_q - 1, 0)), out_rows.clamp(0, p * ch - 1),
                       (out_rows < 0)[:, None])
        return ExtendStep(c, num_q, table_start, kv_lens, table, q_rows, out_rows, gathers)

    # ------------------------------------------------------------------------ per layer
    def __call__(self, q, kv_pool, step: ExtendStep, *, out=None, lse=None, k_scale=None,
                 v_scale=None, return_lse: bool = True):
        torch, c = self._torch, self.config
        if not (isinstance(step, ExtendStep) and step.config == c):
            raise LauncherArgumentError(f"step must be a layout of this launcher, got "
                                        f"{type(step).__name__}")
        h, d, dv, t = c.num_heads, c.head_dim, c.v_head_dim, step.num_q
        self._expect("q", q, getattr(torch, c.dtype))
        if tuple(q.shape) not in ((t, h, d), (t, h * d)):
            raise LauncherArgumentError(f"q has shape {list(q.shape)}; the step's layout is for "
                                        f"[{t}, {h}, {d}] (or [{t}, {h * d}])")
        if not return_lse and lse is not None:
            raise LauncherArgumentError("lse= is given with return_lse=False")
        if step.q_rows is None:  # q and out as they lie: one foreign call
            out, lse = self.decode(q, kv_pool, step.table_start, step.kv_lens, step.table,
                                   out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
            return out, (lse if return_lse else None)
        for name, x, dtype, shape in (("out", out, getattr(torch, c.dtype), ((t, h, dv),
                                                                             (t, h * dv))),
                                      ("lse", lse, torch.float32, ((t, h),))):
            if x is not None:
                self._expect(name, x, dtype)
                if tuple(x.shape) not in shape or not x.is_contiguous():
                    raise LauncherArgumentError(
                        f"{name} must be contiguous of shape {' or '.join(map(str, shape))}, "
                        f"got {list(x.shape)}")
        if t == 0:  # nothing to launch; the pool and the scales are checked all the same
            self.decode.check_pool(kv_pool, k_scale, v_scale)
            out = torch.empty((0, h, dv), dtype=q.dtype, device=self.device) if out is None \
                else out.view(0, h, dv)
            if not return_lse:
                return out, None
            return out, (torch.empty((0, h), dtype=torch.float32, device=self.device)
                         if lse is None else lse)
        q_src, o_src, o_dead = step.gathers
        # rows move as 8-byte words (a 576-column bf16 row is 144 of them): torch's row
        # gather runs at about twice the bandwidth of 2-byte elements. A padding row of a
        # chunk takes some token's q: the kernels keep rows apart (a row's scores, softmax
        # and output are its own) and no padding row is stored, so its values never matter.
        words = self._words
        qp = torch.index_select(q.reshape(t, -1).view(words), 0, q_src)
        o, l = self.decode(qp.view(q.dtype).view(-1, h, d), kv_pool, step.table_start,
                           step.kv_lens, step.table, k_scale=k_scale, v_scale=v_scale)
        out = torch.empty((t, h, dv), dtype=o.dtype, device=self.device) if out is None \
            else out.view(t, h, dv)
        torch.index_select(o.view(o.shape[0], -1).view(words), 0, o_src,
                           out=out.view(t, -1).view(words))
        out.view(t, -1).view(words).masked_fill_(o_dead, 0)
        if not return_lse:
            return out, None
        lse = torch.empty((t, h), dtype=torch.float32, device=self.device) if lse is None \
            else lse
        torch.index_select(l, 0, o_src, out=lse)
        lse.masked_fill_(o_dead, math.inf)
        return out, lse

    # ------------------------------------------------------------------------ checks
    def _expect(self, name, x, dtype=None) -> None:
        """x is a torch tensor of `dtype` (default int32) on the launcher's device."""
        expect_tensor(name, x, self._i32 if dtype is None else dtype, self.device_index,
                      self.device)

    def _vector(self, name, x, size: int | None) -> None:
        self._expect(name, x)
        if x.ndim != 1 or (size is not None and x.shape[0] != size) or x.shape[0] < 1:
            want = "[B + 1]" if size is None else f"[{size}]"
            raise LauncherArgumentError(f"{name} has shape {list(x.shape)}; the launcher takes "
                                        f"{want}")

    def info(self) -> dict:
        c = self.config
        return {"config": dataclasses.asdict(c), "chunk": c.chunk, "num_pseudo": c.num_pseudo,
                "decode": self.decode.info()}


def extend_launcher(config: ExtendLaunchConfig, device=None) -> ExtendLauncher:
    """The launcher of `config` on `device` (a torch CUDA device, index or None: the current
    one): its "lens" decode launcher built (lowered, compiled, loaded) on first use and
    cached (`decode_launcher`)."""
    if not isinstance(config, ExtendLaunchConfig):
        raise TypeError(f"config must be an ExtendLaunchConfig, got {type(config).__name__}")
    if not (isinstance(config.sm_scale, numbers.Real) and math.isfinite(config.sm_scale)):
        raise ValueError(f"ExtendLaunchConfig.sm_scale={config.sm_scale!r} must be finite")
    cuda_device_index(device)  # LauncherUnavailable for a device that is not CUDA
    why = launcher_unavailable_reason()
    if why is not None:  # before lowering anything
        raise LauncherUnavailable(why)
    return ExtendLauncher(config, decode_launcher(config.decode_config, device))
