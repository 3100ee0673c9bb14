"""Benchmark of the ragged prefill kernels on one GPU: device time per call, useful TFLOP/s, the
ratio to the fastest dense attention measured in the same run, and the error against float32.

Case groups (`case_groups`): each is a function `rows(args) -> list[dict]` whose rows carry at
least {"group", "case", "us", "tflops", "baseline", "baseline_us", "ratio", "rel_err"}
(ratio = baseline time / kernel time, > 1: the kernel is faster; "targets": the issue's
targets judged on the row, `verdict`). The MHA group (`mha_rows`) is here; the absorbed MLA
extend group runs `bench.extend.extend_rows` (`extend_group_rows`).

MHA cases (q / k [T, H, 192], v [T, H, 128], bf16):
  * causal, one request of 16k tokens, H = 128;
  * causal, 16 requests of 1k tokens, H = 16 and H = 128.
Baselines: JAX's cuDNN attention (`jax.nn.dot_product_attention(implementation="cudnn")`,
v padded to 192, the padding's columns dropped; causal top-left = bottom-right at q_len =
kv_len) on the batch as [B, 1k] (the requests padded to one length: here equal) and request by
request (B calls in one program); torch's SDPA (flash / cuDNN backends) with --torch, on
strided views of the same token-major tensors, batched and request by request, and on
head-major copies (`torch_sdpa_us`). Every baseline but the head-major ones reads the kernel's
own inputs, and the fastest of those is the ratio's baseline; the fastest head-major one is
reported beside it (`ratio_head_major`: a layout the caller would have to pay a transposing
copy for, untimed here), and the fastest request by request gives `ratio_one_by_one`, on which
the issue's 16 x 1k targets are judged ("the baseline running the same requests one by one
padded"; `TARGETS`).
Without --sweep each case runs the config `mha_prefill` picks for its lengths
(`prefill_kernel_config`). With --torch that config's row also carries the same call through the
torch launcher (`launcher_us`: device and host time per call, bit-identity with the JAX path's
out). Each row also carries a layer of a serving step (`layer_us`, `layer_tflops`): the call
with a `prefill_step` built once outside it, so the schedule's small XLA kernels (built once a
step for all its layers) are not in it, and its bit-identity with the call (`layer_bitwise`).
FLOPs counted: 2 x H x (192 + 128) per visible (query, key) pair, a causal request counting
half of q_len x kv_len. Times are device time per call (`timing.device_kernel_times`:
profiler spans, each call queued behind a spin kernel so host gaps do not count); torch is timed
with CUDA events around calls queued behind a sleep kernel. Error: relative Frobenius error of
out against `mha_attention_reference` (float32) on two heads.

    python -m bench.prefill --out docs/results/            # the cases, prefill_<card>.json
    python -m bench.prefill --check --sweep --out out/     # + correctness shapes, tile sweep
    python -m bench.prefill --sweep --rounds 3 --only causal --configs kv128_s2_pp,kv64_s4_pp
                                                           # configs in alternating rounds
    python -m bench.prefill --profile out/trace --only 16x1k  # in-kernel phase profile
    python -m bench.prefill --sweep --configs kv128_s2_pp,kv64_s4_pp --rounds 2 \
        --shapes 128:64x256,128:32x512,128:16x1024,128:12x1536,128:8x2048,128:4x4096,128:2x8192
                                                           # the tile configs' crossover

--profile DIR runs each selected case once per config with Mosaic GPU's in-kernel profiler
(`MgpuPrefillConfig.profile_space`) instead of timing it, and prints `bench.kernel_trace`'s
summary (phase cycles per block and warpgroup, SM time inside blocks, gaps between blocks);
cases whose blocks hold more tiles than the profiler's shared memory takes are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import (
    MgpuPrefillConfig,
    merge_attention_states,
    mha_prefill,
    prefill_kernel_config,
)
from funcmla.attention.pallas.prefill import SHORT_CONFIG, SHORT_KV_LEN, prefill_step
from funcmla.attention.reference import mha_attention_reference
from funcmla.config import MLADims

from .kernel_trace import format_summary, profiled_summary
from .report import card_tag
from .timing import device_kernel_times, environment, torch_host_us, torch_queued_us, write_json

SM_SCALE = MLADims().sm_scale
D_QK, D_V = 192, 128
# 16 requests of 1017-1031 tokens (16384 in all), starting off 8-row boundaries as a serving
# step's extend lengths do: the kernel reads each from its 8-row group, with no copy.
RAGGED_1K = [1021, 1030, 1019, 1027, 1025, 1018, 1031, 1023, 1026, 1020, 1029, 1022, 1024,
             1028, 1017, 1024]
# 15 of them, 15352 tokens: a multiple of 8 (the JAX path reads q / k / v as they are) that is
# not a torch launcher bucket (`prefill_capacity`: 15360), so the launcher pads q / k / v by a
# copy each, as it does for most serving steps.
RAGGED_15 = RAGGED_1K[:14] + [RAGGED_1K[14] - 8]
# (name, heads, request lengths, causal)
MHA_CASES = [
    ("causal 1x16k H128", 128, [16384], True),
    ("causal 16x1k H16", 16, [1024] * 16, True),
    ("causal 16x1k H128", 128, [1024] * 16, True),
    ("causal 16x1k ragged H128", 128, RAGGED_1K, True),  # no dense baseline: unequal lengths
    ("causal 15x1k ragged H128", 128, RAGGED_15, True),
]
SWEEP = [MgpuPrefillConfig(),
         MgpuPrefillConfig(pingpong=False),
         MgpuPrefillConfig(block_kv=64, num_stages=3),
         MgpuPrefillConfig(block_kv=64, num_stages=4),
         MgpuPrefillConfig(block_kv=64, num_stages=4, pingpong=False),
         MgpuPrefillConfig(block_kv=64, num_stages=2),
         *[MgpuPrefillConfig(block_kv=64, num_stages=3, tiles_per_cta=g) for g in (2, 3, 4)]]


def log(*a):
    print(*a, flush=True)


_SINK: dict = {}


def save_partial() -> None:
    """Rewrites the JSON with what has been measured so far (a call cut short keeps it)."""
    if _SINK.get("path"):
        write_json(_SINK["path"], _SINK["payload"])


def past_deadline(args) -> bool:
    return bool(args.time_limit) and time.time() - _SINK.get("t0", time.time()) > args.time_limit


def cfg_name(c: MgpuPrefillConfig) -> str:
    return (f"kv{c.block_kv}_s{c.num_stages}" + ("_pp" if c.pingpong else "")
            + (f"_g{c.tiles_per_cta}" if c.tiles_per_cta > 1 else ""))


# The targets per case: (min TFLOP/s or None, min ratio or None, the row's ratio it
# is judged on). One request: the fastest dense call ("ratio"); 16 requests: "the baseline
# running the same requests one by one padded" ("ratio_one_by_one"; the batched call of the
# equal-length requests stays reported as "ratio").
TARGETS = {"causal 1x16k H128": (550.0, 0.95, "ratio"),
           "causal 16x1k H16": (None, 0.90, "ratio_one_by_one"),
           "causal 16x1k H128": (400.0, 0.90, "ratio_one_by_one")}
MAX_REL_ERR = 1e-2


def verdict(row: dict) -> str:
    """The issue's targets judged on one row: 'met' or what was missed."""
    tf, ratio, key = TARGETS.get(row["case"], (None, None, "ratio"))
    missed = []
    if tf is not None and not (row.get("tflops") or 0) >= tf:
        missed.append(f"{row.get('tflops') or 0:.0f} < {tf:.0f} TFLOP/s")
    what = "of the baseline" if key == "ratio" else "of the baseline one by one"
    if ratio is not None and not (row.get(key) or 0) >= ratio:
        missed.append(f"x{row.get(key) or 0:.3f} < x{ratio} {what}")
    if not row["rel_err"] < MAX_REL_ERR:
        missed.append(f"error {row['rel_err']:.1e} >= {MAX_REL_ERR}")
    return "met" if not missed else "missed: " + "; ".join(missed)


