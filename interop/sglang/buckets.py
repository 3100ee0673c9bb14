"""Shape buckets: one compiled metadata program per (mode, batch bucket, token bucket).

A server sees a new batch size almost every step; compiling the metadata builder per size
costs seconds each time. Batch sizes are padded up to SGLang's CUDA-graph batch sizes (the
same ladder SGLang captures graphs at), and token counts (KV tokens, the longest query) to
powers of two above a floor. Padded requests carry no tokens and no work (the exported views
are cut to the live batch), so padding never shows in an output.
"""

from __future__ import annotations

import bisect
import dataclasses

from funcmla.layout import next_power_of_two

__all__ = ["sglang_cuda_graph_batch_sizes", "Buckets", "BucketOverflow"]


def sglang_cuda_graph_batch_sizes(max_bs: int = 512) -> tuple[int, ...]:
    """SGLang's default CUDA-graph capture ladder (no speculative decoding), up to max_bs:
    1, 2, 4, 8, 12, then steps of 8 to 256, of 16 to 512, of 32 above; max_bs itself included."""
    if not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"max_bs must be a positive int, got {max_bs!r}")
    ladder = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16))
              + list(range(512, max_bs + 1, 32)))
    return tuple(sorted({b for b in ladder if b <= max_bs} | {max_bs}))


class BucketOverflow(ValueError):
    """A batch is larger than the largest batch bucket."""


@dataclasses.dataclass(frozen=True)
class Buckets:
    """batch_sizes: ascending batch buckets (default SGLang's ladder to 512).
    min_kv_tokens / min_q_tokens: floors of the power-of-two token buckets (the KV-index
    capacity and the longest query of an extend)."""

    batch_sizes: tuple[int, ...] = sglang_cuda_graph_batch_sizes()
    min_kv_tokens: int = 256
    min_q_tokens: int = 16

    def __post_init__(self):
        bs = tuple(self.batch_sizes)
        if not bs or any(not isinstance(b, int) or b < 1 for b in bs) or list(bs) != sorted(set(bs)):
            raise ValueError(f"Buckets.batch_sizes must be ascending positive ints, got {bs!r}")
        object.__setattr__(self, "batch_sizes", bs)
        for name in ("min_kv_tokens", "min_q_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Buckets.{name} must be a positive int, got {v!r}")

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def batch(self, n: int) -> int:
        """The smallest batch bucket >= n (n >= 1)."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise BucketOverflow(
                f"batch_size {n} exceeds the largest batch bucket {self.max_batch} "
                f"(Buckets.batch_sizes; raise it with FuncMLAAttnBackend(buckets=...))")
        return self.batch_sizes[i]

    def kv_tokens(self, n: int) -> int:
        return next_power_of_two(n, self.min_kv_tokens)

    def q_tokens(self, n: int) -> int:
        return next_power_of_two(n, self.min_q_tokens)
