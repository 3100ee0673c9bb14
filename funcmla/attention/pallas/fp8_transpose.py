"""4 x 4 byte-block transposes by PTX `prmt`: how the fp8-products decode path turns V's
token-major fp8 rows into the token-contiguous words an 8-bit `wgmma` operand needs (V's K axis
is the token axis; 8-bit operands must be K-major), with no conversion.

Four words hold tokens 0-3 of the same 4 columns (byte j of a word: column j). A first round
of `prmt` pairs the words of tokens (0, 1) and (2, 3) into X (two columns, each as its two
tokens) and Y (the other two columns); a second round joins X of tokens 0-1 with X of tokens
2-3 (and Y with Y) into one word a column, its 4 tokens in order. The first round's selectors
(`pair_select`) choose which columns go to X and Y and in what order, and take a pair loaded in
the other order (odd token first), so a kernel may permute its loads and its output columns
per thread (to spread them over shared-memory banks) at no cost in the loop: only those
selectors differ between threads.

`transpose_4x4` is written over a `prmt(a, b, selector)` and a `const(int)` it is given: MLIR
emitters inside the kernel (`decode_mgpu_fp8_wide._transpose_v`), Python ints in the test that
emulates it byte for byte.
"""

from __future__ import annotations

__all__ = ["PAIR_LO", "PAIR_HI", "pair_select", "transpose_4x4"]

# The second round: [X01 byte 0, X01 byte 1, X23 byte 0, X23 byte 1] (the first column of X, its
# 4 tokens) and the same of bytes 2, 3 (the second).
PAIR_LO, PAIR_HI = 0x5410, 0x7632


def pair_select(x0: int, x1: int, swap: int) -> int:
    """The `prmt` selector taking columns x0 and x1 (bytes of a token word) of two tokens' words
    A (bytes 0-3) and B (4-7) into [A x0, B x0, A x1, B x1]; with swap, A and B trade places
    (the thread loaded the token pair in the other order)."""
    a, b = (4, 0) if swap else (0, 4)
    return (a + x0) | (b + x0) << 4 | (a + x1) << 8 | (b + x1) << 12


def transpose_4x4(prmt, words, sel_x, sel_y, const):
    """words [4]: the same 4 columns of tokens 0-3 (pairs (0, 1) and (2, 3), each in the order
    `sel_x` / `sel_y` were built for) -> [4] words, word i the 4 tokens of column x_i, where
    sel_x = pair_select(x0, x1, swap) and sel_y = pair_select(x2, x3, swap)."""
    x01, y01 = prmt(words[0], words[1], sel_x), prmt(words[0], words[1], sel_y)
    x23, y23 = prmt(words[2], words[3], sel_x), prmt(words[2], words[3], sel_y)
    lo, hi = const(PAIR_LO), const(PAIR_HI)
    return [prmt(x01, x23, lo), prmt(x01, x23, hi), prmt(y01, y23, lo), prmt(y01, y23, hi)]
