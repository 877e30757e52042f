"""Benchmark: the cost of a 768 -> 50257 untied head's partitioned K-FAC block, on a small model.

GPT-2 small with ``--untied-head`` (``gpt2_small.py``) did not finish 12 K-FAC steps in 15
minutes. This is the small reproduction: the same head (768 -> 50257 dense, the real vocabulary,
its output factor in 38 blocks of <= 1323) on a 1-layer model with ``--batch`` sequences of
``--seq`` tokens. In a child process (killed after ``--timeout`` seconds, with a Python traceback
of every thread from ``faulthandler`` when it does not finish) it times K-FAC's init and every step,
labelled refresh (every ``--inverse-period`` steps) or ordinary, with JAX's trace, lower and
compile events (``jax.monitoring``) per step, the peak resident memory, and AdamW's step on the
same model. The load average is recorded before and after.

    python benchmarks/partitioned_head.py --output benchmarks/results/partitioned_head.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EVENTS = {  # jax.monitoring duration events -> short names
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """K-FAC's init and steps, then AdamW's, on the 1-layer model with the untied head."""
    import faulthandler

    faulthandler.dump_traceback_later(max(args.timeout - 5, 1), exit=False)
    import jax

    import curvax

    sys.path.insert(0, str(Path(__file__).parent))
    from gpt2_small import adamw_step, build

    phase = ["setup"]
    events: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event in EVENTS:
            events[phase[0]][EVENTS[event]] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    model, loss = build(args.vocab, args.d, args.layers, args.heads, args.seq + 1, untied=True)
    key = jax.random.PRNGKey(0)
    tokens = jax.random.randint(key, (args.batch, args.seq + 1), 0, args.vocab)
    params = model.init(key, tokens[:, :-1])
    out: dict[str, Any] = {"num_params": int(sum(x.size for x in jax.tree_util.tree_leaves(params)))}

    def timed(name: str, fn: Any) -> tuple[Any, float]:
        phase[0] = name
        t = time.perf_counter()
        res = jax.block_until_ready(fn())
        return res, time.perf_counter() - t

    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0, inverse_update_period=args.inverse_period,
        batch_size_extractor=lambda t: t.shape[0] * (t.shape[1] - 1),
    )
    state, out["kfac_init_s"] = timed("init", lambda: opt.init(params, key, tokens))
    out["registration_table"] = opt.registration_table()
    steps, p = [], params
    for i in range(args.steps):
        (p, state, stats), dt = timed(f"step{i}", lambda: opt.step(
            p, state, jax.random.fold_in(key, i), batch=tokens, learning_rate=3e-2, momentum=0.5, damping=1e-1,
            global_step_int=i))
        steps.append({"step": i, "refresh": i % args.inverse_period == 0, "wall_s": dt, "loss": float(stats["loss"]),
                      **{k: v for k, v in events[f"step{i}"].items()}})
        print(f"step {i}: {dt:.2f} s", file=sys.stderr, flush=True)
    out["kfac_steps"] = steps
    out["kfac_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    later = steps[1:]
    for kind, want in (("refresh", True), ("ordinary", False)):
        times = [s["wall_s"] for s in later if s["refresh"] == want]
        out[f"kfac_{kind}_step_median_s"] = statistics.median(times) if times else None

    tx, adam_step = adamw_step(loss, tokens)
    p, s, times = params, tx.init(params), []
    for i in range(args.steps):
        (p, s, _), dt = timed(f"adam{i}", lambda: adam_step(p, s))
        times.append(dt)
    out["adamw_first_step_s"], out["adamw_step_median_s"] = times[0], statistics.median(times[1:])
    faulthandler.cancel_dump_traceback_later()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--inverse-period", type=int, default=3)
    p.add_argument("--timeout", type=int, default=600, help="seconds before the child is killed (a hang)")
    p.add_argument("--output", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from autoencoder import machine_info

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    record: dict[str, Any] = {"benchmark": "partitioned_head", "curvax_commit": commit.stdout.strip() or None, "machine": machine_info(),
                              "config": {k: v for k, v in vars(args).items() if k not in ("output", "child")}}
    cmd = [sys.executable, __file__, "--child"] + [f"--{k.replace('_', '-')}={v}" for k, v in record["config"].items()]
    load, t = os.getloadavg(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            record["error"] = proc.stderr[-4000:]
        else:
            record.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            record["stderr_tail"] = proc.stderr[-1000:]
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        record["error"] = f"killed after {args.timeout} s (did not finish)\n" + err[-4000:]
    record["wall_s"] = time.perf_counter() - t
    record["load_average_before"], record["load_average_after"] = load, os.getloadavg()
    print(json.dumps({k: v for k, v in record.items() if k not in ("registration_table", "machine")}, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
