"""Benchmark: curvax K-FAC against what users would pick instead, on three models, in one run.

Optimizers: Optax Adam and AdamW (learning rate picked by a short grid search, recorded), the
second-order-flavoured optimizers of the installed Optax where they exist (``optax.contrib.muon``,
``optax.contrib.sophia``, ``optax.lbfgs``), curvax K-FAC (adaptive), and kfac-jax 0.0.8 with the
same settings when ``--kfac-jax-python`` names an interpreter that has it (kfac-jax 0.0.8 needs
JAX 0.9.0, so it runs in a child process of that interpreter, next to an Adam run there that its
per-step ratio is taken against). Models: the deep MNIST autoencoder, a small MNIST CNN and a
character-level transformer (``benchmarks/_compare_models.py``), each trained full batch.

Per optimizer and model: setup (building the optimizer; K-FAC's ``init`` traces the loss) and
the first step (trace + compile + run) apart from the rest; median and mean step time after a
short warm-up, every step waiting on its outputs (``jax.block_until_ready``), and its ratio to
the Adam run's median step in the same process, and again from rounds of interleaved steps
after the runs (``--ratio-rounds``: one step of each optimizer per round, rotating order, so a
busy machine's drift hits all alike); steps and seconds to the model's target loss;
the loss at every step with its wall clock. Budgeted by steps (``--*-steps``) with a time cap
per run (``--time-cap``). Writes one JSON (``--output``); ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import optax

sys.path.insert(0, str(Path(__file__).parent))
import _compare_models as models  # noqa: E402
import harness  # noqa: E402
from autoencoder import machine_info  # noqa: E402  (shared benchmark helper)

# A benchmark step: carry -> (carry, loss before the update).
Step = Callable[[Any], tuple[Any, jax.Array]]
MAX_CURVE_POINTS = 400


# ---------------------------------------------------------------------------------------------
# Optimizers


def _optax_optimizers() -> dict[str, dict[str, Any]]:
    """name -> {"make": lr -> GradientTransformation, "grid": learning rates or None, "kind"}.

    Only what the installed Optax has: contrib optimizers are looked up with ``hasattr``.
    ``kind`` says which extra arguments ``update`` needs (Sophia: the objective; L-BFGS: the
    value, gradient and objective for its line search).
    """
    out: dict[str, dict[str, Any]] = {
        "adam": {"make": optax.adam, "grid": [3e-4, 1e-3, 3e-3, 1e-2], "kind": "plain"},
        "adamw": {"make": lambda learning_rate: optax.adamw(learning_rate, weight_decay=1e-4),
                  "grid": [3e-4, 1e-3, 3e-3, 1e-2], "kind": "plain"},
    }
    contrib = getattr(optax, "contrib", None)
    if contrib is not None and hasattr(contrib, "muon"):
        out["muon"] = {"make": contrib.muon, "grid": [3e-3, 1e-2, 3e-2, 1e-1], "kind": "plain"}
    if contrib is not None and hasattr(contrib, "sophia"):
        out["sophia"] = {"make": contrib.sophia, "grid": [3e-4, 1e-3, 3e-3, 1e-2], "kind": "sophia"}
    if hasattr(optax, "lbfgs"):
        out["lbfgs"] = {"make": lambda learning_rate: optax.lbfgs(), "grid": None, "kind": "lbfgs"}
    return out


def optax_runner(model: models.Model, tx: Any, kind: str) -> tuple[Step, Any]:
    """A jitted full-batch step of the Optax transformation ``tx`` and its initial carry."""
    batch, loss_fn = model.batch, model.loss_fn

    def objective(p: Any) -> jax.Array:
        return loss_fn(p, batch)

    @jax.jit
    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if kind == "sophia":
            updates, opt_state = tx.update(grads, opt_state, params, obj_fn=objective)
        elif kind == "lbfgs":
            updates, opt_state = tx.update(grads, opt_state, params, value=loss, grad=grads, value_fn=objective)
        else:
            updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (model.params, tx.init(model.params))


def kfac_runner(mod: Any, model: models.Model, seed: int) -> tuple[Step, Any]:
    """A K-FAC step of ``mod.Optimizer`` (curvax or kfac_jax), adaptive, and its initial carry."""
    opt = models.kfac_optimizer(mod, model)
    rng = jax.random.PRNGKey(seed + 1)
    state = opt.init(model.params, rng, model.batch)
    counter = itertools.count()

    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, state = carry
        i = next(counter)
        params, state, stats = opt.step(params, state, jax.random.fold_in(rng, i),
                                        data_iterator=itertools.repeat(model.batch), global_step_int=i)
        return (params, state), stats["loss"]

    return step, (model.params, state)


# ---------------------------------------------------------------------------------------------
# Measurement


def measure(make: Callable[[], tuple[Step, Any]], max_steps: int, time_cap: float, target: float,
            warmup: int, stop_at_target: bool = True, min_timed: int = 10,
            keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Builds a runner and runs it for ``max_steps`` steps (its step and last carry go to ``keep``).

    It stops earlier after ``time_cap`` seconds, when the loss is not finite, or (with
    ``stop_at_target``) once the target is reached and ``min_timed`` steps have been timed.
    ``seconds`` on the curve count from before the build (setup and compilation included);
    ``seconds_to_target_after_compile`` leaves out setup and the first step.
    """
    t0 = time.perf_counter()
    step, carry = make()
    setup_s = time.perf_counter() - t0
    losses: list[float] = []
    clock: list[float] = []
    times: list[float] = []
    elapsed = setup_s
    stopped_by = "steps"
    for i in range(max_steps):
        carry, loss, dt = harness.timed_step(step, carry)
        elapsed += dt
        times.append(dt)
        losses.append(float(loss))
        clock.append(elapsed)
        if not math.isfinite(losses[-1]):
            stopped_by = "not finite"
            break
        if stop_at_target and min(losses) <= target and i >= warmup + min_timed and i + 1 < max_steps:
            stopped_by = "target"
            break
        if elapsed > time_cap and i + 1 < max_steps:
            stopped_by = "time cap"
            break
    if keep is not None and math.isfinite(losses[-1]):
        keep["runner"] = (step, carry)
    timed = times[1 + warmup:]
    hit = next((i for i, x in enumerate(losses) if x <= target), None)
    finite = [x for x in losses if math.isfinite(x)]
    stride = max(1, math.ceil(len(losses) / MAX_CURVE_POINTS))
    keep = sorted(set(range(0, len(losses), stride)) | {len(losses) - 1} | ({hit} if hit is not None else set()))
    return {
        "setup_s": setup_s,
        "first_step_s": times[0],
        "step_median_s": statistics.median(timed) if timed else None,
        "step_mean_s": statistics.fmean(timed) if timed else None,
        "timed_steps": len(timed),
        "steps_run": len(losses),
        "seconds_run": elapsed,
        "stopped_by": stopped_by,
        "final_loss": losses[-1] if math.isfinite(losses[-1]) else None,
        "best_loss": min(finite) if finite else None,
        "diverged": not math.isfinite(losses[-1]),
        "steps_to_target": None if hit is None else hit + 1,
        "seconds_to_target": None if hit is None else clock[hit],
        "seconds_to_target_after_compile": None if hit is None else clock[hit] - setup_s - times[0],
        "curve": {
            "step": [i + 1 for i in keep],
            "loss": [losses[i] if math.isfinite(losses[i]) else None for i in keep],
            "seconds": [clock[i] for i in keep],
        },
    }


