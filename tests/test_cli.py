"""The `funcmla` command: plan, bench, --version and bad arguments in-process through the console
script `funcmla.cli.main` (its return value is the exit status), and one subprocess, `python -m
funcmla` with its stdout closed early, for what only a process shows: main's status becomes the
process's, and a closed pipe exits 141 without a traceback. The demo runs in-process in
tests/test_demo.py."""

import json
import os
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest

from funcmla.config import custom_device
from funcmla.indices import indptr_from_lens
from funcmla.planners.decode import DecodePlanConfig, plan_mla_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Run(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def funcmla(capsys):
    """`funcmla ARGS...` in-process: the console script's exit status (its return value, or
    argparse's SystemExit code) and what it printed."""
    from funcmla import cli

    def run(*args):
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def test_plan_decode_json_equals_the_planner(tmp_path, funcmla):
    kv = [4096, 17, 0, 9000, 300]
    png = tmp_path / "plan.png"
    r = funcmla("plan", "decode", "--kv-lens", ",".join(map(str, kv)), "--device", "custom:8",
                "--heads", "16", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    cfg = DecodePlanConfig(device=custom_device(8), num_heads=16, uni_seqlen_qo=1)
    plan = plan_mla_decode(indptr_from_lens(np.ones(5, np.int32)), indptr_from_lens(np.array(kv)),
                           np.ones(5, np.int32), config=cfg)
    n = int(plan.num_works)
    assert got["num_works"] == n
    assert got["work_indptr"] == np.asarray(plan.work_indptr).tolist()
    assert got["work_info"] == np.asarray(plan.work_info)[:n].tolist()
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_prefill_from_a_json_batch_file(tmp_path, funcmla):
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"kv_lens": [600, 300], "qo_lens": [600, 200]}))
    r = funcmla("plan", "prefill", "--batch", str(batch), "--device", "custom:8:gfx950")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prefill work plan" in r.stdout and "block_size 1" in r.stdout
    legacy = funcmla("plan", "prefill", "--batch", str(batch), "--device", "custom:8:gfx950",
                     "--legacy", "--page-size", "64", "--json")
    assert legacy.returncode == 0, legacy.stderr[-2000:]
    out = json.loads(legacy.stdout)
    assert out["legacy"] is True and out["block_size"] == 64


@pytest.mark.slow  # 7-17 s on 2 cores: CI runs it in `./dev test -m slow`
def test_bench_metadata_quick_writes_json(tmp_path):
    # a process of its own: the benchmark's timing runs stay out of the pytest worker
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "funcmla", "bench", "metadata", "--quick", "--out",
                        str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "metadata.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"decode", "extend"} and all(r["jax_us"] > 0 for r in rows)


@pytest.mark.parametrize("args, message", [
    (["plan", "decode", "--kv-lens", "12,x"], "--kv-lens must be a comma-separated list of integers"),
    (["plan", "decode", "--kv-lens", "12,-3"], "--kv-lens[1] = -3 must be >= 0"),
    (["plan", "decode", "--kv-lens", "99999999999"], "--kv-lens[0] = 99999999999 exceeds the int32 limit 2147483647"),
    (["plan", "decode", "--kv-lens", "2000000000,2000000000", "--json"],
     "sum(--kv-lens) = 4000000000 exceeds the int32 limit 2147483647"),
    (["plan", "decode"], "give the batch with --kv-lens"),
    (["plan", "decode", "--kv-lens", "5,6", "--qo-lens", "1"], "--qo-lens has 1 entries but --kv-lens has 2"),
    (["plan", "decode", "--kv-lens", "5", "--device", "tpu9"], "unknown device profile 'tpu9'"),
    (["plan", "decode", "--kv-lens", "5", "--device", "custom:abc"], "custom:N needs an integer CU count"),
    (["plan", "decode", "--kv-lens", "5", "--page-size", "48"], "--page-size must be a power of two"),
    (["plan", "decode", "--kv-lens", "5", "--heads", "20"], "DecodePlanConfig.num_heads"),
    (["plan", "prefill", "--kv-lens", "5", "--qo-lens", "9"], "--qo-lens <= --kv-lens"),
    (["plan", "prefill", "--batch", "/nonexistent.json"], "--batch '/nonexistent.json'"),
    (["demo", "--page-sizes", "1,3"], "--page-sizes[1] must be a power of two, got 3"),
    (["plan", "sideways", "--kv-lens", "5"], "invalid choice: 'sideways'"),
])
def test_bad_arguments_exit_2_and_name_the_argument(args, message, capsys):
    """In-process (the console script is `cli.main`); tests/bad_inputs_cli.py has the rest."""
    from funcmla import cli

    try:
        code = cli.main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err[-2000:])
    assert message in err, err[-2000:]
    assert "Traceback" not in err


def test_version_and_a_closed_pipe(funcmla):
    r = funcmla("--version")
    assert r.returncode == 0 and r.stdout.startswith("funcmla ")
    # `funcmla plan ... --json | head -c 10`: the reader closes early; no traceback, status 141.
    # 2400 requests make ~145 KB of JSON, over a pipe's 64 KB buffer: the writer is still
    # writing when the reader closes, however the two are scheduled (400 made 26 KB, which a
    # loaded machine could write in full before the close: status 0).
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "funcmla", "plan", "decode", "--kv-lens",
                             ",".join(["4096"] * 2400), "--device", "custom:64", "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10).startswith(b"{")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_gpu_only_bench_is_refused_on_cpu(funcmla):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("has a GPU")
    r = funcmla("bench", "decode", "--quick")
    assert r.returncode == 2 and "bench.decode needs an NVIDIA GPU" in r.stderr
