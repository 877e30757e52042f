"""Sphinx extension: API reference pages for every public name, generated at build time.

Each name in ``curvax.__all__`` is documented on the page of the module that defines it (one page
per module, titled by the module's first docstring line); public submodules (``curvax.laplace``,
``curvax.utils``, the kfac-jax compatibility namespaces, ...) get a page each. Nothing is listed by
hand, so a new public name appears without editing the docs, and ``tests/test_docs.py`` checks
that every one of them has a docstring.

A submodule page lists the module's members one by one (``__all__``, or its public classes and
functions defined in curvax): most of kfac-jax's module names re-export objects defined
elsewhere, which ``automodule``'s ``:members:`` would leave out. Objects documented on another
page are linked there, not documented twice. Module-level constants (``HAIKU_BIASES``) are
documented from the comment above their assignment, not from their type's docstring. Property
docstrings of the form ``Sentence: more`` are kept as written (napoleon would read the sentence
as a type). The pages are written to ``docs/_generated/api`` when the build starts and the folder
is removed when it ends, so a build leaves the source tree as it found it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import shutil
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "_generated" / "api"


def public_names() -> dict[str, Any]:
    """``curvax.__all__`` as ``{name: object}``."""
    import curvax

    return {n: getattr(curvax, n) for n in curvax.__all__}


def public_submodules() -> dict[str, types.ModuleType]:
    """Public submodules exported by ``curvax`` (by their attribute name)."""
    return {n: o for n, o in public_names().items() if isinstance(o, types.ModuleType)}


def _directive(name: str, obj: Any) -> str:
    # autodoc emits reStructuredText (members, napoleon's Args/Returns fields): in a MyST page it
    # must run inside ``eval-rst``, or that output is read as Markdown and shows up as raw text.
    if inspect.isclass(obj):
        return f"```{{eval-rst}}\n.. autoclass:: curvax.{name}\n   :members:\n```\n"
    if _is_function(obj):
        return f"```{{eval-rst}}\n.. autofunction:: curvax.{name}\n```\n"
    return _data_directive(f"curvax.{name}", obj, name)


def _is_function(obj: Any) -> bool:
    """Functions (also wrapped or built-in ones); a typing alias or a namespace is data."""
    return inspect.isroutine(obj) or (callable(obj) and hasattr(obj, "__wrapped__")) or type(obj).__name__ == "PjitFunction"


def _source_comment(name: str, obj: Any) -> str:
    """The docstring right after ``name = ...`` or the comment block above it (skipping the
    assignments right above it that share that comment), in the curvax module that assigns it."""
    for mod_name, mod in sorted(sys.modules.items()):
        if not mod_name.startswith("curvax") or getattr(mod, name, _MISSING) is not obj:
            continue
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        body = ast.parse(source).body
        for k, node in enumerate(body):
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                targets = [node.target.id]
            if name not in targets:
                continue
            after = body[k + 1] if k + 1 < len(body) else None
            if isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant) \
                    and isinstance(after.value.value, str):
                return " ".join(inspect.cleandoc(after.value.value).split())
            i = node.lineno - 2
            while i >= 0 and re.match(r"^[A-Za-z_][A-Za-z0-9_]* = ", lines[i]):
                i -= 1
            comment = []
            while i >= 0 and lines[i].startswith("#"):
                comment.insert(0, lines[i].lstrip("#").strip())
                i -= 1
            if comment:  # the comment's `name` spans are code, as in docstrings
                return re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", " ".join(comment))
    return ""


_MISSING = object()


def _defining_module(name: str, obj: Any) -> str | None:
    """The curvax module whose source assigns ``name`` (for constants, which have no ``__module__``)."""
    for mod_name, mod in sorted(sys.modules.items()):
        if mod_name.startswith("curvax") and getattr(mod, name, _MISSING) is obj:
            try:
                tree = ast.parse(inspect.getsource(mod))
            except (OSError, TypeError, SyntaxError):
                continue
            if any(isinstance(t, ast.Name) and t.id == name for node in tree.body for t in getattr(node, "targets", [])):
                return mod_name
    return None


def _data_directive(target: str, obj: Any, name: str, no_index: bool = False) -> str:
    """``py:data`` with the value and the source comment (autodata would show the type's docstring)."""
    text = _source_comment(name, obj)
    if not text and (type(obj).__module__ or "").startswith("curvax"):
        text = f"A ``{type(obj).__name__}``: {_first_line(inspect.getdoc(type(obj)))}."
    text = text or "A module-level constant."
    value = repr(obj) if len(repr(obj)) < 200 else type(obj).__name__
    opts = "   :no-index:\n" if no_index else ""
    return f"```{{eval-rst}}\n.. py:data:: {target}\n   :value: {value}\n{opts}\n   {text}\n```\n"


def _module_members(mod: types.ModuleType) -> list[tuple[str, Any]]:
    """``__all__``, or the public classes, functions and curvax submodules a module holds."""
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, o in vars(mod).items() if not n.startswith("_") and (
            ((inspect.isclass(o) or inspect.isfunction(o)) and (getattr(o, "__module__", "") or "").startswith("curvax"))
            or (isinstance(o, types.ModuleType) and o.__name__.startswith(mod.__name__ + ".")))]
    return [(n, getattr(mod, n)) for n in names if hasattr(mod, n)]


