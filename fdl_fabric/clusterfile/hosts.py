"""Hosts from the command line: ``--hosts node[1-4],gpu[01-02]`` and ``--hostfile``.

A cluster without a file, as pdsh, clush, mpirun and DeepSpeed users write it. Ranges are
folded and expanded by ClusterShell's `NodeSet` (the syntax of Slurm and ClusterShell);
each entry may carry ssh's ``user@`` and ``:port`` (``root@gpu[1-4]:2222``), and an IPv6
address is written in brackets (``[fd00::1]:22``), as ``fab -H`` and ``ssh`` take them.
A hostfile is DeepSpeed's and MPI's (``host slots=N``, ``max_slots`` accepted, ``#``
comments; its host word takes the same ``user@host:port``). The result is written as
the cluster file it stands for and read by the same schema, so every rule of a cluster
file (names, bounds, addresses) holds here too, with the flag named in place of the file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from ..limits import WORKERS_MAX
from .loading import parse_cluster
from .model import ClusterSpec
from .problems import ConfigError, Problem

#: One hostfile line: a host, then ``key=value`` words.
_WORD_RE = re.compile(r"([A-Za-z_]+)=([0-9]+)")
#: The key of a worker's problem in the cluster the hosts stand for: its index, its field.
_WORKER_KEY_RE = re.compile(r"workers\[([0-9]+)\](?:\.(.*))?")


class HostsError(ValueError):
    """A bad ``--hosts`` or ``--hostfile``: the message names the flag, file or line."""


@dataclass(frozen=True)
class HostSlot:
    """A host and the ranks it runs (``slots=N`` of a hostfile; None: ``--nproc-per-node``)."""

    host: str
    slots: Optional[int] = None
    #: The hostfile line it was read from (None: ``--hosts``).
    line: Optional[int] = None
    #: ``user@`` and ``:port`` of the entry (None: ``--user``/``--port``, else ssh_config).
    user: Optional[str] = None
    port: Optional[int] = None


@dataclass(frozen=True)
class SshDefaults:
    """``--user``, ``--port``, ``--identity`` and ``-F``: what every host of the command
    line is reached with, unless its entry says otherwise (``user@host:port``)."""

    config_file: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None


def split_entry(text: str, where: str) -> tuple[Optional[str], str, Optional[int]]:
    """``[user@]host[:port]`` as (user, host, port); ``host`` may be a range
    (``gpu[1-4]``), an IPv6 address in brackets (``[fd00::1]``, returned without them) or
    bare (``fd00::1``, no port then, as ssh reads it)."""
    user: Optional[str] = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        if not user:
            raise HostsError(f"{where}: {text!r}: empty user before '@'")
    port_text: Optional[str] = None
    end = text.find("]")
    if text.startswith("[") and ":" in text[1:max(end, 0)]:
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise HostsError(f"{where}: {text!r}: expected [ipv6]:port")
            port_text = rest[1:]
    elif text.count(":") > 1:
        host = text  # a bare IPv6 address: no port (write [addr]:port for one)
    else:
        host, colon, port_text_ = text.partition(":")
        port_text = port_text_ if colon else None
    if not host:
        raise HostsError(f"{where}: {text!r}: no host")
    return user, host, None if port_text is None else port_number(port_text, f"{where}: {text!r}")


def port_number(text: str, where: str) -> int:
    """A TCP port, 1-65535, written in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise HostsError(f"{where}: port must be a number from 1 to 65535, got {text!r}")
    return int(text)


def expand_hosts(text: str) -> list[HostSlot]:
    """``node[1-4],gpu[01-02]`` in the order written (each part expanded by `NodeSet`,
    which sorts within a part only); a host named twice is an error."""
    from ClusterShell.NodeSet import NodeSet, NodeSetException

    parts = _top_level_parts(text)
    if not parts:
        raise HostsError("--hosts: no host given")
    slots: list[HostSlot] = []
    for part in parts:
        user, host, port = split_entry(part, "--hosts")
        if ":" in host:  # an IPv6 address is one host, never a range
            names = [host]
        else:
            try:
                names = list(NodeSet(host))
            except NodeSetException as exc:
                raise HostsError(f"--hosts: {part!r}: {exc}") from None
        slots += [HostSlot(h, user=user, port=port) for h in names]
        if len(slots) > WORKERS_MAX:
            raise HostsError(f"--hosts: more than {WORKERS_MAX} hosts")
    _unique([s.host for s in slots], "--hosts")
    return slots


