"""``--on-exit CMD`` (``on_exit:`` in cluster.yml): one command when a run ends.

How users get a mail, a Slack message or a webhook when a run they walked away from
ends. It runs once, with ``sh -c``, in the launch's folder, with the run's outcome in
its environment (`hook_env`), before the verdict line is written, so the verdict stays
the last line. It is bounded (`limits.ON_EXIT_SECONDS`; TERM to its process group, then
KILL) and what it prints goes to the record's ``on_exit.log``; its failure is reported
but never changes the run's verdict or exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..limits import ON_EXIT_SECONDS
from ..presentation.rotating import open_private

#: Seconds between the TERM and the KILL of a hook past its bound.
KILL_AFTER = 5.0
#: The hook's bound in seconds, when not `limits.ON_EXIT_SECONDS`.
ENV_TIMEOUT = "FDL_FABRIC_ON_EXIT_TIMEOUT"


@dataclass(frozen=True)
class HookOutcome:
    exit_code: Optional[int]
    seconds: float
    timed_out: bool = False
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def hook_env(run_id: str, verdict: str, exit_code: int, run_dir: Optional[Path]
             ) -> dict[str, str]:
    """What the hook is told, on top of the launcher's environment."""
    return {"FDL_FABRIC_RUN_ID": run_id, "FDL_FABRIC_VERDICT": verdict,
            "FDL_FABRIC_EXIT_CODE": str(exit_code),
            "FDL_FABRIC_RUN_DIR": str(run_dir) if run_dir is not None else ""}


def run_hook(command: str, env: dict[str, str], log: Optional[Path], *,
             timeout: Optional[float] = None) -> HookOutcome:
    """Run ``command`` with ``sh -c`` to its end or its bound (`limits.ON_EXIT_SECONDS`,
    or ``$FDL_FABRIC_ON_EXIT_TIMEOUT`` seconds); never raises."""
    if timeout is None:
        timeout = bound()
    started = time.monotonic()
    out = open_private(log) if log is not None else os.open(os.devnull, os.O_WRONLY)
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out, env={**os.environ, **env},
                                start_new_session=True)
    except OSError as exc:
        return HookOutcome(None, 0.0, error=exc.strerror or str(exc))
    finally:
        os.close(out)
    try:
        code = proc.wait(timeout)
        return HookOutcome(code, time.monotonic() - started)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(KILL_AFTER)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(KILL_AFTER)
        return HookOutcome(proc.returncode, time.monotonic() - started, timed_out=True)


def bound() -> float:
    """The hook's bound: `limits.ON_EXIT_SECONDS`, or ``$FDL_FABRIC_ON_EXIT_TIMEOUT`` (a
    number of seconds > 0) for a hook that needs longer, or a test that needs shorter."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        value = float(raw) if raw else ON_EXIT_SECONDS
    except ValueError:
        return ON_EXIT_SECONDS
    return value if 0 < value < float("inf") else ON_EXIT_SECONDS


def _signal_group(pid: int, sig: int) -> None:
    """The hook's own process group (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


__all__ = ["ENV_TIMEOUT", "HookOutcome", "bound", "hook_env", "run_hook"]
