"""What the sshd lab needs from this machine: OpenSSH's binaries, system tools, keys.

Why a module of its own: finding ``sshd`` and ``ssh-keygen`` (root's PATH often lacks the
sbin folders), telling whether a lab can run at all (``sshd_available``, which test
suites and benchmarks ask before anything else), preparing the privilege-separation
folder a root sshd insists on, and generating ed25519 keys are the lab's only contact
with the installed OpenSSH outside sshd itself.  The netns lab uses ``require_tool``
and ``SBIN_PATH`` for ``ip`` and ``unshare`` too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from .processes import LabError

#: Where Debian/Ubuntu put sshd; preferred because root's PATH may not include sbin dirs.
_SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd")


SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"


def _find_sshd() -> Optional[str]:
    """Absolute path of sshd, or None.

    sshd refuses to re-exec itself unless started with an absolute path, so a bare
    ``sshd`` from PATH is resolved here once.
    """
    for candidate in _SSHD_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("sshd") or shutil.which("sshd", path=SBIN_PATH)
    return os.path.abspath(found) if found else None


def _find_keygen() -> Optional[str]:
    return shutil.which("ssh-keygen") or shutil.which("ssh-keygen", path=SBIN_PATH)


def sshd_available() -> bool:
    """True if this machine can run a lab: an sshd binary and ssh-keygen exist."""
    return _find_sshd() is not None and _find_keygen() is not None


def require_tool(name: str) -> str:
    """Absolute path of a system tool (``ip``, ``unshare``), or LabError."""
    found = shutil.which(name) or shutil.which(name, path=SBIN_PATH)
    if found is None:
        raise LabError(f"{name} not found (needed for this lab; install iproute2/util-linux)")
    return found


def _ensure_privsep_dir() -> None:
    """Create /run/sshd, which a root sshd insists on (privilege separation chroot).

    Containers and CI images often have openssh-server installed but never booted, so
    the tmpfs directory that the init script would create is missing.  A non-root sshd
    does not chroot and does not need it.
    """
    if os.geteuid() != 0 or os.path.isdir("/run/sshd"):
        return
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    os.chmod("/run/sshd", 0o755)


def _generate_keys(keygen: str, specs: Sequence[tuple[Path, str]]) -> None:
    """Generate passphrase-less ed25519 keys (path, comment) with ssh-keygen, in parallel.

    Existing files are removed first: ssh-keygen would otherwise ask "Overwrite (y/n)?",
    read EOF from stdin and fail.
    """
    procs: list[tuple[Path, subprocess.Popen[bytes]]] = []
    for path, comment in specs:
        for stale in (path, path.with_name(path.name + ".pub")):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        argv = [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
        procs.append(
            (
                path,
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    errors = []
    for path, proc in procs:
        out, _ = proc.communicate(timeout=30)
        if proc.returncode != 0:
            errors.append(f"ssh-keygen for {path} failed ({proc.returncode}): {out.decode()}")
    if errors:
        raise LabError("\n".join(errors))
