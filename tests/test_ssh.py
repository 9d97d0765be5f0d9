"""SSH policy: options map onto Fabric/paramiko, user options beat defaults."""

from __future__ import annotations

import textwrap

import paramiko
import pytest

from fdl_fabric.config import WorkerSpec, parse_cluster
from fdl_fabric.ssh import (
    AcceptNewPolicy,
    SshOptionError,
    batchmode_warning,
    make_connection,
    parse_options,
    resolve_settings,
)


def _worker(ssh: str = "{}") -> WorkerSpec:
    doc = textwrap.dedent(f"""\
        workers:
          - host: gpu1
            path: /srv
            nproc: 1
            ssh: {ssh}
        """)
    return parse_cluster(doc, file="c.yml", folder="/proj", local_hostname="ctl").workers[0]


def test_defaults_are_accept_new_keepalive_10x3_and_connect_timeout_10() -> None:
    s = resolve_settings(_worker())
    assert s.strict_host_key_checking == "accept-new"
    assert (s.alive_interval, s.alive_count_max, s.alive_timeout) == (10, 3, 30)
    assert s.connect_timeout == 10 and s.batch_mode
    assert s.target == "gpu1" and s.user is None and s.port is None


def test_user_options_take_precedence_over_defaults() -> None:
    s = resolve_settings(_worker('{options: ["StrictHostKeyChecking=no", "ConnectTimeout=3", '
                                 '"ServerAliveInterval=2", "ServerAliveCountMax=5", '
                                 '"UserKnownHostsFile=/tmp/kh", "ProxyJump=jump@bastion:2222"]}'))
    assert s.strict_host_key_checking == "no" and s.connect_timeout == 3
    assert s.alive_timeout == 10 and s.known_hosts_file == "/tmp/kh"
    assert s.proxy_jump == "jump@bastion:2222"


def test_first_occurrence_of_an_option_wins_as_in_openssh() -> None:
    assert parse_options(["User=a", "user=b"]) == {"user": "a"}


def test_fields_beat_options_for_target_user_port_and_identity() -> None:
    s = resolve_settings(_worker('{target: box, user: me, port: 2200, identity_file: k, '
                                 'options: ["User=other", "Port=22", "IdentityFile=/x/id"]}'))
    assert (s.target, s.user, s.port) == ("box", "me", 2200)
    assert s.identity_files == ("/proj/k", "/x/id")


@pytest.mark.parametrize("opt", ["ForwardX11=yes", "ControlMaster=auto", "LocalForward=1 x:2"])
def test_an_unsupported_option_is_refused_by_name(opt: str) -> None:
    with pytest.raises(SshOptionError, match=opt.split("=")[0]):
        parse_options([opt])


def test_a_bad_strict_host_key_checking_value_is_refused() -> None:
    with pytest.raises(SshOptionError, match="StrictHostKeyChecking"):
        resolve_settings(_worker('{options: ["StrictHostKeyChecking=maybe"]}'))


@pytest.mark.parametrize("opts,warns", [
    (["BatchMode=no"], True), (["batchmode=No"], True), (["BatchMode = ask"], True),
    (["BatchMode=yes"], False), (["BatchMode = yes"], False),
    (["StrictHostKeyChecking=no"], False), ([], False)])
def test_turning_batchmode_off_prints_the_seed_warning(opts: list[str], warns: bool) -> None:
    warning = batchmode_warning(opts, "host-a")
    assert (warning is not None) == warns
    if warning:
        assert "host 'host-a'" in warning and "Proceeding as requested" in warning


def test_connection_never_uses_fabrics_auto_add_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = resolve_settings(_worker(f'{{options: ["UserKnownHostsFile={tmp_path}/kh"]}}'))
    conn = make_connection(s)
    assert isinstance(conn.client._policy, AcceptNewPolicy)
    strict = resolve_settings(_worker('{options: ["StrictHostKeyChecking=yes"]}'))
    assert isinstance(make_connection(strict).client._policy, paramiko.RejectPolicy)


def test_accept_new_records_an_unknown_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kh = tmp_path / "sub" / "known_hosts"
    pkey = paramiko.RSAKey.generate(1024)
    client = paramiko.SSHClient()
    AcceptNewPolicy(str(kh)).missing_host_key(client, "[127.0.0.9]:2222", pkey)
    assert kh.read_text().startswith("[127.0.0.9]:2222 ssh-rsa ")
    assert client.get_host_keys().lookup("[127.0.0.9]:2222") is not None


def test_proxy_jump_becomes_a_gateway_connection() -> None:
    s = resolve_settings(_worker('{options: ["ProxyJump=jumper@bastion:2222"]}'))
    conn = make_connection(s)
    assert conn.gateway.host == "bastion" and conn.gateway.port == 2222
    assert conn.gateway.user == "jumper"