def _module_page(attr: str, mod: types.ModuleType, documented: dict[int, str]) -> str:
    """A submodule's page: each member documented here once, or linked to the page that has it."""
    body = [f"# `curvax.{attr}`\n", f"```{{eval-rst}}\n.. automodule:: {mod.__name__}\n   :no-index:\n   :no-members:\n```\n"]
    linked, sub_sections = [], []
    for name, obj in sorted(_module_members(mod), key=lambda t: t[0].lower()):
        if isinstance(obj, types.ModuleType):
            sub_sections.append(_module_section(f"{attr}.{name}", obj, documented))
            continue
        target = f"curvax.{attr}.{name}"
        if id(obj) in documented:
            summary = _first_line(inspect.getdoc(obj)) if (inspect.isclass(obj) or _is_function(obj)) else ""
            linked.append(f"- `{name}`: {{py:obj}}`{documented[id(obj)]}`" + (f" — {summary}" if summary else ""))
            continue
        documented[id(obj)] = target
        if inspect.isclass(obj):
            body.append(f"```{{eval-rst}}\n.. autoclass:: {target}\n   :members:\n```\n")
        elif _is_function(obj):
            body.append(f"```{{eval-rst}}\n.. autofunction:: {target}\n```\n")
        else:
            body.append(_data_directive(target, obj, name))
    if linked:
        body.append("## Documented on other pages\n\n" + "\n".join(linked) + "\n")
    return "\n".join(body + sub_sections)


def _module_section(label: str, mod: types.ModuleType, documented: dict[int, str]) -> str:
    page = _module_page(label, mod, documented)
    return "\n".join(("#" + line) if line.startswith("#") else line for line in page.splitlines()) + "\n"


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0].rstrip(".") if doc and doc.strip() else ""


def generate(app: Any = None) -> list[str]:
    import curvax

    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.md"):
        old.unlink()
    by_module: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for name, obj in public_names().items():
        if isinstance(obj, types.ModuleType):
            continue
        home = getattr(obj, "__module__", None) if (inspect.isclass(obj) or _is_function(obj)) else _defining_module(name, obj)
        by_module[home or "curvax"].append((name, obj))
    pages = []
    documented = {id(o): f"curvax.{n}" for n, o in public_names().items() if not isinstance(o, types.ModuleType)}
    for mod_name in sorted(by_module):
        mod = importlib.import_module(mod_name) if mod_name.startswith("curvax") else None
        title = f"`{mod_name}`" + (f": {_first_line(mod.__doc__)}" if mod is not None and mod.__doc__ else "")
        body = [f"# {title}\n"]
        for name, obj in sorted(by_module[mod_name], key=lambda t: t[0].lower()):
            body.append(_directive(name, obj))
        page = mod_name.replace(".", "_")
        (OUT / f"{page}.md").write_text("\n".join(body))
        pages.append(page)
    seen_modules: dict[int, str] = {}
    for attr, mod in sorted(public_submodules().items()):
        page = f"module_{attr}"
        if id(mod) in seen_modules:  # kfac-jax's name for a module documented under curvax's
            other = seen_modules[id(mod)]
            (OUT / f"{page}.md").write_text(
                f"# `curvax.{attr}`\n\nThe same module as [`curvax.{other}`](module_{other}.md) "
                f"(kfac-jax's name for it).\n")
        else:
            seen_modules[id(mod)] = attr
            (OUT / f"{page}.md").write_text(_module_page(attr, mod, documented))
        pages.append(page)
    del curvax
    toc = "\n".join(pages)
    (OUT / "index.md").write_text(
        "# API reference\n\nEvery name in `curvax.__all__`, on the page of the module that defines it, "
        "then every public submodule. kfac-jax's module names (`loss_functions`, `curvature_blocks`, ...) "
        "are submodules too.\n\n```{toctree}\n:maxdepth: 1\n\n" + toc + "\n```\n"
    )
    return pages


def keep_property_sentences(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Undoes napoleon's reading of ``Sentence: more`` as ``type: description`` in a property's,
    attribute's or constant's docstring: a ``:type:`` napoleon made from text with a space outside
    brackets (not a type expression) goes back in front of the description."""
    if what not in ("property", "attribute", "data"):
        return
    for k, line in enumerate(lines):
        if not line.startswith(":type: "):
            continue
        head = line[len(":type: "):]
        if not re.search(r"\s", re.sub(r"\[.*?\]|`.*?`", "", head).strip()):
            return  # a real type
        del lines[k]
        if k > 0 and not lines[k - 1].strip():
            del lines[k - 1]
        first = next((j for j, text in enumerate(lines) if text.strip()), None)
        if first is None:
            lines.insert(0, head)
        else:
            lines[first] = f"{head}: {lines[first].lstrip()}"
        return


def remove_generated(app: Any, exception: Exception | None) -> None:
    """Removes ``docs/_generated`` (API pages, benchmark tables and plots) after the build."""
    shutil.rmtree(OUT.parent, ignore_errors=True)


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    # after napoleon's handler (priority 500)
    app.connect("autodoc-process-docstring", keep_property_sentences, priority=600)
    app.connect("build-finished", remove_generated, priority=900)
    return {"version": "1", "parallel_read_safe": True}
