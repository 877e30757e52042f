"""One switch for a whole package: ``curvax.install_as_kfac_jax`` (``curvax/kfac_api/switch.py``).

``tests/data/kfac_client_pkg/kfac_client`` is a package written against kfac-jax 0.0.8 (several
modules; ``import kfac_jax``, ``import kfac_jax.curvature_blocks``, ``from kfac_jax import
utils``, ``from kfac_jax.loss_functions import ...``). It is run unmodified, in a fresh
interpreter, with each of the three ways of turning the switch on, and must train with curvax's
modules behind every ``kfac_jax`` name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from xla_env import child_env

from curvax.kfac_api import switch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "kfac_client_pkg"
# kfac-jax 0.0.8's kfac_jax/__init__.py: `from kfac_jax._src import <name>` for each of these.
KFAC_JAX_008_MODULES = ("curvature_blocks", "curvature_estimator", "layers_and_loss_tags", "loss_functions",
                        "optimizer", "patches_second_moment", "tag_graph_matcher", "tracer", "utils")


def run(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in child_env().items() if k != switch.ENV_VAR}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(FIXTURE)]), **(extra_env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=FIXTURE, timeout=300)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_ran_on_curvax(r: dict) -> None:
    assert r["kfac_jax_file"] == str(ROOT / "curvax" / "__init__.py")
    assert r["optimizer_class"] == "curvax.optimizer.Optimizer" and r["same_block"]
    # every kfac_jax module the package imported is curvax's (no second copy of any module)
    assert r["modules"]["kfac_jax"] == "curvax"
    for name in ("curvature_blocks", "loss_functions", "layers_and_loss_tags", "tracer", "optimizer",
                 "patches_second_moment"):
        assert r["modules"][f"kfac_jax.{name}"].startswith("curvax."), (name, r["modules"])
    assert r["tracer"] == "curvax.kfac_api.tracer" and r["layer_data"] == "LayerData"
    assert r["losses"][-1] < r["losses"][0]
    # kfac-jax's import-time setting, where this JAX has the option
    if r["has_pmap_shmap_merge_option"]:
        assert r["jax_pmap_shmap_merge"] is False


def test_the_fixture_needs_kfac_jax():
    proc = run(["-c", "import kfac_client.train"])
    assert proc.returncode != 0 and "No module named 'kfac_jax'" in proc.stderr


def test_python_api_and_command_line_runner_give_the_same_run():
    api = result(run(["-c", "import curvax; curvax.install_as_kfac_jax(); import runpy; "
                            "runpy.run_module('kfac_client', run_name='__main__')"]))
    check_ran_on_curvax(api)
    script = result(run(["-m", "curvax.kfac_api.switch", str(FIXTURE / "run_client.py")]))
    check_ran_on_curvax(script)
    assert script["losses"] == api["losses"]


def test_pth_hook_is_gated_by_the_environment_variable_and_imports_nothing_heavy(tmp_path):
    proc = run(["-m", "curvax.kfac_api.switch", "--write-pth", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    pth = tmp_path / switch.PTH_NAME
    assert pth.read_text() == switch.PTH_LINE
    start = f"import site; site.addsitedir({str(tmp_path)!r}); "
    # off without the variable
    proc = run(["-c", start + "import kfac_client"])
    assert proc.returncode != 0 and "No module named 'kfac_jax'" in proc.stderr
    # on with it; start-up imports neither JAX nor curvax (a script may still configure JAX first)
    light = result(run(["-c", start + "import sys, json; print(json.dumps(['jax' in sys.modules, "
                                      "'curvax' in sys.modules, any(getattr(f, 'curvax_kfac_jax_alias', 0) "
                                      "for f in sys.meta_path)]))"], {switch.ENV_VAR: "1"}))
    assert light == [False, False, True]
    check_ran_on_curvax(result(run(["-c", start + "from kfac_client.train import main; main()"], {switch.ENV_VAR: "1"})))


def test_every_kfac_jax_008_module_is_mapped():
    assert set(switch.KFAC_JAX_MODULES) == {"kfac_jax", *(f"kfac_jax.{m}" for m in KFAC_JAX_008_MODULES)}


@pytest.fixture
def installed():
    switch.install_as_kfac_jax()
    yield
    switch.uninstall()


def test_in_process_aliases_are_curvax_modules(installed):
    import importlib

    import curvax

    for name, target in switch.KFAC_JAX_MODULES.items():
        assert importlib.import_module(name) is importlib.import_module(target), name
    assert curvax.__spec__.name == "curvax"  # the alias does not rename curvax
    import kfac_jax.curvature_blocks as cb
    from kfac_jax import utils

    assert cb.DenseTwoKroneckerFactored is curvax.DenseTwoKroneckerFactored and utils is curvax.utils
    with pytest.raises(ModuleNotFoundError, match="kfac-jax's private modules have no counterpart"):
        importlib.import_module("kfac_jax._src.optimizer")
    switch.install_as_kfac_jax()  # idempotent
    assert sum(getattr(f, "curvax_kfac_jax_alias", False) for f in sys.meta_path) == 1


def test_refuses_when_the_real_kfac_jax_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "kfac_jax", types.ModuleType("kfac_jax"))
    with pytest.raises(RuntimeError, match="already imported"):
        switch.install_as_kfac_jax()
    assert not switch.installed()


def test_kfac_jax_import_time_config(monkeypatch):
    import jax

    class Config:
        values = {"jax_pmap_shmap_merge": True}

        def update(self, name, value):
            self.values[name] = value

    fake = Config()
    monkeypatch.setattr(jax, "config", fake)
    assert switch.apply_kfac_jax_config() == {"jax_pmap_shmap_merge": False}
    assert fake.values["jax_pmap_shmap_merge"] is False
    fake.values.clear()  # a JAX without the option: nothing set, as kfac-jax does
    assert switch.apply_kfac_jax_config() == {} and fake.values == {}
