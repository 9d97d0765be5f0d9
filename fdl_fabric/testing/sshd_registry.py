"""Private run registries: each lab host's sshd sees a registry folder of its own.

Why a module of its own: fdl-fabric's rank wrappers record runs in one fixed folder per
machine, but all lab hosts share this machine.  With ``private_registry=True`` every
host's sshd runs in a mount namespace where that folder is a bind mount of a folder of
the lab, as if each host were a separate machine; this module holds the mount point,
the check that it is safe to mount over, and the shell snippet that does the mount.
"""

from __future__ import annotations

import contextlib
import os

from ..agent.registry import tmp_dir
from .processes import LabError

#: The run registry that fdl-fabric's rank wrappers write on every host (see
#: ``fdl_fabric.commands.REGISTRY_DIR``).  With ``private_registry=True`` each lab host's
#: sshd runs in its own mount namespace where this folder is a bind mount of a folder of
#: the lab, so every host has a registry of its own, as on a real cluster, and cleanup
#: tests never touch the records of ranks that other test runs keep in the real one.
REGISTRY_MOUNTPOINT = tmp_dir()


#: Run inside the listener's new mount namespace: bind the host's private registry over
#: REGISTRY_MOUNTPOINT, then become sshd (same pid all the way: unshare and sh exec).
_BIND_REGISTRY = 'mount --bind -- "$1" "$2" || exit 97; shift 2; exec "$@"'


def _ensure_registry_mountpoint() -> None:
    """Make sure REGISTRY_MOUNTPOINT exists as a real folder, so hosts can mount over it.

    It is created exactly as a rank wrapper would create it (mode 0700, owned by us).
    """
    if os.geteuid() != 0:
        raise LabError("private_registry needs root (a mount namespace per lab host)")
    path = REGISTRY_MOUNTPOINT
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if os.path.islink(path) or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
        raise LabError(f"{path} is not a folder owned by this user; refusing to mount over it")
