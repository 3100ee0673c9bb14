"""bench.sass_loops: natural loops of an `nvdisasm -c` listing and the spills inside them, on
listings in nvdisasm's format: a loop holding a barrier wait whose retry block sits after the
function's exit, a wait alone (its retry block branching back is no loop), unreachable code."""

from __future__ import annotations

from bench.sass_loops import loop_spills, loops, parse_sass


def _listing(lines: list[str]) -> str:
    """nvdisasm -c lines: labels as they are, instructions at 16-byte addresses."""
    out, addr = [], 0
    for ln in lines:
        if ln.startswith(".L"):
            out.append(ln)
        else:
            out.append(f"        /*{addr:04x}*/                   {ln} ;")
            addr += 16
    return "\n".join(out) + "\n"


WAIT = "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2"
LOOP = _listing(
    ["MOV R1, c[0x0][0x28]", "STL [R1], R2",
     ".L_x_0:", "LDL.64 R6, [R1+0x8]"] + ["IMAD R4, R4, 0x3, RZ"] * 40 +
    [WAIT, "@!P1 BRA `(.L_x_9)",
     ".L_x_5:", "ISETP.NE.AND P0, PT, R4, RZ, PT", "@P0 BRA `(.L_x_0)", "EXIT",
     ".L_x_9:", WAIT, "@!P1 BRA `(.L_x_9)", "BRA `(.L_x_5)",
     ".L_x_10:", "BRA `(.L_x_10)"])


def test_parses_addresses_predicates_opcodes_and_labels():
    instrs = parse_sass(LOOP)
    assert instrs[2].addr == 0x20 and instrs[2].opcode == "LDL" and instrs[2].labels == (".L_x_0",)
    bra = instrs[44]
    assert (bra.opcode, bra.predicated, bra.target) == ("BRA", True, ".L_x_9")
    assert instrs[-1].target == ".L_x_10" and not instrs[-1].predicated


def test_loop_with_a_wait_holds_its_retry_block_and_its_spill():
    """The loop runs from .L_x_0 to the back edge and takes in the out-of-line retry block
    (it returns into the loop); the retry block's own spin is a loop of 2 instructions, left
    out by size; the STL before the loop and the unreachable self-branch are in no loop."""
    assert loop_spills(LOOP) == [
        {"header": "0x20", "instructions": 48, "spill_loads": 1, "spill_stores": 0}]
    spins = [(head, idx) for head, idx in loops(parse_sass(LOOP)) if len(idx) < 32]
    assert [len(idx) for _, idx in spins] == [2]


def test_a_wait_alone_is_no_loop():
    """A retry block that branches back to the code after the wait does not make that code a
    loop: the continuation does not dominate the retry block."""
    text = _listing(["MOV R1, c[0x0][0x28]", WAIT, "@!P1 BRA `(.L_x_1)",
                     ".L_x_2:", "STL [R1], R2", "EXIT",
                     ".L_x_1:", WAIT, "@!P1 BRA `(.L_x_1)", "BRA `(.L_x_2)"])
    found = loop_spills(text, min_instructions=1)
    assert found == [{"header": "0x50", "instructions": 2, "spill_loads": 0,
                      "spill_stores": 0}]
