"""Shared test configuration: hypothesis profiles sized for a 2-core CPU."""

import os

import jax
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

