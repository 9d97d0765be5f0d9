"""``setup:`` on a host: one shell command in the synced tree, once per host, again only
when it or its inputs changed (docs/code-and-environment.md).

The launcher sends SETUP with the command, the tree, a *key* (a hash of the command and
of the contents of ``setup_inputs``) and the names at the top of the tree as synced.
When this host's record (``<store>/setup/last.json``) holds the same key and the tree it
names still has what setup made there, nothing runs: what setup made at the top of that
tree (a ``.venv``) is linked into the new one, so ``python: .venv/bin/python`` works in
every version that shares the key. Otherwise the command runs with ``sh -c`` in the new
tree, in its own process group, its output sent up as SETUP_OUTPUT, killed at its
``timeout``; on success the record is written, naming what it made.

Why link rather than re-run or copy: a venv holds absolute paths (its scripts' ``#!``
lines), so it must stay where it was made; the tree it was made in is kept by the
store's collector for as long as the record names it (`codestore.keep_named`).

Standard library only: this runs inside the agent, whose loop reads the pipes, reaps
the process and enforces the timeout (`fdl_fabric.agent.main`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Any, Dict, List, Optional

#: The record of this host's last successful setup, under the store's folder.
RECORD = os.path.join("setup", "last.json")
#: Lines of output kept to quote when the setup fails.
TAIL_LINES = 20


class SetupRun:
    """One setup on this host: either skipped at once, or a running process group."""

    def __init__(self, request: Dict[str, Any]) -> None:
        self.command = str(request["command"])
        self.tree = str(request["dir"])
        self.root = str(request["root"])
        self.key = str(request["key"])
        self.top = set(str(n) for n in request.get("top") or [])
        self.timeout = float(request.get("timeout") or 1800.0)
        self.env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.fds: Dict[int, int] = {}  # fd -> stream (1 out, 2 err)
        self.deadline: Optional[float] = None
        self.status: Optional[int] = None
        self.timed_out = False
        self.tail: List[str] = []
        self.started = time.monotonic()

    # -- skipping ------------------------------------------------------------------------
    def reuse(self) -> Optional[Dict[str, Any]]:
        """The SETUP_DONE of a setup already done for this key (what it made, linked
        into this tree), or None when it must run."""
        record = read_record(self.root)
        if record is None or record.get("key") != self.key:
            return None
        made = [str(n) for n in record.get("made") or []]
        old = str(record.get("tree") or "")
        if old != self.tree:
            if not os.path.isdir(old) or not all(os.path.lexists(os.path.join(old, n))
                                                 for n in made):
                return None
            for name in made:
                target = os.path.join(self.tree, name)
                if not os.path.lexists(target):
                    os.symlink(os.path.join(old, name), target)
        return {"skipped": True, "made": made, "made_in": old, "code": 0,
                "at": record.get("at")}

    # -- running -------------------------------------------------------------------------
    def start(self) -> List[int]:
        """Start the command; the pipes' fds for the agent's selector."""
        env = dict(os.environ)
        env.update(self.env)
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", self.command], cwd=self.tree, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.fds = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.deadline = time.monotonic() + self.timeout
        return list(self.fds)

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def keep(self, data: bytes) -> None:
        """The last lines, to quote in the failure."""
        text = data.decode("utf-8", "replace")
        self.tail = (self.tail + text.splitlines())[-TAIL_LINES:]

    def kill(self) -> None:
        """The whole process group: the timeout, or the launcher gone (the leash)."""
        if self.proc is not None and self.status is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def expire(self) -> None:
        self.timed_out = True
        self.deadline = None
        self.kill()

    @property
    def ended(self) -> bool:
        return self.status is not None and not self.fds

    def result(self) -> Dict[str, Any]:
        """SETUP_DONE once the process was reaped and its pipes are closed; on success
        the record is written first."""
        status = self.status if self.status is not None else 0
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        done: Dict[str, Any] = {"skipped": False, "code": code, "signal": sig,
                                "timed_out": self.timed_out, "tail": self.tail,
                                "seconds": round(time.monotonic() - self.started, 3)}
        if code == 0 and not self.timed_out:
            made = sorted(n for n in os.listdir(self.tree) if n not in self.top)
            done["made"] = made
            try:
                write_record(self.root, {"key": self.key, "tree": self.tree, "made": made,
                                         "command": self.command, "at": time.time()})
            except OSError as exc:
                done["record_error"] = exc.strerror or str(exc)
        return done


def read_record(root: str) -> Optional[Dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(root, RECORD), encoding="utf-8") as f:
            record = json.load(f)
        if isinstance(record, dict):
            return record
    return None


def write_record(root: str, record: Dict[str, Any]) -> None:
    path = os.path.join(root, RECORD)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)
