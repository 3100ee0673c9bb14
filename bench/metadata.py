"""Time to build decode and extend metadata under jit (after compile) vs a NumPy restatement.

    python -m bench.metadata [--out out/] [--quick]

For each (batch, context): requests get random KV lengths in [ctx/2, ctx] laid out at page size
16 in a shuffled pool; the jit builders run with a static token-granular capacity of
batch * ctx. Prints a table of medians and the NumPy/JAX ratio, writes out/metadata.json.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
from rich.progress import track

from .timing import environment, median_time_s, print_table, write_json
from funcmla.metadata import decode_metadata, extend_metadata

PAGE_SIZE = 16


def numpy_decode(req_to_token, req_pool_indices, seq_lens):
    """Plain NumPy: kv_indptr = [0, cumsum], kv_indices = concatenated request rows."""
    kv_indptr = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    kv_indices = np.concatenate([req_to_token[r, :n] for r, n in zip(req_pool_indices, seq_lens)])
    qo_indptr = np.arange(len(seq_lens) + 1, dtype=np.int32)
    return kv_indptr, kv_indices, qo_indptr, np.ones(len(seq_lens), np.int32), 1, int(seq_lens.max())


def numpy_extend(req_to_token, req_pool_indices, seq_lens, extend_lens):
    kv_indptr, kv_indices, _, last, _, max_kv = numpy_decode(req_to_token, req_pool_indices, seq_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(extend_lens)]).astype(np.int32)
    return kv_indptr, kv_indices, qo_indptr, last, int(extend_lens.max()), max_kv


def make_batch(batch, ctx, rng):
    pages_per_req = -(-ctx // PAGE_SIZE)
    num_pages = batch * pages_per_req
    perm = rng.permutation(np.arange(1, num_pages + 1)).reshape(batch, pages_per_req)
    t = np.arange(ctx)
    req_to_token = (perm[:, t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE).astype(np.int32)
    rpi = rng.permutation(batch).astype(np.int32)
    seq = rng.integers(max(1, ctx // 2), ctx + 1, size=batch).astype(np.int32)
    ext = np.minimum(seq, rng.integers(1, 512, size=batch)).astype(np.int32)
    return req_to_token, rpi, seq, ext


def run(batches, contexts, reps):
    rng = np.random.default_rng(0)
    dec = jax.jit(decode_metadata, static_argnames="capacity")
    ext = jax.jit(extend_metadata, static_argnames="capacity")

    rows = []
    cases = [(b, c) for b in batches for c in contexts]
    for batch, ctx in track(cases, description="metadata bench", transient=True):
        r2t, rpi, seq, extl = make_batch(batch, ctx, rng)
        cap = batch * ctx
        d_r2t, d_rpi, d_seq, d_ext = map(jax.device_put, (r2t, rpi, seq, extl))
        run_dec = lambda: jax.block_until_ready(dec(d_r2t, d_rpi, d_seq, capacity=cap))
        run_ext = lambda: jax.block_until_ready(ext(d_r2t, d_rpi, d_seq, d_ext, capacity=cap))
        # correctness of what is timed
        m = run_dec()
        ref = numpy_decode(r2t, rpi, seq)
        assert np.array_equal(np.asarray(m.kv_indices[: ref[0][-1]]), ref[1])
        for mode, jfn, nfn in (
            ("decode", run_dec, lambda: numpy_decode(r2t, rpi, seq)),
            ("extend", run_ext, lambda: numpy_extend(r2t, rpi, seq, extl)),
        ):
            t_jax = median_time_s(jfn, reps=reps)
            t_np = median_time_s(nfn, reps=reps)
            rows.append(dict(mode=mode, batch=batch, ctx=ctx, tokens=int(seq.sum()),
                             capacity=cap, jax_us=t_jax * 1e6, numpy_us=t_np * 1e6,
                             numpy_over_jax=t_np / t_jax))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    if args.quick:
        batches, contexts = [1, 32], [1024, 4096]
    else:
        batches, contexts = [1, 32, 256, 1024], [1024, 4096, 32768]
    rows = run(batches, contexts, args.reps)
    print_table(
        f"metadata build time (median, {environment()['backend']})",
        ["mode", "batch", "ctx", "tokens", "jax us", "numpy us", "numpy/jax"],
        [[r["mode"], r["batch"], r["ctx"], r["tokens"], r["jax_us"], r["numpy_us"],
          r["numpy_over_jax"]] for r in rows],
    )
    path = write_json(os.path.join(args.out, "metadata.json"),
                      {"benchmark": "metadata", "env": environment(), "rows": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
