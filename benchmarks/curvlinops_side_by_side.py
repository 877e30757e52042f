"""Side by side: curvlinops' ``KFACLinearOperator`` and ``curvax.operators.kfac`` on the same models.

One MLP (20-32-32-5, tanh) and one small CNN (Conv2d 3->4 3x3 'same', tanh, linear 256->5) with
identical float64 weights and data (64 and 320 examples, ``MSELoss(reduction="mean")`` over 5 outputs /
``register_squared_error_loss(out, y, weight=1/5)``), type-2 Fisher, ``separate_weight_and_bias=True``.
(A softmax cross-entropy's K-FAC is singular, its ``G`` has the null vector of ones, so its
log-determinant is ``-inf`` and any finite value is round-off: MSE keeps ``logdet`` comparable.)
For each method (``K @ v``, ``trace``, ``logdet``, ``frobenius_norm``, the exactly damped inverse
``(K + d I)^-1 v``) it records both values, their relative difference and the median time of 5
calls after a warm-up (curvax's methods jitted; compile time reported apart), and again on
``K.factorized()`` (the factors' eigendecompositions computed once, as curvlinops' inverse
operator keeps its inverted factors; the factorization is timed apart). Building the operator
(the factors) is timed too.

curvlinops and torch are not curvax dependencies: this script runs the torch half in another
Python (``--torch-python``, an environment with ``torch`` and ``curvlinops-for-pytorch``) and
passes weights and data through an ``.npz`` file.

    python benchmarks/curvlinops_side_by_side.py --torch-python /path/to/venv/bin/python

Writes JSON (default ``benchmarks/results/curvlinops_side_by_side.json``).

``--ekfac``: curvlinops' ``EKFACLinearOperator`` against ``curvax.operators.kfac`` with
``layer_tag_to_block_ctor={"dense": curvax.DenseEigenvalueCorrected}`` on the MLP (curvax has
no convolution EKFAC block, so the CNN is not compared), ``separate_weight_and_bias=False`` in
both (curvax's EKFAC block keeps a layer's weight and bias together); ``factorized()`` does not
apply to EKFAC blocks, so those columns repeat the plain operator. Default output
``benchmarks/results/curvlinops_side_by_side_ekfac.json``.

    python benchmarks/curvlinops_side_by_side.py --torch-python /path/to/venv/bin/python --ekfac
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
from pathlib import Path
from typing import Any, Callable

import numpy as np

DAMPING = 1e-2
NUM_DATA = {"mlp": 64, "cnn": 320}  # the CNN's last layer has 257 inputs: A needs >= 257 examples to be invertible


def _median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_problem(model: str, seed: int = 0) -> dict:
    """Weights in torch's layout (Linear ``(out, in)``, Conv2d ``OIHW``), data, and a vector."""
    rng = np.random.default_rng(seed)
    if model == "mlp":
        sizes = [(20, 32), (32, 32), (32, 5)]
        weights = []
        for i, o in sizes:
            weights += [rng.standard_normal((o, i)) / np.sqrt(i), 0.1 * rng.standard_normal(o)]
        x = rng.standard_normal((NUM_DATA[model], 20))
    else:
        weights = [rng.standard_normal((4, 3, 3, 3)) / np.sqrt(27), 0.1 * rng.standard_normal(4),
                   rng.standard_normal((5, 256)) / 16, 0.1 * rng.standard_normal(5)]
        x = rng.standard_normal((NUM_DATA[model], 3, 8, 8))
    y = rng.standard_normal((NUM_DATA[model], 5))
    v = [rng.standard_normal(w.shape) for w in weights]
    return {"weights": weights, "x": x, "y": y, "v": v}


# ----------------------------------------------------------------------------------
# torch / curvlinops half (runs in the other Python)
# ----------------------------------------------------------------------------------


