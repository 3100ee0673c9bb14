"""Forward-mode attention metadata, as SGLang's AITER MLA backend builds it (token-granular).

Every builder returns a `ForwardMetadata` whose field names follow SGLang's dataclass:

    qo_indptr        int32 [B + 1]     query-token offsets
    kv_indptr        int32 [B + 1]     KV-token offsets, [0, cumsum(kv_lens)]   (tokens)
    kv_indices       int32 [capacity]  token slots (rows of the latent pool)     (tokens)
    kv_last_page_len int32 [B]         all ones: kernels see pages of one token
    max_q_len        int32 []          max query tokens per request
    max_kv_len       int32 []          max KV tokens per request

and the static `mode` and `num_draft_tokens`. All builders are pure and jit-able; `capacity`
is a static int, so one compiled builder serves every batch that fits (see `BufferPlan`).
The KV of every request already includes the tokens of this step (SGLang writes the cache
before attention).

Modes (SGLang's `ForwardMode`s, as its aiter backend builds their metadata):
* decode:        kv_lens = seq_lens;             qo_indptr = arange(B + 1)
* extend:        kv_lens = seq_lens (prefix + new); qo_indptr = [0, cumsum(extend_seq_lens)]
* target_verify: kv_lens = seq_lens + n;         qo_indptr = arange(B + 1) * n
* draft_extend:  kv_lens = seq_lens (incl. n);   qo_indptr = arange(B + 1) * n
Multi-token queries are bottom-right causal: query j of a request with q_len queries and kv_len
keys sees keys [0, kv_len - (q_len - 1 - j)).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.checks import check_lengths, check_queries_fit
from funcmla.guards import check_int32_total, enforce, int_array, should_check
from funcmla.indices import capacity_arg, indptr_from_lens, request_inputs, token_csr_from_table
from funcmla.layout import TokenCSR, check_page_size

__all__ = [
    "MODES",
    "ForwardMetadata",
    "BufferPlan",
    "decode_metadata",
    "extend_metadata",
    "target_verify_metadata",
    "draft_extend_metadata",
    "build_metadata",
    "draft_keys",
]

MODES = ("decode", "extend", "target_verify", "draft_extend")


def draft_keys(mode: str, num_draft_tokens: int) -> int:
    """Keys a request reads past its seq_lens: target verify's n draft tokens (SGLang's
    seq_lens exclude them there; draft extend's include them), 0 in every other mode."""
    return num_draft_tokens if mode == "target_verify" else 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardMetadata:
    """Token-granular metadata of one forward step (SGLang's `ForwardMetadata` MLA fields)."""

    kv_indptr: jax.Array  # int32 [B + 1]  tokens
    kv_indices: jax.Array  # int32 [capacity]  token slots
    qo_indptr: jax.Array  # int32 [B + 1]  query tokens
    kv_last_page_len: jax.Array  # int32 [B]  ones
    max_q_len: jax.Array  # int32 []
    max_kv_len: jax.Array  # int32 []
    mode: str = dataclasses.field(metadata=dict(static=True))
    num_draft_tokens: int = dataclasses.field(default=0, metadata=dict(static=True))

    granularity = "token"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"ForwardMetadata.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def kv(self) -> TokenCSR:
        """The KV index stream as a typed TokenCSR."""
        return TokenCSR(indptr=self.kv_indptr, indices=self.kv_indices)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.shape[0] - 1

    @property
    def capacity(self) -> int:
        """Static length of kv_indices, in tokens."""
        return self.kv_indices.shape[0]

    @property
    def kv_lens(self) -> jax.Array:
        return self.kv_indptr[1:] - self.kv_indptr[:-1]

    @property
    def qo_lens(self) -> jax.Array:
        return self.qo_indptr[1:] - self.qo_indptr[:-1]


