"""Benchmark: where K-FAC's inverse refresh goes on the MNIST CNN, and the staggered refresh.

Everything is measured in one run, interleaved, so that a shared machine's load
lands on every variant alike; the figures that matter are ratios within the run:

* ``ops``: for every Kronecker factor of the CNN's blocks (its real damped,
  pi-adjusted statistics after a few K-FAC steps), the time of ``eigh``
  (``linalg.safe_psd_eigh``), curvax's ``linalg.psd_inv`` (Cholesky),
  ``jnp.linalg.inv`` (LU) and a bare Cholesky, each jitted alone, and each
  inverse's relative error against a float64 NumPy inverse;
* ``blocks``: each block's whole ``update_cache`` (jitted alone);
* ``steps``: Adam, curvax adaptive K-FAC (``inverse_update_period=5``) and the
  same with ``inverse_update_staggered=True``, stepped in rotating order, each
  on its own trajectory: step-time distribution in units of Adam's median
  step, refresh steps apart, first step (compile) times;
* ``loss``: the two K-FAC trajectories' losses step by step.

Writes JSON (``--output``, default ``benchmarks/results/refresh.json``).
``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks as blocks_lib
from curvax import datasets, linalg

sys.path.insert(0, str(Path(__file__).parent))
import autoencoder  # noqa: E402
import cnn  # noqa: E402
import harness  # noqa: E402
from autoencoder import machine_info, write_results  # noqa: E402

PERIOD = 5  # the inverse_update_period of cnn.kfac_runner and curvax.autoencoder.make_kfac


def _rel_err(x: Any, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def op_timings(opt: Any, est_state: Any, identity_weight: float, repeats: int, per_op: bool = True) -> tuple[list, list]:
    """Per factor (ops) and per block (whole ``update_cache``) timings on real statistics."""
    est = opt.estimator
    ops: list[dict[str, Any]] = []
    block_rows: list[dict[str, Any]] = []
    routines = {
        "eigh": lambda m: linalg.safe_psd_eigh(m),
        "psd_inv": linalg.psd_inv,
        "jnp_inv": jnp.linalg.inv,
        "cholesky": jnp.linalg.cholesky,
    }
    for b, s in zip(est.blocks, est_state.blocks_states):
        cache_fn = jax.jit(lambda s, b=b: b.update_cache(s, identity_weight, None, -1, False))
        jax.block_until_ready(cache_fn(s))
        row: dict[str, Any] = {"block": b.name, "type": type(b).__name__, "dim": int(b.dim)}
        if isinstance(b, blocks_lib.TwoKroneckerFactored):
            row["factor_sides"] = [int(b.input_size()), int(b.output_size())]
        if per_op and isinstance(b, blocks_lib.TwoKroneckerFactored):
            row["factor_sides"] = [int(b.input_size()), int(b.output_size())]
            a, g = linalg.pi_adjusted_factors(s.inputs_factor.value, s.outputs_factor.value, identity_weight)
            for which, m in (("inputs", a), ("outputs", g)):
                ref = np.linalg.inv(np.asarray(m, np.float64))
                fns = {k: jax.jit(f) for k, f in routines.items()}
                entry: dict[str, Any] = {"block": b.name, "factor": which, "side": int(m.shape[0])}
                for k in ("psd_inv", "jnp_inv"):
                    entry[f"{k}_rel_err"] = _rel_err(fns[k](m), ref)
                for f in fns.values():
                    jax.block_until_ready(f(m))
                n_rep = repeats if m.shape[0] > 500 else 10 * repeats
                t = harness.interleave_thunks({k: (lambda f=f: f(m)) for k, f in fns.items()}, n_rep)
                entry.update({f"{k}_{stat}": v[stat] for k, v in t.items() for stat in ("median_s", "min_s")})
                ops.append(entry)
                print(f"  {b.name:10s} {which:7s} side {m.shape[0]:5d}: " + "  ".join(
                    f"{k} {t[k]['median_s'] * 1e3:8.2f}ms" for k in t), flush=True)
        block_rows.append((row, cache_fn, s))
    t = harness.interleave_thunks({r["block"]: (lambda f=f, s=s: f(s)) for r, f, s in block_rows}, repeats)
    out = []
    for r, _, _ in block_rows:
        r.update(update_cache_median_s=t[r["block"]]["median_s"], update_cache_min_s=t[r["block"]]["min_s"])
        out.append(r)
        print(f"  block {r['block']:10s} update_cache {r['update_cache_median_s'] * 1e3:8.2f}ms", flush=True)
    return ops, out


def refresh_per_phase(opt: Any, est_state: Any, identity_weight: float, repeats: int) -> dict[str, Any]:
    """The refresh alone: the whole ``update_cache`` against ``update_cache_staggered`` at each
    phase of one period (same statistics), each jitted once and called in rotating order."""
    est = opt.estimator
    w = jnp.asarray(identity_weight, jnp.float32)
    full = jax.jit(lambda s: est.update_cache(s, w, None, -1, False))
    stag = jax.jit(lambda s, t: est.update_cache_staggered(s, t, PERIOD, w, None, -1, False))
    fns = {"all_blocks": lambda: full(est_state)}
    for t in range(PERIOD, 2 * PERIOD):  # one period, away from step 0
        fns[f"phase_{t % PERIOD}"] = lambda t=t: stag(est_state, jnp.asarray(t, jnp.int32))
    for f in fns.values():
        jax.block_until_ready(f())
    t = harness.interleave_thunks(fns, repeats)
    phases = [t[f"phase_{p}"] for p in range(PERIOD)]
    out = {"times": t,
           "sum_of_phases_min_s": sum(x["min_s"] for x in phases),
           "max_phase_min_s": max(x["min_s"] for x in phases),
           "all_blocks_min_s": t["all_blocks"]["min_s"]}
    print("  refresh alone (min ms): all blocks {:.1f}; phases {}".format(
        out["all_blocks_min_s"] * 1e3, " ".join(f"{x['min_s'] * 1e3:.1f}" for x in phases)), flush=True)
    return out


def _dist(times: Sequence[float], unit: float) -> dict[str, float]:
    a = np.asarray(times) / unit
    return {"median": float(np.median(a)), "mean": float(a.mean()), "p95": float(np.percentile(a, 95)),
            "max": float(a.max()), "n": int(a.size)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("cnn", "autoencoder"), default="cnn",
                   help="cnn (benchmarks/cnn.py) or the MNIST autoencoder (eight dense blocks of similar size)")
    p.add_argument("--num-images", type=int, default=1000)
    p.add_argument("--skip-ops", action="store_true", help="skip the per-factor eigh/inverse timings")
    p.add_argument("--steps", type=int, default=50, help="interleaved rounds (steps per optimizer)")
    p.add_argument("--op-repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", default=None, help="default benchmarks/results/refresh[_autoencoder].json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_images, args.steps, args.op_repeats = 64, 12, 2
    if args.output is None:
        args.output = "benchmarks/results/refresh" + ("" if args.model == "cnn" else "_autoencoder") + ".json"
    print(f"MNIST {args.model}, {args.num_images} images full batch, inverse_update_period {PERIOD}", flush=True)
    if args.model == "cnn":
        x = datasets.load_mnist_images(args.num_images).reshape(-1, 28, 28, 1)
        batch = (jnp.asarray(x), jnp.asarray(datasets.load_mnist_labels(args.num_images)))
        runners = {
            "adam": cnn.adam_runner(batch, 1e-3, args.seed),
            "kfac_default": cnn.kfac_runner(batch, args.seed),
            "kfac_staggered": cnn.kfac_runner(batch, args.seed, staggered=True),
        }
    else:
        images = jnp.asarray(datasets.load_mnist_images(args.num_images))
        ae = lambda **kw: autoencoder.kfac_runner(images, args.seed, True, {}, 1.0, **kw)
        runners = {
            "adam": autoencoder.adam_runner(images, 1e-3, args.seed),
            "kfac_default": ae(),
            "kfac_staggered": ae(inverse_update_staggered=True),
        }
    carries = {k: c for k, (_, c) in runners.items()}
    times: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}  # CPU seconds of this process (all threads)
    losses: dict[str, list[float]] = {k: [] for k in runners}
    first: dict[str, float] = {}
    names = list(runners)
    for r in range(args.steps):
        for n in names[r % 3:] + names[: r % 3]:
            t, c = time.perf_counter(), time.process_time()
            carries[n], loss = runners[n][0](carries[n])
            jax.block_until_ready((carries[n], loss))
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if r == 0:
                first[n] = dt
            else:
                times[n].append(dt)
                cpu[n].append(dc)
            losses[n].append(float(loss))
        if r % 10 == 0:
            print(f"  round {r}: " + "  ".join(f"{n} {losses[n][-1]:.4f}" for n in names), flush=True)

    adam = statistics.median(times["adam"])
    adam_cpu = statistics.median(cpu["adam"])
    steps: dict[str, Any] = {"adam_step_median_s": adam, "adam_step_median_cpu_s": adam_cpu, "first_step_s": first}
    for n in ("kfac_default", "kfac_staggered"):
        ts = times[n]  # step r = 1 .. steps-1 (K-FAC's step counter equals r)
        refresh = [t for r, t in enumerate(ts, 1) if r % PERIOD == 0]
        other = [t for r, t in enumerate(ts, 1) if r % PERIOD != 0]
        steps[n] = {
            "all_steps_x_adam": _dist(ts, adam),
            "default_refresh_steps_x_adam": _dist(refresh, adam),
            "other_steps_x_adam": _dist(other, adam),
            # The same in CPU time (less sensitive to other processes on a shared machine).
            "cpu_all_steps_x_adam": _dist(cpu[n], adam_cpu),
            "cpu_default_refresh_steps_x_adam": _dist([c for r, c in enumerate(cpu[n], 1) if r % PERIOD == 0], adam_cpu),
            "cpu_other_steps_x_adam": _dist([c for r, c in enumerate(cpu[n], 1) if r % PERIOD != 0], adam_cpu),
            "first_step_s": first[n],
            "step_times_s": ts,
            "step_cpu_s": cpu[n],
        }
        print(f"{n:15s} x Adam: median {steps[n]['all_steps_x_adam']['median']:.2f} mean "
              f"{steps[n]['all_steps_x_adam']['mean']:.2f} p95 {steps[n]['all_steps_x_adam']['p95']:.2f} max "
              f"{steps[n]['all_steps_x_adam']['max']:.2f}; first step {first[n]:.2f}s", flush=True)
    d, s = np.asarray(losses["kfac_default"]), np.asarray(losses["kfac_staggered"])
    loss = {
        "kfac_default": losses["kfac_default"], "kfac_staggered": losses["kfac_staggered"], "adam": losses["adam"],
        "max_abs_diff": float(np.max(np.abs(d - s))),
        "max_rel_diff": float(np.max(np.abs(d - s) / np.abs(d))),
        "final_rel_diff": float(abs(d[-1] - s[-1]) / abs(d[-1])),
    }
    print(f"loss: default {d[-1]:.4f} staggered {s[-1]:.4f} (max rel diff {loss['max_rel_diff']:.3g})", flush=True)

    # Per op and per block, on the default run's final statistics and damping.
    (params, state) = carries["kfac_default"]
    opt = _optimizer_of(runners["kfac_default"][0])
    weight = float(opt.l2_reg + state.damping)
    print(f"refresh ops on the final statistics (identity weight {weight:.3g}):", flush=True)
    ops, blocks_rows = op_timings(opt, state.estimator_state, weight, args.op_repeats, not args.skip_ops)
    per_phase = refresh_per_phase(opt, state.estimator_state, weight, 3 * args.op_repeats)
    phases = opt.estimator.refresh_phases(PERIOD)
    summary = {
        "adam_step_median_s": adam,
        "default": {k: steps["kfac_default"]["all_steps_x_adam"][k] for k in ("median", "mean", "p95", "max")},
        "default_refresh_steps_max_x_adam": steps["kfac_default"]["default_refresh_steps_x_adam"]["max"],
        "staggered": {k: steps["kfac_staggered"]["all_steps_x_adam"][k] for k in ("median", "mean", "p95", "max")},
        "staggered_phase_steps_max_x_adam": steps["kfac_staggered"]["default_refresh_steps_x_adam"]["max"],
        "cpu_default": {k: steps["kfac_default"]["cpu_all_steps_x_adam"][k] for k in ("median", "mean", "p95", "max")},
        "cpu_staggered": {k: steps["kfac_staggered"]["cpu_all_steps_x_adam"][k] for k in ("median", "mean", "p95", "max")},
        "first_step_s": first,
        "loss_max_rel_diff": loss["max_rel_diff"],
        "refresh_phases": dict(zip([b.name for b in opt.estimator.blocks], phases)),
        "refresh_alone_min_ms": {"all_blocks": per_phase["all_blocks_min_s"] * 1e3,
                                 "max_phase": per_phase["max_phase_min_s"] * 1e3,
                                 "sum_of_phases": per_phase["sum_of_phases_min_s"] * 1e3},
        "block_update_cache_ms": {r["block"]: r["update_cache_median_s"] * 1e3 for r in blocks_rows},
    }
    out = {"benchmark": f"{args.model}_refresh", "machine": machine_info(), "settings": vars(args), "summary": summary,
           "steps": steps, "loss": loss, "refresh_per_phase": per_phase, "ops": ops, "blocks": blocks_rows}
    write_results(args.output, out, summary)
    return 0


def _optimizer_of(step: Callable[..., Any]) -> Any:
    """The ``curvax.Optimizer`` a ``cnn.kfac_runner`` step closes over."""
    for cell in step.__closure__ or ():
        if type(cell.cell_contents).__name__ == "Optimizer":
            return cell.cell_contents
    raise RuntimeError("no optimizer in the step's closure")


if __name__ == "__main__":
    sys.exit(main())
