"""The simulation's deterministic data: the seeded request list, the latent rows and queries
(pure hashes of token or request id and position, so no value depends on where a token is
stored), and the seeded number of accepted draft tokens."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import numpy.typing as npt

from funcmla.simulate.config import SimulationConfig

__all__ = ["KV_STREAM", "Q_STREAM", "RequestSpec", "accepted_drafts", "hashed_uniform",
           "make_workload"]

# `hashed_uniform` streams: latent rows (token id, position) and queries (request id, position)
KV_STREAM, Q_STREAM = 1, 2


def _fmix(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser (a bijection on uint32; arrays wrap silently)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def hashed_uniform(seed: int, stream: int, a: npt.ArrayLike, b: npt.ArrayLike,
                   width: int) -> np.ndarray:
    """float32 [N, width], uniform on [-sqrt(3), sqrt(3)) (mean 0, variance 1): a pure function
    of (seed, stream, a[i], b[i], column). Used as latent row (token id, position) and query
    (request id, position), so values never depend on where a token is stored."""
    a = np.asarray(a, np.int64).astype(np.uint32)
    b = np.asarray(b, np.int64).astype(np.uint32)
    h0 = _fmix(np.full(a.shape, (seed * 0x9E3779B1 + stream * 0x632BE5AB) % 2**32, np.uint32))
    h = _fmix(_fmix(h0 ^ a) + b * np.uint32(0x9E3779B1))
    cols = np.arange(width, dtype=np.uint32) * np.uint32(0x27D4EB2F)
    x = _fmix(_fmix(h[:, None] ^ cols[None, :]) + h[:, None])
    u = (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    return ((u * 2.0 - 1.0) * np.float32(math.sqrt(3.0))).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of the workload. `token_ids` covers prompt and output (int32)."""

    rid: int
    arrival_step: int
    prompt_len: int
    output_len: int
    group: int  # prefix group, -1 for none
    token_ids: np.ndarray

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def make_workload(config: SimulationConfig) -> list[RequestSpec]:
    """The seeded request list (independent of page size)."""
    rng = np.random.default_rng(config.seed)
    prefixes = rng.integers(0, config.vocab_size,
                            (config.num_prefix_groups, config.shared_prefix_len))
    p_arrive = 1.0 / (1.0 + config.arrival_every)
    step, out = 0, []
    for rid in range(config.num_requests):
        if rid:
            step += int(rng.geometric(p_arrive)) - 1
        group = -1
        if config.shared_prefix_len and rng.random() < config.shared_prefix_prob:
            group = int(rng.integers(0, config.num_prefix_groups))
        lo = config.prompt_len[0]
        if group >= 0:
            lo = max(lo, config.shared_prefix_len + 1)
        prompt = int(rng.integers(lo, config.prompt_len[1] + 1))
        output = int(rng.integers(config.output_len[0], config.output_len[1] + 1))
        tokens = rng.integers(0, config.vocab_size, prompt + output).astype(np.int32)
        if group >= 0:
            tokens[: config.shared_prefix_len] = prefixes[group]
        out.append(RequestSpec(rid, step, prompt, output, group, tokens))
    return out


def accepted_drafts(seed: int, rid: int, pos: int, n: int) -> int:
    """Draft tokens (0 .. n-1) a verify step starting at `pos` accepts: seeded, page-free."""
    return int(np.random.default_rng([seed, rid, pos]).integers(0, n))
