"""kfac-jax v0.0.8's own test suite, run against curvax behind the ``kfac_jax`` name.

kfac-jax's ``tests/`` directory at the tag (from a clone of google-deepmind/kfac-jax: the PyPI
sdist lacks ``tests/models.py`` and ``tests/estimator_test_utils.py``) is copied into a fresh
temporary directory, next to:

* ``shim/kfac_jax/__init__.py``: ``import sys, curvax; sys.modules["kfac_jax"] = curvax``, first
  on ``PYTHONPATH``, so every ``import kfac_jax`` of the tests loads curvax (even where the real
  kfac-jax is installed);
* ``conftest.py``: checks at collection that ``kfac_jax`` *is* curvax (the run stops otherwise).

Nothing of kfac-jax is copied into this repository: the tests are read from the clone at run
time. pytest runs with ``-p no:cacheprovider`` and a JUnit XML report, from which the JSON gets
every test id with its outcome (``passed``, ``failed``, ``error``, ``skipped``), the first line of
each failure's message, the totals per file and overall, and the versions, the load average
before and after, and the runtime.

The tests need ``distrax``, ``dm-haiku`` and ``absl-py`` (kfac-jax's ``models.py`` imports
distrax), which are not curvax dependencies: use an environment of its own, e.g.::

    git clone https://github.com/google-deepmind/kfac-jax /tmp/kfac-jax
    python3 -m venv /tmp/kfj && /tmp/kfj/bin/pip install "jax==0.9.0" "jaxlib==0.9.0" \\
        kfac-jax==0.0.8 optax dm-haiku distrax absl-py pytest pytest-xdist
    /tmp/kfj/bin/python benchmarks/kfac_jax_tests.py --kfac-jax-repo /tmp/kfac-jax

(curvax itself comes from this checkout, put on ``PYTHONPATH``; its dependencies must be in the
environment: JAX, NumPy, and Optax for the Optax interface tests.)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

CONFTEST = '''\
import kfac_jax
import curvax

assert kfac_jax is curvax, f"kfac_jax resolves to {kfac_jax!r}, not curvax"


def pytest_report_header(config):
    return f"kfac_jax -> curvax from {curvax.__file__}"
'''

SHIM = 'import sys\nimport curvax\n\nsys.modules["kfac_jax"] = curvax\n'


def _git_dir(path: Path) -> list[str]:
    """``git`` arguments reading the repository at ``path`` (a work tree or a bare git dir)."""
    if (path / ".git").exists():
        return ["git", "-C", str(path)]
    return ["git", f"--git-dir={path}"]


def export_tests(repo: Path, ref: str, dest: Path) -> str:
    """Writes ``tests/`` of ``repo`` at ``ref`` under ``dest``; returns the commit."""
    git = _git_dir(repo)
    commit = subprocess.run([*git, "rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run([*git, "archive", "--format=tar", commit, "tests"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return commit


def _versions(python: str, env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, platform, importlib.metadata as m\n"
        "import jax, jaxlib, curvax\n"
        "out = {'python': platform.python_version(), 'jax': jax.__version__, 'jaxlib': jaxlib.__version__,\n"
        "       'curvax_file': curvax.__file__, 'backend': jax.default_backend()}\n"
        "for p in ('kfac-jax', 'dm-haiku', 'distrax', 'optax', 'pytest', 'numpy'):\n"
        "    try:\n"
        "        out[p] = m.version(p)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[p] = None\n"
        "print(json.dumps(out))\n"
    )
    res = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """One row per test case: ``id`` (file::Class::name), ``outcome``, ``message`` (first line)."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        # classname "tests.test_utils.TestClass": the module path, then the class.
        mod_parts = [p for p in parts if not p[:1].isupper()]
        cls_parts = [p for p in parts if p[:1].isupper()]
        file = "/".join(mod_parts) + ".py"
        test_id = "::".join([file, *cls_parts, case.get("name", "")])
        outcome, message = "passed", None
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome = name
                message = (el.get("message") or el.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        rows.append({"id": test_id, "file": file, "outcome": outcome, "message": message, "time_s": float(case.get("time", 0.0))})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kfac-jax-repo", required=True, type=Path, help="a clone (or bare git dir) of google-deepmind/kfac-jax")
    ap.add_argument("--ref", default="v0.0.8", help="tag or commit whose tests/ to run (default v0.0.8)")
    ap.add_argument("--python", default=sys.executable, help="interpreter to run pytest with (needs distrax, haiku, absl)")
    ap.add_argument("-n", "--workers", default="2", help="pytest-xdist workers ('0': none)")
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks/results/kfac_jax_tests.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k test_utils)")
    args = ap.parse_args(argv)

    head = _git_head()  # the curvax under test: this checkout as the run starts
    tmp = Path(tempfile.mkdtemp(prefix="kfac_jax_tests_"))
    try:
        commit = export_tests(args.kfac_jax_repo, args.ref, tmp)
        (tmp / "shim/kfac_jax").mkdir(parents=True)
        (tmp / "shim/kfac_jax/__init__.py").write_text(SHIM)
        (tmp / "conftest.py").write_text(CONFTEST)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "shim"), str(REPO), str(tmp), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("JAX_PLATFORMS", "cpu")
        versions = _versions(args.python, env)
        junit = tmp / "junit.xml"
        cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=", f"--junitxml={junit}",
               "-o", "junit_family=xunit1", "--rootdir", str(tmp)]
        if args.workers not in ("0", ""):
            cmd += ["-n", args.workers]
        paths = [a for a in args.pytest_args if a.startswith("tests")]
        cmd += [*([] if paths else ["tests"]), *args.pytest_args]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        runtime = time.perf_counter() - t0
        load_after = os.getloadavg()
        if not junit.exists():
            sys.stderr.write(res.stdout[-5000:] + res.stderr[-5000:])
            raise SystemExit(f"pytest wrote no report (exit {res.returncode})")
        rows = parse_junit(junit)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    totals = collections.Counter(r["outcome"] for r in rows)
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        per_file[r["file"]][r["outcome"]] += 1
    out = {
        "description": "kfac-jax's own tests (tests/ at the ref below), run with `kfac_jax` resolving to curvax",
        "kfac_jax_tests_ref": args.ref,
        "kfac_jax_tests_commit": commit,
        "curvax_commit": head,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": load_after},
        "pytest_command": " ".join(cmd[1:]).replace(str(tmp), "<tmp>"),
        "pytest_exit_code": res.returncode,
        "runtime_s": round(runtime, 1),
        "totals": {"tests": len(rows), **{k: totals.get(k, 0) for k in ("passed", "failed", "error", "skipped")}},
        "per_file": {f: {k: c.get(k, 0) for k in ("passed", "failed", "error", "skipped")} for f, c in sorted(per_file.items())},
        "not_passed": [r for r in rows if r["outcome"] != "passed"],
        "tests": {r["id"]: r["outcome"] for r in rows},
        "pytest_summary": [line for line in res.stdout.strip().splitlines()[-3:]],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    t = out["totals"]
    print(f"{t['passed']} of {t['tests']} passed ({t['failed']} failed, {t['error']} errors, {t['skipped']} skipped) "
          f"in {runtime / 60:.1f} min; wrote {args.output}")
    for f, c in out["per_file"].items():
        print(f"  {f}: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
