"""The fleet pre-flight on this host: a listener on the ports the job will use, and dials
to the other hosts' listeners. Being written."""

from __future__ import annotations

import selectors
from typing import Any, Callable, Dict, Optional

Send = Callable[[int, Optional[Dict[str, Any]]], None]


class FleetCheck:
    def __init__(self, send: Send, sel: selectors.BaseSelector) -> None:
        self.send = send
        self.sel = sel

    def on_request(self, request: Dict[str, Any], beat: Callable[[float], None]) -> None:
        from fdl_fabric.agent import wire

        self.send(wire.FACTS, {"fleet": {"error": "not built yet"}})

    def close(self) -> None:
        """Release every port it holds."""