def interleaved_steps(runners: dict[str, tuple[Step, Any]], rounds: int) -> dict[str, list[float]]:
    """Step times of already compiled runners, one step of each per round in a rotating order.

    Drift and background load of a shared machine then hit every optimizer alike; each runner
    continues its own trajectory.
    """
    steps = {n: step for n, (step, _) in runners.items()}
    return harness.interleave_steps(steps, {n: carry for n, (_, carry) in runners.items()}, rounds)["times"]


def add_interleaved(results: dict[str, Any], runners: dict[str, tuple[Step, Any]], rounds: int,
                    reference: str) -> None:
    """Stores ``interleaved_step_times_s`` and the interleaved ratios to ``reference`` in ``results``."""
    if rounds <= 0 or reference not in runners:
        return
    times = interleaved_steps(runners, rounds)
    ref = times[reference]
    for n, ts in times.items():
        results[n]["interleaved_step_times_s"] = ts
        results[n]["interleaved_ratio_median"] = statistics.median(ts) / statistics.median(ref)
        results[n]["interleaved_ratio_per_round_median"] = statistics.median(a / b for a, b in zip(ts, ref))


def tune(model: models.Model, spec: dict[str, Any], steps: int, time_cap: float) -> dict[str, Any]:
    """Grid search: each learning rate for ``steps`` steps; the lowest mean of the last 5 losses wins.

    The learning rate lives in the optimizer state (``optax.inject_hyperparams``), so the grid
    compiles one program; the measured run that follows compiles its own.
    """
    grid: dict[str, float | None] = {}
    tx = optax.inject_hyperparams(spec["make"])(learning_rate=spec["grid"][0])
    step, (params, state0) = optax_runner(model, tx, spec["kind"])
    for lr in spec["grid"]:
        state = tx.init(params)
        state.hyperparams["learning_rate"] = jax.numpy.asarray(lr, state.hyperparams["learning_rate"].dtype)
        r = measure(lambda: (step, (params, state)), steps, time_cap, -math.inf, 0, stop_at_target=False)
        tail = [x for x in r["curve"]["loss"][-5:]]
        grid[f"{lr:g}"] = None if r["diverged"] or None in tail else statistics.fmean(tail)
    finite = {k: v for k, v in grid.items() if v is not None}
    best = min(finite, key=finite.__getitem__) if finite else f"{spec['grid'][0]:g}"
    return {"grid": spec["grid"], "tune_steps": steps, "loss_at_end_of_tuning": grid, "chosen_lr": float(best)}


