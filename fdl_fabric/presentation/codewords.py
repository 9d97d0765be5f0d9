"""The words of code and environment: the run's code id, each host's sync, setup
(merged into `words`' one table; kept apart so each wording module stays one concern)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ..events import Event, Name
from .speakers import L

Words = Callable[[Event, Mapping[str, Any]], str]


def size(n: float) -> str:
    """Bytes as people read them: ``812 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _files(n: int) -> str:
    return f"{n:,} file" + ("" if n == 1 else "s")


def _code(e: Event, d: Mapping[str, Any]) -> str:
    excluded = f", {d['excluded']:,} left out by the ignore rules" if d.get("excluded") else ""
    return (f"{L}code {d['code_id']}: {_files(d['files'])}, {size(d['bytes'])} from "
            f"{d['src']}{excluded}")


def _code_synced(e: Event, d: Mapping[str, Any]) -> str:
    if d.get("had"):
        return f"{L}code on {e.host}: already there ({d['dir']})"
    return (f"{L}code on {e.host}: {_files(d['files'])}, {size(d['bytes'])} sent "
            f"({d['dir']})")


def _code_in_place(e: Event, d: Mapping[str, Any]) -> str:
    had = d.get("had", 0)
    if had == d["hosts"]:
        return f"{L}code in place on {d['hosts']} host(s): nothing to send"
    return (f"{L}code in place on {d['hosts']} host(s): {size(d['bytes'])} sent in "
            f"{d['seconds']:.1f} s" + (f" ({had} had it already)" if had else ""))


def _made(d: Mapping[str, Any]) -> str:
    return f" (made {', '.join(d['made'])})" if d.get("made") else ""


def _setup_done(e: Event, d: Mapping[str, Any]) -> str:
    if d.get("skipped"):
        links = f"; links {', '.join(d['made'])}" if d.get("made") else ""
        return (f"{L}setup on {e.host}: skipped, done before for this command and its "
                f"inputs{links}")
    return f"{L}setup on {e.host}: done in {d['seconds']:.1f} s{_made(d)}"


def _setup_failed(e: Event, d: Mapping[str, Any]) -> str:
    tail = d.get("tail") or []
    if not tail:
        return f"{L}setup failed on {e.host}: {d['why']} (it wrote nothing)"
    return "\n".join([f"{L}setup failed on {e.host}: {d['why']}; its last lines:",
                      *(f"  {t}" for t in tail)])


CODE_WORDS: dict[Name, Words] = {
    Name.CODE: _code,
    Name.CODE_SYNCED: _code_synced,
    Name.CODE_IN_PLACE: _code_in_place,
    Name.SETUP_OUTPUT: lambda e, d: f"[{e.host}:setup] {d['text']}",
    Name.SETUP_DONE: _setup_done,
    Name.SETUP_FAILED: _setup_failed,
    Name.VERSIONS_AGREE: lambda e, d: f"{L}versions: {d['reason']}",
    Name.FLEET_CHECK_PASSED: lambda e, d: (
        f"{L}{d['check']}: " + ("" if not e.host or e.host.startswith("(") else f"{e.host}: ")
        + str(d["reason"])),
    Name.SETUP_NOT_RUN: lambda e, d: (f"{L}setup is not run: --no-sync (it runs in the "
                                      "synced folder)"),
}
