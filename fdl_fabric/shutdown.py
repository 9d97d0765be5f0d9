"""The reason the ranks are told when the cohort must save and stop.

A save-and-shutdown goes on the wire (``{"type": "shutdown", "reason": ...}``, see
docs/protocol.md): the coordinator sends it, and a rank's ``on_shutdown`` callback gets the
sentence. It is part of the protocol, as the coordinator's other reasons to a rank are
(a refused hello, ``BUSY_REASON``), so it is made here, below supervision, from the
policy's event. The renderer (`presentation.words`) gives the same two names these very
words, so each sentence is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from .events import Event, Name

#: The policy's reasons for a save-and-shutdown (`policy.Elastic.on_death`), in words.
SHUTDOWN_REASONS: dict[Name, Callable[[Mapping[str, Any]], str]] = {
    Name.MAX_FAILURE_REACHED: lambda d: (f"max_failure reached ({d['dead']}/{d['world_size']} "
                                         f"dead, threshold {d['limit']})"),
    Name.ALL_RANKS_DEAD: lambda d: f"every rank was lost ({d['dead']}/{d['world_size']} dead)",
}


def shutdown_reason(cause: Event) -> str:
    """What the ranks are told: the sentence of a save-and-shutdown's cause (its name, for
    a cause that is no shutdown reason of the policy's)."""
    words = SHUTDOWN_REASONS.get(cause.name)
    return words(cause.data) if words is not None else cause.name.value
