"""Hosts from the command line: ``--hosts node[1-4],gpu[01-02]`` and ``--hostfile``.

A cluster without a file, as pdsh, clush, mpirun and DeepSpeed users write it. Ranges are
folded and expanded by ClusterShell's `NodeSet` (the syntax of Slurm and ClusterShell);
a hostfile is DeepSpeed's and MPI's (``host slots=N``, ``max_slots`` accepted, ``#``
comments). The result is written as the cluster file it stands for and read by the same
schema, so every rule of a cluster file (names, bounds, addresses) holds here too, with
the flag named in place of the file.
"""

from __future__ import annotations

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


def expand_hosts(text: str) -> list[HostSlot]:
    """``node[1-4],gpu[01-02]`` in the order written (each part expanded by `NodeSet`,
    which sorts within a part only); a host named twice is an error."""
    from ClusterShell.NodeSet import NodeSet, NodeSetException

    parts = _top_level_parts(text)
    if not parts:
        raise HostsError("--hosts: no host given")
    hosts: list[str] = []
    for part in parts:
        try:
            hosts += list(NodeSet(part))
        except NodeSetException as exc:
            raise HostsError(f"--hosts: {part!r}: {exc}") from None
        if len(hosts) > WORKERS_MAX:
            raise HostsError(f"--hosts: more than {WORKERS_MAX} hosts")
    return [HostSlot(h) for h in _unique(hosts, "--hosts")]


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
        found.append(HostSlot(words[0], slots, number))
        if len(found) > WORKERS_MAX:
            raise HostsError(f"{path}: more than {WORKERS_MAX} hosts")
    if not found:
        raise HostsError(f"--hostfile {path}: no host in it")
    _unique([h.host for h in found], path)
    return found


def cluster_from_hosts(hosts: Sequence[HostSlot], *, nproc_per_node: Optional[int],
                       ssh_config: Optional[str], source: str, folder: Optional[str] = None,
                       max_hosts: Optional[int] = None, **top: Any) -> ClusterSpec:
    """The cluster these hosts stand for: each host a worker with its slots (or
    ``nproc_per_node``, else 1) ranks, working in this folder, reached through
    ``ssh_config`` when given; hosts after the first ``max_hosts`` are spares
    (``--nnodes MIN:MAX``); ``top`` adds cluster keys (``elastic``, ...)."""
    folder = os.path.abspath(folder or os.getcwd())
    workers = []
    for i, h in enumerate(hosts):
        worker: dict[str, Any] = {"host": h.host, "path": folder,
                                  "nproc": h.slots or nproc_per_node or 1}
        if ssh_config is not None:
            worker["ssh"] = {"config_file": os.path.abspath(ssh_config)}
        if max_hosts is not None and i >= max_hosts:
            worker["spare"] = True
        workers.append(worker)
    text = yaml.safe_dump({**top, "workers": workers}, sort_keys=False)
    try:
        return parse_cluster(text, file=source, folder=folder)
    except ConfigError as exc:
        raise HostsError(_one_line(exc.problems, hosts, source)) from None


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
