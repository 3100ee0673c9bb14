"""funcmla.compile_cache: the directory choice (argument, environment, default, off), and that the
choice takes effect in a process whose JAX has already opened a cache."""

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from funcmla.compile_cache import ENV_VAR, enable_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture
def restore():
    """The worker's cache settings back after the test, and its cache reopened under them."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def test_argument_environment_and_off(tmp_path, monkeypatch, restore):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert enable_compilation_cache() == str(tmp_path / "env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
    assert enable_compilation_cache() == str(tmp_path / "env")  # an existing setting is kept
    assert enable_compilation_cache(tmp_path / "arg") == str(tmp_path / "arg")
    assert (tmp_path / "arg").is_dir()
    assert enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir is None


def test_off_in_the_environment_wins_over_a_directory_set_in_jax(tmp_path, monkeypatch, restore):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    monkeypatch.setenv(ENV_VAR, "OFF")
    assert enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    # a directory in the environment does not replace the user's own setting
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert enable_compilation_cache() == str(tmp_path / "user")
    assert not (tmp_path / "env").exists()


def test_uncreatable_directory_names_the_variable(tmp_path, restore):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"{ENV_VAR}.*cannot create"):
        enable_compilation_cache(blocker / "sub")


# One process: the user's directory A opened by a first compile, then a new directory B, then
# FUNCMLA_COMPILATION_CACHE=off. Prints the entry counts of A and B and the cache hits after each.
_PROCESS = r"""
import json, os, sys
import jax, jax.numpy as jnp
from funcmla.compile_cache import ENV_VAR, enable_compilation_cache

a, b = sys.argv[1:3]
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)

def compile_fresh(scale):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs too
    jax.jit(lambda x: x * scale + 1.0)(jnp.ones(8)).block_until_ready()

def recompile(scale):  # the same program again, after the in-memory caches are dropped
    jax.clear_caches()
    compile_fresh(scale)

def state():
    return [len(os.listdir(d)) if os.path.isdir(d) else 0 for d in (a, b)] + [len(hits)]

jax.config.update("jax_compilation_cache_dir", a)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
out = {}
compile_fresh(3.0)
recompile(3.0)
out["user_dir"] = state()
enable_compilation_cache(b)
compile_fresh(5.0)
recompile(5.0)
out["new_dir"] = state()
os.environ[ENV_VAR] = "off"
out["returned"] = enable_compilation_cache()
recompile(5.0)
compile_fresh(7.0)
out["off"] = state()
print(json.dumps(out))
"""


def test_off_stops_a_cache_the_process_already_opened(tmp_path):
    """JAX opens its cache at the first compile and keeps it; a later directory must move the
    writes, and "off" must stop every read and write."""
    env = {k: v for k, v in os.environ.items()
           if k != ENV_VAR and not k.startswith("JAX_COMPILATION_CACHE")
           and not k.startswith("JAX_PERSISTENT_CACHE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _PROCESS, str(tmp_path / "a"), str(tmp_path / "b")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    a_files, b_files, hits = out["user_dir"]
    assert a_files > 0 and b_files == 0 and hits > 0  # the user's cache written, then read
    assert out["new_dir"][0] == a_files and out["new_dir"][1] > 0  # writes moved to B
    assert out["new_dir"][2] > hits  # and B is read
    assert out["returned"] is None
    assert out["off"] == out["new_dir"]  # off: no entry written, none read
