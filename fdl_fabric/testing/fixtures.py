"""The labs as pytest fixtures, like ``fabric.testing.fixtures``.

Load them with ``pytest_plugins = ["fdl_fabric.testing.fixtures"]`` in a conftest. Each
fixture is a factory: every lab it made is stopped at teardown, whether the test passed
or not.

A lab that cannot run here skips its tests with the reason, except where that would hide
them: the sshd lab always fails (it is the heart of the suite), and under CI (``CI`` set)
every lab fails, because CI installs what they need and a silently skipped suite looks
green while testing nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import pytest

from .netns import NetnsLab, netns_available
from .slurm import SlurmLab, slurm_missing
from .sshd import SshdLab, sshd_available

Lab = TypeVar("Lab", SshdLab, NetnsLab, SlurmLab)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``lab`` and ``slurm`` markers for projects that load this plugin."""
    config.addinivalue_line("markers", "lab: needs real OpenSSH sshd hosts (the sshd lab)")
    config.addinivalue_line("markers", "slurm: needs a real local Slurm cluster")


def _unavailable(reason: Optional[str], *, always_fail: bool = False) -> None:
    """Skip (or, under CI or when ``always_fail``, fail) the calling test for ``reason``."""
    if reason is None:
        return
    if always_fail or os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def _labs(new: Callable[..., Lab], tmp_path: Path, prefix: str) -> Iterator[Callable[..., Lab]]:
    """The factory a lab fixture yields; stops every lab it made, newest first."""
    labs: list[Lab] = []

    def factory(*args: Any, **kwargs: Any) -> Lab:
        lab = new(tmp_path / f"{prefix}{len(labs)}", *args, **kwargs)
        labs.append(lab)
        lab.start()
        return lab

    try:
        yield factory
    finally:
        for lab in reversed(labs):
            lab.stop()


@pytest.fixture
def sshd_lab(tmp_path: Path) -> Iterator[Callable[..., SshdLab]]:
    """Factory fixture: ``sshd_lab(n_hosts=2, **kwargs)`` returns a started SshdLab."""
    _unavailable(None if sshd_available() else
                 "the sshd lab needs OpenSSH's sshd and ssh-keygen, which were not found: "
                 "install openssh-server (e.g. `apt-get install openssh-server`)",
                 always_fail=True)
    yield from _labs(SshdLab, tmp_path, "lab")


@pytest.fixture
def netns_lab(tmp_path: Path) -> Iterator[Callable[..., NetnsLab]]:
    """Factory fixture: ``netns_lab(n_hosts=1, **kwargs)`` returns a started NetnsLab.

    Network namespaces need root; every namespace made is deleted at teardown.
    """
    _unavailable(netns_available())
    yield from _labs(NetnsLab, tmp_path, "netns")


def require_slurm() -> None:
    """Skip the calling test (fail it under CI) when Slurm or munge is not installed."""
    _unavailable(slurm_missing())


@pytest.fixture
def slurm_lab(tmp_path: Path) -> Iterator[Callable[..., SlurmLab]]:
    """Factory fixture: ``slurm_lab(n_nodes=3, **kwargs)`` returns a started SlurmLab."""
    require_slurm()
    yield from _labs(SlurmLab, tmp_path, "slurm")
