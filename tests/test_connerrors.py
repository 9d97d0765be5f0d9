"""Connection errors in the user's words (`fdl_fabric.transport.connerrors`), over real
paramiko exception objects: the socket ones are raised by paramiko itself against
loopback listeners this test owns; the others are paramiko's classes built as paramiko
builds them. The same words through the real sshd lab: tests/test_connerrors_lab.py."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import paramiko
import pytest

from fdl_fabric.transport import connerrors
from fdl_fabric.transport.connerrors import Destination, Handshake, Origin, describe
from fdl_fabric.transport.ssh import SshConnectError, open_connection
from fdl_fabric.transport.sshconfig import SshSettings


def _settings(port: int, tmp_path: Path, *, timeout: float = 1.0,
              keys: tuple[str, ...] = ()) -> SshSettings:
    return SshSettings(host="node1", target="127.0.0.1", user="root", port=port,
                       identity_files=keys, strict_host_key_checking="accept-new",
                       known_hosts_file=str(tmp_path / "known_hosts"),
                       connect_timeout=timeout, alive_interval=10, alive_count_max=3,
                       proxy_jump=None, batch_mode=True)


def _reason(settings: SshSettings, origin: Optional[Origin] = None) -> str:
    with pytest.raises(SshConnectError) as failed:
        open_connection(settings, origin=origin)
    return failed.value.reason


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _listener(on_accept: str) -> Iterator[int]:
    """A loopback port that accepts and then stays ``silent`` or ``closes`` at once."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            if on_accept == "close":
                conn.close()
            else:
                held.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for conn in held:
            conn.close()


def test_a_refused_port_says_connection_refused_with_the_destination(tmp_path: Path) -> None:
    port = _free_port()
    reason = _reason(_settings(port, tmp_path))
    assert reason.startswith(f"unreachable: connection refused by root@127.0.0.1:{port}")
    assert "Errno" not in reason and "Unable to connect" not in reason


def test_a_silent_server_says_no_ssh_banner_within_the_connect_timeout(tmp_path: Path) -> None:
    with _listener("silent") as port:
        reason = _reason(_settings(port, tmp_path, timeout=1))
    assert reason.startswith(f"no SSH banner within 1 s from root@127.0.0.1:{port}"), reason
    assert "No existing session" not in reason and "protocol banner" not in reason


def test_a_server_that_closes_at_once_is_told_apart_from_a_silent_one(tmp_path: Path) -> None:
    with _listener("close") as port:
        reason = _reason(_settings(port, tmp_path, timeout=5))
    assert f"root@127.0.0.1:{port} closed the connection before its SSH banner" in reason, \
        reason


def test_the_worker_line_of_the_cluster_file_is_named(tmp_path: Path) -> None:
    reason = _reason(_settings(_free_port(), tmp_path),
                     Origin(file="/jobs/cluster.yml", line=12))
    assert reason.endswith("; worker at /jobs/cluster.yml:12")


def test_port_22_of_a_hosts_run_points_to_port_and_ssh_config() -> None:
    refused = paramiko.ssh_exception.NoValidConnectionsError(
        {("10.0.0.7", 22): ConnectionRefusedError(111, "Connection refused")})
    hosts = Destination(target="node7", origin=Origin(flag="--hosts"))
    said = describe(refused, hosts)
    assert "connection refused by node7" in said
    assert "--hosts reaches port 22 unless told: give --port, or -F ssh_config" in said
    # not for another port, nor for a worker of a cluster file
    assert "--port" not in describe(refused, Destination(target="node7", port=2222,
                                                         origin=Origin(flag="--hosts")))
    assert "--port" not in describe(refused, Destination(
        target="node7", origin=Origin(file="c.yml", line=3)))
    assert "fab -H takes user@host:port" in describe(
        refused, Destination(target="node7", origin=Origin(flag="-H")))


def test_a_timeout_during_the_tcp_connect_says_no_answer() -> None:
    said = describe(socket.timeout("timed out"), Destination(target="10.0.0.7", port=22,
                                                            timeout=10))
    assert said.startswith("unreachable: no answer from 10.0.0.7:22 within 10 s")


