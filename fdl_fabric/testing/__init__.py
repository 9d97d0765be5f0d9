"""Labs for testing against the real parts: sshd hosts, network namespaces, Slurm.

The sshd lab runs real OpenSSH servers on loopback addresses, one per simulated host.

Why real sshd rather than a paramiko stub server: the launcher's hard problems (host keys,
``accept-new``, session limits, remote forwards, what dies when a connection drops) are
properties of OpenSSH itself, and a stub would happily agree with whatever bug we write.
Every lab host is therefore a genuine ``sshd -D`` listening on its own 127.x.y.z address
(Linux routes all of 127.0.0.0/8 to ``lo``), so "host" identity in logs,
``SSH_CONNECTION`` and known_hosts entries is distinct per host, exactly as on a cluster.

Public API (also meant for users' own tests, like ``fabric.testing``)::

    with SshdLab(tmp_path, n_hosts=2) as lab:
        path = lab.write_cluster([lab.worker(h) for h in lab.hosts])

or, in pytest, with ``pytest_plugins = ["fdl_fabric.testing.fixtures"]`` in a conftest::

    def test_something(sshd_lab):
        lab = sshd_lab(n_hosts=3)

The lab is Linux-only (other systems only answer on 127.0.0.1) and needs ``sshd`` and
``ssh-keygen`` (Debian/Ubuntu package ``openssh-server``).  Sessions log in as the user
running the lab; our CI runs as root (``PermitRootLogin prohibit-password``).  A non-root
user makes sshd run unprivileged, which OpenSSH supports for logging in that same user,
but that mode is not exercised by our CI.  Because the lab uses ``UsePAM no``, sshd
itself refuses accounts whose shadow password field is locked (``!``, which ``useradd``
leaves by default) even for key logins: give such users ``*`` instead.

The package: `sshd` (`SshdLab`, `LabHost`), `netns` (`NetnsLab`), `slurm` (`SlurmLab`),
`processes` (stopping what a lab started), `launches` (running ``inv launch`` as a
process and watching it: one helper for tests and benchmarks), `fixtures` (pytest).
"""

from __future__ import annotations

import importlib.util

from .launches import (
    LiveLaunch,
    LiveProcess,
    alive,
    dumps,
    launch_argv,
    processes_of_run,
    run_launch,
    wait_for,
)
from .netns import NetnsLab, netns_available
from .processes import LabError
from .slurm import SlurmLab, SlurmLabError, slurm_missing
from .sshd import MARKER_ENV, REGISTRY_MOUNTPOINT, LabHost, SshdLab, sshd_available

# ``pytest_plugins = ["fdl_fabric.testing"]`` keeps working (it predates the fixtures
# module); without pytest installed, the labs are still importable for benchmarks.
if importlib.util.find_spec("pytest") is not None:
    from .fixtures import netns_lab, pytest_configure, slurm_lab, sshd_lab  # noqa: F401

__all__ = [
    "MARKER_ENV",
    "REGISTRY_MOUNTPOINT",
    "LabError",
    "LabHost",
    "LiveLaunch",
    "LiveProcess",
    "NetnsLab",
    "SlurmLab",
    "SlurmLabError",
    "SshdLab",
    "alive",
    "dumps",
    "launch_argv",
    "netns_available",
    "processes_of_run",
    "run_launch",
    "slurm_missing",
    "sshd_available",
    "wait_for",
]
