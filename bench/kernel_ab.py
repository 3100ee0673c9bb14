"""A kernel module of the working tree against the same module at a git revision, in one
process: device time per call of decode cases, the two alternating round by round (and which
runs first in a round alternating too), so a change is measured against a baseline of the same
run (same machine state, same clocks).

    python -m bench.kernel_ab --rev 594e5fa --kv-dtype fp8 --out out/
    python -m bench.kernel_ab --rev HEAD~1 --module funcmla.attention.pallas.decode_mgpu \\
        --cases h128_b128_ctx16k_p64,h128_b32_ctx4k_p1

    python -m bench.kernel_ab --base-file base.py --label e75e8f7 --kv-dtype fp8   # no git
    python -m bench.kernel_ab --rev main --module funcmla.attention.pallas.decode_mgpu_fp8_wide \
        --kv-dtype fp8 --fp8-products fp8 --cases h128_b32_ctx4k_p64,h128_b128_ctx16k_p64
    python -m bench.kernel_ab --rev main --module funcmla.attention.pallas.prefill_mgpu \
        --cases prefill_h16_16x1k,prefill_h128_16x1k                         # MHA prefill
    python -m bench.kernel_ab --set _PROMOTE=192 --module \
        funcmla.attention.pallas.decode_mgpu_fp8 --cases h16_b32_ctx4k_p64  # a knob
    python -m bench.kernel_ab --set _STAGES=6 --base-set _STAGES=4 --label s4 \
        --module funcmla.attention.pallas.decode_mgpu_fp8    # two values of a knob

Only the named module comes from REV: its source (`git show REV:path`, or the file given by
`--base-file` where the checkout has no git history, as on a copy of the working tree) is
imported under another name, and what it imports resolves to the working tree. Its public names
(`__all__`) replace the live module's, and those of every funcmla module that imported them by
name, for REV's rounds; a configuration dataclass with the same fields in both stays the live
one (instances made at import, such as default arguments, pass either side's checks). `--set
NAME=VALUE` (repeatable) instead rebinds a module-level constant of the live module (a Python
literal) for the working tree's rounds, against the module as it is (or against REV when given
too): a knob the module's functions read at trace time, with no second copy of the source; a
module that imported the constant by name keeps its own binding. `--base-set NAME=VALUE` rebinds
one for the baseline's rounds the same way (without --rev / --base-file), so two values of a
knob are timed against each other. jax's caches are cleared at every switch (`mla_decode` is
jitted: a cached program would run the other kernel). A decode case runs through `mla_decode`
on a pool of `--kv-dtype` (default: fp8 where the module's name says fp8, else bf16, so that the
case reaches the named module's kernel) with `DecodeKernelConfig(kernel=--kernel)`, timed by
`bench.decode_case.bench_case` (device span per call from a CUPTI trace, decode + merge;
relative error against float32 attention, over the dequantized cache for fp8); a prefill case
(the module `prefill_mgpu`) runs causal requests of equal length through `mha_prefill` with the
config it picks for them (`prefill_kernel_config`), timed and checked as `bench.prefill` does
(device span per call; error against float32 on two heads). Writes out/kernel_ab.json: per
case and variant the time of every round, their median, and the working tree's median over the
baseline's; the file is rewritten after every case, so a run cut short keeps the cases it
finished.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import os
import re
import statistics
import subprocess
import sys
import types

__all__ = ["module_at_revision", "module_from_file", "swapped", "parse_setting",
           "check_settings", "settings_applied", "parse_case", "parse_prefill_case", "main"]

_CASE = re.compile(r"h(\d+)_b(\d+)_ctx(\d+)k_p(\d+)")
_PREFILL_CASE = re.compile(r"prefill_h(\d+)_(\d+)x(\d+)k")
PREFILL_MODULE = "funcmla.attention.pallas.prefill_mgpu"
DEFAULT_CASES = {
    "fp8": "h16_b32_ctx4k_p64,h16_b32_ctx4k_p1,h16_b128_ctx16k_p64,h16_b128_ctx16k_p1",
    "bf16": "h128_b32_ctx4k_p64,h128_b128_ctx16k_p64,h128_b128_ctx16k_p1,h16_b128_ctx16k_p64",
    "prefill": "prefill_h128_1x16k,prefill_h16_16x1k,prefill_h128_16x1k",
}


def parse_prefill_case(name: str) -> tuple[int, int, int]:
    """(heads, requests, tokens a request) of a prefill case name such as prefill_h16_16x1k."""
    m = _PREFILL_CASE.fullmatch(name)
    if m is None:
        raise ValueError(f"case {name!r} is not of the form prefill_h<heads>_<requests>x<k>k, "
                         "e.g. prefill_h16_16x1k")
    h, n, k = (int(x) for x in m.groups())
    return h, n, 1024 * k


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
    """Within the block, `live`'s public names (`base.__all__`) are `base`'s, in `live` and,
    for functions and classes, in every loaded funcmla module that imported them by name;
    jax's caches are cleared on entry and exit, so no program traced with the other module
    runs."""
    import jax

    names = [n for n in getattr(base, "__all__", ()) if hasattr(live, n)]
    if not names:
        raise ValueError(f"{base.__name__} shares no name of its __all__ with {live.__name__}")
    # a configuration dataclass that is the same in both stays live's: instances made before
    # the swap (default arguments such as api's `config=MgpuDecodeConfig()`) must pass the
    # isinstance checks of whichever module runs
    for n in [n for n in names if _same_dataclass(getattr(live, n), getattr(base, n))]:
        setattr(base, n, getattr(live, n))
    # every funcmla module holding one of those functions or classes (`from live import
    # name`) too; constants only in `live` (a small int is the same object everywhere)
    holders = [(live, n) for n in names] + [
        (m, n) for m in list(sys.modules.values()) if m is not live
        and getattr(m, "__name__", "").startswith("funcmla") for n in names
        if callable(getattr(live, n)) and getattr(m, n, None) is getattr(live, n)]
    saved = [(m, n, getattr(m, n)) for m, n in holders]
    jax.clear_caches()
    try:
        for m, n in holders:
            setattr(m, n, getattr(base, n))
        yield names
    finally:
        for m, n, v in saved:
            setattr(m, n, v)
        jax.clear_caches()


def _same_dataclass(a, b) -> bool:
    """Whether `a` and `b` are dataclasses with the same name and the same fields (names,
    annotations, defaults)."""
    if not (dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b)
            and isinstance(a, type) and isinstance(b, type) and a.__name__ == b.__name__):
        return False
    key = lambda c: [(f.name, str(f.type), f.default, f.default_factory)  # noqa: E731
                     for f in dataclasses.fields(c)]
    return key(a) == key(b)


def parse_setting(text: str) -> tuple[str, object]:
    """(name, value) of a --set argument NAME=VALUE, VALUE a Python literal (`576`,
    `(1, 3)`, `'x'`). Raises ValueError naming the argument if it is not of that form."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ValueError(f"--set {text!r}: expected NAME=VALUE, e.g. _PROMOTE=576")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--set {text!r}: VALUE must be a Python literal ({e})") from None


