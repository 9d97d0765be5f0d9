"""The launcher's end of one agent: start it, speak the protocol, post what it reports.

One `AgentSession` per host. A remote agent is one SSH session on the host's Fabric
Connection (`RawRemote`); a local agent is one process started through invoke
(`RawLocal`), and so is a Slurm node's, through the srun step that runs it there
(`fdl_fabric.transport.slurm`). Either way the agent's stdin and stdout carry
`fdl_fabric.agent.wire` frames; a reading thread (for SSH sessions the launcher's one
`channels.ChannelReader`, for local processes the runner's own) feeds stdout into a
`wire.Reader` and every frame becomes a `reports` record, posted to the supervisor's
inbox. Nothing here prints: transport never imports presentation.

Writes (the spec, start, stop, signals) come from the launcher's threads and are
serialised by a lock; a write to an agent that is gone is dropped, because its end is
reported separately (`reports.AgentGone`).

Rank output is handed to ``on_output`` on the reading thread itself (the console and the
logs, `fdl_fabric.supervision.rankoutput`): a slow console slows this one reader, never
the supervisor. Every byte read counts as a sign of life (`last_heard`), and so does time
spent waiting on a slow console.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Optional

from .. import reports
from ..agent import wire
from . import bundle
from .base import AgentProcess, Transport

#: Bytes of an agent's stderr kept to explain how it ended.
STDERR_TAIL = 4096
#: Seconds to wait for an agent's exit status once its streams ended.
STATUS_WAIT = 5.0
#: Beats this recent say they flow: two at their longest interval (3 s, sent up to
#: 1.1 x late, `agent.cohortrelay.next_beat_at`).
BEATS_FRESH = 7.0
#: The types a rank's age in BEATS may have.
_AGES = (float, int)
#: The ping and the start, made once: 1,024 agents get each in a round.
_PING = wire.message(wire.PING)
_START = wire.message(wire.START)

Post = Callable[[reports.Report], None]
#: Where rank output goes on the reading thread; it may block while the console is slow.
OutputSink = Callable[[reports.Output], None]


class _Stdout:
    """Frames from the agent's stdout, turned into reports."""

    def __init__(self, session: AgentSession) -> None:
        self.session = session
        self.reader = wire.Reader(wire.UP_TYPES, handshake=True)

    def feed(self, data: bytes) -> None:
        self.session.heard()
        if self.session.broken:
            return
        try:
            frames = self.reader.feed(data)
        except wire.ProtocolError as exc:
            self.session.protocol_error(str(exc))
            return
        post = self.session.post
        host = self.session.host
        for kind, body in frames:
            try:
                if kind == wire.OUTPUT:
                    rank, stream, partial, chunk = wire.parse_output(body)
                    report = reports.Output(host, rank, stream == wire.STDERR, chunk, partial)
                    self.session.output(report)
                    post(report)
                elif kind == wire.HEARTBEAT:
                    continue
                elif kind == wire.SETUP_OUTPUT:
                    post(reports.SetupOutput(host, body[:1] == b"\x02", bytes(body[1:])))
                else:
                    self.session.handle(kind, wire.parse_json(body))
            except (wire.ProtocolError, KeyError, TypeError, ValueError) as exc:
                self.session.protocol_error(f"bad frame {kind}: {exc}")
                return

    def close(self) -> None:
        self.session.stream_closed()


class _Stderr:
    """The agent's own stderr (a crash's traceback): kept, last bytes only. What came
    before the agent's handshake is the login shell's (an rc file's complaints), kept
    apart: it explains an agent that never started, not one that died."""

    def __init__(self, session: AgentSession) -> None:
        self.session = session
        self.tail = b""
        self.shell = b""

    def feed(self, data: bytes) -> None:
        if self.session._stdout.reader.synced:
            self.tail = (self.tail + data)[-STDERR_TAIL:]
        else:
            self.shell = (self.shell + data)[-STDERR_TAIL:]

    def close(self) -> None:
        self.session.stream_closed()


# -- decoding: one JSON frame -> one report ---------------------------------------------
# Each decoder rebuilds a frame's body into its report with the field types the
# supervisor relies on: JSON numbers may arrive as floats or strings, optional fields may
# be absent or null. A missing required field or a value that does not convert raises
# KeyError, TypeError or ValueError, which `_Stdout.feed` reports as a bad frame.

#: Builds the report of one kind of frame from the host's name and the frame's body.
_Decoder = Callable[[str, dict[str, Any]], reports.Report]


