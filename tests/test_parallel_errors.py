"""Every bad parallel layout (tests/bad_inputs_scale.py) is refused before JAX compiles
anything: no "Compiling" record is logged while the bad call runs."""

from __future__ import annotations

import logging

import jax
import pytest

from tests.bad_inputs_scale import CASES


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_before_any_compile(case, caplog):
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        with pytest.raises(case.error):
            case.call()
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert compiles == [], compiles


def test_the_detector_sees_a_compile(caplog):
    import jax.numpy as jnp

    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        jax.jit(lambda x: x * 3 + 7)(jnp.ones(5))
    assert any("Compiling" in r.getMessage() for r in caplog.records)
