"""One record shape for every event written as JSON: ``--json`` and events.jsonl.

Both sinks write the same object for the same event (docs/events.md is its reference)::

    {"v": 1, "time": 1733337600.123456, "kind": "death", "name": "rank_failed",
     "host": "node1", "rank": 3, "attempt": 0, "message": "cluster launcher: ...",
     "data": {"exit": {...}, "ok": false}}

``v`` is the schema's version: new names, new kinds and new keys in ``data`` keep it; a
field removed, renamed or changed in meaning raises it. ``data`` is the event's own data,
nested, so a data key can never collide with a field of the record. The sinks differ only
in what they leave out, each said in docs/events.md: events.jsonl keeps rank output
in the rank's files (no ``output`` records), and a bulky value in a file of its own
(``error_file``, the stacks' ``ranks``); ``--json`` has no raw bytes.

Every record but rank output goes through `masking` here, its data and its words alike,
so neither sink can keep a secret the rule hides (a URL's password, a token, a
``secret_env`` value). Rank output is the rank's own bytes, kept as they are, like its
log files.

`upgrade` reads the flat records events.jsonl had before version 1 (``event`` for the
kind, data keys at the top), so a log written by an older launcher still plots.
"""

from __future__ import annotations

from typing import Any, Optional

from ..events import Event, Kind, Name
from ..masking import mask_data, mask_text
from .words import render

#: The version of the record shape (the ``v`` field).
VERSION = 1
#: The fields of a record besides ``data``, in the order they are written.
FIELDS = ("v", "time", "kind", "name", "host", "rank", "attempt", "message", "data")


def record(event: Event, *, attempt: Optional[int] = None,
           data: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """``event`` as a record, every field present: ``attempt`` null outside a launch,
    ``message`` (its words) null for rank output, ``data`` the event's (or the given
    one: a sink that moved a bulky value to a file). Secrets masked (`masking`): the
    words are said of the masked data, then masked again, as the data is."""
    out: dict[str, Any] = {"v": VERSION, "time": round(event.time, 6),
                           "kind": event.kind.value, "name": event.name.value,
                           "host": event.host, "rank": event.rank, "attempt": attempt,
                           "message": None}
    given = event.data if data is None else data
    if event.kind is Kind.OUTPUT:
        body = dict(given)
        body.pop("raw", None)  # rank output's bytes: the rank's log file has them
    else:
        out["message"] = mask_text(render(event))  # `render` masks the data it words
        body = mask_data(given)  # a copy, or the `masking.Masked` it was already
        if "raw" in body:
            body = {k: v for k, v in body.items() if k != "raw"}
    out["data"] = body
    return out


def masked(event: Event) -> Event:
    """``event`` with its data as `masking` lets it be shown: what a sink renders or
    keeps of an event that is not rank output."""
    if event.kind is Kind.OUTPUT:
        return event
    shown = mask_data(event.data)
    if shown is event.data:
        return event
    return Event(event.name, host=event.host, rank=event.rank, data=shown, time=event.time)


class Attempts:
    """Which attempt the events belong to, learnt from the events themselves: the
    launch's first event (kind ``launch``) starts attempt 0, and a restart
    (``restarting``, then ``attempt_hosts``) names the next. None until a launch began
    (checks before it, and the other commands, have no attempt): both sinks see the
    same events, so they say the same."""

    def __init__(self, start: Optional[int] = None) -> None:
        self.current = start

    def see(self, event: Event) -> Optional[int]:
        """The attempt of ``event`` (which may begin one)."""
        if event.kind is Kind.LAUNCH and self.current is None:
            self.current = 0
        elif event.name in (Name.RESTARTING, Name.ATTEMPT_HOSTS) \
                and isinstance(event.data.get("attempt"), int):
            self.current = event.data["attempt"]
        return self.current


def upgrade(raw: dict[str, Any]) -> dict[str, Any]:
    """A record of any version as version 1: a flat record of before (``event``, the data
    at the top) gets its fields and its nested ``data``."""
    if "v" in raw or "event" not in raw:
        return raw
    top = {"time", "event", "name", "host", "rank", "attempt", "message"}
    out: dict[str, Any] = {"v": VERSION, "time": raw.get("time"), "kind": raw.get("event"),
                           "name": raw.get("name"), "host": raw.get("host"),
                           "rank": raw.get("rank"), "attempt": raw.get("attempt"),
                           "message": raw.get("message")}
    data = {k: v for k, v in raw.items() if k not in top}
    if raw.get("name") in (Name.RESTARTING.value, Name.ATTEMPT_HOSTS.value) \
            and "attempt" in raw:
        data["attempt"] = raw["attempt"]  # flat: the data's attempt was the record's
    out["data"] = data
    return out
