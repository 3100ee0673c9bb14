"""Shared test configuration: hypothesis profiles sized for a 2-core CPU; tests marked `gpu`
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

