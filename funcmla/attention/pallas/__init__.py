"""Pallas kernels for absorbed MLA decode over the paged latent pool (NVIDIA GPUs).

`mla_decode` (in `api`) checks its arguments, runs one of two decode kernels, the
Triton-lowered one (`mla_decode_rows`; every shape) or the warp-specialized Mosaic GPU one for
Hopper (`mla_decode_rows_mgpu`; bf16, 64-row blocks; an fp8 pool runs the fp8 Mosaic GPU
kernels at 16 folded rows or 64-row blocks), and merges split-KV partials with
`merge_splits_pallas`. `DecodeKernelConfig` is the static tiling, `choose_num_splits` the split
rule. `mla_extend` (in `extend`) runs ragged extend batches on the same kernels, each
request's queries cut into chunks that act as decode sequences. `mha_prefill` (in `prefill`)
is the ragged MHA prefill (q/k 192, v 128) on a warp-specialized Mosaic GPU kernel
(`MgpuPrefillConfig`, chosen per batch by `prefill_kernel_config`; `prefill_step` builds its
schedule once for a serving step's layers); `merge_attention_states`
combines two (out, lse) partials. All of it
runs in Pallas interpret mode on CPU. Design: docs/decode_kernel.md, docs/prefill_kernel.md.
"""

from funcmla.attention.pallas.decode_common import (  # noqa: F401
    DecodeKernelConfig,
    KVRows,
    choose_num_splits,
    merge_splits,
)
from funcmla.attention.pallas.merge import (  # noqa: F401
    merge_attention_states,
    merge_splits_pallas,
)
from funcmla.attention.pallas.decode_mgpu import (  # noqa: F401
    MgpuDecodeConfig,
    mgpu_decode_supported,
)
from funcmla.attention.pallas.api import (  # noqa: F401
    KV_FP8_DTYPE,
    kernel_choice,
    mla_decode,
    mla_decode_rows,
    mla_decode_rows_mgpu,
    validate_decode_inputs,
)
from funcmla.attention.pallas.extend import (  # noqa: F401
    chunk_tokens,
    mla_extend,
)
from funcmla.attention.pallas.prefill_mgpu import MgpuPrefillConfig  # noqa: F401
from funcmla.attention.pallas.prefill import (  # noqa: F401
    PrefillStep,
    mha_prefill,
    prefill_step,
    prefill_kernel_config,
    validate_prefill_inputs,
)
