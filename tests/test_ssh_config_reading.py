"""An ssh_config is parsed once a process while its text is the same, and each host is
looked up once (`transport.configread`, issue 35): a cluster file of 1,024 workers naming
an ssh_config of 1,024 blocks took 49 s to dry-run. The answers stay paramiko's, a text
that changed is parsed and checked again, and a ``Match exec`` is asked afresh."""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path

import paramiko
import pytest

from fdl_fabric.transport.sshconfig import SshOptionError, read_config

#: Host blocks, a wildcard, a negation, and Match criteria that need no command.
CONFIG = f"""\
Host node1 node2
    HostName 10.0.0.1
    User alice
Host node3
    Port 2201
Match originalhost node3 user bob
    IdentityFile ~/.ssh/bob
Match localuser {getpass.getuser()}
    ServerAliveInterval 17
Host !node2 node*
    Port 2299
    IdentityFile ~/.ssh/nodes
Match all
    ConnectTimeout 9
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(CONFIG)
    return path


def paramikos(path: Path, host: str) -> dict[str, object]:
    plain = paramiko.SSHConfig()
    with path.open() as fh:
        plain.parse(fh)
    return dict(plain.lookup(host))


@pytest.mark.parametrize("host", ["node1", "node2", "node3", "node9", "elsewhere"])
def test_every_answer_is_paramikos_own(config: Path, host: str) -> None:
    assert dict(read_config(str(config)).lookup(host)) == paramikos(config, host)
    # asked again: the remembered answer is the same
    assert dict(read_config(str(config)).lookup(host)) == paramikos(config, host)


def test_an_ssh_config_is_parsed_once_while_its_text_is_the_same_and_again_once_changed(
        config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config.write_text(CONFIG + f"# {config}\n")  # a text no other test parsed
    parses: list[int] = []
    real_parse = paramiko.SSHConfig.parse
    monkeypatch.setattr(paramiko.SSHConfig, "parse",
                        lambda self, fh: (parses.append(1), real_parse(self, fh))[1])
    for _ in range(5):
        assert read_config(str(config)).lookup("node1")["user"] == "alice"
    assert len(parses) == 1
    config.write_text(CONFIG.replace("User alice", "User carol") + f"# {config}\n")
    assert read_config(str(config)).lookup("node1")["user"] == "carol"
    assert len(parses) == 2


def test_each_caller_gets_an_answer_of_its_own(config: Path) -> None:
    first = read_config(str(config)).lookup("node9")
    first["identityfile"].append("/tmp/mine")
    first["user"] = "mallory"
    again = read_config(str(config)).lookup("node9")
    assert again["identityfile"] == [os.path.expanduser("~/.ssh/nodes")]
    assert "user" not in again


def test_a_match_exec_is_asked_afresh_at_each_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "asked"
    path = tmp_path / "ssh_config"
    path.write_text(f'Match exec "echo x >> {counter}"\n    User asked\n')
    with open(os.devnull) as nothing:  # paramiko runs it with invoke, which reads stdin
        monkeypatch.setattr(sys, "stdin", nothing)
        for _ in range(3):
            assert read_config(str(path)).lookup("node1")["user"] == "asked"
    # two passes a lookup (paramiko's "final" pass), each one asking the command
    assert counter.read_text().count("x") == 6


def test_a_checked_file_changed_to_run_a_command_after_a_clean_read_is_refused(
        config: Path) -> None:
    assert read_config(str(config), checked=True).lookup("node1")["user"] == "alice"
    config.write_text(CONFIG + "Host *\n    ProxyCommand nc %h %p\n")
    with pytest.raises(SshOptionError, match=r"ssh_config:16: ProxyCommand runs a command"):
        read_config(str(config), checked=True)