def _report(model: str, name: str, r: dict[str, Any]) -> None:
    med = "n/a" if r["step_median_s"] is None else f"{1e3 * r['step_median_s']:7.1f}ms"
    tgt = "not reached" if r["steps_to_target"] is None else f"{r['steps_to_target']} steps / {r['seconds_to_target']:.1f}s"
    final = "nan" if r["final_loss"] is None else f"{r['final_loss']:.4g}"
    print(f"  {model:11s} {name:18s} setup {r['setup_s']:5.1f}s first {r['first_step_s']:6.2f}s median {med} "
          f"final {final} after {r['steps_run']} steps; target: {tgt}", flush=True)


def summarize(results: dict[str, Any], adam_name: str = "adam") -> dict[str, Any]:
    """Per optimizer: ratios of its step times to the Adam run's median step, and the target figures."""
    ref = results.get(adam_name, {}).get("step_median_s")
    out: dict[str, Any] = {"adam_step_median_s": ref}
    for name, r in results.items():
        # kfac-jax's child process has its own Adam run (same learning rate, JAX 0.9.0).
        base = results.get(r.get("ratio_reference", adam_name), {}).get("step_median_s")
        ok = base is not None and r["step_median_s"] is not None
        out[name] = {
            "learning_rate": r.get("learning_rate"),
            "setup_s": r["setup_s"],
            "first_step_s": r["first_step_s"],
            "step_median_s": r["step_median_s"],
            "step_ratio_median": r["step_median_s"] / base if ok else None,
            "step_ratio_mean": r["step_mean_s"] / base if ok else None,
            "interleaved_ratio_median": r.get("interleaved_ratio_median"),
            "interleaved_ratio_per_round_median": r.get("interleaved_ratio_per_round_median"),
            "steps_to_target": r["steps_to_target"],
            "seconds_to_target": r["seconds_to_target"],
            "seconds_to_target_after_compile": r["seconds_to_target_after_compile"],
            "final_loss": r["final_loss"],
            "steps_run": r["steps_run"],
        }
    reached = [n for n, r in results.items() if r["seconds_to_target"] is not None]
    out["fastest_to_target"] = min(reached, key=lambda n: results[n]["seconds_to_target"]) if reached else None
    return out


# ---------------------------------------------------------------------------------------------
# Command line