def _optional_int(value: Any) -> Optional[int]:
    """An int, keeping null as None: a rank or exit code may legitimately be absent."""
    return None if value is None else int(value)


def _agent_ready(host: str, obj: dict[str, Any]) -> reports.Report:
    """HELLO: the agent's description of itself, passed on whole; readers pick fields."""
    return reports.AgentReady(host, obj)


def _facts(host: str, obj: dict[str, Any]) -> reports.Report:
    """FACTS: ``gpus`` is null when the GPUs could not be listed; that stays None (with
    ``gpu_error`` saying why), distinct from an empty list (no GPU)."""
    gpus = obj.get("gpus")
    versions, fleet, smoke = obj.get("versions"), obj.get("fleet"), obj.get("smoke")
    return reports.Facts(host, [int(g) for g in gpus] if isinstance(gpus, list) else None,
                         str(obj.get("gpu_error", "")),
                         versions if isinstance(versions, dict) else None,
                         fleet if isinstance(fleet, dict) else None,
                         smoke if isinstance(smoke, dict) else None)


def _preflight(host: str, obj: dict[str, Any]) -> reports.Report:
    """PREFLIGHT: raw values as text, the form the verdicts parse."""
    return reports.Preflight(host, {str(k): str(v) for k, v in obj["values"].items()})


def _swept(host: str, obj: dict[str, Any]) -> reports.Report:
    """SWEPT: passed on whole; the cleanup report reads what it needs."""
    return reports.Swept(host, obj)


def _spawned(host: str, obj: dict[str, Any]) -> reports.Report:
    """SPAWNED: the rank's pid, which the supervisor names in stop and status messages."""
    return reports.Spawned(host, int(obj["rank"]), int(obj["pid"]))


def _spawn_failed(host: str, obj: dict[str, Any]) -> reports.Report:
    """SPAWN_FAILED: which rank could not be started, and why."""
    return reports.SpawnFailed(host, int(obj["rank"]), str(obj["reason"]))


def _exited(host: str, obj: dict[str, Any]) -> reports.Report:
    """EXITED: exactly one of ``code`` and ``signal`` is set; the other stays None."""
    return reports.Exited(host, int(obj["rank"]), _optional_int(obj.get("code")),
                          _optional_int(obj.get("signal")), str(obj.get("error", "")))


def _verified(host: str, obj: dict[str, Any]) -> reports.Report:
    """VERIFIED: an absent list means nothing of that kind."""
    return reports.Verified(host, list(obj.get("stopped", [])), list(obj.get("remaining", [])))


def _agent_error(host: str, obj: dict[str, Any]) -> reports.Report:
    """ERROR: ``rank`` is null for a problem of the agent's own rather than a rank's;
    ``lease`` is set when the agent's lease ran out (it is stopping every rank)."""
    return reports.AgentError(host, str(obj.get("message", "")), _optional_int(obj.get("rank")),
                              lease_ran_out=obj.get("lease") is not None)


def _agent_done(host: str, obj: dict[str, Any]) -> reports.Report:
    """DONE: no body; `AgentSession.handle` also notes it (a clean end needs it)."""
    return reports.AgentDone(host)


def _signaled(host: str, obj: dict[str, Any]) -> reports.Report:
    """SIGNALED: ``by`` (the note of a cleanup that stopped this run) is kept only when it
    is an object, the shape `reports.Signaled` declares; anything else is dropped."""
    by = obj.get("by")
    return reports.Signaled(host, str(obj["signal"]), bool(obj.get("stopping")),
                            bool(obj.get("forwarded")), by if isinstance(by, dict) else None)


def _stacks(host: str, obj: dict[str, Any]) -> reports.Report:
    """STACKS_REPORT: JSON object keys are strings, ranks are ints; a rank entry that is not
    an object is dropped so the stack view never has to guard against it."""
    ranks = obj.get("ranks") or {}
    return reports.Stacks(host, int(obj.get("id") or 0), obj.get("run"),
                          {int(k): v for k, v in ranks.items() if isinstance(v, dict)},
                          bool(obj.get("py_spy")), str(obj.get("error") or ""))


def _runs(host: str, obj: dict[str, Any]) -> reports.Report:
    """RUNS: null lists count as empty, and entries that are not run objects are dropped."""
    return reports.Runs(host, [r for r in obj.get("runs") or [] if isinstance(r, dict)],
                        [str(e) for e in obj.get("errors") or []])


def _sync_need(host: str, obj: dict[str, Any]) -> reports.Report:
    """SYNC_NEED: passed on whole; `fdl_fabric.sync` checks what it reads."""
    return reports.SyncAnswer(host, False, obj)


