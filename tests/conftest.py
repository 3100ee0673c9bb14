"""Shared test configuration: hypothesis profiles sized for a 2-core CPU, XLA:CPU code
generation flags that compile the suite's programs faster, a persistent XLA compilation cache
shared by the pytest workers and the CLI subprocesses, and the `gpu` marker's skip where JAX
has no GPU."""

import os
import platform

import jax
import jaxlib.version
import pytest
from hypothesis import HealthCheck, settings

from funcmla.attention.pallas.mgpu_ops import WARPGROUPS, xla_cpu_threads

# 4 CPU devices: the tensor- and data-parallel tests build meshes of up to 4.
jax.config.update("jax_num_cpu_devices", 4)

# Mosaic GPU's interpreter needs an XLA:CPU worker thread for each of a kernel's warpgroups
# (`mgpu_ops.interpreter_unsupported`: with fewer it can hang, and the kernels refuse to run);
# XLA sizes its pool from PJRT_NPROC, else the CPUs, once, when the CPU backend starts. So a
# 2-core machine asks for 3; a larger count already in place is kept.
if xla_cpu_threads() < WARPGROUPS:
    os.environ["PJRT_NPROC"] = str(WARPGROUPS)

# XLA:CPU code generation flags for the suite (see _cpu_codegen_flags); an XLA flag that a
# jaxlib does not know aborts the process, so they are set only on the jaxlib they were
# checked on.
CPU_CODEGEN_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_max_isa=AVX")
CPU_CODEGEN_JAXLIB = ("0.10.2",)


def _cpu_codegen_flags() -> None:
    """XLA:CPU backend compiles are about half of the suite's CPU time (Pallas interpret-mode
    kernels, planners, checkify checks; each program is compiled once). XLA's elemental IR
    emitters (`xla_cpu_use_fusion_emitters=false`) compile them in about a third of the time
    of the default MLIR fusion emitters (a decode-kernel program: 0.31 s against 0.85-0.94 s;
    a cold `./dev test` on 2 cores: 416 s of CPU time instead of 600). The elemental emitters
    contract a*b+c into a fused multiply-add where the ISA has one, so the ISA is capped at
    AVX, which has none: every multiply and add rounds on its own (with FMAs,
    test_pallas_merge.py::test_bfloat16_partials_combine_in_float32 finds the bf16 and
    float32 merges an ulp apart; it passes with the default emitters and with these flags).
    The `slow` tests pass with them too. The elemental emitters round a tiny negative float32
    to float8_e4m3fnuz's NaN (0x80) rather than to 0, so tests build fp8 data with NumPy
    (ml_dtypes) casts, not jnp ones. x86-64 and CPU_CODEGEN_JAXLIB only; a flag already in
    XLA_FLAGS is left as it is (the xdist workers inherit the controller's); set
    FUNCMLA_TEST_CPU_CODEGEN=default to keep XLA's defaults. Only XLA:CPU reads these flags:
    on a GPU the kernels compile as users get them."""
    if os.environ.get("FUNCMLA_TEST_CPU_CODEGEN") == "default":
        return
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    if jaxlib.version.__version__ not in CPU_CODEGEN_JAXLIB:
        return
    current = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_CODEGEN_FLAGS if f.split("=")[0] not in current]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


_cpu_codegen_flags()  # before the first use of a backend, which reads XLA_FLAGS once


