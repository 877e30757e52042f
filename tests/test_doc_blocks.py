"""Every Python code block in README.md and docs/ runs as printed, page by page.

Conventions (also on the docs page ``docs/contributing_docs.md``):

* Every fenced block whose language is ``python`` (or ``py``, ``python3``, a ``{code-block}`` or
  ``{code-cell}`` directive with ``python``) is collected. A page's blocks run in order, in one
  namespace, in a fresh interpreter per page, with the working directory a temporary folder and
  the repository on ``PYTHONPATH``. So a page's blocks must run on their own: define what they
  use in an earlier block of the same page.
* ``<!-- doc-test: skip REASON -->`` on the lines just before a block skips it; the reason is
  required (an empty one fails), and skipped blocks are counted so that they stay rare.
* ``<!-- doc-test: env NAME=VALUE -->`` anywhere in a page sets an environment variable for that
  page's interpreter (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` for a page
  with several CPU devices).
* A fenced block with language ``output`` right after a Python block states what that block
  prints; the test compares it with the block's standard output (whitespace-insensitive, numbers
  to a relative 1e-3).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON_INFOS = {"python", "py", "python3", "{code-block} python", "{code-cell} python", "{code-block} py"}
FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n`]*)$")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(?P<kind>skip|env)\b\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None = None
    output: str | None = None


@dataclass
class Page:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _is_generated(path: Path) -> bool:
    return any(part.startswith("_") for part in path.relative_to(ROOT).parts)


def parse(path: Path) -> Page:
    """The page's Python blocks, their skip markers and stated outputs, and its environment."""
    lines = path.read_text().splitlines()
    page = Page(path)
    pending_skip: str | None = None
    last: Block | None = None  # the previous Python block, if nothing but blank lines follows it
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line.strip())
        if marker:
            if marker["kind"] == "skip":
                if not marker["arg"]:
                    raise ValueError(f"{path.name}:{i + 1}: a doc-test skip needs a reason")
                pending_skip = marker["arg"]
            else:
                name, _, value = marker["arg"].partition("=")
                page.env[name.strip()] = value.strip()
            i += 1
            continue
        fence = FENCE.match(line)
        if not fence:
            if line.strip():
                pending_skip, last = None, None
            i += 1
            continue
        info = fence["info"].strip()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence["fence"]):
            end += 1
        body = lines[i + 1:end]
        if info.startswith("{"):  # MyST directive options (":caption: ...") are not code
            while body and re.match(r"^:\w[\w-]*:", body[0]):
                body = body[1:]
        text = "\n".join(body) + "\n"
        if info in PYTHON_INFOS:
            last = Block(i + 1, text, pending_skip)
            page.blocks.append(last)
        elif info == "output":
            if last is None:
                raise ValueError(f"{path.name}:{i + 1}: an output block must follow a Python block")
            last.output = text
            last = None
        else:
            last = None
        pending_skip = None
        i = end + 1
    return page


RUNNER = r'''
import contextlib, io, json, sys, time, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
results = []
for b in blocks:
    if b["skip"]:
        results.append({"line": b["line"], "skipped": True})
        continue
    out = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(b["code"], f"{b['page']}:block@{b['line']}", "exec"), namespace)
    except BaseException:
        results.append({"line": b["line"], "error": traceback.format_exc(limit=-8), "stdout": out.getvalue()})
        break
    results.append({"line": b["line"], "stdout": out.getvalue(), "seconds": time.perf_counter() - start})
json.dump(results, open(sys.argv[2], "w"))
'''

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def same_output(got: str, want: str) -> bool:
    """Whitespace-insensitive; numbers equal to a relative 1e-3 (absolute 1e-6)."""
    g, w = got.split(), want.split()
    if len(g) != len(w):
        return False
    for a, b in zip(g, w):
        if a == b:
            continue
        na, nb = NUMBER.findall(a), NUMBER.findall(b)
        if len(na) != len(nb) or not na or NUMBER.sub("#", a) != NUMBER.sub("#", b):
            return False
        if not all(math.isclose(float(x), float(y), rel_tol=1e-3, abs_tol=1e-6) for x, y in zip(na, nb)):
            return False
    return True


def run_page(page: Page, tmp_path: Path) -> list[dict]:
    rel = str(page.path.relative_to(ROOT))
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"page": rel, "line": b.line, "code": b.code, "skip": b.skip} for b in page.blocks]))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **page.env}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "runner.py"), str(spec), str(tmp_path / "results.json")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{rel}: the runner failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((tmp_path / "results.json").read_text())


PAGES = [p for p in pages() if not _is_generated(p) and parse(p).blocks]


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(path: Path, tmp_path: Path):
    page = parse(path)
    rel = path.relative_to(ROOT)
    results = run_page(page, tmp_path)
    print(rel, " ".join(f"@{r['line']}:{r.get('seconds', 0):.1f}s" for r in results))
    for block, result in zip(page.blocks, results):
        assert "error" not in result, f"{rel}, block at line {block.line} raised:\n{result['error']}"
        if block.output is not None and not result.get("skipped"):
            assert same_output(result["stdout"], block.output), (
                f"{rel}, block at line {block.line} printed\n{result['stdout']}\nbut the page states\n{block.output}")
    assert len(results) == len(page.blocks)


def test_every_page_is_collected_and_skips_are_rare():
    collected = {p: parse(p) for p in pages() if not _is_generated(p)}
    n_blocks = sum(len(p.blocks) for p in collected.values())
    skipped = [(p.relative_to(ROOT), b.line, b.skip) for p, page in collected.items() for b in page.blocks if b.skip]
    assert n_blocks >= 36, n_blocks
    assert len(skipped) <= max(3, n_blocks // 20), f"too many skipped doc blocks: {skipped}"
    # Every Python-looking fence is one this test collects (no hidden language spellings).
    for p in collected:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            m = FENCE.match(line)
            if m and "python" in m["info"].lower() and m["info"].strip() not in PYTHON_INFOS:
                pytest.fail(f"{p.relative_to(ROOT)}:{i}: fence '{m['info']}' is not collected")


def test_parser_conventions(tmp_path: Path):
    md = tmp_path / "page.md"
    md.write_text(
        "<!-- doc-test: env A=1 -->\n\n```python\nprint(1)\n```\n\n```output\n1\n```\n\n"
        "<!-- doc-test: skip needs a GPU -->\n```python\nraise SystemExit\n```\n\ntext\n\n```output\n2\n```\n")
    with pytest.raises(ValueError, match="output block must follow"):
        parse(md)
    md.write_text(md.read_text().replace("text\n\n```output\n2\n```\n", ""))
    page = parse(md)
    assert page.env == {"A": "1"}
    assert [(b.output, b.skip) for b in page.blocks] == [("1\n", None), (None, "needs a GPU")]
    md.write_text("<!-- doc-test: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        parse(md)
    assert same_output("loss 0.31362\n", "loss   0.3136") and not same_output("loss 0.33", "loss 0.3136")
    assert not same_output("a b", "a")
