"""bench.split_count's pieces that run without a GPU: the split counts it is given and the
order it times them in."""

from __future__ import annotations

import pytest

from bench import split_count


def test_parse_splits_keeps_the_order_and_drops_repeats():
    assert split_count.parse_splits("4,3,8,3") == [4, 3, 8]


@pytest.mark.parametrize("text", ["4,0", "2,-1", "2,x", "2,,4"])
def test_parse_splits_names_the_bad_part(text):
    with pytest.raises(ValueError, match=r"--splits .*is not a positive int"):
        split_count.parse_splits(text)


def test_counts_to_time_puts_the_rules_count_first_once():
    assert split_count.counts_to_time(4, [3, 4, 8]) == [4, 3, 8]
    assert split_count.counts_to_time(2, [4]) == [2, 4]


def test_main_refuses_a_bad_case_name_before_importing_jax_work():
    with pytest.raises(ValueError, match="h<heads>_b<batch>_ctx<k>k_p<page>"):
        split_count.main(["--cases", "h16_b32_4k", "--splits", "2"])


def test_case_dispatch_gives_the_split_rules_documented_counts():
    """The count bench.split_count times as the rule's (`decode_case.case_dispatch`): 4 splits
    at 16 heads, batch 32, 4k (the Triton sweep's fastest, docs/decode_kernel.md), one at
    128 heads, batch 128, 16k (256 blocks already fill the chip)."""
    from bench import decode_case
    from funcmla.attention.pallas import DecodeKernelConfig

    config = DecodeKernelConfig()
    assert decode_case.case_dispatch(16, 32, 4096, 64, config)[2] == 4
    assert decode_case.case_dispatch(16, 32, 4096, 64, config, fp8=True)[2] == 4
    assert decode_case.case_dispatch(128, 128, 16384, 64, config)[2] == 1