def make_inputs(key, heads: int, q_lens, kv_lens):
    qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (int(qo[-1]), heads, D_QK), jnp.bfloat16)
    k = jax.random.normal(k2, (int(kv[-1]), heads, D_QK), jnp.bfloat16)
    v = jax.random.normal(k3, (int(kv[-1]), heads, D_V), jnp.bfloat16)
    return q, k, v, jnp.asarray(qo), jnp.asarray(kv)


def useful_flops(heads: int, q_lens, kv_lens, causal: bool) -> float:
    pairs = sum(q * kv * (0.5 if causal else 1.0) for q, kv in zip(q_lens, kv_lens))
    return 2.0 * heads * (D_QK + D_V) * pairs


def rel_err(out, ref) -> float:
    a = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    r = np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


ERR_HEADS = (0, -1)


def head_subset_reference(q, k, v, qo, kv, causal: bool):
    """(head indices, float32 reference out on those heads): the error is measured on two
    heads, which keeps the reference's cost small at 16k tokens."""
    idx = jnp.asarray(sorted({h % q.shape[1] for h in ERR_HEADS}))
    ref, _ = mha_attention_reference(q[:, idx], k[:, idx], v[:, idx], qo, kv, sm_scale=SM_SCALE,
                                     causal=causal, max_kv_len=int(np.max(np.diff(kv))),
                                     query_chunk=64)
    return idx, np.asarray(ref)


