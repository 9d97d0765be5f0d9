"""Whether a folder the launcher writes to can be changed under it by another user.

``--log-dir`` names a folder the launcher creates files in. If another user can write
any folder on the way to it, they can swap a component for a symlink to a place of
theirs between the check and the write (``O_NOFOLLOW`` covers only the last name), so
such a path is refused, as OpenSSH's StrictModes refuses a key file under a folder
others can write. A path is trusted when every folder of its real path, from ``/``
down, is owned by root or this user and writable by nobody else, except a sticky
folder such as ``/tmp``, where other users cannot rename or remove the names this user
or root owns (so the next component must be this user's or root's, or made by the
launcher now).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

from ..agent.registry import owner


def untrusted(path: str) -> Optional[str]:
    """Why another user could change ``path`` (or the folders above it) under the
    launcher, or None when nobody but this user and root can."""
    me = os.getuid()
    given = Path(os.path.abspath(path))
    for link in [*given.parents][::-1] + [given]:  # a link another user can repoint
        try:
            st = link.lstat()
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            return f"{link} is a symbolic link owned by {owner(st.st_uid)}"
    real = Path(os.path.realpath(path))
    parts = [real, *real.parents][::-1]  # "/" first
    for folder, below in zip(parts, [*parts[1:], None]):
        try:
            st = folder.lstat()
        except FileNotFoundError:
            return None  # the rest is made by the launcher, inside a trusted folder
        if st.st_uid not in (0, me):
            return f"{folder} is owned by {owner(st.st_uid)}"
        if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            continue
        if not st.st_mode & stat.S_ISVTX:
            return (f"{folder} can be written by other users "
                    f"(mode {stat.S_IMODE(st.st_mode):o})")
        if below is None:
            return (f"{folder} is shared (mode {stat.S_IMODE(st.st_mode):o}): use a folder "
                    "of yours in it")
        try:  # in a sticky folder only the name's owner (or root) can rename it
            if below.lstat().st_uid not in (0, me):
                return (f"{below} is owned by {owner(below.lstat().st_uid)}, in a folder "
                        "every user can write")
        except FileNotFoundError:
            return None
    return None
