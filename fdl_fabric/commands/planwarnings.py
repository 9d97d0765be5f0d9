"""A warning about a plan's MASTER_ADDR: loopback where a host on another machine must dial.

A ``MASTER_ADDR`` of 127.0.0.1 works only for ranks on this machine: torch's rendezvous
and collectives dial it from every rank. (The coordinator's address needs no such
warning: ranks reach it through their host's agent, on its session; docs/protocol.md.)
A worker is on this machine when the cluster says so (``localhost``, this host's name,
a tunnel that forwards to it), or when its address or its ssh destination (the
``HostName`` of an ssh_config alias, as `sshconfig` resolved it) is a loopback address or
one of this machine's own interface addresses, given as such or by a name that resolves
only to them. So ``--hosts 127.0.0.2,127.0.0.3`` or aliases of this machine warn
nothing; a host elsewhere, or a name that does not resolve, is warned about. Names are
looked up only when a warning is possible (a loopback master), each once, many at a
time and for at most `LOOKUP_BUDGET` seconds in all.

The advice is in the words of how the cluster was given: keys of the cluster file, or
the ``--master-addr ADDR`` flag for ``--hosts`` and ``--hostfile``, whose cluster has no
file to edit.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import psutil

from ..events import Name
from ..planning.plan import LaunchPlan

if TYPE_CHECKING:
    from ..clusterfile import WorkerSpec

Resolve = Callable[[str], list[str]]

#: Names looked up at once (each lookup mostly waits on the resolver).
LOOKUPS_AT_ONCE = 32

#: Seconds all the lookups may take: a name not resolved by then is taken as one that
#: does not resolve (a resolver that dropped queries made 1,024 names take 145 s, each
#: waiting out its 5 s timeout twice). This is a warning, never a refusal.
LOOKUP_BUDGET = 2.0

T = TypeVar("T")


def judge_all(items: Sequence[T], judge: Callable[[T], bool], at_once: int,
              budget: float) -> list[Optional[bool]]:
    """``judge(item)`` for every item, ``at_once`` at a time, for at most ``budget``
    seconds in all: None for an item not judged by then. The threads are daemons, as a
    lookup cannot be cancelled: one still waiting on the resolver never holds up the
    launch, nor its exit."""
    results: list[Optional[bool]] = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()
    deadline = time.monotonic() + budget

    def work() -> None:
        while time.monotonic() < deadline:  # past it, nobody waits for more answers
            with lock:
                index = next(todo, None)
            if index is None:
                return
            results[index] = judge(items[index])

    threads = [threading.Thread(target=work, name="fdl-lookup", daemon=True)
               for _ in range(min(at_once, len(items)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return results


def is_loopback(address: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ``::1``, as written (no lookup)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(name: str) -> list[str]:
    """Every address ``name`` resolves to ([] when it does not)."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None)})
    except (OSError, UnicodeError):
        return []


def own_addresses() -> set[str]:
    """The addresses of this machine's interfaces (IPv6 without its ``%scope``)."""
    try:
        interfaces = psutil.net_if_addrs()
    except OSError:
        return set()
    return {a.address.split("%")[0] for addrs in interfaces.values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


class ThisMachine:
    """Whether an address or a name is this machine, each name looked up once."""

    def __init__(self, lookup: Resolve = resolve) -> None:
        self._lookup = lookup
        self._own: Optional[set[str]] = None
        self._known: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        if not name:
            return False
        if name not in self._known:
            self._known[name] = self._is_ours(name)
        return self._known[name]

    def _ours(self, address: str) -> bool:
        if self._own is None:
            self._own = own_addresses()
        return is_loopback(address) or address.split("%")[0] in self._own

    def _is_ours(self, name: str) -> bool:
        if is_loopback(name):
            return True
        try:
            return self._ours(str(ipaddress.ip_address(name.strip("[]").split("%")[0])))
        except ValueError:
            found = self._lookup(name)
            return bool(found) and all(self._ours(a) for a in found)


def plan_warnings(plan: LaunchPlan, *, targets: Optional[Mapping[str, str]] = None,
                  from_flags: bool = False, lookup: Resolve = resolve
                  ) -> list[tuple[Name, dict[str, Any]]]:
    """A MASTER_ADDR that cannot work: loopback where a worker on another machine must
    dial it. ``targets``: each SSH host's destination (its ssh_config ``HostName``);
    ``from_flags``: the cluster came from ``--hosts``/``--hostfile`` (advice in flags)."""
    master = plan.ranks[0].env.get("MASTER_ADDR", "")
    if not is_loopback(master):
        return []
    here = ThisMachine(lookup)
    dialed = [w for w in plan.cluster.workers if not w.is_local and not w.tunnel]

    def elsewhere(worker: WorkerSpec) -> bool:
        return not here(worker.addr) and not here((targets or {}).get(worker.host, ""))

    verdicts = judge_all(dialed, elsewhere, LOOKUPS_AT_ONCE, LOOKUP_BUDGET)
    # Not judged within the budget: its name did not resolve in time, so it is warned
    # about as a name that does not resolve is.
    remote = {w.host: w.addr for w, away in zip(dialed, verdicts) if away is not False}
    if not remote:
        return []
    return [(Name.PLAN_LOOPBACK_MASTER, {"address": master, "remote": remote,
                                         "flags": from_flags, "file": plan.cluster.file})]
