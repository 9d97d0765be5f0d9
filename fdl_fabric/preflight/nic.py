"""The interface the ranks' collectives use: ``nccl_socket_ifname`` (NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME), judged on each host and across hosts; pure.

Two checks, with different costs:
- on each host (cheap, every launch): the interface a setting names exists, is up and
  has an address (`iface_row`, from the agent's ``ifaces`` fact);
- across hosts (the fleet check, `fdl_fabric.preflight.matrix`): that address is reached
  by every peer, and where nothing is set on a host with several interfaces, which of
  them every peer reaches (`reach_rows`), so the value to set can be suggested.

NCCL reads NCCL_SOCKET_IFNAME as a comma list of name *prefixes* (``=eth0`` an exact name,
``^docker`` an exclusion); Gloo reads GLOO_SOCKET_IFNAME as exact names. A setting is
judged by the rules of the variable that carries it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .facts import ControllerFacts, HostFacts
from .probe import HostPlan, IfnameSetting
from .report import Check, Status


def parse_ifaces(raw: str) -> dict[str, dict[str, Any]]:
    """The agent's ``ifaces`` value (name -> up, addrs); {} when unreadable."""
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _present(ifaces: Mapping[str, Any]) -> str:
    names = [n for n in ifaces if n != "lo"]
    return ", ".join(sorted(names)) or "none but lo"


def selected(setting: IfnameSetting, ifaces: Mapping[str, Mapping[str, Any]]
             ) -> list[tuple[str, str]]:
    """(interface, address) pairs the setting selects that are up with an address."""
    return [(name, str(info["addrs"][0])) for name, info in ifaces.items()
            if setting.matches(name) and info.get("up") and info.get("addrs")]


def _setting_problem(setting: IfnameSetting, ifaces: Mapping[str, Mapping[str, Any]]
                     ) -> Optional[str]:
    """Why the setting selects nothing usable on this host, else None."""
    named = [n for n in ifaces if setting.matches(n)]
    label = f"{setting.source} {setting.value}"
    if not named:
        return f"{label}: no such interface on this host (it has {_present(ifaces)})"
    down = [n for n in named if not ifaces[n].get("up")]
    if len(down) == len(named):
        return f"{label}: {', '.join(down)} is down (`ip link set {down[0]} up`)"
    if not selected(setting, ifaces):
        return f"{label}: {', '.join(named)} has no IPv4 address"
    return None


def iface_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> list[Check]:
    """The ``nic`` row of each setting on this host: the interface exists, is up, has an
    address (cheap: every launch). Nothing when no setting names one."""
    raw = facts.values.get("ifaces")
    if not plan.ifnames or raw is None:
        return []
    ifaces = parse_ifaces(raw)
    rows = []
    for setting in plan.ifnames:
        if setting.excludes_only:
            continue
        problem = _setting_problem(setting, ifaces)
        if problem is not None:
            rows.append(Check(plan.host, "nic", Status.FAIL,
                              f"{problem}: the ranks' collectives would fail or hang at init"))
        else:
            got = ", ".join(f"{n} {a}" for n, a in selected(setting, ifaces))
            rows.append(Check(plan.host, "nic", Status.OK,
                              f"{setting.source} {setting.value}: up with {got}"))
    return rows


def candidates(ifaces: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Interfaces NCCL or Gloo might pick by themselves: up, not loopback, with an IPv4
    address (NCCL skips ``lo`` and ``docker*`` unless told)."""
    return sorted((name, str(info["addrs"][0])) for name, info in ifaces.items()
                  if info.get("up") and info.get("addrs") and name != "lo"
                  and not name.startswith("docker")
                  and not str(info["addrs"][0]).startswith("127."))


def reach_rows(host: str, settings: Sequence[IfnameSetting],
               reached: Mapping[tuple[str, str], Sequence[tuple[str, str]]]) -> list[Check]:
    """The cross-host ``nic`` rows of one host from what its peers' dials found:
    ``reached`` maps (interface, address) -> [(peer, why)] of the peers that could NOT
    reach it (empty: every peer did).

    With a setting: a FAIL per selected interface a peer cannot reach. Without one, on a
    host with several candidate interfaces: which reaches every peer, suggested as the
    value to set (a WARN when some do not: NCCL or Gloo may pick one of those).
    """
    if not reached:
        return []
    if settings:
        return [_unreached_row(host, iface, addr, failed, settings)
                for (iface, addr), failed in sorted(reached.items()) if failed]
    good = sorted(iface for (iface, _), failed in reached.items() if not failed)
    bad = sorted((iface, addr, failed) for (iface, addr), failed in reached.items() if failed)
    if not bad:
        return [Check(host, "nic", Status.OK, f"{', '.join(good)}: every peer reaches each "
                      "of them; unset nccl_socket_ifname is fine")]
    unreached = "; ".join(f"{i} {a} not from {_peers(f)}" for i, a, f in bad)
    if not good:
        return [Check(host, "nic", Status.FAIL,
                      f"no interface of this host is reached by every peer ({unreached})")]
    return [Check(host, "nic", Status.WARN,
                  f"{', '.join(good)} reaches every peer, but {unreached}: NCCL or Gloo "
                  f"may pick the wrong one; set nccl_socket_ifname: {good[0]}")]


def _peers(failed: Sequence[tuple[str, str]]) -> str:
    names = [p for p, _ in failed]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} ({failed[0][1]})"


def _unreached_row(host: str, iface: str, addr: str, failed: Sequence[tuple[str, str]],
                   settings: Sequence[IfnameSetting]) -> Check:
    label = " / ".join(f"{s.source} {s.value}" for s in settings)
    return Check(host, "nic", Status.FAIL,
                 f"{label}: {iface} {addr} is not reached from {_peers(failed)}: the ranks "
                 "there cannot connect to this host's ranks")