def torch_half(npz_path: str, model: str, kfac_approx: str = "expand", ekfac: bool = False) -> dict:
    import torch
    from curvlinops import EKFACLinearOperator, KFACInverseLinearOperator, KFACLinearOperator

    torch.set_default_dtype(torch.float64)
    data = np.load(npz_path)
    nw = sum(1 for k in data.files if k.startswith("w"))
    weights = [torch.tensor(data[f"w{i}"]) for i in range(nw)]
    v = [torch.tensor(data[f"v{i}"]) for i in range(nw)]
    x, y = torch.tensor(data["x"]), torch.tensor(data["y"])
    if model == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 5))
    else:
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Flatten(),
                                  torch.nn.Linear(256, 5))
    with torch.no_grad():
        for p, w in zip(net.parameters(), weights):
            p.copy_(w)
    params = [p for p in net.parameters() if p.requires_grad]

    def build() -> Any:
        cls = EKFACLinearOperator if ekfac else KFACLinearOperator
        K = cls(net, torch.nn.MSELoss(), params, [(x, y)], fisher_type="type-2", kfac_approx=kfac_approx,
                separate_weight_and_bias=not ekfac, check_deterministic=False)
        K @ v  # the factors are computed at the first product
        return K

    t0 = time.perf_counter()
    K = build()
    build_s = time.perf_counter() - t0
    inv = KFACInverseLinearOperator(K, damping=DAMPING, use_exact_damping=True)
    def uncached(name: str) -> Callable[[], Any]:
        """curvlinops 3.0 caches ``trace``/``logdet``/``frobenius_norm`` (properties): reset the cache so
        that each timed call computes them; a method in other versions."""

        def fn() -> Any:
            if hasattr(K, f"_{name}"):
                setattr(K, f"_{name}", None)
            value = getattr(K, name)
            return value() if callable(value) else value

        return fn

    methods = {
        "matvec": lambda: torch.cat([t.flatten() for t in K @ v]),
        "trace": uncached("trace"), "logdet": uncached("logdet"), "frobenius_norm": uncached("frobenius_norm"),
        "inverse_matvec": lambda: torch.cat([t.flatten() for t in inv @ v]),
    }
    out = {"build_s": build_s, "methods": {}}
    for name, fn in methods.items():
        with torch.no_grad():
            value = fn()
            out["methods"][name] = {"value": np.asarray(value.detach()).tolist(), "time_s": _median_time(fn)}
    out["versions"] = {"torch": torch.__version__, "curvlinops": __import__("importlib.metadata").metadata.version("curvlinops-for-pytorch")}
    return out


# ----------------------------------------------------------------------------------
# curvax half
# ----------------------------------------------------------------------------------


