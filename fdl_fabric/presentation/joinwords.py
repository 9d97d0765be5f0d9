"""The words of the join window (workers that dial in, docs/join.md), merged into
`words`' one table. The lines start ``cluster join: `` as flodl's do, so one grep finds
a window's story: open, who joined, who was refused, formed or failed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ..events import Event, Name
from .speakers import L

Words = Callable[[Event, Mapping[str, Any]], str]

#: The speaker of every join line.
J = "cluster join: "


def _target(d: Mapping[str, Any]) -> str:
    return "none" if d.get("target") is None else str(d["target"])


def _open(e: Event, d: Mapping[str, Any]) -> str:
    token = (f"token from {d['token_file']}" if d.get("token_file_given")
             else f"token written to {d['token_file']} (0600; hand it to the joiners)")
    return (f"{J}window open on {d['address']} (quorum {d['quorum']} ranks, target "
            f"{_target(d)}, window {d['window']:g}s, cap {d['cap']:g}s, start {d['start']}, "
            f"{'any host with the token' if d['discovery'] else 'the roster only'}); "
            f"{token}")


def _admitted(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{J}host {e.host!r} joined from {d['peer']} with {d['ranks']} rank(s) — "
            f"{d['ranks_in']} rank(s) in, quorum {d['quorum']}, target {_target(d)}")


def _refused(e: Event, d: Mapping[str, Any]) -> str:
    who = f"host {e.host!r} from {d['peer']}" if e.host else d["peer"]
    more = "; further refusals of it are counted" if d.get("last") else ""
    return f"{J}refused a join attempt of {who}: {d['reason']}{more}"


def _refusals(e: Event, d: Mapping[str, Any]) -> str:
    sources = ", ".join(d["sources"]) + (f" and {d['more_sources']} more"
                                         if d.get("more_sources") else "")
    return f"{J}refused {d['count']:,} more join attempt(s) (from {sources}); the window goes on"


def _formed(e: Event, d: Mapping[str, Any]) -> str:
    missing = (f"; not joined: {', '.join(d['missing'])}" if d.get("missing") else "")
    return (f"{J}world formed — {d['ranks']} rank(s) across {d['hosts']} host(s) after "
            f"{d['after']:.1f}s ({d['why']}){missing}")


def _failed(e: Event, d: Mapping[str, Any]) -> str:
    """The verdict's cause (said by the launcher: it ends the run)."""
    if d["why"] == "operator start not received":
        return (f"{L}operator start not received: {d['ranks_in']} rank(s) staged with quorum "
                f"met, but start: manual got no `fdl-fabric start` within the join window's "
                f"max_join_timeout hard cap ({d['cap']:g}s)")
    return (f"{L}quorum not met: {d['ranks_in']}/{d['quorum']} ranks joined within the join "
            f"window's max_join_timeout hard cap ({d['cap']:g}s)")


def _view(e: Event, d: Mapping[str, Any]) -> str:
    """``fdl-fabric status``'s view of one window: its phase, who is in, the time left."""
    if d.get("error"):
        return f"join window at {d['address']}: {d['error']}"
    w = d["window"]
    start = w["start"] + (" (started)" if w.get("armed") else "")
    head = (f"join window of run {w['run_id']} at {w['address']}: {w['phase']} — "
            f"{w['ranks_in']} rank(s) in (quorum {w['quorum']}, target {_target(w)}), "
            f"start {start}")
    if w["phase"] in ("waiting", "staging"):
        head += (f"; {w['window_left']:.0f}s left in the window, {w['cap_left']:.0f}s to "
                 "the cap")
    hosts = [f"  {host}  {info['ranks']} rank(s)"
             + (f"  from {info['peer']}" if info.get("peer") else "")
             for host, info in sorted(w["hosts"].items())]
    return "\n".join([head, *hosts])


def _planned(e: Event, d: Mapping[str, Any]) -> str:
    """A dry run's line for the window: the world it will take, nothing listened to."""
    who = ("any host with the token" if d["discovery"] else "")
    if d["joining"]:
        named = ", ".join(d["joining"])
        who = f"{named}" + (f", and {who}" if who else "")
    token = (f"the token in {d['token_file']}" if d.get("token_file")
             else "a fresh token, written into the run's record")
    return (f"join window on {d['address']} (not opened: a dry run): quorum {d['quorum']} "
            f"ranks, target {_target(d)}, window {d['window']:g}s, cap {d['cap']:g}s, start "
            f"{d['start']}; it admits {who} with {token}")


#: The words of the join window's events.
JOIN_WORDS: dict[Name, Words] = {
    Name.JOIN_WINDOW_OPEN: _open,
    Name.JOIN_ADMITTED: _admitted,
    Name.JOIN_REFUSED: _refused,
    Name.JOIN_REFUSALS: _refusals,
    Name.JOIN_LEFT: lambda e, d: (f"{J}host {e.host!r} ({d['peer']}) left before the world "
                                  "formed; its ranks no longer count"),
    Name.JOIN_REJOINED: lambda e, d: (f"{J}host {e.host!r} joined again from {d['peer']}: "
                                      "ready if the run has another attempt"),
    Name.JOIN_START_ARMED: lambda e, d: (f"{J}operator start received ({d['ranks_in']} "
                                         "rank(s) in)"),
    Name.JOIN_WORLD_FORMED: _formed,
    Name.JOIN_WINDOW_FAILED: _failed,
    Name.JOIN_WINDOW_VIEW: _view,
    Name.JOIN_WINDOW_PLANNED: _planned,
}
