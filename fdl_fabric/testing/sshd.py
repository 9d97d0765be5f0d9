"""The sshd lab: real OpenSSH servers on loopback addresses, one per simulated host.

Why real sshd rather than a paramiko stub server: the launcher's hard problems (host keys,
``accept-new``, session limits, remote forwards, what dies when a connection drops) are
properties of OpenSSH itself, and a stub would happily agree with whatever bug we write.
Every lab host is therefore a genuine ``sshd -D`` listening on its own 127.x.y.z address
(Linux routes all of 127.0.0.0/8 to ``lo``), so "host" identity in logs,
``SSH_CONNECTION`` and known_hosts entries is distinct per host, exactly as on a cluster.

The lab is Linux-only (other systems only answer on 127.0.0.1) and needs ``sshd`` and
``ssh-keygen`` (Debian/Ubuntu package ``openssh-server``).  Sessions log in as the user
running the lab; our CI runs as root (``PermitRootLogin prohibit-password``).  A non-root
user makes sshd run unprivileged, which OpenSSH supports for logging in that same user,
but that mode is not exercised by our CI.  Because the lab uses ``UsePAM no``, sshd
itself refuses accounts whose shadow password field is locked (``!``, which ``useradd``
leaves by default) even for key logins: give such users ``*`` instead.

This module is the lab's front door and re-exports the names of the modules that
implement it, one concern each:

* ``sshd_tools``: finding sshd, ssh-keygen and system tools; generating keys;
* ``sshd_config``: one host's sshd_config and the settings a lab's hosts share;
* ``sshd_login``: what a session's login shell runs (``login_shell_rc``, pyenv's lock);
* ``sshd_registry``: a private run registry per host (``private_registry=True``);
* ``sshd_process``: spawning listeners, waiting until they answer, stopping them;
* ``sshd_host``: ``LabHost``, one host;
* ``sshd_lab``: ``SshdLab``, the hosts of one lab together and their clients.
"""

from __future__ import annotations

from .sshd_config import MARKER_ENV as MARKER_ENV
from .sshd_config import _render_sshd_config as _render_sshd_config
from .sshd_config import _sshd_version as _sshd_version
from .sshd_config import _SshdSettings as _SshdSettings
from .sshd_host import _UNAUTHENTICATED_TITLES as _UNAUTHENTICATED_TITLES
from .sshd_host import LabHost as LabHost
from .sshd_lab import SshdLab as SshdLab
from .sshd_lab import _pick_addresses as _pick_addresses
from .sshd_login import _clear_stale_pyenv_lock as _clear_stale_pyenv_lock
from .sshd_login import _write_login_rc as _write_login_rc
from .sshd_process import _marked_processes as _marked_processes
from .sshd_process import _probe_children as _probe_children
from .sshd_process import _read_banner as _read_banner
from .sshd_process import _spawn_sshd as _spawn_sshd
from .sshd_process import _stop_hosts as _stop_hosts
from .sshd_process import _wait_ready as _wait_ready
from .sshd_registry import _BIND_REGISTRY as _BIND_REGISTRY
from .sshd_registry import REGISTRY_MOUNTPOINT as REGISTRY_MOUNTPOINT
from .sshd_registry import _ensure_registry_mountpoint as _ensure_registry_mountpoint
from .sshd_tools import _SSHD_CANDIDATES as _SSHD_CANDIDATES
from .sshd_tools import SBIN_PATH as SBIN_PATH
from .sshd_tools import _ensure_privsep_dir as _ensure_privsep_dir
from .sshd_tools import _find_keygen as _find_keygen
from .sshd_tools import _find_sshd as _find_sshd
from .sshd_tools import _generate_keys as _generate_keys
from .sshd_tools import require_tool as require_tool
from .sshd_tools import sshd_available as sshd_available

__all__ = [
    "MARKER_ENV",
    "REGISTRY_MOUNTPOINT",
    "SBIN_PATH",
    "LabHost",
    "SshdLab",
    "require_tool",
    "sshd_available",
]
