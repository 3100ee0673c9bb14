"""funcmla: paged MLA metadata as pure, shape-checked JAX functions."""

import os as _os

# The torch shim lives in the top-level folder `interop/` and is installed as `funcmla.interop`
# (pyproject's package-dir). In a plain source checkout (PYTHONPATH=., no install) that mapping
# does not exist, so let `funcmla.interop` resolve to `<checkout>/interop` there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "interop", "__init__.py")) and _checkout not in __path__:
    __path__.append(_checkout)

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
