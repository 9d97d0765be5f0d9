"""Where this controller keeps its run records, which records there are, and pruning.

Every launch, foreground or detached, keeps a record of its run here (`record`): the
console as rendered, events.jsonl, every rank's output, the state while it runs and
``result.json`` once it ended. ``attach``, ``logs``, ``stop``, ``wait`` and ``status``
read it from any terminal of this user on this machine.

The folder follows the run registry's rules (`agent.registry`): a folder only this user
can write, never one taken first by someone else, 0700 whatever the umask:

1. ``$FDL_FABRIC_RUNS_DIR``, when set;
2. ``$XDG_STATE_HOME/fdl-fabric/runs/<host>``, else
   ``~/.local/state/fdl-fabric/runs/<host>`` (the XDG place for state that outlives a
   login, unlike ``$XDG_RUNTIME_DIR``, a tmpfs emptied at logout: a record must outlive
   the terminal that started the run). Per host name, because a home is often shared
   over NFS and only this host can tell whether its launchers live.

Pruning keeps the newest `limits.RECORDS_KEPT` ended runs within
`limits.RECORDS_BYTES_MAX` bytes; a record whose launcher is alive is never pruned.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

from ..agent.registry import RegistryError, foreign, make_private
from ..limits import RECORDS_BYTES_MAX, RECORDS_KEPT
from .record import RESULT

#: The user's choice of records folder.
ENV_RUNS_DIR = "FDL_FABRIC_RUNS_DIR"
#: A run id as `planning.envelope.new_run_id` makes them (and nothing that could climb out
#: of the folder).
RUN_ID_RE = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{8}")


def runs_path() -> Path:
    """Where this user's records folder is (neither made nor checked here)."""
    override = os.environ.get(ENV_RUNS_DIR, "")
    if override:
        return Path(os.path.abspath(os.path.expanduser(override)))
    state = os.environ.get("XDG_STATE_HOME", "")
    base = state if os.path.isabs(state) else os.path.join(
        os.path.expanduser("~"), ".local", "state")
    host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())
    return Path(base, "fdl-fabric", "runs", host or "localhost")


def runs_root(*, create: bool = True) -> Path:
    """This user's records folder, made private (0700) when ``create``. A folder that is
    not this user's is refused (`RegistryError`, an OSError), naming its owner."""
    path = str(runs_path())
    if create:
        make_private(path)
    else:
        why = foreign(path)
        if why is not None:
            raise RegistryError(f"{path} {why}; set {ENV_RUNS_DIR} to a folder of yours")
    return Path(path)


def record_folder(run_id: str, root: Optional[Path] = None) -> Path:
    """The folder of one run's record (the run id is checked: it names a folder)."""
    if not RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"{run_id!r} is not a run id (such as 20261204-213000-1a2b3c4d)")
    return (root or runs_root()) / run_id


def records(root: Optional[Path] = None) -> list[Path]:
    """Every record folder, oldest first (run ids sort by start time)."""
    try:
        base = root or runs_root(create=False)
        names = sorted(p.name for p in base.iterdir() if RUN_ID_RE.fullmatch(p.name))
    except OSError:
        return []
    return [base / n for n in names if (base / n).is_dir() and not (base / n).is_symlink()]


def find(spec: Optional[str], root: Optional[Path] = None) -> Path:
    """The record ``spec`` names: a run id, the unique start of one, or None/``latest``
    for the newest. Raises LookupError with what there is instead."""
    found = records(root)
    if not found:
        raise LookupError(f"no run recorded in {root or runs_root(create=False)} yet")
    if spec in (None, "", "latest"):
        return found[-1]
    assert spec is not None
    matches = [p for p in found if p.name.startswith(spec)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise LookupError(f"no run {spec!r} on this machine (newest: {found[-1].name}; "
                          "fdl-fabric status --all lists them)")
    named = ", ".join(p.name for p in matches[:4]) + (", ..." if len(matches) > 4 else "")
    raise LookupError(f"{spec!r} names {len(matches)} runs ({named}): give more of the run id")


def size_of(folder: Path) -> int:
    """Bytes under ``folder`` (links not followed); what cannot be read counts as 0."""
    total = 0
    for base, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(base, name)).st_size
    return total


