"""The decode launch configurations and the bitwise comparison that the torch-path GPU checks
(`bench.launcher`, `bench.torch_path`) share."""

from __future__ import annotations

from funcmla.config import MLADims

SCALE = MLADims().sm_scale  # DeepSeek-V3's softmax scale


def launch_config(b: int, h: int, *, ctx: int, page_size: int = 1, splits: int | None = None,
                  s_q: int = 1):
    """DecodeLaunchConfig for `b` sequences of up to `ctx` tokens and `h` heads: a token CSR
    over b * ctx + 64 pool rows (page_size 1), else a page table of ctx // page_size pages per
    sequence over b * ctx + 4 * page_size rows."""
    from funcmla.interop import launcher as L

    if page_size == 1:
        return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=b * ctx + 64,
                                    kv_capacity=b * ctx, max_kv_len=ctx, num_splits=splits,
                                    sm_scale=SCALE)
    return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q,
                                pool_rows=b * ctx + 4 * page_size,
                                kv_capacity=b * (ctx // page_size), num_splits=splits,
                                sm_scale=SCALE, page_size=page_size)


def same_bits(a, b) -> bool:
    """Two torch tensors (bf16, f16 or f32) of one shape and dtype hold the same bits."""
    import torch

    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a.contiguous().view(view[a.dtype]), b.contiguous().view(view[b.dtype])))
