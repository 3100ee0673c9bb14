"""SGLang's forward modes, resolved by name (never by number) to what the backend builds.

SGLang's `ForwardMode` is an `IntEnum` whose numbering changed between releases (v0.4 had
PREFILL first; newer trees dropped DRAFT_EXTEND for DRAFT_EXTEND_V2), so a mode is resolved by
its member *name*. `resolve_mode` accepts SGLang's enum (any version), this module's stand-in,
or funcmla's own mode strings; a bare int is refused (its meaning depends on the release).

| SGLang name      | kind            | metadata (funcmla.metadata)                       |
|------------------|-----------------|---------------------------------------------------|
| EXTEND, MIXED    | extend          | extend: qo = extend_seq_lens, kv = seq_lens        |
| DRAFT_EXTEND     | extend          | extend (EAGLE v1: per-request accepted lengths)    |
| DECODE           | decode          | decode: one query per request                     |
| IDLE             | idle            | none: batch 0, empty outputs                      |
| TARGET_VERIFY    | target_verify   | n draft queries over seq_lens + n keys            |
| DRAFT_EXTEND_V2  | draft_extend    | n queries over seq_lens keys (n included)         |
"""

from __future__ import annotations

import enum

__all__ = ["ForwardMode", "KINDS", "SUPPORTED_MODES", "UNSUPPORTED_MODES", "resolve_mode"]

KINDS = ("extend", "decode", "idle", "target_verify", "draft_extend")


class ForwardMode(enum.IntEnum):
    """A stand-in with SGLang's member names, in SGLang's current order (values are irrelevant:
    modes are matched by name). DRAFT_EXTEND is the EAGLE v1 name of older trees."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()
    PREBUILT = enum.auto()
    SPLIT_PREFILL = enum.auto()
    DLLM_EXTEND = enum.auto()
    DRAFT_EXTEND = enum.auto()

    def is_extend(self) -> bool:
        return resolve_mode(self) == "extend"

    def is_decode(self) -> bool:
        return self.name == "DECODE"

    def is_mixed(self) -> bool:
        return self.name == "MIXED"

    def is_idle(self) -> bool:
        return self.name == "IDLE"

    def is_decode_or_idle(self) -> bool:
        return self.name in ("DECODE", "IDLE")

    def is_target_verify(self) -> bool:
        return self.name == "TARGET_VERIFY"

    def is_draft_extend_v2(self) -> bool:
        return self.name == "DRAFT_EXTEND_V2"


SUPPORTED_MODES: dict[str, str] = {
    "EXTEND": "extend",
    "MIXED": "extend",
    "DRAFT_EXTEND": "extend",
    "DECODE": "decode",
    "IDLE": "idle",
    "TARGET_VERIFY": "target_verify",
    "DRAFT_EXTEND_V2": "draft_extend",
}
# SGLang modes this backend does not serve, with the reason given to the user.
UNSUPPORTED_MODES: dict[str, str] = {
    "PREBUILT": "a disaggregated-decode batch whose KV arrives prebuilt runs no attention here",
    "SPLIT_PREFILL": "PD-multiplexed layer-split prefill is not implemented",
    "DLLM_EXTEND": "diffusion-LLM extend (block-causal masks) is not implemented",
    "PREFILL": "SGLang's deprecated PREFILL mode; use EXTEND",
    "DUMMY_FIRST": "the overlap scheduler's dummy batch runs no attention",
}
_FUNCMLA_NAMES = {"decode": "decode", "extend": "extend", "target_verify": "target_verify",
                  "draft_extend": "draft_extend", "idle": "idle"}


def resolve_mode(forward_mode) -> str:
    """forward_mode (SGLang's ForwardMode of any release, the stand-in, or a funcmla mode
    string) -> one of KINDS. Raises ValueError naming the mode if it is unknown or unsupported."""
    if isinstance(forward_mode, str):
        if forward_mode in _FUNCMLA_NAMES:
            return _FUNCMLA_NAMES[forward_mode]
        name = forward_mode.upper()
    elif isinstance(forward_mode, enum.Enum):
        name = forward_mode.name
    else:
        raise ValueError(
            f"forward_mode={forward_mode!r}: pass SGLang's ForwardMode (matched by name; its "
            f"numbering differs between releases) or one of {sorted(_FUNCMLA_NAMES)}")
    if name in SUPPORTED_MODES:
        return SUPPORTED_MODES[name]
    if name in UNSUPPORTED_MODES:
        raise ValueError(f"forward_mode {name} is not supported by FuncMLAAttnBackend: "
                         f"{UNSUPPORTED_MODES[name]}")
    raise ValueError(f"forward_mode {forward_mode!r} is unknown; supported: "
                     f"{', '.join(SUPPORTED_MODES)}")
