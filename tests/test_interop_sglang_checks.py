"""Every bad step the SGLang backend refuses (tests/bad_inputs_backend.py) is refused before
anything runs: no program is compiled or launched, no static buffer is written, the previous
step's metadata stays in place."""

from __future__ import annotations

import pytest
import torch

from funcmla.interop.sglang import step as step_mod
from tests.bad_inputs_backend import CASES, shared


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_before_any_work(case):
    be = shared()
    static = be._graph_buffer.clone()
    meta = be.forward_metadata
    compiled = step_mod.build_step._cache_size()
    with pytest.raises(case.error):
        case.call()
    assert torch.equal(be._graph_buffer, static)
    assert be.forward_metadata is meta
    assert step_mod.build_step._cache_size() == compiled


def test_a_good_replay_after_refusals_still_works():
    be = shared()
    from funcmla.interop.sglang_backend import ForwardMode

    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    be.init_forward_metadata_replay_cuda_graph(2, t([3, 4]), t([6, 10]), 16, None,
                                               ForwardMode.DECODE, None, t([6, 10]))
    fm = be.forward_metadata
    assert fm.kv_indptr.tolist() == [0, 6, 16]
    r2t = be.req_to_token
    assert fm.kv_indices[:16].tolist() == r2t[3, :6].tolist() + r2t[4, :10].tolist()
