"""Source-checkout imports of the subpackages that live outside `funcmla/`.

pyproject.toml installs `interop/` as `funcmla.interop` and `bench/` as `funcmla.bench`
(`[tool.setuptools.package-dir]`). A wheel or an editable install carries that mapping; a plain
checkout on `PYTHONPATH` does not. This module reads the mapping from the checkout's own
pyproject.toml and resolves exactly those names, nothing else: it acts only when the folder
above `funcmla/` holds a pyproject.toml whose project is `funcmla`, so an unrelated top-level
`interop` package next to an installed funcmla is never picked up.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__all__ = ["checkout_package_dirs", "install_checkout_packages"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_package_dirs(root: str = _ROOT) -> dict[str, str]:
    """{"funcmla.interop": "<root>/interop", ...} from `root`/pyproject.toml's package-dir, or
    {} when `root` is not a funcmla source checkout (no pyproject.toml, another project)."""
    path = os.path.join(root, "pyproject.toml")
    if not os.path.isfile(path):
        return {}
    import tomllib

    try:
        with open(path, "rb") as f:
            meta = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    if meta.get("project", {}).get("name") != "funcmla":
        return {}
    dirs = meta.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    out = {}
    for name, rel in dirs.items():
        folder = os.path.join(root, rel)
        if name.startswith("funcmla.") and os.path.isfile(os.path.join(folder, "__init__.py")):
            out[name] = folder
    return out


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped subpackages (their submodules then resolve through `__path__`)."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs = dict(dirs)

    def find_spec(self, fullname, path=None, target=None):
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])


def install_checkout_packages(root: str = _ROOT) -> None:
    """Put a finder for the checkout's mapped subpackages first on `sys.meta_path` (once)."""
    dirs = checkout_package_dirs(root)
    if not dirs or any(isinstance(f, _CheckoutFinder) and f.dirs == dirs for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CheckoutFinder(dirs))
