"""Worker-to-worker reachability: which host dials which port of which other host, and
what the answers mean; pure, so every rule is unit tested.

Each host's agent listens on the ports the job will use there (`fdl_fabric.agent.fleet`):
``master_port`` on rank 0's host (the rendezvous every rank dials at MASTER_ADDR), and a
sample of the ephemeral range on every host (gloo and NCCL listen on ephemeral ports and
every peer connects to them, at the host's ``addr``). Then every host dials the others
(`dials`), and `judge` lists only what failed, each row naming the pair, the port and the
cause: ``gpu-c cannot reach gpu-a:29500 (timed out after 2 s)``.

Who dials whom. Up to `fanout` hosts, every pair. Beyond it, the sample below, which still
finds one blocked host: every host dials MASTER_ADDR (every rank will), and each host's
ephemeral ports are dialed by its next `RING` hosts in roster order plus `RANDOM_PEERS`
others chosen at random, so each host is dialed by at least `RING` peers and dials at
least `RING` others. A host that cannot be reached, or reaches nobody, fails every dial
it is part of, and its row says so once.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .nic import candidates, selected
from .probe import IfnameSetting
from .report import CONTROLLER, Check, Status

#: Ephemeral ports each host samples and listens on.
EPHEMERAL_SAMPLE = 2
#: Beyond fanout: each host is dialed by its next RING hosts and RANDOM_PEERS others.
RING = 3
RANDOM_PEERS = 2
#: Seconds each dial may take, connect and keyed reply together.
DIAL_TIMEOUT = 2.0


@dataclass(frozen=True)
class Peer:
    """One host of the check: where its ranks are reached, and its interface settings."""

    host: str
    addr: str
    ifnames: tuple[IfnameSetting, ...] = ()

    @property
    def on_loopback(self) -> bool:
        """Ranks reached at a loopback address all run on one machine: no interface to
        choose between."""
        return self.addr.startswith("127.") or self.addr in ("localhost", "::1")


@dataclass(frozen=True)
class Target:
    """One dial: ``dialer`` connects to ``host``'s listener at ``addr:port``."""

    id: str
    dialer: str
    host: str
    addr: str
    port: int
    #: ``master`` (MASTER_ADDR), ``ephemeral`` (the host's addr), or ``iface`` (an
    #: interface's address, ``iface`` naming it).
    purpose: str
    iface: str = ""

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "host": self.host, "addr": self.addr, "port": self.port}


def listen_request(peer: Peer, master_host: str, master_port: int, token: str) -> dict[str, Any]:
    """What one host's agent listens on: ``master_port`` on rank 0's host, and a sample
    of the ephemeral range everywhere."""
    return {"op": "listen", "host": peer.host, "token": token,
            "ports": [master_port] if peer.host == master_host else [],
            "ephemeral": EPHEMERAL_SAMPLE}


def dialers_of(index: int, hosts: Sequence[str], fanout: int, seed: str) -> list[str]:
    """Who dials host ``index``'s ephemeral ports: every other host up to ``fanout``
    hosts, else its next `RING` hosts and `RANDOM_PEERS` others (the module says why)."""
    n = len(hosts)
    others = [hosts[i] for i in range(n) if i != index]
    if n <= fanout:
        return others
    ring = [hosts[(index + k) % n] for k in range(1, RING + 1)]
    rest = [h for h in others if h not in ring]
    rng = random.Random(f"{seed}:{index}")
    return ring + rng.sample(rest, min(RANDOM_PEERS, len(rest)))


def dials(peers: Sequence[Peer], answers: Mapping[str, Mapping[str, Any]], master_host: str,
          master_addr: str, master_port: int, fanout: int, seed: str = ""
          ) -> dict[str, list[Target]]:
    """Each host's dials, from what every listener could bind (``answers``: host -> the
    agent's ``listen`` answer)."""
    hosts = [p.host for p in peers]
    out: dict[str, list[Target]] = {h: [] for h in hosts}
    if answers.get(master_host, {}).get("ports", {}).get(str(master_port)) == "ok":
        for h in hosts:
            if h != master_host:
                out[h].append(Target(f"m:{h}", h, master_host, master_addr, master_port,
                                     "master"))
    for i, peer in enumerate(peers):
        for dialer in dialers_of(i, hosts, fanout, seed):
            out[dialer] += _peer_targets(dialer, peer, answers.get(peer.host, {}))
    return out


def _peer_targets(dialer: str, peer: Peer, answer: Mapping[str, Any]) -> list[Target]:
    """``dialer``'s dials of one peer: its sampled ports at its ``addr``, and the first
    of them at the address of each interface its ranks may use."""
    ports = [int(p) for p in answer.get("ephemeral") or []]
    if not ports:
        return []
    found = [Target(f"e:{dialer}:{peer.host}:{p}", dialer, peer.host, peer.addr, p,
                    "ephemeral") for p in ports]
    for iface, addr in _iface_addresses(peer, answer.get("ifaces") or {}):
        found.append(Target(f"i:{dialer}:{peer.host}:{iface}", dialer, peer.host, addr,
                            ports[0], "iface", iface))
    return found


