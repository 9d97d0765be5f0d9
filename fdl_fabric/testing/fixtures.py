"""The labs as pytest fixtures, like ``fabric.testing.fixtures``.

Load them with ``pytest_plugins = ["fdl_fabric.testing.fixtures"]`` in a conftest. Each
fixture is a factory: every lab it made is stopped at teardown, whether the test passed
or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from .netns import NetnsLab, netns_available
from .slurm import SlurmLab, slurm_missing
from .sshd import SshdLab, sshd_available


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``lab`` and ``slurm`` markers for projects that load this plugin."""
    config.addinivalue_line("markers", "lab: needs real OpenSSH sshd hosts (the sshd lab)")
    config.addinivalue_line("markers", "slurm: needs a real local Slurm cluster")

@pytest.fixture
def sshd_lab(tmp_path: Path) -> Iterator[Callable[..., SshdLab]]:
    """Factory fixture: ``sshd_lab(n_hosts=2, **kwargs)`` returns a started SshdLab.

    Every lab made by the factory is stopped at teardown.  A machine without sshd
    makes the test fail, not skip: a silently skipped lab suite looks green in CI
    while testing nothing (CI installs openssh-server).
    """
    if not sshd_available():
        pytest.fail(
            "the sshd lab needs OpenSSH's sshd and ssh-keygen, which were not found: "
            "install openssh-server (e.g. `apt-get install openssh-server`)",
            pytrace=False,
        )
    labs: list[SshdLab] = []

    def factory(n_hosts: int = 2, **kwargs: Any) -> SshdLab:
        lab = SshdLab(tmp_path / f"lab{len(labs)}", n_hosts, **kwargs)
        labs.append(lab)
        return lab.start()

    try:
        yield factory
    finally:
        for lab in reversed(labs):
            lab.stop()

@pytest.fixture
def netns_lab(tmp_path: Path) -> Iterator[Callable[..., NetnsLab]]:
    """Factory fixture: ``netns_lab(n_hosts=1, **kwargs)`` returns a started NetnsLab.

    Skips (with the reason) where network namespaces cannot be made, i.e. when not
    root; CI runs as root, so there it always runs.  Every namespace the factory made
    is deleted at teardown, whether the test passed or not.
    """
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    labs: list[NetnsLab] = []

    def factory(n_hosts: int = 1, **kwargs: Any) -> NetnsLab:
        lab = NetnsLab(tmp_path / f"netns{len(labs)}", n_hosts, **kwargs)
        labs.append(lab)
        return lab.start()  # type: ignore[return-value]

    try:
        yield factory
    finally:
        for lab in reversed(labs):
            lab.stop()


def require_slurm() -> None:
    """Skip the calling test (with the reason) when Slurm or munge is not installed."""
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)

@pytest.fixture
def slurm_lab(tmp_path: Path) -> Iterator[Callable[..., SlurmLab]]:
    """Factory fixture: ``slurm_lab(n_nodes=3, **kwargs)`` returns a started SlurmLab.

    Skips with the reason when Slurm's daemons or munge are missing (CI installs them,
    so there it runs).  Every lab made by the factory is stopped at teardown.
    """
    require_slurm()
    labs: list[SlurmLab] = []

    def factory(n_nodes: int = 3, **kwargs: Any) -> SlurmLab:
        lab = SlurmLab(tmp_path / f"slurm{len(labs)}", n_nodes, **kwargs)
        labs.append(lab)
        return lab.start()

    try:
        yield factory
    finally:
        for lab in reversed(labs):
            lab.stop()
