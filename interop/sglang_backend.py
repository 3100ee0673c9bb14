"""An attention backend with SGLang's surface whose MLA metadata and work plan are built by
funcmla: the public names of `funcmla.interop.sglang` (see docs/sglang_backend.md)."""

from funcmla.interop.sglang.backend import FuncMLAAttnBackend
from funcmla.interop.sglang.buckets import BucketOverflow, Buckets, sglang_cuda_graph_batch_sizes
from funcmla.interop.sglang.modes import ForwardMode, resolve_mode
from funcmla.interop.sglang.plugin import register_with_sglang
from funcmla.interop.sglang.types import (
    CudaGraphBufferOverflow,
    ForwardBatch,
    ForwardMetadata,
    MLATokenToKVPool,
    RadixAttention,
    SpecInfo,
)
from funcmla.interop.sglang.workplan import PlanSettings

__all__ = [
    "ForwardMode",
    "resolve_mode",
    "SpecInfo",
    "ForwardBatch",
    "ForwardMetadata",
    "RadixAttention",
    "MLATokenToKVPool",
    "CudaGraphBufferOverflow",
    "BucketOverflow",
    "Buckets",
    "sglang_cuda_graph_batch_sizes",
    "PlanSettings",
    "FuncMLAAttnBackend",
    "register_with_sglang",
]
