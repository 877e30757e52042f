"""Benchmark: K-FAC on a GPT-2-small-sized transformer (124M parameters) on a CPU machine, next to AdamW.

The model is GPT-2 small's shape in Flax Linen: 12 pre-LayerNorm blocks (causal self-attention
with a fused ``3d`` query/key/value projection, a ``4d`` GELU MLP), ``d = 768``, 12 heads, a
50257-token vocabulary whose embedding is tied to the output head (``logits = h @ wte.T``), learned
positions; 124.4M parameters (``--untied-head``: a separate head, 163M). Tokens are random (the point is the cost of a step, not a language
model), ``--batch`` sequences of ``--seq`` tokens.

Each optimizer runs ``--steps`` steps in its own child process (so its peak resident memory is its
own: ``ru_maxrss``): curvax K-FAC (fixed learning rate, momentum and damping; the curvature on
every step, inverses every ``--inverse-period`` steps) and Optax AdamW. Reported: the first step
(tracing, compilation, K-FAC's first refresh), the median of the other steps, the mean (K-FAC's
refresh steps included), the peak memory, the losses, and K-FAC's registration table, which says
which layers got which block and why (the 50257-wide head's output factor is over the per-factor
byte budget, so it is partitioned or diagonal). ``--scale tiny`` is the same code on a toy size
(``tests/test_gpt2_small.py`` runs it).

    python benchmarks/gpt2_small.py --output benchmarks/results/gpt2_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

SCALES = {  # vocab, d, layers, heads, seq, batch
    "gpt2-small": dict(vocab=50257, d=768, layers=12, heads=12, seq=64, batch=4),
    "tiny": dict(vocab=97, d=32, layers=2, heads=4, seq=16, batch=4),
}


def build(vocab: int, d: int, layers: int, heads: int, seq: int, untied: bool = False) -> tuple[Any, Any]:
    """The Flax module and a function ``loss(params, tokens)`` that registers its loss with curvax."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import curvax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, _ = x.shape
            h = nn.LayerNorm()(x)
            q, k, v = jnp.split(nn.Dense(3 * d)(h), 3, axis=-1)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(d // heads)
            scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
            att = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
            x = x + nn.Dense(d)(att)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(h)))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            wte = self.param("wte", nn.initializers.normal(0.02), (vocab, d))
            wpe = self.param("wpe", nn.initializers.normal(0.01), (seq, d))
            x = wte[tokens] + wpe[: tokens.shape[1]]
            for _ in range(layers):
                x = Block()(x)
            x = nn.LayerNorm()(x)
            # GPT-2 ties the head to the embedding (a shared weight: curvax gives it a diagonal
            # block); ``--untied-head`` gives the head its own 768 x 50257 dense layer instead.
            return nn.Dense(vocab, use_bias=False)(x) if untied else x @ wte.T

    model = GPT()

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        logits = model.apply(params, tokens[:, :-1])
        targets = tokens[:, 1:]
        curvax.register_softmax_cross_entropy_loss(logits.reshape(-1, vocab), targets.reshape(-1))
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return model, loss


def adamw_step(loss: Callable[[Any, Any], Any], tokens: Any) -> tuple[Any, Callable[[Any, Any], Any]]:
    """The AdamW baseline (learning rate 3e-4, weight decay 0.01): Optax's transformation and its
    jitted step ``(params, opt_state) -> (params, opt_state, loss)`` on ``tokens``."""
    import jax
    import optax

    tx = optax.adamw(3e-4, weight_decay=0.01)

    @jax.jit
    def step(p: Any, s: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(p, tokens)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return tx, step


def child(optimizer: str, scale: str, steps: int, inverse_period: int, untied: bool = False) -> dict[str, Any]:
    """One optimizer's run; returns its record (step times, losses, peak memory)."""
    import itertools

    import jax
    import jax.numpy as jnp

    import curvax

    cfg = SCALES[scale]
    model, loss = build(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["seq"] + 1, untied)
    key = jax.random.PRNGKey(0)
    tokens = jax.random.randint(key, (cfg["batch"], cfg["seq"] + 1), 0, cfg["vocab"])
    params = model.init(key, tokens[:, :-1])
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    out: dict[str, Any] = {"optimizer": optimizer, "num_params": int(num_params)}
    times, losses = [], []
    if optimizer == "kfac":
        opt = curvax.Optimizer(
            jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0, inverse_update_period=inverse_period,
            batch_size_extractor=lambda t: t.shape[0] * (t.shape[1] - 1),
        )
        t0 = time.perf_counter()
        state = opt.init(params, key, tokens)
        out["init_s"] = time.perf_counter() - t0
        out["registration_table"] = opt.registration_table()
        for i in range(steps):
            t = time.perf_counter()
            params, state, stats = opt.step(params, state, jax.random.fold_in(key, i), batch=tokens,
                                            learning_rate=3e-2, momentum=0.5, damping=1e-1, global_step_int=i)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - t)
            losses.append(float(stats["loss"]))
    else:
        tx, step = adamw_step(loss, tokens)
        state = tx.init(params)
        for _ in itertools.repeat(None, steps):
            t = time.perf_counter()
            params, state, value = step(params, state)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - t)
            losses.append(float(value))
    rest = times[1:] or times
    out.update({
        "first_step_s": times[0], "step_median_s": statistics.median(rest), "step_mean_s": statistics.fmean(rest),
        "step_times_s": times, "losses": losses,
        "all_finite": bool(all(jnp.isfinite(jnp.asarray(losses)))),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    })
    out["peak_rss_gib"] = round(out["peak_rss_bytes"] / 2**30, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=SCALES, default="gpt2-small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--inverse-period", type=int, default=10)
    p.add_argument("--optimizers", nargs="+", default=["kfac", "adamw"])
    p.add_argument("--untied-head", action="store_true", help="a separate 768 x vocab head (163M parameters)")
    p.add_argument("--output", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.scale, args.steps, args.inverse_period, args.untied_head)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from autoencoder import machine_info

    record: dict[str, Any] = {"benchmark": "gpt2_small", "machine": machine_info(), "scale": args.scale,
                              "config": SCALES[args.scale], "untied_head": args.untied_head, "steps": args.steps,
                              "inverse_update_period": args.inverse_period, "runs": {}}
    for name in args.optimizers:
        load = os.getloadavg()
        cmd = [sys.executable, __file__, "--child", name, "--scale", args.scale, "--steps", str(args.steps),
               "--inverse-period", str(args.inverse_period)] + (["--untied-head"] if args.untied_head else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            record["runs"][name] = {"error": proc.stderr[-3000:]}
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["load_average_before"], r["load_average_after"] = load, os.getloadavg()
        record["runs"][name] = r
        print(f"{name}: {r['num_params'] / 1e6:.1f}M params, first step {r['first_step_s']:.1f}s, median step "
              f"{r['step_median_s']:.2f}s, mean {r['step_mean_s']:.2f}s, peak {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", flush=True)
    runs = record["runs"]
    if all("step_median_s" in runs.get(n, {}) for n in ("kfac", "adamw")):
        record["kfac_over_adamw"] = {
            "step_median": runs["kfac"]["step_median_s"] / runs["adamw"]["step_median_s"],
            "step_mean": runs["kfac"]["step_mean_s"] / runs["adamw"]["step_mean_s"],
            "peak_memory": runs["kfac"]["peak_rss_bytes"] / runs["adamw"]["peak_rss_bytes"],
        }
    if args.output:
        Path(args.output).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
