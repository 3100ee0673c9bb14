"""The JSON report of a GPU check script (`bench.launcher`, `bench.torch_path`): named sections
that record their error and keep the others running, and a file rewritten after every section,
so that a run stopped at its time limit still reports what it measured."""

from __future__ import annotations

import json
import re
import time
import traceback
from typing import Callable


def log(*a) -> None:
    print(*a, flush=True)


def card_tag(device_name: str) -> str:
    """The card's model as a file-name suffix ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA
    H200" -> "h200"; "gpu" when no model is named), so that a script's default result file
    names the card it ran on."""
    m = re.search(r"\b([A-Z]+\d{2,4}[A-Z]?)\b", device_name.replace("NVIDIA", ""))
    return m.group(1).lower() if m else "gpu"


class Report:
    """`results` (a dict with an "errors" dict) written to `path` (set once the output folder is
    known) by `save` and after each `section`."""

    def __init__(self, results: dict):
        results.setdefault("errors", {})
        self.results = results
        self.path: str | None = None

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.results, f, indent=1, default=str)

    def section(self, name: str) -> Callable[[Callable], Callable]:
        """Decorator: run the function under a heading and its wall time; an exception is
        recorded under results["errors"][name] and printed, not raised; the report is saved."""
        def deco(fn):
            def run(*args, **kw):
                t0 = time.perf_counter()
                log(f"\n=== {name}")
                try:
                    return fn(*args, **kw)
                except Exception as err:  # noqa: BLE001 - keep the other sections running
                    self.results["errors"][name] = f"{type(err).__name__}: {err}"
                    log(traceback.format_exc())
                finally:
                    log(f"=== {name}: {time.perf_counter() - t0:.1f} s")
                    self.save()
            return run
        return deco
