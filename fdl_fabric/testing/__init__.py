"""Labs for testing against the real parts: sshd hosts, network namespaces, Slurm.

Why real parts rather than stubs, and what each lab needs, is in its module's docstring.
In short (also meant for users' own tests, like ``fabric.testing``)::

    with SshdLab(tmp_path, n_hosts=2) as lab:
        path = lab.write_cluster([lab.worker(h) for h in lab.hosts])

or, in pytest, with ``pytest_plugins = ["fdl_fabric.testing.fixtures"]`` in a conftest::

    def test_something(sshd_lab):
        lab = sshd_lab(n_hosts=3)

The package: `sshd` (`SshdLab`, `LabHost`; its parts are the `sshd_*` modules: `tools`,
`config`, `login`, `registry`, `process`, `host`, `lab`), `netns` (`NetnsLab`), `slurm`
(`SlurmLab`),
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