def _iface_addresses(peer: Peer, ifaces: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The interfaces whose address the peers must reach: those a setting selects, or,
    with none and several candidates, each candidate (to say which reaches everyone)."""
    if peer.ifnames:
        found: list[tuple[str, str]] = []
        for setting in peer.ifnames:
            found += [x for x in selected(setting, ifaces) if x not in found]
        return found
    if peer.on_loopback:
        return []
    several = candidates(ifaces)
    return several if len(several) > 1 else []


def _where(t: Target) -> str:
    shown = f"{t.host}:{t.port}"
    if t.addr != t.host:
        shown += f" at {t.addr}"
    return shown + {"master": " (MASTER_ADDR)", "iface": f" ({t.iface})"}.get(t.purpose, "")


def _cause(result: str) -> str:
    return result[1:] if result[:1] in "!?" else result


def judge(targets: Mapping[str, Sequence[Target]], results: Mapping[str, Mapping[str, str]],
          seconds: float, sampled: bool) -> list[Check]:
    """The ``reach`` rows: one per failed pair (port, cause); a host that no peer reaches,
    or that reaches no peer, said once; one ok row when everything answered. Interface
    dials are judged by `iface_failures` (the ``nic`` rows)."""
    plain = [t for ts in targets.values() for t in ts if t.purpose != "iface"]
    failed = [(t, _result(results, t)) for t in plain if _result(results, t) != "ok"]
    if not failed:
        how = "sampled beyond fanout" if sampled else "every pair"
        return [Check(CONTROLLER, "reach", Status.OK,
                      f"{len(plain)} dials between {len(targets)} hosts ({how}), each reached "
                      f"its host's listener on the job's ports in {seconds:.1f} s")]
    return _collapsed(plain, failed)


def _result(results: Mapping[str, Mapping[str, str]], t: Target) -> str:
    return results.get(t.dialer, {}).get(t.id, "!no answer from this host's agent")


def _collapsed(plain: Sequence[Target], failed: Sequence[tuple[Target, str]]) -> list[Check]:
    """Per-pair rows, except a dialer that failed every dial (one row: it reaches nobody)
    and a target every dialer failed (one row: nobody reaches it)."""
    said: set[str] = set()
    rows = _said_once(plain, failed, said, lambda t: t.dialer, lambda t, why: Check(
        t.dialer, "reach", Status.FAIL, f"{t.dialer} reaches no other host ({_where(t)}: "
        f"{_cause(why)}): its link or firewall"))
    rows += _said_once(plain, failed, said, lambda t: (t.host, t.port, t.addr),
                       lambda t, why: Check(t.host, "reach", Status.FAIL,
                                            f"no host reaches {_where(t)} ({t.dialer}: "
                                            f"{_cause(why)}): its link or firewall"))
    return rows + [Check(t.dialer, "reach", Status.FAIL,
                         f"{t.dialer} cannot reach {_where(t)} ({_cause(why)})")
                   for t, why in failed if t.id not in said]


def _said_once(plain: Sequence[Target], failed: Sequence[tuple[Target, str]], said: set[str],
               key: Callable[[Target], Any], row: Callable[[Target, str], Check]
               ) -> list[Check]:
    """One row for each ``key`` group (two dials or more) whose every dial failed and was
    not said yet; the dials it covers join ``said``."""
    totals = _count(plain, key)
    groups: dict[Any, list[tuple[Target, str]]] = {}
    for t, why in failed:
        if t.id not in said:
            groups.setdefault(key(t), []).append((t, why))
    rows = []
    for k, fails in groups.items():
        if len(fails) == totals[k] > 1:
            rows.append(row(*fails[0]))
            said.update(t.id for t, _ in fails)
    return rows


def _count(targets: Sequence[Target], key: Any) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for t in targets:
        counts[key(t)] = counts.get(key(t), 0) + 1
    return counts


def iface_failures(targets: Mapping[str, Sequence[Target]],
                   results: Mapping[str, Mapping[str, str]]
                   ) -> dict[str, dict[tuple[str, str], list[tuple[str, str]]]]:
    """host -> (interface, address) -> [(peer, why)] of the peers that could not reach it
    (an empty list: every peer did), for `fdl_fabric.preflight.nic.reach_rows`."""
    out: dict[str, dict[tuple[str, str], list[tuple[str, str]]]] = {}
    for ts in targets.values():
        for t in ts:
            if t.purpose != "iface":
                continue
            slot = out.setdefault(t.host, {}).setdefault((t.iface, t.addr), [])
            why = _result(results, t)
            if why != "ok":
                slot.append((t.dialer, _cause(why)))
    return out


def listen_rows(master_host: str, master_port: int,
                answers: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """What a listener could not bind: ``master_port`` taken on rank 0's host (rank 0's
    store will fail to bind it too), or a host whose agent did not answer."""
    rows = []
    got: Optional[str] = answers.get(master_host, {}).get("ports", {}).get(str(master_port))
    if got is not None and got != "ok":
        rows.append(Check(master_host, "reach", Status.FAIL,
                          f"master_port {master_port} {_cause(got)}: rank 0's store cannot "
                          "listen there (give --master-port, or master_port:)"))
    for host, answer in answers.items():
        if answer.get("error"):
            rows.append(Check(host, "reach", Status.FAIL,
                              f"the reachability check got no answer: {answer['error']}"))
    return rows
