"""SSH policy: options map onto Fabric/paramiko, user options beat defaults."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Any

import paramiko
import pytest

from fdl_fabric.clusterfile import ConfigError, SshSpec, WorkerSpec, parse_cluster
from fdl_fabric.transport.ssh import AcceptNewPolicy, make_connection
from fdl_fabric.transport.sshconfig import (
    SUPPORTED_OPTIONS,
    SshOptionError,
    batchmode_off,
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


def _coded(**ssh: Any) -> WorkerSpec:
    """A worker whose ssh block was built in code, so the cluster file's checks never ran."""
    return dataclasses.replace(_worker(), ssh=SshSpec(**ssh))


def test_a_bad_strict_host_key_checking_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="StrictHostKeyChecking='maybe': must be one of"):
        _worker('{options: ["StrictHostKeyChecking=maybe"]}')
    with pytest.raises(SshOptionError, match="StrictHostKeyChecking"):
        resolve_settings(_coded(options=("StrictHostKeyChecking=maybe",)))


def test_forward_agent_is_yes_no_or_left_to_ssh_config() -> None:
    assert resolve_settings(_worker()).forward_agent is None
    assert resolve_settings(_worker('{options: ["ForwardAgent=yes"]}')).forward_agent is True
    assert resolve_settings(_worker('{options: ["forwardagent=No"]}')).forward_agent is False
    with pytest.raises(ConfigError, match="ForwardAgent='always': must be yes or no"):
        _worker('{options: ["ForwardAgent=always"]}')


@pytest.mark.parametrize("port", ["0", "65536", "-1", "22x", "２２"])
def test_port_0_is_refused_instead_of_falling_back_to_22(port: str) -> None:
    with pytest.raises(ConfigError, match=f"Port='{port}': must be a port number between 1 and"):
        _worker(f'{{options: ["Port={port}"]}}')
    with pytest.raises(SshOptionError, match="must be a port number between 1 and 65535"):
        resolve_settings(_coded(options=(f"Port={port}",)))


def test_a_port_field_out_of_range_is_refused_even_when_built_in_code() -> None:
    with pytest.raises(SshOptionError, match="ssh.port: must be between 1 and 65535, got 0"):
        resolve_settings(_coded(port=0))


@pytest.mark.parametrize("port", ["1", "65535"])
def test_ports_at_the_edges_of_the_range_are_used_as_given(port: str) -> None:
    assert resolve_settings(_worker(f'{{options: ["Port={port}"]}}')).port == int(port)


@pytest.mark.parametrize(
    "option",
    ["User=me\nProxyCommand nc %h %p", "HostName=box\rProxyCommand x", "User=me\u2028x",
     "ServerAliveInterval=5\nProxyCommand x", "BatchMode=yes\x00"],
)
def test_an_option_with_an_embedded_line_break_never_reaches_paramiko(option: str) -> None:
    with pytest.raises(ConfigError, match="must be a single line"):
        _worker(f"{{options: [{json.dumps(option)}]}}")
    with pytest.raises(SshOptionError, match="must be a single line"):
        parse_options([option])
    with pytest.raises(SshOptionError, match="must be a single line"):
        resolve_settings(_coded(options=(option,)))


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("ConnectTimeout=nan", "ConnectTimeout='nan': must be a number of seconds"),
        ("ServerAliveInterval=inf", "ServerAliveInterval='inf': must be a number of seconds"),
        ("ServerAliveCountMax=3.5", "ServerAliveCountMax='3.5': must be a whole number"),
        ("HostName=a b", "HostName='a b': contains a space"),
        ("User=-oops", "User='-oops': '-oops' is not a user name"),
        ("ProxyJump=bastion:0", "ProxyJump='bastion:0': jump host 'bastion:0': must be a port"),
        ("ProxyJump=[::1]:22", "ProxyJump='[::1]:22': jump host '[::1]:22': IPv6 jump hosts"),
        ("User=", "User='': has no value"),
    ],
)
def test_option_values_are_held_to_the_config_grammar(option: str, message: str) -> None:
    with pytest.raises(SshOptionError) as info:
        parse_options([option])
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("ssh", "message"),
    [
        ({"target": "a;b"}, "ssh.target: contains ';'"),
        ({"target": "m e@box"}, "ssh.target: user part 'm e' is not a user name"),
        ({"user": "a\nb"}, "ssh.user: 'a\\nb' is not a user name"),
    ],
)
def test_names_built_in_code_are_held_to_the_config_grammar(
    ssh: dict[str, str], message: str
) -> None:
    with pytest.raises(SshOptionError) as info:
        resolve_settings(_coded(**ssh))
    assert str(info.value).startswith(message)