@dataclasses.dataclass(frozen=True)
class BufferPlan:
    """Static capacities for CUDA-graph-style reuse of metadata buffers.

    `kv_indices_capacity` is token-granular:
    `max_bs * (ceil(max_ctx / page_size) * page_size + n_draft)` (SGLang after #24587, plus
    draft slack for target-verify's `seq_len + n` rows).

    `legacy_block_granular_kv_indices=True` reproduces the seed's undersized buffer,
    `max_bs * ceil(max_ctx / page_size)` entries (blocks, while the writer writes tokens). It exists
    only so the overflow can be reproduced; `funcmla.checks.check_token_csr` then reports
    `kv_indptr[-1] > capacity` instead of the silent out-of-bounds write SGLang had.
    """

    max_bs: int
    max_context_len: int
    page_size: int = 1
    num_draft_tokens: int = 0
    legacy_block_granular_kv_indices: bool = False

    def __post_init__(self):
        for name in ("max_bs", "max_context_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BufferPlan.{name} must be a positive int, got {value!r}")
        check_page_size(self.page_size, "BufferPlan.page_size")
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0:
            raise ValueError(
                f"BufferPlan.num_draft_tokens must be an int >= 0, got {self.num_draft_tokens!r}"
            )

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_context_len / self.page_size)

    @property
    def kv_indices_capacity(self) -> int:
        """Length of the kv_indices buffer (tokens; blocks under the legacy option)."""
        if self.legacy_block_granular_kv_indices:
            return self.max_bs * self.max_pages_per_seq
        return self.max_bs * (self.max_pages_per_seq * self.page_size + self.num_draft_tokens)

    @property
    def indptr_size(self) -> int:
        return self.max_bs + 1

    @property
    def page_table_shape(self) -> tuple[int, int]:
        """[max_bs, ceil(max_ctx / page_size)]: a separate page table for page-granular kernels."""
        return (self.max_bs, self.max_pages_per_seq)


def _max_or_zero(x: jax.Array) -> jax.Array:
    return jnp.max(x, initial=0).astype(jnp.int32)


def _build(req_to_token, req_pool_indices, kv_lens, qo_indptr, *, capacity, mode, n=0):
    """The metadata of inputs that `request_inputs` has checked (with `capacity`)."""
    kv = token_csr_from_table(req_to_token, req_pool_indices, kv_lens, capacity=capacity)
    batch = kv_lens.shape[0]
    qo_lens = qo_indptr[1:] - qo_indptr[:-1]
    return ForwardMetadata(
        kv_indptr=kv.indptr,
        kv_indices=kv.indices,
        qo_indptr=qo_indptr.astype(jnp.int32),
        kv_last_page_len=jnp.ones((batch,), jnp.int32),
        max_q_len=_max_or_zero(qo_lens),
        max_kv_len=_max_or_zero(kv_lens),
        mode=mode,
        num_draft_tokens=n,
    )


def _check_n(num_draft_tokens):
    if (not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool)
            or num_draft_tokens <= 0):
        raise ValueError(f"num_draft_tokens must be a positive int, got {num_draft_tokens!r}")


def decode_metadata(
    req_to_token: jax.Array,  # int32 [num_req_slots, max_context_len]
    req_pool_indices: jax.Array,  # int32 [B]
    seq_lens: jax.Array,  # int32 [B]  tokens, including the one being decoded
    *,
    capacity: int,
) -> ForwardMetadata:
    """Decode: one query per request over its `seq_lens` tokens.

    Every builder refuses bad values when they are concrete or under `funcmla.checks.checked`
    (`checks.check_request_table`: rows inside req_to_token, 0 <= seq_lens <= max_context_len,
    the total within `capacity` and int32); see `funcmla.checks` for the jitted variant."""
    req_to_token, req_pool_indices, seq_lens, _ = request_inputs(
        req_to_token, req_pool_indices, seq_lens, lens_name="seq_lens",
        capacity=capacity_arg(capacity))
    batch = seq_lens.shape[0]
    qo_indptr = jnp.arange(batch + 1, dtype=jnp.int32)
    return _build(req_to_token, req_pool_indices, seq_lens, qo_indptr, capacity=capacity,
                  mode="decode")


