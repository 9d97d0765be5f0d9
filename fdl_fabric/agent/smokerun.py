"""The collective smoke test on this host: each rank slot runs a tiny program with the
run's rank environment and interpreter (`fdl_fabric.preflight.smoke`). Being written."""

from __future__ import annotations

from typing import Any, Callable, Dict


def run(request: Dict[str, Any], beat: Callable[[float], None]) -> Dict[str, Any]:
    """Every slot of ``request``, bounded; one entry per slot."""
    return {"slots": [], "error": "the smoke test is not built yet"}
