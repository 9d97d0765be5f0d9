"""The loopback warning on the real thing: ``--hosts`` of ssh_config aliases whose
HostName is a loopback address of this machine (the sshd lab) warns nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from labutil import INV_LAUNCH, ROOT

pytestmark = pytest.mark.lab


def test_hosts_that_are_aliases_of_this_machine_raise_no_loopback_warning(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    config = lab.write_ssh_config(tmp_path / "ssh_config")
    out = subprocess.run([*INV_LAUNCH, "--hosts", "node[1-2]", "--ssh-config", str(config),
                          "--cmd", "true"], cwd=ROOT, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    assert "loopback" not in out.stderr and "controller.host" not in out.stderr, out.stderr
    assert out.stderr.splitlines()[-1] == ("cluster launcher: run completed — all 2 ranks "
                                           "exited 0")
