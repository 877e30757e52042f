"""The compiled K-FAC step can be reused across processes (JAX's persistent cache).

The cache is keyed by the lowered program, so this holds only if tracing is
deterministic: no dependence on object ids, set order or Python's string hash
seed. Two demo runs with different hash seeds share one cache directory; the
second must find every program the first compiled and add none. The zoo's
models (every framework, conv, attention, norms, embeddings) must lower to the
same text in two processes with different hash seeds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax

from curvax import cli

# A step of every kind of layer and framework (tests/zoo.py), lowered through the public API.
LOWER_ZOO = """
import hashlib, sys, jax, curvax, zoo
for model, framework in [("transformer", "plain_jax"), ("cnn", "flax_linen"), ("resnet", "haiku")]:
    loss, params, batch = zoo.BUILDERS[model][framework](jax.random.PRNGKey(0))
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=1e-3, use_adaptive_learning_rate=True,
                           use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0,
                           num_burnin_steps=0)
    rng = jax.random.PRNGKey(1)
    state = opt.init(params, rng, batch)
    step = jax.jit(lambda p, s, r, b: opt.step(p, s, r, batch=b, global_step_int=0))
    text = step.lower(params, state, rng, batch).as_text()
    print(model, framework, hashlib.sha256(text.encode()).hexdigest())
"""


def _run_demo(cache: Path, out: Path, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "JAX_PLATFORMS": "cpu"}
    argv = ["demo", "--num-images", "16", "--steps", "2", "--adam-steps", "2", "--time-budget", "300", "--quiet",
            "--output", str(out), "--compilation-cache", str(cache)]
    proc = subprocess.run([sys.executable, "-m", "curvax.cli", *argv], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_zoo_steps_lower_identically_across_processes():
    procs = [
        subprocess.Popen([sys.executable, "-c", LOWER_ZOO], cwd=Path(__file__).parent, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"})
        for seed in ("3", "4")
    ]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    first, second = (out for out, _ in outs)
    assert len(first.splitlines()) == 3
    assert first == second


def test_lowering_hash_sees_a_different_model():
    # The comparison above is meaningful: a change in the traced program changes the text.
    f = lambda x: x * 2.0
    g = lambda x: x * 3.0
    text = [jax.jit(h).lower(jax.numpy.ones(3)).as_text() for h in (f, g)]
    assert hashlib.sha256(text[0].encode()).digest() != hashlib.sha256(text[1].encode()).digest()


def test_compilation_cache_flag_is_parsed():
    args = cli.build_parser().parse_args(["demo", "--compilation-cache", "some/dir"])
    assert args.compilation_cache == "some/dir"
    assert cli.build_parser().parse_args(["demo"]).compilation_cache is None


def test_second_run_reuses_every_compiled_program(tmp_path: Path):
    cache = tmp_path / "cache"
    _run_demo(cache, tmp_path / "a.png", "1")
    first = set(os.listdir(cache))
    assert any("_step_reported" in name for name in first), sorted(first)  # the optimizer step
    assert any("burnin" in name for name in first), sorted(first)
    _run_demo(cache, tmp_path / "b.png", "2")
    assert set(os.listdir(cache)) == first
