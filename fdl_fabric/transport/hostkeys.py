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
#: The host-key file every launch reads besides the user's (as OpenSSH does).
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
#: Each known_hosts file as read (`_load`), by path: its stamp and its entries.
_parsed: dict[str, tuple[tuple[int, int, int, int], tuple[Any, ...]]] = {}
_parsed_lock = threading.Lock()


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
    # What load_system_host_keys and load_host_keys do, each file read once (`_load`).
    if os.path.exists(SYSTEM_KNOWN_HOSTS):
        _load(getattr(client, "_system_host_keys"), SYSTEM_KNOWN_HOSTS)  # noqa: B009
    if os.path.exists(known_hosts_file):
        _load(client.get_host_keys(), known_hosts_file)
        setattr(client, "_host_keys_filename", known_hosts_file)  # noqa: B010
    if strict == "accept-new":
        client.set_missing_host_key_policy(AcceptNewPolicy(known_hosts_file))
    else:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())



def _load(keys: paramiko.HostKeys, path: str) -> None:
    """``path``'s entries added to ``keys``, as `paramiko.HostKeys.load` reads them, but
    read once a process while the file is unchanged (its inode, size and mtime).

    Why: paramiko's load checks each line against every line before it, so a
    known_hosts of 1,024 hosts takes about 0.1 s of CPU to read (0.003 s at 100), and
    the launcher read it again for each connection: 3 s of CPU before the first rank
    of a launch through 32 gateways (issue 35). Each client gets its own list of its
    own entries (copies: adding a key to one client changes no other), and a file that
    changed (a key that ``accept-new`` appended) is read again."""
    st = os.stat(path)
    stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _parsed_lock:
        kept = _parsed.get(path)
        if kept is None or kept[0] != stamp:
            fresh = paramiko.HostKeys()
            fresh.load(path)
            kept = _parsed[path] = (stamp, tuple(_entries(fresh)))
    _entries(keys).extend(paramiko.hostkeys.HostKeyEntry(list(e.hostnames), e.key)
                          for e in kept[1])


def _entries(keys: paramiko.HostKeys) -> list[Any]:
    """A HostKeys' entries, in order (paramiko keeps them in ``_entries``, and has no
    public way to copy them but re-adding each: a scan of all the others each)."""
    entries: list[Any] = getattr(keys, "_entries")  # noqa: B009
    return entries


def known_hosts_of(conn: Any) -> str:
    """The known_hosts file of a Connection someone else built: the ``UserKnownHostsFile``
    its ssh_config gives the host (``fab -S FILE``, ~/.ssh/config), as ssh would use it
    (the first of the list), else ~/.ssh/known_hosts."""
    found = getattr(conn, "ssh_config", None) or {}
    files = str(found.get("userknownhostsfile") or "").split()
    return os.path.expanduser(files[0]) if files else DEFAULT_KNOWN_HOSTS



__all__ = ["SYSTEM_KNOWN_HOSTS", "AcceptNewPolicy", "apply_host_key_policy", "known_hosts_of"]
