"""Transitional: `RankOutput` is `fdl_fabric.supervision.rankoutput` now (it renders
nothing, and presentation must not import supervision).

This re-export keeps the launcher's import working until its import line follows; it is
the one upward edge left here, and goes with it.
"""

from __future__ import annotations

from ..supervision.rankoutput import RankOutput

__all__ = ["RankOutput"]
