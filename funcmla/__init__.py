"""funcmla: paged MLA metadata as pure, shape-checked JAX functions.

The chain is allocator -> metadata -> work plan -> attention (`funcmla.allocator`,
`funcmla.metadata`, `funcmla.planners`, `funcmla.attention`); `funcmla.interop` is the torch
shim (needs the `torch` extra) and `funcmla.bench` the benchmarks. docs/quickstart.md shows the
chain inside one `jax.jit`.
"""

from funcmla._checkout import install_checkout_packages as _install_checkout_packages

# From a source checkout (PYTHONPATH=., no install), map the subpackages that pyproject.toml
# installs from other folders (`funcmla.interop` <- interop/, `funcmla.bench` <- bench/).
_install_checkout_packages()

from funcmla.config import (  # noqa: E402,F401
    DEVICE_PROFILES,
    H200,
    MI300X,
    MI355X,
    DeviceProfile,
    MLADims,
    custom_device,
    deepseek_v3,
    get_device_profile,
)
from funcmla.layout import PageTable, PoolSpec, TokenCSR  # noqa: E402,F401

__version__ = "0.1.0"  # the one home of the version (pyproject reads it)
