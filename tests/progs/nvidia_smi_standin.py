#!/usr/bin/env python3
"""A stand-in ``nvidia-smi`` (and ``dmesg``) that prints captured outputs.

Installed on a host's PATH as links named ``nvidia-smi`` and ``dmesg`` (the name it is
called by picks the program). The case is a folder of captures
(``tests/fixtures/nvidia-smi/<case>/``, see its README), named by ``FDL_NVSMI_CASE`` (a
name there, or a path), else by a file ``case`` next to the link:

* ``query-gpu.csv`` / ``compute-apps.csv``: a CSV capture with its header; a
  ``--query-gpu=`` / ``--query-compute-apps=`` is answered with the asked columns, picked
  by header name (units like `` [MiB]`` dropped), without the header under ``noheader``;
  a line that is not a row (a message) is printed as it is.
* ``q.txt``: printed for ``-q`` (with or without ``-d``); ``table.txt``: for no argument.
* ``fail.txt`` and ``status``: printed for every call, exiting with that status (a
  driver that does not answer).
* ``dmesg.txt``: what ``dmesg`` prints; ``dmesg-denied.txt``: printed by ``dmesg``
  instead, exiting 1 (a user who may not read the kernel log).

A missing file prints nothing and exits 0, like a capture of nothing.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi"
#: ``--query-compute-apps`` takes either name of the same column (``--help-query-compute-apps``).
ALIASES = {"used_memory": "used_gpu_memory", "name": "process_name"}


def _case() -> Path:
    named = os.environ.get("FDL_NVSMI_CASE")
    if not named:
        marker = Path(sys.argv[0]).parent / "case"
        named = marker.read_text().strip() if marker.is_file() else "healthy-h200"
    path = Path(named)
    return path if path.is_absolute() else FIXTURES / named


def _read(case: Path, name: str) -> str:
    path = case / name
    return path.read_text() if path.is_file() else ""


def _project(capture: str, asked: str, header: bool) -> str:
    """The asked columns of a CSV capture, by header name."""
    lines = [ln for ln in capture.splitlines() if ln.strip()]
    if not lines:
        return ""
    names = [re.sub(r"\s*\[.*\]$", "", c.strip()) for c in lines[0].split(",")]
    wanted = [ALIASES.get(f, f) if ALIASES.get(f) in names else f for f in asked.split(",")]
    missing = [f for f in wanted if f not in names]
    if missing:
        sys.stdout.write(f'Field "{missing[0]}" is not a valid field to query.\n')
        sys.exit(2)
    cols = [names.index(f) for f in wanted]
    out = []
    for line in lines if header else lines[1:]:
        cells = [c.strip() for c in line.split(",")]
        # a line that is not a row (a message nvidia-smi mixed in) is printed as it is
        out.append(", ".join(cells[i] for i in cols) if len(cells) == len(names) else line)
    return "".join(line + "\n" for line in out)


def nvidia_smi(case: Path, args: list[str]) -> int:
    if (case / "fail.txt").is_file():
        sys.stdout.write(_read(case, "fail.txt"))
        return int(_read(case, "status").strip() or "9")
    header = not any("noheader" in a for a in args)
    for arg in args:
        for flag, capture in (("--query-gpu=", "query-gpu.csv"),
                              ("--query-compute-apps=", "compute-apps.csv")):
            if arg.startswith(flag):
                sys.stdout.write(_project(_read(case, capture), arg[len(flag):], header))
                return 0
    if "-q" in args:
        sys.stdout.write(_read(case, "q.txt"))
    elif not args:
        sys.stdout.write(_read(case, "table.txt"))
    return 0


def dmesg(case: Path) -> int:
    denied = _read(case, "dmesg-denied.txt")
    if denied:
        sys.stderr.write(denied)
        return 1
    sys.stdout.write(_read(case, "dmesg.txt"))
    return 0


if __name__ == "__main__":
    here = _case()
    if Path(sys.argv[0]).name == "dmesg":
        sys.exit(dmesg(here))
    sys.exit(nvidia_smi(here, sys.argv[1:]))