MODEL_FLAGS = {"autoencoder": "ae", "cnn": "cnn", "transformer": "lm"}
DEFAULTS = {  # size, steps, target loss
    "autoencoder": (500, 150, 130.0),
    "cnn": (256, 60, 0.3),
    "transformer": (64, 150, 1.0),
}
QUICK = {"autoencoder": (32, 4, 500.0), "cnn": (16, 4, 2.2), "transformer": (4, 4, 3.2)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=models.MODELS, default=list(models.MODELS))
    p.add_argument("--optimizers", nargs="+", default=None,
                   help="subset of: adam adamw muon sophia lbfgs curvax_kfac (default all available; "
                        "adam is always run, it is the reference of the step ratios)")
    for m, flag in MODEL_FLAGS.items():
        size, steps, target = DEFAULTS[m]
        what = "sequences" if m == "transformer" else "images"
        p.add_argument(f"--{flag}-size", type=int, default=size, help=f"{m}: full-batch {what} (default {size})")
        p.add_argument(f"--{flag}-steps", type=int, default=steps, help=f"{m}: step budget (default {steps})")
        p.add_argument(f"--{flag}-target", type=float, default=target, help=f"{m}: target loss (default {target})")
    p.add_argument("--tune-fraction", type=float, default=0.2,
                   help="grid search horizon as a fraction of the step budget (default 0.2)")
    p.add_argument("--time-cap", type=float, default=90.0, help="seconds per run, setup included (default 90)")
    p.add_argument("--full-curves", action="store_true",
                   help="run every optimizer for its whole step budget (default: stop once the target is "
                        "reached and 10 steps have been timed)")
    p.add_argument("--ratio-rounds", type=int, default=10,
                   help="after a model's runs, rounds of interleaved steps (one per optimizer, rotating order) "
                        "for the interleaved step ratios (default 10; 0: none)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps after the first left out of step times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kfac-jax-python", default=None,
                   help="a Python interpreter with kfac-jax 0.0.8 (and JAX 0.9.0) and curvax importable: "
                        "runs kfac-jax (and an Adam reference) there in a child process")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (small models, 4 steps, one-point grids)")
    p.add_argument("--output", default="benchmarks/results/compare.json", help="JSON output path")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON spec: run as kfac-jax child
    args = p.parse_args(argv)
    if args.quick:
        for m, flag in MODEL_FLAGS.items():
            size, steps, target = QUICK[m]
            setattr(args, f"{flag}_size", size)
            setattr(args, f"{flag}_steps", steps)
            setattr(args, f"{flag}_target", target)
        args.tune_fraction, args.time_cap, args.warmup_steps, args.ratio_rounds = 0.5, 60.0, 1, 2
    return args


def model_config(args: argparse.Namespace, name: str) -> tuple[int, int, float]:
    flag = MODEL_FLAGS[name]
    return getattr(args, f"{flag}_size"), getattr(args, f"{flag}_steps"), getattr(args, f"{flag}_target")


