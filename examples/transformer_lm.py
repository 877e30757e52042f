"""A small character-level transformer language model (Flax Linen): K-FAC against Adam.

The corpus, ``examples/data/founding_documents.txt`` (13 kB, public domain: the Declaration of
Independence, the Preamble and Bill of Rights of the US Constitution and the Gettysburg
Address; see ``examples/data/README.md``), is split into its first 90% for training and the
last 10% for evaluation. The model is a decoder-only transformer: character embeddings,
sinusoidal positions, pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP,
and a dense read-out to the vocabulary.

curvax detects the embedding, every dense layer (the attention projections included) and the
LayerNorm scales and offsets by itself; the per-character softmax cross-entropy is registered
with ``weight=1/T`` because the loss averages over the ``T`` positions of each sequence as
well as over the batch (curvax's registered losses are averaged over the batch only).

Both optimizers start from the same initialisation, read the same stream of random windows
and run the same number of steps. The table reports training and held-out loss in nats and
bits per character.

    python examples/transformer_lm.py            # 300 steps (several minutes on 2 cores)
    python examples/transformer_lm.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import curvax

CORPUS = Path(__file__).resolve().parent / "data" / "founding_documents.txt"


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP, each residual."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        t, d, k = h.shape[-2], self.width, self.width // self.heads
        a = nn.LayerNorm()(h)
        # one dense layer per projection, heads split afterwards: (B, T, D) -> (B, heads, T, k)
        q, kk, v = (nn.Dense(d, name=n)(a).reshape(*a.shape[:-1], self.heads, k).swapaxes(-2, -3) for n in "qkv")
        scores = q @ kk.swapaxes(-1, -2) / math.sqrt(k)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attended = (jax.nn.softmax(scores, axis=-1) @ v).swapaxes(-2, -3).reshape(h.shape)
        h = h + nn.Dense(d, name="o")(attended)
        m = nn.Dense(4 * d, name="mlp_in")(nn.LayerNorm()(h))
        return h + nn.Dense(d, name="mlp_out")(nn.gelu(m))


class CharTransformer(nn.Module):
    vocab: int
    width: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        t = ids.shape[-1]
        h = nn.Embed(self.vocab, self.width)(ids)
        pos = np.arange(t)[:, None] / 10_000 ** (np.arange(0, self.width, 2)[None] / self.width)
        h = h + jnp.asarray(np.concatenate([np.sin(pos), np.cos(pos)], axis=-1), h.dtype)
        for _ in range(self.layers):
            h = Block(self.width, self.heads)(h)
        return nn.Dense(self.vocab, name="readout")(nn.LayerNorm()(h))


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean over batch and positions of ``-log p(next char)``, in nats."""
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def make_loss(model: nn.Module):
    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        inputs, targets = batch
        logits = model.apply(params, inputs)
        # registered losses are sums over positions averaged over the batch: 1/T makes it a mean
        curvax.register_softmax_cross_entropy_loss(logits, targets, weight=1.0 / targets.shape[-1])
        return token_cross_entropy(logits, targets)

    return loss


