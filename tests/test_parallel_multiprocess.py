"""The same parallel code across processes: 2 CPU processes over localhost under
`jax.distributed.initialize`, 2 devices each, one 4-device mesh. TP over 4 heads-shards that
span both processes, and DP attention over 4 ranks (2 per process, each process building only
its own ranks' metadata and plans), checked in every process against its own single-device
result. Run by pytest (it spawns the two workers); `python -m tests.test_parallel_multiprocess
PROCESS_ID PORT` is one worker."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from funcmla.config import MLADims
from tests.pools import scattered_requests

ROOT = pathlib.Path(__file__).resolve().parent.parent
D, DV, SCALE = 576, 512, MLADims().sm_scale
N, CTX, SLOTS, HEADS = 6, 24, 192, 16


def _problem():
    rng = np.random.default_rng(7)  # the same problem in both processes
    lens, req_to_token, rpi = scattered_requests(rng, N, CTX, SLOTS, empty=3)
    q = rng.standard_normal((N, HEADS, D)).astype(np.float32)
    pool = rng.standard_normal((SLOTS, D)).astype(np.float32)
    return lens, req_to_token, rpi, q, pool


def _check_shards(x, expected, what):
    for shard in x.addressable_shards:
        got = np.asarray(shard.data)
        want = expected[shard.index]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=what)


def worker(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()

    from funcmla.attention.reference import mla_attention_reference
    from funcmla.config import custom_device
    from funcmla.metadata import BufferPlan, decode_metadata
    from funcmla.parallel import (DPLayout, DPRank, build_dp_step, dp_attention, gather_global,
                                  make_mesh, rank_rows, split_batch, stack_pools, stack_rows,
                                  tp_attention_reference)
    from funcmla.parallel.placement import local_ranks
    from funcmla.planners import DecodePlanConfig

    lens, req_to_token, rpi, q, pool = _problem()
    md = decode_metadata(req_to_token, rpi, lens, capacity=N * CTX)
    ref_out, ref_lse = (np.asarray(x) for x in mla_attention_reference(
        q, pool, md.qo_indptr, md.kv_indptr, md.kv_indices, sm_scale=SCALE, max_kv_len=CTX))

    # TP: the 16 heads over 4 devices, 2 of them in the other process
    mesh = make_mesh(tp=4)
    out, lse = tp_attention_reference(q, pool, md.qo_indptr, md.kv_indptr, md.kv_indices,
                                      mesh=mesh, sm_scale=SCALE, max_kv_len=CTX)
    assert not out.is_fully_addressable
    _check_shards(out, ref_out, "tp out")
    _check_shards(lse, ref_lse, "tp lse")

    # DP: 4 ranks, this process builds only its own two
    mesh = make_mesh(dp=4)
    mine = local_ranks(mesh)
    assert mine == [2 * process_id, 2 * process_id + 1], mine
    split = split_batch(N, 4, policy="round_robin")
    layout = DPLayout(tuple(DPRank(BufferPlan(max_bs=2, max_context_len=CTX),
                                   custom_device(4 + r)) for r in range(4)),
                      DecodePlanConfig(device=custom_device(4), num_heads=HEADS))
    inputs = [(req_to_token, rpi[ids], lens[ids]) if r in mine else None
              for r, ids in enumerate(split.requests)]
    step = build_dp_step(layout, mesh, inputs)
    rows = rank_rows(q, split, layout)
    qs = stack_rows([rows[r] if r in mine else None for r in range(4)], mesh)
    pools = stack_pools([pool if r in mine else None for r in range(4)], mesh)
    o, l = dp_attention(qs, pools, step, mesh=mesh, layout=layout, impl="executor",
                        sm_scale=SCALE)
    out, lse = gather_global(o, l, split, mesh=mesh)
    assert out.sharding.is_fully_replicated
    _check_shards(out, ref_out, "dp out")
    _check_shards(lse, ref_lse, "dp lse")
    print(f"worker {process_id}: ok", flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two fresh JAX processes, each compiling the TP and DP programs
def test_two_processes_over_localhost():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_parallel_multiprocess",
                               str(i), str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=540)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0 and f"worker {i}: ok" in log, log[-3000:]


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]))
