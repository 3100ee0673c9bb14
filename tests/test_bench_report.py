"""bench.report.card_tag: the default result files name the card a script ran on."""

import pytest

from bench.report import card_tag


@pytest.mark.parametrize("name,tag", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("cpu", "gpu"),
])
def test_card_tag_names_the_model(name, tag):
    assert card_tag(name) == tag