def _synced(host: str, obj: dict[str, Any]) -> reports.Report:
    """SYNCED: passed on whole, as SYNC_NEED."""
    return reports.SyncAnswer(host, True, obj)


def _setup_done(host: str, obj: dict[str, Any]) -> reports.Report:
    """SETUP_DONE: passed on whole; `fdl_fabric.sync.setup` reads what it needs."""
    return reports.SetupDone(host, obj)


def _cohort_up(host: str, obj: dict[str, Any]) -> reports.Report:
    """COHORT_UP: a rank's verified message, or its closed connection (a bad body raises:
    the session turns it into a protocol error)."""
    rank, msg, closed = obj["rank"], obj.get("msg"), obj.get("closed")
    if not isinstance(rank, int) or isinstance(rank, bool) or (msg is None) == (closed is None):
        raise ValueError("cohort: a rank, and a msg or closed")
    if msg is not None and not (isinstance(msg, dict) and isinstance(msg.get("type"), str)):
        raise ValueError("cohort: msg is not a message")
    return reports.CohortUp(host, rank, msg, None if closed is None else str(closed))


def _beats(host: str, obj: dict[str, Any]) -> reports.Report:
    """BEATS: {"ranks": {"<r>": [age, progress]}}. Types by identity (a bool is neither
    an age nor a progress): 1,024 hosts' beats pass here every 3 s."""
    given = obj["ranks"]
    if type(given) is not dict:
        raise TypeError("beats: ranks is not a mapping")
    ranks: dict[int, tuple[float, int]] = {}
    for key, (age, progress) in given.items():
        if type(progress) is not int or type(age) not in _AGES:
            raise ValueError("beats: [age, progress] per rank")
        ranks[int(key)] = (float(age), progress)
    return reports.Beats(host, ranks)


#: The decoder of every JSON frame kind that becomes a report (OUTPUT is binary and
#: HEARTBEAT carries nothing; `_Stdout.feed` handles both before this table).
_DECODERS: dict[int, _Decoder] = {
    wire.HELLO: _agent_ready,
    wire.FACTS: _facts,
    wire.PREFLIGHT: _preflight,
    wire.SWEPT: _swept,
    wire.SPAWNED: _spawned,
    wire.SPAWN_FAILED: _spawn_failed,
    wire.EXITED: _exited,
    wire.VERIFIED: _verified,
    wire.ERROR: _agent_error,
    wire.DONE: _agent_done,
    wire.SIGNALED: _signaled,
    wire.STACKS_REPORT: _stacks,
    wire.RUNS: _runs,
    wire.SYNC_NEED: _sync_need,
    wire.SYNCED: _synced,
    wire.SETUP_DONE: _setup_done,
    wire.COHORT_UP: _cohort_up,
    wire.BEATS: _beats,
}

#: Reports for the coordinator (`supervision.relayed`), not the supervisor's inbox.
_FOR_COHORT = (reports.CohortUp, reports.Beats)