def curvax_half(problem: dict, model: str, kfac_approx: str = "expand", ekfac: bool = False) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax import lax

    import curvax
    from curvax import operators as ops

    w = [jnp.asarray(a) for a in problem["weights"]]
    if model == "mlp":  # x @ W with W (in, out): torch's weight transposed
        params = [(w[i].T, w[i + 1]) for i in range(0, len(w), 2)]

        def logits_fn(p: Any, x: jax.Array) -> jax.Array:
            for i, (kernel, bias) in enumerate(p):
                x = x @ kernel + bias
                x = jnp.tanh(x) if i < len(p) - 1 else x
            return x

        to_flat = lambda tree: jnp.concatenate([jnp.concatenate([k.T.ravel(), b]) for k, b in tree])  # noqa: E731
    else:
        params = [(w[0], w[1]), (w[2].T, w[3])]

        def logits_fn(p: Any, x: jax.Array) -> jax.Array:
            h = lax.conv_general_dilated(x, p[0][0], (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
            h = jnp.tanh(h + p[0][1][None, :, None, None])
            return h.reshape(h.shape[0], -1) @ p[1][0] + p[1][1]

        to_flat = lambda tree: jnp.concatenate([tree[0][0].ravel(), tree[0][1], tree[1][0].T.ravel(), tree[1][1]])  # noqa: E731

    def loss_fn(p: Any, batch: Any) -> jax.Array:
        logits = logits_fn(p, batch[0])
        curvax.register_squared_error_loss(logits, batch[1], weight=1.0 / logits.shape[-1])
        return jnp.mean((logits - batch[1]) ** 2)

    batch = (jnp.asarray(problem["x"]), jnp.asarray(problem["y"]))
    vw = [jnp.asarray(a) for a in problem["v"]]
    v = [(vw[i].T, vw[i + 1]) for i in range(0, len(vw), 2)] if model == "mlp" else [(vw[0], vw[1]), (vw[2].T, vw[3])]

    def build() -> Any:
        ctors = {"dense": curvax.DenseEigenvalueCorrected} if ekfac else None
        K = ops.kfac(loss_fn, params, batch, fisher_type="type-2", separate_weight_and_bias=not ekfac,
                     kfac_approx=kfac_approx, layer_tag_to_block_ctor=ctors)
        jax.block_until_ready(K.state)
        return K

    t0 = time.perf_counter()
    K = build()
    build_s = time.perf_counter() - t0
    methods = {
        "matvec": lambda K: to_flat(K @ v),
        "trace": lambda K: K.trace(), "logdet": lambda K: K.logdet(), "frobenius_norm": lambda K: K.frobenius_norm(),
        "inverse_matvec": lambda K: to_flat(K.inverse(DAMPING) @ v),
    }
    # K.factorized(): the factors' eigendecompositions once, reused by every later call (as
    # curvlinops' inverse operator keeps its inverted factors)
    factorize = jax.jit(lambda K: K.factorized())
    Kf = jax.block_until_ready(factorize(K))
    out = {"build_s": build_s, "factorize_s": _median_time(lambda: jax.block_until_ready(factorize(K))), "methods": {}}
    for name, fn in methods.items():
        jitted = jax.jit(fn)
        t0 = time.perf_counter()
        value = jax.block_until_ready(jitted(K))
        compile_s = time.perf_counter() - t0
        t = _median_time(lambda: jax.block_until_ready(jitted(K)))
        value_f = jax.block_until_ready(jitted(Kf))
        t_f = _median_time(lambda: jax.block_until_ready(jitted(Kf)))
        rel_f = float(np.linalg.norm(np.asarray(value_f) - np.asarray(value)) / max(np.linalg.norm(np.asarray(value)), 1e-300))
        out["methods"][name] = {"value": np.asarray(value).tolist(), "time_s": t, "first_call_s": compile_s,
                                "factorized_time_s": t_f, "factorized_relative_difference": rel_f}
    out["versions"] = {"jax": jax.__version__, "curvax": getattr(curvax, "__version__", "?")}
    return out


_LABELS = {"matvec": "`K @ v`", "trace": "`trace`", "logdet": "`logdet`", "frobenius_norm": "`frobenius_norm`",
           "inverse_matvec": "`(K + 0.01 I)^-1 v` (exact damping)"}


def _ms(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _value(v: Any) -> str:
    return "a vector" if isinstance(v, str) else f"{v:.12g}"


def markdown(path: str) -> str:
    """The tables of ``docs/migration/curvlinops.md`` from one results JSON (every figure from it)."""
    report = json.loads(Path(path).read_text())
    out = []
    for model, res in report["models"].items():
        label = {"mlp": "MLP", "cnn": "CNN"}[model]
        b = res["build_s"]
        out.append(f"**{label}, {report.get('operator', 'K-FAC')}** ({res['num_parameters']} parameters, "
                   f"{report['num_data'][model]} examples). Building the operator: curvlinops {_ms(b['curvlinops'])}, "
                   f"curvax {_ms(b['curvax'])} (tracing and compiling included)"
                   + (f"; `K.factorized()` {_ms(res['curvax_factorize_s'])}." if report.get("operator") != "EKFAC" else "."))
        out.append("")
        out.append("| method | curvlinops | curvax | relative difference |")
        out.append("| --- | --- | --- | --- |")
        for name, row in res["methods"].items():
            out.append(f"| {_LABELS[name]} | {_value(row['curvlinops'])} | {_value(row['curvax'])} | "
                       f"{row['relative_difference']:.1e} |")
        out.append("")
        fact = report.get("operator") != "EKFAC"
        out.append("| method | curvlinops | curvax (jitted) |" + (" curvax on `K.factorized()` |" if fact else ""))
        out.append("| --- | --- | --- |" + (" --- |" if fact else ""))
        for name, row in res["methods"].items():
            cells = [_LABELS[name], _ms(row["curvlinops_time_s"]), _ms(row["curvax_time_s"])]
            if fact:
                cells.append(_ms(row["curvax_factorized_time_s"]))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    worst = max(row["relative_difference"] for res in report["models"].values() for row in res["methods"].values())
    out.append(f"Largest relative difference: {worst:.1e}.")
    if "load_average_1min" in report:
        out.append(f"Load average (1 min) when the run ended: {report['load_average_1min']:.1f}.")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-python", default=None, help="a Python with torch and curvlinops-for-pytorch")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/curvlinops_side_by_side[_ekfac].json")
    parser.add_argument("--ekfac", action="store_true", help="EKFAC (curvlinops' EKFACLinearOperator) on the MLP")
    parser.add_argument("--kfac-approx", choices=("expand", "reduce"), default="expand",
                        help="K-FAC-expand (default) or K-FAC-reduce in both libraries")
    parser.add_argument("--markdown", metavar="JSON", help="print the docs' tables from a results JSON and exit")
    parser.add_argument("--torch-half", nargs=4, metavar=("NPZ", "MODEL", "APPROX", "EKFAC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.markdown:
        print(markdown(args.markdown))
        return
    if args.torch_half:
        npz, model, approx, ekfac = args.torch_half
        print(json.dumps(torch_half(npz, model, approx, ekfac == "1")))
        return
    if args.output is None:
        name = "curvlinops_side_by_side_ekfac.json" if args.ekfac else "curvlinops_side_by_side.json"
        args.output = str(Path(__file__).parent / "results" / name)
    if not args.torch_python:
        parser.error("--torch-python is needed (an environment with torch and curvlinops-for-pytorch)")
    report: dict = {"damping": DAMPING, "num_data": NUM_DATA, "fisher_type": "type-2",
                    "separate_weight_and_bias": not args.ekfac, "kfac_approx": args.kfac_approx,
                    "operator": "EKFAC" if args.ekfac else "K-FAC", "models": {}}
    for model in ("mlp",) if args.ekfac else ("mlp", "cnn"):
        problem = make_problem(model)
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "problem.npz")
            arrays = {f"w{i}": a for i, a in enumerate(problem["weights"])}
            arrays.update({f"v{i}": a for i, a in enumerate(problem["v"])})
            np.savez(path, x=problem["x"], y=problem["y"], **arrays)
            proc = subprocess.run([args.torch_python, __file__, "--torch-half", path, model, args.kfac_approx,
                                   "1" if args.ekfac else "0"], capture_output=True, text=True, check=True)
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        ours = curvax_half(problem, model, args.kfac_approx, args.ekfac)
        rows = {}
        for name in ours["methods"]:
            a, b = np.asarray(theirs["methods"][name]["value"]), np.asarray(ours["methods"][name]["value"])
            rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-300))
            rows[name] = {
                "curvlinops": a.tolist() if a.ndim == 0 else f"vector of {a.size}",
                "curvax": b.tolist() if b.ndim == 0 else f"vector of {b.size}",
                "relative_difference": rel,
                "curvlinops_time_s": theirs["methods"][name]["time_s"],
                "curvax_time_s": ours["methods"][name]["time_s"],
                "curvax_first_call_s": ours["methods"][name]["first_call_s"],
                "curvax_factorized_time_s": ours["methods"][name]["factorized_time_s"],
                "curvax_factorized_relative_difference": ours["methods"][name]["factorized_relative_difference"],
            }
        report["models"][model] = {"num_parameters": int(sum(w.size for w in problem["weights"])),
                                   "build_s": {"curvlinops": theirs["build_s"], "curvax": ours["build_s"]},
                                   "curvax_factorize_s": ours["factorize_s"],
                                   "methods": rows}
        report["versions"] = {**theirs["versions"], **ours["versions"]}
    # the machine's 1-minute load average when done (times on a shared, busy machine are noisy)
    report["load_average_1min"] = os.getloadavg()[0]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
