"""``setup:`` on the launcher: the command to every host's agent once its tree is in
place, each host's output as ``[host:setup]`` lines, and the first failure ending the
launch before a rank starts.

The key that decides a re-run is computed here, from the manifest: the command and the
content hash of each ``setup_inputs`` file (a missing one counts as missing). A host
that ran setup for the same key before links what setup made (`agent.setupstep`).

When one host's setup fails, the launch ends at once (exit 1, naming the host, with its
last lines above the verdict); the other hosts' setups are stopped by the leash, as the
launch's teardown closes their agents' input, and run again on the next launch since
no record says they succeeded.
"""

from __future__ import annotations

import hashlib
import queue
import time
from collections.abc import Mapping
from typing import Any

from .. import reports
from ..agent import wire
from ..clusterfile.model import SetupSpec
from ..errors import FdlError
from ..events import EventBus, Name
from ..transport.session import AgentSession
from .manifest import Manifest

#: Seconds beyond ``setup_timeout`` the launcher waits for a host's answer (its agent
#: kills the command at the timeout and says so).
ANSWER_MARGIN = 30.0
#: Bytes of one line shown at most; a longer one is cut.
LINE_MAX = 4096


def setup_key(spec: SetupSpec, manifest: Manifest) -> str:
    """What must change for setup to run again on a host that did it."""
    by_rel = {e.rel: e for e in manifest.entries}
    digest = hashlib.sha256(spec.command.encode("utf-8", "surrogateescape") + b"\0")
    for rel in spec.inputs:
        entry = by_rel.get(rel)
        digest.update(f"{rel}\0{entry.ref if entry else '-'}\n".encode("utf-8",
                                                                    "surrogateescape"))
    return digest.hexdigest()[:20]


class Setup:
    """One setup across the hosts of ``dirs`` (host -> its tree, as its agent said)."""

    def __init__(self, spec: SetupSpec, manifest: Manifest, events: EventBus,
                 inbox: queue.SimpleQueue[reports.Report]) -> None:
        self.spec = spec
        self.manifest = manifest
        self.events = events
        self.inbox = inbox
        self.key = setup_key(spec, manifest)
        self.partial: dict[tuple[str, bool], bytes] = {}

    def run(self, sessions: Mapping[str, AgentSession], dirs: Mapping[str, str],
            roots: Mapping[str, str], env: Mapping[str, Mapping[str, str]]) -> None:
        top = sorted({e.rel.split("/", 1)[0] for e in self.manifest.entries})
        for host, folder in dirs.items():
            sessions[host].send(wire.SETUP, {
                "command": self.spec.command, "dir": folder, "root": roots[host],
                "key": self.key, "top": top, "timeout": self.spec.timeout,
                "env": dict(env.get(host, {}))})
        waiting = set(dirs)
        kept: list[reports.Report] = []
        deadline = time.monotonic() + self.spec.timeout + ANSWER_MARGIN
        try:
            while waiting:
                try:
                    report = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise FdlError(f"cluster launcher: setup did not end on "
                                   f"{', '.join(sorted(waiting))} within "
                                   f"{self.spec.timeout + ANSWER_MARGIN:g} s — nothing was "
                                   "started") from None
                if isinstance(report, reports.SetupOutput) and report.host in waiting:
                    self._output(report.host, report.stderr, report.data)
                elif isinstance(report, reports.SetupDone) and report.host in waiting:
                    waiting.discard(report.host)
                    self._done(report.host, report.info)
                elif isinstance(report, reports.AgentGone) and report.host in waiting:
                    raise FdlError(f"cluster launcher: setup on {report.host}: the host "
                                   f"dropped ({report.reason}) — nothing was started")
                else:
                    kept.append(report)
        finally:
            for report in kept:
                self.inbox.put(report)

    def _output(self, host: str, stderr: bool, data: bytes, *, end: bool = False) -> None:
        """Whole lines as events; a line's start waits for its end (or for setup's)."""
        buf = self.partial.pop((host, stderr), b"") + data
        *lines, rest = buf.split(b"\n")
        if end and rest:
            lines.append(rest)
            rest = b""
        if rest:
            self.partial[(host, stderr)] = rest[-LINE_MAX:]
        for line in lines:
            text = line[:LINE_MAX].decode("utf-8", "replace").rstrip("\r")
            self.events(Name.SETUP_OUTPUT, host=host, text=text, stderr=stderr)

    def _done(self, host: str, info: Mapping[str, Any]) -> None:
        for stderr in (False, True):
            self._output(host, stderr, b"", end=True)
        if info.get("error"):
            self._failed(host, str(info["error"]), [])
        if info.get("skipped") or (info.get("code") == 0 and not info.get("timed_out")):
            self.events(Name.SETUP_DONE, host=host, skipped=bool(info.get("skipped")),
                        seconds=float(info.get("seconds") or 0.0),
                        made=[str(n) for n in info.get("made") or []], key=self.key)
            return
        if info.get("timed_out"):
            why = f"it did not end within setup_timeout ({self.spec.timeout:g} s); killed"
        elif info.get("signal") is not None:
            why = f"killed by signal {info['signal']}"
        else:
            why = f"exit {info.get('code')}"
        self._failed(host, why, [str(t) for t in info.get("tail") or []])

    def _failed(self, host: str, why: str, tail: list[str]) -> None:
        self.events(Name.SETUP_FAILED, host=host, why=why, tail=tail)
        raise FdlError(f"cluster launcher: setup on {host}: {why} — no rank was "
                       "started on any host")
