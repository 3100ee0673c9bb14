"""Serialize the SGLang step program's XLA executables (fixtures for the step launcher).

    PYTHONPATH=. python -m bench.step_dump --out out/   # on a GPU with jaxlib 0.11.2

Compiles `funcmla.interop.sglang.step.build_step` for a few StepSpecs (decode at batch bucket
64 with page 1 and 64, target verify n=4, a CUDA-graph layout at max_bs 256, a step without
work plan) against req_to_token [256, 4096], writes each serialized executable
(`step_<name>.bin`), the optimized HLO of all of them (`step_hlo.txt`) and a summary of their
thunks (`step_summary.json`: thunk kinds, counts, buffer allocations).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import jax
import jax.numpy as jnp

from funcmla.config import H200
from funcmla.interop._containers import try_proto_fields
from funcmla.interop._xla_kernels import _serialized_executable, executable_records
from funcmla.interop.sglang.step import StepSpec, build_step, num_parts
from funcmla.interop.sglang.workplan import PlanSettings, plan_shapes

POOL, CTX = 256, 4096


def specs() -> dict[str, StepSpec]:
    p1 = PlanSettings(device=H200, num_heads=16, page_size=1)
    p64 = PlanSettings(device=H200, num_heads=16, page_size=64)
    pv = PlanSettings(device=H200, num_heads=16, page_size=1, num_draft_tokens=4)
    graph = tuple(sorted(plan_shapes(p64, "decode", 256, 1).items()))
    return {
        "decode_b64_p1": StepSpec("decode", 64, 1 << 18, 0, 1, p1),
        "decode_b64_p64": StepSpec("decode", 64, 1 << 18, 0, 1, p64),
        "verify_b64_n4": StepSpec("target_verify", 64, 1 << 18, 4, 4, pv),
        "graph_decode_b256_p64": StepSpec("decode", 256, 256 * 4096, 0, 1, p64, graph),
        "decode_b64_noplan": StepSpec("decode", 64, 1 << 18, 0, 1, None),
    }


def thunk_summary(buf: bytes, depth: int = 0, out=None):
    """Counts of ThunkProto oneof field numbers, recursively (sequential / while bodies)."""
    out = out if out is not None else collections.Counter()
    for f, w, v in try_proto_fields(buf) or ():
        if f == 1 or w != 2:
            continue
        out[f] += 1
        if f in (2, 7, 6, 18, 47, 57) and depth < 8:  # nested sequences
            for g, w2, v2 in try_proto_fields(v) or ():
                if w2 == 2:
                    for h, w3, v3 in try_proto_fields(v2) or ():
                        if w3 == 2:
                            thunk_summary(v3, depth + 1, out)
                    thunk_summary(v2, depth + 1, out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    summary, hlo = {"jax": jax.__version__, "pool": POOL, "ctx": CTX}, []
    r2t = jax.ShapeDtypeStruct((POOL, CTX), jnp.int32)
    for name, spec in specs().items():
        inputs = jax.ShapeDtypeStruct((num_parts(spec.kind) * spec.batch + 1,), jnp.int32)
        compiled = build_step.lower(r2t, inputs, spec=spec).compile()
        blob = _serialized_executable(compiled)
        with open(os.path.join(args.out, f"step_{name}.bin"), "wb") as f:
            f.write(blob)
        hlo.append(f"// ===== {name}: {spec}\n{compiled.as_text()}\n")
        recs = executable_records(blob)
        top = [(f, len(v)) for r in recs for f, w, v in (try_proto_fields(r) or ()) if w == 2]
        gpu = max(recs, key=len)
        kinds = collections.Counter()
        for f, w, v in try_proto_fields(gpu) or ():
            if f == 13 and w == 2:
                kinds[f"top:{[g for g, _, _ in try_proto_fields(v) if g != 1]}"] += 1
                thunk_summary(v, 0, kinds)
        summary[name] = dict(spec=repr(spec), bytes=len(blob), records=[len(r) for r in recs],
                             gpu_fields=sorted(collections.Counter(f for f, _ in top).items()),
                             thunk_kinds=dict(kinds))
        print(name, summary[name], flush=True)
    with open(os.path.join(args.out, "step_hlo.txt"), "w") as f:
        f.write("".join(hlo))
    with open(os.path.join(args.out, "step_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