def windows(ids: np.ndarray, batch_size: int, length: int, seed: int) -> Iterator[tuple[jax.Array, jax.Array]]:
    """Endless random windows: inputs ``ids[s : s + T]``, targets shifted by one character."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - length - 1, batch_size)
        chunk = np.stack([ids[s : s + length + 1] for s in starts])
        yield jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])


def make_held_out_loss(model: nn.Module, ids: np.ndarray, length: int):
    """``params -> mean loss`` over consecutive, non-overlapping windows of the held-out text."""
    n = (len(ids) - 1) // length
    x = jnp.asarray(ids[: n * length].reshape(n, length))
    y = jnp.asarray(ids[1 : n * length + 1].reshape(n, length))
    evaluate = jax.jit(lambda params: token_cross_entropy(model.apply(params, x), y))
    return lambda params: float(evaluate(params))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model (smoke test)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="sequence length T")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results (and the machine's load) to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.context, args.width, args.heads, args.layers = 10, 16, 32, 32, 2, 1
        args.eval_every = 5

    text = CORPUS.read_text(encoding="ascii")
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    split = int(0.9 * len(ids))
    train_ids, test_ids = ids[:split], ids[split:]

    model = CharTransformer(len(chars), args.width, args.heads, args.layers)
    loss = make_loss(model)
    held_out_loss = make_held_out_loss(model, test_ids, args.context)
    example = next(windows(train_ids, args.batch_size, args.context, args.seed))
    params0 = model.init(jax.random.PRNGKey(args.seed), example[0])

    rows = []
    for name in ("curvax K-FAC", "optax Adam"):
        data = windows(train_ids, args.batch_size, args.context, args.seed + 1)  # the same stream for both
        losses, times, held_out = [], [], []  # held_out: (step, loss) pairs
        params = params0
        if name.startswith("curvax"):
            optimizer = curvax.Optimizer(
                value_and_grad_func=jax.value_and_grad(loss),
                l2_reg=0.0,
                use_adaptive_learning_rate=True,
                use_adaptive_momentum=True,
                use_adaptive_damping=True,
                initial_damping=1.0,
                num_burnin_steps=3,
                inverse_update_period=5,
            )
            key = jax.random.PRNGKey(args.seed)
            state = optimizer.init(params, key, example)
            for i in range(args.steps):
                key, sub = jax.random.split(key)
                start = time.perf_counter()
                params, state, stats = optimizer.step(params, state, sub, data_iterator=data, global_step_int=i)
                losses.append(float(stats["loss"]))  # float() waits for the step to finish
                times.append(time.perf_counter() - start)
                if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
                    held_out.append((i + 1, held_out_loss(params)))
        else:
            tx = optax.adam(args.adam_lr)
            opt_state = tx.init(params)

            @jax.jit
            def adam_step(params, opt_state, batch):
                value, grads = jax.value_and_grad(loss)(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, value

            for i in range(args.steps):
                start = time.perf_counter()
                params, opt_state, value = adam_step(params, opt_state, next(data))
                losses.append(float(value))
                times.append(time.perf_counter() - start)
                if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
                    held_out.append((i + 1, held_out_loss(params)))
        rows.append((name, losses, held_out, times))

    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params0))
    print(f"Character transformer ({args.layers} layers, width {args.width}, {args.heads} heads, context "
          f"{args.context}, {n_params} parameters), vocabulary {len(chars)}, {len(train_ids)} training characters")
    print(f"{'optimizer':<14} {'steps':>5} {'first loss':>10} {'last loss':>10} {'final held-out':>14} "
          f"{'best held-out (step)':>20} {'bits/char':>9} {'first step s':>12} {'median step ms':>14} {'total s':>8}")
    for name, losses, held_out, times in rows:
        last = float(np.mean(losses[-5:]))
        best_step, best = min(held_out, key=lambda sl: sl[1])
        print(f"{name:<14} {len(losses):>5} {losses[0]:>10.4f} {last:>10.4f} {held_out[-1][1]:>14.4f} "
              f"{f'{best:.4f} ({best_step})':>20} {best / math.log(2):>9.3f} {times[0]:>12.1f} "
              f"{1000 * np.median(times[1:]):>14.1f} {sum(times):>8.1f}")
    print(f"(losses in nats per character; 'last loss': mean of the last 5 training batches; held-out loss every "
          f"{args.eval_every} steps, bits/char of the best; 'first step': compilation, and K-FAC's burn-in, included)")
    ok = all(np.isfinite(r[2][-1][1]) and np.mean(r[1][-5:]) < r[1][0] for r in rows)
    best = [min(h for _, h in r[2]) for r in rows]
    print(f"RESULT kfac_first={rows[0][1][0]:.4f} kfac_last={np.mean(rows[0][1][-5:]):.4f} "
          f"kfac_held_out={rows[0][2][-1][1]:.4f} kfac_best_held_out={best[0]:.4f} "
          f"adam_held_out={rows[1][2][-1][1]:.4f} adam_best_held_out={best[1]:.4f} finite_and_decreasing={ok}")
    if args.json:
        write_json(args, rows, n_params, len(chars), len(train_ids))
    return 0 if ok else 1


def write_json(args, rows, n_params: int, vocabulary: int, train_chars: int) -> None:
    """The run's settings, per-optimizer results and the machine (its load average included)."""
    import json
    import os
    import platform

    out = {"script": "examples/transformer_lm.py", "date": time.strftime("%Y-%m-%d"),
           "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "machine": {"jax": jax.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                       "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
           "parameters": n_params, "vocabulary": vocabulary, "training_characters": train_chars, "runs": {}}
    for name, losses, held_out, times in rows:
        best_step, best = min(held_out, key=lambda sl: sl[1])
        out["runs"][name] = {
            "steps": len(losses), "first_loss": round(losses[0], 4), "last_loss": round(float(np.mean(losses[-5:])), 4),
            "final_held_out": round(held_out[-1][1], 4), "best_held_out": round(best, 4), "best_held_out_step": best_step,
            "best_bits_per_char": round(best / math.log(2), 3), "first_step_s": round(times[0], 1),
            "median_step_ms": round(1000 * float(np.median(times[1:])), 1),
            "mean_step_after_first_s": round(float(np.mean(times[1:])), 2), "total_s": round(sum(times), 1),
            "held_out": [[s, round(v, 4)] for s, v in held_out],
        }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
