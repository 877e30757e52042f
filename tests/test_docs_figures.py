"""Figures quoted in README.md and docs/ come from a current result file (issue 22).

The convention (also on the docs page ``docs/contributing_docs.md``):

* A paragraph that names a result file (``results/NAME.json``, ``benchmarks/results/NAME.json``
  or ``examples/results/NAME.json``; a bare ``NAME.json`` once a folder was named on the page)
  *cites* it, and so do the tables and ``text`` blocks right after that paragraph (only blank
  lines between). ``<!-- figures: PATH.json ... -->`` makes every paragraph, table and ``text``
  block of its section (to the next heading) cite the files it names.
* In a citing paragraph or table, every *figure* must be held by one of the files it cites: a
  number with a decimal point (``2.27``, ``0.3136``) or a number with a unit (``256 ms``,
  ``12 s``, ``1.64×``, ``25%``, ``101.8M``), outside inline code. A JSON value ``v`` holds a
  figure ``f`` written with ``d`` decimals when ``v`` rounds to ``f``, or, by the unit, ``1000 v``
  (ms), ``v / 1000`` (s), ``100 v`` (%), ``v / 10^6`` (M): seconds quoted as milliseconds,
  fractions as percentages, counts in millions. Numbers in long lists (per-step series) count too. Version numbers (``0.10.2``),
  dates and numbers in scientific notation are not figures.
* A figure computed from others (a ratio of two times, a difference) is not in any file: quote
  the numbers it comes from, or have the script write it.
* A file named anywhere must exist, and a paragraph must not call the machine "idle" when a file
  it cites records a load average of 1 or more (``test_no_idle_claims_against_recorded_load``).

What this cannot catch: a figure that happens to equal another value of the cited file at the
quoted precision, and figures in paragraphs that cite no file (state where they come from).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT_DIRS = (ROOT / "benchmarks" / "results", ROOT / "examples" / "results")
EXCLUDED = {"docs/guides/operators.md", "docs/migration/curvlinops.md", "docs/guides/architecture.md"}
FILE_REF = re.compile(r"(?:(?:benchmarks|examples)/)?(?:results/)?([A-Za-z0-9_.-]+\.json)")
MARKER = re.compile(r"^<!--\s*figures:\s*(.*?)-->", re.M)  # on a line of its own
FIGURE = re.compile(
    r"(?<![\w.\-/])(?P<num>\d+(?:\.\d+)?)(?:\s?(?P<unit>ms|s|×|x|%|M)(?![\w]))?(?![\w.]*\d)"
)


def result_file(name: str) -> Path | None:
    for d in RESULT_DIRS:
        if (d / name).exists():
            return d / name
    return None


def numbers(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)] if math.isfinite(obj) else []
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers(v)]
    return []


_cache: dict[Path, list[float]] = {}


def values(path: Path) -> list[float]:
    if path not in _cache:
        _cache[path] = numbers(json.loads(path.read_text()))
    return _cache[path]


SCALES = {"ms": (1.0, 1000.0), "s": (1.0, 0.001), "%": (1.0, 100.0), "M": (1e-6,), "": (1.0,), "×": (1.0,), "x": (1.0,)}


def held(figure: str, pool: list[float], unit: str = "") -> bool:
    """Whether a value of ``pool`` rounds to ``figure`` (seconds may be quoted in ms, fractions in %)."""
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    f = float(figure)
    tol = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(v * s - f) <= tol for v in pool for s in SCALES[unit])


def figures(text: str) -> list[str]:
    """The figures in a piece of Markdown prose or table (inline code, versions, dates removed)."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\d+\.\d+\.\d+", " ", text)                   # versions
    text = re.sub(r"\d{4}-\d{2}-\d{2}", " ", text)               # dates
    text = re.sub(r"\d+(?:\.\d+)?e-?\d+", " ", text)             # 1e-3
    text = re.sub(r"\[[^\]]*\]\([^)]*\)", lambda m: m.group(0).split("](")[0], text)  # link targets
    return [(m["num"], m["unit"] or "") for m in FIGURE.finditer(text) if "." in m["num"] or m["unit"]]


