"""Benchmark: where FermiNet's first K-FAC step goes, kfac-jax against curvax (traces and compilations).

FermiNet (H2, its default ansatz: ``base_config.default()`` network, 16 determinants, hidden
((256, 32),) * 4) runs unchanged for a few iterations, once with the released kfac-jax and once
with curvax behind the ``kfac_jax`` name (the one-line module of ``clients.py``), and with curvax
under JAX's legacy pmap (``curvax_legacy_pmap``: ``JAX_PMAP_SHMAP_MERGE=false``, the setting
kfac-jax 0.0.8 makes on import; curvax leaves JAX's default, pmap as jit of shard_map). Each child
process counts, per phase of the run (``setup``: the client before ``Optimizer.init``; ``init``;
``client``: the client between optimizer calls, its MCMC; ``step0``, ``step1``, ...):

* the traces of the user's functions: calls of the ``value_and_grad_func`` the client hands to
  the optimizer, and of the log-network and the local energy FermiNet's ``make_loss`` is given
  (a Python call of these happens only while JAX traces them: each is one trace);
* JAX's compile-time events from ``jax.monitoring`` (``jaxpr_trace_duration``: tracing a
  function to a jaxpr; ``jaxpr_to_mlir_module_duration``: lowering; ``backend_compile_duration``:
  XLA compilation), each with the function's name and its duration.

Counts are valid on a loaded machine; durations are not (the load average is recorded). Needs
the clients' environment (benchmarks/README.md, "K-FAC clients")::

    python benchmarks/clients_first_step.py --dump-hlo --output benchmarks/results/clients_first_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))
from clients import SHIM, _arrays  # noqa: E402

BACKENDS = ("kfac_jax", "curvax", "curvax_legacy_pmap")
WALKERS = 128
ITERATIONS = 4
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


class Phases:
    """The current phase of the run and what each phase saw."""

    def __init__(self) -> None:
        self.name = "setup"
        self.start = time.perf_counter()
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.events: list[dict[str, Any]] = []

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        self.wall[self.name] += now - self.start
        self.name, self.start = name, now

    def counted(self, label: str, fn: Callable) -> Callable:
        """``fn`` with its calls counted under ``label`` in the current phase."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[self.name][label] += 1
            return fn(*args, **kwargs)

        wrapper.__name__ = getattr(fn, "__name__", label)
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        return wrapper

    def listener(self, event: str, duration: float, **kwargs: Any) -> None:
        kind = EVENTS.get(event)
        if kind is not None:
            self.events.append({"phase": self.name, "kind": kind, "fun": str(kwargs.get("fun_name")),
                                "s": duration})

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for phase in dict.fromkeys([*self.wall, *self.calls, *(e["phase"] for e in self.events)]):
            evs = [e for e in self.events if e["phase"] == phase]
            out[phase] = {
                "wall_s": self.wall.get(phase),
                "user_function_traces": dict(self.calls.get(phase, {})),
                **{f"{k}_count": sum(e["kind"] == k for e in evs) for k in EVENTS.values()},
                **{f"{k}_s": sum(e["s"] for e in evs if e["kind"] == k) for k in EVENTS.values()},
                "compiled": [f"{e['fun']} {e['s']:.2f}s" for e in evs if e["kind"] == "compile"],
            }
        return out


