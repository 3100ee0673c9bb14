"""`funcmla.attention.pallas.prefill_layout` restated in torch ops, on torch's stream.

The prefill launcher needs the kernel's index arrays on the device, from token CSRs that are
device tensors, without a host sync and inside a CUDA graph capture: so the JAX rule is restated
with the same integer operations (remainders, cumsum, searchsorted, clamps), each step exact in
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
    r = geometry.num_reqs
    i32 = torch.int32
    # tile_counts / tile_schedule: request i takes ceil((lead_i + q_len_i) / 128) consecutive
    # slots (none without queries), its rows counted from its 8-row group
    q_lens = qo[1:] - qo[:-1]
    leads = qo[:-1] % ROW_ALIGN
    tiles = torch.where(q_lens > 0, (leads + q_lens + BLOCK_Q - 1) // BLOCK_Q, 0)
    ends = torch.cumsum(tiles, 0, dtype=i32)
    starts = ends - tiles
    slot = torch.arange(geometry.num_slots, dtype=i32, device=dev)
    req = torch.searchsorted(ends, slot, right=True, out_int32=True)
    live = req < r
    # tile_shifts: tiles move up so the last ends on the last row's 8-row group, unless that
    # starts before row 0
    span = (leads + q_lens + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    shift = tiles * BLOCK_Q - span
    shift = torch.where((q_lens > 0) & (qo[:-1] - leads - shift >= 0), shift, 0)
    reqc = req.clamp(max=r - 1)
    first = (slot - starts[reqc]) * BLOCK_Q - shift[reqc]
    return PrefillLayout(
        qo_indptr=qo, kv_indptr=kv, q_lens=q_lens.to(i32), kv_lens=(kv[1:] - kv[:-1]).to(i32),
        tile_req=torch.where(live, req, -1).to(i32),
        tile_first=torch.where(live, first, 0).to(i32))
