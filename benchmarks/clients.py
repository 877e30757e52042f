"""Benchmark: two K-FAC clients, unchanged, with kfac-jax and with curvax behind the ``kfac_jax`` name.

The clients are FermiNet (google-deepmind/ferminet) and DeepQMC (PyPI ``deepqmc``), the two
quantum Monte Carlo codes that use kfac-jax most. Neither is modified: each child process runs
the client's own training entry point (``ferminet.train.train``; ``deepqmc.train.train`` from
its Hydra config). In the curvax run (results in ``benchmarks/results/clients.json``, recorded
before the switch existed) a one-line module ``kfac_jax.py`` on ``PYTHONPATH``
(``import sys, curvax; sys.modules["kfac_jax"] = curvax``) made every ``import kfac_jax``
of the client load curvax; in the kfac-jax run the released kfac-jax is imported. Same
environment, same seed, same configuration, one CPU device (the clients pmap over it).

That shim covers ``import kfac_jax`` only: ``import kfac_jax.curvature_blocks`` (or
``.loss_functions``, ``.tag_graph_matcher``, ``.tracer``) raises ``ModuleNotFoundError`` with it,
and it does not apply kfac-jax's import-time JAX setting. To run a package of your own the
supported way is the switch, ``curvax.install_as_kfac_jax()`` (``curvax/kfac_api/switch.py``):
every ``kfac_jax`` module name, submodules included, resolves to curvax's module, and
``jax_pmap_shmap_merge`` is set as kfac-jax sets it. Without editing anything:
``python -m curvax.kfac_api.switch -m ferminet.main ...`` or the ``.pth`` hook
(``python -m curvax.kfac_api.switch --write-pth``, then ``CURVAX_AS_KFAC_JAX=1``); see the docs'
"Migrating from kfac-jax" page. ``tests/test_kfac_jax_switch.py`` runs a package-shaped fixture
with all three.

What the runner adds, in the child process only (no file of a client is touched):

* ``kfac_jax.Optimizer`` is replaced by a subclass that passes ``include_norms_in_stats=True``
  (DeepQMC passes it already) and times each ``step`` (inputs and outputs blocked on, so the
  time is the optimizer step alone, not the client's MCMC). From the step's stats it keeps
  ``loss`` (the client's energy estimate), ``grad_norm`` (the gradient the optimizer used),
  ``precon_grad_norm``, ``update_norm``, ``param_norm``, ``learning_rate``.
* On the first step it also evaluates the client's own ``value_and_grad_func`` (the one the
  client gave to the optimizer) on the step's parameters, rng and batch in a pmap of its own,
  and records that gradient's norm (``client_grad_norm``): the gradient before any optimizer
  code, so a difference in ``grad_norm`` can be told apart from a difference in the data.
* A per-iteration hook (FermiNet: a ``writer_manager``; DeepQMC: a wrapper of
  ``deepqmc.train.update_progress``) records the client's logged energy and the wall time of
  each whole iteration (MCMC + optimizer step + logging).
* DeepQMC calls ``jax.tree_map``, which JAX removed; the child sets
  ``jax.tree_map = jax.tree_util.tree_map`` (the same in both runs). FermiNet's ``init_electrons``
  draws from NumPy's global RNG; the child seeds it, so both runs get the same walkers.
* ``--time-gradient``: before each step after the first, the client's own ``value_and_grad_func``
  alone is timed on that step's inputs (``client_gradient_s``), and its first call at step 0
  (trace, compile, run: ``client_gradient_first_s``). The step less the first is the optimizer's
  own part (``optimizer_own_median_s``); the second is a floor under any optimizer's first step.
* ``--steps N`` (default 15): more steps steady the median; the energies are still compared over
  the first 15 (``max_energy_diff``), after which float32 MCMC chains of two runs may part.
* ``--pool A.json B.json --output P.json``: no runs; the rows of the files' runs together.
* Fingerprints of the first step's inputs (parameter norm, batch sum, rng) and the JAX flag
  ``jax_pmap_shmap_merge`` (kfac-jax 0.0.8 sets it to False on import; curvax does not touch it).

DeepQMC means DeepQMC master (1.3.0): 1.2.0 on PyPI was written for kfac-jax 0.0.6 and does not
run with kfac-jax 0.0.8.

Install the clients (see benchmarks/README.md, "K-FAC clients"), then::

    python benchmarks/clients.py                         # both clients, both backends (~minutes)
    python benchmarks/clients.py --clients ferminet --backends curvax
    python benchmarks/clients.py --output benchmarks/results/clients.json

Writes JSON and prints a side-by-side table. A failing child is recorded (phase, exception,
traceback tail) and the other runs go on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

CLIENTS = ("ferminet", "deepqmc")
# "attention": the attention-based ansatz each client ships (FermiNet's Psiformer, DeepQMC's
# psiformer), shrunk; "default": FermiNet's FermiNet network, DeepQMC's message-passing
# `ansatz=default` (DeepQMC's configuration otherwise selects psiformer).
ANSATZE = ("default", "attention")
BACKENDS = ("kfac_jax", "curvax", "curvax_legacy_pmap")
DEFAULT_BACKENDS = BACKENDS[:2]
SHIM = 'import sys, curvax; sys.modules["kfac_jax"] = curvax\n'
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "clients.json"

# The configurations (the same for both backends).
STEPS = int(os.environ.get("CLIENTS_STEPS", "15"))  # --steps sets it for the children
WALKERS = 128
SEED = 0


# --------------------------------------------------------------------------- child side


class Recorder:
    """Collects what the child measures; written as JSON at the end (or on failure)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"phase": "import", "opt_steps": [], "iterations": [], "notes": []}
        self._last_iter_time: float | None = None

    def iteration(self, energy: float) -> None:
        now = time.perf_counter()
        start = self._last_iter_time if self._last_iter_time is not None else self.data.get("train_start")
        self.data["iterations"].append({"energy": energy, "wall_s": None if start is None else now - start})
        self._last_iter_time = now


