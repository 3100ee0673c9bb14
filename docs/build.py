"""Build the documentation's generated parts: `./dev docs [OUT_DIR]`.

* The API reference: HTML pages generated from the docstrings by pdoc (the `docs` extra) for
  every public module of `funcmla` and `funcmla.interop`, written to OUT_DIR (default
  `out/api/`; open `index.html`).
* The README's figure: `funcmla plan decode ... --plot docs/plan_decode_16cu.png`, the exact
  command in `FIGURES` (the README quotes it; tests/test_docs.py checks that they agree).

tests/test_docs.py runs `build_api` into a temporary folder, so a docstring that pdoc cannot
render, or a public module that cannot be imported, fails the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The documented package (with funcmla.interop, imported first so that the walk finds it);
# private modules (a leading underscore) and the benchmarks are not API.
API_SPECS = ("funcmla", r"!.*\._", r"!funcmla\.bench")

# README figures: file -> the `funcmla` arguments that draw it.
FIGURES = {
    "docs/plan_decode_16cu.png": (
        "plan", "decode", "--kv-lens", "8192,300,4096,17,0,12000,2048,700,5000,64,1500,9000",
        "--device", "custom:16", "--heads", "16", "--plot", "docs/plan_decode_16cu.png"),
}


def build_api(out_dir: str) -> list[str]:
    """Write the API reference HTML under `out_dir`; returns the documented module names."""
    import pdoc
    import pdoc.extract

    import funcmla.interop  # noqa: F401  (the torch shim: needs the `torch` extra)

    modules = pdoc.extract.walk_specs(list(API_SPECS))
    pdoc.pdoc(*API_SPECS, output_directory=pdoc.extract.Path(out_dir))
    return modules


def draw_figures() -> None:
    """Redraw every README figure with the command that `FIGURES` names."""
    for args in FIGURES.values():
        subprocess.run([sys.executable, "-m", "funcmla", *args], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = os.path.abspath(argv[0] if argv else os.path.join(ROOT, "out", "api"))
    modules = build_api(out)
    print(f"API reference: {len(modules)} modules -> {os.path.join(out, 'index.html')}")
    draw_figures()
    print("figures: " + ", ".join(FIGURES))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