#: An ended record's size in bytes, kept in it once measured (`record_size`).
SIZE_FILE = ".bytes"


def record_size(folder: Path) -> int:
    """The bytes of an ended record: measured once, then kept in it. Its result written,
    a record no longer changes, and walking the files of every kept record at every
    launch took a second before the first connect with a few runs of 8,192 ranks kept
    (issue 35, `bench/profile.py --mode wall`). A record without a result (its launcher
    died) is measured each time: it may still be the one being written."""
    kept = folder / SIZE_FILE
    with contextlib.suppress(OSError, ValueError):
        return int(kept.read_text(encoding="ascii"))
    size = size_of(folder)
    if (folder / RESULT).is_file():
        with contextlib.suppress(OSError):
            fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(str(size))
    return size


#: The prefix a pruned record's folder is renamed to before its files are removed: no
#: run id, so no reader lists it; a removal cut short is finished by the next prune.
PRUNED_PREFIX = ".pruned-"


def prune(is_live: Callable[[Path], bool], *, keep: int = RECORDS_KEPT,
          max_bytes: int = RECORDS_BYTES_MAX, root: Optional[Path] = None,
          spare: Iterable[str] = (), background: bool = False) -> list[str]:
    """Remove the oldest ended records beyond ``keep`` runs or ``max_bytes`` bytes in all.
    A live record (``is_live``) and the runs in ``spare`` are never removed, nor counted
    against the others. Returns the run ids removed; never raises.

    A record leaves the listing at once, by one rename; its files are removed then, or,
    with ``background``, by a daemon thread. A launch prunes before its first connect,
    and removing the 16,000 files of one kept run of 8,192 ranks took 2.3 s there
    (issue 35, `bench/profile.py --timeline`)."""
    kept = set(spare)
    ended = [p for p in records(root) if p.name not in kept and not is_live(p)]
    sizes = {p: record_size(p) for p in ended}
    total = sum(sizes.values())
    removed: list[str] = []
    for folder in ended:  # oldest first
        if len(ended) - len(removed) <= keep and total <= max_bytes:
            break
        try:
            folder.rename(folder.with_name(PRUNED_PREFIX + folder.name))
        except OSError:
            continue
        total -= sizes[folder]
        removed.append(folder.name)
    base = ended[0].parent if ended else root
    if base is None or not (removed or _pruned_in(base)):
        return removed
    if not background:
        discard_pruned(base)
    elif not _DISCARDING.locked():  # else the thread at work takes these too, or the next
        threading.Thread(target=discard_pruned, args=(base,), name="fdl-prune",
                         daemon=True).start()
    return removed


#: Held by the one thread removing pruned records' files (`discard_pruned`).
_DISCARDING = threading.Lock()


def discard_pruned(root: Path) -> None:
    """Remove the files of every pruned record under ``root``, one caller at a time (a
    second one returns at once); never raises."""
    if not _DISCARDING.acquire(blocking=False):
        return
    try:
        for path in _pruned_in(root):
            shutil.rmtree(path, ignore_errors=True)
    finally:
        _DISCARDING.release()


def _pruned_in(root: Path) -> list[str]:
    """The folders of pruned records under ``root`` whose files are still there."""
    try:
        with os.scandir(root) as entries:
            return [e.path for e in entries
                    if e.name.startswith(PRUNED_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


__all__ = ["ENV_RUNS_DIR", "PRUNED_PREFIX", "RUN_ID_RE", "SIZE_FILE", "discard_pruned", "find",
           "prune", "record_folder", "record_size", "records", "runs_path", "runs_root",
           "size_of"]
