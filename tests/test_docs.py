"""The documentation: every public name has a docstring, and the site builds without warnings."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

import curvax

ROOT = Path(__file__).resolve().parent.parent


def _public_objects() -> list[tuple[str, object]]:
    """Every name in ``curvax.__all__`` and every public function/class of the public submodules."""
    out = []
    for name in curvax.__all__:
        obj = getattr(curvax, name)
        out.append((f"curvax.{name}", obj))
        if isinstance(obj, types.ModuleType):
            names = getattr(obj, "__all__", None) or [n for n in vars(obj) if not n.startswith("_")]
            for sub in names:
                member = getattr(obj, sub, None)
                if inspect.isfunction(member) or inspect.isclass(member):
                    if (getattr(member, "__module__", "") or "").startswith("curvax"):
                        out.append((f"curvax.{name}.{sub}", member))
    return out


def test_every_public_name_has_a_docstring():
    missing = sorted({label for label, obj in _public_objects() if not (inspect.getdoc(obj) or "").strip()})
    assert not missing, f"public names without a docstring: {missing}"


def test_public_methods_of_exported_classes_have_docstrings():
    missing = []
    for name in curvax.__all__:
        cls = getattr(curvax, name)
        if not inspect.isclass(cls) or not cls.__module__.startswith("curvax"):
            continue
        for attr, member in vars(cls).items():
            if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            if not (inspect.getdoc(member) or "").strip():
                missing.append(f"curvax.{name}.{attr}")
    assert not missing, f"public methods without a docstring: {sorted(missing)}"


def _text(path: Path) -> str:
    """An HTML page's text, tags removed, whitespace collapsed."""
    import html
    import re

    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", path.read_text())))


def _docs_tree() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*") if "__pycache__" not in p.parts)


def test_docs_build_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    pytest.importorskip("furo")
    before = _docs_tree()
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    pages = list((tmp_path / "html").rglob("*.html"))
    assert len(pages) > 20
    api = (tmp_path / "html" / "_generated" / "api" / "curvax_optimizer.html").read_text()
    assert "value_and_grad_func" in api and "step" in api
    # autodoc's reStructuredText is rendered, not shown as raw text (napoleon's Args become fields).
    assert ".. py:method::" not in api and ":param value_and_grad_func:" not in api
    assert "Parameters" in api and 'id="curvax.Optimizer.step"' in api
    # The build leaves the source tree as it was (the generated pages live only during the build).
    assert _docs_tree() == before and not (ROOT / "docs" / "_generated").exists()
    pages = tmp_path / "html" / "_generated" / "api"
    # A property whose docstring reads "Sentence: more" keeps it as text, not as a "Type:" field.
    optimizer_page = _text(pages / "curvax_optimizer.html")
    assert "damping_decay_factor : float ¶ Factor applied to the damping per adaptive-damping update:" in optimizer_page
    assert "Type: Factor applied" not in optimizer_page
    # Constants are described by their source comment, not by str's docstring.
    assert "HAIKU_BIASES = 'b,bias'" in optimizer_page and "example values of regularized_parameters_path_exclusions" in optimizer_page
    assert "str(object='')" not in optimizer_page
    # kfac-jax's namespace modules list their members (re-exported objects included).
    blocks_page = _text(pages / "module_curvature_blocks.html")
    assert "DenseTwoKroneckerFactored" in blocks_page and "set_max_parallel_elements" in blocks_page
    assert "BlockDiagonalCurvature" in _text(pages / "module_curvature_estimator.html")
    layers_page = _text(pages / "module_layers.html")
    assert "register_conv2d" in layers_page and "register_embedding" in layers_page
    for page in pages.glob("module_*.html"):
        body = _text(page)
        assert len(body) > 1500 or "The same module as" in body, f"{page.name} lists no members"