def device_us(fn, reps: int) -> float | None:
    stats = device_stats(fn, reps)
    return None if stats is None else stats["span_us"]


def device_stats(fn, reps: int) -> dict | None:
    """`timing.device_kernel_times` of `fn` (blocking), each call queued behind a spin kernel:
    span_us (the headline: first kernel start to last kernel end of a call), busy_us_per_call
    (the kernels' summed durations; a span well above it means gaps inside a call, e.g. the
    host still queueing its kernels) and the kernels by name."""
    return device_kernel_times(fn, reps=reps, primed=True)


# ----------------------------------------------------------------------------- baselines

def cudnn_fn(q, k, v, qo, causal: bool, per_request: bool):
    """Dense cuDNN attention on the requests padded to one length ([B, L, H, 192], v padded to
    192), or one call per request; returns a blocking callable."""
    q_lens = np.diff(np.asarray(qo))
    if len(set(q_lens.tolist())) != 1:
        raise ValueError("the dense baseline here takes equal-length requests")
    b, length = len(q_lens), int(q_lens[0])
    h = q.shape[1]
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, D_QK - D_V)))

    def attend(qb, kb, vb):
        return jax.nn.dot_product_attention(qb, kb, vb, scale=SM_SCALE, is_causal=causal,
                                            implementation="cudnn")[..., :D_V]

    if per_request:
        parts = [(q[i * length:(i + 1) * length][None], k[i * length:(i + 1) * length][None],
                  vp[i * length:(i + 1) * length][None]) for i in range(b)]
        # one program of B calls, so no host dispatch lies between them
        each = jax.jit(lambda ps: [attend(*p) for p in ps])

        def run():
            return jax.block_until_ready(each(parts))
    else:
        qb, kb, vb = (x.reshape(b, length, h, x.shape[-1]) for x in (q, k, vp))
        f = jax.jit(attend)

        def run():
            return jax.block_until_ready(f(qb, kb, vb))
    return run


# Baselines fed tensors laid out otherwise than the kernel's inputs: reported, not the ratio's.
HEAD_MAJOR = "_head_major"
# Baselines that run the requests one by one (one dense call each, queued back to back): the
# issue's baseline for the 16 x 1k cases ("the same requests one by one padded").
PER_REQUEST = "_per_request"


def fastest_baselines(base: dict[str, float]) -> tuple[str | None, str | None, str | None]:
    """(the fastest baseline that reads the kernel's own inputs, batched or one by one: the
    ratio's; the fastest on head-major copies, reported beside it; the fastest that runs the
    requests one by one: `ratio_one_by_one`'s), each None if there is none. base: name -> us."""
    def fastest(names):
        return min(names, key=base.get) if names else None

    own = [n for n in base if not n.endswith(HEAD_MAJOR)]
    return (fastest(own), fastest([n for n in base if n.endswith(HEAD_MAJOR)]),
            fastest([n for n in own if n.endswith(PER_REQUEST)]))