def units(page: Path):
    """(first line, kind, text, cited files) for each paragraph, table and text block of a page."""
    lines = page.read_text().splitlines()
    section_files: list[str] = []
    previous_files: list[str] = []  # a paragraph's citation carries to the tables/blocks after it
    i = 0
    # section markers apply to the whole section: collect them per section first
    section_of_line, sections, current = [], [[]], 0
    for line in lines:
        if line.startswith("#"):
            sections.append([])
            current += 1
        section_of_line.append(current)
        for m in MARKER.finditer(line):
            sections[current].extend(m.group(1).split())
    while i < len(lines):
        line = lines[i]
        section_files = [Path(f).name for f in sections[section_of_line[i]]]
        if not line.strip() or line.startswith("#") or line.strip().startswith("<!--"):
            if line.startswith("#"):
                previous_files = []
            i += 1
            continue
        fence = re.match(r"^(`{3,})(.*)$", line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].startswith(fence.group(1)):
                end += 1
            if fence.group(2).strip() == "text":
                yield i + 1, "text block", "\n".join(lines[i + 1:end]), previous_files + section_files
            i = end + 1
            continue
        start = i
        is_table = line.startswith("|")
        while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "```")) and lines[i].startswith("|") == is_table:
            i += 1
        text = "\n".join(lines[start:i])
        own = [m.group(1) for m in FILE_REF.finditer(re.sub(r"\[[^\]]*\]\(([^)]*)\)", "", text).replace("`", " "))]
        own = [f for f in own if result_file(f)]
        if is_table:
            files = own + previous_files + section_files
        else:
            previous_files = own
            files = own + section_files
        yield start + 1, "table" if is_table else "paragraph", text, files


PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
         if str(p.relative_to(ROOT)) not in EXCLUDED and not any(part.startswith("_") for part in p.relative_to(ROOT).parts)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_cited_figures_are_in_the_cited_files(page: Path):
    problems = []
    for line, kind, text, files in units(page):
        if not files:
            continue
        pool = [v for f in dict.fromkeys(files) for v in values(result_file(f))]
        missing = [f + u for f, u in figures(text) if not held(f, pool, u)]
        if missing:
            problems.append(f"line {line} ({kind}, citing {', '.join(dict.fromkeys(files))}): {missing}")
    assert not problems, f"{page.relative_to(ROOT)}: figures no cited result file holds:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_result_files_exist(page: Path):
    text = page.read_text()
    for m in re.finditer(r"(?:benchmarks|examples)/results/([A-Za-z0-9_.-]+\.json)", text):
        if m.group(1)[:-5].isupper():  # a placeholder (NAME.json)
            continue
        assert result_file(m.group(1)), f"{page.relative_to(ROOT)} names {m.group(0)}, which does not exist"
    for m in MARKER.finditer(text):
        for f in m.group(1).split():
            assert (ROOT / f).exists(), f"{page.relative_to(ROOT)}: figures marker names {f}, which does not exist"


def load_averages(obj) -> list[float]:
    if isinstance(obj, dict):
        return [x for k, v in obj.items() for x in (numbers(v) if "load" in k.lower() else load_averages(v))]
    if isinstance(obj, list):
        return [x for v in obj for x in load_averages(v)]
    return []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_idle_claims_against_recorded_load(page: Path):
    for line, kind, text, files in units(page):
        if not re.search(r"\bidle\b", text, re.I):
            continue
        for f in dict.fromkeys(files):
            loads = load_averages(json.loads(result_file(f).read_text()))
            assert not loads or max(loads) < 1.0, (
                f"{page.relative_to(ROOT)}:{line} calls the machine idle, but {f} records load averages up to {max(loads):.1f}")


def test_the_figure_rules():
    assert figures("2.27× and 256 ms, `lr=0.25`, jax 0.10.2, 1e-3, 40 rounds, 2026-11-24") == [("2.27", "×"), ("256", "ms")]
    assert held("2.27", [2.2712]) and held("256", [0.2561], "ms") and held("25", [0.25], "%")
    assert not held("2.28", [2.2712]) and not held("256", [0.2561])
