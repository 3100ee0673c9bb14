"""Checks of a step's inputs from what is on the host, with no device sync.

SGLang passes host mirrors of the step's lengths (`seq_lens_cpu`, `seq_lens_sum`,
`extend_seq_lens_cpu`); every value check here reads only those, tensor dtypes and shapes
(host metadata), and device tensors that happen to live on the CPU. Nothing here launches
device work, so a failing check leaves every buffer untouched.

Checkable without a sync (always checked):
  batch size against the largest bucket / the CUDA-graph max_bs; IDLE batches empty;
  dtypes of req_pool_indices / seq_lens / extend_seq_lens (integers only); seq_lens_cpu values
  (>= 0, >= 1 where a query must see a key, <= max_context_len including draft tokens);
  seq_lens_sum == sum(seq_lens_cpu); extend_seq_lens_cpu (0 <= extend <= seq_len);
  out_cache_loc's length against the step's query tokens.
Checkable only when the tensor is on the CPU (checked then):
  req_pool_indices values in [0, pool rows); seq_lens == seq_lens_cpu; extend_seq_lens ==
  extend_seq_lens_cpu.
Not checkable on a GPU without a sync (documented in docs/sglang_backend.md):
  device req_pool_indices values and agreement of device seq_lens with seq_lens_cpu. The
  metadata program reads req_to_token with clamped gathers, so such a mismatch cannot read or
  write out of bounds, but it can produce metadata for the wrong rows.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["INT_DTYPES", "HostLens", "check_int_tensor", "host_lens", "check_max", "check_rows",
           "check_same", "check_out_cache_loc"]


INT_DTYPES = frozenset({torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8})
# signed dtype -> (unsigned view, signed max): the lower-bound test below
_UNSIGNED = {np.dtype(t): (np.dtype(u), int(np.iinfo(t).max)) for t, u in (
    (np.int32, np.uint32), (np.int64, np.uint64), (np.int16, np.uint16), (np.int8, np.uint8))}


class HostLens:
    """max / sum / count of the batch's host lengths (NumPy, computed once per step).

    The lower bound costs no extra pass: `(arr - lo)` viewed as unsigned has its maximum above
    the signed range exactly when some value is below `lo` (bench/interop.py: checks' cost)."""

    __slots__ = ("arr", "max", "sum", "count")

    def __init__(self, arr: np.ndarray, lo: int = 0, field: str = "seq_lens_cpu"):
        self.arr = arr
        self.count = n = int(arr.shape[0])
        if not n:
            self.max = self.sum = 0
            return
        unsigned = _UNSIGNED.get(arr.dtype)
        if unsigned is None:
            if arr.dtype.kind != "u":
                raise TypeError(f"{field} must hold integers, got {arr.dtype}")
            arr = arr.astype(np.int64)
            unsigned = _UNSIGNED[arr.dtype]
        shifted = arr - lo if lo else arr
        top = int(shifted.view(unsigned[0]).max())
        # below lo: negative after the shift (top past the signed range), or so far below that
        # the shift wrapped it round to the top of the signed range (top + lo past it)
        if top + lo > unsigned[1]:
            i = int(np.argmin(arr))
            raise ValueError(f"{field}[{i}] = {int(arr[i])} is below the minimum {lo}")
        self.max = top + lo
        self.sum = int(arr.sum(dtype=np.int64))


def check_int_tensor(t, field: str) -> None:
    """t must be a torch integer tensor (a float index would be truncated silently)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{field} must be a torch tensor, got {type(t).__name__}")
    if t.dtype not in INT_DTYPES:
        raise TypeError(f"{field} must be an integer tensor (int32/int64), got {t.dtype}")


def host_lens(lens, batch: int, field: str = "seq_lens_cpu", lo: int = 0) -> HostLens:
    """The first `batch` entries of a host tensor / list as NumPy, checked for shape, integer
    values and `>= lo`."""
    if lens is None:
        raise ValueError(f"forward_batch.{field} is required (host lengths: no device sync)")
    if isinstance(lens, torch.Tensor):
        try:
            arr = lens[:batch].numpy()  # dtype: HostLens checks it on the NumPy side
        except TypeError:  # not on the host (or a dtype NumPy lacks)
            if lens.device.type != "cpu":
                raise ValueError(f"{field} must be a host tensor, got one on {lens.device}") \
                    from None
            raise TypeError(f"{field} must hold integers, got {lens.dtype}") from None
    else:
        arr = np.asarray(lens)[:batch]
        if arr.dtype.kind not in "iu" and arr.size:
            raise TypeError(f"{field} must hold integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.shape[0] != batch:
        raise ValueError(f"{field} has {arr.shape[0]} entries, the batch has {batch}")
    return HostLens(arr, lo, field)


def check_max(seq: HostLens, *, field: str, hi: int, extra: int = 0,
              extra_what: str = "") -> None:
    """seq_len + extra <= hi for every request, else ValueError naming the first offender."""
    if seq.count and seq.max + extra > hi:
        i = int(np.argmax(seq.arr))
        plus = f" + {extra} {extra_what}" if extra else ""
        raise ValueError(f"{field}[{i}] = {seq.max}{plus} exceeds max_context_len = {hi} "
                         "(the width of req_to_token)")


def check_rows(req_pool_indices: torch.Tensor, batch: int, rows: int,
               field: str = "req_pool_indices") -> None:
    """Row indices in [0, rows); values are read only from a CPU tensor (no device sync)."""
    check_int_tensor(req_pool_indices, field)
    if req_pool_indices.shape[0] < batch:
        raise ValueError(f"{field} has {req_pool_indices.shape[0]} entries, the batch has {batch}")
    if req_pool_indices.device.type != "cpu" or not batch:
        return
    arr = req_pool_indices[:batch].numpy()
    mn, mx = int(arr.min()), int(arr.max())
    if mn < 0:
        raise ValueError(f"{field}[{int(np.argmin(arr))}] = {mn} is negative")
    if mx >= rows:
        raise ValueError(f"{field}[{int(np.argmax(arr))}] = {mx} is out of range: req_to_token "
                         f"has {rows} rows")


def check_same(dev: torch.Tensor, host: HostLens, field: str, host_field: str) -> None:
    """A device tensor against its host mirror, when the 'device' tensor is on the CPU."""
    check_int_tensor(dev, field)
    if dev.shape[0] < host.count:
        raise ValueError(f"{field} has {dev.shape[0]} entries, the batch has {host.count}")
    if dev.device.type != "cpu" or not host.count:
        return
    got = dev[:host.count].numpy()
    if not np.array_equal(got, host.arr):
        i = int(np.flatnonzero(got != host.arr)[0])
        raise ValueError(f"{field}[{i}] = {int(got[i])} disagrees with {host_field}[{i}] = "
                         f"{int(host.arr[i])}")


def check_out_cache_loc(out_cache_loc, tokens: int) -> None:
    if out_cache_loc is None:
        return
    check_int_tensor(out_cache_loc, "out_cache_loc")
    if out_cache_loc.shape[0] != tokens:
        raise ValueError(f"out_cache_loc has {out_cache_loc.shape[0]} entries, the step has "
                         f"{tokens} query tokens")