def torch_sdpa_us(q, k, v, qo, causal: bool, reps: int, calls: int = 5) -> dict:
    """torch SDPA (flash and cuDNN backends) on the batch as [B, H, L, 192]: device time per
    call by backend (`torch_queued_us`, so the host's dispatch of each call is not timed);
    {} without torch or CUDA. Two layouts: "torch_<backend>" reads the very tensors the kernel
    reads ([T, H, d] token-major, as SGLang holds q / k / v; [B, H, L, d] is a strided view of
    them, v padded to 192 in that layout), "torch_<backend>_head_major" contiguous [B, H, L, d]
    copies made before timing (each head's rows together: fewer, longer memory segments; the
    copy is not timed, so that figure is reported beside the ratio, not as its baseline).
    With B > 1 also "torch_<backend>_per_request": B calls of one request each on the
    token-major views, queued back to back (the requests one by one)."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    q_lens = np.diff(np.asarray(qo))
    if len(set(q_lens.tolist())) != 1:
        return {}  # [B, H, L, d] views need equal lengths
    b, length = len(q_lens), int(q_lens[0])
    h = q.shape[1]

    def view(t):  # [T, H, d] -> [B, H, L, d], a strided view (no copy)
        return t.reshape(b, length, h, t.shape[-1]).transpose(1, 2)

    tq, tk = torch.from_dlpack(q), torch.from_dlpack(k)
    tv = torch.nn.functional.pad(torch.from_dlpack(v), (0, D_QK - D_V))  # [T, H, 192]
    views = [view(t) for t in (tq, tk, tv)]
    # per variant, the (q, k, v) of each SDPA call one timed call makes
    variants = {"": [views], HEAD_MAJOR: [[t.contiguous() for t in views]]}
    if b > 1:
        variants[PER_REQUEST] = [[t[i:i + 1] for t in views] for i in range(b)]
    res = {}
    for suffix, calls_qkv in variants.items():
        for name, be in (("torch_flash", SDPBackend.FLASH_ATTENTION),
                         ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    res[name + suffix] = torch_queued_us(torch, lambda: [
                        torch.nn.functional.scaled_dot_product_attention(
                            cq, ck, cv, is_causal=causal, scale=SM_SCALE)
                        for cq, ck, cv in calls_qkv], reps, calls)
            except Exception as e:  # noqa: BLE001 - a backend missing here is reported
                log(f"   {name}{suffix}: {type(e).__name__}: {str(e)[:160]}")
    return res


def launcher_us(q, k, v, qo, kv, causal: bool, kernel: MgpuPrefillConfig, jax_out, reps: int,
                calls: int = 5) -> dict:
    """The same call through the torch launcher (`funcmla.interop.launcher.torch_mha_prefill`'s
    buckets, the step's layout built once as a serving step does): device time per call
    (`torch_queued_us`), host time per call (the median of `calls` calls' wall time, not
    synchronized, over `reps` runs) and whether out equals the JAX path's bit for bit; {} with
    no torch CUDA, {"via_torch_error": why} where the launcher cannot run."""
    try:
        import torch

        from funcmla.interop.launcher import (PrefillLaunchConfig, prefill_batch_capacity,
                                              prefill_capacity, prefill_launcher)
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    t = [torch.from_dlpack(x) for x in (q, k, v, qo, kv)]
    try:
        cfg = PrefillLaunchConfig(
            num_heads=int(q.shape[1]), q_capacity=prefill_capacity(q.shape[0]),
            kv_capacity=prefill_capacity(k.shape[0]),
            batch=prefill_batch_capacity(qo.shape[0] - 1), sm_scale=SM_SCALE, causal=causal,
            kernel=kernel)
        lau = prefill_launcher(cfg)
        step = lau.layout(t[3], t[4], int(q.shape[0]), int(k.shape[0]))
        out = torch.empty(q.shape[0], q.shape[1], D_V, dtype=torch.bfloat16, device=t[0].device)
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=t[0].device)
        fn = lambda: lau(t[0], t[1], t[2], step=step, out=out, lse=lse)  # noqa: E731
        us = torch_queued_us(torch, fn, reps, calls)
        host = torch_host_us(torch, fn, reps, calls)
        bitwise = bool(torch.equal(out.view(torch.int16),
                                   torch.from_dlpack(jax_out).view(torch.int16)))
    except Exception as e:  # noqa: BLE001 - reported in the row
        log(f"   via torch: {type(e).__name__}: {str(e)[:200]}")
        return {"via_torch_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"via_torch_us": us, "via_torch_host_us": host,
            "via_torch_bitwise": bitwise}


# ----------------------------------------------------------------------------- groups

def selected_configs(args, kv_lens) -> list[MgpuPrefillConfig]:
    """The config `mha_prefill` picks for these requests (`prefill_kernel_config` of the
    longest), or with --sweep every SWEEP config (those named by --configs)."""
    configs = SWEEP if args.sweep else [prefill_kernel_config(max(kv_lens))]
    if args.configs:
        configs = [c for c in configs if cfg_name(c) in args.configs.split(",")]
    return configs


def parse_shapes(text: str) -> list[tuple]:
    """--shapes "H:NxL,...": causal cases of N requests of L tokens at H heads, as MHA_CASES
    entries (the tile configs' crossover). Raises ValueError naming a malformed entry."""
    cases = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+):(\d+)x(\d+)\s*", part)
        if not m or min(int(g) for g in m.groups()) < 1:
            raise ValueError(f"--shapes entry {part!r} is not H:NxL with positive ints, "
                             "e.g. 128:16x1024")
        h, n, length = (int(g) for g in m.groups())
        cases.append((f"causal {n}x{length} H{h}", h, [length] * n, True))
    return cases


def selected_cases(args) -> list[tuple]:
    """MHA_CASES (or the --shapes cases) whose name contains --only."""
    cases = parse_shapes(args.shapes) if args.shapes else MHA_CASES
    return [c for c in cases if not args.only or args.only in c[0]]


def mha_rows(args) -> list[dict]:
    """The MHA prefill cases (MHA_CASES) with the config `mha_prefill` picks for them, or with
    every SWEEP config when --sweep."""
    rows = []
    key = jax.random.PRNGKey(0)
    for name, heads, lens, causal in selected_cases(args):
        configs = selected_configs(args, lens)
        q, k, v, qo, kv = make_inputs(key, heads, lens, lens)
        flops = useful_flops(heads, lens, lens, causal)
        base = {}
        for label, per in (("cudnn_batched", False), ("cudnn" + PER_REQUEST, True)):
            if per and len(lens) == 1:
                continue
            try:
                base[label] = device_us(cudnn_fn(q, k, v, qo, causal, per), args.reps)
            except Exception as e:  # noqa: BLE001
                log(f"   {label}: {type(e).__name__}: {str(e)[:200]}")
        base.update(torch_sdpa_us(q, k, v, qo, causal, args.reps) if args.torch else {})
        base = {n: t for n, t in base.items() if t}
        best, best_hm, best_one = fastest_baselines(base)
        idx, ref = head_subset_reference(q, k, v, qo, kv, causal)
        # Each config compiled and checked first, then timed in `--rounds` alternating rounds
        # (the median of its rounds), so configs compare on the same machine state.
        runs, times = {}, {}
        for cfg in configs:
            if past_deadline(args):
                log(f"   time limit: {name} {cfg_name(cfg)} not run")
                continue
            # the CSRs are the call's constants, as the host knows them (checked and
            # configured eagerly, as `mha_prefill` does with concrete indptrs)
            f = jax.jit(lambda q_, k_, v_, c=cfg: mha_prefill(
                q_, k_, v_, qo, kv, sm_scale=SM_SCALE, causal=causal, config=c))
            # A layer of a serving step: the step's schedule (`prefill_step`) built once,
            # outside the timed call, as the step's layers share it.
            layer = jax.jit(lambda q_, k_, v_, s_: mha_prefill(q_, k_, v_, step=s_,
                                                               sm_scale=SM_SCALE))
            try:
                out, _ = f(q, k, v)
                step = prefill_step(qo, kv, q.shape[0], k.shape[0], causal=causal, config=cfg)
                layer_out, _ = layer(q, k, v, step)
                runs[cfg] = (f, out, rel_err(out[:, idx], ref),
                             functools.partial(layer, q, k, v, step),
                             bool(jnp.array_equal(layer_out, out)))
            except Exception as e:  # noqa: BLE001 - a config that fails is a row, not a stop
                log(f"   {name} {cfg_name(cfg)}: {type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(group="mha", case=name, config=cfg_name(cfg),
                                 error=f"{type(e).__name__}: {str(e)[:300]}"))
        stats = {}
        layer_times = {}
        for _ in range(args.rounds):
            for cfg, (f, _, _, layer, _) in runs.items():
                st = device_stats(lambda f=f: jax.block_until_ready(f(q, k, v)), args.reps)
                stats.setdefault(cfg, []).append(st)
                times.setdefault(cfg, []).append(st and st["span_us"])
                st = device_stats(lambda g=layer: jax.block_until_ready(g()), args.reps)
                layer_times.setdefault(cfg, []).append(st and st["span_us"])
        for cfg, (f, out, err, _, layer_bitwise) in runs.items():
            valid = [t for t in times.get(cfg, []) if t]
            us = statistics.median(valid) if valid else None
            done = [st for st in stats.get(cfg, []) if st]
            row = dict(group="mha", case=name, config=cfg_name(cfg), heads=heads,
                       requests=len(lens), tokens=int(sum(lens)), causal=causal, us=us,
                       tflops=flops / (us * 1e-6) / 1e12 if us else None,
                       baselines_us=base, baseline=best,
                       baseline_us=base.get(best), rel_err=err, rounds_us=times.get(cfg),
                       rounds_busy_us=[st["busy_us_per_call"] for st in done],
                       kernels=done[-1]["kernels"] if done else None)
            row["baseline_tflops"] = (flops / (row["baseline_us"] * 1e-6) / 1e12
                                      if row["baseline_us"] else None)
            row["ratio"] = row["baseline_us"] / us if us and row["baseline_us"] else None
            if best_hm is not None and us:
                row.update(baseline_head_major=best_hm, ratio_head_major=base[best_hm] / us)
            if best_one is not None and us:
                row.update(baseline_one_by_one=best_one, ratio_one_by_one=base[best_one] / us)
            layer_valid = [t for t in layer_times.get(cfg, []) if t]
            if layer_valid:
                layer_us = statistics.median(layer_valid)
                row.update(layer_us=layer_us, layer_tflops=flops / (layer_us * 1e-6) / 1e12,
                           rounds_layer_us=layer_times[cfg], layer_bitwise=layer_bitwise)
            row["targets"] = verdict(row)
            if args.torch and cfg == prefill_kernel_config(max(lens)):
                row.update(launcher_us(q, k, v, qo, kv, causal, cfg, out, args.reps))
            rows.append(row)
            log(fmt(row))
            save_partial()
    return rows