def check_settings(live: types.ModuleType, settings: list[tuple[str, object]]) -> None:
    """ValueError naming each name of `settings` that `live` does not already have (a --set
    rebinds a module constant; it never adds one)."""
    missing = [n for n, _ in settings if not hasattr(live, n)]
    if missing:
        raise ValueError(f"--set: {live.__name__} has no {', '.join(missing)}")


@contextlib.contextmanager
def settings_applied(live: types.ModuleType, settings: list[tuple[str, object]]):
    """Within the block, each (name, value) of `settings` is bound in `live` (`check_settings`
    first, so nothing changes on a bad name); restored on exit, jax's caches cleared on entry
    and exit."""
    import jax

    check_settings(live, settings)
    saved = [(n, getattr(live, n)) for n, _ in settings]
    jax.clear_caches()
    try:
        for n, v in settings:
            setattr(live, n, v)
        yield
    finally:
        for n, v in saved:
            setattr(live, n, v)
        jax.clear_caches()


def decode_runner(args, h: int, b: int, ctx: int, page: int):
    """A decode case through `mla_decode` (`bench_case`, traced afresh each round):
    (variant) -> (us, rel_err, kernel)."""
    import jax

    from funcmla.attention.pallas import DecodeKernelConfig

    from . import decode_case
    from .decode_fp8 import KV_SCALE

    config = DecodeKernelConfig(kernel=args.kernel, fp8_products=args.fp8_products)
    kv_scale = KV_SCALE if args.kv_dtype == "fp8" else None

    def run(variant: str):
        del variant  # the live module's names decide
        r = decode_case.bench_case(jax.random.key(1), h, b, ctx, page, float("inf"), args.reps,
                                   config, baseline=False, kv_scale=kv_scale)
        return r["time_us"], r["rel_err"], f"{r['kernel']} ns={r['num_splits']}"
    return run


