"""Benchmark of absorbed MLA extend (`funcmla.attention.pallas.mla_extend`) on one GPU.

Each case: B requests of `q_len` new tokens over a `prefix` of cached tokens (bottom-right
causal), H heads, a token CSR (page 1, slots scattered at random) or a page table (page 64,
pages in random order), random bf16 data. Timing as `bench.decode` (`time_calls`,
`profile_timings`): a jit of n calls on distinct q, run under a profiler trace; the headline
is the device span per call (first kernel start to last kernel end: the metadata fusions, the
q and output gathers where C > 1, the decode kernel and the merge where split). Reports
useful TFLOP/s, counting each query's visible keys only (2 * H * (576 + 512) per query and
visible key), the decode kernel's own time, the kernel choice, C, the pseudo-sequence count P
and the split count, and the relative error against the float32 reference
(`funcmla.attention.reference`, Precision.HIGHEST) on the same bf16 values.

Baseline in the same run: the decode kernel (`mla_decode`) on uniform sequences of the same
rows a sequence (s_q = C) at the extend's mean visible context, 256 of them: the rate the
kernel reaches without the ragged extend's metadata, causal spread and gathers.

    python -m bench.extend [--quick] [--only REGEX] [--out DIR] [--reps N] [--no-check]
                           [--torch] [--replot JSON]

Writes extend.json and extend.png under --out (docs/results/extend_h200.{json,png} hold the
H200's; `--replot JSON` redraws a saved run's plot) and prints
a table and the targets (H = 128, B = 8, 1024 tokens over a 4k prefix: >= 450 TFLOP/s at
pages 1 and 64, page 1 within 5% of page 64; relative error < 1e-2 everywhere).
`extend_rows(...)` returns the rows for other benchmarks (bench/prefill.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import DecodeKernelConfig, chunk_tokens, mla_decode, mla_extend
from funcmla.attention.pallas.api import decode_num_splits, uses_mgpu
from funcmla.attention.pallas.extend import extend_kernel_config, num_pseudo_seqs
from funcmla.attention.reference import mla_attention_reference
from funcmla.config import MLADims
from funcmla.layout import PageTable

from .decode_timing import profile_timings, time_calls
from .report import log
from .timing import environment, write_json

__all__ = ["ExtendCase", "default_cases", "extend_rows", "bench_extend_case", "main",
           "target_verdicts", "make_extend_inputs"]

D, DV = 576, 512
SM_SCALE = MLADims().sm_scale

TARGET_TFLOPS = 450.0
TARGET_PAGE_RATIO = 1.05
TARGET_ERR = 1e-2


@dataclasses.dataclass(frozen=True)
class ExtendCase:
    """B requests of q_len new tokens over `prefix` cached ones, H heads, page size."""

    heads: int
    batch: int
    q_len: int
    prefix: int
    page_size: int

    @property
    def label(self) -> str:
        return (f"H{self.heads} B{self.batch} q{self.q_len} prefix{self.prefix} "
                f"p{self.page_size}")

    @property
    def kv_len(self) -> int:
        return self.prefix + self.q_len

    @property
    def useful_flops(self) -> float:
        """2 * H * (576 + 512) per query and key it sees (query j sees prefix + j + 1)."""
        visible = self.q_len * self.prefix + self.q_len * (self.q_len + 1) / 2
        return 2.0 * self.heads * (D + DV) * self.batch * visible


def default_cases(quick: bool = False) -> list[ExtendCase]:
    """The targets' cases (H = 128 and 16, B = 8, 1024 over 4k, pages 1 and 64), then short
    ones: one request of 64 tokens, and 16 tokens over 8k (few pseudo-sequences: split)."""
    cases = [ExtendCase(128, 8, 1024, 4096, 1), ExtendCase(128, 8, 1024, 4096, 64),
             ExtendCase(16, 8, 1024, 4096, 1), ExtendCase(16, 8, 1024, 4096, 64)]
    if quick:
        return cases[:2]
    return cases + [ExtendCase(128, 1, 64, 4096, 64), ExtendCase(16, 1, 64, 4096, 64),
                    ExtendCase(128, 1, 16, 8192, 1), ExtendCase(16, 1, 16, 8192, 64)]


def make_extend_inputs(key, case: ExtendCase, n_q: int):
    """n_q query tensors [B * q_len, H, 576], one pool, the metadata (a token CSR at page 1,
    slots in random order; a page table else, pages in random order)."""
    b, ps, kv = case.batch, case.page_size, case.kv_len
    k1, k2, k3 = jax.random.split(key, 3)
    qo_indptr = jnp.arange(b + 1, dtype=jnp.int32) * case.q_len
    if ps == 1:
        slots = b * kv + 1  # slot 0 unused
        perm = jax.random.permutation(k3, jnp.arange(1, slots, dtype=jnp.int32))
        meta = dict(kv_indptr=jnp.arange(b + 1, dtype=jnp.int32) * kv, kv_indices=perm)
    else:
        pages = -(-kv // ps)
        slots = (b * pages + 1) * ps
        perm = jax.random.permutation(k3, jnp.arange(1, b * pages + 1, dtype=jnp.int32))
        meta = dict(page_table=PageTable(perm.reshape(b, pages), jnp.full((b,), kv, jnp.int32),
                                         ps))
    pool = jax.random.normal(k1, (slots, D), jnp.bfloat16)
    qs = [jax.random.normal(jax.random.fold_in(k2, i), (b * case.q_len, case.heads, D),
                            jnp.bfloat16) for i in range(n_q)]
    return qs, pool, qo_indptr, meta


def _csr_of(meta, case: ExtendCase):
    """The token CSR of the metadata (for the reference)."""
    if "kv_indptr" in meta:
        return meta["kv_indptr"], meta["kv_indices"]
    pt, ps, kv = meta["page_table"], case.page_size, case.kv_len
    pos = jnp.arange(kv, dtype=jnp.int32)
    slots = pt.table[:, pos // ps] * ps + pos % ps
    return jnp.arange(case.batch + 1, dtype=jnp.int32) * kv, slots.reshape(-1)


def rel_err(a, ref) -> float:
    a = jnp.asarray(a, jnp.float32)
    return float(jnp.linalg.norm((a - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def _launch_facts(case: ExtendCase, config: DecodeKernelConfig) -> dict:
    """C, P, the kernel `mla_extend` runs and its split count (the decode rules on the
    pseudo-sequences)."""
    c = chunk_tokens(case.heads)
    p = num_pseudo_seqs(case.batch * case.q_len, case.batch, c)
    q_p = jax.ShapeDtypeStruct((p * c, case.heads, D), jnp.bfloat16)
    config = extend_kernel_config(config, case.heads, c, p, case.page_size)
    mgpu = uses_mgpu(config, q_p, case.page_size, c)
    bound = case.kv_len if case.page_size == 1 else -(-case.kv_len // case.page_size) * \
        case.page_size
    return dict(chunk=c, pseudo_seqs=p, kernel="mgpu" if mgpu else "triton",
                num_splits=decode_num_splits(config, p, c * case.heads, bound, mgpu=mgpu))


def _decode_baseline(key, case: ExtendCase, reps: int, config: DecodeKernelConfig) -> dict:
    """The decode kernel on 256 uniform sequences of s_q = C tokens at the extend's mean
    visible context (rounded to 64): device time and TFLOP/s."""
    c = chunk_tokens(case.heads)
    ctx = max(64, int(round((case.prefix + (case.q_len + 1) / 2) / 64)) * 64)
    b = 256
    base = ExtendCase(case.heads, b, c, ctx - c, case.page_size)
    qs, pool, _, meta = make_extend_inputs(key, base, 2)
    mkl = dict(max_kv_len=ctx) if case.page_size == 1 else {}
    fn = lambda q, p, m: mla_decode(q, p, **m, **mkl, sm_scale=SM_SCALE,  # noqa: E731
                                    s_q=c, config=config)
    t = time_calls(fn, [(q, pool, meta) for q in qs], reps)
    profile_timings([t])
    us = t.dev["span_us"] if t.dev else t.wall_s * 1e6
    flops = 2.0 * case.heads * (D + DV) * b * c * ctx  # every row sees the whole context
    return dict(decode_baseline_seqs=b, decode_baseline_s_q=c, decode_baseline_ctx=ctx,
                decode_baseline_us=us, decode_baseline_tflops=flops / us / 1e6)


def bench_extend_case(key, case: ExtendCase, *, reps: int = 3, check: bool = True,
                      baseline: bool = True, torch_path: bool = False,
                      config: DecodeKernelConfig = DecodeKernelConfig()) -> dict:
    """One case (module docstring): device span per call, the decode kernel's time, useful
    TFLOP/s, the relative error against float32, and the decode-kernel baseline; torch_path
    (with check): the same call through the torch extend launcher (`launcher_us`)."""
    n = 4 if case.useful_flops > 1e12 else 16
    qs, pool, qo_indptr, meta = make_extend_inputs(key, case, n)
    mkl = dict(max_kv_len=case.kv_len) if case.page_size == 1 else {}

    def fn(q, p, qo, m):
        return mla_extend(q, p, qo_indptr=qo, **m, **mkl, sm_scale=SM_SCALE, config=config)

    t0 = time.perf_counter()
    t = time_calls(fn, [(q, pool, qo_indptr, meta) for q in qs], reps)
    compile_s = time.perf_counter() - t0
    profile_timings([t])
    dev = t.dev
    us = dev["span_us"] if dev else t.wall_s * 1e6
    row = dict(case=case.label, **dataclasses.asdict(case), **_launch_facts(case, config),
               time_us=us, time_source="device span" if dev else "wall",
               decode_kernel_us=None if dev is None else dev["decode_us"],
               merge_us=None if dev is None else dev["merge_us"],
               kernels_per_call=None if dev is None else dev["kernels_per_call"],
               device=dev, wall_us=t.wall_s * 1e6, calls_per_timing=n,
               compile_and_time_s=compile_s, useful_tflop=case.useful_flops / 1e12,
               tflops=case.useful_flops / us / 1e6)
    if dev and dev["decode_us"]:
        row["kernel_tflops"] = case.useful_flops / dev["decode_us"] / 1e6
    if check:
        kv_indptr, kv_indices = _csr_of(meta, case)
        o, lse = jax.jit(fn)(qs[0], pool, qo_indptr, meta)
        ref_o, ref_l = mla_attention_reference(
            qs[0].astype(jnp.float32), pool.astype(jnp.float32), qo_indptr, kv_indptr,
            kv_indices, sm_scale=SM_SCALE, max_kv_len=case.kv_len, query_chunk=64)
        row["rel_err"] = rel_err(o, ref_o)
        row["lse_max_abs_err"] = float(jnp.max(jnp.abs(lse - ref_l)))
        if torch_path:
            row.update(launcher_us(case, qs[0], pool, qo_indptr, meta, o, reps))
        del o, lse, ref_o, ref_l
    del qs, pool
    if baseline:
        row.update(_decode_baseline(jax.random.fold_in(key, 7), case, reps, config))
        row["vs_decode_baseline"] = row["tflops"] / row["decode_baseline_tflops"]
    return row


def launcher_us(case: ExtendCase, q, pool, qo_indptr, meta, jax_out, reps: int,
                calls: int = 4) -> dict:
    """The call through the torch extend launcher (`funcmla.interop.launcher.extend`, the
    step's layout built once as a serving step does): device time per call (calls queued
    behind a sleep kernel), host time per call, and whether out equals the JAX path's bit for
    bit; {} with no torch CUDA, {"via_torch_error": why} where the launcher cannot run."""
    try:
        import torch

        from funcmla.interop.launcher.extend import ExtendLaunchConfig, extend_launcher
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    from .timing import torch_host_us, torch_queued_us

    t = lambda x: torch.from_dlpack(x)  # noqa: E731
    try:
        ps = case.page_size
        if ps == 1:
            idx = dict(kv_indptr=t(meta["kv_indptr"]), kv_indices=t(meta["kv_indices"]))
            cap, extra = int(meta["kv_indices"].shape[0]), dict(max_kv_len=case.kv_len)
        else:
            pt = meta["page_table"]
            idx = dict(page_table=t(pt.table), lengths=t(pt.lengths))
            cap, extra = int(pt.table.size), {}
        cfg = ExtendLaunchConfig(num_heads=case.heads, q_capacity=int(q.shape[0]),
                                 batch=case.batch, pool_rows=int(pool.shape[0]),
                                 kv_capacity=cap, sm_scale=SM_SCALE, page_size=ps, **extra)
        lau = extend_launcher(cfg)
        tq, tp = t(q), t(pool)
        step = lau.layout(t(qo_indptr), num_q=int(q.shape[0]), **idx)
        out = torch.empty(q.shape[0], case.heads, DV, dtype=torch.bfloat16, device=tq.device)
        lse = torch.empty(q.shape[0], case.heads, dtype=torch.float32, device=tq.device)
        fn = lambda: lau(tq, tp, step, out=out, lse=lse)  # noqa: E731
        us = torch_queued_us(torch, fn, reps * calls, calls)
        host = torch_host_us(torch, fn, reps * calls, calls)
        bitwise = bool(torch.equal(out.view(torch.int16), t(jax_out).view(torch.int16)))
    except Exception as e:  # noqa: BLE001 - reported in the row
        log(f"   via torch: {type(e).__name__}: {str(e)[:200]}")
        return {"via_torch_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"via_torch_us": us, "via_torch_host_us": host, "via_torch_bitwise": bitwise,
            "via_torch_kernel": lau.decode.plan.kernel}


def extend_rows(cases: list[ExtendCase] | None = None, *, reps: int = 3, check: bool = True,
                baseline: bool = True, only: str | None = None, seed: int = 0,
                config: DecodeKernelConfig = DecodeKernelConfig(),
                time_limit_s: float | None = None, torch_path: bool = False) -> list[dict]:
    """Run the extend cases (default: `default_cases()`), each a dict (`bench_extend_case`);
    `only`: a regex on the case label; `time_limit_s`: start no case after that many
    seconds."""
    cases = default_cases() if cases is None else cases
    if only:
        cases = [c for c in cases if re.search(only, c.label)]
    key = jax.random.PRNGKey(seed)
    rows, start = [], time.perf_counter()
    for i, case in enumerate(cases):
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            log(f"time limit: {case.label} and later cases not run")
            break
        row = bench_extend_case(jax.random.fold_in(key, i), case, reps=reps, check=check,
                                baseline=baseline, config=config, torch_path=torch_path)
        log(fmt_row(row))
        rows.append(row)
    return rows


def fmt_row(r: dict) -> str:
    err = "" if r.get("rel_err") is None else f", err {r['rel_err']:.2e}"
    kern = "" if r.get("decode_kernel_us") is None else f" (kernel {r['decode_kernel_us']:.1f})"
    base = ("" if r.get("decode_baseline_tflops") is None else
            f", decode baseline {r['decode_baseline_tflops']:.0f} TFLOP/s")
    return (f"{r['case']}: {r['time_us']:.1f} us{kern}, {r['tflops']:.1f} TFLOP/s, "
            f"{r['kernel']} C={r['chunk']} P={r['pseudo_seqs']} splits={r['num_splits']}"
            f"{err}{base}" + (f"; via torch {r['via_torch_us']:.1f} us (host "
                              f"{r['via_torch_host_us']:.0f} us, bitwise "
                              f"{r['via_torch_bitwise']})" if r.get("via_torch_us") else ""))


def target_verdicts(rows: list[dict]) -> list[tuple[str, str]]:
    """(target, result) pairs for the extend targets judged on `rows`."""
    out = []
    big = {r["page_size"]: r for r in rows
           if (r["heads"], r["batch"], r["q_len"], r["prefix"]) == (128, 8, 1024, 4096)}
    for ps in (1, 64):
        r = big.get(ps)
        out.append((f"H128 B8 1024 over 4k, page {ps}: >= {TARGET_TFLOPS:.0f} TFLOP/s",
                    "not run" if r is None else
                    f"{r['tflops']:.1f}: {'met' if r['tflops'] >= TARGET_TFLOPS else 'missed'}"))
    if 1 in big and 64 in big:
        ratio = big[1]["time_us"] / big[64]["time_us"]
        out.append((f"page 1 within {100 * (TARGET_PAGE_RATIO - 1):.0f}% of page 64",
                    f"ratio {ratio:.3f}: {'met' if ratio <= TARGET_PAGE_RATIO else 'missed'}"))
    errs = [r["rel_err"] for r in rows if r.get("rel_err") is not None]
    if errs:
        worst = max(errs)
        out.append((f"relative error < {TARGET_ERR:g} against float32",
                    f"worst {worst:.2e}: {'met' if worst < TARGET_ERR else 'missed'}"))
    return out


def plot(rows: list[dict], path: str) -> str:
    """Useful TFLOP/s per case (device span, and the decode kernel alone), the decode
    baseline where timed, and the 450 TFLOP/s target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = list(range(len(rows)))
    ax.bar([i - 0.27 for i in x], [r["tflops"] for r in rows], 0.27,
           label="mla_extend, device span")
    ax.bar(x, [r.get("kernel_tflops") or 0.0 for r in rows], 0.27,
           label="its decode kernel alone")
    ax.bar([i + 0.27 for i in x], [r.get("decode_baseline_tflops") or 0.0 for r in rows], 0.27,
           label="decode kernel, uniform sequences (baseline)")
    ax.axhline(TARGET_TFLOPS, color="r", ls="--", label=f"target {TARGET_TFLOPS:.0f} (H128 B8)")
    ax.set_xticks(x)
    ax.set_xticklabels([f"H{r['heads']} B{r['batch']}\n{r['q_len']} / {r['prefix'] // 1024}k"
                        f"\np{r['page_size']} {r['kernel']}" for r in rows], fontsize=7)
    ax.set_ylabel("useful TFLOP/s")
    ax.set_title("absorbed MLA extend (new tokens / prefix), H200")
    ax.set_ylim(0, 700)
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true", help="the two H128 target cases only")
    ap.add_argument("--only", default=None, help="regex on the case label")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the float32 reference")
    ap.add_argument("--no-baseline", action="store_true", help="skip the decode baseline")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--torch", action="store_true",
                    help="also time each case through the torch extend launcher")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="redraw the plot of a saved extend.json into --out (no GPU needed)")
    args = ap.parse_args(argv)
    if args.replot:
        import json

        with open(args.replot) as f:
            rows = json.load(f)["rows"]
        log(f"wrote {plot(rows, f'{args.out}/extend.png')}")
        return rows
    if jax.devices()[0].platform != "gpu":
        log("bench.extend times the compiled kernels: it needs a GPU (JAX CUDA)")
        return []
    rows = extend_rows(default_cases(args.quick), reps=args.reps, check=not args.no_check,
                       baseline=not args.no_baseline, only=args.only,
                       time_limit_s=args.time_limit, torch_path=args.torch)
    verdicts = target_verdicts(rows)
    log("\ntargets:")
    for target, result in verdicts:
        log(f"  {target}: {result}")
    path = write_json(f"{args.out}/extend.json", dict(
        environment=environment(), rows=rows, targets=[list(v) for v in verdicts],
        flops_rule="2 * H * (576 + 512) per query and visible key", sm_scale=SM_SCALE))
    log(f"wrote {path} and {plot(rows, f'{args.out}/extend.png')}")
    return rows


if __name__ == "__main__":
    main()

