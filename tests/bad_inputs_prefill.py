"""Bad inputs of the ragged MHA prefill (funcmla.attention.pallas.mha_prefill), its config and
`merge_attention_states`: head dims other than (192, 128), dtypes, grouped heads, indptrs that
disagree with the tensors, causal requests with kv_len < q_len, bad scales and configs. Every
check runs before a kernel is built, so each case is fast (tests/test_bad_inputs.py runs
them)."""

from __future__ import annotations

import jax.numpy as jnp

from funcmla.attention.pallas import MgpuPrefillConfig, merge_attention_states, mha_prefill
from funcmla.attention.pallas.prefill import prefill_step
from tests.bad_input import BadInput

H = 2


def _t(rows, d, heads=H, dtype=jnp.bfloat16):
    return jnp.zeros((rows, heads, d), dtype)


def _ip(*vals, dtype=jnp.int32):
    return jnp.array(vals, dtype)


def _call(q=None, k=None, v=None, qo=None, kv=None, **kw):
    """mha_prefill on 2 requests (q 4 + 4 rows, k / v 8 + 8 rows), each argument replaceable."""
    return lambda: mha_prefill(_t(8, 192) if q is None else q, _t(16, 192) if k is None else k,
                               _t(16, 128) if v is None else v,
                               _ip(0, 4, 8) if qo is None else qo,
                               _ip(0, 8, 16) if kv is None else kv,
                               **{"sm_scale": 0.1, "interpret": True, **kw})


def _step():
    """The step of `_call`'s CSRs (2 requests, q 4 + 4 rows, k / v 8 + 8 rows)."""
    return prefill_step(_ip(0, 4, 8), _ip(0, 8, 16), 8, 16, interpret=True)


