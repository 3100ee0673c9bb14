"""A kernel module of the working tree against the same module at a git revision, in one
process: device time per call of decode cases, the two alternating round by round, so a
change is measured against a baseline of the same run (same machine state, same clocks).

    python -m bench.kernel_ab --rev 594e5fa --kv-dtype fp8 --out out/
    python -m bench.kernel_ab --rev HEAD~1 --module funcmla.attention.pallas.decode_mgpu \\
        --cases h128_b128_ctx16k_p64,h128_b32_ctx4k_p1

    python -m bench.kernel_ab --base-file base.py --label e75e8f7 --kv-dtype fp8   # no git

Only the named module comes from REV: its source (`git show REV:path`, or the file given by
`--base-file` where the checkout has no git history, as on a copy of the working tree) is
imported under
another name, and what it imports resolves to the working tree. Its public names (`__all__`)
replace the live module's for REV's rounds, so callers must reach them through the module, as
`funcmla.attention.pallas.api` calls `decode_mgpu.decode_call` and `decode_mgpu_fp8
.decode_call`. jax's caches are cleared at every switch (`mla_decode` is jitted: a cached
program would run the other kernel). Each case runs through `mla_decode` with
`DecodeKernelConfig(kernel=--kernel)`, timed by `bench.decode_case.bench_case` (device span per
call from a CUPTI trace, decode + merge; relative error against float32 attention, over the
dequantized cache for fp8). Writes out/kernel_ab.json: per case and variant the time of every
round, their median, and the working tree's median over REV's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import statistics
import subprocess
import sys
import types

__all__ = ["module_at_revision", "module_from_file", "swapped", "parse_case", "main"]

_CASE = re.compile(r"h(\d+)_b(\d+)_ctx(\d+)k_p(\d+)")
DEFAULT_CASES = {
    "fp8": "h16_b32_ctx4k_p64,h16_b32_ctx4k_p1,h16_b128_ctx16k_p64,h16_b128_ctx16k_p1",
    "bf16": "h128_b32_ctx4k_p64,h128_b128_ctx16k_p64,h128_b128_ctx16k_p1,h16_b128_ctx16k_p64",
}


def parse_case(name: str) -> tuple[int, int, int, int]:
    """(heads, batch, ctx, page_size) of a case name such as h16_b32_ctx4k_p64."""
    m = _CASE.fullmatch(name)
    if m is None:
        raise ValueError(f"case {name!r} is not of the form h<heads>_b<batch>_ctx<k>k_p<page>, "
                         "e.g. h16_b32_ctx4k_p64")
    h, b, k, p = (int(x) for x in m.groups())
    return h, b, 1024 * k, p


def module_at_revision(module: str, rev: str, repo: str | None = None) -> types.ModuleType:
    """The source of `module` (a dotted name of the working tree) at git revision `rev`,
    imported as a separate module. Raises ValueError if git cannot show it."""
    live = importlib.import_module(module)
    path = os.path.realpath(live.__file__)
    repo = repo or subprocess.run(["git", "rev-parse", "--show-toplevel"],
                                  cwd=os.path.dirname(path), capture_output=True,
                                  text=True).stdout.strip()
    if not repo:
        raise ValueError(f"{path} is not in a git checkout")
    rel = os.path.relpath(path, repo)
    shown = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=repo, capture_output=True,
                           text=True)
    if shown.returncode:
        raise ValueError(f"git show {rev}:{rel}: {shown.stderr.strip()}")
    return _load(module, shown.stdout, rev, f"{rev}:{rel}")


def module_from_file(module: str, path: str, label: str) -> types.ModuleType:
    """The source in file `path`, standing for `module` at the revision called `label`,
    imported as a separate module. Raises ValueError if the file cannot be read."""
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ValueError(f"--base-file {path}: {e.strerror}") from e
    return _load(module, source, label, f"{label}:{path}")


def _load(module: str, source: str, label: str, file: str) -> types.ModuleType:
    name = f"{module}__at_{re.sub(r'[^0-9A-Za-z_]', '_', label)}"
    base = types.ModuleType(name)
    base.__file__ = file
    sys.modules[name] = base  # dataclasses resolve annotations through sys.modules
    exec(compile(source, file, "exec"), base.__dict__)
    return base


@contextlib.contextmanager
def swapped(live: types.ModuleType, base: types.ModuleType):
    """Within the block, `live`'s public names (`base.__all__`) are `base`'s; jax's caches are
    cleared on entry and exit, so no program traced with the other module runs."""
    import jax

    names = [n for n in getattr(base, "__all__", ()) if hasattr(live, n)]
    if not names:
        raise ValueError(f"{base.__name__} shares no name of its __all__ with {live.__name__}")
    saved = {n: getattr(live, n) for n in names}
    jax.clear_caches()
    try:
        for n in names:
            setattr(live, n, getattr(base, n))
        yield names
    finally:
        for n, v in saved.items():
            setattr(live, n, v)
        jax.clear_caches()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rev", help="git revision of the baseline module")
    src.add_argument("--base-file", help="a file holding the baseline module's source")
    ap.add_argument("--label", default=None,
                    help="the baseline's name in the report (default: --rev or the file)")
    ap.add_argument("--module", default="funcmla.attention.pallas.decode_mgpu_fp8")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8")
    ap.add_argument("--kernel", choices=("auto", "mgpu", "triton"), default="mgpu")
    ap.add_argument("--cases", default=None, help="comma-separated h<H>_b<B>_ctx<k>k_p<page>")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (tree, REV) per case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/")
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in (args.cases or DEFAULT_CASES[args.kv_dtype]).split(",")]

    import jax

    from funcmla.attention.pallas import DecodeKernelConfig

    from .decode_case import bench_case
    from .decode_fp8 import KV_SCALE
    from .report import log
    from .timing import environment, print_table, write_json

    live = importlib.import_module(args.module)
    label = args.label or args.rev or args.base_file
    base = (module_at_revision(args.module, args.rev) if args.rev
            else module_from_file(args.module, args.base_file, label))
    config = DecodeKernelConfig(kernel=args.kernel)
    kv_scale = KV_SCALE if args.kv_dtype == "fp8" else None
    rows, table = [], []

    def run(h, b, ctx, page):
        r = bench_case(jax.random.key(1), h, b, ctx, page, float("inf"), args.reps, config,
                       baseline=False, kv_scale=kv_scale)
        return r["time_us"], r["rel_err"], r["kernel"], r["num_splits"]

    for h, b, ctx, page in cases:
        name = f"h{h}_b{b}_ctx{ctx // 1024}k_p{page}"
        times = {"tree": [], "rev": []}
        errs, kernels = {}, {}
        for _ in range(args.rounds):
            for variant in ("tree", "rev"):
                ctxm = swapped(live, base) if variant == "rev" else contextlib.nullcontext()
                with ctxm:
                    t, err, kernel, splits = run(h, b, ctx, page)
                times[variant].append(t)
                errs[variant], kernels[variant] = err, f"{kernel} ns={splits}"
                log(f"{name} {variant}: {t:.1f} us, err {err:.1e} [{kernels[variant]}]")
        med = {v: statistics.median(ts) for v, ts in times.items()}
        rows.append(dict(case=name, heads=h, batch=b, ctx=ctx, page_size=page, times_us=times,
                         median_us=med, ratio=med["tree"] / med["rev"], rel_err=errs,
                         kernel=kernels))
        table.append([name, kernels["tree"], med["rev"], med["tree"], med["tree"] / med["rev"],
                      errs["tree"]])
    print_table(f"{args.module}: working tree vs {label} (device us per call, medians)",
                ["case", "kernel", label, "tree", "tree / rev", "tree err"], table)
    path = write_json(os.path.join(args.out, "kernel_ab.json"), dict(
        info=dict(environment(), module=args.module, rev=label, kv_dtype=args.kv_dtype,
                  kernel=args.kernel, rounds=args.rounds, reps=args.reps, kv_scale=kv_scale),
        cases=rows))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
