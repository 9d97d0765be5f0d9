"""The network-namespace lab: sshd hosts behind veth pairs that a test can cut.

Each host's sshd runs in a network namespace of its own (``ip netns add``) behind a veth
pair with a private /30; `NetnsLab.link_down` takes the link down with no FIN and no RST,
as a real partition does. Root only; `netns_available` says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import psutil

from .processes import LabError, own_lineage, terminate
from .sshd import SBIN_PATH, LabHost, SshdLab, require_tool, sshd_available

#: Every namespace and interface a NetnsLab creates starts with this, then the lab's token.
NETNS_PREFIX = "fdlt"


#: The private /16 NetnsLab picks its /24 from; it is only ever routed to our veths and, by
#: a blackhole route, nowhere else (never out of this machine's real interfaces).
NETNS_SUPERNET = ipaddress.IPv4Network("10.231.0.0/16")


def netns_available() -> Optional[str]:
    """None if a NetnsLab can run here, else the reason it cannot (for ``pytest.skip``)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "NetnsLab needs root (ip netns, veth pairs, mount namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None and shutil.which(tool, path=SBIN_PATH) is None:
            return f"{tool} not found (install iproute2 / util-linux)"
    if not sshd_available():
        return "sshd not found (install openssh-server)"
    return None


def _ip(*args: str, netns: Optional[str] = None, check: bool = True) -> str:
    argv = [require_tool("ip")]
    if netns is not None:
        argv += ["-n", netns]
    argv += list(args)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _set_forwarding(iface: str) -> None:
    """IPv4 forwarding for packets that arrive on ``iface`` only (the kernel decides by
    the input interface): the lab's hosts reach each other, nothing else is forwarded."""
    with open(f"/proc/sys/net/ipv4/conf/{iface}/forwarding", "w", encoding="ascii") as fh:
        fh.write("1\n")


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return sorted(int(p) for p in out.split() if p.isdigit())


@dataclass
class _Netns:
    """One host's plumbing: its namespace, the veth pair and the two ends' addresses."""

    name: str
    veth_root: str
    veth_host: str
    root_addr: str
    host_addr: str


