"""Error files: why a rank failed, in its own words (torchrun's ``TORCHELASTIC_ERROR_FILE``).

Every rank gets its own ``TORCHELASTIC_ERROR_FILE`` path (the agent sets it), so a
script whose entry point is decorated with
``torch.distributed.elastic.multiprocessing.errors.record`` writes its uncaught
exception there, exactly as under torchrun. When the rank fails, its agent reads the
file and sends it up with the exit. This module reads it on the controller without
torch: the format is small and stable::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1796282914"}}}

(older torch and hand-written files may put a plain string in ``message``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

#: Lines of the traceback shown in the run summary (the file keeps all of it).
TRACEBACK_LINES = 12


@dataclass(frozen=True)
class RankError:
    """What a failed rank's error file says."""

    message: str
    traceback: str = ""

    def traceback_tail(self, lines: int = TRACEBACK_LINES) -> list[str]:
        return self.traceback.rstrip("\n").splitlines()[-lines:] if self.traceback else []


def parse(text: str) -> Optional[RankError]:
    """The error in a rank's error file; None when the text holds none we can read."""
    if not text.strip():
        return None
    try:
        data: Any = json.loads(text)
    except ValueError:
        first = text.strip().splitlines()[0]
        return RankError(message=first[:500])
    if not isinstance(data, dict):
        return None
    body = data.get("message")
    if isinstance(body, str):
        return RankError(message=body)
    if not isinstance(body, dict):
        return None
    message = str(body.get("message", "")).strip()
    info = body.get("extraInfo")
    extra: dict[str, Any] = info if isinstance(info, dict) else {}
    callstack = extra.get("py_callstack")
    return RankError(message=message or "(no message)",
                     traceback=callstack if isinstance(callstack, str) else "")
