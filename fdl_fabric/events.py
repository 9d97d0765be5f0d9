"""Run events: what the launcher's workers report, decoupled from display.

Transport and supervision code never prints. They emit `Event`s; one place
(`output.Console`) renders them, and the log writer records them. This keeps
the supervisor testable and lets the live view, plain CI output and the
events.jsonl log all describe the same run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Protocol


class Kind(str, Enum):
    LAUNCH = "launch"
    CONNECT = "connect"
    SPAWN = "spawn"
    OUTPUT = "output"
    JOIN = "join"
    FORMED = "formed"
    EXIT = "exit"
    DEATH = "death"
    TOLERATED = "tolerated"
    STOPPING = "stopping"
    RESTART = "restart"
    SHUTDOWN = "shutdown"
    HANG = "hang"
    STACKS = "stacks"
    VERDICT = "verdict"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"


@dataclass(frozen=True)
class Event:
    kind: Kind
    message: str
    host: Optional[str] = None
    rank: Optional[int] = None
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time": round(self.time, 6), "event": self.kind.value,
                               "message": self.message}
        if self.host is not None:
            out["host"] = self.host
        if self.rank is not None:
            out["rank"] = self.rank
        out.update(self.data)
        return out


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...


class EventBus:
    """Fans one event out to every handler; handlers must not raise."""

    def __init__(self, *handlers: EventSink) -> None:
        self._handlers = list(handlers)
        self._lock = threading.Lock()

    def add(self, handler: EventSink) -> None:
        with self._lock:
            self._handlers.append(handler)

    def emit(self, event: Event) -> None:
        with self._lock:
            handlers = list(self._handlers)
        for handler in handlers:
            handler.emit(event)

    def __call__(self, kind: Kind, message: str, **kw: Any) -> None:
        data = kw.pop("data", {})
        self.emit(Event(kind, message, data=data, **kw))


class EventLog:
    """Keeps every event in memory, so a caller can look back at what happened."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: Kind) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.kind is kind]
