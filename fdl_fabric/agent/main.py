"""The agent's event loop: one select loop over its input, its ranks and its signals.

One process per host (flodl 0.7.0's agent phase). It reads a spec on its stdin, runs
the host's fast pre-flight and sweeps this cluster's leftovers, starts every rank in
its own session, forwards their output as whole lines, reports each exit the moment
it is reaped, and at the end makes sure nothing of the run is left on the host.

It is single-threaded on purpose: it forks ranks and its watchdog, which is only safe
without threads, and one ``select`` over stdin, the rank pipes, stdout and a signal
wake-up pipe needs no locking. Nothing here polls on a timer: a rank's exit arrives as
SIGCHLD through `signal.set_wakeup_fd`, and the loop sleeps until something happens
(or until a kill grace runs out).

The leash: when its input reaches EOF (the launcher is gone, or the connection
dropped), or it receives HUP, TERM or INT, the agent sends TERM to every rank's process
group, KILL after the kill grace, then verifies and exits. If the agent itself is
SIGKILLed, its watchdog does the same (see `watchdog`).

Liveness, both ways: the launcher pings (the lease), and the agent answers a ping with
a heartbeat when it has sent nothing else for `wire.HEARTBEAT_INTERVAL`, so a frozen
agent, a frozen sshd or a cut link is noticed by the launcher within its
``agent_timeout``. An idle agent wakes only for what arrives: no timer of its own. The
agent also touches its registry record, which is how a cleanup tells a live run (left
alone) from a leftover.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fdl_fabric.agent import children, codeops, lines, procs, registry, stacks, watchdog, wire
from fdl_fabric.rank import ENV_CLUSTER_JSON, ENV_ERROR_FILE

#: Frames waiting for the launcher beyond this many bytes pause reading rank output,
#: so a launcher that reads slowly slows the ranks down instead of growing the agent.
HIGH_WATER = 4 * 1024 * 1024
#: Bytes read from a rank pipe at once.
READ_SIZE = 64 * 1024
#: Started by srun: a signal Slurm sends the step (scancel, the time limit, --signal)
#: reaches every process in it, the ranks included, not only the agent.
_IN_SLURM_STEP = os.environ.get("SLURM_STEP_ID") is not None
#: Bytes written to the launcher per write call.
WRITE_SIZE = 256 * 1024

EXIT_OK = 0
EXIT_PROTOCOL = 3
EXIT_INTERNAL = 4

_INTERNAL_PREFIX = "FLODL_INTERNAL_"
#: What srun tells the agent about its own step's one task. Wrong for every rank (all
#: would be "task 0 of 1"), and frameworks that detect Slurm from them (Lightning reads
#: SLURM_NTASKS and SLURM_PROCID) would take them over RANK and WORLD_SIZE.
_STEP_TASK_VARS = frozenset({
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST",
    "SLURM_NNODES", "SLURM_DISTRIBUTION", "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT",
})


@dataclass
class RankProc:
    """One rank this agent started."""

    rank: int
    pid: int
    start: int
    status: Optional[int] = None
    error_file: str = ""
    #: When a stop of this rank alone (a rank the coordinator declared dead) turns to KILL.
    kill_at: Optional[float] = None

    @property
    def running(self) -> bool:
        return self.status is None


@dataclass
class Stream:
    rank: RankProc
    kind: int
    splitter: lines.LineSplitter = field(
        default_factory=lambda: lines.LineSplitter(wire.MAX_LINE_PIECE))


class Agent:
    """The agent of one host; `run` returns its exit status."""

    def __init__(self, rfd: int = 0, wfd: int = 1) -> None:
        self.rfd = rfd
        self.wfd = wfd
        self.reader = wire.Reader(wire.DOWN_TYPES)
        self.out = bytearray()
        self.sel = selectors.DefaultSelector()
        self.spec: Optional[Dict[str, Any]] = None
        self.ranks: Dict[int, RankProc] = {}
        self.by_pid: Dict[int, RankProc] = {}
        self.streams: Dict[int, Stream] = {}
        self.paused = False
        self.input_open = True
        self.output_open = True
        self.stopping = False
        self.kill_at: Optional[float] = None
        self.killed = False
        self.started = False
        self.finished = False
        self.interrupts = 0
        #: The spec's lease: seconds without a byte from the launcher after which the
        #: agent acts as on EOF (None: only EOF counts).
        self.lease: Optional[float] = None
        self.last_input = time.monotonic()
        #: The launcher said it is suspended (Ctrl-Z): its silence is no absence.
        self.suspended = False
        #: After an INT-first stop: when the TERM follows.
        self.term_at: Optional[float] = None
        #: When a frame last went into ``out`` (a heartbeat is due when this gets old).
        self.last_sent = time.monotonic()
        self.record_written = False
        self.last_touch = 0.0
        #: Stack collectors running: pid -> (read fd, request id, run id).
        self.collectors: Dict[int, Any] = {}
        self.watchdog: Optional[watchdog.Watchdog] = None
        self.exit_code = EXIT_OK
        #: The code step: the synced code's store (its tree's lock) and ``setup:``.
        self.code = codeops.CodeOps(self.send, self._queue, self.sel)
        self._wake_r, self._wake_w = os.pipe()

    # -- setup ----------------------------------------------------------------------------
    def _install(self) -> None:
        for fd in (self.rfd, self.wfd, self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGINT,
                    signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, _noop)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        if not _IN_SLURM_STEP:
            # A local agent leaves the launcher's session, so a terminal's Ctrl-C, Ctrl-Z
            # and Ctrl-\ reach the launcher alone, which decides what its agents do. (Over
            # SSH the agent already leads a session of its own: this fails harmlessly.)
            with contextlib.suppress(OSError):
                os.setsid()
        _become_subreaper()
        self.sel.register(self.rfd, selectors.EVENT_READ, "in")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")

    def hello(self) -> None:
        self.out += wire.HANDSHAKE
        self.send(wire.HELLO, {
            "version": wire.VERSION, "pid": os.getpid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "system": os.uname().sysname,
            "machine": os.uname().machine,
        })

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> int:
        self._install()
        self.hello()
        try:
            while not self.finished:
                self._step()
        except Exception:
            self.exit_code = EXIT_INTERNAL
            import traceback

            self._error("agent crashed: " + traceback.format_exc(limit=5).strip())
            self._leash_now()
        self._flush_blocking()
        return self.exit_code

    def _deadlines(self) -> List[float]:
        """Every moment the loop must wake for, whatever arrives meanwhile."""
        due: List[float] = []
        if self.kill_at is not None and not self.killed:
            due.append(self.kill_at)
        if self.term_at is not None:
            due.append(self.term_at)
        lease_end = self._lease_end()
        if lease_end is not None:
            due.append(lease_end)
        due += [p.kill_at for p in self.ranks.values() if p.kill_at is not None and p.running]
        if self.record_written:
            due.append(self.last_touch + procs.RECORD_TOUCH)
        setup_due = self.code.deadline()
        if setup_due is not None:
            due.append(setup_due)
        return due

    def _step(self) -> None:
        self._update_registrations()
        for key, _ in self.sel.select(self._select_timeout()):
            self._dispatch(key)
        self._reap()
        self._on_deadlines(time.monotonic())
        self._maybe_finish()
        if self.out and self.output_open:
            self._write_output()  # most writes fit the pipe: no need to wait for select

    def _select_timeout(self) -> Optional[float]:
        """How long ``select`` may sleep: until the nearest deadline, or for ever when
        none is set (an idle agent wakes only for what arrives)."""
        due = self._deadlines()
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        """Hand a ready descriptor to its reader by the tag it was registered with; a
        rank's pipe is registered with its `Stream`, so anything untagged is a rank."""
        what = key.data
        if what == "in":
            self._read_input()
        elif what == "wake":
            self._read_signals()
        elif what == "out":
            self._write_output()
        elif what == "stacks":
            self._read_collector(key.fd)
        elif what == "setup":
            self.code.read_setup(key.fd, _read_ready(key.fd))
        else:
            self._read_rank(key.fd)

    def _on_deadlines(self, now: float) -> None:
        """Act on every deadline `_deadlines` woke the loop for that ``now`` has passed.
        One ``now`` for all, taken after the reap, and a fixed order: a lease that runs
        out starts the leash before the stop's own TERM and KILL moments are looked at."""
        self._end_lease_if_expired(now)
        self._term_after_interrupt(now)
        self._kill_after_grace(now)
        self._kill_ranks_past_grace(now)
        self._touch_record_if_due(now)
        self.code.on_time(now)

    def _end_lease_if_expired(self, now: float) -> None:
        """The launcher's silence outlived the lease: act as on EOF, since a stalled
        stream without an EOF must not keep ranks running for ever."""
        lease_end = self._lease_end()
        if lease_end is not None and now >= lease_end:
            self._error(f"no word from the launcher for {self.lease:g}s (its host, its link or "
                        "the srun carrying this agent is gone): stopping every rank")
            self._leash()

    def _term_after_interrupt(self, now: float) -> None:
        """An INT-first stop (Ctrl-C: Python ranks print where they were) turns to TERM
        once its moment comes, for the ranks and the run's strays alike, as both got the
        INT: a process that caught the INT and went on must still be asked to stop."""
        if self.term_at is not None and now >= self.term_at:
            self.term_at = None
            self._signal(signal.SIGTERM, None)
            procs.signal_pids(self._strays(), signal.SIGTERM)

    def _kill_after_grace(self, now: float) -> None:
        """The whole stop's kill grace is over: KILL everything, once."""
        if self.kill_at is not None and not self.killed and now >= self.kill_at:
            self._kill_all()

    def _kill_ranks_past_grace(self, now: float) -> None:
        """KILL the group of each rank stopped alone (declared dead by the coordinator)
        whose own grace is over; the other ranks keep running."""
        for proc in self.ranks.values():
            if proc.kill_at is not None and proc.running and now >= proc.kill_at:
                proc.kill_at = None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def _touch_record_if_due(self, now: float) -> None:
        """Touch the registry record every `procs.RECORD_TOUCH` seconds: the sign of life
        by which a cleanup leaves this run alone (`procs.record_live`)."""
        if self.record_written and now - self.last_touch >= procs.RECORD_TOUCH:
            self.last_touch = now
            spec = self.spec
            assert spec is not None
            procs.touch_record(str(spec["run_id"]), str(spec["host"]))

    def _lease_end(self) -> Optional[float]:
        """When the launcher's silence becomes its absence: a stream that stalls without an
        EOF (a Slurm node whose srun is gone, a link cut behind an sshd that never probes
        its clients) must not keep ranks running for ever."""
        if self.lease is None or self.stopping or not self.input_open or self.suspended:
            return None
        return self.last_input + self.lease

    def _update_registrations(self) -> None:
        want_out = bool(self.out) and self.output_open
        registered = self.sel.get_map()
        if want_out and self.wfd not in registered:
            self.sel.register(self.wfd, selectors.EVENT_WRITE, "out")
        elif not want_out and self.wfd in registered:
            self.sel.unregister(self.wfd)
        pause = len(self.out) > HIGH_WATER
        if pause != self.paused:
            self.paused = pause
            for fd, stream in self.streams.items():
                if pause:
                    self.sel.unregister(fd)
                else:
                    self.sel.register(fd, selectors.EVENT_READ, stream)

    # -- output to the launcher -------------------------------------------------------------
    def send(self, kind: int, obj: Optional[Dict[str, Any]] = None) -> None:
        if self.output_open:
            self.out += wire.message(kind, obj)
            self.last_sent = time.monotonic()

    def _queue(self, frame: bytes) -> None:
        """A frame built elsewhere (binary: setup's output), sent like `send`'s."""
        if self.output_open:
            self.out += frame
            self.last_sent = time.monotonic()

    def _pump(self, seconds: float) -> None:
        """Wait ``seconds`` inside a blocking step (a sweep, a stop) while staying heard:
        a heartbeat goes out, and what is queued for the launcher is written."""
        if time.monotonic() - self.last_sent >= wire.HEARTBEAT_INTERVAL:
            self.send(wire.HEARTBEAT)
        if self.out and self.output_open:
            self._write_output()
        time.sleep(seconds)

    def _error(self, text: str, rank: Optional[int] = None) -> None:
        self.send(wire.ERROR, {"message": text, "rank": rank})

    def _write_output(self) -> None:
        while self.out:
            try:
                n = os.write(self.wfd, self.out[:WRITE_SIZE])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError:  # the launcher's end is gone (EPIPE): nobody to report to
                self.output_open = False
                self.out.clear()
                self._leash()
                return
            del self.out[:n]

    def _flush_blocking(self) -> None:
        """Before exiting: hand everything to the launcher (or give up once it is gone)."""
        deadline = time.monotonic() + 10.0
        while self.out and self.output_open:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._write_output()
            if self.out:
                with contextlib.suppress(OSError, ValueError):
                    select.select([], [self.wfd], [], min(remaining, 0.5))

    # -- input from the launcher ------------------------------------------------------------
    def _read_input(self) -> None:
        while True:
            data = _read_ready(self.rfd)
            if data is None:
                return
            self.last_input = time.monotonic()
            if not data:
                self.input_open = False
                self.sel.unregister(self.rfd)
                self._leash()
                return
            try:
                frames = self.reader.feed(data)
            except wire.ProtocolError as exc:
                self._protocol_error(str(exc))
                return
            for kind, body in frames:
                try:
                    self._handle(kind, body)
                except wire.ProtocolError as exc:
                    self._protocol_error(str(exc))
                    return

    def _protocol_error(self, reason: str) -> None:
        self._error(f"protocol error from the launcher: {reason}")
        self.exit_code = EXIT_PROTOCOL
        if self.input_open:
            self.input_open = False
            self.sel.unregister(self.rfd)
        self._leash()

    def _handle(self, kind: int, body: bytes) -> None:
        if kind == wire.SPEC:
            self._on_spec(wire.parse_json(body))
        elif kind == wire.PROBE:
            self._on_probe(wire.parse_json(body))
        elif kind == wire.START:
            self._spawn_all()
        elif kind == wire.SIGNAL:
            obj = wire.parse_json(body)
            name = obj.get("signal")
            if name not in wire.SIGNALS:
                raise wire.ProtocolError(f"cannot forward signal {name!r}")
            self._signal(getattr(signal, "SIG" + str(name)), obj.get("rank"))
        elif kind == wire.STOP:
            self._on_stop(wire.parse_json(body) if body else {})
        elif kind == wire.KILL:
            self.stopping = True
            self._kill_all()
        elif kind == wire.SWEEP:
            self._on_sweep(wire.parse_json(body))
        elif kind == wire.PING:  # reading it renewed the lease; answer if quiet of late
            if time.monotonic() - self.last_sent >= wire.HEARTBEAT_INTERVAL:
                self.send(wire.HEARTBEAT)
        elif kind == wire.SUSPEND:
            self.suspended = True
        elif kind == wire.RESUME:
            self.suspended = False  # reading it renewed the lease
        elif kind == wire.STACKS:
            self._on_stacks(wire.parse_json(body))
        elif kind == wire.SYNC:
            self.code.on_sync(wire.parse_json(body))
        elif kind == wire.SYNC_DATA:
            if time.monotonic() - self.last_sent >= wire.HEARTBEAT_INTERVAL:
                self.send(wire.HEARTBEAT)  # a long transfer: the launcher hears it lives
            self.code.on_sync_data(body)
        elif kind == wire.SYNC_MANIFEST:
            self.code.on_manifest(wire.parse_json(body))
        elif kind == wire.SETUP:
            self.code.on_setup(wire.parse_json(body))
        elif kind == wire.LIST:
            request = wire.parse_json(body)
            cluster = request.get("cluster")
            self.send(wire.RUNS, procs.list_runs(str(cluster) if cluster else None))

    def _on_stop(self, request: Dict[str, Any]) -> None:
        name = request.get("signal") or "TERM"
        if name not in ("TERM", "INT"):
            raise wire.ProtocolError(f"cannot stop with signal {name!r}")
        rank = request.get("rank")
        if rank is None:
            self._leash(first=signal.SIGINT if name == "INT" else signal.SIGTERM)
            return
        proc = self.ranks.get(int(rank))
        if proc is None or not proc.running or proc.kill_at is not None:
            return
        # One rank (declared dead by the coordinator, so frozen or cut off): TERM, then
        # KILL after the kill grace; the others carry on.
        grace = float(self.spec["kill_grace"]) if self.spec else 0.0
        proc.kill_at = time.monotonic() + grace
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)

    # -- spec, probe, pre-flight, sweep -----------------------------------------------------
    def _on_spec(self, spec: Dict[str, Any]) -> None:
        if self.spec is not None:
            raise wire.ProtocolError("a second spec")
        if spec.get("version") != wire.VERSION:
            raise wire.ProtocolError(f"spec version {spec.get('version')!r}, agent speaks "
                                     f"{wire.VERSION}")
        for key in ("run_id", "cluster", "host", "cwd", "argv", "env", "ranks", "kill_grace"):
            if key not in spec:
                raise wire.ProtocolError(f"spec lacks {key!r}")
        self.spec = spec
        if spec.get("lease"):
            self.lease = max(float(spec["lease"]), wire.LEASE_MIN)
        envelope = _decode_envelope(str(spec.get("envelope", "")))
        if spec.get("checks"):
            from fdl_fabric.agent import checks  # only with a pre-flight: keeps starts light

            values = checks.gather(spec["checks"], bytes.fromhex(envelope.get("salt", "00" * 16)),
                                   str(spec["run_id"]), str(spec["host"]), beat=self._pump)
            self.send(wire.PREFLIGHT, {"values": values})
        if spec.get("cluster"):
            self.send(wire.SWEPT, procs.sweep(cluster=str(spec["cluster"]),
                                              keep=str(spec["run_id"]), wait=self._pump))
        if spec.get("start_now"):
            self._spawn_all()

    def _on_stacks(self, request: Dict[str, Any]) -> None:
        """Start a collector for the stacks of this run's ranks, or (no spec: ``fdl-fabric
        stacks`` from another terminal) of a recorded run's ranks on this host."""
        req_id, run = request.get("id"), request.get("run")
        pids: Dict[int, int] = {}
        error = ""
        if self.spec is not None and run in (None, self.spec["run_id"]):
            run = self.spec["run_id"]
            pids = {p.rank: p.pid for p in self.ranks.values() if p.running}
        else:
            host = request.get("host")
            try:
                records, _ = procs.read_records()
            except procs.RegistryError as exc:
                records, error = [], str(exc)
            for rec in records:
                if rec["run"] == run and host in (None, rec["host"]):
                    pids.update({int(r["rank"]): int(r["pid"]) for r in rec["ranks"]
                                 if procs.group_members(int(r["pid"]), int(r["start"]))})
        if not pids:
            self.send(wire.STACKS_REPORT, {"id": req_id, "run": run, "ranks": {},
                                           "error": error or "no running rank here"})
            return
        started = stacks.start(pids)
        if started is None:
            self.send(wire.STACKS_REPORT, {"id": req_id, "run": run, "ranks": {},
                                           "error": "cannot start the stack collector"})
            return
        pid, fd = started
        os.set_blocking(fd, False)
        self.collectors[pid] = {"fd": fd, "id": req_id, "run": run, "buf": bytearray()}
        self.sel.register(fd, selectors.EVENT_READ, "stacks")

    def _read_collector(self, fd: int) -> None:
        pid = next((p for p, c in self.collectors.items() if c["fd"] == fd), None)
        if pid is None:
            return
        job = self.collectors[pid]
        while True:
            data = _read_ready(fd)
            if data is None:
                return
            if not data:
                break
            job["buf"] += data
        self.sel.unregister(fd)
        os.close(fd)
        del self.collectors[pid]
        result = stacks.read_result(bytes(job["buf"]))
        self.send(wire.STACKS_REPORT, {"id": job["id"], "run": job["run"], **result})

    def _on_probe(self, request: Dict[str, Any]) -> None:
        facts: Dict[str, Any] = {}
        if request.get("gpus"):
            from fdl_fabric.agent import checks

            facts.update(checks.gpu_indices())
        if isinstance(request.get("versions"), dict):
            from fdl_fabric.agent import versions

            facts["versions"] = versions.gather(request["versions"], beat=self._pump)
        self.send(wire.FACTS, facts)

    def _on_sweep(self, request: Dict[str, Any]) -> None:
        by = request.get("by")
        report = procs.sweep(runs=[str(r) for r in request.get("runs") or []],
                             cluster=request.get("cluster"), all_runs=bool(request.get("all")),
                             pattern=request.get("pattern"), scope=request.get("scope"),
                             force=bool(request.get("force")),
                             by=by if isinstance(by, dict) else None, wait=self._pump)
        self.send(wire.SWEPT, report)
        self.send(wire.DONE)
        self.finished = True

    # -- ranks ------------------------------------------------------------------------------
    def _spawn_all(self) -> None:
        spec = self.spec
        if spec is None:
            raise wire.ProtocolError("start before spec")
        if self.started or self.stopping:
            return
        self.started = True
        run_id, host = str(spec["run_id"]), str(spec["host"])
        self.watchdog = watchdog.start(run_id, host, float(spec["kill_grace"]))
        # Defaults first, then this host's own environment, then the spec's.
        base = {str(k): str(v) for k, v in (spec.get("defaults") or {}).items()}
        base.update({k: v for k, v in os.environ.items()
                     if not k.startswith(_INTERNAL_PREFIX) and k not in _STEP_TASK_VARS})
        base.update(spec["env"])
        if spec.get("envelope"):
            base[ENV_CLUSTER_JSON] = str(spec["envelope"])
        argv = [str(a) for a in spec["argv"]]
        for entry in spec["ranks"]:
            rank = int(entry["rank"])
            env = dict(base)
            env.update(entry.get("env") or {})
            error_file = ""
            try:
                if spec.get("error_files"):
                    error_file = procs.error_file(run_id, host, int(spec.get("attempt", 0)),
                                                  rank)
                    env[ENV_ERROR_FILE] = error_file
                child = children.spawn(argv, env, str(spec["cwd"]))
            except (OSError, procs.RegistryError, children.SpawnError) as exc:
                self.send(wire.SPAWN_FAILED, {"rank": rank, "reason": children.problem(exc)})
                self._leash()  # all or none: stop what this host already started
                break
            proc = RankProc(rank=rank, pid=child.pid, start=child.start, error_file=error_file)
            self.ranks[rank] = proc
            self.by_pid[child.pid] = proc
            for fd, kind in ((child.stdout, wire.STDOUT), (child.stderr, wire.STDERR)):
                os.set_blocking(fd, False)
                stream = Stream(proc, kind)
                self.streams[fd] = stream
                if not self.paused:
                    self.sel.register(fd, selectors.EVENT_READ, stream)
            if self.watchdog is not None:
                self.watchdog.watch(child.pid, child.start)
            self.send(wire.SPAWNED, {"rank": rank, "pid": child.pid})
        if self.ranks:  # nothing started (the first spawn failed): nothing to record
            self._write_record()
        note = registry.take_note()  # the registry had to move: said once, by this agent
        if note is not None:
            self._error(note)

    def _write_record(self) -> None:
        spec = self.spec
        assert spec is not None
        launcher = spec.get("launcher")
        record = {"version": procs.RECORD_VERSION, "run": spec["run_id"],
                  "cluster": spec["cluster"], "host": spec["host"], "agent": os.getpid(),
                  "agent_start": procs.start_time(os.getpid()),
                  "launcher": launcher if isinstance(launcher, dict) else None,
                  "started": time.time(),
                  "ranks": [{"rank": p.rank, "pid": p.pid, "start": p.start}
                            for p in self.ranks.values()]}
        try:
            procs.write_record(record)
            self.record_written = True
            self.last_touch = time.monotonic()
        except (OSError, procs.RegistryError, ValueError) as exc:
            self._error(f"cannot write the run registry ({exc}); `inv cleanup` will not know "
                        "this run")

    def _read_rank(self, fd: int) -> None:
        stream = self.streams.get(fd)
        if stream is None:
            return
        for _ in range(16):  # bounded, so one chatty rank cannot starve the loop
            data = _read_ready(fd)
            if data is None:
                return
            if not data:
                self._close_stream(fd, stream)
                return
            for chunk, partial in stream.splitter.feed(data):
                self._send_output(stream, chunk, partial)
            if len(self.out) > HIGH_WATER:
                return

    def _send_output(self, stream: Stream, chunk: bytes, partial: bool) -> None:
        if self.output_open:
            self.out += wire.output(stream.rank.rank, stream.kind, chunk, partial)

    def _close_stream(self, fd: int, stream: Stream) -> None:
        for chunk, partial in stream.splitter.flush():
            self._send_output(stream, chunk, partial)
        if not self.paused:
            self.sel.unregister(fd)
        del self.streams[fd]
        os.close(fd)

    def _drain_rank(self, proc: RankProc) -> None:
        """Forward what the rank wrote before it exited, so its output precedes its exit."""
        for fd, stream in list(self.streams.items()):
            if stream.rank is proc:
                self._read_rank(fd)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            proc = self.by_pid.get(pid)
            if proc is None:
                self.code.reaped(pid, status)
                continue  # an adopted orphan (subreaper) or the watchdog
            proc.status = status
            self._drain_rank(proc)
            code: Optional[int] = None
            sig: Optional[int] = None
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
            else:
                code = os.WEXITSTATUS(status)
            exited: Dict[str, Any] = {"rank": proc.rank, "code": code, "signal": sig}
            if code != 0 and proc.error_file:
                error = procs.read_error_file(proc.error_file)
                if error:
                    exited["error"] = error
            self.send(wire.EXITED, exited)

    def _signal(self, sig: int, rank: Optional[Any]) -> None:
        for proc in self.ranks.values():
            if proc.running and (rank is None or rank == proc.rank):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

    # -- stopping ---------------------------------------------------------------------------
    def _leash(self, signal_ranks: bool = True, first: int = signal.SIGTERM) -> None:
        """Graceful stop of everything: ``first`` now (unless the ranks already have it),
        KILL after the kill grace. A first SIGINT (Ctrl-C: Python ranks print where they
        were) is followed by TERM `wire.INT_GRACE` seconds later, or at half the grace."""
        if self.stopping:
            return
        self.stopping = True
        grace = float(self.spec["kill_grace"]) if self.spec else 0.0
        now = time.monotonic()
        if signal_ranks:
            self._signal(first, None)
            if self.spec is not None:
                procs.signal_pids(self._strays(), first)
            if first != signal.SIGTERM:
                self.term_at = now + min(wire.INT_GRACE, grace / 2)
        self.kill_at = now + grace

    def _leash_now(self) -> None:
        self.stopping = True
        self._kill_all()

    def _kill_all(self) -> None:
        self.killed = True
        self._signal(signal.SIGKILL, None)
        if self.spec is not None:
            procs.signal_pids(self._strays(), signal.SIGKILL)

    def _strays(self) -> List[int]:
        """Processes of the run on this host outside the live ranks' groups: those that
        carry its id, and those reparented to this agent (a subreaper), whatever their
        environment."""
        return [pid for pid in self._run_processes() if _pgid(pid) not in
                {p.pid for p in self.ranks.values() if p.running}]

    def _run_processes(self) -> List[int]:
        spec = self.spec
        if spec is None or not self.started:
            return []
        found = set(procs.carriers(str(spec["run_id"]), str(spec["host"])))
        keep = {p.pid for p in self.ranks.values()} | set(self.collectors)
        if self.watchdog is not None:
            keep.add(self.watchdog.pid)
        found.update(procs.adopted(os.getpid(), keep))
        return sorted(found)

    def _read_signals(self) -> None:
        try:
            data = os.read(self._wake_r, 1024)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:
            if signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
                if signum == signal.SIGINT:
                    self.interrupts += 1
                # Said before the ranks' exits, which it causes: the launcher then knows
                # the run was stopped from outside (scancel, a time limit), not that it failed.
                if not self.stopping:
                    told: Dict[str, Any] = {"signal": signal.Signals(signum).name[3:],
                                            "stopping": True}
                    note = procs.take_stop_note(str(self.spec["run_id"]),
                                                str(self.spec["host"])) if self.spec else None
                    if note:
                        told["by"] = note
                    self.send(wire.SIGNALED, told)
                if self.stopping and self.interrupts >= 2:
                    self._kill_all()
                # Under Slurm the same TERM reached every process of the step (scancel, the
                # time limit): the ranks have it; a second one could cut their handler short.
                self._leash(signal_ranks=not _IN_SLURM_STEP)
            elif signum in (signal.SIGUSR1, signal.SIGUSR2):
                # An operator's `kill -USR1 <agent>` is meant for the ranks. Slurm's
                # `--signal=USR1@T` and `scancel --signal` reach every process of the step,
                # the ranks included: forwarding it too would deliver it twice.
                forward = not _IN_SLURM_STEP
                if forward:
                    self._signal(signum, None)
                self.send(wire.SIGNALED, {"signal": signal.Signals(signum).name[3:],
                                          "stopping": False, "forwarded": forward})

    # -- the end ----------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        if self.finished:
            return
        if self.started:
            if any(p.running for p in self.ranks.values()):
                return
            self._read_signals()  # a TERM that came with the ranks' end is still told
            self._verify()
            self.finished = True
            return
        if self.stopping or not self.input_open:
            # Nothing was started (pre-flight failed, or the launcher went away first).
            self.code.leash()  # the leash holds setup too
            self.send(wire.DONE)
            self.finished = True

    def _verify(self) -> None:
        """After the last rank: stop whatever of the run is left here, and say so."""
        spec = self.spec
        assert spec is not None
        run_id, host = str(spec["run_id"]), str(spec["host"])
        left = self._run_processes()
        remaining: List[int] = []
        stopped = procs.describe(left)
        if left:
            grace = min(float(spec["kill_grace"]), procs.SWEEP_GRACE) if not self.killed else 0.0
            remaining = procs.stop(self._run_processes, grace, self._pump)
        self.record_written = False
        if not remaining:
            procs.remove_record(run_id, host)
        procs.remove_error_files(run_id, host)
        # Output that leftovers wrote before they were stopped still belongs to the run.
        for fd, stream in list(self.streams.items()):
            self._read_rank(fd)
            if fd in self.streams:
                self._close_stream(fd, stream)
        self.send(wire.VERIFIED, {"stopped": stopped, "remaining": procs.describe(remaining)})
        if self.watchdog is not None:
            self.watchdog.done()
        self.send(wire.DONE)


def _read_ready(fd: int) -> Optional[bytes]:
    """One read of a non-blocking fd: None when nothing is there yet, b"" at its end (a
    read error ends the stream too: the agent cannot tell a broken pipe from EOF)."""
    while True:
        try:
            return os.read(fd, READ_SIZE)
        except BlockingIOError:
            return None
        except InterruptedError:
            continue
        except OSError:
            return b""


def _noop(signum: int, frame: Any) -> None:
    """Signals only wake the loop (through the wake-up fd); the loop decides."""


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def _become_subreaper() -> None:
    """Adopt orphans (a rank's double-forked daemons) instead of letting init have them."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def _decode_envelope(text: str) -> Dict[str, Any]:
    if not text:
        return {}
    import json

    try:
        obj = json.loads(bytes.fromhex(text).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise wire.ProtocolError(f"the envelope is not hex JSON: {exc}") from None
    return obj if isinstance(obj, dict) else {}


def main() -> int:
    """Entry point of the shipped agent (see `fdl_fabric.bundle`)."""
    try:
        return Agent().run()
    except KeyboardInterrupt:  # pragma: no cover - signals are handled by the loop
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["Agent", "main"]