def read_hostfile(path: str) -> list[HostSlot]:
    """DeepSpeed's and MPI's hostfile: ``host [slots=N] [max_slots=M]`` per line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read(1 << 20).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostsError(f"--hostfile {path}: {getattr(exc, 'strerror', None) or exc}") from None
    found: list[HostSlot] = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots: Optional[int] = None
        for word in words[1:]:
            m = _WORD_RE.fullmatch(word)
            if m is None or m.group(1) not in ("slots", "max_slots"):
                raise HostsError(f"{path}:{number}: expected `host slots=N`, got {word!r}")
            if m.group(1) == "slots":
                slots = int(m.group(2))
                if slots < 1:  # not "the default": a host with no rank is no host here
                    raise HostsError(f"{path}:{number}: slots must be at least 1, got {word!r}")
        user, host, port = split_entry(words[0], f"{path}:{number}")
        found.append(HostSlot(host, slots, number, user=user, port=port))
        if len(found) > WORKERS_MAX:
            raise HostsError(f"{path}: more than {WORKERS_MAX} hosts")
    if not found:
        raise HostsError(f"--hostfile {path}: no host in it")
    _unique([h.host for h in found], path)
    return found


def cluster_from_hosts(hosts: Sequence[HostSlot], *, nproc_per_node: Optional[int],
                       ssh: SshDefaults, source: str, folder: Optional[str] = None,
                       max_hosts: Optional[int] = None,
                       addrs: Optional[dict[str, str]] = None, **top: Any) -> ClusterSpec:
    """The cluster these hosts stand for: each host a worker with its slots (or
    ``nproc_per_node``, else 1) ranks, working in this folder, reached with ``ssh`` (its
    entry's user and port first); ``addrs`` gives a host's address when it is not its
    name (an ssh_config alias's HostName, ``--master-addr``); hosts after the first
    ``max_hosts`` are spares (``--nnodes MIN:MAX``); ``top`` adds cluster keys."""
    folder = os.path.abspath(folder or os.getcwd())
    workers = [_worker(h, folder, nproc_per_node, ssh, addrs or {},
                       spare=max_hosts is not None and i >= max_hosts)
               for i, h in enumerate(hosts)]
    text = yaml.safe_dump({**top, "workers": workers}, sort_keys=False)
    try:
        return dataclasses.replace(
            parse_cluster(text, file=source, folder=folder),
            named_by="--hostfile" if any(h.line is not None for h in hosts) else "--hosts")
    except ConfigError as exc:
        raise HostsError(_one_line(exc.problems, hosts, source)) from None


def _worker(h: HostSlot, folder: str, nproc_per_node: Optional[int], ssh: SshDefaults,
            addrs: dict[str, str], *, spare: bool) -> dict[str, Any]:
    """One host's worker, as a cluster file would write it: only the keys it needs."""
    worker: dict[str, Any] = {"host": h.host, "path": folder,
                              "nproc": h.slots or nproc_per_node or 1}
    reach = _reach(h, ssh)
    if reach:
        worker["ssh"] = reach
    if h.host in addrs:
        worker["addr"] = addrs[h.host]
    if spare:
        worker["spare"] = True
    return worker


def _reach(h: HostSlot, ssh: SshDefaults) -> dict[str, Any]:
    """The worker's ``ssh:`` keys: its entry's user and port first, then the flags'."""
    reach = {"config_file": os.path.abspath(ssh.config_file) if ssh.config_file else None,
             "user": h.user or ssh.user, "port": h.port or ssh.port,
             "identity_file": os.path.abspath(os.path.expanduser(ssh.identity_file))
             if ssh.identity_file else None}
    return {k: v for k, v in reach.items() if v is not None}


def _one_line(problems: Sequence[Problem], hosts: Sequence[HostSlot], source: str) -> str:
    """The schema's problems with the hosts, as one line naming the flag (or the hostfile's
    line) and the host as given, not the lines of the YAML written for them."""
    said = []
    for p in problems:
        m = _WORKER_KEY_RE.fullmatch(p.key)
        if m is None or int(m.group(1)) >= len(hosts):
            said.append(f"{source}: {p.key}: {p.message}" if p.key else f"{source}: {p.message}")
            continue
        h = hosts[int(m.group(1))]
        where = source if h.line is None else f"{source}:{h.line}"
        field = m.group(2) or ""
        what = f"slots={h.slots}" if field == "nproc" and h.slots is not None else \
            (field if field not in ("", "host") else "")
        named = "" if repr(h.host) in p.message else f"{h.host!r}: "
        said.append(f"{where}: {named}{what + ': ' if what else ''}{p.message}")
    more = f" (and {len(said) - 1} more problem(s))" if len(said) > 1 else ""
    return said[0] + more


def _top_level_parts(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1,3],b`` is two parts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _unique(hosts: list[str], where: str) -> list[str]:
    seen: set[str] = set()
    for h in hosts:
        if h in seen:
            raise HostsError(f"{where}: host {h!r} is named twice")
        seen.add(h)
    return hosts
