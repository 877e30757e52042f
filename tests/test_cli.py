"""The ``curvax`` command line and the demo's pieces that do not need K-FAC."""

from __future__ import annotations

import builtins
import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from curvax import cli, datasets, demo


def test_demo_defaults():
    args = cli.build_parser().parse_args(["demo"])
    assert args.command == "demo"
    assert args.num_images == 1000 and args.initial_damping == 1.0 and args.adam_lr == 1e-3
    assert args.output == "curvax_demo.png" and args.seed == 0 and not args.quiet
    assert args.curvature_batch_fraction == 1.0  # the whole batch, as kfac-jax
    # Budgeted by steps, so a busy machine cannot change how far each optimizer gets.
    assert args.steps == 100 and args.adam_steps == 500 and args.time_budget is None


def test_demo_flags():
    args = cli.build_parser().parse_args(
        ["demo", "--num-images", "64", "--steps", "3", "--adam-steps", "4", "--time-budget", "2.5",
         "--adam-lr", "3e-4", "--initial-damping", "10", "--seed", "7", "--output", "x.png", "--quiet",
         "--curvature-batch-fraction", "0.25"]
    )
    assert args.curvature_batch_fraction == 0.25
    assert (args.num_images, args.steps, args.adam_steps, args.time_budget) == (64, 3, 4, 2.5)
    assert (args.adam_lr, args.initial_damping, args.seed, args.output, args.quiet) == (3e-4, 10.0, 7, "x.png", True)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["train"],
        ["demo", "--num-images", "0"],
        ["demo", "--num-images", str(datasets.NUM_EXAMPLES + 1)],
        ["demo", "--steps", "0"],
        ["demo", "--adam-steps", "-1"],
        ["demo", "--time-budget", "0"],
        ["demo", "--initial-damping", "-1"],
        ["demo", "--num-images", "many"],
        ["demo", "--curvature-batch-fraction", "0"],
        ["demo", "--curvature-batch-fraction", "1.5"],
    ],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: curvax" in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--num-images", "--steps", "--adam-steps", "--seed", "--output", "--time-budget", "--initial-damping"):
        assert flag in out


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "curvax.cli", "--help"], capture_output=True, text=True, check=True)
    assert "usage: curvax" in out.stdout


def test_console_script_is_declared():
    # The README's test command installs the package first, so its console script must exist.
    scripts = metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "curvax"] == ["curvax.cli:main"]


def test_demo_data_is_real_mnist():
    x = datasets.load_mnist_images(1000)
    assert x.shape == (1000, 784) and 0.0 <= x.min() and x.max() <= 1.0
    assert 0.1 < x.mean() < 0.15  # MNIST digits: about 13% ink


def _run(name: str, losses: list[float]) -> demo.Run:
    return demo.Run(name, losses, [0.5 * i for i in range(len(losses))], 3.0)


def test_results_table_uses_shared_target():
    a, b = _run("fast", [500.0, 200.0, 90.0, 80.0]), _run("slow", [500.0, 300.0, 150.0])
    assert a.steps_to(150.0) == 2 and b.steps_to(150.0) == 2 and b.steps_to(10.0) is None
    assert a.time_to(150.0) == 1.0 and b.time_to(10.0) is None
    assert a.median_step_seconds() == 0.5
    table = demo.results_table([a, b])
    header, _, row_a, row_b = table.splitlines()[:4]
    assert "steps to 150.00" in header and "train s to 150.00" in header
    # name, steps, final, best, first step, median step, steps to target, seconds to target
    assert row_a.split() == ["fast", "4", "80.000", "80.000", "3.0", "0.500", "2", "1.0"]
    assert row_b.split() == ["slow", "3", "150.000", "150.000", "3.0", "0.500", "2", "1.0"]


def test_results_table_states_no_verdict():
    table = demo.results_table([_run("a", [3.0, 1.0]), _run("b", [3.0, 2.0])]).lower()
    for word in ("faster", "wins", "winner", "better", "beats"):
        assert word not in table


def test_results_table_ignores_nan():
    r = _run("diverged", [500.0, 100.0, math.nan])
    assert r.best() == 100.0
    assert "nan" in demo.results_table([r, _run("ok", [500.0, 90.0])])


@pytest.mark.parametrize("floor", [None, 0.5])
def test_plot_writes_png(tmp_path: Path, floor: float | None):
    path = tmp_path / "plot.png"
    assert demo.plot([_run("a", [3.0, 2.0, 1.0]), _run("b", [3.0, 2.5])], str(path), "title", floor)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_entropy_floor():
    from curvax import autoencoder as ae

    assert ae.entropy_floor(np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])) == 0.0
    assert ae.entropy_floor(np.full((3, 784), 0.5)) == pytest.approx(784 * math.log(2))
    images = datasets.load_mnist_images(100)
    logits = jnp.log(jnp.clip(images, 1e-6, 1 - 1e-6)) - jnp.log1p(-jnp.clip(images, 1e-6, 1 - 1e-6))
    assert float(ae.cross_entropy(logits, images)) == pytest.approx(ae.entropy_floor(images), rel=1e-3)
    assert "lowest loss possible" in demo.results_table([_run("a", [3.0])], floor=1.0)


def test_missing_extras_degrade_gracefully(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    real_import = builtins.__import__

    def no_extras(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] in ("matplotlib", "tqdm"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_extras)
    assert demo.missing_extras() == ["matplotlib", "tqdm"]
    assert demo._progress(10, "x", quiet=False) is None
    assert not demo.plot([_run("a", [1.0])], str(tmp_path / "p.png"), "t")
    assert not (tmp_path / "p.png").exists()


def test_adam_run_trains():
    images = jnp.asarray(datasets.load_mnist_images(16))
    result = demo.run("adam", demo.adam_setup(images, seed=0, learning_rate=1e-3), steps=5, budget=60.0, quiet=True)
    assert len(result.losses) == 5 and result.times == sorted(result.times)
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    # The first step (compilation) is timed apart: the training clock starts after it.
    assert result.times[0] == 0.0 and result.first_step_seconds > 0


def test_kfac_run_with_curvature_on_a_sub_batch_trains():
    images = jnp.asarray(datasets.load_mnist_images(16))
    setup = demo.kfac_setup(images, seed=0, initial_damping=1.0, quiet=True, curvature_batch_fraction=0.25)
    result = demo.run("kfac", setup, steps=4, budget=120.0, quiet=True)
    assert len(result.losses) == 4 and result.losses[-1] < result.losses[0]


def test_run_stops_at_time_budget():
    images = jnp.asarray(datasets.load_mnist_images(8))
    result = demo.run("adam", demo.adam_setup(images, seed=0, learning_rate=1e-3), steps=1000, budget=1e-9, quiet=True)
    assert len(result.losses) == 2  # the first step is not budgeted; the second passes the budget


@pytest.mark.slow
def test_demo_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "demo.png"
    argv = ["demo", "--num-images", "32", "--steps", "6", "--adam-steps", "6", "--quiet", "--output", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "curvax K-FAC" in text and "Optax Adam" in text and "final loss" in text and "steps to" in text
    if demo.missing_extras() == []:
        assert out.read_bytes()[:4] == b"\x89PNG"
