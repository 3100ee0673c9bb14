"""The launcher as torch ops (CPU): `torch.ops.funcmla.mla_decode(_out)` have fake
implementations with the launcher's output shapes, so torch.export and torch.compile trace a
decode step as one opaque op without a GPU (the real launches run on the GPU:
bench/torch_path.py and tests/test_launcher_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from funcmla.interop import launcher as L
from tests.launcher_helpers import SCALE

B, H, T, CAP, POOL = 4, 128, 8, 4 * 64, 300  # s_q = 2


def _inputs(page_size: int):
    q = torch.empty(T, H, 576, dtype=torch.bfloat16)
    kv = torch.empty(POOL, 576, dtype=torch.bfloat16)
    if page_size == 1:
        return q, kv, torch.empty(B + 1, dtype=torch.int32), torch.empty(CAP, dtype=torch.int32)
    return (q, kv, torch.empty(B, CAP // page_size // B, dtype=torch.int32),
            torch.empty(B, dtype=torch.int32))


def test_registration_is_idempotent():
    ops = L.register_torch_ops()
    assert L.register_torch_ops() is ops and set(ops) == {"mla_decode", "mla_decode_out",
                                                          "mha_prefill"}
    assert hasattr(torch.ops.funcmla, "mla_decode") and hasattr(torch.ops.funcmla,
                                                                "mla_decode_out")


@pytest.mark.parametrize("page_size", [1, 16])
def test_fake_implementations_give_the_launchers_outputs(page_size):
    L.register_torch_ops()
    with FakeTensorMode():
        q, kv, a, b = _inputs(page_size)
        out, lse = torch.ops.funcmla.mla_decode(q, kv, a, b, SCALE, 2, page_size, 0, 0, 512)
        assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16
        assert lse.shape == (T, H) and lse.dtype == torch.float32
        o, s = torch.empty(T, H, 512, dtype=torch.bfloat16), torch.empty(T, H)
        assert torch.ops.funcmla.mla_decode_out(q, kv, a, b, o, s, SCALE, 2, page_size, 0, 0,
                                                512) is None


class _Step(torch.nn.Module):
    def forward(self, q, kv, a, b):
        out, lse = torch.ops.funcmla.mla_decode(q, kv, a, b, SCALE, 2, 1, 0, 0, 512)
        return out.float().sum(-1), lse


def test_torch_export_traces_one_opaque_op():
    L.register_torch_ops()
    ep = torch.export.export(_Step(), _inputs(1))
    calls = [n for n in ep.graph.nodes if n.op == "call_function"
             and "funcmla" in str(n.target)]
    assert [str(n.target) for n in calls] == ["funcmla.mla_decode.default"]
    out_meta = calls[0].meta["val"]
    assert out_meta[0].shape == (T, H, 512) and out_meta[1].shape == (T, H)


def test_torch_compile_fullgraph_sees_one_op():
    L.register_torch_ops()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        metas = [n.meta["example_value"] for n in gm.graph.output_node().args[0]]

        def run(*args):  # the real op needs a GPU: hand back tensors of the traced outputs
            return [torch.zeros(m.shape, dtype=m.dtype) for m in metas]

        return run

    step = torch.compile(_Step(), backend=backend, fullgraph=True)
    got = step(*_inputs(1))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("funcmla.mla_decode" in t for t in targets) == 1, targets
    assert got[0].shape == (T, H) and got[1].shape == (T, H)


class _Fp8Step(torch.nn.Module):
    def forward(self, q, kv, a, b, k_scale, v_scale):
        out, lse = torch.ops.funcmla.mla_decode(q, kv, a, b, SCALE, 2, 1, 0, 0, 512,
                                                k_scale=k_scale, v_scale=v_scale)
        return out, lse


def test_fp8_scales_are_optional_tensor_arguments_of_the_ops():
    """The ops take an fp8 pool's k_scale / v_scale as optional trailing tensors (calls without
    them are unchanged); the fakes give the same outputs and torch.export keeps one op node
    with the scales as its inputs."""
    L.register_torch_ops()
    schema = str(torch.ops.funcmla.mla_decode.default._schema)
    assert schema.endswith("int v_head_dim, Tensor? k_scale=None, Tensor? v_scale=None) -> "
                           "(Tensor, Tensor)")
    q, _, a, b = _inputs(1)
    kv = torch.empty(POOL, 576, dtype=torch.float8_e4m3fn)
    ks, vs = torch.empty(1), torch.empty(())
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse = torch.ops.funcmla.mla_decode(q, kv, a, b, SCALE, 2, 1, 0, 0, 512, ks, vs)
        assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16 and lse.shape == (T, H)
        o, s = torch.empty(T, H, 512, dtype=torch.bfloat16), torch.empty(T, H)
        assert torch.ops.funcmla.mla_decode_out(q, kv, a, b, o, s, SCALE, 2, 1, 0, 0, 512,
                                                k_scale=ks) is None
    ep = torch.export.export(_Fp8Step(), (q, kv, a, b, ks, vs))
    calls = [n for n in ep.graph.nodes if n.op == "call_function"
             and "funcmla" in str(n.target)]
    assert [str(n.target) for n in calls] == ["funcmla.mla_decode.default"]
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    assert tuple(calls[0].args[10:]) == tuple(placeholders[4:6])


class _Prefill(torch.nn.Module):
    def forward(self, q, k, v, qo, kv):
        out, lse = torch.ops.funcmla.mha_prefill(q, k, v, qo, kv, SCALE, True)
        return out.float().sum(-1), lse


def _prefill_inputs():
    t, tk, h = 40, 70, 16
    return (torch.empty(t, h, 192, dtype=torch.bfloat16),
            torch.empty(tk, h, 192, dtype=torch.float8_e4m3fn),
            torch.empty(tk, h, 128, dtype=torch.bfloat16),
            torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.int32))


def test_prefill_op_exports_as_one_opaque_op_with_mha_prefill_shapes():
    """`torch.ops.funcmla.mha_prefill`: out [Tq, H, 128] bf16 (whatever fp8 operands it
    gets) and lse [Tq, H] float32, one node under torch.export."""
    L.register_torch_ops()
    with FakeTensorMode():
        out, lse = torch.ops.funcmla.mha_prefill(*_prefill_inputs(), SCALE, False,
                                                 k_scale=torch.ones(1))
        assert out.shape == (40, 16, 128) and out.dtype == torch.bfloat16
        hinted, _ = torch.ops.funcmla.mha_prefill(*_prefill_inputs(), SCALE, True,
                                                  max_kv_len=1024)
        assert hinted.shape == (40, 16, 128)
        assert lse.shape == (40, 16) and lse.dtype == torch.float32
    ep = torch.export.export(_Prefill(), _prefill_inputs())
    calls = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"
             and "funcmla" in str(n.target)]
    assert calls == ["funcmla.mha_prefill.default"]