class NetnsLab(SshdLab):
    """Lab hosts that each live in a network namespace of their own, behind a veth pair.

    Host ``i`` is ``sshd`` inside namespace ``fdlt-<token>-<i>``; the namespace reaches
    the root namespace through a veth pair whose ends hold the two usable addresses of a
    private /30 (``10.231.<lab octet>.<4i+1>`` on the root side, ``<4i+2>`` on the host
    side).  Nothing else is routed: the namespace has no default route, and the lab's
    whole /24 gets a blackhole route in the root namespace, so while a link is down
    packets to the host are dropped here instead of following the default route out of
    the machine.  ``link_down(host)``/``link_up(host)`` cut and restore the wire the way
    a switch port or cable failure would: no FIN, no RST, silence.

    sshd's ClientAlive defaults to 1 s x 3 here, so the server side drops a silent
    client within a few seconds (pass other values to test other policies).  ``stop()``
    stops the lab's processes, kills whatever is still inside its namespaces (processes
    in a namespace we created are ours by construction) and deletes every namespace,
    interface and route the lab added.  Root only; see ``netns_available()``.
    """

    def __init__(
        self,
        root: Union[str, os.PathLike[str]],
        n_hosts: int = 1,
        *,
        client_alive_interval: int = 1,
        client_alive_count_max: int = 3,
        routed: bool = False,
        host_ifnames: Optional[dict[int, str]] = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name_prefix", "ns")
        #: Hosts reach each other through the root namespace (which forwards between the
        #: lab's own veths only), as workers on one switch do.
        self.routed = routed
        #: The name of host i's interface inside its namespace (default: the veth's own).
        self.host_ifnames = dict(host_ifnames or {})
        super().__init__(
            root,
            n_hosts,
            client_alive_interval=client_alive_interval,
            client_alive_count_max=client_alive_count_max,
            **kwargs,
        )
        if n_hosts > 63:
            raise ValueError("a NetnsLab has at most 63 hosts (one /30 each in a /24)")
        self.token = secrets.token_hex(3)
        self.subnet: Optional[ipaddress.IPv4Network] = None
        self._nets: dict[str, _Netns] = {}
        self._blackhole = False

    # -- hooks -------------------------------------------------------------------------

    def _host_addresses(self, names: Sequence[str]) -> list[str]:
        reason = netns_available()
        if reason is not None:
            raise LabError(reason)
        self.subnet = self._pick_subnet()
        _ip("route", "add", "blackhole", str(self.subnet))
        self._blackhole = True
        base = self.subnet.network_address
        addrs = []
        for i, name in enumerate(names):
            net = _Netns(
                name=f"{NETNS_PREFIX}-{self.token}-{i}",
                veth_root=f"{NETNS_PREFIX}{self.token}{i}r",
                veth_host=self.host_ifnames.get(i, f"{NETNS_PREFIX}{self.token}{i}n"),
                root_addr=str(base + 4 * i + 1),
                host_addr=str(base + 4 * i + 2),
            )
            self._nets[name] = net
            _ip("netns", "add", net.name)
            _ip("link", "add", net.veth_root, "type", "veth", "peer", "name", net.veth_host,
                "netns", net.name)
            _ip("addr", "add", f"{net.root_addr}/30", "dev", net.veth_root)
            _ip("link", "set", net.veth_root, "up")
            _ip("addr", "add", f"{net.host_addr}/30", "dev", net.veth_host, netns=net.name)
            _ip("link", "set", net.veth_host, "up", netns=net.name)
            _ip("link", "set", "lo", "up", netns=net.name)
            if self.routed:
                _ip("route", "add", str(self.subnet), "via", net.root_addr, netns=net.name)
                _set_forwarding(net.veth_root)
            addrs.append(net.host_addr)
        return addrs

    def _host_port(self, addr: str) -> int:
        return 22  # the namespace is ours alone: the standard port is free

    def _host_netns(self, name: str) -> Optional[str]:
        net = self._nets.get(name)
        return net.name if net else None

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """A /24 of NETNS_SUPERNET that no address or route of this machine touches."""
        used = []
        for line in (_ip("-4", "-o", "addr", "show") + _ip("-4", "route", "show", "table",
                                                            "all")).splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    if "/" in word or word.count(".") == 3:
                        used.append(ipaddress.IPv4Network(word, strict=False))
        candidates = list(NETNS_SUPERNET.subnets(new_prefix=24))
        random.shuffle(candidates)
        for net in candidates:
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        raise LabError(f"no free /24 left in {NETNS_SUPERNET}")

    # -- faults ------------------------------------------------------------------------

    def veth_root(self, host: LabHost) -> str:
        """The root-namespace end of ``host``'s veth pair (what ``link_down`` sets down)."""
        return self._nets[host.name].veth_root

    def set_link(self, host: LabHost, up: bool) -> None:
        """``ip link set <root-side veth> up|down``: cut or restore the host's only wire."""
        _ip("link", "set", self.veth_root(host), "up" if up else "down")

    def link_down(self, host: LabHost) -> None:
        self.set_link(host, False)

    def link_up(self, host: LabHost) -> None:
        self.set_link(host, True)

    def drop(self, src: LabHost, dst: LabHost, port: int) -> None:
        """An nft rule in ``src``'s namespace that drops its TCP traffic to ``dst`` on
        ``port`` (silence, as a firewall rule does); the namespace's end removes it."""
        net = self._nets[src.name]
        nft = require_tool("nft")
        script = (f"add table inet fdlt\n"
                  "add chain inet fdlt out { type filter hook output priority 0; }\n"
                  f"add rule inet fdlt out ip daddr {self._nets[dst.name].host_addr} "
                  f"tcp dport {int(port)} drop\n")
        done = subprocess.run([require_tool("ip"), "netns", "exec", net.name, nft, "-f", "-"],
                              input=script, capture_output=True, text=True, timeout=30,
                              check=False)
        if done.returncode != 0:
            raise LabError(f"nft in {net.name} failed: {done.stderr.strip()}")

    def add_interface(self, host: LabHost, name: str, cidr: str) -> None:
        """An interface in ``host``'s namespace, up, with ``cidr``: an address that no
        peer can reach (nothing routes to it). A veth whose other end stays in the same
        namespace (containers often lack the dummy driver)."""
        net = self._nets[host.name]
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p", netns=net.name)
        _ip("addr", "add", cidr, "dev", name, netns=net.name)
        for end in (name, f"{name}p"):
            _ip("link", "set", end, "up", netns=net.name)

    def host_ifname(self, host: LabHost) -> str:
        """The name of ``host``'s interface inside its namespace."""
        return self._nets[host.name].veth_host

    def namespace_pids(self, host: LabHost) -> list[int]:
        """Pids of every process inside ``host``'s network namespace."""
        net = self._nets.get(host.name)
        return _netns_pids(net.name) if net else []

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the lab's processes, then remove its namespaces, veths and route."""
        try:
            super().stop()
        finally:
            self._teardown_network()

    def _teardown_network(self) -> None:
        skip = own_lineage()
        for host_name, net in list(self._nets.items()):
            procs = []
            for pid in _netns_pids(net.name):
                if pid in skip:
                    continue
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(pid))
            terminate(procs, 1.0)
            _ip("link", "del", net.veth_root, check=False)
            _ip("netns", "del", net.name, check=False)
            del self._nets[host_name]
        if self._blackhole and self.subnet is not None:
            _ip("route", "del", "blackhole", str(self.subnet), check=False)
            self._blackhole = False