REC = Recorder()


def _first(x: Any) -> Any:
    """Device 0's value of a pmapped output, as a Python float (or None)."""
    import numpy as np

    if x is None:
        return None
    a = np.asarray(x)
    if a.ndim > 0:
        a = a.reshape(-1)[0]
    return float(a)


def _arrays(tree: Any) -> list:
    import jax

    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def _global_norm(tree: Any) -> float:
    import numpy as np

    return float(np.sqrt(sum(float(np.sum(np.asarray(x, dtype=np.float64) ** 2)) for x in tree)))


def _dist_version(name: str) -> str | None:
    """The installed distribution's version (None when it is not installed as one)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install_optimizer_wrapper() -> None:
    """Replaces ``kfac_jax.Optimizer`` (whatever module that name loads) by a recording subclass."""
    import jax
    import kfac_jax
    import numpy as np

    base = kfac_jax.Optimizer
    REC.data["kfac_jax_module"] = getattr(kfac_jax, "__file__", repr(kfac_jax))

    class RecordingOptimizer(base):  # type: ignore[misc, valid-type]
        """The client's optimizer, with norms in the stats and each step timed."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._rec_vg = args[0] if args else kwargs.get("value_and_grad_func")
            self._rec_axis = kwargs.get("pmap_axis_name", "kfac_axis")
            self._rec_has_rng = kwargs.get("value_func_has_rng", False)
            self._rec_has_aux = kwargs.get("value_func_has_aux", False)
            self._rec_cache: dict[str, Any] = {}  # kfac-jax's Optimizer takes no new attributes after __init__
            kwargs["include_norms_in_stats"] = True
            REC.data["optimizer_kwargs"] = sorted(kwargs)
            REC.data["phase"] = "optimizer_construct"
            super().__init__(*args, **kwargs)

        def init(self, *args: Any, **kwargs: Any) -> Any:
            REC.data["phase"] = "optimizer_init"
            t = time.perf_counter()
            out = super().init(*args, **kwargs)
            jax.block_until_ready(_arrays(out))
            REC.data["init_s"] = time.perf_counter() - t
            proof = getattr(self, "_gradient_proof", None)  # curvax only: where its gradient comes from
            if proof is not None:
                REC.data["curvax_gradient_source"] = {"shared_pass": bool(proof.shared), "reason": str(proof.reason)}
            return out

        def _client_gradient(self, params: Any, rng: Any, batch: Any) -> Any:
            """The client's own ``value_and_grad_func`` in a pmap of its own, compiled once for the
            step-0 shapes and then called as a compiled program: no pmap dispatch on each call,
            which costs more under JAX 0.9's default pmap (curvax's process) than under the legacy
            one that importing kfac-jax selects, and would bias the comparison."""
            if "vg" not in self._rec_cache:
                vg = self._rec_vg
                if self._rec_has_rng:
                    fn = lambda p, r, b: vg(p, r, b)  # noqa: E731
                else:
                    fn = lambda p, r, b: vg(p, b)  # noqa: E731
                self._rec_cache["vg"] = jax.pmap(fn, axis_name=self._rec_axis).lower(params, rng, batch).compile()
            return self._rec_cache["vg"]

        def _client_grad_norm(self, params: Any, rng: Any, batch: Any) -> tuple[float, float]:
            """The norm of the client's own gradient and its loss, on device 0, outside the optimizer."""
            (value, grads) = self._client_gradient(params, rng, batch)(params, rng, batch)
            loss = value[0] if self._rec_has_aux else value
            leaves = [x[0] for x in jax.tree_util.tree_leaves(grads)]
            return _global_norm(leaves), _first(loss)

        def step(self, *args: Any, **kwargs: Any) -> Any:
            i = len(REC.data["opt_steps"])
            REC.data["phase"] = f"optimizer_step_{i}"
            jax.block_until_ready(_arrays((args, kwargs)))
            if i == 0:
                # kfac-jax 0.0.8 sets this jax flag to False when imported (legacy pmap);
                # recorded because it changes how pmap (which both clients use) is lowered.
                REC.data["jax_pmap_shmap_merge"] = jax.config.values.get("jax_pmap_shmap_merge")
                params = kwargs["params"] if "params" in kwargs else args[0]
                rng = kwargs["rng"] if "rng" in kwargs else (args[2] if len(args) > 2 else None)
                batch = kwargs["batch"] if "batch" in kwargs else (args[4] if len(args) > 4 else None)
                # Fingerprints of the step-0 inputs: equal in both runs unless the data differ.
                REC.data["step0_param_norm"] = _global_norm([x[0] for x in _arrays(params)])
                REC.data["step0_batch_sum"] = float(sum(float(np.nansum(np.asarray(x, np.float64)))
                                                        for x in _arrays(batch) if x.dtype.kind == "f"))
                REC.data["step0_rng"] = [int(v) for v in jax.numpy.ravel(jax.random.key_data(rng)
                                         if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng)]
                try:
                    t = time.perf_counter()
                    REC.data["client_grad_norm"], REC.data["client_loss_step0"] = self._client_grad_norm(
                        params, rng, batch
                    )
                    # Its first call: tracing, compiling and running the client's gradient alone, a
                    # part of every optimizer's first step that no optimizer can remove.
                    REC.data["client_gradient_first_s"] = time.perf_counter() - t
                except Exception as e:  # the measurement must not stop the run
                    REC.data["notes"].append(f"client_grad_norm failed: {type(e).__name__}: {e}")
            if i > 0 and os.environ.get("CLIENTS_TIME_GRADIENT") == "1":
                # The client's own gradient alone, on the same inputs (compiled on step 0): the part
                # of the step no optimizer can change. Pure, so the run's numbers are untouched.
                params = kwargs["params"] if "params" in kwargs else args[0]
                rng = kwargs["rng"] if "rng" in kwargs else (args[2] if len(args) > 2 else None)
                batch = kwargs["batch"] if "batch" in kwargs else (args[4] if len(args) > 4 else None)
                try:
                    t = time.perf_counter()
                    jax.block_until_ready(self._client_gradient(params, rng, batch)(params, rng, batch))
                    grad_s = time.perf_counter() - t
                except Exception as e:  # e.g. a batch of new shapes: the measurement must not stop the run
                    REC.data["notes"].append(f"client gradient timing failed at step {i}: {type(e).__name__}: {e}"[:500])
                    grad_s = None
            else:
                grad_s = None
            t = time.perf_counter()
            out = super().step(*args, **kwargs)
            jax.block_until_ready(_arrays(out))
            dt = time.perf_counter() - t
            stats = out[-1] if isinstance(out, tuple) else {}
            rec = {"step_s": dt, "client_gradient_s": grad_s}
            for key in ("loss", "grad_norm", "precon_grad_norm", "update_norm", "param_norm", "learning_rate"):
                rec[key] = _first(stats.get(key)) if isinstance(stats, dict) and key in stats else None
            REC.data["opt_steps"].append(rec)
            if i == 0 and REC.data.get("train_start") is not None:
                REC.data["train_start_to_step0_end_s"] = time.perf_counter() - REC.data["train_start"]
            if i == 0 and isinstance(stats, dict):
                REC.data["stats_keys"] = sorted(stats)
            return out

    RecordingOptimizer.__name__ = "Optimizer"
    RecordingOptimizer.__qualname__ = "Optimizer"
    kfac_jax.Optimizer = RecordingOptimizer


