"""Pallas kernels for absorbed MLA decode over the paged latent pool (NVIDIA GPUs).

`mla_decode` (Triton lowering; also runs in Pallas interpret mode on CPU) with its tiling
`DecodeKernelConfig`, the split rule `choose_num_splits`, and the one-launch split-KV combine
`merge_splits_pallas`.
"""

from funcmla.attention.pallas.decode_common import (  # noqa: F401
    DecodeKernelConfig,
    KVRows,
    choose_num_splits,
    merge_splits,
)
from funcmla.attention.pallas.merge import merge_splits_pallas  # noqa: F401
from funcmla.attention.pallas.decode_triton import (  # noqa: F401
    mla_decode,
    mla_decode_rows,
    validate_decode_inputs,
)
