"""``<log-dir>/latest``: a link to the newest run's folder, as SkyPilot's and Ray's logs have.

A ``--log-dir`` holds one folder per run, named by run id (`runlog.RunLog`); the id is
not something a person remembers, so each launch points ``latest`` at its own folder.
The link's target is the run id alone, relative: it stays inside the log folder
wherever that is moved or mounted, and nothing here ever writes through it. It is made
under a temporary name and renamed over the old one (`os.replace`), so a reader sees
the old run or the new one, never no link; two launches at once leave the later one's.
A ``latest`` that is not a link (someone's folder or file) is left alone, and said.

Without ``--log-dir`` a run keeps no folder (the root cause quotes the failed rank's
last lines from memory and says how to keep everything): tests and scripts launch many
runs, a shared machine's disk is not ours to fill, and rank output may hold secrets that
a person should choose to keep.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

LATEST = "latest"


@dataclass(frozen=True)
class RunFolder:
    """Where a run's logs are, and its ``latest`` link (or why there is none)."""

    run_id: str
    folder: str
    latest: Optional[str]
    latest_error: Optional[str] = None

    def data(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "folder": self.folder, "latest": self.latest,
                "latest_error": self.latest_error}


def point_latest(root: str, run_id: str) -> RunFolder:
    """``<root>/latest`` -> ``run_id``, replaced atomically; never raises."""
    folder = Path(root) / run_id
    link = Path(root) / LATEST
    if not run_id or os.sep in run_id or run_id in (".", "..", LATEST):
        return RunFolder(run_id, str(folder), None, f"run id {run_id!r} is no folder name")
    if os.path.lexists(link) and not link.is_symlink():
        return RunFolder(run_id, str(folder), None, f"{link} is not a link: left alone")
    temporary = Path(root) / f".{LATEST}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.symlink(run_id, temporary)
        os.replace(temporary, link)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return RunFolder(run_id, str(folder), None, exc.strerror or str(exc))
    return RunFolder(run_id, str(folder), str(link))
