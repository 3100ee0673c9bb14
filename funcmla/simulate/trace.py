"""The host state of one simulated run at one page size (`Trace`): queues, request rows, the
allocator state and the KV pool, and its two kinds of step, a prefill of waiting requests
(`try_prefill`) and a decode or target-verify step of every running one (`decode`).

Batches are padded to static shapes (see `funcmla.simulate`); out of pages, a prefill defers
its newest candidate and a decode retracts the newest running request, as SGLang does.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from funcmla import allocator as alloc
from funcmla import metadata as md
from funcmla.simulate.config import SimulationConfig
from funcmla.simulate.forward import Forward, forward, metadata_checker
from funcmla.simulate.oracle import oracle_attention
from funcmla.simulate.results import StepStats
from funcmla.simulate.workload import (
    KV_STREAM,
    Q_STREAM,
    RequestSpec,
    accepted_drafts,
    hashed_uniform,
)

__all__ = ["LiveRequest", "Trace"]


@dataclasses.dataclass
class LiveRequest:
    """A running request: its spec, its request-table row and its length in the pool."""

    spec: RequestSpec
    row: int
    cur_len: int  # tokens whose KV is in the pool (between steps: true tokens only)


class Trace:
    """Host state of one run: queues, request rows, the allocator state and the KV pool."""

    def __init__(self, config: SimulationConfig, page_size: int, pool_rows: int,
                 workload: list[RequestSpec]):
        self.cfg = config
        self.page_size = page_size
        self.spec = config.allocator_spec(page_size)
        self.state = alloc.init_allocator(self.spec)
        dims = config.dims
        self.kv_pool = jnp.zeros((pool_rows, dims.head_dim_qk), jnp.float32)
        self.pending = collections.deque(sorted(workload, key=lambda r: (r.arrival_step, r.rid)))
        self.waiting: collections.deque[RequestSpec] = collections.deque()
        self.running: list[LiveRequest] = []
        self.free_rows = list(range(config.max_running))
        self.outputs = {
            r.rid: np.full((r.output_len + 1, dims.num_heads, dims.v_head_dim), np.nan,
                           np.float32)
            for r in workload
        }
        self.finished = 0
        self.steps: list[StepStats] = []
        # Token-granular kv_indices capacity with draft slack (the seed's fix), or, with
        # legacy_kv_indices_buffer, the page-granular size the seed's bug had.
        self.kv_capacity = md.BufferPlan(
            max_bs=config.max_running, max_context_len=config.max_context_len,
            page_size=page_size, num_draft_tokens=config.num_draft_tokens,
            legacy_block_granular_kv_indices=config.legacy_kv_indices_buffer,
        ).kv_indices_capacity

    # -- small helpers
    def _pad(self, values, fill, n=None):
        n = self.cfg.max_running if n is None else n
        return np.array(list(values) + [fill] * (n - len(values)), np.int32)

    def _mask(self, k, n=None):
        return np.arange(self.cfg.max_running if n is None else n) < k

    def _free_rows(self, rows) -> None:
        res = alloc.free_requests(self.state, self._pad(rows, 0), self._mask(len(rows)))
        alloc.raise_for_status(res, "free_requests")
        self.state = res.state
        self.free_rows = sorted(self.free_rows + list(rows))

    def _retract_last(self) -> None:
        """Out of pages while decoding: free the newest running request and requeue it."""
        if len(self.running) <= 1:
            raise RuntimeError(
                f"page_size={self.page_size}: out of pages with a single running request; "
                f"SimulationConfig.pool_tokens={self.cfg.pool_tokens} is too small"
            )
        victim = self.running.pop()
        self._free_rows([victim.row])
        self.waiting.appendleft(victim.spec)

    def _match(self, req: RequestSpec) -> tuple[int, int]:
        """(src row, tokens) of the longest page-aligned prefix a running request holds; at
        most prompt_len - 1 tokens (the last prompt token is always computed)."""
        best = (0, 0)
        for live in self.running:
            n = min(live.cur_len, req.prompt_len - 1)
            diff = np.flatnonzero(live.spec.token_ids[:n] != req.token_ids[:n])
            m = (int(diff[0]) if diff.size else n) // self.page_size * self.page_size
            if m > best[1]:
                best = (live.row, m)
        return best

    def _tokens(self, live: LiveRequest, n: int, drafts=None) -> np.ndarray:
        """Token ids at positions [0, n) of a request (drafts over [cur_len, cur_len + k))."""
        ids = np.zeros(n, np.int32)
        have = min(n, live.spec.total_len)
        ids[:have] = live.spec.token_ids[:have]
        if drafts is not None:
            ids[live.cur_len:live.cur_len + len(drafts)] = drafts
        return ids

    def _latent(self, token_ids, positions) -> np.ndarray:
        return hashed_uniform(self.cfg.seed, KV_STREAM, token_ids, positions,
                              self.cfg.dims.head_dim_qk)

    def _queries(self, rids, positions) -> np.ndarray:
        dims = self.cfg.dims
        flat = hashed_uniform(self.cfg.seed, Q_STREAM, rids, positions,
                              dims.num_heads * dims.head_dim_qk)
        return flat.reshape(len(rids), dims.num_heads, dims.head_dim_qk)

    def _step(self, mode, write_loc, write_tok, write_pos, batch, q_rid, q_pos, q_valid,
              oracle_keys, oracle_qlens):
        """Run one forward; returns (out [T, H, v] numpy, max rel err, kv tokens, works,
        partials)."""
        cfg = self.cfg
        rows = self._latent(write_tok, write_pos)
        rows[write_loc == 0] = 0.0  # padding writes zeros into the reserved slot 0
        q = self._queries(q_rid, q_pos)
        q[~q_valid] = 0.0
        plan_config = None
        if cfg.use_plans:
            prefill_cfg, decode_cfg = cfg.plan_configs(self.page_size)
            plan_config = prefill_cfg if mode == "extend" else decode_cfg
        f = Forward(mode, cfg.num_draft_tokens if mode == "target_verify" else 0,
                     self.kv_capacity, cfg.max_context_len, cfg.dims, plan_config,
                     cfg.uses_pallas_decode)
        kv_pool, meta, out, works, partials = forward(
            f, self.state.req_to_token, self.kv_pool, write_loc, rows, batch, q)
        if cfg.check:  # the value checks ignore the mode: one compiled checker per pool
            unmoded = dataclasses.replace(meta, mode="extend", num_draft_tokens=0)
            err, _ = metadata_checker(self.spec.pool, cfg.max_context_len)(unmoded)
            err.throw()
        self.kv_pool = kv_pool
        out = np.asarray(out)
        n_q = int(q_valid.sum())
        ref = oracle_attention(q[:n_q], oracle_keys, oracle_qlens, cfg.dims.sm_scale,
                               cfg.dims.v_head_dim)
        scale = max(float(np.max(np.abs(ref))), 1e-30)
        rel = float(np.max(np.abs(out[:n_q] - ref))) / scale
        kv_tokens = sum(len(k) for k in oracle_keys)
        return out, rel, kv_tokens, int(works), int(partials)

    def _record(self, live: LiveRequest, pos: int, out_row: np.ndarray) -> None:
        k = pos - (live.spec.prompt_len - 1)
        if 0 <= k <= live.spec.output_len:
            self.outputs[live.spec.rid][k] = out_row

    def _stats(self, step, mode, batch_size, q_tokens, kv_tokens, hits, ooms, rel, works,
               partials) -> None:
        self.steps.append(StepStats(
            step=step, mode=mode, batch_size=batch_size, num_q_tokens=q_tokens,
            num_kv_tokens=kv_tokens, kv_indices_capacity=self.kv_capacity,
            pages_in_use=int(alloc.pages_in_use(self.state)),
            num_free_pages=int(alloc.num_free_pages(self.state)),
            prefix_hit_tokens=hits, oom_events=ooms, plan_works=works, plan_partials=partials,
            max_rel_err=rel,
        ))

    # -- steps
    def try_prefill(self, step: int) -> bool:
        """Admit waiting requests (FIFO) that fit the batch, the token budget and the pool."""
        cfg = self.cfg
        cands, budget = [], cfg.max_prefill_tokens
        for req in self.waiting:
            if len(self.running) + len(cands) >= cfg.max_running:
                break
            src, m = self._match(req)
            if req.prompt_len - m > budget:
                break
            cands.append((req, src, m))
            budget -= req.prompt_len - m
        ooms = 0
        while cands:
            k = len(cands)
            rows = self.free_rows[:k]
            shared = alloc.share_prefix(
                self.state, self._pad([s for _, s, _ in cands], 0), self._pad(rows, 0),
                self._pad([m for _, _, m in cands], 0), self._mask(k))
            alloc.raise_for_status(shared, "share_prefix")
            res = alloc.alloc_extend(
                shared.state, self._pad(rows, 0), self._pad([m for _, _, m in cands], 0),
                self._pad([r.prompt_len for r, _, _ in cands], 0), self._mask(k),
                capacity=cfg.max_prefill_tokens)
            if bool(res.ok):
                break
            if not bool(res.oom):
                alloc.raise_for_status(res, "alloc_extend")
            cands.pop()  # out of pages: defer the newest candidate (self.state is untouched)
            ooms += 1
        if not cands:
            return False
        self.state = res.state
        lives = []
        for (req, _, _), row in zip(cands, rows):
            self.waiting.remove(req)
            self.free_rows.remove(row)
            lives.append(LiveRequest(req, row, req.prompt_len))
        ms = [m for _, _, m in cands]
        cap = cfg.max_prefill_tokens
        w_tok = np.concatenate([x.spec.token_ids[m:x.cur_len] for x, m in zip(lives, ms)])
        w_pos = np.concatenate([np.arange(m, x.cur_len) for x, m in zip(lives, ms)])
        q_rid = np.concatenate([np.full(x.cur_len - m, x.spec.rid) for x, m in zip(lives, ms)])
        n_tok = len(w_tok)
        batch = (self._pad(rows, 0), self._pad([x.cur_len for x in lives], 0),
                 self._pad([x.cur_len - m for x, m in zip(lives, ms)], 0))
        out, rel, kv_tokens, works, partials = self._step(
            "extend", np.asarray(res.out_cache_loc), self._pad(w_tok, 0, cap),
            self._pad(w_pos, 0, cap), batch, self._pad(q_rid, 0, cap), self._pad(w_pos, 0, cap),
            self._mask(n_tok, cap),
            [self._latent(self._tokens(x, x.cur_len), np.arange(x.cur_len)) for x in lives],
            [x.cur_len - m for x, m in zip(lives, ms)])
        k = 0
        for x, m in zip(lives, ms):
            for pos in range(m, x.cur_len):
                self._record(x, pos, out[k])
                k += 1
        self.running.extend(lives)
        self._stats(step, "extend", len(lives), n_tok, kv_tokens, sum(ms), ooms, rel, works,
                    partials)
        return True

    def decode(self, step: int) -> None:
        """One decode (or target-verify) step of every running request."""
        cfg = self.cfg
        n = cfg.num_draft_tokens
        ooms = 0
        while True:
            lives = list(self.running)
            rows = [x.row for x in lives]
            valid = self._mask(len(lives))
            if n == 0:
                res = alloc.alloc_decode(self.state, self._pad(rows, 0),
                                         self._pad([x.cur_len + 1 for x in lives], 0), valid)
            else:
                res = alloc.alloc_extend(self.state, self._pad(rows, 0),
                                         self._pad([x.cur_len for x in lives], 0),
                                         self._pad([x.cur_len + n for x in lives], 0), valid,
                                         capacity=cfg.max_running * n)
            if bool(res.ok):
                break
            if not bool(res.oom):
                alloc.raise_for_status(res, "alloc_decode")
            self._retract_last()
            ooms += 1
        self.state = res.state
        everyone = lives + [lives[0]] * (cfg.max_running - len(lives))  # padding replays row 0
        per = max(n, 1)
        cap = cfg.max_running * per
        i32 = functools.partial(np.array, dtype=np.int32)
        batch_rows = i32([x.row for x in everyone])
        if n == 0:
            mode, drafts, accepted = "decode", [None] * len(lives), []
            w_tok = [int(x.spec.token_ids[x.cur_len]) for x in lives]
            w_pos = [x.cur_len for x in lives]
            batch = (batch_rows, i32([x.cur_len + 1 for x in everyone]), i32([1] * len(everyone)))
        else:
            mode, drafts, accepted = "target_verify", [], []
            for x in lives:
                a = accepted_drafts(cfg.seed, x.spec.rid, x.cur_len, n)
                true = self._tokens(x, x.cur_len + n)[x.cur_len:]
                wrong = (true + 1 + np.arange(n)) % cfg.vocab_size
                drafts.append(np.where(np.arange(n) <= a, true, wrong).astype(np.int32))
                accepted.append(a)
            w_tok = np.concatenate(drafts)
            w_pos = np.concatenate([np.arange(x.cur_len, x.cur_len + n) for x in lives])
            batch = (batch_rows, i32([x.cur_len for x in everyone]), i32([n] * len(everyone)))
        q_rid = np.repeat([x.spec.rid for x in lives], per)
        out, rel, kv_tokens, works, partials = self._step(
            mode, np.asarray(res.out_cache_loc), self._pad(w_tok, 0, cap), self._pad(w_pos, 0, cap),
            batch, self._pad(q_rid, 0, cap), self._pad(w_pos, 0, cap), self._mask(len(w_tok), cap),
            [self._latent(self._tokens(x, x.cur_len + per, d), np.arange(x.cur_len + per))
             for x, d in zip(lives, drafts)],
            [per] * len(lives))
        if n == 0:
            for i, x in enumerate(lives):
                self._record(x, x.cur_len, out[i])
                x.cur_len += 1
        else:
            keep = []
            for i, (x, a) in enumerate(zip(lives, accepted)):
                new_len = min(x.cur_len + 1 + a, x.spec.total_len)
                for j in range(new_len - x.cur_len):
                    self._record(x, x.cur_len + j, out[i * n + j])
                x.cur_len = new_len
                keep.append(new_len)
            # rejected drafts give their slots back (whole pages no longer touched are freed)
            tr = alloc.truncate_requests(self.state, self._pad(rows, 0), self._pad(keep, 0), valid)
            alloc.raise_for_status(tr, "truncate_requests")
            self.state = tr.state
        done = [x for x in self.running if x.cur_len >= x.spec.total_len]
        if done:
            self.running = [x for x in self.running if x not in done]
            self._free_rows([x.row for x in done])
            self.finished += len(done)
        self._stats(step, mode, len(lives), len(lives) * per, kv_tokens, 0, ooms, rel, works,
                    partials)
