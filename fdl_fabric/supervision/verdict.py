"""The verdicts a run can end with (the policy picks one; the result carries it)."""

from __future__ import annotations

from enum import Enum


class Verdict(str, Enum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"
    #: No rank wrote a line or reported progress for ``hang_timeout``: stopped, restartable.
    HUNG = "hung"
    INTERRUPTED = "interrupted"
