"""Device time per call of decode cases at several KV split counts, the split rule's own choice
among them, in one process: rounds alternate the order of the counts, medians per count. It
checks the split rule (`decode_common.choose_num_splits`) where the Mosaic GPU kernels run,
which the Triton sweep (`bench.decode_sweep`) does not cover.

    python -m bench.split_count --cases h16_b32_ctx4k_p64,h16_b32_ctx4k_p1 --kv-dtype fp8 \\
        --splits 3,4,8 --out out/
    python -m bench.split_count --cases h128_b32_ctx4k_p64,h128_b32_ctx16k_p64 --splits 2,4

Each case runs through `mla_decode` (`DecodeKernelConfig(kernel=--kernel)`) with
`num_splits` forced, timed by `bench.decode_case.bench_case` (device span per call, decode +
merge; relative error against float32 attention). Writes out/split_count.json (rewritten after
every case): per case and count the time of every round, the decode and merge kernels' medians,
the error, and the rule's count.
"""

from __future__ import annotations

import argparse
import os
import statistics

from .kernel_ab import parse_case

__all__ = ["parse_splits", "counts_to_time", "main"]


def parse_splits(text: str) -> list[int]:
    """Split counts from "2,4,8": positive ints, each once, in the given order."""
    counts = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            n = 0
        if n <= 0:
            raise ValueError(f"--splits {text!r}: {part!r} is not a positive int")
        if n not in counts:
            counts.append(n)
    return counts


def counts_to_time(rule: int, requested: list[int]) -> list[int]:
    """The rule's count first, then the requested others: every sweep times what the rule
    picks."""
    return [rule] + [n for n in requested if n != rule]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="h<heads>_b<batch>_ctx<k>k_p<page>, ...")
    ap.add_argument("--splits", required=True, help="split counts to time beside the rule's")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--kernel", choices=("auto", "mgpu", "triton"), default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/")
    args = ap.parse_args(argv)
    requested = parse_splits(args.splits)
    cases = [(n, parse_case(n)) for n in args.cases.split(",")]

    import jax

    from funcmla.attention.pallas import DecodeKernelConfig

    from . import decode_case
    from .decode_fp8 import KV_SCALE
    from .report import log
    from .timing import environment, print_table, write_json

    config = DecodeKernelConfig(kernel=args.kernel)
    kv_scale = KV_SCALE if args.kv_dtype == "fp8" else None
    path = os.path.join(args.out, "split_count.json")
    info = dict(environment(), kv_dtype=args.kv_dtype, kernel=args.kernel, rounds=args.rounds,
                reps=args.reps, kv_scale=kv_scale)
    rows, table = [], []
    for name, (h, b, ctx, page) in cases:
        def run(splits: int):
            return decode_case.bench_case(jax.random.key(1), h, b, ctx, page, float("inf"),
                                          args.reps, config, num_splits=splits,
                                          baseline=False, kv_scale=kv_scale)

        rule = decode_case.case_dispatch(h, b, ctx, page, config, fp8=kv_scale is not None)[2]
        counts = counts_to_time(rule, requested)
        runs = {n: [] for n in counts}
        for r in range(args.rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                res = run(n)
                runs[n].append(res)
                log(f"{name} splits={n}: {res['time_us']:.1f} us (decode {res['decode_us']}, "
                    f"merge {res['merge_us']}) [{res['kernel']}]")
        per = {}
        for n, rs in runs.items():
            med = lambda k: statistics.median(x[k] for x in rs if x[k] is not None)  # noqa: E731
            per[str(n)] = dict(times_us=[x["time_us"] for x in rs], median_us=med("time_us"),
                               decode_us=med("decode_us"),
                               merge_us=(med("merge_us") if n > 1 else None),
                               rel_err=rs[-1]["rel_err"], kernel=rs[-1]["kernel"])
        rows.append(dict(case=name, heads=h, batch=b, ctx=ctx, page_size=page, rule=rule,
                         splits=per))
        base = per[str(rule)]["median_us"]
        for n in counts:
            table.append([name, per[str(n)]["kernel"], n, "rule" if n == rule else "",
                          per[str(n)]["median_us"], per[str(n)]["median_us"] / base])
        write_json(path, dict(info=info, cases=rows))
    print_table("device us per call by split count (medians)",
                ["case", "kernel", "splits", "", "us", "/ rule's"], table)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
