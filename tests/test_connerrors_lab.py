"""Errors that say what to fix, through real sshd hosts (issue 29, item 4): a host that
does not answer is one line naming it under ``status``, ``stacks`` and ``cleanup`` on a
real terminal, with no traceback and the hosts asked counted right; a refused port, a
changed host key and a refused key each get their words (`transport.connerrors`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fdl_fabric.testing.sshd import SshdLab
from labutil import ROOT

pytestmark = pytest.mark.lab

INV = [sys.executable, "-m", "invoke", "--search-root", str(ROOT)]
#: Seconds the connect (and the banner, and the login) may take: short, so a frozen
#: host is given up on quickly.
CONNECT = 2


def on_pty(argv: Sequence[str], *, timeout: float = 90) -> tuple[int, str]:
    """Run ``argv`` to its end with a pty as its terminal; its exit status and output."""
    master, slave = os.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                            env=env, start_new_session=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            out += data
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return code, out.decode("utf-8", "replace").replace("\r\n", "\n")


def _cluster(lab: SshdLab, **ssh: Any) -> Path:
    options = [*lab.ssh_options(), f"ConnectTimeout={CONNECT}"]
    return lab.write_cluster([lab.worker(h, ssh={"options": options, **ssh})
                              for h in lab.hosts])


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process ``pid`` (a lab host's own sshd) stopped, and continued afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _line_of(host: str, out: str) -> list[str]:
    return [line for line in out.splitlines() if host in line and "banner" in line]


def test_a_frozen_host_is_one_line_naming_it_under_status_stacks_and_cleanup(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=3)
    cluster = _cluster(lab)
    gone = lab.hosts[2]
    with frozen(gone.sshd.pid):
        outputs = {command: on_pty([*INV, command, "-c", str(cluster)])
                   for command in ("status", "stacks", "cleanup")}
    for command, (code, out) in outputs.items():
        assert code == 1, (command, out)
        assert "Traceback" not in out and "paramiko" not in out, (command, out)
        said = _line_of(gone.name, out)
        assert len(said) == 1, (command, out)
        assert f"no SSH banner within {CONNECT} s from {lab.user}@{gone.addr}:{gone.port}" \
            in said[0], (command, out)
        assert f"worker at {cluster}:" in said[0], (command, out)
    # the hosts that answered are counted, out of the three asked
    assert f"0 live run(s) on 2 of the 3 host(s) of {cluster}" in outputs["status"][1]
    assert "on 2 of the 3 host(s)" in outputs["stacks"][1]
    assert "lab1: nothing to stop" in outputs["cleanup"][1]


def test_a_frozen_host_under_fabs_ad_hoc_cleanup_is_one_line_and_the_others_are_swept(
        sshd_lab: Any, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    gone = lab.hosts[1]
    home = tmp_path / "home"
    home.mkdir()
    targets = ",".join(f"{lab.user}@{h.addr}:{h.port}" for h in lab.hosts)
    fab = [sys.executable, "-m", "fabric", "-H", targets, "-i", lab.identity_file,
           "-t", str(CONNECT), "cleanup"]
    saved = {k: os.environ.get(k) for k in ("HOME", "SSH_AUTH_SOCK")}
    os.environ.update({"HOME": str(home), "SSH_AUTH_SOCK": ""})
    try:
        with frozen(gone.sshd.pid):
            code, out = on_pty(fab)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert code == 1, out
    assert "Traceback" not in out, out
    said = _line_of(gone.addr, out)
    assert len(said) == 1, out
    assert f"no SSH banner within {CONNECT} s from {lab.user}@{gone.addr}:{gone.port}" \
        in said[0], out
    assert f"cleanup: {lab.hosts[0].addr}: nothing to stop" in out, out


def test_a_port_with_no_sshd_says_connection_refused(sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster = _cluster(lab)
    down = lab.hosts[1]
    down.stop()
    code, out = on_pty([*INV, "status", "-c", str(cluster)])
    assert code == 1, out
    assert (f"{down.name}: not asked: unreachable: connection refused by "
            f"{lab.user}@{down.addr}:{down.port} (no SSH server listens on that port)") \
        in out, out
    assert "Errno" not in out and "Traceback" not in out


def test_a_changed_host_key_shows_its_sha256_the_file_and_the_line_that_fixes_it(
        sshd_lab: Any) -> None:
    lab = sshd_lab(n_hosts=1)
    cluster = _cluster(lab)
    host = lab.hosts[0]
    assert on_pty([*INV, "status", "-c", str(cluster)])[0] == 0  # accept-new records it
    host.regenerate_host_key()
    code, out = on_pty([*INV, "status", "-c", str(cluster)])
    assert code == 1, out
    new = subprocess.run(["ssh-keygen", "-l", "-f", host.host_key_path + ".pub"],
                         capture_output=True, text=True, check=True).stdout.split()[1]
    name = f"[{host.addr}]:{host.port}"
    assert f"host key has CHANGED for {name}: it now presents ssh-ed25519 {new}" in out, out
    fix = f"ssh-keygen -R '{name}' -f {lab.known_hosts}"
    assert fix in " ".join(out.split()), out
    # the line it gives is the fix: after it, the new key is recorded and used
    subprocess.run(["ssh-keygen", "-R", name, "-f", lab.known_hosts], check=True,
                   capture_output=True)
    assert on_pty([*INV, "status", "-c", str(cluster)])[0] == 0


def test_a_key_the_host_does_not_accept_names_user_host_port_and_key(
        sshd_lab: Any, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=1)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
                   check=True)
    cluster = _cluster(lab, identity_file=str(other))
    host = lab.hosts[0]
    env_saved = os.environ.pop("SSH_AUTH_SOCK", None)  # no agent key may log us in
    try:
        code, out = on_pty([*INV, "status", "-c", str(cluster)])
    finally:
        if env_saved is not None:
            os.environ["SSH_AUTH_SOCK"] = env_saved
    assert code == 1, out
    assert (f"authentication refused for {lab.user}@{host.addr}:{host.port} with key "
            f"{other}") in " ".join(out.split()), out