def prefill_runner(args, h: int, n: int, length: int):
    """A causal MHA prefill case of n requests of `length` tokens through `mha_prefill` (the
    config it picks for them, `prefill_kernel_config`; inputs and the float32 reference on two
    heads made once): (variant) -> (us, rel_err, config name). Each variant is compiled once, at
    its first round (under its module), and its executable timed in every round."""
    import jax

    from funcmla.attention.pallas import prefill

    from . import prefill as bp

    lens = [length] * n
    q, k, v, qo, kv = bp.make_inputs(jax.random.PRNGKey(0), h, lens, lens)
    idx, ref = bp.head_subset_reference(q, k, v, qo, kv, True)

    compiled = {}

    def run(variant: str):
        if variant not in compiled:
            # the config class of the module in use (REV's while swapped: `prefill` checks it),
            # with the tiles `prefill_kernel_config` picks for these lengths
            picked = prefill.prefill_kernel_config(length)
            config = prefill.MgpuPrefillConfig(block_kv=picked.block_kv,
                                               num_stages=picked.num_stages)
            f = jax.jit(lambda q_, k_, v_: prefill.mha_prefill(
                q_, k_, v_, qo, kv, sm_scale=bp.SM_SCALE, causal=True, config=config)
                        ).lower(q, k, v).compile()
            compiled[variant] = (f, bp.rel_err(f(q, k, v)[0][:, idx], ref), bp.cfg_name(config))
        f, err, name = compiled[variant]
        return bp.device_us(lambda: jax.block_until_ready(f(q, k, v)), args.reps), err, name
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--rev", help="git revision of the baseline module")
    src.add_argument("--base-file", help="a file holding the baseline module's source")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a module constant rebound for the working tree's rounds (repeatable); "
                         "without --rev / --base-file the baseline is the module as it is")
    ap.add_argument("--base-set", action="append", default=[], metavar="NAME=VALUE",
                    help="a module constant rebound for the baseline's rounds (repeatable; "
                         "not with --rev / --base-file)")
    ap.add_argument("--label", default=None,
                    help="the baseline's name in the report (default: --rev or the file)")
    ap.add_argument("--module", default="funcmla.attention.pallas.decode_mgpu_fp8")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default=None,
                    help="the pool's dtype (default: fp8 for a module whose name says fp8, "
                         "else bf16, so a case runs the named module's kernel)")
    ap.add_argument("--kernel", choices=("auto", "mgpu", "triton"), default="mgpu")
    ap.add_argument("--fp8-products", choices=("mixed", "fp8"), default="mixed",
                    help="DecodeKernelConfig.fp8_products of the fp8 decode cases")
    ap.add_argument("--cases", default=None,
                    help="comma-separated h<H>_b<B>_ctx<k>k_p<page> (decode modules) or "
                         "prefill_h<H>_<requests>x<k>k (the prefill kernel's module)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (tree, REV) per case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out/")
    args = ap.parse_args(argv)
    if not (args.rev or args.base_file or args.set or args.base_set):
        ap.error("one of --rev, --base-file, --set or --base-set is required")
    if args.base_set and (args.rev or args.base_file):
        ap.error("--base-set rebinds the live module's constants: not with --rev / --base-file")
    if args.kv_dtype is None:
        args.kv_dtype = "fp8" if "fp8" in args.module.rsplit(".", 1)[-1] else "bf16"
    settings = [parse_setting(t) for t in args.set]
    base_settings = [parse_setting(t) for t in args.base_set]
    is_prefill = args.module == PREFILL_MODULE
    names = (args.cases or DEFAULT_CASES["prefill" if is_prefill else args.kv_dtype]).split(",")
    if is_prefill:
        cases = [(n, dict(zip(("heads", "requests", "tokens"), parse_prefill_case(n))))
                 for n in names]
    else:
        cases = [(n, dict(zip(("heads", "batch", "ctx", "page_size"), parse_case(n))))
                 for n in names]

    from .report import log
    from .timing import environment, print_table, write_json

    live = importlib.import_module(args.module)
    label = (args.label or args.rev or args.base_file
             or (f"with {', '.join(args.base_set)}" if args.base_set else "as is"))
    base = (module_at_revision(args.module, args.rev) if args.rev
            else module_from_file(args.module, args.base_file, label) if args.base_file
            else None)
    check_settings(live, settings + base_settings)  # before any case runs
    rows, table = [], []
    path = os.path.join(args.out, "kernel_ab.json")
    info = dict(environment(), module=args.module, rev=label, kv_dtype=args.kv_dtype,
                set=args.set, base_set=args.base_set, kernel=args.kernel,
                fp8_products=args.fp8_products, rounds=args.rounds, reps=args.reps)
    for name, fields in cases:
        run = (prefill_runner(args, *fields.values()) if is_prefill
               else decode_runner(args, *fields.values()))
        times = {"tree": [], "rev": []}
        errs, kernels = {}, {}
        for r in range(args.rounds):
            # which variant runs first alternates too: an effect of the position in a round
            # (allocations, clocks) falls on both
            for variant in (("tree", "rev") if r % 2 == 0 else ("rev", "tree")):
                ctxm = (settings_applied(live, settings) if variant == "tree"
                        else swapped(live, base) if base is not None
                        else settings_applied(live, base_settings))
                with ctxm:
                    t, err, kernel = run(variant)
                times[variant].append(t)
                errs[variant], kernels[variant] = err, kernel
                log(f"{name} {variant}: {t:.1f} us, err {err:.1e} [{kernel}]")
        med = {v: statistics.median(ts) for v, ts in times.items()}
        rows.append(dict(case=name, **fields, times_us=times, median_us=med,
                         ratio=med["tree"] / med["rev"], rel_err=errs, kernel=kernels))
        table.append([name, kernels["tree"], med["rev"], med["tree"], med["tree"] / med["rev"],
                      errs["tree"]])
        # written after every case: a run cut short (a time limit) keeps the cases it finished
        write_json(path, dict(info=info, cases=rows))
    tree = "working tree" + (f" with {', '.join(args.set)}" if args.set else "")
    print_table(f"{args.module}: {tree} vs {label} (device us per call, medians)",
                ["case", "kernel", label, "tree", "tree / rev", "tree err"], table)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
