"""The compiled K-FAC step can be reused across processes (JAX's persistent cache).

The cache is keyed by the lowered program, so this holds only if tracing is
deterministic: no dependence on object ids, set order or Python's string hash
seed. Two demo runs with different hash seeds share one cache directory; the
second must find every program the first compiled and add none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from curvax import cli


def _run_demo(cache: Path, out: Path, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "JAX_PLATFORMS": "cpu"}
    argv = ["demo", "--num-images", "16", "--steps", "2", "--adam-steps", "2", "--time-budget", "300", "--quiet",
            "--output", str(out), "--compilation-cache", str(cache)]
    proc = subprocess.run([sys.executable, "-m", "curvax.cli", *argv], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_compilation_cache_flag_is_parsed():
    args = cli.build_parser().parse_args(["demo", "--compilation-cache", "some/dir"])
    assert args.compilation_cache == "some/dir"
    assert cli.build_parser().parse_args(["demo"]).compilation_cache is None


def test_second_run_reuses_every_compiled_program(tmp_path: Path):
    cache = tmp_path / "cache"
    _run_demo(cache, tmp_path / "a.png", "1")
    first = set(os.listdir(cache))
    assert any("step_impl" in name for name in first), sorted(first)
    assert any("burnin_impl" in name for name in first), sorted(first)
    _run_demo(cache, tmp_path / "b.png", "2")
    assert set(os.listdir(cache)) == first
