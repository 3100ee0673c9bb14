"""funcmla: paged MLA metadata as pure, shape-checked JAX functions."""

from funcmla.config import (  # noqa: F401
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
from funcmla.layout import PageTable, PoolSpec, TokenCSR  # noqa: F401

__version__ = "0.1.0"