def test_a_name_that_does_not_resolve_is_named() -> None:
    said = describe(socket.gaierror(-2, "Name or service not known"),
                    Destination(target="gpu1.invalid"))
    assert said == ("unreachable: the name gpu1.invalid does not resolve "
                    "(Name or service not known)")


def test_an_auth_failure_names_user_host_port_and_key() -> None:
    said = describe(paramiko.AuthenticationException("Authentication failed."),
                    Destination(target="10.0.0.7", user="alice", port=6301,
                                keys=("/home/alice/.ssh/id_ed25519",)))
    assert said.startswith("authentication refused for alice@10.0.0.7:6301 with key "
                           "/home/alice/.ssh/id_ed25519")
    agent = describe(paramiko.AuthenticationException("Authentication failed."),
                     Destination(target="10.0.0.7"))
    assert "with ssh-agent and the default keys" in agent


def test_an_encrypted_key_says_to_load_it_into_the_agent() -> None:
    said = describe(paramiko.PasswordRequiredException("private key file is encrypted"),
                    Destination(target="h", keys=("/k",)))
    assert "the key /k is encrypted" in said and "ssh-add" in said


def test_a_missing_identity_file_is_named() -> None:
    missing = FileNotFoundError(2, "No such file or directory")
    missing.filename = "/nope/id"
    said = describe(missing, Destination(target="h", user="u", port=1, keys=("/nope/id",)))
    assert said == "identity file /nope/id does not exist (u@h:1 with key /nope/id)"


def test_a_changed_host_key_shows_sha256_the_known_hosts_file_and_the_fix(
        tmp_path: Path) -> None:
    got, expected = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    exc = paramiko.BadHostKeyException("127.0.0.1", got, expected)  # as paramiko raises it
    kh = str(tmp_path / "known_hosts")
    said = describe(exc, Destination(target="127.0.0.1", port=6301, known_hosts=kh))
    assert said.startswith("host key has CHANGED for [127.0.0.1]:6301")
    assert f"it now presents ecdsa-sha2-nistp256 {connerrors.fingerprint(got)}" in said
    assert f"{kh} has ecdsa-sha2-nistp256 {connerrors.fingerprint(expected)}" in said
    assert said.endswith(f"run: ssh-keygen -R '[127.0.0.1]:6301' -f {kh}")
    assert got.get_fingerprint().hex() not in said  # no MD5


def test_the_fingerprint_is_the_one_ssh_keygen_prints(tmp_path: Path) -> None:
    key = paramiko.ECDSAKey.generate()
    pub = tmp_path / "k.pub"
    pub.write_text(f"{key.get_name()} {key.get_base64()}\n")
    listed = subprocess.run(["ssh-keygen", "-l", "-f", str(pub)], capture_output=True,
                            text=True, check=True).stdout
    assert connerrors.fingerprint(key) == listed.split()[1]


def test_a_handshake_that_got_its_banner_but_no_key_exchange_says_so() -> None:
    said = describe(paramiko.SSHException("No existing session"),
                    Destination(target="h", timeout=3), Handshake(banner=True, kex=False))
    assert said.startswith("no SSH key exchange within 3 s with h")


def test_an_unknown_key_under_strict_checking_says_how_to_add_it() -> None:
    exc = paramiko.SSHException("Server '[h]:2' not found in known_hosts")
    said = describe(exc, Destination(target="h", port=2, known_hosts="/kh"))
    assert said.startswith("host key of [h]:2 is unknown and StrictHostKeyChecking=yes")
    assert "ssh-keyscan -p 2 h" in said and "/kh" in said


def test_origins_give_lines_for_a_file_and_the_flag_otherwise() -> None:
    class W:
        def __init__(self, host: str, line: int) -> None:
            self.host, self.line = host, line

    workers = [W("a", 4), W("b", 9)]
    assert connerrors.origins(workers, "c.yml")["b"].place == "c.yml:9"
    named = connerrors.origins(workers, "--hosts", flag="--hosts")
    assert named["a"].place is None and named["a"].flag == "--hosts"
