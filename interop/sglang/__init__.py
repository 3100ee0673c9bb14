"""funcmla's SGLang attention backend, in small modules (one idea each):

* `modes`:       SGLang's ForwardMode, resolved by name.
* `types`:       SGLang's ForwardBatch / ForwardMetadata / RadixAttention / MLATokenToKVPool.
* `buckets`:     batch and token buckets (one compiled program per bucket).
* `workplan`:    the persistent work plan (funcmla's planners) as SGLang's aiter backend sizes it.
* `step`:        the jitted per-step program: metadata + plan, packed into one buffer.
* `host_checks`: checks of a step from its host mirrors (no device sync).
* `backend`:     FuncMLAAttnBackend.
* `plugin`:      construction from a ModelRunner; registration with SGLang.
"""
