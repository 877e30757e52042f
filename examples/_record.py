"""``--json PATH`` for the example scripts: what a run printed, as a result file the docs quote from.

``run_recorded(main, argv, path, script)`` runs ``main(argv)`` while copying its standard output,
then writes ``path``: the script, the date, the arguments, the machine (JAX version, CPU count,
load average over 1, 5 and 15 minutes), every line printed, the ``RESULT`` fields as numbers, and
every number printed (in order), so that ``tests/test_docs_figures.py`` can check the figures a
page quotes from the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import sys
import time
from typing import Callable


class _Tee(io.TextIOBase):
    def __init__(self, out):
        self.out, self.buffer_ = out, io.StringIO()

    def write(self, s: str) -> int:
        self.out.write(s)
        return self.buffer_.write(s)

    def flush(self) -> None:
        self.out.flush()


def run_recorded(main: Callable[[list[str]], int], argv: list[str], path: str, script: str) -> int:
    import jax

    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        code = main(argv)
    lines = tee.buffer_.getvalue().splitlines()
    result = {}
    for line in lines:
        if line.startswith("RESULT "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                try:
                    result[key] = float(value)
                except ValueError:
                    result[key] = value
    out = {
        "script": script, "date": time.strftime("%Y-%m-%d"), "argv": argv,
        "machine": {"jax": jax.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "result": result, "printed": lines,
        "printed_numbers": [float(x) for x in re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", "\n".join(lines))],
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return code