settings.register_profile(
    "ci",
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _skip_xla_optimizations() -> None:
    """On CPU, where the suite's programs are tiny and compiled once, XLA's optimization passes
    cost more than they save: `jax_disable_most_optimizations` (backend optimization level 0, no
    expensive LLVM passes) cuts the fast suite's CPU time by about a quarter. Semantics are
    unchanged, and tests that compare two paths bit for bit compile both the same way. On a GPU
    the kernels are compiled as users get them."""
    if jax.default_backend() != "cpu":
        return
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # for the subprocesses
    _optimize_programs_that_run_long()
    # Each op's MLIR location names its innermost user frame instead of the whole Python
    # traceback: lowering (a quarter of the suite's CPU time; Pallas interpret-mode kernels
    # lower to large modules) takes ~15% less. Locations are debug information in the IR;
    # the compiled programs are the same.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    os.environ["JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS"] = "0"


# Programs (by module name) that the suite runs far longer than it compiles them, which keep
# XLA's default optimizations: the float32 MLA reference, the oracle of the executor and
# reference tests and of many kernel tests (a cold run: ~40 compiles, ~130 calls; at
# optimization level 0 a call runs 4-6x longer, 28 s of execution in all, against 7 s of
# compiles at level 0 and 12 s optimized); jax.random.normal, which draws the tests' pools
# (2048 x 576 draws: 0.26 s a call at level 0, 0.04 s optimized); and the extend kernel in
# interpret mode, whose page-size-1 gather runs 2.8 s at level 0 and 0.5 s optimized, for
# the same compile time. They give the same bits at either level (no fast-math, no FMA under
# CPU_CODEGEN_FLAGS). Not here: the MHA reference and the decode kernels, which run about once
# per compile (optimized, their files took longer).
OPTIMIZED_PROGRAMS = ("jit__reference", "jit__normal", "jit__mla_extend")
OPTIMIZED_JAXLIB = ("0.10.2",)  # where compile_or_get_cached's signature was checked


def _optimize_programs_that_run_long() -> None:
    """Compile OPTIMIZED_PROGRAMS with XLA's default optimization level (what users get) while
    `jax_disable_most_optimizations` holds for every other program. JAX reads that setting
    once per compile, into the compile options, which are part of the persistent cache key;
    this hook sets the two fields back to their defaults for the named modules before JAX
    computes the key. Off on other jaxlibs (then every program compiles at level 0)."""
    if jaxlib.version.__version__ not in OPTIMIZED_JAXLIB:
        return
    from jax._src import compiler
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    compile_or_get_cached = compiler.compile_or_get_cached
    if getattr(compile_or_get_cached, "optimizes", None) is not None:
        return  # installed already
    options = xla_client.CompileOptions()  # XLA's defaults (read while `options` lives)
    level = options.executable_build_options.debug_options.xla_backend_optimization_level
    no_expensive = options.executable_build_options.debug_options.xla_llvm_disable_expensive_passes

    def compile_optimizing_some(backend, computation, devices, compile_options, *args, **kwargs):
        name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
        if name in OPTIMIZED_PROGRAMS:
            debug = compile_options.executable_build_options.debug_options
            debug.xla_backend_optimization_level = level
            debug.xla_llvm_disable_expensive_passes = no_expensive
        return compile_or_get_cached(backend, computation, devices, compile_options, *args,
                                     **kwargs)

    compile_optimizing_some.optimizes = OPTIMIZED_PROGRAMS
    compiler.compile_or_get_cached = compile_optimizing_some


def pytest_configure(config):
    """XLA compiles dominate the suite's CPU time, and the xdist workers and the `funcmla`
    subprocesses compile many of the same programs: share them through JAX's persistent cache
    in pytest's cache folder (`.pytest_cache/d/jax-compilation-cache`; `--cache-clear` empties
    it). Keys cover the program, the compile options and the jax version, and JAX never caches
    executables with host callbacks (Pallas interpret mode), so results are unchanged.
    FUNCMLA_TEST_JAX_CACHE=0 turns it off, and then also funcmla's own default cache
    (`~/.cache/funcmla/jax`, which the demo and CLI entry points turn on): a cold run stays cold
    and the suite never writes into the user's home."""
    _skip_xla_optimizations()
    cache = getattr(config, "cache", None)  # None under `-p no:cacheprovider`
    if os.environ.get("FUNCMLA_TEST_JAX_CACHE", "1") == "0" or cache is None:
        os.environ["FUNCMLA_COMPILATION_CACHE"] = "off"  # in-process and for the subprocesses
        return
    settings_ = {
        "jax_compilation_cache_dir": str(cache.mkdir("jax-compilation-cache")),
        "jax_persistent_cache_min_compile_time_secs": 0,  # the suite's programs compile in < 1 s
        "jax_persistent_cache_min_entry_size_bytes": 0,
        # a size limit turns on JAX's file lock, so concurrent workers never read a half-written entry
        "jax_compilation_cache_max_size": 2 * 1024**3,
    }
    for name, value in settings_.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # for the subprocesses (`python -m funcmla ...`)
    _evict_once_not_per_write(settings_["jax_compilation_cache_dir"],
                              settings_["jax_compilation_cache_max_size"])


def _evict_once_not_per_write(directory: str, max_size: int) -> None:
    """JAX's size-limited file cache rescans its whole folder on every write (a stat and an
    access-time read per entry) to choose what to evict, holding the file lock that the other
    worker's reads and writes wait on: quadratic in the entries, and a cold run writes about
    1200 (at 1200 entries one scan costs 50-70 ms of CPU; about 40 s over a run). Here the
    pytest process that starts the run (xdist's controller, or the only process) evicts once,
    and every process's writes skip the scan; the lock stays, so no reader sees a half-written
    entry. The folder stays under the limit from one run to the next (a run adds about 25 MB);
    the `funcmla` subprocesses keep JAX's own cache. Where JAX's cache module is not laid out
    as this expects, JAX's own cache runs in the workers too."""
    from jax._src import compilation_cache, lru_cache

    base = getattr(lru_cache, "LRUCache", None)
    if base is None or getattr(compilation_cache, "LRUCache", None) is not base:
        return
    if not all(hasattr(base, name) for name in ("_evict_if_needed", "get", "put")):
        return
    cache = base(directory, max_size=max_size)
    if not getattr(cache, "eviction_enabled", False):
        return
    if "PYTEST_XDIST_WORKER" not in os.environ:
        try:
            cache.lock.acquire(timeout=cache.lock_timeout_secs)
        except TimeoutError:  # filelock.Timeout: another run holds the lock; evict next time
            pass
        else:
            try:
                cache._evict_if_needed()
            finally:
                cache.lock.release()

    class EvictedAtStart(base):
        def _evict_if_needed(self, *, additional_size: int = 0) -> None:
            del additional_size  # evicted once per run, in pytest_configure

    compilation_cache.LRUCache = EvictedAtStart


def _jax_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """The `gpu` marker (pyproject.toml) skips its tests where JAX's default device is not a
    GPU; tests that also need torch CUDA or the launcher's toolchain add their own skipif."""
    if _jax_gpu():
        return
    skip = pytest.mark.skip(reason="marked gpu: JAX has no GPU here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def setmaxnreg_calls(monkeypatch) -> list[tuple[str, int]]:
    """The ("increase" | "decrease", registers) of every `plgpu.set_max_registers` a Mosaic GPU
    kernel calls while it is traced (lowering for CUDA traces it on any host)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    calls, real = [], plgpu.set_max_registers

    def record(n, *, action):
        calls.append((action, n))
        return real(n, action=action)

    monkeypatch.setattr(plgpu, "set_max_registers", record)
    return calls
