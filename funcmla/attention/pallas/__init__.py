"""Pallas kernels for absorbed MLA decode over the paged latent pool (NVIDIA GPUs).

`mla_decode` with its configuration `DecodeKernelConfig` (which kernel and its tiling), the
split rule `choose_num_splits`, and the one-launch split-KV combine `merge_splits_pallas`. Two
decode kernels: the Triton-lowered one (`mla_decode_rows`; every shape) and the warp-specialized
Mosaic GPU one for Hopper (`mla_decode_rows_mgpu`; bf16, 64-row blocks). Both run in
Pallas interpret mode on CPU.
"""

from funcmla.attention.pallas.decode_common import (  # noqa: F401
    DecodeKernelConfig,
    KVRows,
    choose_num_splits,
    merge_splits,
)
from funcmla.attention.pallas.merge import merge_splits_pallas  # noqa: F401
from funcmla.attention.pallas.decode_mgpu import (  # noqa: F401
    mgpu_decode_supported,
    mla_decode_rows_mgpu,
)
from funcmla.attention.pallas.decode_triton import (  # noqa: F401
    mla_decode,
    mla_decode_rows,
    validate_decode_inputs,
)