def child(backend: str, result: str, network: str = "default") -> int:
    """Runs FermiNet's default ansatz for a few iterations and records the phases
    (``network="small"``/``"psiformer_small"``: the shrunk networks of ``clients.py``'s rows)."""
    ph = Phases()
    rec: dict[str, Any] = {"backend": backend}
    try:
        import jax
        import kfac_jax
        import numpy as np
        from ferminet import base_config, train
        from ferminet import loss as ferminet_loss
        from ferminet.utils import system

        jax.monitoring.register_event_duration_secs_listener(ph.listener)
        rec.update(jax_version=jax.__version__, kfac_jax_module=kfac_jax.__file__)
        base, make_loss = kfac_jax.Optimizer, ferminet_loss.make_loss

        def counting_make_loss(network: Callable, local_energy: Callable, *args: Any, **kwargs: Any) -> Any:
            return make_loss(ph.counted("log_network", network), ph.counted("local_energy", local_energy),
                             *args, **kwargs)

        ferminet_loss.make_loss = counting_make_loss

        steps = [0]  # kfac-jax's Optimizer refuses new attributes once finalized: counted here

        class PhasedOptimizer(base):  # type: ignore[misc, valid-type]
            """The client's optimizer; its init and steps mark the phases."""

            def __init__(self, value_and_grad_func: Callable, *args: Any, **kwargs: Any) -> None:
                super().__init__(ph.counted("value_and_grad_func", value_and_grad_func), *args, **kwargs)

            def init(self, *args: Any, **kwargs: Any) -> Any:
                ph.enter("init")
                out = super().init(*args, **kwargs)
                jax.block_until_ready(_arrays(out))
                ph.enter("client")
                return out

            def step(self, *args: Any, **kwargs: Any) -> Any:
                jax.block_until_ready(_arrays((args, kwargs)))
                ph.enter(f"step{steps[0]}")
                out = super().step(*args, **kwargs)
                jax.block_until_ready(_arrays(out))
                ph.enter("client")
                steps[0] += 1
                return out

        PhasedOptimizer.__name__ = PhasedOptimizer.__qualname__ = "Optimizer"
        kfac_jax.Optimizer = PhasedOptimizer
        cfg = base_config.default()
        cfg.system.electrons = (1, 1)
        cfg.system.molecule = [system.Atom("H", (0, 0, -1)), system.Atom("H", (0, 0, 1))]
        cfg.batch_size = WALKERS
        cfg.pretrain.iterations = 0
        cfg.mcmc.burn_in = 10
        cfg.optim.iterations = ITERATIONS
        cfg.optim.optimizer = "kfac"
        if network in ("small", "psiformer_small"):
            cfg.network.determinants = 2
            cfg.network.ferminet.hidden_dims = ((16, 4), (16, 4))
        if network == "psiformer_small":  # clients.py's attention row
            cfg.network.network_type = "psiformer"
            cfg.network.psiformer.num_layers = 2
            cfg.network.psiformer.num_heads = 2
            cfg.network.psiformer.heads_dim = 8
            cfg.network.psiformer.mlp_hidden_dims = (16,)
        cfg.debug.deterministic = True
        cfg.log.save_path = tempfile.mkdtemp(prefix="clients_first_step_")
        cfg.log.save_frequency = 1e9
        cfg = base_config.resolve(cfg)
        rec["network"] = {"determinants": cfg.network.determinants,
                          "hidden_dims": [list(h) for h in cfg.network.ferminet.hidden_dims]}
        np.random.seed(0)
        train.train(cfg)
        ph.enter("done")
        rec["ok"] = True
    except BaseException as e:  # record the failure and what was measured until then
        import traceback

        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
        ph.enter("failed")
    rec["phases"] = ph.summary()
    rec["compile_events"] = [e for e in ph.events if e["kind"] == "compile"]  # traces: counted in phases
    Path(result).write_text(json.dumps(rec, indent=1))
    return 0 if rec["ok"] else 1


def hlo_sizes(dump: Path, top: int = 4, kinds: int = 40) -> list[dict[str, Any]]:
    """The largest XLA modules XLA dumped: instructions before and after XLA's optimizations, and
    (the largest module) the most frequent instruction kinds after them."""

    def kinds_of(path: Path) -> Counter:
        ops: Counter = Counter()
        for line in path.read_text(errors="replace").splitlines():
            if " = " in line:
                m = re.search(r"\s([a-z][a-z0-9\-]*)\(", line.split(" = ", 1)[1])
                ops[m.group(1) if m else "?"] += 1
        return ops

    out = []
    for after in dump.glob("*after_optimizations.txt"):  # module_NNNN.NAME.cpu_after_optimizations.txt
        before = after.with_name(after.name.rsplit(".", 2)[0] + ".before_optimizations.txt")
        out.append({"module": after.name.split(".")[1], "file": after.name,
                    "instructions_after_opt": sum(kinds_of(after).values()),
                    "instructions_before_opt": sum(kinds_of(before).values()) if before.exists() else None})
    out = sorted(out, key=lambda m: -m["instructions_after_opt"])[:top]
    if out:
        out[0]["kinds_after_opt"] = dict(kinds_of(dump / out[0]["file"]).most_common(kinds))
    return out