def profile_rows(args) -> list[dict]:
    """Each selected MHA case once per config with the in-kernel profiler (`--profile DIR`):
    `bench.kernel_trace.summarize` of the call's trace, one row per (case, config)."""
    rows = []
    key = jax.random.PRNGKey(0)
    for name, heads, lens, causal in selected_cases(args):
        q, k, v, qo, kv = make_inputs(key, heads, lens, lens)
        for cfg in selected_configs(args, lens):
            tiles = -(-max(lens) // cfg.block_kv)
            # per consumer and q tile: wait_q, finish, and per KV tile wait_k, qk, softmax,
            # wait_v, turn, pv; store_wait once a CTA (the producer records fewer)
            space = cfg.tiles_per_cta * (6 * tiles + 8)
            trace_dir = os.path.join(args.profile, f"{name}_{cfg_name(cfg)}".replace(" ", "_"))
            try:
                pcfg = dataclasses.replace(cfg, profile_space=space, profile_dir=trace_dir)
            except ValueError as e:
                log(f"   {name} {cfg_name(cfg)}: not profiled ({e})")
                continue
            f = jax.jit(lambda q_, k_, v_, c=pcfg: mha_prefill(
                q_, k_, v_, qo, kv, sm_scale=SM_SCALE, causal=causal, config=c))
            profiled = profiled_summary(lambda: jax.block_until_ready(f(q, k, v)), trace_dir,
                                        clock_ghz=args.clock_ghz)
            if profiled is None:
                log(f"   {name} {cfg_name(cfg)}: no trace written")
                continue
            summary = profiled[0]
            log(f"{name} {cfg_name(cfg)}:\n{format_summary(summary)}")
            rows.append(dict(group="profile", case=name, config=cfg_name(cfg), **summary))
    return rows


def extend_group_rows(args) -> list[dict]:
    """The absorbed MLA extend cases (`bench.extend.extend_rows`) as rows of this table: the
    baseline is the decode kernel on the same keys, timed in the same run (ratio: its TFLOP/s
    over the extend's, inverted so > 1 means the extend is faster)."""
    from .extend import extend_rows, target_verdicts

    left = None
    if args.time_limit:
        left = max(0.0, args.time_limit - (time.time() - _SINK.get("t0", time.time())))
    rows = extend_rows(reps=max(3, args.reps // 3), only=args.only, time_limit_s=left)
    out = []
    for r in rows:
        out.append(dict(group="extend", case=r["case"], config=r.get("kernel", ""),
                        us=r.get("time_us"), tflops=r.get("tflops"), baseline="decode kernel",
                        baseline_us=r.get("decode_baseline_us"),
                        baseline_tflops=r.get("decode_baseline_tflops"),
                        ratio=r.get("vs_decode_baseline"), rel_err=r.get("rel_err", float("nan")),
                        extend=r))
    verdicts = dict(target_verdicts(rows))
    if out:
        out[0]["targets"] = "; ".join(f"{t}: {v}" for t, v in verdicts.items())
    return out


def case_groups() -> list[tuple[str, object]]:
    """(name, rows function) of every case group: the MHA prefill and the absorbed extend."""
    return [("mha", mha_rows), ("extend", extend_group_rows)]


# ----------------------------------------------------------------------------- checks

CHECKS = [  # (heads, q_lens, kv_lens, causal): ragged, prefix, empty, q_len 1, non-causal
    (16, [1000, 1, 0, 300, 129], [1000, 700, 0, 4000, 129], True),
    (128, [64, 200, 1], [64, 1200, 33], True),
    (16, [77, 0, 513], [5, 9, 513], False),
]


def check_rows(args) -> list[dict]:
    """Correctness on ragged shapes against the float32 reference (every head), unused k / v
    rows holding NaN, and the merge of a prefix part and a new-token part against one call."""
    rows = []
    key = jax.random.PRNGKey(1)
    for heads, q_lens, kv_lens, causal in CHECKS:
        q, k, v, qo, kv = make_inputs(key, heads, q_lens, kv_lens)
        pad = 200  # rows no request uses, poisoned
        k = jnp.concatenate([k, jnp.full((pad, heads, D_QK), jnp.nan, k.dtype)])
        v = jnp.concatenate([v, jnp.full((pad, heads, D_V), jnp.nan, v.dtype)])
        q = jnp.concatenate([q, jnp.ones((3, heads, D_QK), q.dtype)])  # rows past qo[-1]
        for cfg in SWEEP[:3] if args.sweep else [prefill_kernel_config(max(kv_lens))]:
            out, lse = mha_prefill(q, k, v, qo, kv, sm_scale=SM_SCALE, causal=causal,
                                   config=cfg)
            ref, ref_lse = mha_attention_reference(q, k, v, qo, kv, sm_scale=SM_SCALE,
                                                   causal=causal, max_kv_len=max(kv_lens))
            fin = np.isfinite(np.asarray(ref_lse))
            lse_err = float(np.max(np.abs(np.where(fin, np.asarray(lse) - np.asarray(ref_lse),
                                                   0.0))))
            row = dict(case=f"H{heads} q{q_lens} kv{kv_lens} causal={causal}",
                       config=cfg_name(cfg), rel_err=rel_err(out, ref), lse_max_abs=lse_err,
                       empty_ok=bool(np.array_equal(np.isinf(np.asarray(lse)), ~fin)
                                     and not np.asarray(out, np.float32)[~fin].any()),
                       nan=bool(np.isnan(np.asarray(out, np.float32)).any()))
            rows.append(row)
            log(f"   check {row['case']} {row['config']}: rel_err {row['rel_err']:.2e} "
                f"lse {lse_err:.1e} empty_ok {row['empty_ok']} nan {row['nan']}")
    # merge: a prefix part (non-causal over the prefix) + the new tokens (causal) == one call
    heads, new, prefix = 16, [300, 128], [700, 0]
    q, k, v, qo, kv = make_inputs(key, heads, new, [n + p for n, p in zip(new, prefix)])
    qn, kvn = np.asarray(qo), np.asarray(kv)
    pre = np.concatenate([np.r_[kvn[i]:kvn[i] + prefix[i]] for i in range(2)]).astype(int)
    nw = np.concatenate([np.r_[kvn[i] + prefix[i]:kvn[i + 1]] for i in range(2)]).astype(int)
    pre_indptr = jnp.asarray(np.concatenate([[0], np.cumsum(prefix)]), jnp.int32)
    o1, l1 = mha_prefill(q, k[pre], v[pre], qo, pre_indptr, sm_scale=SM_SCALE, causal=False)
    o2, l2 = mha_prefill(q, k[nw], v[nw], qo, qo, sm_scale=SM_SCALE, causal=True)
    om, _ = merge_attention_states(o1, l1, o2, l2)
    ref, _ = mha_attention_reference(q, k, v, qo, kv, sm_scale=SM_SCALE, causal=True)
    rows.append(dict(case="merge prefix + new", config="default", rel_err=rel_err(om, ref)))
    log(f"   check merge: rel_err {rows[-1]['rel_err']:.2e}")
    del qn
    return rows


# ----------------------------------------------------------------------------- output

def fmt(r: dict) -> str:
    if "error" in r:
        return f"{r['group']:6s} {r['case']:22s} {r.get('config', ''):10s} ERROR {r['error'][:80]}"
    ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
    base = (f"{r['baseline']} {r['baseline_us']:.1f} us" if r.get("baseline_us") else "none")
    us = f"{r['us']:10.1f} us {r['tflops']:7.1f} TFLOP/s" if r.get("us") else "no device time"
    if r.get("rounds_busy_us"):  # kernel time summed, against the span: gaps inside a call
        us += f" (busy {statistics.median(r['rounds_busy_us']):.1f})"
    torch_path = (f"  via torch {r['via_torch_us']:.1f} us (host {r['via_torch_host_us']:.0f} "
                  f"us, bitwise {r['via_torch_bitwise']})" if r.get("via_torch_us") else "")
    hm = (f"  (x{r['ratio_head_major']:.3f} of {r['baseline_head_major']} "
          f"{r['baselines_us'][r['baseline_head_major']]:.1f} us)"
          if r.get("ratio_head_major") else "")
    if r.get("ratio_one_by_one"):
        hm += (f"  one by one x{r['ratio_one_by_one']:.3f} of {r['baseline_one_by_one']} "
               f"{r['baselines_us'][r['baseline_one_by_one']]:.1f} us")
    layer = (f"  a layer of a step {r['layer_us']:.1f} us {r['layer_tflops']:.1f} TFLOP/s "
             f"(bitwise {r['layer_bitwise']})" if r.get("layer_us") else "")
    return (f"{r['group']:6s} {r['case']:22s} {r.get('config', ''):10s} {us}  baseline {base}  "
            f"x{ratio}{hm}  err {r['rel_err']:.2e}  {r.get('targets', '')}{layer}{torch_path}")


def plot(rows: list[dict], path: str) -> None:
    """TFLOP/s per case and config, with the case's baseline and target, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("tflops")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4.5))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["tflops"] for r in rows], 0.4, label="funcmla prefill kernel")
    ax.bar(x + 0.2, [r.get("baseline_tflops") or 0 for r in rows], 0.4,
           label="fastest dense baseline (same run)")
    for i, r in enumerate(rows):
        tf = TARGETS.get(r["case"], (None, None, "ratio"))[0]
        if tf:
            ax.plot([i - 0.45, i + 0.45], [tf, tf], "r--", lw=1)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['case']}\n{r.get('config', '')}" for r in rows], fontsize=6)
    ax.set_ylabel("useful TFLOP/s (causal counts half)")
    ax.set_title("ragged MHA prefill and absorbed extend, device time per call\n(red: target)",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--name", default=None,
                    help="JSON file name (default prefill_<card>.json, the card from the "
                         "device's name: h100, h200)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="correctness shapes first")
    ap.add_argument("--sweep", action="store_true", help="every tile config of SWEEP")
    ap.add_argument("--torch", action="store_true",
                    help="torch SDPA baselines and the torch launcher's times too")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternating timing rounds per config (the median is reported)")
    ap.add_argument("--configs", default=None,
                    help="with --sweep: comma-separated config names of SWEEP (cfg_name)")
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    ap.add_argument("--shapes", default=None, metavar="H:NxL,...",
                    help="causal cases of N requests of L tokens at H heads instead of the "
                         "MHA cases (no extend cases), e.g. 128:64x256,128:8x2048")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds after which no further config is started")
    ap.add_argument("--quick", action="store_true", help="3 repetitions (`funcmla bench`)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="in-kernel profile of the MHA cases (traces under DIR), no timing")
    ap.add_argument("--clock-ghz", type=float, default=1.755,
                    help="SM clock for --profile's block ends (cycles to ns)")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 3
    if jax.default_backend() != "gpu":
        sys.exit("bench.prefill needs a GPU (the kernel is Hopper's)")
    t0 = time.time()
    payload = dict(environment=environment(), sm_scale=SM_SCALE,
                   default_config=dataclasses.asdict(MgpuPrefillConfig()),
                   short_config=dict(max_kv_len=SHORT_KV_LEN, **dataclasses.asdict(SHORT_CONFIG)))
    name = args.name or f"prefill_{card_tag(jax.devices()[0].device_kind)}.json"
    path = f"{args.out.rstrip('/')}/{name}"
    _SINK.update(path=path, payload=payload, t0=t0)
    if args.profile:
        payload["profiles"] = profile_rows(args)
        write_json(path, payload)
        log(f"wrote {path}")
        return payload
    if args.check:
        payload["checks"] = check_rows(args)
        save_partial()
    for name, rows_fn in case_groups():
        if args.shapes and name != "mha":
            continue
        payload[name] = rows_fn(args)
        save_partial()
    payload["seconds"] = time.time() - t0
    write_json(path, payload)
    log(f"wrote {path}")
    try:
        plot([r for name, _ in case_groups() for r in payload.get(name, [])],
             path.rsplit(".", 1)[0] + ".png")
    except ImportError as e:  # matplotlib is the `bench` extra
        log(f"no plot: {e}")
    for name, _ in case_groups():
        for r in payload.get(name, []):
            log(fmt(r))
    return payload


if __name__ == "__main__":
    main()