CASES = [
    BadInput("prefill.q_head_dim", _call(q=_t(8, 576), k=_t(16, 576)), ValueError,
             (r"head dims", r"576", r"\(192, 128\)")),
    BadInput("prefill.v_head_dim", _call(v=_t(16, 192)), ValueError,
             (r"head dims", r"v 192")),
    BadInput("prefill.k_head_dim", _call(k=_t(16, 128)), ValueError, (r"head dims", r"k 128")),
    BadInput("prefill.dtype", _call(q=_t(8, 192, dtype=jnp.float16)), TypeError,
             (r"\bq\b", r"float16", r"bfloat16")),
    BadInput("prefill.fp8_format", _call(q=_t(8, 192, dtype=jnp.float8_e5m2)), TypeError,
             (r"\bq\b", r"float8_e5m2", r"float8_e4m3fn")),
    BadInput("prefill.scale_for_bf16", _call(k_scale=2.0), ValueError,
             (r"k_scale", r"fp8 k\b", r"bfloat16")),
    BadInput("prefill.scale_value", _call(q=_t(8, 192, dtype=jnp.float8_e4m3fn), q_scale=0.0),
             ValueError, (r"q_scale=0.0", r"positive finite")),
    BadInput("prefill.scale_shape", _call(v=_t(16, 128, dtype=jnp.float8_e4m3fn),
                                          v_scale=jnp.ones((2,), jnp.float32)), ValueError,
             (r"v_scale", r"\(\) or \[1\]", r"\(2,\)")),
    BadInput("prefill.ndim", _call(v=jnp.zeros((16, 128), jnp.bfloat16)), ValueError,
             (r"\bv\b", r"\[T, H, D\]", r"\(16, 128\)")),
    BadInput("prefill.grouped_heads", _call(k=_t(16, 192, heads=1), v=_t(16, 128, heads=1)),
             ValueError, (r"heads", r"num_kv_heads", r"\b1\b")),
    BadInput("prefill.kv_tokens", _call(v=_t(12, 128)), ValueError,
             (r"\bk\b", r"\bv\b", r"\(12, 2, 128\)")),
    BadInput("prefill.indptr_dtype", _call(qo=_ip(0, 4, 8, dtype=jnp.int16)), TypeError,
             (r"qo_indptr", r"int16", r"int32")),
    BadInput("prefill.indptr_shape", _call(kv=_ip(0, 16)), ValueError,
             (r"qo_indptr", r"kv_indptr", r"\(2,\)")),
    BadInput("prefill.indptr_empty", _call(qo=_ip(0), kv=_ip(0)), ValueError,
             (r"qo_indptr", r"B >= 1", r"\(1,\)")),
    BadInput("prefill.indptr_start", _call(qo=_ip(1, 4, 8)), ValueError,
             (r"qo_indptr\[0\] must be 0", r"got 1")),
    BadInput("prefill.indptr_decreasing", _call(kv=_ip(0, 12, 8), causal=False), ValueError,
             (r"kv_indptr must be non-decreasing", r"kv_indptr\[2\] = 8 < kv_indptr\[1\] = 12")),
    BadInput("prefill.qo_past_q", _call(qo=_ip(0, 4, 9)), ValueError,
             (r"qo_indptr\[-1\] = 9", r"q.shape\[0\] = 8")),
    BadInput("prefill.kv_past_k", _call(kv=_ip(0, 8, 17)), ValueError,
             (r"kv_indptr\[-1\] = 17", r"k.shape\[0\] = 16")),
    BadInput("prefill.causal_kv_short", _call(kv=_ip(0, 3, 16)), ValueError,
             (r"request 0", r"kv_len 3", r"q_len 4")),
    BadInput("prefill.sm_scale", _call(sm_scale=-1.0), ValueError, (r"sm_scale", r"-1.0")),
    BadInput("prefill.causal_type", _call(causal=1), TypeError, (r"causal", r"bool", r"\b1\b")),
    BadInput("prefill.config_type", _call(config=object()), TypeError,
             (r"config", r"MgpuPrefillConfig", r"object")),
    BadInput("prefill.max_kv_len", _call(max_kv_len=-1), ValueError,
             (r"max_kv_len must be an int >= 0", r"got -1")),
    BadInput("prefill.max_kv_len_type", _call(max_kv_len=2.5), ValueError,
             (r"max_kv_len", r"2.5")),
    BadInput("prefill.config_and_max_kv_len", _call(config=MgpuPrefillConfig(), max_kv_len=8),
             ValueError, (r"max_kv_len picks the config", r"one of config and max_kv_len")),
    BadInput("prefill.config_block_kv", lambda: MgpuPrefillConfig(block_kv=96), ValueError,
             (r"block_kv", r"96", r"64 or 128")),
    BadInput("prefill.config_smem", lambda: MgpuPrefillConfig(block_kv=128, num_stages=3),
             ValueError, (r"num_stages=3", r"shared memory", r"232448")),
    BadInput("prefill.config_tiles_per_cta", lambda: MgpuPrefillConfig(tiles_per_cta=0),
             ValueError, (r"tiles_per_cta", r"int >= 1", r"got 0")),
    BadInput("prefill.config_tiles_per_cta_smem",
             lambda: MgpuPrefillConfig(block_kv=128, num_stages=2, tiles_per_cta=2),
             ValueError, (r"block_kv=128", r"tiles_per_cta=2", r"shared memory")),
    BadInput("prefill.config_profile_space",
             lambda: MgpuPrefillConfig(profile_space=-1, profile_dir="/tmp"), ValueError,
             (r"profile_space=-1", r">= 0")),
    BadInput("prefill.config_profile_dir", lambda: MgpuPrefillConfig(profile_space=8),
             ValueError, (r"profile_space > 0", r"profile_dir")),
    BadInput("prefill.config_profile_smem",
             lambda: MgpuPrefillConfig(profile_space=400, profile_dir="/tmp"), ValueError,
             (r"profile_space=400", r"shared memory")),
    BadInput("prefill.config_registers",
             lambda: MgpuPrefillConfig(consumer_registers=240, producer_registers=40),
             ValueError, (r"consumer_registers=240", r"= 520 exceeds 504")),
    BadInput("prefill.step_rows", lambda: prefill_step(_ip(0, 4, 8), _ip(0, 8, 16), -1, 16,
                                                       interpret=True), ValueError,
             (r"num_q must be an int >= 0", r"got -1")),
    BadInput("prefill.step_no_indptrs", lambda: mha_prefill(
        _t(8, 192), _t(16, 192), _t(16, 128), sm_scale=0.1, interpret=True), ValueError,
             (r"qo_indptr and kv_indptr", r"step=")),
    BadInput("prefill.step_type", _call(step=object()), TypeError,
             (r"step must be a PrefillStep", r"object")),
    BadInput("prefill.step_and_indptrs", lambda: mha_prefill(
        _t(8, 192), _t(16, 192), _t(16, 128), _ip(0, 4, 8), _ip(0, 8, 16), sm_scale=0.1,
        step=_step()), ValueError, (r"the indptrs or step=", r"not both")),
    BadInput("prefill.step_config", lambda: mha_prefill(
        _t(8, 192), _t(16, 192), _t(16, 128), sm_scale=0.1, step=_step(),
        config=MgpuPrefillConfig()), ValueError, (r"config / max_kv_len", r"prefill_step")),
    BadInput("prefill.step_causal", lambda: mha_prefill(
        _t(8, 192), _t(16, 192), _t(16, 128), sm_scale=0.1, step=_step(), causal=False),
             ValueError, (r"causal=False", r"step's causal=True")),
    BadInput("prefill.step_row_counts", lambda: mha_prefill(
        _t(8, 192), _t(24, 192), _t(24, 128), sm_scale=0.1, step=_step()), ValueError,
             (r"k / v 24", r"num_kv=16")),
    BadInput("merge.attention_states_shape",
             lambda: merge_attention_states(_t(4, 128), jnp.zeros((4, H)), _t(5, 128),
                                            jnp.zeros((5, H))),
             ValueError, (r"out_a", r"\(4, 2, 128\)", r"\(5, 2, 128\)")),
    BadInput("merge.attention_states_lse_dtype",
             lambda: merge_attention_states(_t(4, 128), jnp.zeros((4, H), jnp.bfloat16),
                                            _t(4, 128), jnp.zeros((4, H), jnp.bfloat16)),
             TypeError, (r"lse_a", r"bfloat16", r"float32")),
]