def extend_metadata(
    req_to_token: jax.Array,  # int32 [num_req_slots, max_context_len]
    req_pool_indices: jax.Array,  # int32 [B]
    seq_lens: jax.Array,  # int32 [B]  tokens: prefix + new
    extend_seq_lens: jax.Array,  # int32 [B]  new tokens (queries); == seq_lens without prefix
    *,
    capacity: int,
) -> ForwardMetadata:
    """Extend / prefill: `extend_seq_lens` queries over the full `seq_lens` keys (prefix + new).
    Also checks `0 <= extend_seq_lens <= seq_lens` (bottom-right causal needs q <= k)."""
    req_to_token, req_pool_indices, seq_lens, _ = request_inputs(
        req_to_token, req_pool_indices, seq_lens, lens_name="seq_lens",
        capacity=capacity_arg(capacity))
    extend_seq_lens = int_array(extend_seq_lens, "extend_seq_lens", ndim=1)
    if extend_seq_lens.shape != seq_lens.shape:
        raise ValueError(f"extend_seq_lens must have shape [batch]=({seq_lens.shape[0]},) like "
                         f"req_pool_indices, got {tuple(extend_seq_lens.shape)}")
    if should_check(seq_lens, extend_seq_lens):
        check_int32_total(extend_seq_lens, "extend_seq_lens")
        enforce(check_queries_fit, extend_seq_lens, seq_lens, q_name="extend_seq_lens",
                k_name="seq_lens")
    qo_indptr = indptr_from_lens(extend_seq_lens)
    return _build(req_to_token, req_pool_indices, seq_lens, qo_indptr, capacity=capacity,
                  mode="extend")


def _n_per_request(req_to_token, req_pool_indices, seq_lens, kv_extra, *, n, capacity, mode):
    """n queries per request (qo_indptr = arange(B + 1) * n) over `seq_lens + kv_extra` keys."""
    _check_n(n)
    seq_lens = int_array(seq_lens, "seq_lens", ndim=1)
    if should_check(seq_lens):
        if mode == "draft_extend":  # seq_lens already include the n new tokens (the queries)
            enforce(check_queries_fit, jnp.full_like(seq_lens, n), seq_lens,
                    q_name="num_draft_tokens", k_name="seq_lens")
        else:  # seq_lens + n must not wrap before the table check sees it
            cols = np.shape(req_to_token)[-1]
            enforce(check_lengths, seq_lens, name="seq_lens", max_context_len=cols - n,
                    limit=f"max_context_len - num_draft_tokens = {cols} - {n}")
    name = "seq_lens" if kv_extra == 0 else f"seq_lens + num_draft_tokens({n})"
    req_to_token, req_pool_indices, kv_lens, _ = request_inputs(
        req_to_token, req_pool_indices, seq_lens + kv_extra, lens_name=name,
        capacity=capacity_arg(capacity))
    qo_indptr = jnp.arange(kv_lens.shape[0] + 1, dtype=jnp.int32) * n
    return _build(req_to_token, req_pool_indices, kv_lens, qo_indptr,
                  capacity=capacity, mode=mode, n=n)


def target_verify_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,  # int32 [B]
    seq_lens: jax.Array,  # int32 [B]  tokens before the drafts
    *,
    num_draft_tokens: int,
    capacity: int,
) -> ForwardMetadata:
    """Target verify: n draft queries per request over `seq_lens + n` keys."""
    return _n_per_request(req_to_token, req_pool_indices, seq_lens,
                          draft_keys("target_verify", num_draft_tokens),
                          n=num_draft_tokens, capacity=capacity, mode="target_verify")


def draft_extend_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,  # int32 [B]
    seq_lens: jax.Array,  # int32 [B]  tokens, already including the n new ones
    *,
    num_draft_tokens: int,
    capacity: int,
) -> ForwardMetadata:
    """Draft extend (EAGLE v2): n queries per request over `seq_lens` keys."""
    return _n_per_request(req_to_token, req_pool_indices, seq_lens,
                          draft_keys("draft_extend", num_draft_tokens),
                          n=num_draft_tokens, capacity=capacity, mode="draft_extend")


def build_metadata(
    mode: str,
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,  # int32 [B]
    seq_lens: jax.Array,  # int32 [B]
    extend_seq_lens: jax.Array | None = None,  # int32 [B]; extend only
    *,
    capacity: int,
    num_draft_tokens: int = 0,
) -> ForwardMetadata:
    """The one per-mode dispatch: the builder of `mode` (one of `MODES`) with its arguments."""
    if mode == "decode":
        return decode_metadata(req_to_token, req_pool_indices, seq_lens, capacity=capacity)
    if mode == "extend":
        if extend_seq_lens is None:
            raise ValueError("mode 'extend' needs extend_seq_lens")
        return extend_metadata(req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                               capacity=capacity)
    if mode == "target_verify":
        return target_verify_metadata(req_to_token, req_pool_indices, seq_lens,
                                      num_draft_tokens=num_draft_tokens, capacity=capacity)
    if mode == "draft_extend":
        return draft_extend_metadata(req_to_token, req_pool_indices, seq_lens,
                                     num_draft_tokens=num_draft_tokens, capacity=capacity)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
