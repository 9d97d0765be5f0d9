"""The versions a host's ranks will see, kept between launches while nothing they rest on
changed.

Asking the ranks' interpreter for its versions (`versions`) starts a Python each launch:
60-80 ms on a CPU host, seconds on a GPU host whose torch must be imported to read its
NCCL. A launch of a few ranks spent more on that than on its ranks (issue 35,
`bench/profile.py --timeline`). The answer depends only on files and a few variables,
so it is kept, one file per question, in a ``cache`` folder of this user's private
registry folder (`registry.writable_dir`, 0700; files 0600), and reused while:

* the question is the same: the interpreter found, its folder, the packages asked, and
  the variables that move an interpreter's imports (every ``PYTHON*``, ``PATH``,
  ``VIRTUAL_ENV``, ``CONDA_PREFIX``, ``LD_LIBRARY_PATH``, ``CUDA_VISIBLE_DEVICES``, and
  every variable the launch sets for the ranks). The file is named by a SHA-256 of them:
  no value is written down;
* the interpreter file and every folder on its ``sys.path`` have the ``mtime`` they had:
  installing, upgrading or removing a package renames a ``*.dist-info`` folder in
  ``site-packages``, which changes that folder's ``mtime``;
* for an answer that imported torch (a GPU build), the GPU driver's version file reads
  the same;
* it is younger than `MAX_AGE_S`, so a change none of these shows (a library edited in
  place) is seen within a day.

An answer with an error, or from a GPU build that saw no GPU, is not kept: those may be
passing states. Standard library only, Python 3.8 syntax: this module ships to hosts in
the agent bundle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any, Dict, List, Optional

from fdl_fabric.agent import registry

#: Seconds a kept answer is trusted at most.
MAX_AGE_S = 24 * 3600.0
#: The driver's version file: a driver upgraded under a kept GPU answer changes it.
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
#: The variables, besides the launch's own, that change what an interpreter imports.
_MOVING_VARS = ("PATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH",
                "CUDA_VISIBLE_DEVICES")
#: The answer's field listing the interpreter's ``sys.path`` (taken out before it is sent).
PATHS = "paths"


def key(python: str, cwd: str, names: Optional[List[str]], env: Dict[str, str],
        launch_env: Dict[str, str]) -> str:
    """The question's name: a SHA-256 of everything the answer depends on but files."""
    moving = {k: v for k, v in env.items() if k.startswith("PYTHON") or k in _MOVING_VARS}
    moving.update(launch_env)
    question = [python, cwd, names, sorted(moving.items())]
    return hashlib.sha256(json.dumps(question).encode("utf-8")).hexdigest()


def lookup(question: str) -> Optional[Dict[str, Any]]:
    """The kept answer to ``question`` while it still holds, else None (never raises)."""
    path = _path(question)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            kept = json.loads(fh.read(1 << 20).decode("utf-8"))
        answer, stamps, made = kept["answer"], kept["stamps"], float(kept["made"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(answer, dict) or not isinstance(stamps, dict) \
            or not 0 <= time.time() - made <= MAX_AGE_S:
        return None
    if stamps != _stamps(list(stamps)):
        return None
    return answer


def keep(question: str, python: str, cwd: str, answer: Dict[str, Any]) -> None:
    """Keep ``answer`` (with its ``paths`` field) for `lookup`, when it may be kept."""
    paths = answer.get(PATHS)
    if not isinstance(paths, list) or answer.get("error") or answer.get("torch_error"):
        return
    if answer.get("torch_cuda") and not answer.get("cuda_available"):
        return  # a GPU build that saw no GPU: maybe a passing state
    watched = [python] + [os.path.join(cwd, p) if not os.path.isabs(str(p)) else str(p)
                          for p in paths]
    if answer.get("cuda_available"):
        watched.append(DRIVER_VERSION_FILE)
    path = _path(question)
    if path is None:
        return
    _forget_old(os.path.dirname(path))
    body = {"answer": {k: v for k, v in answer.items() if k != PATHS},
            "stamps": _stamps(watched), "made": time.time()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(body, fh)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _path(question: str) -> Optional[str]:
    """This question's file in the private cache folder, or None when there is none."""
    try:
        folder = os.path.join(registry.writable_dir(), "cache")
        registry.make_private(folder)
    except OSError:
        return None
    return os.path.join(folder, "versions-" + question + ".json")


def _forget_old(folder: str) -> None:
    """Remove the kept answers past `MAX_AGE_S`: one file per question, and a host asked
    by many venvs over months would otherwise keep them all."""
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                if entry.name.startswith("versions-") and \
                        now - entry.stat(follow_symlinks=False).st_mtime > MAX_AGE_S:
                    os.unlink(entry.path)


def _stamps(paths: List[str]) -> Dict[str, str]:
    """What each watched path is now: its mtime and size, or ``-`` when it is not there;
    the driver's version file by its text (``/proc`` files have no useful mtime)."""
    stamps = {}
    for path in paths:
        try:
            if path == DRIVER_VERSION_FILE:
                with open(path, "rb") as fh:
                    stamps[path] = hashlib.sha256(fh.read(1 << 16)).hexdigest()
                continue
            st = os.stat(path)
            stamps[path] = f"{st.st_mtime_ns}:{st.st_size}"
        except OSError:
            stamps[path] = "-"
    return stamps


__all__ = ["DRIVER_VERSION_FILE", "MAX_AGE_S", "PATHS", "key", "keep", "lookup"]