def run_ferminet(workdir: str, ansatz: str = "default") -> None:
    """FermiNet H2: 2 determinants, hidden ((16, 4), (16, 4)), 128 walkers, K-FAC, no pretraining.
    ``ansatz="attention"``: FermiNet's Psiformer, 2 layers of 2 heads of width 8, MLP 16."""
    import numpy as np
    from ferminet import base_config, train
    from ferminet.utils import system

    import ferminet

    REC.data["client_version"] = _dist_version("ferminet")
    REC.data["client_file"] = ferminet.__file__
    cfg = base_config.default()
    cfg.system.electrons = (1, 1)
    cfg.system.molecule = [system.Atom("H", (0, 0, -1)), system.Atom("H", (0, 0, 1))]
    cfg.batch_size = WALKERS
    cfg.network.determinants = 2
    cfg.network.ferminet.hidden_dims = ((16, 4), (16, 4))
    if ansatz == "attention":
        cfg.network.network_type = "psiformer"
        cfg.network.psiformer.num_layers = 2
        cfg.network.psiformer.num_heads = 2
        cfg.network.psiformer.heads_dim = 8
        cfg.network.psiformer.mlp_hidden_dims = (16,)
    cfg.pretrain.iterations = 0
    cfg.mcmc.burn_in = 10
    cfg.optim.iterations = STEPS
    cfg.optim.optimizer = "kfac"
    cfg.debug.deterministic = True  # FermiNet's fixed seed (23)
    cfg.log.save_path = workdir
    cfg.log.save_frequency = 1e9  # minutes: no checkpoint during the run
    cfg = base_config.resolve(cfg)

    class Writer:
        """FermiNet's writer interface: records the logged energy of each iteration."""

        def __enter__(self) -> "Writer":
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def write(self, t: int, **kwargs: Any) -> None:
            REC.iteration(float(kwargs["energy"]))

        def flush(self) -> None:
            return None

    # FermiNet's init_electrons draws the atoms' spin assignment from NumPy's global RNG
    # (np.random.randint), unseeded: without this the walkers differ from run to run.
    np.random.seed(SEED)
    REC.data["train_start"] = time.perf_counter()
    train.train(cfg, writer_manager=Writer())


