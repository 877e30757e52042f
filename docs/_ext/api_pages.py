"""Sphinx extension: API reference pages for every public name, generated at build time.

Each name in ``curvax.__all__`` is documented on the page of the module that defines it (one page
per module, titled by the module's first docstring line); public submodules (``curvax.laplace``,
``curvax.utils``, the kfac-jax compatibility namespaces, ...) get a page each. Nothing is listed by
hand, so a new public name appears without editing the docs, and ``tests/test_docs.py`` checks
that every one of them has a docstring.
"""

from __future__ import annotations

import inspect
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
    if callable(obj):
        return f"```{{eval-rst}}\n.. autofunction:: curvax.{name}\n```\n"
    return f"```{{eval-rst}}\n.. autodata:: curvax.{name}\n   :annotation:\n```\n"


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0].rstrip(".") if doc and doc.strip() else ""


def generate(app: Any = None) -> list[str]:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.md"):
        old.unlink()
    by_module: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for name, obj in public_names().items():
        if isinstance(obj, types.ModuleType):
            continue
        by_module[getattr(obj, "__module__", None) or "curvax"].append((name, obj))
    pages = []
    import importlib

    for mod_name in sorted(by_module):
        mod = importlib.import_module(mod_name) if mod_name.startswith("curvax") else None
        title = f"`{mod_name}`" + (f": {_first_line(mod.__doc__)}" if mod is not None and mod.__doc__ else "")
        body = [f"# {title}\n"]
        for name, obj in sorted(by_module[mod_name], key=lambda t: t[0].lower()):
            body.append(_directive(name, obj))
        page = mod_name.replace(".", "_")
        (OUT / f"{page}.md").write_text("\n".join(body))
        pages.append(page)
    for attr, mod in sorted(public_submodules().items()):
        page = f"module_{attr}"
        title = f"`curvax.{attr}`" + (f": {_first_line(mod.__doc__)}" if mod.__doc__ else "")
        # Members already documented on their module's page: not indexed twice (:no-index:).
        (OUT / f"{page}.md").write_text(
            f"# {title}\n\n```{{eval-rst}}\n.. automodule:: {mod.__name__}\n   :members:\n   :no-index:\n```\n"
        )
        pages.append(page)
    toc = "\n".join(pages)
    (OUT / "index.md").write_text(
        "# API reference\n\nEvery name in `curvax.__all__`, on the page of the module that defines it, "
        "then every public submodule. kfac-jax's module names (`loss_functions`, `curvature_blocks`, ...) "
        "are submodules too.\n\n```{toctree}\n:maxdepth: 1\n\n" + toc + "\n```\n"
    )
    return pages


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    return {"version": "1", "parallel_read_safe": True}