def run_child(backend: str, timeout: float, dump_hlo: bool, hlo_dir: Path | None = None,
              network: str = "default") -> dict[str, Any]:
    """One fresh process; for curvax the one-line ``kfac_jax`` module goes first on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        dump = hlo_dir / backend if hlo_dir is not None else Path(tmp, "hlo")
        if dump_hlo:  # the size of each compiled program, independent of the machine's load
            env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
        if backend == "curvax_legacy_pmap":  # the pmap lowering kfac-jax 0.0.8 selects on import
            env["JAX_PMAP_SHMAP_MERGE"] = "false"
        if backend.startswith("curvax"):
            Path(tmp, "kfac_jax.py").write_text(SHIM)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH", "")) if p)
        result = Path(tmp, "result.json")
        load = list(os.getloadavg())
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", backend, "--result", str(result), "--network", network],
                              env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        rec = json.loads(result.read_text()) if result.exists() else {"backend": backend, "ok": False}
        if dump_hlo:
            rec["largest_xla_modules"] = hlo_sizes(dump)
    rec.update(process_s=time.perf_counter() - t, returncode=proc.returncode, load_average_start=load,
               load_average_end=list(os.getloadavg()))
    if proc.returncode:
        rec["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return rec


def print_table(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        print(f"\n== {r['backend']} ({'ok' if r.get('ok') else 'FAILED: ' + str(r.get('error'))[:200]})")
        for phase, p in r.get("phases", {}).items():
            print(f"{phase:8s} wall {p['wall_s'] or 0:7.2f}s  traces {p['user_function_traces']}  "
                  f"jaxpr traces {p['trace_count']} ({p['trace_s']:.2f}s)  lowerings {p['lower_count']} "
                  f"({p['lower_s']:.2f}s)  XLA compiles {p['compile_count']} ({p['compile_s']:.2f}s)")
            for c in p["compiled"] if phase.startswith("step") else []:
                print(f"           compiled {c}")
        for m in r.get("largest_xla_modules", []):
            print(f"  module {m['module']}: {m['instructions_before_opt']} instructions before XLA's "
                  f"optimizations, {m['instructions_after_opt']} after")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "clients_first_step.json")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--hlo-dir", type=Path, help="keep the HLO dumps there (one folder per backend)")
    p.add_argument("--dump-hlo", action="store_true", help="also count the instructions of the largest "
                   "compiled programs (XLA_FLAGS=--xla_dump_to; adds a little to the compile times)")
    p.add_argument("--network", choices=("default", "small", "psiformer_small"), default="default",
                   help="small: 2 determinants, hidden ((16, 4), (16, 4)), the network of clients.py's rows; "
                   "psiformer_small: clients.py's attention row")
    p.add_argument("--repeats", type=int, default=1, help="runs per backend, the backends' order alternating")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.result, args.network)
    out = {"what": __doc__.split("\n")[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "configuration": {"walkers": WALKERS, "iterations": ITERATIONS, "devices": 1, "network": args.network,
                             "repeats": args.repeats},
           "machine": {"cpu_count": os.cpu_count(), "load_average_before": list(os.getloadavg())},
           "dump_hlo": args.dump_hlo,
           "runs": []}
    for repeat in range(args.repeats):
        for b in args.backends if repeat % 2 == 0 else args.backends[::-1]:
            out["runs"].append(run_child(b, args.timeout, args.dump_hlo or args.hlo_dir is not None, args.hlo_dir,
                                         args.network))
            out["runs"][-1]["repeat"] = repeat
    out["machine"]["load_average_after"] = list(os.getloadavg())
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out["runs"])
    print(f"\nwrote {args.output}")
    return 0 if all(r.get("ok") for r in out["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
