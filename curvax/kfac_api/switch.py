"""One switch for a whole package: every ``import kfac_jax...`` resolves to curvax.

``import curvax as kfac_jax`` switches one module. A package written against kfac-jax (FermiNet,
DeepQMC) imports ``kfac_jax`` in many modules, and some import its submodules
(``import kfac_jax.curvature_blocks``, ``from kfac_jax import utils``,
``from kfac_jax.loss_functions import ...``). :func:`install_as_kfac_jax` puts an import hook in
front of ``sys.meta_path`` so that all of those resolve to curvax's modules, without editing
the package:

* ``kfac_jax`` is ``curvax``; ``kfac_jax.<name>`` is ``curvax.<name>`` for each module kfac-jax
  0.0.8 exports (:data:`KFAC_JAX_MODULES`). The same module objects, not copies: ``kfac_jax.Optimizer
  is curvax.Optimizer``. Any other ``kfac_jax.<name>`` (kfac-jax's private ``_src`` tree) raises
  ``ModuleNotFoundError`` naming what curvax provides, rather than loading a second copy of a
  curvax module under another name.
* When ``kfac_jax`` is first imported, kfac-jax's import-time JAX settings are applied
  (:data:`KFAC_JAX_CONFIG`): kfac-jax 0.0.8's ``_src/optimizer.py`` sets
  ``jax_pmap_shmap_merge`` to False where the JAX in use has that option (JAX 0.9.0 has it; 0.10.2
  has no such option, and then nothing is set, as kfac-jax would do).

Three ways to turn it on, from the most to the least explicit:

1. In Python, before the package is imported::

       import curvax
       curvax.install_as_kfac_jax()
       import ferminet.train          # its `import kfac_jax...` lines now get curvax

2. From the command line, for a script or module you do not edit::

       python -m curvax.kfac_api.switch path/to/script.py ARGS...
       python -m curvax.kfac_api.switch -m ferminet.main ARGS...

   (This imports JAX before the script runs: set ``JAX_PLATFORMS`` and similar options in the
   environment rather than in the script.)
3. For every Python process of an environment, gated by an environment variable:
   ``python -m curvax.kfac_api.switch --write-pth`` writes ``curvax_kfac_jax.pth`` into
   site-packages; from then on ``CURVAX_AS_KFAC_JAX=1 python anything.py`` runs with the switch,
   and without the variable nothing changes. The ``.pth`` line loads this file alone (no JAX,
   no curvax until ``kfac_jax`` is imported), so the interpreter's start is not slowed and a
   script may still configure JAX before importing it.

This module imports only the standard library at import time, so that the ``.pth`` hook stays
light; curvax itself is imported when ``kfac_jax`` is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

# kfac-jax 0.0.8's public modules (``kfac_jax/__init__.py`` imports each from ``_src``) and the
# curvax module each one is.
KFAC_JAX_MODULES: dict[str, str] = {
    "kfac_jax": "curvax",
    "kfac_jax.curvature_blocks": "curvax.curvature_blocks",
    "kfac_jax.curvature_estimator": "curvax.curvature_estimator",
    "kfac_jax.layers_and_loss_tags": "curvax.layers_and_loss_tags",
    "kfac_jax.loss_functions": "curvax.loss_functions",
    "kfac_jax.optimizer": "curvax.optimizer",
    "kfac_jax.patches_second_moment": "curvax.patches_second_moment",
    "kfac_jax.tag_graph_matcher": "curvax.tag_graph_matcher",
    "kfac_jax.tracer": "curvax.tracer",
    "kfac_jax.utils": "curvax.utils",
}

# What kfac-jax 0.0.8 sets when it is imported (kfac_jax/_src/optimizer.py:
# ``if "jax_pmap_shmap_merge" in jax.config.values: jax.config.update("jax_pmap_shmap_merge", False)``).
KFAC_JAX_CONFIG: dict[str, Any] = {"jax_pmap_shmap_merge": False}

ENV_VAR = "CURVAX_AS_KFAC_JAX"
PTH_NAME = "curvax_kfac_jax.pth"
# One line, run by `site` at start-up: loads this file by path (no JAX, no curvax) when the
# variable is set. `find_spec("curvax")` locates the package without importing it.
PTH_LINE = (
    "import os, importlib.util; os.environ.get('" + ENV_VAR + "', '') not in ('', '0') and "
    "(lambda s, util: (s.loader.exec_module(m := util.module_from_spec(s)), m.install_as_kfac_jax()))("
    "importlib.util.spec_from_file_location('curvax_kfac_jax_switch', os.path.join(os.path.dirname("
    "importlib.util.find_spec('curvax').origin), 'kfac_api', 'switch.py')), importlib.util)\n"
)
# (`site` runs the line with `exec` inside a function: names it imports are not globals, so the
# lambda is given `importlib.util` as an argument.)


def apply_kfac_jax_config() -> dict[str, Any]:
    """Applies :data:`KFAC_JAX_CONFIG` where this JAX has the option; returns what was set."""
    import jax

    applied = {}
    for name, value in KFAC_JAX_CONFIG.items():
        if name in jax.config.values:
            jax.config.update(name, value)
            applied[name] = value
    return applied


class KfacJaxAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A ``sys.meta_path`` finder and loader: ``kfac_jax[.x]`` is the curvax module of the same role."""

    curvax_kfac_jax_alias = True  # how `install_as_kfac_jax` recognises one (also from a copy of this file)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "kfac_jax" and not fullname.startswith("kfac_jax."):
            return None
        if fullname not in KFAC_JAX_MODULES:
            known = ", ".join(sorted(n.split(".", 1)[1] for n in KFAC_JAX_MODULES if "." in n))
            raise ModuleNotFoundError(
                f"No module named '{fullname}': curvax stands in for kfac_jax (curvax.install_as_kfac_jax) and "
                f"provides kfac_jax and kfac_jax.{{{known}}}; kfac-jax's private modules have no counterpart.",
                name=fullname,
            )
        is_package = fullname == "kfac_jax"
        return importlib.util.spec_from_loader(fullname, self, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        target = importlib.import_module(KFAC_JAX_MODULES[spec.name])
        if spec.name == "kfac_jax":
            apply_kfac_jax_config()
        # The import system sets `__spec__` on the module it gets; keep curvax's own.
        self._specs = getattr(self, "_specs", {})
        self._specs[spec.name] = target.__spec__
        return target

    def exec_module(self, module: ModuleType) -> None:
        original = getattr(self, "_specs", {}).pop(module.__spec__.name if module.__spec__ else "", None)
        if original is not None:
            module.__spec__ = original


def installed() -> bool:
    """Whether the switch is on in this process."""
    return any(getattr(f, "curvax_kfac_jax_alias", False) for f in sys.meta_path)


def install_as_kfac_jax() -> None:
    """Makes every ``import kfac_jax...`` in this process resolve to curvax (see the module docstring).

    Idempotent. Raises ``RuntimeError`` if the real kfac-jax was imported already: modules holding
    its objects would then mix two libraries.
    """
    existing = sys.modules.get("kfac_jax")
    if existing is not None and not (getattr(existing, "__name__", "") == "curvax"):
        raise RuntimeError(
            f"kfac_jax is already imported from {getattr(existing, '__file__', existing)!r}: call "
            "install_as_kfac_jax() before anything imports kfac_jax."
        )
    if not installed():
        sys.meta_path.insert(0, KfacJaxAlias())


def uninstall() -> None:
    """Removes the hook and the ``kfac_jax`` entries it made (tests use it)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "curvax_kfac_jax_alias", False)]
    for name in list(sys.modules):
        if name == "kfac_jax" or name.startswith("kfac_jax."):
            module = sys.modules[name]
            if getattr(module, "__name__", "").startswith("curvax"):
                del sys.modules[name]


def write_pth(directory: str | None = None) -> str:
    """Writes :data:`PTH_NAME` (the env-gated hook) into ``directory`` (default: site-packages)."""
    if directory is None:
        import sysconfig

        directory = sysconfig.get_paths()["purelib"]
    path = os.path.join(directory, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m curvax.kfac_api.switch [-m module | script.py | --write-pth [DIR]] ARGS...``."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m curvax.kfac_api.switch (script.py | -m module | --write-pth [DIR]) [args...]"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n\n" + (__doc__ or "").split("\n\n")[0])
        return 0 if argv else 2
    if argv[0] == "--write-pth":
        path = write_pth(argv[1] if len(argv) > 1 else None)
        print(f"wrote {path}: run with {ENV_VAR}=1 to make kfac_jax resolve to curvax")
        return 0
    install_as_kfac_jax()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(usage, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
