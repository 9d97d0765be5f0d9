"""The words of a launch being set up: the run's first line, the plan's warnings about
loopback addresses, tunnels to the coordinator and the open-file limit (merged into
`words`' one table; kept apart so each wording module stays one concern)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ..events import Event, Name
from .speakers import L

Words = Callable[[Event, Mapping[str, Any]], str]


def _launch(e: Event, d: Mapping[str, Any]) -> str:
    hosts = ", ".join(f"{h}: r{rs[0]}-r{rs[-1]}" if len(rs) > 1 else f"{h}: r{rs[0]}"
                      for h, rs in d["ranks"].items())
    return (f"{L}run {d['run_id']}: {d['world_size']} rank(s) on {len(d['ranks'])} host(s) "
            f"({hosts})")


def _tunnel_turning_away(e: Event, d: Mapping[str, Any]) -> str:
    why = {"busy": f"more than {d['limit']} open at once",
           "files": "too few open files left to the launcher",
           "silent": f"more than {d['waiting_max']} waiting for a first frame, or waiting "
                     f"{d['waiting_seconds']:g}s",
           "garbled": "first bytes that are no frame"}.get(d["why"], d["why"])
    return (f"{L}tunnel {e.host}:127.0.0.1:{d['port']}: turning away forwarded connections "
            f"({why}); someone on {e.host} may be flooding the port. Open connections stay "
            "open; the count follows when the tunnel closes")


def _tunnel_turned_away(e: Event, d: Mapping[str, Any]) -> str:
    parts = []
    if d.get("busy"):
        parts.append(f"{d['busy']:,} beyond {d['limit']} open at once")
    if d.get("files"):
        parts.append(f"{d['files']:,} for want of open files")
    if d.get("silent"):
        parts.append(f"{d['silent']:,} that sent no first frame")
    if d.get("garbled"):
        parts.append(f"{d['garbled']:,} whose first bytes were no frame")
    return (f"{L}tunnel {e.host}:127.0.0.1:{d['port']}: turned away {d['turned_away']:,} "
            f"forwarded connection(s) ({'; '.join(parts)})")


def _tunnel_exposed(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}tunnel {e.host}:127.0.0.1:{d['port']} listens on "
            f"{' and '.join(d['addresses'])} too, not only on loopback (GatewayPorts in "
            f"{e.host}'s sshd_config): anyone who reaches {e.host} can connect to the "
            "coordinator through it (a join still needs the run's key); set GatewayPorts no "
            "or clientspecified there")


def _open_files_raised(e: Event, d: Mapping[str, Any]) -> str:
    hard = "unlimited" if d.get("hard") is None else d["hard"]
    return (f"{L}raised the open-file limit (RLIMIT_NOFILE) from {d['was']} to {d['now']} "
            f"(hard limit {hard}): this run needs about {d['needed']}")


def _loopback_master(e: Event, d: Mapping[str, Any]) -> str:
    fix = ("pass --master-addr ADDR, an address of the first host that the others reach"
           if d.get("flags") else "give the first worker an `addr:` the others reach")
    return (f"{L}MASTER_ADDR is {d['address']}, a loopback address, but {_remote(d)} dial it "
            f"from another machine: {fix}")


#: Hosts a warning names one by one; beyond, it says how many more (1,024 hosts would
#: make one warning of 30 KB).
HOSTS_NAMED = 8


def _remote(d: Mapping[str, Any]) -> str:
    items = list(d["remote"].items())
    named = ", ".join(f"{h} ({a})" for h, a in items[:HOSTS_NAMED])
    more = len(items) - HOSTS_NAMED
    return named + (f" and {more} more host{'s' if more > 1 else ''}" if more > 0 else "")


#: The words of a launch's set-up events.
SETUP_WORDS: dict[Name, Words] = {
    Name.LAUNCH: _launch,
    Name.CONNECTED: lambda e, d: f"{L}connected to {e.host}",
    Name.TUNNEL_OPENED: lambda e, d: (f"{L}tunnel {e.host}:127.0.0.1:{d['port']} -> controller "
                                      f"{d['target']}:{d['port']}"),
    Name.TUNNEL_TURNING_AWAY: _tunnel_turning_away,
    Name.TUNNEL_TURNED_AWAY: _tunnel_turned_away,
    Name.TUNNEL_EXPOSED: _tunnel_exposed,
    Name.OPEN_FILES_RAISED: _open_files_raised,
    Name.PLAN_LOOPBACK_MASTER: _loopback_master,
}