class AgentSession:
    """One host's agent, over its host's `Transport`; see the module docstring."""

    def __init__(self, transport: Transport, post: Post, *,
                 on_output: Optional[OutputSink] = None) -> None:
        self.transport = transport
        self.host = transport.host
        self.post = post
        self.process: Optional[AgentProcess] = None
        self.broken = False
        self.done = False
        #: The agent said HELLO: it ran, so something of the run may be on its host (an
        #: agent that never started, its login shell in the way, left nothing to sweep).
        self.greeted = False
        self._closed_streams = 0
        self._stdout = _Stdout(self)
        self._stderr = _Stderr(self)
        self._lock = threading.Lock()
        self._gone = False
        self._problem = ""
        self.on_output = on_output
        self._heard = time.monotonic()
        self._in_sink = 0
        #: Where this host's ranks' cohort frames go (the attempt's coordinator), if any.
        self.cohort: Optional[Post] = None
        #: When (monotonic) the agent last sent its ranks' ``beats`` (`beats_flowing`).
        self._beats_at = 0.0

    # -- liveness -------------------------------------------------------------------------
    @property
    def last_heard(self) -> float:
        """When the agent last sent anything; now, while its output waits on the console
        (the agent is talking, the launcher is the one not listening), and no earlier
        than the last time a shared reading thread was held by another host's output
        (`channels.ChannelReader.held_until`)."""
        if self._in_sink:
            return time.monotonic()
        process = self.process
        held = process.reader_held_until() if process is not None else 0.0
        return max(self._heard, held)

    @property
    def beats_flowing(self) -> bool:
        """Its ranks' beats came within `BEATS_FRESH`: the agent is heard without being
        pinged, so a ping need only renew its lease (`supervision.stopping`)."""
        return time.monotonic() - self._beats_at <= BEATS_FRESH

    def heard(self) -> None:
        self._heard = time.monotonic()

    def output(self, report: reports.Output) -> None:
        sink = self.on_output
        if sink is None:
            return
        self._in_sink += 1
        try:
            sink(report)
        finally:
            self._in_sink -= 1
            self._heard = time.monotonic()

    # -- starting -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the agent and ship its source; raises if it cannot start. An agent that
        dialled in runs its own host's install: it is sent no source."""
        self.process = self.transport.start_agent(self._stdout, self._stderr)
        if not self.transport.dials_in:
            self.write(bundle.payload())

    # -- writing --------------------------------------------------------------------------
    def write(self, data: bytes, *, lazy: bool = False) -> None:
        """To the agent's stdin; ``lazy``: it may wait a moment to travel with other
        agents' writes (`AgentProcess.write_lazy`)."""
        process = self.process
        if process is None or self._gone:
            return
        # The agent may be gone; its end is reported by the reader, not here.
        with self._lock, contextlib.suppress(Exception):
            (process.write_lazy if lazy else process.write)(data)

    def send(self, kind: int, obj: Optional[dict[str, Any]] = None) -> None:
        self.write(wire.message(kind, obj))

    def write_shared(self, frame: bytes) -> None:
        """A frame many agents get the same (a sync's manifest): through a gateway, it
        crosses the launcher's link once per gateway (`AgentProcess.send_shared`)."""
        process = self.process
        if process is None or self._gone:
            return
        with self._lock, contextlib.suppress(Exception):
            process.send_shared(frame)

    def spec(self, spec: dict[str, Any]) -> None:
        """The agent's spec. Sent to every agent in one loop, so it may travel with the
        others (`write`'s ``lazy``): through a gateway, 31 leaves' specs cross in a few
        SSH packets, not 31 writes (issue 35's burst at 1,024 hosts)."""
        self.write(wire.message(wire.SPEC, spec), lazy=True)

    def probe(self, *, gpus: bool) -> None:
        self.send(wire.PROBE, {"gpus": gpus})

    def send_probe(self, request: dict[str, Any]) -> None:
        """A PROBE of other facts (``versions``, ``fleet``, ``smoke``), answered by FACTS."""
        self.send(wire.PROBE, request)

    def start_ranks(self) -> None:
        """Start the ranks: sent to every agent at once, so it may travel with the others."""
        self.write(_START, lazy=True)

    def stop(self, signal: str = "TERM", rank: Optional[int] = None) -> None:
        """Graceful stop of every rank (``signal`` first: TERM, or INT for a Ctrl-C), or
        of one rank (a rank the coordinator declared dead)."""
        self.send(wire.STOP, {"signal": signal, "rank": rank})

    def suspend(self) -> None:
        self.send(wire.SUSPEND)

    def resume(self) -> None:
        self.send(wire.RESUME)

    def stacks(self, request_id: int, run: Optional[str] = None,
               host: Optional[str] = None) -> None:
        """Ask for every rank's stack: this run's, or a recorded run's (``run``, ``host``)."""
        self.send(wire.STACKS, {"id": request_id, "run": run, "host": host})

    def list_runs(self, cluster: Optional[str] = None) -> None:
        self.send(wire.LIST, {"cluster": cluster})

    def kill(self) -> None:
        self.send(wire.KILL)

    def signal(self, name: str, rank: Optional[int] = None) -> None:
        if name not in wire.SIGNALS:
            raise ValueError(f"cannot forward signal {name}")
        self.send(wire.SIGNAL, {"signal": name, "rank": rank})

    def ping(self) -> None:
        """Renew the agent's lease: sent to every agent at once, so it may travel with
        the others (through a relay, one write for all of a gateway's leaves)."""
        self.write(_PING, lazy=True)

    def sweep(self, request: dict[str, Any]) -> None:
        self.send(wire.SWEEP, request)

    def close_input(self) -> None:
        """EOF on the agent's stdin: the leash (it stops its ranks and exits)."""
        process = self.process
        if process is None:
            return
        with self._lock, contextlib.suppress(Exception):
            process.close_input()

    def abandon(self) -> None:
        """Last resort for an agent that stopped answering: cut its session or process.

        A remote agent sees EOF and runs its leash; a local one is killed (its watchdog
        then stops its ranks).
        """
        self.close_input()
        process = self.process
        if process is None:
            return
        with contextlib.suppress(Exception):
            process.kill()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the reading threads (after the agent is gone)."""
        if self.process is not None:
            self.process.join(timeout)

    # -- reading (runner threads) -----------------------------------------------------------
    def handle(self, kind: int, obj: dict[str, Any]) -> None:
        """Post the report one JSON frame carries (`_DECODERS`).

        A kind with no decoder is ignored rather than refused: the reader has already
        checked it against `wire.UP_TYPES`. DONE is also noted on the session, before it
        is posted: only an agent that said DONE ends cleanly (`stream_closed`). A malformed
        body raises out of its decoder before anything is posted; `_Stdout.feed` turns
        that into a protocol error.
        """
        decode = _DECODERS.get(kind)
        if decode is None:
            return
        report = decode(self.host, obj)
        if isinstance(report, _FOR_COHORT):
            if kind == wire.BEATS:
                self._beats_at = time.monotonic()
            cohort = self.cohort
            if cohort is not None:
                cohort(report)
            return
        if kind == wire.DONE:
            self.done = True
        elif kind == wire.HELLO:
            self.greeted = True
        self.post(report)

    def protocol_error(self, reason: str) -> None:
        """A malformed stream: stop reading it, end the agent, say why (naming the host)."""
        if self.broken:
            return
        self.broken = True
        self._problem = f"protocol error from the agent: {reason}"
        self.abandon()

    def stream_closed(self) -> None:
        with self._lock:
            self._closed_streams += 1
            if self._closed_streams < 2 or self._gone:
                return
            self._gone = True
        status = self._exit_status()
        # An agent that dialled in is not our process: no status comes, and its DONE is
        # the word that it ended well.
        ended_well = status == 0 or (status is None and self.transport.dials_in)
        clean = self.done and ended_well and not self.broken
        killed_by = -status if status is not None and status < 0 and not self.broken else None
        self.post(reports.AgentGone(self.host, clean, "" if clean else self._why(status),
                                    killed_by=killed_by))

    def _exit_status(self) -> Optional[int]:
        process = self.process
        return None if process is None else process.exit_status(STATUS_WAIT)

    def _why(self, status: Optional[int]) -> str:
        shell = self._login_shell_problem()
        if shell is not None:  # the one cause, said once
            return shell
        parts = []
        if self._problem:
            parts.append(self._problem)
        noise = self._stdout.reader.noise
        if not self._stdout.reader.synced:
            said = self._stderr.shell.decode("utf-8", "replace").strip()
            if noise:
                parts.append(f"the login shell printed {noise[-200:]!r} and no agent started")
            elif said:
                parts.append(f"the agent never started; the login shell said: "
                             f"{said.splitlines()[-1][:300]}")
            else:
                parts.append("the agent never started")
        if status is None:
            parts.append(self.process.lost_reason if self.process is not None
                         else "the agent never started")
        elif status < 0:
            parts.append(f"the agent was killed by signal {-status}")
        elif status:
            parts.append(f"the agent exited with status {status}")
        elif not self.done:
            parts.append("the agent ended without reporting")
        tail = self._stderr.tail.decode("utf-8", "replace").strip()
        if tail:
            parts.append("its last words: " + tail.splitlines()[-1][:300])
        return "; ".join(parts)

    def _login_shell_problem(self) -> Optional[str]:
        """The host's login shell stood between sshd and the agent: it printed more than
        the launcher reads before the handshake (`wire.MAX_NOISE`), or it read the stdin
        that carries the agent's source (`bundle.STDIN_TAKEN`). Named as such, with where
        to look, instead of the protocol error and the bytes it caused."""
        if self._stdout.reader.synced:
            return None
        rc = "check ~/.bashrc and ~/.profile"
        if len(self._stdout.reader.noise) > wire.MAX_NOISE:
            return (f"the login shell of host {self.host} printed more than "
                    f"{wire.MAX_NOISE // 1024} KiB before the agent started: {rc} for "
                    "output in non-interactive shells (guard it with `case $- in *i*)`)")
        said = self._stderr.shell.decode("utf-8", "replace").strip().splitlines()
        if said and said[-1].strip() == bundle.STDIN_TAKEN:
            return (f"the login shell of host {self.host} consumed the agent's stdin before "
                    f"the agent started: {rc} for commands that read stdin (read, cat, ssh "
                    "without -n) in non-interactive shells")
        return None
