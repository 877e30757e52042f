"""curvax's import structure: no import circle, the layering of ``benchmarks/structure.py`` holds.

The graph counts every import, function-local ones included. The checks are run on
small synthetic packages too, so that a circle or an upward import is shown to be found.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
import textwrap
from types import ModuleType

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "structure.py"


def _load_structure() -> ModuleType:
    spec = importlib.util.spec_from_file_location("curvax_benchmarks_structure", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass/typing lookups resolve the module by name
    spec.loader.exec_module(module)
    return module


structure = _load_structure()


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return structure.import_graph()


def test_no_import_circle(graph):
    assert structure.circles(graph) == []


def test_core_does_not_import_the_compatibility_layer(graph):
    # Only curvax/__init__.py (the public surface) and the compatibility layer itself may import it.
    assert structure.compat_imports(graph) == []


def test_every_module_has_a_layer(graph):
    assert structure.unplaced(graph) == [], "add these modules to a layer in benchmarks/structure.py:LAYERS"


def test_lower_layers_never_import_higher_ones(graph):
    upward = [
        f"{m} ({structure.LAYERS[structure.layer_of(m)][0]}) -> {i} ({structure.LAYERS[structure.layer_of(i)][0]})"
        for m, i in structure.upward_imports(graph)
    ]
    assert upward == []


def test_the_graph_sees_the_known_edges(graph):
    # A sanity check of the reader itself on curvax: a few imports that must be there.
    assert "curvax.tags" in graph["curvax.losses"]
    assert "curvax.tracing" in graph["curvax.blocks"]  # LayerData / LayerVjpData
    assert "curvax.blocks" in graph["curvax.kfac_api.curvature_blocks"]
    assert structure.layer_of("curvax.kfac_api.tracer") > structure.layer_of("curvax.optimizer")
    assert structure.layer_of("curvax.layers.conv") == structure.layer_of("curvax.blocks")


# The size limits of the house standards: no class over 600 lines, no function over 100.
MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 100


def test_no_class_over_the_size_limit():
    too_long = [(n, name) for n, name in structure.longest(ast.ClassDef, 10) if n > MAX_CLASS_LINES]
    assert too_long == [], f"classes over {MAX_CLASS_LINES} lines (split them): {too_long}"


def test_no_function_over_the_size_limit():
    too_long = [(n, name) for n, name in structure.longest((ast.FunctionDef, ast.AsyncFunctionDef), 10) if n > MAX_FUNCTION_LINES]
    assert too_long == [], f"functions over {MAX_FUNCTION_LINES} lines (split them): {too_long}"


# --- the checker on synthetic packages ----------------------------------------------------


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "from pkg import a\n",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from pkg.a import thing\n    return thing\n",
        "c.py": "import pkg.a\n",
    })
    graph = structure.import_graph(package)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg"] == set()  # a package's __init__ importing its own submodules is no edge
    assert structure.circles(graph) == [["pkg.a", "pkg.b"]]


def test_relative_imports_and_subpackages(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "",
        "low.py": "",
        "sub/__init__.py": "from . import leaf\n",
        "sub/leaf.py": "from .. import low\nfrom ..high import x\n",
        "high.py": "from .sub.leaf import y\n",
    })
    graph = structure.import_graph(package)
    assert graph["pkg.sub.leaf"] == {"pkg.low", "pkg.high"}
    assert graph["pkg.high"] == {"pkg.sub.leaf"}
    assert structure.circles(graph) == [["pkg.high", "pkg.sub.leaf"]]


def test_upward_and_compatibility_imports_are_found(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "from pkg import compat\n",
        "base.py": "def f():\n    import pkg.top\n",
        "top.py": "from pkg import base\n",
        "misc.py": "",
        "compat/__init__.py": "",
        "compat/names.py": "from pkg.base import f\n",
        "user.py": "from pkg.compat.names import f\n",
    })
    graph = structure.import_graph(package)
    layers = (("low", ("pkg.base", "pkg.user")), ("high", ("pkg.top", "pkg.compat")), ("surface", ("pkg",)))
    assert structure.upward_imports(graph, layers) == [("pkg.base", "pkg.top"), ("pkg.user", "pkg.compat.names")]
    assert structure.unplaced(graph, layers) == ["pkg.misc"]  # the root entry does not cover submodules
    assert structure.compat_imports(graph, ("pkg.compat",), surface="pkg") == [("pkg.user", "pkg.compat.names")]
    assert structure.circles(graph) == [["pkg.base", "pkg.top"]]


def test_longest_measures_classes_and_functions_with_their_bodies(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    package = _package(tmp_path, {
        "__init__.py": "",
        "m.py": f"class Big:\n    def f(self):\n{body}\n\n    def g(self):\n        pass\n\n\ndef h():\n    pass\n",
    })
    assert structure.longest(ast.ClassDef, 5, package) == [(10, "pkg.m:Big")]
    assert structure.longest(ast.FunctionDef, 2, package) == [(6, "pkg.m:f"), (2, "pkg.m:h")]