def test_a_host_name_built_in_code_is_held_to_the_config_grammar() -> None:
    worker = dataclasses.replace(_worker(), host="h1 pgid=22602 start=1677925")
    with pytest.raises(SshOptionError, match="host: contains a space"):
        resolve_settings(worker)


@pytest.mark.parametrize(
    "option",
    ["StrictHostKeyChecking=no", "UserKnownHostsFile=/tmp/kh", "ConnectTimeout=10",
     "ServerAliveInterval=2.5", "ServerAliveCountMax=0", "ProxyJump=u@b:2222,c", "ProxyJump=none",
     "IdentityFile=~/.ssh/id", "User=deploy.bot", "Port=2222", "BatchMode=no",
     "HostName=fe80::1%eth0"],
)
def test_every_supported_option_takes_its_usual_values(option: str) -> None:
    assert option.split("=")[0].lower() in SUPPORTED_OPTIONS
    assert parse_options([option]) == {option.split("=")[0].lower(): option.split("=", 1)[1]}
    resolve_settings(_worker(f'{{options: ["{option}"]}}'))


@pytest.mark.parametrize("opts,warns", [
    (["BatchMode=no"], True), (["batchmode=No"], True), (["BatchMode = ask"], True),
    (["BatchMode=yes"], False), (["BatchMode = yes"], False),
    (["StrictHostKeyChecking=no"], False), ([], False)])
def test_turning_batchmode_off_is_warned_about(opts: list[str], warns: bool) -> None:
    assert (batchmode_off(opts) is not None) == warns


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


def _known_hosts(path: Any, hosts: list[str]) -> dict[str, paramiko.PKey]:
    keys = {h: paramiko.Ed25519Key.from_private_key_file(str(_ed25519(path, h))) for h in hosts}
    path.write_text("".join(f"{h} {k.get_name()} {k.get_base64()}\n" for h, k in keys.items()))
    return keys


def _ed25519(folder: Any, name: str) -> Any:
    """A fresh ed25519 key file (paramiko cannot make one: cryptography does)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = folder.parent / f"{name}.key"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption()))
    return key


def test_a_known_hosts_file_is_read_once_while_it_is_unchanged_and_again_once_it_changes(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    kh = tmp_path / "known_hosts"
    keys = _known_hosts(kh, ["[127.0.0.7]:22", "[127.0.0.8]:22"])
    reads: list[str] = []
    real_load = paramiko.HostKeys.load
    monkeypatch.setattr(paramiko.HostKeys, "load",
                        lambda self, f: (reads.append(f), real_load(self, f))[1])
    s = resolve_settings(_worker(f'{{options: ["UserKnownHostsFile={kh}"]}}'))
    clients = [make_connection(s).client for _ in range(5)]
    assert reads == [str(kh)], "one read for five connections"
    for client in clients:
        found = client.get_host_keys().lookup("[127.0.0.8]:22")
        assert found is not None and found["ssh-ed25519"] == keys["[127.0.0.8]:22"]
    # a key one connection accepts is its own: no other client sees it
    new = paramiko.Ed25519Key.from_private_key_file(str(_ed25519(kh, "new")))
    clients[0].get_host_keys().add("[127.0.0.9]:22", new.get_name(), new)
    assert clients[1].get_host_keys().lookup("[127.0.0.9]:22") is None
    # the file changed (accept-new appended a line): the next connection reads it again
    with kh.open("a") as fh:
        fh.write(f"[127.0.0.9]:22 {new.get_name()} {new.get_base64()}\n")
    again = make_connection(s).client.get_host_keys().lookup("[127.0.0.9]:22")
    assert again is not None and again["ssh-ed25519"] == new
    assert reads == [str(kh), str(kh)]


def test_proxy_jump_becomes_a_gateway_connection() -> None:
    s = resolve_settings(_worker('{options: ["ProxyJump=jumper@bastion:2222"]}'))
    conn = make_connection(s)
    assert conn.gateway.host == "bastion" and conn.gateway.port == 2222
    assert conn.gateway.user == "jumper"
