"""A real terminal for tests: bash in a tmux pane, on a tmux server of its own.

Each `Pane` starts its own tmux server (its own socket), so tests that run at once never
share a session name or a server, and closing one kills exactly what it started
(``kill-server`` on its socket: SIGHUP to every process of its panes, as a closed
terminal window or a dropped SSH login does).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional

from .launches import wait_for

PROMPT = "pane$"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout


class Pane:
    """bash in a ``width`` x ``height`` tmux pane in ``folder``, with ``env`` added."""

    def __init__(self, folder: Path, *, width: int = 100, height: int = 50,
                 env: Optional[Mapping[str, str]] = None, name: str = "main",
                 prompt: str = PROMPT) -> None:
        if not shutil.which("tmux"):
            raise RuntimeError("tmux is needed (scripts/bootstrap.sh --test installs it)")
        self.folder = folder
        self.name = name
        self.socket = f"fdl-pane-{uuid.uuid4().hex[:8]}"
        assigned = [f"{k}={v}" for k, v in (env or {}).items()]
        # No COLUMNS or LINES from the test's environment: the pane's size is the truth.
        self.tmux("-f", "/dev/null", "new-session", "-d", "-s", name, "-x", str(width),
                  "-y", str(height), "-c", str(folder), "env", "-u", "COLUMNS", "-u",
                  "LINES", *assigned, f"PS1={prompt} ", "bash", "--norc", "--noprofile")
        wait_for(lambda: self.lines() == [prompt], 10, "the shell's prompt")

    def tmux(self, *args: str) -> str:
        return tmux("-L", self.socket, *args)

    def type(self, argv: Sequence[str]) -> None:
        """Type a command line and Enter."""
        self.tmux("send-keys", "-t", self.name, " ".join(shlex.quote(a) for a in argv),
                  "Enter")

    def run(self, argv: Sequence[str], timeout: float = 60) -> int:
        """Type ``argv`` followed by a note of its exit status; wait for it; the status."""
        done = self.folder / f"rc-{uuid.uuid4().hex[:6]}"
        line = " ".join(shlex.quote(a) for a in argv)
        self.tmux("send-keys", "-t", self.name, f"{line}; echo $? > {done}", "Enter")
        wait_for(done.exists, timeout, f"{argv[-1]!r} to end in the pane")
        wait_for(lambda: done.read_text().strip() != "", 5, "its exit status")
        return int(done.read_text())

    def key(self, *keys: str) -> None:
        """tmux key names: ``C-c``, ``Enter``."""
        self.tmux("send-keys", "-t", self.name, *keys)

    def text(self) -> str:
        return "\n".join(self.lines())

    def lines(self, joined: bool = True) -> list[str]:
        """Every line of the pane and its scrollback, trailing blanks dropped; ``joined``:
        a line the terminal wrapped is one line (else each row is one)."""
        text = self.tmux("capture-pane", "-p", "-t", self.name, "-S", "-", "-E", "-",
                         *(["-J"] if joined else []))
        lines = [line.rstrip() for line in text.split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def close(self) -> None:
        """Kill the server: SIGHUP to every process of the pane, as a closed terminal."""
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=10)


__all__ = ["PROMPT", "Pane", "tmux"]
