"""The bad-input battery: every class in `tests/bad_inputs_*.py` raises its documented error,
whose message names the field and the value or limit (docs/errors.md lists them all)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from tests.bad_input import BadInput


def _cases() -> list[BadInput]:
    cases: list[BadInput] = []
    for path in sorted(pathlib.Path(__file__).parent.glob("bad_inputs_*.py")):
        cases.extend(importlib.import_module(f"tests.{path.stem}").CASES)
    return cases


CASES = _cases()


def test_case_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _available(need: str) -> bool:
    if need == "torch":
        return importlib.util.find_spec("torch") is not None
    if need == "gpu":
        import jax

        return jax.devices()[0].platform == "gpu"
    if need == "launcher":  # a jaxlib the launchers' extraction was tested on
        from funcmla.interop.launcher import jaxlib_unsupported_reason

        return jaxlib_unsupported_reason() is None
    if need == "lowering":  # and the decode kernels' Pallas Triton lowering for CUDA
        from tests.launcher_helpers import _lowering_available

        return _lowering_available() is None
    raise ValueError(f"unknown requirement {need!r}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: BadInput):
    for need in case.needs:
        if not _available(need):
            pytest.skip(f"needs {need}")
    with pytest.raises(case.error) as info:
        case.call()
    message = str(info.value)
    for pattern in case.match:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
