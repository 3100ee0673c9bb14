"""funcmla.interop: the torch shim (installed as `funcmla.interop`; import it only by that name).

* `dlpack`:         zero-copy torch <-> JAX bridge (stream-ordered, fp8 as uint8, no donation).
* `packed`:         one packed int32 buffer per step, torch views onto it.
* `aiter_dispatch`: AITER MLA kernels on funcmla metadata / work plans (contract-tested only).
* `backend_select`: one attention entry point (aiter, pallas, reference) reporting what ran.
* `sglang_backend`: an attention backend with SGLang's surface, metadata and work plan built by
                    funcmla (the `sglang` package: modes, buckets, plan, step, checks, plugin).
* `torch_native`:   SGLang's torch-native MLA algorithm restated in torch (the comparison baseline).
* `torch_csr`:      a CUDA-graph-capturable torch consumer of the static metadata buffers.
* `testing`:        random paged batches laid out like SGLang's allocator (tests, benchmarks).
* `launcher`:       funcmla's Pallas decode kernels launched directly on torch tensors.

Core `funcmla` never imports torch; this package does. amd-aiter is imported lazily.
"""

import importlib.util as _importlib_util

if _importlib_util.find_spec("torch") is None:
    raise ModuleNotFoundError(
        "funcmla.interop is the torch shim and needs torch, which is not installed: "
        "pip install 'funcmla[torch]'", name="torch")
