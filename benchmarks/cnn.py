"""Benchmark: curvax K-FAC on an MNIST CNN against Optax Adam, and first-step times per framework.

Part 1 (one run, one machine, so the ratios are meaningful): a small CNN
(conv 3x3x16, pool, conv 3x3x32, pool, dense) classifying real MNIST digits,
full batch. Step times: Adam (each learning rate) and curvax (adaptive) are
built, warmed up, then stepped in rounds, one step of each per round in a
rotating order, so the machine's load hits them alike (``interleaved``: every
step time, the medians, the load average before and after). ``--before`` adds
curvax with the KFC statistics' previous formulation (patches by a one-hot
convolution, no cache-sized chunks) to the same rounds; ``--breakdown``
adds curvax with fixed coefficients (no quadratic model) and without the
statistics update, to split the step's time. Then each optimizer runs alone
for the first step and the steps and seconds to a target training loss.
Part 2: for the CNN of every framework in ``tests/zoo.py``, the time of
curvax's first step (trace + layer detection + compile + run) next to Adam's.

Writes JSON (``--output``). ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import curvax
from curvax import datasets
from curvax.layers import conv as conv_layers

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import harness  # noqa: E402
from autoencoder import machine_info, measure, write_results  # noqa: E402  (shared benchmark helpers)

CHANNELS = (16, 32)


def init_params(key: jax.Array) -> dict[str, Any]:
    k = jax.random.split(key, 3)
    he = lambda kk, shape, fan_in: jax.random.normal(kk, shape) * np.sqrt(2.0 / fan_in)
    return {
        "conv1": {"w": he(k[0], (3, 3, 1, CHANNELS[0]), 9), "b": jnp.zeros(CHANNELS[0])},
        "conv2": {"w": he(k[1], (3, 3, CHANNELS[0], CHANNELS[1]), 9 * CHANNELS[0]), "b": jnp.zeros(CHANNELS[1])},
        "out": {"w": he(k[2], (7 * 7 * CHANNELS[1], 10), 7 * 7 * CHANNELS[1]) / 4, "b": jnp.zeros(10)},
    }


def _conv_relu_pool(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b"]
    y = jax.nn.relu(y)
    b, h, w, c = y.shape
    return y.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


def loss_fn(params: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, labels = batch
    h = _conv_relu_pool(_conv_relu_pool(x, params["conv1"]), params["conv2"])
    logits = h.reshape(h.shape[0], -1) @ params["out"]["w"] + params["out"]["b"]
    curvax.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def adam_runner(batch: Any, lr: float, seed: int) -> tuple[Any, Any]:
    tx = optax.adam(lr)
    params = init_params(jax.random.PRNGKey(seed))

    @jax.jit
    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params))


def kfac_runner(
    batch: Any, seed: int, value_and_grad: Any = None, params: Any = None, staggered: bool = False,
    fixed: bool = False, statistics_period: int = 1,
) -> tuple[Any, Any]:
    """curvax adaptive K-FAC; ``staggered`` spreads the inverse refresh over the period.

    ``fixed`` (learning rate 1e-3, momentum 0.9, damping 1) drops the quadratic model;
    ``statistics_period`` > 1 updates the statistics (and refreshes) that rarely: both only
    split the step's time (``--breakdown``)."""
    adaptive = not fixed
    opt = curvax.Optimizer(
        value_and_grad_func=value_and_grad or jax.value_and_grad(loss_fn),
        l2_reg=1e-5, use_adaptive_learning_rate=adaptive, use_adaptive_momentum=adaptive,
        use_adaptive_damping=adaptive, initial_damping=1.0, num_burnin_steps=2,
        inverse_update_period=max(5, statistics_period), inverse_update_staggered=staggered,
        curvature_update_period=statistics_period,
    )
    params = init_params(jax.random.PRNGKey(seed)) if params is None else params
    rng = jax.random.PRNGKey(seed + 1)
    state = opt.init(params, rng, batch)
    counter = itertools.count()
    given = {"learning_rate": 1e-3, "momentum": 0.9, "damping": 1.0} if fixed else {}

    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, state = carry
        i = next(counter)
        params, state, stats = opt.step(
            params, state, jax.random.fold_in(rng, i), batch=batch, global_step_int=i, **given
        )
        return (params, state), stats["loss"]

    return step, (params, state)


