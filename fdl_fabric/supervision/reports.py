"""Where the report records used to live: they are `fdl_fabric.reports` now (vocabulary,
below transport, which makes them, and supervision, which consumes them).

Kept so the modules that still import ``supervision.reports`` keep working until their
import lines follow (a re-export, not a copy).
"""

from __future__ import annotations

from ..reports import (
    AgentDone,
    AgentError,
    AgentGone,
    AgentReady,
    DeclaredDead,
    Exited,
    Facts,
    Joined,
    Output,
    Preflight,
    Report,
    Request,
    Runs,
    SetupDone,
    SetupOutput,
    Signaled,
    Spawned,
    SpawnFailed,
    Stacks,
    Swept,
    SyncAnswer,
    Verified,
)

__all__ = [
    "AgentDone", "AgentError", "AgentGone", "AgentReady", "DeclaredDead", "Exited", "Facts",
    "Joined", "Output", "Preflight", "Report", "Request", "Runs", "SetupDone", "SetupOutput",
    "Signaled", "SpawnFailed", "Spawned", "Stacks", "Swept", "SyncAnswer", "Verified",
]
