"""Where a kernel's register spills land: the loops of an `nvdisasm -c` SASS listing and the
local-memory loads (LDL) and stores (STL) inside each.

ptxas reports a kernel's spill bytes but not where they are; a spill reloaded on every trip
of a hot loop costs a local-memory round trip a tile (the fp8 products' V transpose reloaded
25 hoisted offsets a tile: docs/decode_kernel.md, decision log), while one in a kernel's
prologue or finish costs nothing that matters. Loops are the natural loops of the control-flow
graph (a back edge u -> h where h dominates u), so the out-of-line retry blocks of barrier
waits, which branch back to the code after the wait, are not taken for loops, and spin loops
of a few instructions are left out by size. Used by `bench.ptxas_report`.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Instr", "parse_sass", "loops", "loop_spills"]

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^(\.L\w+):")
_TARGET = re.compile(r"`\((\.L\w+)\)")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    predicated: bool
    opcode: str         # the base mnemonic: LDL for LDL.64, BRA for BRA.U
    target: str | None  # a branch's label
    labels: tuple[str, ...]  # the labels naming this instruction's address


def parse_sass(text: str) -> list[Instr]:
    """The instructions of an `nvdisasm -c` listing, in address order, each with the labels
    placed just before it."""
    out, pending = [], []
    for line in text.splitlines():
        if m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m is None:
            continue
        target = _TARGET.search(m.group(4))
        out.append(Instr(int(m.group(1), 16), m.group(2) is not None,
                         m.group(3).split(".")[0], target.group(1) if target else None,
                         tuple(pending)))
        pending = []
    return out


def _blocks(instrs: list[Instr]) -> tuple[list[range], list[list[int]]]:
    """Basic blocks (index ranges into instrs) and each block's successors."""
    at_label = {lab: i for i, ins in enumerate(instrs) for lab in ins.labels}
    starts = {0}
    for i, ins in enumerate(instrs):
        if ins.labels:
            starts.add(i)
        if ins.opcode in ("BRA", "EXIT", "RET", "BRX", "JMP") and i + 1 < len(instrs):
            starts.add(i + 1)
    starts = sorted(starts)
    spans = [range(a, b) for a, b in zip(starts, starts[1:] + [len(instrs)])]
    block_of = {span.start: k for k, span in enumerate(spans)}
    succ = []
    for k, span in enumerate(spans):
        last = instrs[span[-1]]
        nxt = [k + 1] if k + 1 < len(spans) else []
        if last.opcode == "BRA" and last.target in at_label:
            jump = [block_of[at_label[last.target]]]
            succ.append(jump + nxt if last.predicated else jump)
        elif last.opcode in ("EXIT", "RET", "BRX", "JMP"):
            succ.append(nxt if last.predicated else [])
        else:
            succ.append(nxt)
    return spans, succ


def _reachable(succ: list[list[int]]) -> set[int]:
    seen, stack = {0}, [0]
    while stack:
        for v in succ[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return seen


def _dominators(pred: dict[int, list[int]], live: set[int]) -> dict[int, set[int]]:
    """Each reachable block's dominators (block 0 the entry), from its predecessors."""
    dom = {v: set(live) for v in live}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for v in sorted(live - {0}):
            new = set.intersection(*(dom[p] for p in pred[v])) | {v}
            if new != dom[v]:
                dom[v], changed = new, True
    return dom


def loops(instrs: list[Instr]) -> list[tuple[int, list[int]]]:
    """The natural loops of the code reachable from the entry: (header's first instruction,
    the loop's sorted instruction indices), one per header (the union of its back edges'
    loops), in header order."""
    spans, succ = _blocks(instrs)
    live = _reachable(succ)
    pred = {v: [] for v in live}
    for u in live:
        for v in succ[u]:
            pred[v].append(u)
    dom = _dominators(pred, live)
    body: dict[int, set[int]] = {}
    for u in live:
        for h in succ[u]:
            if h in dom[u]:  # a back edge u -> h
                members, stack = {h, u}, ([u] if u != h else [])
                while stack:
                    for p in pred[stack.pop()]:
                        if p not in members:
                            members.add(p)
                            stack.append(p)
                body.setdefault(h, set()).update(members)
    return [(spans[h].start, sorted(i for k in body[h] for i in spans[k])) for h in sorted(body)]


def loop_spills(text: str, min_instructions: int = 32) -> list[dict]:
    """Per loop of at least `min_instructions` (barrier spin loops are a few): its header's
    address, its instruction count and its LDL / STL count (nested loops count in each loop
    that holds them)."""
    instrs = parse_sass(text)
    out = []
    for head, idx in loops(instrs):
        if len(idx) < min_instructions:
            continue
        ops = [instrs[i].opcode for i in idx]
        out.append({"header": f"{instrs[head].addr:#x}", "instructions": len(idx),
                    "spill_loads": ops.count("LDL"), "spill_stores": ops.count("STL")})
    return out
