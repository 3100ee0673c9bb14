"""`funcmla.attention.pallas.prefill_layout` restated in torch ops, on torch's stream.

The prefill launcher needs the realigned layout's index arrays on the device, from token CSRs
that are device tensors, without a host sync and inside a CUDA graph capture: so the JAX rule is
restated with the same integer operations (searchsorted, cumsum, clamps), each step exact in
int32 / int64. tests/test_launcher_prefill.py holds the two equal on random batches (the JAX
function is the reference). Returns the core's `PrefillLayout` with int32 torch tensors.
"""

from __future__ import annotations

import torch

from funcmla.attention.pallas.prefill_layout import (
    ROW_ALIGN,
    PrefillGeometry,
    PrefillLayout,
    check_fits,
)
from funcmla.attention.pallas.prefill_mgpu import BLOCK_Q
from funcmla.interop.launcher.segments import segment_positions

__all__ = ["torch_prefill_layout"]


def torch_prefill_layout(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, tq: int, tk: int,
                         geometry: PrefillGeometry) -> PrefillLayout:
    """`prefill_layout(qo_indptr, kv_indptr, tq, tk, geometry)` for int32 torch CSRs [B + 1]
    (B <= geometry.batch) on one device; every array on that device, int32."""
    b = qo_indptr.shape[0] - 1
    check_fits(geometry, b, tq, tk)
    pad = geometry.batch - b
    dev = qo_indptr.device
    qo = torch.cat([qo_indptr, qo_indptr[-1:].expand(pad),
                    torch.full((1,), tq, dtype=torch.int32, device=dev)])
    kv = torch.cat([kv_indptr, kv_indptr[-1:].expand(pad + 1)])
    qo_a, kv_a = _aligned(qo), _aligned(kv)
    r = geometry.num_reqs
    # tile_schedule(qo_a, num_slots): request i takes ceil(len_i / 128) consecutive slots
    tiles = (qo_a[1:] - qo_a[:-1] + BLOCK_Q - 1) // BLOCK_Q
    ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    starts = ends - tiles
    slot = torch.arange(geometry.num_slots, dtype=torch.int32, device=dev)
    req = torch.searchsorted(ends, slot, right=True, out_int32=True)
    live = req < r
    first = (slot - starts[req.clamp(max=r - 1)]) * BLOCK_Q
    row, j, _ = segment_positions(qo, tq)  # every row < tq lies in a request (qo[-1] = tq)
    q_tiles = (qo[1:] - qo[:-1] + BLOCK_Q - 1) // BLOCK_Q
    q_first = torch.cumsum(q_tiles, 0, dtype=torch.int32) - q_tiles
    i32 = torch.int32
    return PrefillLayout(
        qo_indptr=qo_a, kv_indptr=kv_a, q_lens=(qo[1:] - qo[:-1]).to(i32),
        kv_lens=(kv[1:] - kv[:-1]).to(i32),
        tile_req=torch.where(live, req, -1).to(i32),
        tile_first=torch.where(live, first, 0).to(i32),
        q_src=_sources(qo, qo_a, geometry.q_rows, tq),
        kv_src=_sources(kv, kv_a, geometry.kv_rows, tk),
        out_rows=(qo_a[row] + j).clamp(0, geometry.q_rows - 1).to(i32),
        lse_cols=((q_first[row] + j // BLOCK_Q) * BLOCK_Q + j % BLOCK_Q).clamp(
            0, geometry.num_slots * BLOCK_Q - 1).to(i32))


def _aligned(indptr: torch.Tensor) -> torch.Tensor:
    """The CSR of the lengths rounded up to ROW_ALIGN (`prefill_layout._aligned_indptr`)."""
    lens = indptr[1:] - indptr[:-1]
    padded = (lens + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    return torch.cat([torch.zeros(1, dtype=torch.int32, device=indptr.device),
                      torch.cumsum(padded, 0, dtype=torch.int32)])


def _sources(indptr: torch.Tensor, aligned: torch.Tensor, rows: int, t: int) -> torch.Tensor:
    """`prefill_layout._sources`: the source row of each of `rows` realigned rows."""
    req, j, _ = segment_positions(aligned, rows)
    src = torch.where(j < indptr[req + 1] - indptr[req], indptr[req] + j, 0)
    return src.clamp(0, max(t - 1, 0)).to(torch.int32)
