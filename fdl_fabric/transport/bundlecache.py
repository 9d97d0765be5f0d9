"""The controller's private cache of built agent payloads (`bundle.payload`), by content.

Building the payload compiles every shipped module and compresses the lot: about 100 ms
of CPU at every launcher start, on the critical path of a small launch (issue 35,
``bench/profile.py --mode wall``: the first agent start waited on it). The payload
depends only on the shipped sources, the loader and this Python, so it is kept under the
sha256 of those (`bundle.payload` computes it) and read back in a few milliseconds while
they are unchanged.

Trust: what is kept here runs on every host. The folder is made this user's and 0700
(`agent.registry.make_private`, which refuses a foreign one); a file is used only if it
is a regular file of this user that nobody else may write, opened without following a
link; it is written whole under a temporary name, then renamed. Anything else, and the
payload is built afresh; a cache that cannot be written is simply not kept. Only the
newest `KEPT` payloads stay (each edit of an agent module makes a new one).
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Callable, Optional

from ..agent.registry import foreign, make_private

#: Payloads kept (the newest by modification time); older ones are removed.
KEPT = 4
_PREFIX = "payload-"


def cache_folder() -> str:
    """``$XDG_CACHE_HOME/fdl-fabric/agent``, else ``~/.cache/fdl-fabric/agent``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fdl-fabric", "agent")


def cached(key: str, build: Callable[[], bytes], folder: Optional[str] = None) -> bytes:
    """The payload kept under ``key``, or ``build()``'s, then kept."""
    folder = folder or cache_folder()
    path = os.path.join(folder, f"{_PREFIX}{key}.bin")
    data = _read_own(folder, path)
    if data is not None:
        return data
    data = build()
    with contextlib.suppress(OSError):  # a RegistryError (a foreign folder) is one
        make_private(folder)
        _write(path, data)
        _prune(folder)
    return data


def _read_own(folder: str, path: str) -> Optional[bytes]:
    if foreign(folder) is not None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        return fh.read()


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _prune(folder: str) -> None:
    """All but the newest `KEPT` payloads go."""
    entries = []
    with os.scandir(folder) as found:
        for entry in found:
            if entry.name.startswith(_PREFIX) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    entries.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
    for _, old in sorted(entries, reverse=True)[KEPT:]:
        with contextlib.suppress(OSError):
            os.unlink(old)


__all__ = ["KEPT", "cache_folder", "cached"]
