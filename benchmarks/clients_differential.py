"""Differential run of the real clients in float64: kfac-jax 0.0.8 against curvax, step by step.

``clients.py`` compares the clients' float32 energies, where a difference of 1e-5 can be rounding
amplified by the Monte Carlo chain or a real difference. This script removes the doubt: each client
(FermiNet, DeepQMC), each ansatz, runs a few K-FAC steps with ``JAX_ENABLE_X64=1`` twice, in fresh
processes, once with kfac-jax and once with ``import curvax as kfac_jax``, and records

* per step: the loss, ``precon_grad_norm``, ``update_norm`` and the learning rate (the clients' own
  statistics);
* after step 0: every parameter's update ``theta_1 - theta_0``, compared leaf by leaf
  (``max |u_curvax - u_kfac_jax| / max |u_kfac_jax|``), so that a difference names its layer.

In float64 the two must agree to rounding (~1e-12). This run found two silent differences, both
fixed: a 1x1 Kronecker factor's damping (a layer with one output) and a float32 step counter in
schedules. Run it in the clients' environment (see ``clients.py``)::

    PYTHONPATH=. /work/clients-venv/bin/python benchmarks/clients_differential.py --steps 3

Results go to ``benchmarks/results/clients_differential.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clients  # noqa: E402  (the clients' configurations and recording optimizer)

DEFAULT_OUTPUT = Path(__file__).parent / "results" / "clients_differential.json"
BACKENDS = ("kfac_jax", "curvax")


def _child(client: str, backend: str, out: str, ansatz: str, steps: int) -> int:
    """Runs ``clients.child`` with a step-0 hook that saves every parameter's update."""
    import numpy as np

    clients.STEPS = steps
    install = clients.install_optimizer_wrapper

    def install_with_update_dump() -> None:
        install()
        import jax
        import kfac_jax

        cls = kfac_jax.Optimizer
        step = cls.step

        def recording_step(self: Any, *args: Any, **kwargs: Any) -> Any:
            first = not clients.REC.data["opt_steps"]
            if first:  # copied now: the client may donate the parameters to the step
                params = kwargs["params"] if "params" in kwargs else args[0]
                before = [(jax.tree_util.keystr(p), np.asarray(x[0], np.float64))
                          for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
            result = step(self, *args, **kwargs)
            if first:
                after = jax.tree_util.tree_leaves(result[0])
                np.savez(out + ".npz", **{k: np.asarray(a[0], np.float64) - b for (k, b), a in zip(before, after)})
            return result

        cls.step = recording_step

    clients.install_optimizer_wrapper = install_with_update_dump
    return clients.child(client, backend, out + ".json", ansatz)


def _run(client: str, ansatz: str, backend: str, steps: int, tmp: str) -> dict[str, Any]:
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    cwd = Path(tmp, backend)
    cwd.mkdir()
    if backend == "curvax":
        (cwd / "kfac_jax.py").write_text(clients.SHIM)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH", "")) if p)
    out = str(cwd / "result")
    proc = subprocess.run([sys.executable, __file__, "--child", client, backend, out, ansatz, str(steps)],
                          env=env, cwd=cwd, capture_output=True, text=True)
    rec = json.loads(Path(out + ".json").read_text()) if Path(out + ".json").exists() else {}
    rec["returncode"] = proc.returncode
    if proc.returncode:
        rec["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return rec


def compare(client: str, ansatz: str, steps: int) -> dict[str, Any]:
    """Both backends on one client and ansatz; the per-step statistics and per-leaf update gaps."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        recs = {b: _run(client, ansatz, b, steps, tmp) for b in BACKENDS}
        row: dict[str, Any] = {"client": client, "ansatz": ansatz, "steps": steps,
                               "jax_version": recs["curvax"].get("jax_version")}
        keys = ("loss", "precon_grad_norm", "update_norm", "learning_rate")
        for b, rec in recs.items():
            row[b] = {k: [s.get(k) for s in rec.get("opt_steps", [])] for k in keys}
            row[b]["ok"] = rec.get("phase") == "done" and rec["returncode"] == 0
            if not row[b]["ok"]:
                row[b]["error"] = rec.get("error") or rec.get("output_tail")
        if not all(row[b]["ok"] for b in BACKENDS):
            return row
        ref, new = np.load(Path(tmp, "kfac_jax", "result.npz")), np.load(Path(tmp, "curvax", "result.npz"))
        gaps = {}
        for k in ref.files:
            scale = float(np.max(np.abs(ref[k])))
            gaps[k] = float(np.max(np.abs(new[k] - ref[k]))) / scale if scale > 0 else float(np.max(np.abs(new[k])))
    row["step0_update_relative_gap_per_leaf"] = gaps
    row["step0_update_relative_gap_max"] = max(gaps.values())
    for k in keys:
        a, b = np.asarray(row["kfac_jax"][k], float), np.asarray(row["curvax"][k], float)
        row[f"{k}_relative_gap_max"] = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-300)))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", nargs="+", choices=clients.CLIENTS, default=list(clients.CLIENTS))
    p.add_argument("--ansatz", nargs="+", choices=clients.ANSATZE, default=list(clients.ANSATZE), dest="ansatze")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        client, backend, out, ansatz, steps = args.child
        return _child(client, backend, out, ansatz, int(steps))
    rows = []
    out = {"what": __doc__.split("\n")[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "python": sys.version.split()[0], "machine": {"cpu_count": os.cpu_count(), "load_average_before": list(os.getloadavg())},
           "rows": rows}
    for client in args.clients:
        for ansatz in args.ansatze:
            print(f"{client} ({ansatz}) ...", flush=True)
            rows.append(compare(client, ansatz, args.steps))
            r = rows[-1]
            print(f"  step-0 update gap {r.get('step0_update_relative_gap_max')}, "
                  f"loss gap {r.get('loss_relative_gap_max')}, precon norm gap {r.get('precon_grad_norm_relative_gap_max')}")
    out["machine"]["load_average_after"] = list(os.getloadavg())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")
    ok = all("step0_update_relative_gap_max" in r for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
