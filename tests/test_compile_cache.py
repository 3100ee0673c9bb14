"""funcmla.compile_cache: the directory choice (argument, environment, default, off)."""

import jax
import pytest

from funcmla.compile_cache import ENV_VAR, enable_compilation_cache


@pytest.fixture
def restore():
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)


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


def test_uncreatable_directory_names_the_variable(tmp_path, restore):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"{ENV_VAR}.*cannot create"):
        enable_compilation_cache(blocker / "sub")
