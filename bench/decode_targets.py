"""The decode kernel's targets (docs/decode_kernel.md), judged from the rows of a `bench.decode`
grid.

The five targets (H200, device span per call):
  * 16 heads, batch >= 32, ctx >= 4k: >= 80% of the copy ceiling;
  * 128 heads, batch >= 32, ctx >= 4k: >= 550 TFLOP/s;
  * batch 1, ctx 4k: <= 20 us;
  * page size 1 within 10% of page size 64 (time ratio <= 1.10, each pair measured in the run);
  * relative error < 1e-2 against float32, in every case.

`target_verdicts(rows)` returns one dict per target: its cases (name, value, ok), how many
passed and the worst case. A target with no measured case is reported as not measured, never
as met. Run on a saved result: `python -m bench.decode_targets decode.json`.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Iterable

__all__ = ["target_verdicts", "print_verdicts", "case_label"]


def case_label(heads: int, batch: int, ctx: int, page_size: int) -> str:
    """A grid case's name, as printed and as `bench.decode --only` matches it."""
    return f"H{heads} B{batch} L{ctx} p{page_size}"


def _name(r: dict) -> str:
    return case_label(r["heads"], r["batch"], r["ctx"], r["page_size"])


def _judge(title: str, unit: str, cases: list[tuple[str, float]],
           ok: Callable[[float], bool], worst: Callable[[Iterable[float]], float]) -> dict:
    judged = [dict(case=n, value=v, ok=bool(ok(v))) for n, v in cases]
    worst_case = None
    if judged:
        w = worst(c["value"] for c in judged)
        worst_case = next(c for c in judged if c["value"] == w)
    return dict(target=title, unit=unit, cases=judged, passed=sum(c["ok"] for c in judged),
                measured=len(judged), met=bool(judged) and all(c["ok"] for c in judged),
                worst=worst_case)


def target_verdicts(rows: list[dict]) -> list[dict]:
    """rows: `bench.decode` grid rows (keys heads, batch, ctx, page_size, time_us,
    pct_ceiling, tflops, rel_err). Returns the five verdicts, in the order above."""
    big = [r for r in rows if r["batch"] >= 32 and r["ctx"] >= 4096]
    out = [
        _judge("H16, B >= 32, ctx >= 4k: >= 80% of the copy ceiling", "% ceiling",
               [(_name(r), r["pct_ceiling"]) for r in big if r["heads"] == 16],
               lambda v: v >= 80.0, min),
        _judge("H128, B >= 32, ctx >= 4k: >= 550 TFLOP/s", "TFLOP/s",
               [(_name(r), r["tflops"]) for r in big if r["heads"] == 128],
               lambda v: v >= 550.0, min),
        _judge("batch 1, ctx 4k: <= 20 us", "us",
               [(_name(r), r["time_us"]) for r in rows if r["batch"] == 1 and r["ctx"] == 4096],
               lambda v: v <= 20.0, max),
    ]
    by_key = {(r["heads"], r["batch"], r["ctx"], r["page_size"]): r for r in rows}
    pairs = []
    for (h, b, ctx, page_size), r1 in sorted(by_key.items()):
        r64 = by_key.get((h, b, ctx, 64))
        if page_size == 1 and r64 is not None:
            pairs.append((f"H{h} B{b} L{ctx} p1/p64", r1["time_us"] / r64["time_us"]))
    out.append(_judge("page 1 within 10% of page 64", "time ratio", pairs,
                      lambda v: v <= 1.10, max))
    out.append(_judge("rel err < 1e-2 vs float32", "rel err",
                      [(_name(r), r["rel_err"]) for r in rows if r.get("rel_err") is not None],
                      lambda v: v < 1e-2, max))
    return out


def print_verdicts(verdicts: list[dict], log: Callable[[str], None] = print) -> None:
    """One line per target: met / not met / not measured, passed of measured, worst case."""
    for v in verdicts:
        if not v["measured"]:
            log(f"   {v['target']}: not measured")
            continue
        w = v["worst"]
        state = "met" if v["met"] else "NOT met"
        log(f"   {v['target']}: {state} ({v['passed']} of {v['measured']}; worst {w['case']} "
            f"{w['value']:.4g} {v['unit']})")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.decode_targets decode.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        rows = json.load(f).get("grid", [])
    print_verdicts(target_verdicts(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
