"""JAX's persistent compilation cache for funcmla's entry points (CLI, demo, SGLang backend).

The metadata and plan programs take seconds to compile; with the cache on, a second process
(a server restart, the next CLI call) loads them from disk instead. The choice, in order: the
`path` argument (a directory, or "off"); `$FUNCMLA_COMPILATION_CACHE=off`; a directory the user
already gave JAX (`jax_compilation_cache_dir`), which is kept; `$FUNCMLA_COMPILATION_CACHE` as a
directory; `~/.cache/funcmla/jax`. The choice takes effect at the next compile even when JAX
has already opened a cache in this process: JAX opens its cache once, at its first compile, so
a changed directory or "off" closes the open one (`reset_cache`). "off" stops every read and
write of the disk cache from then on; programs this process compiled before stay in its memory.
Timings: `python -m bench.interop` (first step per bucket).
"""

from __future__ import annotations

import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = ["ENV_VAR", "enable_compilation_cache"]

ENV_VAR = "FUNCMLA_COMPILATION_CACHE"
_DEFAULT = pathlib.Path("~/.cache/funcmla/jax")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on, or off; returns the directory in use (None:
    off). An explicit "off" (argument or environment) wins over a directory already set in JAX,
    since asking for no cache must never leave one running; a directory from the environment
    does not replace the user's own JAX setting."""
    choice = os.fspath(path) if path is not None else os.environ.get(ENV_VAR, "")
    if choice.lower() == "off":
        _use_cache_dir(None)
        return None
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        return current  # the user's own setting wins
    directory = pathlib.Path(choice or _DEFAULT).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{ENV_VAR} / path: cannot create the compilation cache directory "
                         f"{directory} ({err})") from err
    _use_cache_dir(str(directory))
    # cache every program that took at least 0.5 s to compile (the metadata programs do)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return str(directory)


def _use_cache_dir(directory: str | None) -> None:
    """Point JAX's cache at `directory` (None: no cache) from the next compile on. JAX keeps the
    cache it opened at its first compile whatever the setting says later, so a changed setting
    closes it (`reset_cache`); "off" closes it even when the setting is already None, since a
    cache opened before the setting was cleared stays open."""
    if directory is not None and directory == jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    _jax_cache.reset_cache()
