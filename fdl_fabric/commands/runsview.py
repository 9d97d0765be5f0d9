"""``status``'s first part: this controller's runs, from their records (`runs`).

Detached and foreground alike, each with its state: starting, running (attempt k),
stopping, ended with its verdict and exit code, or lost (its launcher is gone without
a verdict). Ended and lost runs are shown with ``--all``; the hosts' view of ``status``
follows (`status`). Each row as `masking` lets it be shown: a record written before
the rule knew a secret (an older launcher's) still shows none.
"""

from __future__ import annotations

import time
from typing import Any

from ..masking import mask_data
from ..runs import place
from ..runs.reading import view


def controller_runs(*, every_run: bool) -> dict[str, Any]:
    """The data of the view: each run's row, oldest first; ended ones only when
    ``every_run``."""
    try:
        root = str(place.runs_root(create=False))
    except OSError as exc:
        return {"folder": str(exc), "runs": [], "all": every_run, "ended_hidden": 0,
                "now": time.time()}
    rows = [mask_data(view(folder).row()) for folder in place.records()]
    shown = rows if every_run else [r for r in rows if r["state"] not in ("ended", "lost")]
    return {"folder": root, "runs": shown, "all": every_run,
            "ended_hidden": len(rows) - len(shown), "now": time.time()}


__all__ = ["controller_runs"]
