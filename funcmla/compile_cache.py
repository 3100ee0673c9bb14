"""JAX's persistent compilation cache for funcmla's entry points (CLI, demo, SGLang backend).

The metadata and plan programs take seconds to compile; with the cache on, a second process
(a server restart, the next CLI call) loads them from disk instead. The directory is, in order:
the `path` argument, `$FUNCMLA_COMPILATION_CACHE`, `~/.cache/funcmla/jax`; the value "off"
turns the cache off. A directory the user already gave JAX (`jax_compilation_cache_dir`) is
kept. JAX reads the directory when it first compiles in a process, so set it before that
(the entry points call this first). Timings: `python -m bench.interop` (first step per bucket).
"""

from __future__ import annotations

import os
import pathlib

import jax

__all__ = ["ENV_VAR", "enable_compilation_cache"]

ENV_VAR = "FUNCMLA_COMPILATION_CACHE"
_DEFAULT = pathlib.Path("~/.cache/funcmla/jax")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on; returns the directory in use (None: off)."""
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        return current  # the user's own setting wins
    choice = os.fspath(path) if path is not None else os.environ.get(ENV_VAR, "")
    if choice.lower() == "off":
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    directory = pathlib.Path(choice or _DEFAULT).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{ENV_VAR} / path: cannot create the compilation cache directory "
                         f"{directory} ({err})") from err
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # cache every program that took at least 0.5 s to compile (the metadata programs do)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return str(directory)
