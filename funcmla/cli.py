"""The `funcmla` command line: demo, plan, bench.

    funcmla demo  [--page-sizes 1,16,64] [--seed N] [--json]
    funcmla plan  {decode,prefill} --kv-lens 4096,17,0 [--qo-lens ...] [--batch FILE.json]
                  [--device mi300x|mi355x|h200|custom:N[:arch]] [--heads 16] [--plot FILE.png] [--json]
    funcmla bench [metadata|planners|decode|interop|all] [--out DIR] [--quick]

    funcmla --version

Exit status: 0 on success; 2 for a bad argument, with `funcmla: error: ...` naming the argument
and the value or limit (lengths and their sums must fit int32: 2147483647); 141 when the reader
of stdout goes away (`funcmla plan ... --json | head`), quietly, as other Unix tools do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main", "run", "build_parser", "CLIError", "PLAN_COLUMNS"]

INT32_MAX = 2**31 - 1  # funcmla.guards.INT32_MAX, restated to keep `--help` free of JAX imports
EXIT_BROKEN_PIPE = 128 + 13  # the shell's status for a writer killed by SIGPIPE


class CLIError(Exception):
    """A bad argument: printed as `funcmla: error: ...`, exit status 2."""


def _check_ints(values: list, name: str) -> list[int]:
    """Every value an int in [0, INT32_MAX], and their sum too (offsets are int32 cumsums)."""
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise CLIError(f"{name}[{i}] must be an integer, got {v!r}")
        if v < 0:
            raise CLIError(f"{name}[{i}] = {v} must be >= 0")
        if v > INT32_MAX:
            raise CLIError(f"{name}[{i}] = {v} exceeds the int32 limit {INT32_MAX}")
    total = sum(values)
    if total > INT32_MAX:
        raise CLIError(f"sum({name}) = {total} exceeds the int32 limit {INT32_MAX} (offsets "
                       "are int32 cumulative sums); plan a smaller batch")
    return values


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise CLIError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not values:
        raise CLIError(f"{name} must not be empty")
    return _check_ints(values, name)


def _positive(value: int, name: str) -> int:
    if value < 1:
        raise CLIError(f"{name} must be >= 1, got {value}")
    return value


def _page_size(value: int, name: str) -> int:
    from funcmla.layout import check_page_size

    try:
        check_page_size(value, name)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return value


def _device(text: str):
    from funcmla.config import custom_device, get_device_profile

    if text.lower().startswith("custom:"):
        parts = text.split(":")
        try:
            num_cu = int(parts[1])
        except (IndexError, ValueError):
            raise CLIError(f"--device custom:N needs an integer CU count, got {text!r}") from None
        arch = parts[2] if len(parts) > 2 else "gfx942"
        try:
            return custom_device(num_cu, arch=arch)
        except ValueError as e:
            raise CLIError(f"--device {text!r}: {e}") from None
    try:
        return get_device_profile(text)
    except ValueError as e:
        raise CLIError(f"--device: {e}") from None


# ---------------------------------------------------------------------------------------------
# plan


def _load_batch(args) -> tuple[list[int], list[int] | None]:
    if args.batch:
        try:
            with open(args.batch) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CLIError(f"--batch {args.batch!r}: {e}") from None
        if not isinstance(data, dict) or "kv_lens" not in data:
            raise CLIError(f"--batch {args.batch!r} must be a JSON object with 'kv_lens' (and optional 'qo_lens')")
        lists = {k: data[k] for k in ("kv_lens", "qo_lens") if k in data}
        for key, value in lists.items():
            if not isinstance(value, list) or not value:
                raise CLIError(f"--batch {args.batch!r}: {key} must be a non-empty list of "
                               f"integers, got {value!r}")
        kv = _check_ints(lists["kv_lens"], "kv_lens")
        qo = _check_ints(lists["qo_lens"], "qo_lens") if "qo_lens" in lists else None
    elif args.kv_lens:
        kv = _int_list(args.kv_lens, "--kv-lens")
        qo = _int_list(args.qo_lens, "--qo-lens") if args.qo_lens else None
    else:
        raise CLIError("give the batch with --kv-lens 4096,17,... or --batch FILE.json")
    if qo is not None and len(qo) != len(kv):
        raise CLIError(f"--qo-lens has {len(qo)} entries but --kv-lens has {len(kv)}")
    return kv, qo


def build_plan(kind: str, kv_lens, qo_lens, *, device, heads: int, page_size: int,
               kv_granularity: int, max_split_per_batch: int, dtype: str, legacy: bool):
    """Build a decode or prefill WorkPlan for a host-given batch (lengths in tokens)."""
    import numpy as np

    from funcmla.indices import indptr_from_lens, kv_last_page_len

    kv = np.asarray(kv_lens, np.int32)
    if kind == "decode":
        from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode

        qo = np.asarray(qo_lens if qo_lens is not None else [1] * len(kv), np.int32)
        if np.any(qo < 1):
            raise CLIError("decode plans need every --qo-lens >= 1")
        msq = int(qo.max())
        uniform = bool(np.all(qo == qo[0]))
        entries = -(-kv // page_size)
        last = kv_last_page_len(kv, page_size=page_size)
        try:
            cfg = DecodePlanConfig(device=device, num_heads=heads, q_dtype=dtype, kv_dtype=dtype,
                                   max_seqlen_qo=msq, uni_seqlen_qo=int(qo[0]) if uniform else -1,
                                   page_size=page_size, kv_granularity=kv_granularity,
                                   max_split_per_batch=max_split_per_batch)
        except ValueError as e:
            raise CLIError(str(e)) from None
        plan = plan_mla_decode(indptr_from_lens(qo), indptr_from_lens(entries), last, config=cfg)
        return plan, cfg
    from funcmla.planners.prefill import PrefillPlanConfig, plan_ps_prefill

    qo = np.asarray(qo_lens if qo_lens is not None else kv_lens, np.int32)
    if np.any(qo > kv):
        raise CLIError("prefill plans need --qo-lens <= --kv-lens for every request (causal)")
    try:
        if legacy:
            cfg = PrefillPlanConfig.legacy_page_granular(page_size, device=device,
                                                         max_qlen=max(int(qo.max()), 1),
                                                         gqa_ratio=heads)
            kv_entries = -(-kv // page_size)
        else:
            # absorbed MLA: all q heads share the one latent KV head, so gqa_ratio = heads
            cfg = PrefillPlanConfig(device=device, max_qlen=max(int(qo.max()), 1), gqa_ratio=heads)
            kv_entries = kv
    except ValueError as e:
        raise CLIError(str(e)) from None
    plan = plan_ps_prefill(indptr_from_lens(qo), indptr_from_lens(kv_entries), kv, config=cfg)
    return plan, cfg


# work_info columns as the plan table prints them (the JSON keeps AITER's field names)
PLAN_COLUMNS = dict(batch_idx="batch", partial_qo_loc="partial", qo_start="qo_s",
                    qo_end="qo_e", kv_start="kv_s", kv_end="kv_e", kv_offset="kv_off",
                    q_head_range="heads")


def cmd_plan(args) -> int:
    import numpy as np

    from funcmla.plan_plot import plan_summary, plot_work_plan
    from funcmla.planners.plan import WORK_INFO_FIELDS

    kv, qo = _load_batch(args)
    device = _device(args.device)
    _page_size(args.page_size, "--page-size")
    _positive(args.heads, "--heads")
    _positive(args.kv_granularity, "--kv-granularity")
    if args.max_rows < 0:
        raise CLIError(f"--max-rows must be >= 0, got {args.max_rows}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise CLIError(f"--plot {args.plot!r}: the directory "
                       f"{os.path.dirname(os.path.abspath(args.plot))!r} does not exist")
    plan, cfg = build_plan(args.kind, kv, qo, device=device, heads=args.heads,
                           page_size=args.page_size, kv_granularity=args.kv_granularity,
                           max_split_per_batch=args.max_split_per_batch, dtype=args.dtype,
                           legacy=args.legacy)
    summary = plan_summary(plan)
    n = summary["num_works"]
    works = np.asarray(plan.work_info)[:n].tolist()
    if args.plot:
        try:
            plot_work_plan(plan, args.plot, title=args.title)
        except OSError as e:
            raise CLIError(f"--plot {args.plot!r}: {e}") from None
    if args.json:
        out = dict(summary, device=device.name, config=repr(cfg),
                   work_indptr=np.asarray(plan.work_indptr).tolist(),
                   work_info=works,
                   reduce_indptr=np.asarray(plan.reduce_indptr).tolist(),
                   reduce_final_map=np.asarray(plan.reduce_final_map).tolist(),
                   reduce_partial_map=np.asarray(plan.reduce_partial_map)[: summary["num_partials"]].tolist(),
                   plot=args.plot)
        json.dump(out, sys.stdout)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{args.kind} work plan[/bold] on {device.name} ({device.arch}, {device.num_cu} units): "
              f"{n} works on {summary['busy_cus']} units, {summary['num_split_tiles']} split tiles, "
              f"{summary['num_partials']} partials, block_size {plan.block_size}"
              + (" [red](legacy pairing)[/red]" if plan.legacy else ""))
    con.print(f"tokens per unit: max {summary['tokens_per_cu_max']}, mean {summary['tokens_per_cu_mean']:.1f}")
    table = Table(title=f"work_info (first {min(n, args.max_rows)} of {n})")
    table.add_column("cu", justify="right")
    for f in WORK_INFO_FIELDS:
        table.add_column(PLAN_COLUMNS[f], justify="right")
    work_indptr = np.asarray(plan.work_indptr)
    cu_of = np.searchsorted(work_indptr, np.arange(n), side="right") - 1
    for w in range(min(n, args.max_rows)):
        cells = dict(zip(WORK_INFO_FIELDS, works[w]))
        text = {f: str(v) for f, v in cells.items()}
        if plan.kind == "prefill":  # (end << 16) | start, shown as start:end
            v = cells["q_head_range"]
            text["q_head_range"] = f"{v & 0xFFFF}:{v >> 16}"
        table.add_row(str(cu_of[w]), *[text[f] for f in WORK_INFO_FIELDS])
    con.print(table)
    if args.plot:
        con.print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
# bench


BENCHES = ("metadata", "planners", "decode", "prefill", "interop")
GPU_ONLY_BENCHES = ("decode", "prefill")  # time the compiled Pallas kernels


def cmd_bench(args) -> int:
    import importlib

    import jax

    names = BENCHES if args.which == "all" else (args.which,)
    backend = jax.default_backend()
    for name in names:
        if name in GPU_ONLY_BENCHES and backend != "gpu":
            why = f"bench.{name} needs an NVIDIA GPU with JAX CUDA (the JAX backend here is {backend})"
            if args.which != "all":
                raise CLIError(why)
            print(f"== skipped: {why}", flush=True)
            continue
        try:
            mod = importlib.import_module(f"funcmla.bench.{name}")
        except ModuleNotFoundError as e:  # bench.interop needs torch (the `torch` extra)
            raise CLIError(f"benchmark {name!r} cannot run here: {e}") from None
        argv = ["--out", args.out] + (["--quick"] if args.quick else [])
        print(f"== bench.{name} {' '.join(argv)}", flush=True)
        mod.main(argv)
    return 0


# ---------------------------------------------------------------------------------------------
# demo


def cmd_demo(args) -> int:
    from funcmla.demo import run_demo

    page_sizes = tuple(_int_list(args.page_sizes, "--page-sizes"))
    for i, page_size in enumerate(page_sizes):
        _page_size(page_size, f"--page-sizes[{i}]")
    return run_demo(page_sizes=page_sizes, seed=args.seed, as_json=args.json,
                    progress=not args.no_progress)


def build_parser() -> argparse.ArgumentParser:
    from funcmla import __version__

    p = argparse.ArgumentParser(prog="funcmla", description="Paged MLA metadata, checked: demo, plan, bench.")
    p.add_argument("--version", action="version", version=f"funcmla {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the allocator -> metadata -> plan -> attention chain end to end")
    d.add_argument("--page-sizes", default="1,16,64", help="comma-separated page sizes (default 1,16,64)")
    d.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=cmd_demo)

    pl = sub.add_parser("plan", help="build and print a decode or prefill work plan")
    pl.add_argument("kind", choices=("decode", "prefill"))
    pl.add_argument("--kv-lens", help="KV tokens per request, e.g. 4096,17,0")
    pl.add_argument("--qo-lens", help="query tokens per request (decode default 1; prefill default = kv)")
    pl.add_argument("--batch", help="JSON file {\"kv_lens\": [...], \"qo_lens\": [...]}")
    pl.add_argument("--device", default="mi300x", help="mi300x | mi355x | h200 | custom:N[:arch] (default mi300x)")
    pl.add_argument("--heads", type=int, default=16,
                    help="query heads (prefill: its gqa_ratio, one latent KV head; default 16)")
    pl.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="q and kv dtype (decode)")
    pl.add_argument("--page-size", type=int, default=1, help="tokens per kv_indices entry (default 1)")
    pl.add_argument("--kv-granularity", type=int, default=16, help="decode split unit in entries (default 16)")
    pl.add_argument("--max-split-per-batch", type=int, default=-1, help="decode split cap (default none)")
    pl.add_argument("--legacy", action="store_true",
                    help="prefill: the seed's legacy pairing block_size=page_size (reproduces the bug)")
    pl.add_argument("--plot", help="write a PNG of the work per compute unit")
    pl.add_argument("--title", help="plot title")
    pl.add_argument("--max-rows", type=int, default=40, help="work_info rows to print (default 40)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="run the benchmarks in bench/ (JSON and plots under --out)")
    b.add_argument("which", nargs="?", default="all", choices=BENCHES + ("all",))
    b.add_argument("--out", default="out", help="output directory (default out/)")
    b.add_argument("--quick", action="store_true", help="small sizes only")
    b.set_defaults(func=cmd_bench)
    return p


def run(argv=None) -> int:
    """Parse `argv` and run the command; a bad argument raises CLIError (argparse's own errors
    exit with status 2)."""
    args = build_parser().parse_args(argv)
    from funcmla.compile_cache import enable_compilation_cache  # after parsing: --help needs no JAX

    enable_compilation_cache()
    return int(args.func(args) or 0)


def main(argv=None) -> int:
    """The console entry point: `run`, with CLIError as exit status 2 and a closed stdout as a
    quiet exit status 141."""
    try:
        return run(argv)
    except CLIError as e:
        sys.stderr.write(f"funcmla: error: {e}\n")
        return 2
    except BrokenPipeError:
        # the reader went away (`| head`): point stdout at devnull so the interpreter's final
        # flush does not raise again, and exit as a SIGPIPE-killed writer would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
