"""The serving-trace simulation: page-size invariance of every output, against a direct oracle."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from jax.experimental.checkify import JaxRuntimeError

from funcmla import simulate as sim
from funcmla.simulate import SimulationConfig, run_simulation

PAGE_SIZES = (1, 16, 64)
CONFIG = SimulationConfig()  # the small default: prefix hits and out-of-memory at page sizes 16, 64


@pytest.fixture(scope="module")
def result():
    return run_simulation(CONFIG, PAGE_SIZES)


def direct_outputs(config: SimulationConfig, req: sim.RequestSpec) -> np.ndarray:
    """Float64 attention of each recorded query of `req`, straight from (token id, position):
    no allocator, no pool, no metadata. [output_len + 1, H, v_head_dim]."""
    dims = config.dims
    total = req.total_len
    keys = sim.hashed_uniform(config.seed, 1, req.token_ids, np.arange(total), dims.head_dim_qk)
    positions = np.arange(req.prompt_len - 1, total)
    qs = sim.hashed_uniform(config.seed, 2, np.full(len(positions), req.rid), positions,
                            dims.num_heads * dims.head_dim_qk)
    out = np.zeros((len(positions), dims.num_heads, dims.v_head_dim))
    for i, p in enumerate(positions):
        q = qs[i].reshape(dims.num_heads, dims.head_dim_qk).astype(np.float64)
        k = keys[: p + 1].astype(np.float64)
        s = q @ k.T * dims.sm_scale
        w = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (w / w.sum(-1, keepdims=True)) @ k[:, : dims.v_head_dim]
    return out


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_outputs_identical_across_page_sizes(result):
    assert set(result.runs) == set(PAGE_SIZES)
    assert result.outputs_identical(), result.max_output_diff()
    assert result.max_output_diff() == 0.0


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_outputs_match_direct_oracle(result):
    outputs = result.runs[1].outputs
    workload = sim.make_workload(CONFIG)
    assert sorted(outputs) == [r.rid for r in workload]
    for req in workload:
        got = outputs[req.rid]
        assert got.shape == (req.output_len + 1, CONFIG.num_heads, CONFIG.v_head_dim)
        np.testing.assert_allclose(got, direct_outputs(CONFIG, req), rtol=0, atol=2e-5,
                                   err_msg=f"request {req.rid}")


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_trace_statistics(result):
    summaries = {s["page_size"]: s for s in result.summary()}
    for page_size, run in result.runs.items():
        s = summaries[page_size]
        assert s["steps"] == len(run.steps) > 0 and s["extend_steps"] > 0
        assert {x.mode for x in run.steps} == {"extend", "decode"}
        assert s["max_rel_err"] < 1e-5  # float32 pipeline vs float64 oracle, per step
        assert s["prefix_hit_tokens"] > 0
        for x in run.steps:
            assert 0 <= x.pages_in_use <= run.num_pages
            assert x.pages_in_use + x.num_free_pages == run.num_pages
            assert x.num_kv_tokens <= x.kv_indices_capacity
            assert 0 < x.batch_size <= CONFIG.max_running
            if x.mode == "extend":
                assert x.prefix_hit_tokens % page_size == 0
    # larger pages waste more of the same pool: the OOM paths (deferral, retraction) ran there
    assert summaries[64]["oom_events"] > 0
    assert summaries[1]["num_pages"] == CONFIG.pool_tokens
    # page-aligned prefix sharing: a 72-token system prompt is shared as 72, 64, 64 tokens
    assert summaries[1]["prefix_hit_tokens"] > summaries[64]["prefix_hit_tokens"]


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_to_dict_is_json(result):
    d = json.loads(json.dumps(result.to_dict()))
    assert d["outputs_identical"] is True and d["config"]["pool_tokens"] == CONFIG.pool_tokens
    assert [r["summary"]["page_size"] for r in d["runs"]] == list(PAGE_SIZES)
    assert len(d["runs"][2]["steps"]) == len(result.runs[64].steps)


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_verify_keeps_only_true_tokens(result):
    """Target-verify steps (3 drafts, seeded acceptance) produce the decode outputs exactly
    where they keep tokens, at every page size."""
    cfg = dataclasses.replace(CONFIG, num_draft_tokens=3, check=False)
    verify = run_simulation(cfg, (16, 64))
    assert verify.outputs_identical()
    modes = {x.mode for x in verify.runs[16].steps}
    assert modes == {"extend", "target_verify"}
    base = result.runs[1].outputs
    for rid, out in verify.runs[64].outputs.items():
        np.testing.assert_allclose(out, base[rid], rtol=0, atol=2e-6, err_msg=f"request {rid}")


@pytest.mark.slow  # the module's trace: ~20 s of compiles at three page sizes
def test_work_plans_and_executor(result):
    """With use_plans the planners + plan executor give the reference outputs."""
    cfg = dataclasses.replace(CONFIG, use_plans=True, check=False, num_requests=6)
    planned = run_simulation(cfg, (16,))
    for run in planned.runs.values():
        assert all(x.plan_works > 0 for x in run.steps)
        assert max(x.max_rel_err for x in run.steps) < 1e-5
    for rid, out in planned.runs[16].outputs.items():
        np.testing.assert_allclose(out, result.runs[1].outputs[rid], rtol=0, atol=2e-6)


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
def test_seed_bugs_reproduced_on_purpose():
    """The seed's two bugs, at page size 64: a page-counting prefill plan corrupts exactly the
    prefill outputs (the KV it wrote is fine, so decode steps stay exact), and a page-sized
    kv_indices buffer is reported by the metadata checks."""
    cfg = dataclasses.replace(CONFIG, num_requests=3, use_plans=True, legacy_prefill_plan=True,
                              check=False)
    run = run_simulation(cfg, (64,)).runs[64]
    extend = [x.max_rel_err for x in run.steps if x.mode == "extend"]
    decode = [x.max_rel_err for x in run.steps if x.mode == "decode"]
    assert extend and min(extend) > 0.1, extend
    assert decode and max(decode) < 1e-5, decode
    cfg = dataclasses.replace(CONFIG, num_requests=2, legacy_kv_indices_buffer=True)
    with pytest.raises(JaxRuntimeError, match="exceed the buffer capacity 16"):
        run_simulation(cfg, (64,))


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
def test_progress_callback():
    calls = []
    cfg = dataclasses.replace(CONFIG, num_requests=2)
    run_simulation(cfg, (16,),
                   progress=lambda page_size, done, total: calls.append((page_size, done, total)))
    assert calls and calls[-1] == (16, 2, 2)
    assert all(c[0] == 16 and c[2] == 2 for c in calls)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_requests=0), "num_requests must be a positive int, got 0"),
        (dict(seed=-1), "seed must be an int >= 0, got -1"),
        (dict(prompt_len=(5, 4)), r"prompt_len must be a \(lo, hi\) tuple"),
        (dict(shared_prefix_prob=1.5), r"shared_prefix_prob must be in \[0, 1\], got 1.5"),
        (dict(arrival_every=-1.0), "arrival_every must be >= 0"),
        (dict(shared_prefix_len=112), "shared_prefix_len=112 must be shorter"),
        (dict(max_prefill_tokens=100), "prompt_len.1.=112 exceeds max_prefill_tokens=100"),
        (dict(num_draft_tokens=200), "exceeds max_context_len=256"),
        (dict(num_heads=4, use_plans=True), "num_heads=4: must be a multiple of 8"),
        (dict(legacy_prefill_plan=True), "legacy_prefill_plan=True needs use_plans=True"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimulationConfig(**kwargs)


def test_page_size_validation():
    with pytest.raises(ValueError, match="pool_tokens=384 is not a multiple of page_size=256"):
        run_simulation(CONFIG, (1, 256))
    with pytest.raises(ValueError, match="fewer than the 2 the longest request needs"):
        run_simulation(dataclasses.replace(CONFIG, pool_tokens=64), (64,))
    with pytest.raises(ValueError, match="page_size must be a power of two, got 24"):
        run_simulation(CONFIG, (24,))
    with pytest.raises(ValueError, match="page_sizes is empty"):
        run_simulation(CONFIG, ())


@pytest.mark.slow  # the trace through the Pallas kernel in interpret mode, twice
def test_pallas_decode_kernel_in_the_trace():
    """Decode and verify steps through the Pallas kernel (interpret mode here): bf16-accurate
    against the float64 oracle, and still bitwise identical across page sizes."""
    for n_draft, sizes in ((0, (1, 16)), (2, (1, 64))):
        cfg = SimulationConfig(num_requests=4, output_len=(3, 6), pallas_decode="on",
                               num_draft_tokens=n_draft)
        assert cfg.uses_pallas_decode
        res = run_simulation(cfg, sizes)
        assert res.outputs_identical()
        errs = [s["max_rel_err"] for s in res.summary()]
        assert all(1e-4 < e < 2e-2 for e in errs), errs  # bf16 operands: not float32-exact
        ref = run_simulation(dataclasses.replace(cfg, pallas_decode="off"), sizes[:1])
        for rid, out in ref.runs[sizes[0]].outputs.items():
            np.testing.assert_allclose(res.runs[sizes[0]].outputs[rid], out, atol=3e-2)


def test_pallas_decode_option_is_validated():
    with pytest.raises(ValueError, match="pallas_decode must be 'auto', 'on' or 'off'"):
        SimulationConfig(pallas_decode="yes")
    assert SimulationConfig(pallas_decode="off").uses_pallas_decode is False
