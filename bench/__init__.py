"""funcmla's benchmarks (installed as `funcmla.bench`; `python -m bench.<name>` from a checkout).

`funcmla bench [metadata|planners|decode|interop|all] [--quick] [--out DIR]` runs them; each
writes JSON (and plots) under `--out`. Timing helpers shared by all of them: `timing`.
"""
