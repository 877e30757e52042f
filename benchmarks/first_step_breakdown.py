"""Benchmark: where the time to the first K-FAC step goes, curvax against kfac-jax, same JAX.

For each library, a fresh child process builds the optimizer of ``_compare_models`` (the same
settings as ``compare.py``) on one model and runs ``init`` and the first two steps. JAX's own
monitoring events (``jax.monitoring``: tracing to a jaxpr, lowering to MLIR, XLA's backend
compile, with the name of each program) are recorded per phase: building the optimizer, ``init``, step 0 (burn-in included), step 1.
The two libraries run alternately (``--repeats`` times each) so load drift hits both; the load
average is recorded around every child. Needs an interpreter with kfac-jax 0.0.8, its JAX
(0.9.0) and curvax importable (``PYTHONPATH``) for the kfac-jax rows.

    PYTHONPATH=. /work/venv-kfac/bin/python benchmarks/first_step_breakdown.py --output benchmarks/results/first_step_breakdown.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PHASES = ("build", "init", "step0", "step1")
EVENTS = {  # jax.monitoring duration events -> short names
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def child(lib: str, model_name: str, size: int) -> dict[str, Any]:
    """In the child: one optimizer's build, init and two steps, with JAX's events per phase."""
    import itertools

    import jax

    sys.path.insert(0, str(Path(__file__).parent))
    import _compare_models as models

    mod = __import__(lib)
    phase = ["setup"]
    events: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    programs: dict[str, dict[str, dict[str, float]]] = collections.defaultdict(dict)

    def on_duration(event: str, duration: float, fun_name: str = "?", **_: Any) -> None:
        if event in EVENTS:
            events[phase[0]][EVENTS[event]].append(duration)
            if EVENTS[event] != "trace" and duration > 0.05:  # the programs that matter, by name
                per = programs[phase[0]].setdefault(fun_name, {})
                per[EVENTS[event]] = per.get(EVENTS[event], 0.0) + duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    model = models.BUILDERS[model_name](mod, size, False, 0)
    jax.block_until_ready(model.params)
    wall: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        phase[0] = name
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        wall[name] = time.perf_counter() - t
        return out

    rng = jax.random.PRNGKey(1)
    opt = timed("build", lambda: models.kfac_optimizer(mod, model))
    state = timed("init", lambda: opt.init(model.params, rng, model.batch))
    params = model.params
    for i in range(2):
        params, state, _ = timed(f"step{i}", lambda: opt.step(params, state, jax.random.fold_in(rng, i),
                                                               data_iterator=itertools.repeat(model.batch),
                                                               global_step_int=i))
    return {
        "wall_s": wall,
        "events": {p: {k: {"count": len(v), "total_s": sum(v)} for k, v in ev.items()} for p, ev in events.items()},
        "programs": {p: v for p, v in programs.items()},
        "jax": jax.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["autoencoder", "transformer"])
    p.add_argument("--libs", nargs="+", default=["curvax", "kfac_jax"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        lib, model_name, size = json.loads(args.child)
        print(json.dumps(child(lib, model_name, size)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from autoencoder import machine_info
    from compare import DEFAULTS

    out: dict[str, Any] = {"benchmark": "first_step_breakdown", "machine": machine_info(), "models": {}}
    for model_name in args.models:
        runs: dict[str, list[dict[str, Any]]] = {lib: [] for lib in args.libs}
        for r in range(args.repeats):
            for lib in args.libs if r % 2 == 0 else args.libs[::-1]:
                load = os.getloadavg()
                spec = json.dumps([lib, model_name, DEFAULTS[model_name][0]])
                proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu"})
                if proc.returncode != 0:
                    runs[lib].append({"error": proc.stderr[-2000:]})
                    continue
                rec = json.loads(proc.stdout.strip().splitlines()[-1])
                rec["load_average_before"], rec["load_average_after"] = load, os.getloadavg()
                runs[lib].append(rec)
                w = rec["wall_s"]
                print(f"{model_name} {lib}: " + " ".join(f"{k} {v:.2f}s" for k, v in w.items()), flush=True)
        summary = {}
        for lib, recs in runs.items():
            ok = [x for x in recs if "wall_s" in x]
            if ok:
                summary[lib] = {
                    "wall_median_s": {ph: statistics.median(x["wall_s"][ph] for x in ok) for ph in PHASES},
                    "to_end_of_first_step_median_s": statistics.median(
                        sum(x["wall_s"][ph] for ph in PHASES[:3]) for x in ok),
                    "compile_s_median": {ph: statistics.median(
                        x["events"].get(ph, {}).get("compile", {}).get("total_s", 0.0) for x in ok) for ph in PHASES},
                }
        out["models"][model_name] = {"runs": runs, "summary": summary}
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