def run_model(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Every optimizer on one model (curvax registration), in this process."""
    import curvax

    size, steps, target = model_config(args, name)
    model = models.BUILDERS[name](curvax, size, args.quick, args.seed)
    specs = _optax_optimizers()
    wanted = args.optimizers or [*specs, "curvax_kfac"]
    wanted = ["adam", *[w for w in wanted if w != "adam"]]
    unknown = [w for w in wanted if w not in specs and w != "curvax_kfac"]
    if unknown:
        raise SystemExit(f"--optimizers: {unknown} not available here (choose from {[*specs, 'curvax_kfac']})")
    print(f"{name}: {model.description}; {model.num_params} parameters; target loss {target:g}; "
          f"{steps} steps", flush=True)
    tuning: dict[str, Any] = {}
    results: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    for opt in wanted:
        keep: dict[str, Any] = {}
        if opt == "curvax_kfac":
            r = measure(lambda: kfac_runner(curvax, model, args.seed), steps, args.time_cap, target, args.warmup_steps,
                        not args.full_curves, keep=keep)
            r["settings"] = models.json_settings(model.kfac_settings)
            r["learning_rate"] = "adaptive"
        else:
            spec = specs[opt]
            lr = None
            if spec["grid"]:
                grid = spec["grid"]
                if args.quick:  # two points for Adam, one for the others
                    grid = grid[:2] if opt == "adam" else grid[1:2]
                tuning[opt] = tune(model, {**spec, "grid": grid}, max(2, round(args.tune_fraction * steps)),
                                   args.time_cap)
                lr = tuning[opt]["chosen_lr"]
            r = measure(lambda: optax_runner(model, spec["make"](lr), spec["kind"]), steps, args.time_cap, target,
                        args.warmup_steps, not args.full_curves, keep=keep)
            r["learning_rate"] = lr if lr is not None else "line search"
        r["environment"] = "main"
        results[opt] = r
        if "runner" in keep:
            runners[opt] = keep["runner"]
        _report(name, opt, r)
    add_interleaved(results, runners, args.ratio_rounds, "adam")
    return {"description": model.description, "num_params": model.num_params, "batch_size": model.batch_size,
            "target_loss": target, "max_steps": steps, "tuning": tuning, "results": results}


def run_child(spec: dict[str, Any]) -> None:
    """The kfac-jax child: per model, Adam (the parent's tuned learning rate) then kfac-jax."""
    import kfac_jax

    args = argparse.Namespace(**spec["args"])
    out: dict[str, Any] = {"jax": jax.__version__, "kfac_jax": getattr(kfac_jax, "__version__", None),
                           "machine": machine_info(), "models": {}}
    for name in args.models:
        size, steps, target = model_config(args, name)
        model = models.BUILDERS[name](kfac_jax, size, args.quick, args.seed)
        lr = spec["adam_lr"][name]
        res: dict[str, Any] = {}
        k1: dict[str, Any] = {}
        k2: dict[str, Any] = {}
        res["adam_kfac_jax_env"] = measure(lambda: optax_runner(model, optax.adam(lr), "plain"), steps, args.time_cap,
                                           target, args.warmup_steps, not args.full_curves, keep=k1)
        res["adam_kfac_jax_env"]["learning_rate"] = lr
        res["kfac_jax"] = measure(lambda: kfac_runner(kfac_jax, model, args.seed), steps, args.time_cap, target,
                                  args.warmup_steps, not args.full_curves, keep=k2)
        runners = {n: k["runner"] for n, k in (("adam_kfac_jax_env", k1), ("kfac_jax", k2)) if "runner" in k}
        add_interleaved(res, runners, args.ratio_rounds, "adam_kfac_jax_env")
        res["kfac_jax"]["learning_rate"] = "adaptive"
        res["kfac_jax"]["settings"] = models.json_settings(model.kfac_settings)
        for n, r in res.items():
            r["environment"] = f"kfac-jax child (jax {jax.__version__})"
            r["ratio_reference"] = "adam_kfac_jax_env"
            _report(name, n, r)
        out["models"][name] = res
    Path(spec["output"]).write_text(json.dumps(out))


def run_kfac_jax(args: argparse.Namespace, per_model: dict[str, Any]) -> dict[str, Any]:
    """Runs this script under ``--kfac-jax-python`` as the kfac-jax child; returns what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        spec = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "output": str(out),
                "adam_lr": {m: per_model[m]["tuning"].get("adam", {}).get("chosen_lr", 1e-3) for m in per_model}}
        cmd = [args.kfac_jax_python, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        print(f"kfac-jax: {args.kfac_jax_python} (child process)", flush=True)
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], text=True, stdout=sys.stdout,
                              stderr=subprocess.PIPE)
        if proc.returncode != 0 or not out.exists():
            tail = proc.stderr.strip().splitlines()[-5:]
            print("kfac-jax child failed:\n" + "\n".join(tail), flush=True)
            return {"status": "failed", "python": args.kfac_jax_python, "error": "\n".join(tail)}
        child = json.loads(out.read_text())
    return {"status": "ok", "python": args.kfac_jax_python, **child}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_child(json.loads(args.child))
        return 0
    print(f"compare: {jax.default_backend()} backend, JAX {jax.__version__}, Optax {optax.__version__}", flush=True)
    per_model = {name: run_model(args, name) for name in args.models}
    kfj: dict[str, Any] = {"status": "not requested (pass --kfac-jax-python)"}
    if args.kfac_jax_python:
        kfj = run_kfac_jax(args, per_model)
        for name, res in kfj.get("models", {}).items():
            per_model[name]["results"].update(res)
        kfj.pop("models", None)
    for entry in per_model.values():
        entry["summary"] = summarize(entry["results"])
    out = {
        "benchmark": "compare",
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "optimizers_available": [*_optax_optimizers(), "curvax_kfac"],
        "kfac_jax": kfj,
        "models": per_model,
    }
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    for name, entry in per_model.items():
        print(f"{name} (target {entry['target_loss']:g}): fastest to target: {entry['summary']['fastest_to_target']}")
        for opt, s in entry["summary"].items():
            if isinstance(s, dict):
                ratio = "n/a" if s["step_ratio_median"] is None else f"{s['step_ratio_median']:.2f}x"
                inter = s["interleaved_ratio_median"]
                ratio += "" if inter is None else f" (interleaved {inter:.2f}x)"
                print(f"  {opt:18s} step ratio {ratio:>7s}  steps to target {s['steps_to_target']}  "
                      f"seconds {s['seconds_to_target'] and round(s['seconds_to_target'], 1)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
