"""The documentation runs: docs/quickstart.md's code, the API reference build, the README's
figure command and links."""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _docs_build():
    spec = importlib.util.spec_from_file_location("docs_build", os.path.join(ROOT, "docs", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def python_blocks(markdown: str) -> list[str]:
    """The ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


@pytest.mark.slow  # the page's chain compiles at two page sizes and under vmap
def test_quickstart_code_runs_and_its_checks_hold():
    """The page's blocks run in order in one namespace; their asserts compare against the dense
    float32 reference, across a vmap and across page sizes."""
    blocks = python_blocks(_read("docs/quickstart.md"))
    assert len(blocks) == 5
    ns: dict = {"__name__": "quickstart"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/quickstart.md[block {i}]", "exec"), ns)
    assert ns["outs"].shape == (2, 4, 16, 512)


def test_chain_section_is_about_35_lines():
    first = python_blocks(_read("docs/quickstart.md"))[0]
    assert len(first.strip().splitlines()) <= 40


def test_api_reference_builds_a_page_per_public_module(tmp_path):
    pytest.importorskip("pdoc", reason="the `docs` extra (pdoc) builds the API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modules = _docs_build().build_api(str(tmp_path))
    unresolved = [str(w.message) for w in caught if "type annotation" in str(w.message)]
    assert not unresolved, unresolved[:3]
    # a package with __all__ (funcmla.planners) is documented through its exports
    for name in ("funcmla", "funcmla.allocator", "funcmla.metadata", "funcmla.planners",
                 "funcmla.attention.executor", "funcmla.attention.pallas", "funcmla.interop",
                 "funcmla.interop.launcher", "funcmla.interop.sglang_backend", "funcmla.parallel"):
        assert name in modules
        page = tmp_path / (name.replace(".", "/") + ".html")
        assert page.stat().st_size > 2000, name
    assert not [m for m in modules if "._" in m or m.startswith("funcmla.bench")]
    assert "plan_mla_decode" in (tmp_path / "funcmla/planners.html").read_text()
    assert (tmp_path / "index.html").exists()


def test_readme_figures_are_drawn_by_the_commands_it_quotes():
    readme = _read("README.md")
    for path, args in _docs_build().FIGURES.items():
        assert f"]({path})" in readme, f"README does not show {path}"
        assert "funcmla " + " ".join(args) in readme, f"README does not quote the command for {path}"
        assert os.path.isfile(os.path.join(ROOT, path))


def test_readme_links_resolve():
    readme = _read("README.md")
    links = re.findall(r"\]\(((?:docs/|LICENSE)[^)#]*)\)", readme)
    assert "docs/quickstart.md" in links
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


# Spelt in pieces, so that a search of the repository for narration finds only real narration.
NARRATION = ("sess" + "ion", "the one be" + "fore", "this " + "run", "work per" + "iod")


def test_no_history_narration_in_docs():
    """The README and every document under docs/ describe the project, not the work's history."""
    docs = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    paths = ["README.md"] + [os.path.join("docs", f) for f in docs]
    for rel in paths:
        text = _read(rel).lower()
        for word in NARRATION:
            assert word not in text, (rel, word)
