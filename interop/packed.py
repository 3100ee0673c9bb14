"""One packed int32 buffer per step: a step's metadata leaves JAX as a single array.

Crossing DLPack costs a fixed host time per array (`python -m bench.interop`), so a
step's metadata is concatenated inside the jitted builder into one int32 buffer, exported once,
and torch reads each field through a view (no copy). Every field starts at a multiple of
`align` elements (16 int32 = 64 bytes), so every view's data pointer is 64-byte aligned.

    layout = PackedLayout.of(kv_indptr=(B + 1,), kv_indices=(cap,), max_q_len=())
    buf = layout.pack(dict(kv_indptr=..., kv_indices=..., max_q_len=...))   # in JAX, int32 [size]
    views = layout.torch_views(to_torch(buf))                                # torch views, 0 copies

Static buffers (CUDA graphs) use the same layout: a torch buffer of `layout.size` int32 is
allocated once, its views are made once, and each replay copies the new packed buffer into it
with one `copy_` (see `funcmla.interop.sglang_backend`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp

__all__ = ["PackedLayout"]


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Field names and static shapes, in order; offsets are derived (elements of int32).

    fields: ((name, shape), ...); shape () is a scalar stored as one element.
    align:  field offsets are multiples of this many int32 elements.
    """

    fields: tuple[tuple[str, tuple[int, ...]], ...]
    align: int = 16

    def __post_init__(self):
        names = [n for n, _ in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"PackedLayout: duplicate field names in {names}")
        if not isinstance(self.align, int) or self.align <= 0:
            raise ValueError(f"PackedLayout.align must be a positive int, got {self.align!r}")
        for name, shape in self.fields:
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"PackedLayout field {name!r}: bad shape {shape!r}")

    @classmethod
    def of(cls, align: int = 16, **shapes: tuple[int, ...]) -> "PackedLayout":
        """Build from keyword arguments, in keyword order."""
        return cls(tuple((k, tuple(v)) for k, v in shapes.items()), align)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.fields)

    def shape(self, name: str) -> tuple[int, ...]:
        return dict(self.fields)[name]

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Element offset of each field."""
        out, pos = {}, 0
        for name, shape in self.fields:
            out[name] = pos
            pos += _round_up(_numel(shape), self.align)
        return out

    @property
    def size(self) -> int:
        """Total int32 elements (at least 1)."""
        return max(1, sum(_round_up(_numel(s), self.align) for _, s in self.fields))

    @property
    def _pieces(self) -> tuple[tuple[str | None, int], ...]:
        pieces: list[tuple[str | None, int]] = []
        for name, shape in self.fields:
            n = _numel(shape)
            pieces.append((name, n))
            pad = _round_up(n, self.align) - n
            if pad:
                pieces.append((None, pad))
        used = sum(n for _, n in pieces)
        if used < self.size:
            pieces.append((None, self.size - used))
        return tuple(pieces)

    # ---- JAX side ------------------------------------------------------------------------
    def pack(self, arrays: Mapping[str, jax.Array]) -> jax.Array:
        """Concatenate the fields into one int32 [size] array (jit-able; padding is 0).

        Every field must be present with exactly its layout shape and an integer dtype.
        """
        missing = set(self.names) - set(arrays)
        extra = set(arrays) - set(self.names)
        if missing or extra:
            raise ValueError(
                f"PackedLayout.pack: missing fields {sorted(missing)}, unexpected {sorted(extra)}"
            )
        parts = []
        for name, n in self._pieces:
            if name is None:
                parts.append(jnp.zeros((n,), jnp.int32))
                continue
            x = jnp.asarray(arrays[name])
            if x.shape != self.shape(name):
                raise ValueError(
                    f"PackedLayout.pack: field {name!r} has shape {x.shape}, layout says "
                    f"{self.shape(name)}"
                )
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"PackedLayout.pack: field {name!r} has dtype {x.dtype}, not int")
            parts.append(x.astype(jnp.int32).reshape(n))
        return jnp.concatenate(parts)

    def unpack(self, buf: jax.Array) -> dict[str, jax.Array]:
        """JAX (or NumPy) slices of a packed buffer, one per field, with their shapes."""
        self._check_buffer(tuple(buf.shape))
        out = {}
        for name, shape in self.fields:
            off = self.offsets[name]
            out[name] = buf[off : off + _numel(shape)].reshape(shape)
        return out

    # ---- torch side ----------------------------------------------------------------------
    def torch_views(self, buf, names: tuple[str, ...] | None = None) -> dict:
        """torch views of a packed int32 torch buffer (no copy), one per field (or per `names`).

        Each view costs host time (`python -m bench.interop`, stage `handoff`): ask only for the
        fields you read.
        """
        import torch

        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int32:
            raise TypeError(
                f"torch_views expects an int32 torch.Tensor, got "
                f"{getattr(buf, 'dtype', type(buf).__name__)}"
            )
        if not buf.is_contiguous():
            raise ValueError("torch_views: the packed buffer must be contiguous")
        if buf.shape[0] != self.size or buf.dim() != 1:
            self._check_buffer(tuple(buf.shape))
        return {name: buf.as_strided(shape, strides, off)
                for name, shape, strides, off in self._view_specs
                if names is None or name in names}

    @functools.cached_property
    def _view_specs(self) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...], int], ...]:
        """(name, shape, strides, offset) per field, computed once per layout (hot path)."""
        offsets = self.offsets
        return tuple((name, shape, _contiguous_strides(shape), offsets[name])
                     for name, shape in self.fields)

    def empty_torch(self, device=None):
        """A zeroed torch int32 buffer of `size` elements (for static / CUDA-graph use)."""
        import torch

        return torch.zeros(self.size, dtype=torch.int32, device=device)

    def _check_buffer(self, shape: tuple[int, ...]) -> None:
        if shape != (self.size,):
            raise ValueError(f"packed buffer has shape {shape}, layout needs ({self.size},)")


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)
