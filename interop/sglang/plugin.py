"""Plugging the backend into SGLang: construction from a ModelRunner, and registration in
SGLang's attention-backend registry (`--attention-backend funcmla`).

SGLang's registry (`sglang.srt.layers.attention.attention_registry`) maps a name to a factory
`fn(runner) -> backend`; `register_with_sglang` adds ours, and the name to the server's
`--attention-backend` choices where that list exists.
"""

from __future__ import annotations

__all__ = ["backend_kwargs_from_model_runner", "register_with_sglang", "DEFAULT_NAME"]

DEFAULT_NAME = "funcmla"


def _attention_tp_size(model_runner) -> int:
    """SGLang's attention TP size (get_attention_tp_size() where SGLang imports, else
    tp_size / dp_size under DP attention, else tp_size)."""
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        return int(get_attention_tp_size())
    except Exception:  # noqa: BLE001  (SGLang absent or its parallel state not initialised)
        pass
    tp = int(getattr(model_runner, "tp_size", 1) or 1)
    args = getattr(model_runner, "server_args", None)
    if args is not None and getattr(args, "enable_dp_attention", False):
        tp //= int(getattr(args, "dp_size", 1) or 1)
    return max(tp, 1)


def backend_kwargs_from_model_runner(model_runner):
    """(req_to_token, token_to_kv_pool, kwargs) from SGLang's ModelRunner attributes:
    `use_mla_backend`, `req_to_token_pool.req_to_token`, `token_to_kv_pool`, `page_size` (or
    `server_args.page_size`), `model_config.num_attention_heads` over the attention TP size,
    `server_args.speculative_num_draft_tokens`."""
    if not getattr(model_runner, "use_mla_backend", False):
        raise ValueError("FuncMLAAttnBackend serves MLA models only "
                         "(model_runner.use_mla_backend is False)")
    missing = [a for a in ("req_to_token_pool", "token_to_kv_pool", "model_config")
               if getattr(model_runner, a, None) is None]
    if missing:
        raise AttributeError(f"model_runner lacks SGLang's attributes {missing}")
    args = getattr(model_runner, "server_args", None)
    page_size = getattr(model_runner, "page_size", None)
    if page_size is None:
        page_size = getattr(args, "page_size", None) or 1
    heads = model_runner.model_config.num_attention_heads // _attention_tp_size(model_runner)
    draft = getattr(args, "speculative_num_draft_tokens", None) or 0
    kwargs = dict(page_size=int(page_size), num_draft_tokens=int(draft), num_heads=int(heads))
    return model_runner.req_to_token_pool.req_to_token, model_runner.token_to_kv_pool, kwargs


def register_with_sglang(name: str = DEFAULT_NAME, **backend_kwargs):
    """Register FuncMLAAttnBackend in SGLang's attention-backend registry under `name`;
    returns the factory. Raises ImportError (saying so) when SGLang is not importable."""
    try:
        from sglang.srt.layers.attention import attention_registry
    except ImportError as err:
        raise ImportError(
            f"SGLang is not importable here ({err}); install sglang to register the funcmla "
            "attention backend, or build it directly with "
            "FuncMLAAttnBackend.from_model_runner(model_runner)") from err
    from funcmla.interop.sglang.backend import FuncMLAAttnBackend

    def create_funcmla_backend(runner):
        return FuncMLAAttnBackend.from_model_runner(runner, **backend_kwargs)

    attention_registry.register_attention_backend(name)(create_funcmla_backend)
    try:
        from sglang.srt import server_args

        choices = getattr(server_args, "ATTENTION_BACKEND_CHOICES", None)
        if isinstance(choices, list) and name not in choices:
            choices.append(name)
    except ImportError:
        pass
    return create_funcmla_backend