def run_deepqmc(workdir: str, ansatz: str = "default") -> None:
    """DeepQMC H2, an ansatz shrunk (2 determinants, width 16, 1 interaction), 128 samples:
    ``ansatz="default"`` its message-passing ``default`` ansatz, ``"attention"`` its ``psiformer``."""
    import deepqmc
    import jax
    from hydra import compose, initialize_config_module
    from hydra.utils import call

    import deepqmc.train as dtrain

    REC.data["client_version"] = _dist_version("deepqmc")
    REC.data["client_file"] = deepqmc.__file__
    if not hasattr(jax, "tree_map"):  # removed in jax 0.6; DeepQMC (1.2.0 and master) still calls it
        jax.tree_map = jax.tree_util.tree_map
        REC.data["notes"].append("jax.tree_map aliased to jax.tree_util.tree_map (DeepQMC calls it)")
    overrides = [
        "hamil/mol=H2",
        "task=train",
        f"task.steps={STEPS}",
        f"task.electron_batch_size={WALKERS}",
        f"task.seed={SEED}",
        "task.pretrain_steps=0",
        "+task.max_eq_steps=20",
        "ansatz.n_determinants=2",
        "ansatz.omni_factory.embedding_dim=16",
        "ansatz.omni_factory.gnn_factory.n_interactions=1",
        "ansatz.omni_factory.gnn_factory.two_particle_stream_dim=8",
        "task.workdir=null",
    ]
    # DeepQMC's own configuration selects its attention ansatz (psiformer) unless told otherwise;
    # the runs before the --ansatz option (clients.json) used it. Its message-passing ansatz
    # (`ansatz=default`, no attention) is the "default" row here.
    overrides.insert(0, "ansatz=psiformer" if ansatz == "attention" else "ansatz=default")
    REC.data["config"] = overrides
    with initialize_config_module(config_module="deepqmc.conf", version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    original = dtrain.update_progress

    def update_progress(pbar, best_ene, ewm_energies, mol_idxs, stats):  # noqa: ANN001, ANN202
        REC.iteration(float(jax.numpy.asarray(stats["local_energy/mean"]).reshape(-1)[0]))
        return original(pbar, best_ene, ewm_energies, mol_idxs, stats)

    dtrain.update_progress = update_progress
    from omegaconf import OmegaConf

    task = OmegaConf.to_object(cfg.task)
    task["workdir"] = None
    REC.data["train_start"] = time.perf_counter()
    call(task, _convert_="all")


def child(client: str, backend: str, result: str, ansatz: str = "default") -> int:
    """Runs one client with the backend the parent put on the path; writes the record."""
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    REC.data.update(client=client, backend=backend, ansatz=ansatz, steps=STEPS, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    rc = 0
    workdir = tempfile.mkdtemp(prefix=f"clients_{client}_")
    try:
        t0 = time.perf_counter()
        if client == "deepqmc":
            import deepqmc  # noqa: F401  (before jax, as DeepQMC asks)
        import jax
        import kfac_jax

        REC.data["jax_version"] = jax.__version__
        REC.data["kfac_jax_version"] = getattr(kfac_jax, "__version__", None)
        REC.data["devices"] = [str(d) for d in jax.devices()]
        REC.data["import_s"] = time.perf_counter() - t0
        REC.data["phase"] = "client_import"
        install_optimizer_wrapper()
        REC.data["phase"] = "client_setup"
        {"ferminet": run_ferminet, "deepqmc": run_deepqmc}[client](workdir, ansatz)
        REC.data["phase"] = "done"
        REC.data["total_s"] = time.perf_counter() - t0
    except BaseException as e:  # record every failure, including SystemExit from a client
        REC.data["error"] = f"{type(e).__name__}: {e}"[:2000]
        REC.data["traceback"] = traceback.format_exc()[-6000:]
        rc = 1
    REC.data.pop("train_start", None)
    Path(result).write_text(json.dumps(REC.data, indent=1))
    return rc


# -------------------------------------------------------------------------- parent side


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Adds the derived figures: step-0 gradient norms, first and median step times."""
    steps = rec.get("opt_steps", [])
    iters = rec.get("iterations", [])
    times = [s["step_s"] for s in steps]
    iter_times = [i["wall_s"] for i in iters if i["wall_s"] is not None]
    rec["summary"] = {
        "ok": rec.get("phase") == "done" and len(steps) == rec.get("steps", STEPS),
        "steps_done": len(steps),
        "grad_norm_step0": steps[0].get("grad_norm") if steps else None,
        "client_grad_norm_step0": rec.get("client_grad_norm"),
        "first_step_s": times[0] if times else None,
        "client_gradient_first_s": rec.get("client_gradient_first_s"),
        "train_start_to_step0_end_s": rec.get("train_start_to_step0_end_s"),
        "step_median_s": statistics.median(times[1:]) if len(times) > 1 else None,
        # --time-gradient: the client's gradient alone, and the step less it (the optimizer's own part)
        "client_gradient_median_s": _median([s.get("client_gradient_s") for s in steps[1:]]),
        "optimizer_own_median_s": _median([s["step_s"] - s["client_gradient_s"] for s in steps[1:]
                                           if s.get("client_gradient_s") is not None]),
        "first_iter_s": iter_times[0] if iter_times else None,
        "iter_median_s": statistics.median(iter_times[1:]) if len(iter_times) > 1 else None,
        "energies": [s["loss"] for s in steps],
        "client_energies": [i["energy"] for i in iters],
    }
    return rec


def run_child(client: str, backend: str, timeout: float, ansatz: str = "default", devices: int = 1,
              time_gradient: bool = False, steps: int = STEPS) -> dict[str, Any]:
    """One fresh process on ``devices`` CPU devices (the clients pmap over all of them); the shim
    directory goes first on PYTHONPATH for curvax."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    env["NVIDIA_TF32_OVERRIDE"] = "0"
    if time_gradient:
        env["CLIENTS_TIME_GRADIENT"] = "1"
    env["CLIENTS_STEPS"] = str(steps)
    if backend == "curvax_legacy_pmap":
        env["JAX_PMAP_SHMAP_MERGE"] = "false"
    with tempfile.TemporaryDirectory() as tmp:
        if backend.startswith("curvax"):
            Path(tmp, "kfac_jax.py").write_text(SHIM)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH", "")) if p)
        result = Path(tmp, "result.json")
        t = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", client, "--backend", backend, "--result", str(result),
                 "--child-ansatz", ansatz],
                env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp,
            )
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stderr or "")[-3000:]
        wall = time.perf_counter() - t
        rec = json.loads(result.read_text()) if result.exists() else {"client": client, "backend": backend, "ansatz": ansatz}
    rec["num_devices"] = devices
    rec["process_s"] = wall
    rec["returncode"] = rc
    if rc != 0:
        rec["output_tail"] = tail
        rec.setdefault("error", f"child exited with {rc} before writing its record")
    return summarize(rec)


