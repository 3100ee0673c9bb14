"""The decode launch configurations and the bitwise comparison that the torch-path GPU checks
(`bench.launcher`, `bench.torch_path`) share."""

from __future__ import annotations

from funcmla.config import MLADims

SCALE = MLADims().sm_scale  # DeepSeek-V3's softmax scale
FP8_SCALE = 0.03  # k_scale = v_scale of the fp8 cases (as bench.decode_fp8.KV_SCALE)


def launch_config(b: int, h: int, *, ctx: int, page_size: int = 1, splits: int | None = None,
                  s_q: int = 1, kv_dtype: str | None = None):
    """DecodeLaunchConfig for `b` sequences of up to `ctx` tokens and `h` heads: a token CSR
    over b * ctx + 64 pool rows (page_size 1), else a page table of ctx // page_size pages per
    sequence over b * ctx + 4 * page_size rows; kv_dtype: the pool's (None: q's bf16)."""
    from funcmla.interop import launcher as L

    if page_size == 1:
        return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q, pool_rows=b * ctx + 64,
                                    kv_capacity=b * ctx, max_kv_len=ctx, num_splits=splits,
                                    sm_scale=SCALE, kv_dtype=kv_dtype)
    return L.DecodeLaunchConfig(num_seqs=b, num_heads=h, s_q=s_q,
                                pool_rows=b * ctx + 4 * page_size,
                                kv_capacity=b * (ctx // page_size), num_splits=splits,
                                sm_scale=SCALE, page_size=page_size, kv_dtype=kv_dtype)


def same_bits(a, b) -> bool:
    """Two torch tensors (bf16, f16 or f32) of one shape and dtype hold the same bits."""
    import torch

    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.shape == b.shape and a.dtype == b.dtype and bool(
        torch.equal(a.contiguous().view(view[a.dtype]), b.contiguous().view(view[b.dtype])))


def misuse_checks(lau, q, kv, x, y, extra_cases: dict, *, sync) -> dict:
    """Calls of launcher `lau` with one argument wrong (dtype, layout, device, shape, alignment
    of q, kv, out, lse, plus `extra_cases` for x / y, k_scale / v_scale): each must raise
    LauncherArgumentError and leave out / lse untouched (nothing launched).
    {case: {"error", "untouched", "ok"}}."""
    import torch

    from funcmla.interop import launcher as L

    t, h = q.shape[0], q.shape[1]
    out = torch.full((t, h, 512), 7.0, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((t, h), 7.0, device=q.device)
    qbig = torch.zeros(q.numel() + 8, dtype=q.dtype, device=q.device)
    cases = {
        "q_float32": dict(q=q.float()),
        "q_noncontig": dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)),
        "q_cpu": dict(q=q.cpu()),
        "q_shape": dict(q=q[:-1].contiguous()),
        "q_misaligned": dict(q=qbig[1:1 + q.numel()].view(q.shape)),
        "kv_pool_rows": dict(kv=kv[:-1]),
        **extra_cases,
        "out_dtype": dict(out=out.float()),
        "lse_shape": dict(lse=lse[:-1]),
    }
    res = {}
    for case, kw in cases.items():
        a = dict(q=q, kv=kv, x=x, y=y, out=out, lse=lse)
        a.update(kw)
        scales = {k: a[k] for k in ("k_scale", "v_scale") if k in a}
        sync()
        try:
            lau(a["q"], a["kv"], a["x"], a["y"], out=a["out"], lse=a["lse"], **scales)
            raised = "no error"
        except L.LauncherArgumentError as err:
            raised = str(err)
        sync()
        untouched = bool((out == 7).all()) and bool((lse == 7).all())
        res[case] = {"error": raised, "untouched": untouched,
                     "ok": raised != "no error" and untouched}
    return res


def graph_replay_checks(lau, qs, kvs, x, y, new_inputs, jax_ref, *, sync, log, steps: int = 2,
                        scales: list[dict] | None = None):
    """Capture one `lau` call per layer (q, kv of `qs[i]`, `kvs[i]`; shared x, y; an fp8
    pool's k_scale / v_scale keywords `scales[i]`) in a CUDA graph, then `steps` times refill
    x, y (`new_inputs(step)` -> (x, y)) and every q in place and replay. Each step checks the
    replay against uncaptured calls and layer 0 against the JAX path (`jax_ref(q, kv, x, y)`,
    at layer 0's scales), bit for bit, and that the outputs changed since the last step.
    Returns (the per-step checks, the graph)."""
    import torch

    layers = len(qs)
    kw = scales or [{}] * layers
    t, h = qs[0].shape[0], qs[0].shape[1]
    dev = qs[0].device
    outs = [torch.empty(t, h, 512, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    lses = [torch.empty(t, h, device=dev) for _ in range(layers)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(layers):
            lau(qs[i], kvs[i], x, y, out=outs[i], lse=lses[i], **kw[i])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            lau(qs[i], kvs[i], x, y, out=outs[i], lse=lses[i], **kw[i])
    res, prev = [], None
    for step in range(steps):
        nx, ny = new_inputs(step)
        x.copy_(nx)
        y.copy_(ny)
        for i in range(layers):
            qs[i].copy_(torch.randn(t, h, qs[i].shape[2], device=dev).to(torch.bfloat16))
        g.replay()
        sync()
        got = [(o.clone(), ls.clone()) for o, ls in zip(outs, lses)]
        ref = [lau(qs[i], kvs[i], x, y, **kw[i]) for i in range(layers)]
        jref = jax_ref(qs[0], kvs[0], x, y)
        sync()
        r = {"replay_equals_uncaptured": all(same_bits(a[0], b[0]) and same_bits(a[1], b[1])
                                             for a, b in zip(got, ref)),
             "changed_since_last_step": prev is None or not all(
                 same_bits(a[0], b[0]) for a, b in zip(got, prev)),
             "layer0_bitwise_jax": same_bits(got[0][0], jref[0])
             and same_bits(got[0][1], jref[1])}
        res.append(r)
        log(("PASS " if all(r.values()) else "FAIL ") + f"step {step}", r)
        prev = got
    return res, g
