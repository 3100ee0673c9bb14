"""SGLang's data types as the backend reads them: the fields of `ForwardBatch`, `SpecInfo`,
`RadixAttention` and `MLATokenToKVPool` under SGLang's names, and SGLang's `ForwardMetadata`
(aiter_backend.py @003c5589: same field names, same order). SGLang is not a dependency: real
SGLang objects work wherever they carry these attributes."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from funcmla.interop.dlpack import FP8_DTYPES
from funcmla.interop.sglang.modes import ForwardMode

__all__ = ["SpecInfo", "ForwardBatch", "ForwardMetadata", "RadixAttention", "MLATokenToKVPool",
           "CudaGraphBufferOverflow"]


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

    forward_mode: ForwardMode  # SGLang's enum (any release) or the stand-in
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
