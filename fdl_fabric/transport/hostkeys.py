"""Host keys: OpenSSH's ``accept-new``, ``yes`` and ``no`` on a paramiko client.

Fabric's default host-key policy, ``AutoAddPolicy``, accepts changed keys too; every
connection the launcher makes or is handed (``fab -H``'s) gets these rules instead,
with the known_hosts file its settings or its ssh_config name.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import paramiko

from .sshconfig import DEFAULT_KNOWN_HOSTS

_known_hosts_lock = threading.Lock()


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """OpenSSH's ``accept-new``: record an unknown key, never a changed one.

    A changed key never reaches this policy: paramiko raises
    BadHostKeyException itself when a loaded key differs. We append one line
    instead of rewriting the file, so concurrent connections cannot clobber
    each other's entries.
    """

    def __init__(self, known_hosts_file: str) -> None:
        self.known_hosts_file = known_hosts_file

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        entry = paramiko.hostkeys.HostKeyEntry([hostname], key)
        with _known_hosts_lock:
            folder = os.path.dirname(self.known_hosts_file)
            if folder:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            with open(self.known_hosts_file, "a", encoding="utf-8") as fh:
                fh.write(entry.to_line() or "")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _RecordOnlyPolicy(paramiko.MissingHostKeyPolicy):
    """``StrictHostKeyChecking=no``: accept anything, record nothing."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)


def apply_host_key_policy(client: paramiko.SSHClient, strict: str = "accept-new",
                          known_hosts_file: str = DEFAULT_KNOWN_HOSTS) -> None:
    """Our host-key rules on a client that has not connected yet (Fabric's default
    AutoAddPolicy would accept a changed key): ``accept-new``, ``yes`` or ``no``."""
    known_hosts_file = os.path.expanduser(known_hosts_file)
    if strict == "no":
        client.set_missing_host_key_policy(_RecordOnlyPolicy())
        return
    if os.path.exists("/etc/ssh/ssh_known_hosts"):
        client.load_system_host_keys("/etc/ssh/ssh_known_hosts")
    if os.path.exists(known_hosts_file):
        client.load_host_keys(known_hosts_file)
    if strict == "accept-new":
        client.set_missing_host_key_policy(AcceptNewPolicy(known_hosts_file))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())



def known_hosts_of(conn: Any) -> str:
    """The known_hosts file of a Connection someone else built: the ``UserKnownHostsFile``
    its ssh_config gives the host (``fab -S FILE``, ~/.ssh/config), as ssh would use it
    (the first of the list), else ~/.ssh/known_hosts."""
    found = getattr(conn, "ssh_config", None) or {}
    files = str(found.get("userknownhostsfile") or "").split()
    return os.path.expanduser(files[0]) if files else DEFAULT_KNOWN_HOSTS



__all__ = ["AcceptNewPolicy", "apply_host_key_policy", "known_hosts_of"]