def compare_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (client, ansatz, devices): each backend's medians over the repeats, curvax / kfac-jax,
    and the largest energy difference over the steps (repeat 0)."""
    rows = []
    for key in dict.fromkeys(_row_key(r) for r in runs):
        row: dict[str, Any] = {"client": key[0], "ansatz": key[1], "devices": key[2]}
        for backend in dict.fromkeys(r["backend"] for r in runs):
            mine = [r["summary"] for r in runs if _row_key(r) == key and r["backend"] == backend and r["summary"]["ok"]]
            for metric in ("step_median_s", "first_step_s", "train_start_to_step0_end_s", "client_gradient_first_s",
                           "client_gradient_median_s", "optimizer_own_median_s"):
                vals = [m.get(metric) for m in mine if m.get(metric) is not None]
                row[f"{backend}/{metric}"] = statistics.median(vals) if vals else None
        for metric in ("step_median_s", "first_step_s", "train_start_to_step0_end_s", "optimizer_own_median_s"):
            a, c = row.get(f"kfac_jax/{metric}"), row.get(f"curvax/{metric}")
            row[f"ratio/{metric}"] = c / a if a and c else None
        e = {r["backend"]: r["summary"]["energies"] for r in runs if _row_key(r) == key and r.get("repeat", 0) == 0}
        if "kfac_jax" in e and "curvax" in e and e["kfac_jax"] and len(e["kfac_jax"]) == len(e["curvax"]):
            diffs = [abs(x - y) for x, y in zip(e["kfac_jax"], e["curvax"]) if x is not None and y is not None]
            row["max_energy_diff"] = max(diffs[:15])  # the criterion: over the first 15 steps
            row["max_energy_diff_all_steps"] = max(diffs)
        rows.append(row)
    return rows


def fmt(x: Any, spec: str = ".6f") -> str:
    return "-" if x is None else format(x, spec)


def _row_key(r: dict[str, Any]) -> tuple[str, str, int]:
    return r["client"], r.get("ansatz", "default"), r.get("num_devices", 1)


def print_table(runs: list[dict[str, Any]]) -> None:
    by = {(*_row_key(r), r["backend"]): r for r in runs if r.get("repeat", 0) == 0}
    for key in dict.fromkeys(_row_key(r) for r in runs):
        a = by.get((*key, "kfac_jax"))
        print(f"\n== {key[0]}, {key[1]} ansatz, {key[2]} device(s) ==")
        cols = [(name, by.get((*key, name))) for name in BACKENDS]
        header = f"{'':28s}" + "".join(f"{name:>19s}" for name, r in cols if r)
        print(header)

        def row(label: str, key: str, spec: str = ".6f") -> None:
            print(f"{label:28s}" + "".join(f"{fmt(r['summary'][key], spec):>19s}" for _, r in cols if r))

        row("status", "ok", "")
        row("steps done", "steps_done", "d")
        row("step-0 grad norm (optimizer)", "grad_norm_step0", ".7g")
        row("step-0 grad norm (client)", "client_grad_norm_step0", ".7g")
        row("first step s", "first_step_s", ".3f")
        row("  client's gradient, 1st s", "client_gradient_first_s", ".3f")
        row("train start to step 0 end s", "train_start_to_step0_end_s", ".3f")
        row("median step s (after 1st)", "step_median_s", ".4f")
        if any(r["summary"].get("client_gradient_median_s") for _, r in cols if r):
            row("  client's gradient alone s", "client_gradient_median_s", ".4f")
            row("  optimizer's own part s", "optimizer_own_median_s", ".4f")
        row("first iteration s", "first_iter_s", ".3f")
        row("median iteration s", "iter_median_s", ".4f")
        if a and a["summary"]["grad_norm_step0"]:
            ga = a["summary"]["grad_norm_step0"]
            diffs = [
                "-" if not r["summary"]["grad_norm_step0"] else f"{abs(r['summary']['grad_norm_step0'] - ga) / ga:.2e}"
                for _, r in cols if r
            ]
            print(f"{'step-0 grad norm rel. diff':28s}" + "".join(f"{d:>19s}" for d in diffs))
        n = max(len(r["summary"]["energies"]) for _, r in cols if r)
        for i in range(n):
            vals = []
            for _, r in cols:
                if r:
                    e = r["summary"]["energies"]
                    vals.append(fmt(e[i] if i < len(e) else None))
            print(f"{'energy step ' + str(i):28s}" + "".join(f"{v:>19s}" for v in vals))
        for name, r in cols:
            if r and r.get("error"):
                print(f"{name} FAILED in {r.get('phase')}: {r['error'][:300]}")


def pool(paths: list[Path], output: Path) -> int:
    """Rows over the runs of several result files (same code, same settings, other moments): run-to-run
    noise on a shared 2-core machine is 10-15% per file, so more runs per backend steady the medians.
    Each run keeps its file (``pooled_from``); the energy gap is the last file's repeat 0."""
    runs = []
    for path in paths:
        for r in json.loads(path.read_text())["runs"]:
            runs.append({**r, "pooled_from": path.name})
    out = {"what": "pooled rows of " + ", ".join(p.name for p in paths), "pooled_from": [p.name for p in paths],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs, "rows": compare_rows(runs)}
    output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {output} ({len(runs)} runs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS),
                   help="curvax_legacy_pmap: curvax with JAX_PMAP_SHMAP_MERGE=false, the JAX flag kfac-jax "
                   "0.0.8 sets on import (runs only when named)")
    p.add_argument("--ansatz", nargs="+", choices=ANSATZE, default=["default"], dest="ansatze")
    p.add_argument("--devices", nargs="+", type=int, default=[1], help="CPU devices per run (each value a row)")
    p.add_argument("--repeats", type=int, default=1, help="runs per backend and row, the backends' order alternating")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per child process")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run (the energies are compared "
                   "over all of them; the median step is over all but the first)")
    p.add_argument("--time-gradient", action="store_true", help="before each step after the first, also time "
                   "the client's own value_and_grad_func alone on the same inputs; the step less it is the "
                   "optimizer's own part")
    p.add_argument("--pool", nargs="+", type=Path, metavar="JSON", help="run nothing: the rows of the runs of "
                   "these result files together (medians over all their runs), written to --output")
    p.add_argument("--child", choices=CLIENTS, help=argparse.SUPPRESS)
    p.add_argument("--child-ansatz", dest="child_ansatz", choices=ANSATZE, default="default", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pool:
        return pool(args.pool, args.output)
    if args.child:
        return child(args.child, args.backend, args.result, args.child_ansatz)
    import importlib.util

    needed = [*args.clients, *(["kfac_jax"] if "kfac_jax" in args.backends else []), "curvax"]
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        print(f"not installed in this environment: {', '.join(missing)}; see benchmarks/README.md, "
              "'K-FAC clients', for the environment these runs need", file=sys.stderr)
        return 2
    runs: list[dict[str, Any]] = []
    out = {
        "what": "FermiNet and DeepQMC, unchanged, with kfac-jax and with curvax behind the kfac_jax name",
        "configuration": {"steps": args.steps, "walkers": WALKERS, "seed": SEED, "devices": args.devices,
                          "ansatze": args.ansatze, "repeats": args.repeats,
                          "time_gradient": args.time_gradient},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": list(os.getloadavg())},
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for client in args.clients:
        for ansatz in args.ansatze:
            for devices in args.devices:
                for repeat in range(args.repeats):
                    order = args.backends if repeat % 2 == 0 else args.backends[::-1]  # alternate who goes first
                    for backend in order:
                        print(f"running {client} ({ansatz}, {devices} device(s)) with {backend} ...", flush=True)
                        load = list(os.getloadavg())
                        runs.append(run_child(client, backend, args.timeout, ansatz, devices, args.time_gradient, args.steps))
                        runs[-1]["repeat"] = repeat
                        runs[-1]["load_average_start"], runs[-1]["load_average_end"] = load, list(os.getloadavg())
                        out["machine"]["load_average_after"] = list(os.getloadavg())
                        args.output.write_text(json.dumps(out, indent=1) + "\n")  # after each run: partial results survive
    out["rows"] = compare_rows(runs)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print_table(runs)
    print(f"\nwrote {args.output}")
    return 0 if all(r["summary"]["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
