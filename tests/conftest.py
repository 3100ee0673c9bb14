"""Shared test configuration: hypothesis profiles sized for a 2-core CPU, a persistent XLA
compilation cache shared by the pytest workers and the CLI subprocesses, and the `gpu` marker's
skip where JAX has no GPU."""

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Mosaic GPU's interpreter runs each warpgroup of a block as a thread whose barrier waits block
# an XLA CPU worker; on a 2-core machine (2 workers) a 3-warpgroup kernel can starve (two
# warpgroups waiting on the third, which gets no worker). More CPU devices, more workers.
jax.config.update("jax_num_cpu_devices", 4)


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

