"""A verdict's cause as data, and back: the JSON-able form of the event that ended a run.

A verdict, a restart and a save-and-shutdown carry their cause inside another event's
data (``cause``), which must stay JSON (events.jsonl, ``--json``). Supervision makes that
form and presentation reads it back to say it, so it is vocabulary: it imports only
`events`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .events import Event, Name


def cause_data(e: Event, **extra: Any) -> dict[str, Any]:
    """An event as the JSON-able ``cause`` of a verdict or a restart."""
    return {"name": e.name.value, "host": e.host, "rank": e.rank, "data": dict(e.data), **extra}


def cause_event(cause: Mapping[str, Any]) -> Event:
    """The event a verdict's ``cause`` (`cause_data`) describes."""
    return Event(_NAMES[cause["name"]], host=cause.get("host"), rank=cause.get("rank"),
                 data=dict(cause.get("data") or {}))


_NAMES = {n.value: n for n in Name}
