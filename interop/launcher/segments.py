"""`funcmla.segments.segment_positions` in torch ops, for the launchers' per-step layouts
(prefill_layout, extend): on the device, no host sync, capturable in a CUDA graph."""

from __future__ import annotations

__all__ = ["segment_positions"]


def segment_positions(indptr, size: int):
    """For each position t in [0, size) of an int32 CSR [B + 1] (torch tensor): (row clamped to
    the last one, t - indptr[row], live = t lies in a row), int32 / bool tensors."""
    import torch

    b = indptr.shape[0] - 1
    t = torch.arange(size, dtype=torch.int32, device=indptr.device)
    seg = torch.searchsorted(indptr[1:], t, right=True, out_int32=True)
    row = seg.clamp(max=b - 1)
    return row, t - indptr[row], seg < b
