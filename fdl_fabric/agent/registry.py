"""Where this host's run registry lives: a folder only this user can write, or none.

The registry (`procs`: one record per run and host, error files, stop notes) is what
``cleanup``, ``status`` and the agents' sweeps trust to say which processes are ours,
so its folder must be this user's and nobody else's. A fixed name in the shared
``/tmp`` can be taken first by another user (a folder, a symlink to one of theirs, a
file), and the sticky bit then keeps its rightful user from removing it. So the
folder is the first usable of these candidates:

1. ``$FDL_FABRIC_STATE_DIR``, when set: the user's choice, and then the only place
   (a foreign one is refused, naming its owner and the remedy). The launcher passes
   its own value on to every agent it starts (`transport.bundle`).
2. ``$XDG_RUNTIME_DIR/fdl-fabric``, when that runtime folder is this user's (systemd's
   per-user tmpfs: nobody else can create a name in it).
3. ``/tmp/fdl-fabric-<uid>``: the usual place, where a squat is possible.
4. ``~/.cache/fdl-fabric/<host name>``: under the user's home, so private; per host
   name because a home is often shared over NFS.

Records are written to the first usable candidate and read from every candidate that
is this user's, so a cleanup finds the runs that an earlier squat sent elsewhere.
Standard library only: this module ships in the agent bundle.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from typing import Dict, List, Optional

#: The user's choice of registry folder (also on the launcher: passed on to agents).
ENV_STATE_DIR = "FDL_FABRIC_STATE_DIR"


class RegistryError(OSError):
    """No registry folder this user can trust: the message names why and what to do.
    An OSError, so every place that copes with an unwritable registry copes with it."""


def tmp_dir() -> str:
    """The conventional folder, ``/tmp/fdl-fabric-<uid>`` (a squat can make it unusable)."""
    return f"/tmp/fdl-fabric-{os.getuid()}"


def candidates() -> List[str]:
    """Every place this user's registry may be, in order of preference."""
    override = os.environ.get(ENV_STATE_DIR, "")
    if override:
        return [os.path.abspath(os.path.expanduser(override))]
    places = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and foreign(runtime) is None and os.path.isdir(runtime):
        places.append(os.path.join(runtime, "fdl-fabric"))
    places.append(tmp_dir())
    host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())
    places.append(os.path.join(os.path.expanduser("~"), ".cache", "fdl-fabric",
                               host or "localhost"))
    return places


def owner(uid: int) -> str:
    """``uid 1001 (mallory)``: who owns a path, by number and, when known, by name."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def foreign(path: str) -> Optional[str]:
    """Why ``path`` cannot be this user's folder (a symlink, not a folder, another
    owner), or None when it is one or does not exist. Never follows a link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"is a symbolic link (to {target}) owned by {owner(st.st_uid)}"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a folder (a file owned by {owner(st.st_uid)})"
    if st.st_uid != os.getuid():
        return f"is a folder owned by {owner(st.st_uid)}, not by this user"
    return None


def make_private(path: str) -> None:
    """Create ``path`` (and what is missing above it) as 0700 folders of this user, or
    tighten an existing one to 0700; refuses (`RegistryError`) a foreign one."""
    missing = []
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        missing.append(probe)
        probe = os.path.dirname(probe)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile; checked below
            os.mkdir(folder, 0o700)
    why = foreign(path)
    if why is not None:
        raise RegistryError(f"{path} {why}")
    for folder in [path, *missing]:
        if stat.S_IMODE(os.lstat(folder).st_mode) != 0o700:
            os.chmod(folder, 0o700)


class _Choice:
    """The folder this process writes to, chosen once, and the note about a fallback."""

    folder: Optional[str] = None
    note: Optional[str] = None
    note_taken = False
    #: Folders a write failed in (a full disk, a read-only mount): skipped from then on.
    failed: Dict[str, str] = {}


#: Bytes written (and removed) to prove a folder takes a record: a full disk often still
#: lets a folder or an empty file be made.
PROBE_BYTES = 4096


def cannot_write(path: str) -> Optional[str]:
    """Why a record cannot be written in ``path`` (a full disk, a read-only mount), or
    None when a small file could be written and removed there."""
    probe = os.path.join(path, f".probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as exc:
        return f"{path}: cannot write there ({exc.strerror or exc})"
    return None


def write_failed(path: str, exc: OSError) -> None:
    """A write in ``path`` failed: the next `writable_dir` falls back past it."""
    _Choice.failed[path] = f"{path}: cannot write there ({exc.strerror or exc})"
    if _Choice.folder == path:
        _Choice.folder = None


def writable_dir() -> str:
    """The folder this process writes records to: the first usable candidate, made
    0700, that a record can be written in. A skipped candidate is noted once
    (`take_note`); none usable is refused."""
    if _Choice.folder is not None and foreign(_Choice.folder) is None \
            and os.path.isdir(_Choice.folder):
        return _Choice.folder
    skipped: List[str] = []
    for path in candidates():
        try:
            make_private(path)
        except (RegistryError, OSError) as exc:
            skipped.append(str(exc) if isinstance(exc, RegistryError)
                           else f"{path}: {exc.strerror or exc}")
            continue
        why = _Choice.failed.get(path) or cannot_write(path)
        if why is not None:
            skipped.append(why)
            continue
        if skipped:
            _Choice.note = (f"run registry moved to {path}: {'; '.join(skipped)} (only its "
                            "owner or root can remove it)")
        _Choice.folder = path
        return path
    raise RegistryError(refusal(skipped))


def refusal(skipped: List[str]) -> str:
    """The sentence for a host with no usable registry folder: what is wrong, the fix."""
    return (f"no private folder for the run registry: {'; '.join(skipped)}; set "
            f"{ENV_STATE_DIR} to a folder of yours, or ask root to remove the one above")


def take_note() -> Optional[str]:
    """The fallback note, the first time it is asked for (said once per process)."""
    if _Choice.note is None or _Choice.note_taken:
        return None
    _Choice.note_taken = True
    return _Choice.note


def readable_dirs() -> List[str]:
    """Every candidate that exists and is this user's folder: where records may be.
    With an override that is foreign, `RegistryError` (nothing else is trusted then)."""
    places = candidates()
    if os.environ.get(ENV_STATE_DIR):
        why = foreign(places[0])
        if why is not None:
            raise RegistryError(refusal([f"{places[0]} {why}"]))
    return [p for p in places if foreign(p) is None and os.path.isdir(p)]