def _onehot_patch_gram(x: jax.Array, spec: Any, k_sp: Sequence[int], c: int) -> tuple[jax.Array, jax.Array]:
    """The KFC statistics' previous patch Gram: patches from ``conv_general_dilated_patches``
    (a one-hot grouped convolution), multiplied in their (channel, offset) order, the result
    permuted to (offset, channel); batch chunks (``lax.map``, a divisor of the batch) only past
    ``get_max_parallel_elements()`` patch values. Channels-last inputs (this CNN)."""
    k = int(np.prod(k_sp))
    n = x.shape[0]

    def moments(xc: jax.Array) -> tuple[jax.Array, jax.Array]:
        p = conv_layers._canonical_out(conv_layers._conv_patches(xc, spec, k_sp), spec).reshape(-1, k * c)
        return jnp.matmul(p.T, p, precision=spec.precision), jnp.sum(p, axis=0)

    per_example = k * c * int(np.prod(conv_layers._out_shape(spec, x, k_sp))) // n
    chunk = max(1, curvax.blocks.get_max_parallel_elements() // per_example)
    if chunk >= n:
        m, v = moments(x)
    else:
        size = max(i for i in range(1, chunk + 1) if n % i == 0)
        ms, vs = jax.lax.map(moments, x.reshape(n // size, size, *x.shape[1:]))
        m, v = jnp.sum(ms, axis=0), jnp.sum(vs, axis=0)
    m = m.reshape(c, k, c, k).transpose(1, 0, 3, 2).reshape(k * c, k * c)
    return m, v.reshape(c, k).T.reshape(k * c)


@contextlib.contextmanager
def previous_formulation() -> Any:
    """While active, curvax traces its KFC statistics as before: patches from a one-hot
    convolution, the whole batch at once up to ``get_max_parallel_elements()``. Compiled steps keep it."""
    saved = conv_layers._patch_gram
    conv_layers._patch_gram = _onehot_patch_gram
    try:
        yield
    finally:
        conv_layers._patch_gram = saved


def interleaved_steps(makers: dict[str, Any], warmup: int, rounds: int, before: set[str]) -> dict[str, Any]:
    """Builds every runner (those in ``before`` under ``previous_formulation``, compiled there),
    warms them up together, then times ``rounds`` interleaved rounds."""
    steps, carries = {}, {}
    for name, make in makers.items():
        with previous_formulation() if name in before else contextlib.nullcontext():
            steps[name], carries[name] = make()
            carries[name], _ = steps[name](carries[name])  # compiles the step (and the burn-in)
    harness.interleave_steps(steps, carries, warmup)
    timed = harness.interleave_steps(steps, carries, rounds)
    times = timed["times"]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    adam = float(np.median([m for n, m in med.items() if n.startswith("adam")]))
    return {
        "rounds": rounds, "warmup_rounds": warmup, "load_average_before": timed["load_average_before"],
        "load_average_after": timed["load_average_after"], "step_median_s": med,
        "ratio_to_adam_median": {n: m / adam for n, m in med.items()}, "step_times_s": times,
    }


def framework_first_steps(seed: int) -> dict[str, Any]:
    """curvax vs Adam first step (trace, detection, compile, run) on each framework's CNN."""
    import warnings

    import zoo

    out = {}
    for name, build in zoo.BUILDERS["cnn"].items():
        loss, params, batch = build(jax.random.PRNGKey(seed))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step, carry = kfac_runner(batch, seed, jax.value_and_grad(loss), params)
            jax.block_until_ready(step(carry))
        kfac_s = time.perf_counter() - t0
        tx = optax.adam(1e-3)
        t0 = time.perf_counter()
        grads = jax.jit(jax.grad(loss))(params, batch)
        jax.block_until_ready(tx.update(grads, tx.init(params), params))
        out[name] = {"curvax_first_step_s": kfac_s, "adam_first_step_s": time.perf_counter() - t0}
        print(f"  {name:11s} curvax first step {kfac_s:5.2f}s   Adam {out[name]['adam_first_step_s']:5.2f}s", flush=True)
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=1000, help="full-batch size (default 1000)")
    p.add_argument("--target-loss", type=float, default=0.3, help="training loss to reach (default 0.3)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--timed-steps", type=int, default=15)
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--budget", type=float, default=90.0, help="seconds per optimizer, setup included")
    p.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--staggered", action="store_true",
                   help="also run curvax_adaptive_staggered (inverse_update_staggered=True)")
    p.add_argument("--rounds", type=int, default=30,
                   help="interleaved rounds timed (default 30, a multiple of the refresh period 5)")
    p.add_argument("--warmup-rounds", type=int, default=6)
    p.add_argument("--before", action="store_true",
                   help="also time curvax_adaptive_before (the previous formulation) in the rounds")
    p.add_argument("--breakdown", action="store_true",
                   help="also time curvax_fixed and curvax_fixed_no_statistics in the rounds")
    p.add_argument("--skip-target", action="store_true", help="only the interleaved step times")
    p.add_argument("--output", default="benchmarks/results/cnn.json")
    args = p.parse_args(argv)
    if args.quick:
        args.num_images, args.warmup_steps, args.timed_steps, args.max_steps, args.budget = 64, 1, 2, 5, 20.0
        args.rounds, args.warmup_rounds = 5, 1
        args.adam_lrs = [1e-3]
    return args


def step_time_makers(args: argparse.Namespace, batch: Any) -> tuple[dict[str, Any], set[str]]:
    """The runners of the interleaved rounds, and those to compile with the previous formulation."""
    makers: dict[str, Any] = {f"adam_lr{lr:g}": (lambda lr=lr: adam_runner(batch, lr, args.seed)) for lr in args.adam_lrs}
    makers["curvax_adaptive"] = lambda: kfac_runner(batch, args.seed)
    before = set()
    if args.before:
        makers["curvax_adaptive_before"] = lambda: kfac_runner(batch, args.seed)
        before.add("curvax_adaptive_before")
    if args.breakdown:
        makers["curvax_fixed"] = lambda: kfac_runner(batch, args.seed, fixed=True)
        makers["curvax_fixed_no_statistics"] = lambda: kfac_runner(batch, args.seed, fixed=True, statistics_period=10**6)
    return makers, before


def to_target(args: argparse.Namespace, batch: Any) -> dict[str, Any]:
    """Each optimizer alone from a fresh start: first step, step times, steps and seconds to the target."""
    results: dict[str, Any] = {}
    runs = [(f"adam_lr{lr:g}", lambda lr=lr: adam_runner(batch, lr, args.seed)) for lr in args.adam_lrs]
    runs.append(("curvax_adaptive", lambda: kfac_runner(batch, args.seed)))
    if args.staggered:
        runs.append(("curvax_adaptive_staggered", lambda: kfac_runner(batch, args.seed, staggered=True)))
    for name, make in runs:
        t0 = time.perf_counter()
        step, carry = make()
        setup = time.perf_counter() - t0
        r = results[name] = measure(step, carry, setup, args.warmup_steps, args.timed_steps, args.max_steps,
                                    args.budget, args.target_loss)
        print(f"{name:16s} first step {r['first_step_s']:6.2f}s  step median {r['step_median_s'] * 1e3:7.1f}ms  "
              f"final loss {r['final_loss']:.3f} after {r['steps_run']} steps  "
              f"target: {r['steps_to_target']} steps / {r['seconds_to_target']} s", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    x = datasets.load_mnist_images(args.num_images).reshape(-1, 28, 28, 1)
    batch = (jnp.asarray(x), jnp.asarray(datasets.load_mnist_labels(args.num_images)))
    print(f"MNIST CNN, {args.num_images} images full batch, target loss {args.target_loss:g}", flush=True)
    makers, before = step_time_makers(args, batch)
    inter = interleaved_steps(makers, args.warmup_rounds, args.rounds, before)
    for n, m in inter["step_median_s"].items():
        print(f"{n:28s} step median {m * 1e3:7.1f}ms  {inter['ratio_to_adam_median'][n]:5.2f}x Adam", flush=True)
    print(f"load average {inter['load_average_before']} -> {inter['load_average_after']}", flush=True)
    summary: dict[str, Any] = {
        "adam_step_median_s": float(np.median([m for n, m in inter["step_median_s"].items() if n.startswith("adam")])),
        "curvax_step_ratio_median": inter["ratio_to_adam_median"]["curvax_adaptive"],
        "load_average": [inter["load_average_before"], inter["load_average_after"]],
    }
    if args.before:
        summary["curvax_before_step_ratio_median"] = inter["ratio_to_adam_median"]["curvax_adaptive_before"]
    results = {} if args.skip_target else to_target(args, batch)
    if results:
        adam = [n for n in results if n.startswith("adam")]
        reached = [n for n in adam if results[n]["seconds_to_target"] is not None]
        best = min(reached, key=lambda n: results[n]["seconds_to_target"]) if reached else None
        k = results["curvax_adaptive"]
        summary.update({
            "curvax_first_step_s": k["first_step_s"],
            "curvax_seconds_to_target": k["seconds_to_target"],
            "best_adam": best,
            "best_adam_seconds_to_target": results[best]["seconds_to_target"] if best else None,
        })
    frameworks = {}
    if not args.skip_target:
        print("first step per framework (tests/zoo.py CNN):", flush=True)
        frameworks = framework_first_steps(args.seed)
    out = {"benchmark": "mnist_cnn", "machine": machine_info(), "settings": vars(args), "summary": summary,
           "interleaved": inter, "results": results, "framework_first_steps": frameworks}
    write_results(args.output, out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
