"""An ssh_config's commands against real sshd lab hosts (issue 34, items 3 and 8).

A ProxyCommand that a cluster file's ssh_config names is refused until the operator
allows it; allowed (``--trust-ssh-config``), it really carries prebuild-check and a
launch: ``ssh -W`` through one lab host to another, the proxy leaving a line in a log
each time it starts. And ``fab -S FILE cleanup`` records a new host key where that
ssh_config's ``UserKnownHostsFile`` says, not in ``~/.ssh/known_hosts``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from fdl_fabric.testing import SshdLab
from labutil import PROBE, ROOT

pytestmark = pytest.mark.lab

INV = (sys.executable, "-m", "invoke", "--search-root", str(ROOT))


def _through_a_proxy(lab: SshdLab, folder: Path) -> tuple[Path, Path]:
    """A cluster file whose one worker, ``target`` (the lab's second host), is reached by
    a ProxyCommand of its ssh_config: ``ssh -W`` through the lab's first host. Returns
    the cluster file and the proxy's log (a line per start)."""
    via, dest = lab.hosts
    lab_config = lab.write_ssh_config(folder / "lab_ssh_config")  # node1, node2
    log = folder / "proxy.log"
    config = folder / "ssh_config"
    config.write_text(
        f"Host target\n  HostName {dest.addr}\n  Port {dest.port}\n  User {lab.user}\n"
        f"  IdentityFile {lab.identity_file}\n  UserKnownHostsFile {lab.known_hosts}\n"
        f"  ProxyCommand sh -c 'echo \"$0:$1\" >> {log}; exec ssh -F {lab_config} "
        f"-o BatchMode=yes -o LogLevel=ERROR -W \"$0:$1\" node1' %h %p\n")
    cluster = lab.write_cluster([{"host": "target", "nproc": 1, "path": dest.path,
                                  "ssh": {"config_file": str(config)}}])
    cluster.chmod(0o600)
    return cluster, log


def _inv(*words: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INV, *words], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_proxycommand_runs_only_when_allowed_and_then_carries_the_check_and_the_launch(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster, log = _through_a_proxy(lab, tmp_path)
    dest = lab.hosts[1]

    for command in ("prebuild-check", "launch"):
        refused = _inv(command, "-c", str(cluster), "--cmd", f"python3 {PROBE}")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert ":7: ProxyCommand runs a command; a cluster file's ssh_config may not run " \
               "commands unless you allow it" in refused.stdout + refused.stderr
    assert not log.exists(), "refused, and the proxy never started"

    check = _inv("prebuild-check", "-c", str(cluster), "--fast", "--json",
                 "--trust-ssh-config", "--", "python3", PROBE)
    assert check.returncode == 0, check.stdout + check.stderr
    rows = {row["check"]: row for row in json.loads(check.stdout)["checks"]
            if row["host"] == "target"}
    assert rows["ssh"]["status"] == "ok", rows
    proxied = log.read_text().splitlines()
    assert proxied and set(proxied) == {f"{dest.addr}:{dest.port}"}, proxied

    dump = tmp_path / "dump"
    run = _inv("launch", "-c", str(cluster), "--trust-ssh-config", "--cmd",
               f"python3 {PROBE} --dump {dump}")
    assert run.returncode == 0, run.stderr
    assert json.loads((dump / "env-r0.json").read_text())["env"]["RANK"] == "0"
    assert len(log.read_text().splitlines()) > len(proxied), "the launch went through it"


def test_fab_with_an_ssh_config_records_a_new_host_key_where_that_config_says(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    (host,) = lab.hosts
    known = tmp_path / "keys" / "known_hosts"
    config = tmp_path / "fab_ssh_config"
    config.write_text(f"Host node1\n  HostName {host.addr}\n  Port {host.port}\n"
                      f"  User {lab.user}\n  IdentityFile {lab.identity_file}\n"
                      f"  UserKnownHostsFile {known}\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "SSH_AUTH_SOCK": ""}
    # A run id no run has: the sweep touches nothing, and still connects.
    out = subprocess.run([sys.executable, "-m", "fabric", "-S", str(config), "-H", "node1",
                          "cleanup", "--run-id", f"r-none-{secrets.token_hex(4)}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing to stop" in out.stderr
    assert host.host_key_pub.split()[1] in known.read_text()
    assert not (home / ".ssh" / "known_hosts").exists(), "fab -S wrote ~/.ssh/known_hosts"
