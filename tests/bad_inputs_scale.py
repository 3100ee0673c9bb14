"""Bad input to funcmla.parallel: layouts that cannot run are refused in Python, before any
compile, naming the axis or the field and the value or limit."""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from funcmla.config import custom_device
from funcmla.metadata import BufferPlan
from funcmla.parallel import (
    DPLayout,
    DPRank,
    build_dp_step,
    check_split,
    dp_attention,
    make_mesh,
    sglang_mesh,
    split_batch,
    tp_attention_reference,
    tp_mla_decode,
)
from funcmla.planners import DecodePlanConfig
from tests.bad_input import BadInput

D = 576


def _q(heads, rows=2):
    return np.zeros((rows, heads, D), np.float32)


def _csr():
    return np.arange(3, dtype=np.int32), np.zeros(3, np.int32), np.zeros(4, np.int32)


def _pool():
    return np.zeros((8, D), np.float32)


def _tp_heads():
    qo, kv_indptr, kv_indices = _csr()
    tp_attention_reference(_q(6), _pool(), qo, kv_indptr, kv_indices, mesh=make_mesh(tp=4),
                           sm_scale=0.1)


def _tp_no_axis():
    import jax

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("heads",))
    _, kv_indptr, kv_indices = _csr()
    tp_mla_decode(_q(16), _pool(), mesh=mesh, kv_indptr=kv_indptr, kv_indices=kv_indices,
                  sm_scale=0.1, interpret=True)


def _ranks(*max_bs, ctx=16):
    return tuple(DPRank(BufferPlan(max_bs=b, max_context_len=ctx), custom_device(4))
                 for b in max_bs)


def _layout(*max_bs, heads=16):
    return DPLayout(_ranks(*max_bs), DecodePlanConfig(device=custom_device(4), num_heads=heads))


def _dp_no_axis():
    import jax

    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), ("x", "tp"))
    build_dp_step(_layout(2, 2), mesh, [None, None])


def _dp_ranks_vs_mesh():
    build_dp_step(_layout(2, 2, 2), make_mesh(dp=2), [None, None, None])


def _dp_batch_over_max_bs():
    split = split_batch(5, 2, policy="round_robin")  # 3 + 2 requests
    check_split(_layout(2, 4), split, np.ones(5, np.int32))


def _dp_ctx_over_bound():
    split = split_batch(2, 2, policy="round_robin")
    check_split(_layout(2, 2), split, np.array([3, 40], np.int32))


def _dp_rank_inputs_over_max_bs():
    inputs = [(np.zeros((4, 16), np.int32), np.arange(3), np.ones(3, np.int32)),
              (np.zeros((4, 16), np.int32), np.arange(1), np.ones(1, np.int32))]
    build_dp_step(_layout(2, 2), make_mesh(dp=2), inputs)


def _dp_plan_heads():
    mesh = make_mesh(dp=2, tp=2)
    q = np.zeros((2, 2, 64, D), np.float32)  # 32 heads per device, the plan has 16
    dp_attention(q, np.zeros((2, 8, D), np.float32), None, mesh=mesh, layout=_layout(2, 2),
                 sm_scale=0.1)


def _dp_heads_vs_tp():
    mesh = make_mesh(dp=2, tp=2)
    q = np.zeros((2, 2, 15, D), np.float32)
    dp_attention(q, np.zeros((2, 8, D), np.float32), None, mesh=mesh, layout=_layout(2, 2),
                 sm_scale=0.1)


CASES: list[BadInput] = [
    BadInput("scale.tp_heads_not_divisible", _tp_heads, ValueError,
             (r"num_heads=6", r"'tp' axis size 4")),
    BadInput("scale.tp_mesh_without_axis", _tp_no_axis, ValueError,
             (r"no axis 'tp'", r"\('heads',\)")),
    BadInput("scale.dp_mesh_without_axis", _dp_no_axis, ValueError,
             (r"no axis 'dp'", r"\('x', 'tp'\)")),
    BadInput("scale.dp_ranks_vs_mesh", _dp_ranks_vs_mesh, ValueError,
             (r"3 ranks", r"'dp' axis has size 2")),
    BadInput("scale.dp_rank_batch_over_max_bs", _dp_batch_over_max_bs, ValueError,
             (r"DP rank 0", r"3 requests", r"max_bs=2")),
    BadInput("scale.dp_rank_context_over_bound", _dp_ctx_over_bound, ValueError,
             (r"DP rank 1", r"seq_lens max 40", r"max_context_len=16")),
    BadInput("scale.dp_rank_inputs_over_max_bs", _dp_rank_inputs_over_max_bs, ValueError,
             (r"DP rank 0", r"3 requests", r"max_bs=2")),
    BadInput("scale.dp_plan_heads_vs_local_heads", _dp_plan_heads, ValueError,
             (r"DPLayout.plan.num_heads=16", r"each device holds 32 heads")),
    BadInput("scale.dp_heads_not_divisible", _dp_heads_vs_tp, ValueError,
             (r"num_heads=15", r"'tp' axis size 2")),
    BadInput("scale.sglang_dp_without_dp_attention", lambda: sglang_mesh(4, 2), ValueError,
             (r"dp_size=2", r"enable_dp_attention")),
    BadInput("scale.sglang_tp_not_divisible_by_dp",
             lambda: sglang_mesh(4, 3, enable_dp_attention=True), ValueError,
             (r"tp_size=4", r"dp_size=3")),
    BadInput("scale.mesh_too_few_devices", lambda: make_mesh(dp=4, tp=4), ValueError,
             (r"dp=4 x tp=4", r"needs 16 devices")),
    BadInput("scale.split_unknown_policy",
             lambda: split_batch(3, 2, policy="least_tokens"), ValueError,
             (r"policy", r"least_tokens")),
    BadInput("scale.split_pinned_rank_out_of_range",
             lambda: split_batch(2, 2, pinned=[0, 2]), ValueError,
             (r"pinned", r"\[-1, 2\)")),
    BadInput("scale.split_counter_out_of_range",
             lambda: split_batch(3, 2, policy="round_robin", counter=5), ValueError,
             (r"counter", r"\[0, 2\)", r"5")),
]
