"""Python's cycle collector kept off the launch's long-lived objects (issue 35).

A launch at 1,024 hosts x 8 ranks holds a few hundred thousand objects for its whole
life: the cluster spec, the plan (each rank's argv and env), the hosts' sessions. Every
full collection of Python's cycle collector walks all of them, and the bursts of a big
launch (8,192 ranks starting, then joining, then ending) set off several: 0.28 s of the
launcher's CPU before every rank ran, and 0.3 s between the ranks' end and the exit,
measured by `gc.callbacks` under bench/emulator.py.

`gc.freeze` moves every object that exists at that moment to a generation no collection
walks. Reference counting still frees them when they go; only garbage in a cycle among
them waits, until the launch ends and `gc.unfreeze` gives them back to the collector.
The launch settles once its input is read, at each attempt's start (the plan, the
sessions and the agents are there by then), and when every rank runs and when the
cohort forms (each rank's record and connection are there by then): it hears those two
as one of the launch's event sinks.

A program that calls the launch in its own process and freezes its own heap (before a
fork, say), or has turned the collector off, is left as it is: nothing is frozen or
unfrozen under it.

A command's exit is the same walk once more. The interpreter's teardown collects cycles
several times while it clears the modules: 60-110 ms of every ``inv launch``'s exit on
the lab's machine, after its verdict was printed (`left_to_the_os`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

from ..events import Event, Name

#: The events after which what exists lives as long as the attempt.
SETTLE_AFTER = frozenset({Name.ALL_RANKS_RUNNING, Name.COHORT_FORMED})


class LongLived:
    """The launch's say over the collector: `settle` freezes what exists, when the
    launch may (`long_lived`)."""

    def __init__(self, owned: bool) -> None:
        #: Whether this launch froze the heap and unfreezes it at its end.
        self.owned = owned

    def settle(self) -> None:
        """Everything that exists now lives as long as the launch: out of every walk of
        the cycle collector from now on."""
        if self.owned:
            gc.freeze()

    def emit(self, event: Event) -> None:
        """An event sink: settles after `SETTLE_AFTER` (any thread: a freeze is a
        list splice under the GIL)."""
        if event.name in SETTLE_AFTER:
            self.settle()


@contextlib.contextmanager
def long_lived() -> Iterator[LongLived]:
    """A launch's `LongLived`; what it froze goes back to the collector at the end."""
    heap = LongLived(gc.isenabled() and gc.get_freeze_count() == 0)
    try:
        yield heap
    finally:
        if heap.owned:
            heap.owned = False  # a sink still on the bus settles nothing after this
            gc.unfreeze()


_left: list[bool] = []


def left_to_the_os() -> None:
    """At this program's exit, the heap is left to the operating system: `gc.freeze` as
    the interpreter's teardown begins, so none of its collections walks what the command
    held (measured: 110 ms -> 15 ms from the last line to the exit, with the launcher's
    modules loaded). Only a command-line program asks for this (the tasks do, as the
    program's last act is theirs): a garbage cycle left at the exit is then not
    finalized, which nothing here relies on (the run's record and logs are closed by the
    launch; the standard streams are flushed by the interpreter as ever)."""
    if not _left:
        _left.append(True)
        atexit.register(gc.freeze)


__all__ = ["SETTLE_AFTER", "LongLived", "left_to_the_os", "long_lived"]
