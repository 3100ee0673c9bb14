"""The worked example of docs/sglang_backend.md runs and matches SGLang's torch-native
algorithm at every step; the document shows the script verbatim."""

import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "sglang_two_layers.py"


@pytest.mark.slow  # two layers through extend, decode and graph replay: each step compiles
def test_example_matches_torch_native():
    errors = runpy.run_path(str(SCRIPT))["main"]()
    assert set(errors) == {f"{s} layer {i}" for s in ("extend", "decode", "replay") for i in (0, 1)}
    assert max(errors.values()) < 4e-3, errors  # bf16 output vs a float32 restatement


def test_document_shows_the_script():
    doc = (ROOT / "docs" / "sglang_backend.md").read_text()
    assert SCRIPT.read_text().strip() in doc
