"""The bad-input battery's case type: one class of bad input, the call that makes it, and the
error a user must get (type, and a message naming the field and the value or limit).

Each area of the public surface lists its cases in `tests/bad_inputs_<area>.py` as
`CASES: list[BadInput]`; `tests/test_bad_inputs.py` runs them all, and `docs/errors.md` lists
every class with its error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class BadInput:
    """name: unique id of the class (`area.what`); call: makes the bad call (takes no argument);
    error: the exception type; match: regexes that must all appear in `str(exception)`,
    at least one naming the field and one the value or the limit."""

    name: str
    call: Callable[[], Any]
    error: type[BaseException]
    match: tuple[str, ...]
    needs: tuple[str, ...] = ()  # optional requirements: "torch", "gpu"
