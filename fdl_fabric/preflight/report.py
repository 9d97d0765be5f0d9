"""The pre-flight report: one row per host and check, ok / warn / FAIL and a one-line why.

Rendering it (a table, or JSON) is `fdl_fabric.presentation`'s job: the command emits
`Name.CHECK_REPORT` and `Name.CHECK_VERDICT` with this data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

#: The host column of checks that concern the controller itself (not a worker name:
#: a worker may well be called "controller").
CONTROLLER = "(controller)"



class Status(str, Enum):
    """A check's verdict. FAIL is upper case so it stands out in a column of ``ok``."""

    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


_SEVERITY = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}


def worst(statuses: Sequence[Status]) -> Status:
    return max(statuses, key=lambda s: _SEVERITY[s], default=Status.OK)


@dataclass(frozen=True)
class Check:
    """One row of the report: a verdict about one thing on one host, with a one-line why."""

    host: str
    name: str
    status: Status
    reason: str


@dataclass
class Report:
    """Every check of one pre-flight, in display order (controller first, then roster order)."""

    checks: list[Check]
    #: Wall-clock seconds the whole pre-flight took (all hosts in parallel).
    elapsed: float = 0.0

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.WARN]

    def exit_code(self) -> int:
        """0 when nothing FAILs (warnings do not block a launch), 1 otherwise."""
        return 1 if self.failed() else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": [
                {"host": c.host, "check": c.name, "status": c.status.value, "reason": c.reason}
                for c in self.checks
            ],
            "ok": not self.failed(),
        }

    def verdict_data(self) -> dict[str, Any]:
        """The facts of the report's last line (`words`: ``prebuild-check: passed: …``)."""
        counts = {s.value: n for s in Status if (n := sum(1 for c in self.checks
                                                           if c.status is s))}
        return {"failed": bool(self.failed()), "counts": counts,
                "hosts": len({c.host for c in self.checks if c.host != CONTROLLER}),
                "elapsed": round(self.elapsed, 3)}
