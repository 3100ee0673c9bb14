"""Packaging: the subpackages mapped from other folders, the torch extra's error, the metadata."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

import funcmla
from funcmla._checkout import checkout_package_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_checkout_maps_exactly_the_package_dir_table():
    table = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert checkout_package_dirs(ROOT) == {k: os.path.join(ROOT, v) for k, v in table.items()}
    assert set(table) == {"funcmla.interop", "funcmla.bench"}


@pytest.mark.parametrize("pyproject", [None, '[project]\nname = "someone-else"\n', "not toml ["])
def test_no_mapping_outside_a_funcmla_checkout(tmp_path, pyproject):
    """A folder with a top-level `interop` package (site-packages, another project) is not
    mapped: only a pyproject.toml naming the funcmla project turns the mapping on."""
    (tmp_path / "interop").mkdir()
    (tmp_path / "interop" / "__init__.py").write_text("")
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(pyproject)
    assert checkout_package_dirs(str(tmp_path)) == {}


def test_a_foreign_top_level_interop_is_never_funcmla_interop(tmp_path):
    """funcmla installed next to an unrelated `interop` package and an unrelated `rich`-like
    package (the layout of site-packages): neither becomes a funcmla submodule."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(ROOT, "funcmla"), site / "funcmla",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("interop", "foreignpkg"):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"FOREIGN = {name!r}\n")
    code = ("import importlib.util, sys\n"
            "import funcmla\n"
            "assert funcmla.__file__.startswith(sys.argv[1]), funcmla.__file__\n"
            "assert importlib.util.find_spec('funcmla.foreignpkg') is None\n"
            "spec = importlib.util.find_spec('funcmla.interop')\n"
            "assert spec is None or not spec.origin.startswith(sys.argv[1]), spec.origin\n"
            "print('clean')\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-c", code, str(site)], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr[-2000:]


def test_bench_imports_as_funcmla_bench_and_as_bench():
    fb = importlib.import_module("funcmla.bench.timing")
    b = importlib.import_module("bench.timing")
    assert os.path.samefile(fb.__file__, b.__file__)
    assert hasattr(importlib.import_module("funcmla.bench.metadata"), "main")


def test_interop_without_torch_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "funcmla.interop" or m.startswith("funcmla.interop.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` sees without torch
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'funcmla\[torch\]'") as info:
        importlib.import_module("funcmla.interop.dlpack")
    assert info.value.name == "torch"


def test_package_metadata():
    project = _pyproject()
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(200)
    assert os.path.isfile(os.path.join(ROOT, "funcmla", "py.typed"))
    assert project["tool"]["setuptools"]["package-data"]["funcmla"] == ["py.typed"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "funcmla.__version__"}
    assert funcmla.__version__.count(".") == 2
    packages = set(project["tool"]["setuptools"]["packages"])
    on_disk = set()
    for name, folder in (("funcmla", "funcmla"), ("funcmla.interop", "interop"),
                         ("funcmla.bench", "bench")):
        top = os.path.join(ROOT, folder)
        for d, _, files in os.walk(top):
            rel = os.path.relpath(d, top)
            if "__init__.py" in files:
                on_disk.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    assert on_disk == packages
