"""The agent: the host loop (`hostloop`) over its input, its ranks and its signals.

One process per host (flodl 0.7.0's agent phase). It reads a spec on its stdin, runs
the host's fast pre-flight and sweeps this cluster's leftovers, starts every rank in
its own session, forwards their output as whole lines, reports each exit the moment
it is reaped, and at the end makes sure nothing of the run is left on the host.

It is single-threaded on purpose: it forks ranks and its watchdog, which is only safe
without threads, and one ``select`` over stdin, the rank pipes (`ranks`), stdout and a
signal wake-up pipe needs no locking; the loop itself is `hostloop`'s, shared with the
relay. Nothing here polls on a timer: a rank's exit arrives as SIGCHLD through
`signal.set_wakeup_fd`, and the loop sleeps until something happens (or until a kill
grace runs out). Each frame from the launcher goes to its handler by type (the table
in `Agent.__init__`), each signal likewise.

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
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from fdl_fabric.agent import (
    children,
    codeops,
    cohortrelay,
    collectors,
    fleet,
    pids,
    procs,
    ranks,
    registry,
    watchdog,
    wire,
)
from fdl_fabric.agent.hostloop import EXIT_INTERNAL, EXIT_OK, EXIT_PROTOCOL, HostLoop
from fdl_fabric.rank import ENV_ERROR_FILE

#: Started by srun: a signal Slurm sends the step (scancel, the time limit, --signal)
#: reaches every process in it, the ranks included, not only the agent.
_IN_SLURM_STEP = os.environ.get("SLURM_STEP_ID") is not None


def _json(handler: Callable[[Dict[str, Any]], None]) -> Callable[[bytes], None]:
    """A frame handler for a JSON body."""
    return lambda body: handler(wire.parse_json(body))


class Agent(HostLoop):
    """The agent of one host; `run` returns its exit status."""

    def __init__(self, rfd: int = 0, wfd: int = 1) -> None:
        super().__init__(rfd, wfd, wire.DOWN_TYPES)
        self.spec: Optional[Dict[str, Any]] = None
        self.ranks = ranks.Ranks(self)
        self.input_open = True
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
        self.record_written = False
        self.last_touch = 0.0
        self.collectors = collectors.Collectors(self.send, self.sel)
        self.watchdog: Optional[watchdog.Watchdog] = None
        #: The code step: the synced code's store (its tree's lock) and ``setup:``.
        self.code = codeops.CodeOps(self.send, self.queue, self.sel)
        #: The fleet pre-flight's listener and dials (`fleet`), before any rank starts.
        self.fleet = fleet.FleetCheck(self.send, self.sel)
        #: The ranks' socket: they reach the coordinator through this agent (issue 35).
        self.cohort = cohortrelay.CohortRelay(self.send, self.sel, self.ranks.running_pids)
        self.frame_handlers.update({
            wire.SPEC: _json(self._on_spec), wire.PROBE: _json(self._on_probe),
            wire.START: lambda body: self._spawn_all(), wire.SIGNAL: _json(self._on_signal),
            wire.STOP: lambda body: self._on_stop(wire.parse_json(body) if body else {}),
            wire.KILL: lambda body: self._kill_now(), wire.SWEEP: _json(self._on_sweep),
            # Reading a PING renewed the lease; it is answered if the agent was quiet,
            # never while its ranks' beats go up (issue 35: 1,024 frames less a round).
            wire.PING: lambda body: None if self.cohort.beating else self._beat(),
            wire.SUSPEND: lambda body: self._suspend(True),
            wire.RESUME: lambda body: self._suspend(False),
            wire.STACKS: _json(self._on_stacks), wire.SYNC: _json(self.code.on_sync),
            wire.SYNC_DATA: self._on_sync_data, wire.SYNC_MANIFEST: _json(self.code.on_manifest),
            wire.SETUP: _json(self.code.on_setup), wire.LIST: _json(self._on_list),
            wire.COHORT_DOWN: _json(self.cohort.on_down)})
        self.signal_handlers.update({
            signal.SIGCHLD: lambda signum: None,  # wakes the loop: the reap follows
            signal.SIGHUP: self._on_stop_signal, signal.SIGTERM: self._on_stop_signal,
            signal.SIGINT: self._on_stop_signal,
            signal.SIGUSR1: self._on_user_signal, signal.SIGUSR2: self._on_user_signal})

    # -- setup ----------------------------------------------------------------------------
    def install(self) -> None:
        super().install()
        if not _IN_SLURM_STEP:
            # A local agent leaves the launcher's session, so a terminal's Ctrl-C, Ctrl-Z
            # and Ctrl-\ reach the launcher alone, which decides what its agents do. (Over
            # SSH the agent already leads a session of its own: this fails harmlessly.)
            with contextlib.suppress(OSError):
                os.setsid()
        pids.become_subreaper()

    def hello(self) -> None:
        self.out += wire.HANDSHAKE
        self.send(wire.HELLO, {
            "version": wire.VERSION, "pid": os.getpid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "system": os.uname().sysname,
            "machine": os.uname().machine,
        })

    # -- the loop's hooks -----------------------------------------------------------------
    def done(self) -> bool:
        return self.finished

    def closing(self) -> None:
        self.cohort.close()  # whatever the way out (a crash too), the ranks' socket goes

    def crashed(self, trace: str) -> None:
        self._error("agent crashed: " + trace)
        self._leash_now()

    def prepare(self) -> None:
        self.want_output()
        self.ranks.keep_pace()

    def after(self, now: float) -> None:
        self._reap()
        self._on_deadlines(time.monotonic())  # taken after the reap
        self._maybe_finish()

    def deadlines(self) -> List[float]:
        due: List[float] = []
        if self.kill_at is not None and not self.killed:
            due.append(self.kill_at)
        if self.term_at is not None:
            due.append(self.term_at)
        lease_end = self._lease_end()
        if lease_end is not None:
            due.append(lease_end)
        due += self.ranks.deadlines() + self.cohort.deadlines()
        if self.record_written:
            due.append(self.last_touch + procs.RECORD_TOUCH)
        for more in (self.code.deadline(), self.fleet.deadline()):
            if more is not None:
                due.append(more)
        return due

    def _on_deadlines(self, now: float) -> None:
        """Act on every deadline `deadlines` woke the loop for that ``now`` has passed.
        One ``now`` for all, taken after the reap, and a fixed order: a lease that runs
        out starts the leash before the stop's own TERM and KILL moments are looked at."""
        self._end_lease_if_expired(now)
        self._term_after_interrupt(now)
        self._kill_after_grace(now)
        self.ranks.kill_past_grace(now)
        self._touch_record_if_due(now)
        self.code.on_time(now)
        self.fleet.expire(now)
        self.cohort.on_time(now)

    def _end_lease_if_expired(self, now: float) -> None:
        """The launcher's silence outlived the lease: act as on EOF, since a stalled
        stream without an EOF must not keep ranks running for ever."""
        lease_end = self._lease_end()
        if lease_end is not None and now >= lease_end:
            self.send(wire.ERROR, {
                "message": f"no word from the launcher for {self.lease:g}s (it was stopped or "
                           "suspended, or its host, its link or the srun carrying this agent "
                           "is gone): stopping every rank",
                "rank": None, "lease": self.lease})
            self._leash()

    def _term_after_interrupt(self, now: float) -> None:
        """An INT-first stop (Ctrl-C: Python ranks print where they were) turns to TERM
        once its moment comes, for the ranks and the run's strays alike, as both got the
        INT: a process that caught the INT and went on must still be asked to stop."""
        if self.term_at is not None and now >= self.term_at:
            self.term_at = None
            self.ranks.signal(signal.SIGTERM)
            procs.signal_pids(self._strays(), signal.SIGTERM)

    def _kill_after_grace(self, now: float) -> None:
        """The whole stop's kill grace is over: KILL everything, once."""
        if self.kill_at is not None and not self.killed and now >= self.kill_at:
            self._kill_all()

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

    # -- output to the launcher -------------------------------------------------------------
    def send(self, kind: int, obj: Optional[Dict[str, Any]] = None) -> None:
        self.queue(wire.message(kind, obj))

    def _beat(self) -> None:
        """A heartbeat, if nothing else went up for `wire.HEARTBEAT_INTERVAL`."""
        if time.monotonic() - self.last_sent >= wire.HEARTBEAT_INTERVAL:
            self.send(wire.HEARTBEAT)

    def _pump(self, seconds: float) -> None:
        """Wait ``seconds`` inside a blocking step (a sweep, a stop) while staying heard:
        a heartbeat goes out, and what is queued for the launcher is written."""
        self._beat()
        if self.out and self.output_open:
            self.write_out()
        time.sleep(seconds)

    def _error(self, text: str, rank: Optional[int] = None) -> None:
        self.send(wire.ERROR, {"message": text, "rank": rank})

    def output_lost(self) -> None:
        self._leash()

    # -- input from the launcher ------------------------------------------------------------
    def heard(self) -> None:
        self.last_input = time.monotonic()

    def input_ended(self) -> None:
        self.input_open = False
        self.stop_input()
        self._leash()

    def protocol_error(self, reason: str) -> None:
        self._error(f"protocol error from the launcher: {reason}")
        self.exit_code = EXIT_PROTOCOL
        if self.input_open:
            self.input_open = False
            self.stop_input()
        self._leash()

    def _on_signal(self, request: Dict[str, Any]) -> None:
        name = request.get("signal")
        if name not in wire.SIGNALS:
            raise wire.ProtocolError(f"cannot forward signal {name!r}")
        self.ranks.signal(getattr(signal, "SIG" + str(name)), request.get("rank"))

    def _on_stop(self, request: Dict[str, Any]) -> None:
        name = request.get("signal") or "TERM"
        if name not in ("TERM", "INT"):
            raise wire.ProtocolError(f"cannot stop with signal {name!r}")
        rank = request.get("rank")
        if rank is None:
            self._leash(first=signal.SIGINT if name == "INT" else signal.SIGTERM)
            return
        grace = float(self.spec["kill_grace"]) if self.spec else 0.0
        self.ranks.stop_one(int(rank), time.monotonic() + grace)

    def _kill_now(self) -> None:
        self.stopping = True
        self._kill_all()

    def _suspend(self, suspended: bool) -> None:
        """SUSPEND and RESUME (reading either renewed the lease)."""
        self.suspended = suspended

    def _on_sync_data(self, body: bytes) -> None:
        self._beat()  # a long transfer: the launcher hears it lives
        self.code.on_sync_data(body)

    def _on_list(self, request: Dict[str, Any]) -> None:
        cluster = request.get("cluster")
        self.send(wire.RUNS, procs.list_runs(str(cluster) if cluster else None))

    # -- spec, probe, pre-flight, sweep, stacks ---------------------------------------------
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
        envelope = wire.decode_envelope(str(spec.get("envelope", "")))
        if spec.get("checks"):
            from fdl_fabric.agent import checks  # only with a pre-flight: keeps starts light

            values = checks.gather(spec["checks"], bytes.fromhex(envelope.get("salt", "00" * 16)),
                                   str(spec["run_id"]), str(spec["host"]), beat=self._pump)
            self.send(wire.PREFLIGHT, {"values": values})
        if spec.get("cluster"):
            self.send(wire.SWEPT, procs.sweep(cluster=str(spec["cluster"]),
                                              keep=str(spec["run_id"]),
                                              keep_attempt=self.attempt, wait=self._pump))
        if spec.get("start_now"):
            self._spawn_all()

    def _on_stacks(self, request: Dict[str, Any]) -> None:
        """Start a collector for the stacks of this run's ranks, or (no spec: ``fdl-fabric
        stacks`` from another terminal) of a recorded run's ranks on this host."""
        req_id, run = request.get("id"), request.get("run")
        if self.spec is not None and run in (None, self.spec["run_id"]):
            run = self.spec["run_id"]
            pids, error = self.ranks.running_pids(), ""
        else:
            pids, error = collectors.recorded_ranks(run, request.get("host"))
        self.collectors.start(req_id, run, pids, error)

    def _on_probe(self, request: Dict[str, Any]) -> None:
        facts: Dict[str, Any] = {}
        if isinstance(request.get("fleet"), dict):  # answered by the fleet check itself
            self.fleet.on_request(request["fleet"], beat=self._pump)
            return
        if isinstance(request.get("smoke"), dict):
            from fdl_fabric.agent import smokerun

            self.fleet.close()  # the slots bind the job's own ports (MASTER_PORT)
            facts["smoke"] = smokerun.run(request["smoke"], beat=self._pump)
        if request.get("gpus"):
            from fdl_fabric.agent import gpus

            facts.update(gpus.gpu_indices())
        if isinstance(request.get("versions"), dict):
            from fdl_fabric.agent import versions

            facts["versions"] = versions.gather(request["versions"], beat=self._pump)
        self.send(wire.FACTS, facts)

    def _on_sweep(self, request: Dict[str, Any]) -> None:
        self.send(wire.SWEPT, procs.sweep_asked(request, wait=self._pump))
        self.send(wire.DONE)
        self.finished = True

    @property
    def attempt(self) -> int:
        """This spec's attempt (``--max-restarts``): what this agent stops is its own."""
        return int(self.spec.get("attempt", 0)) if self.spec is not None else 0

    # -- ranks ------------------------------------------------------------------------------
    def _spawn_all(self) -> None:
        spec = self.spec
        if spec is None:
            raise wire.ProtocolError("start before spec")
        if self.started or self.stopping:
            return
        self.started = True
        self.fleet.close()  # the ports it tested are the ranks' now
        if not self._registry_ready(spec):
            return
        self.watchdog = watchdog.start(str(spec["run_id"]), str(spec["host"]),
                                       float(spec["kill_grace"]), self.attempt)
        socket_path = self.cohort.open(spec, self.attempt)
        if self.watchdog is not None and socket_path is not None:
            self.watchdog.remove_at_end(socket_path)
        base = ranks.base_env(spec, socket_path)
        argv = [str(a) for a in spec["argv"]]
        for entry in spec["ranks"]:
            if not self._spawn_one(spec, entry, base, argv):
                break
        if self.ranks.procs:  # nothing started (the first spawn failed): nothing to record
            self._write_record()
        note = registry.take_note()  # the registry had to move: said once, by this agent
        if note is not None:
            self._error(note)

    def _registry_ready(self, spec: Dict[str, Any]) -> bool:
        """The run registry can take this run's record (a full disk falls back to the
        next place); when no place can, nothing starts: a run that `status` and
        `cleanup` cannot see must not run (all or none, as a failed spawn)."""
        try:
            registry.writable_dir()
        except OSError as exc:  # RegistryError is one
            first = spec["ranks"][0]["rank"] if spec["ranks"] else 0
            self.send(wire.SPAWN_FAILED, {"rank": first, "reason": (
                f"the run registry cannot be written on this host ({exc}): status and "
                "cleanup would not see this run, so it was not started")})
            self._leash()
            return False
        return True

    def _spawn_one(self, spec: Dict[str, Any], entry: Dict[str, Any], base: Dict[str, str],
                   argv: List[str]) -> bool:
        """Start one rank; False when it could not be (then the leash holds the others:
        all or none)."""
        rank = int(entry["rank"])
        env = dict(base)
        env.update(entry.get("env") or {})
        error_file = ""
        try:
            if spec.get("error_files"):
                error_file = procs.error_file(str(spec["run_id"]), str(spec["host"]),
                                              int(spec.get("attempt", 0)), rank)
                env[ENV_ERROR_FILE] = error_file
            child = self.ranks.start(rank, argv, env, str(spec["cwd"]), error_file)
        except (OSError, procs.RegistryError, children.SpawnError) as exc:
            self.send(wire.SPAWN_FAILED, {"rank": rank, "reason": children.problem(exc)})
            self._leash()  # all or none: stop what this host already started
            return False
        if self.watchdog is not None:
            self.watchdog.watch(child.pid, child.start)
        self.send(wire.SPAWNED, {"rank": rank, "pid": child.pid})
        return True

    def _write_record(self) -> None:
        spec = self.spec
        assert spec is not None
        launcher = spec.get("launcher")
        record = {"version": procs.RECORD_VERSION, "run": spec["run_id"],
                  "cluster": spec["cluster"], "host": spec["host"], "agent": os.getpid(),
                  "agent_start": procs.start_time(os.getpid()),
                  "launcher": launcher if isinstance(launcher, dict) else None,
                  "started": time.time(), "attempt": self.attempt,
                  "ranks": self.ranks.record()}
        try:
            procs.write_record(record)
            self.record_written = True
            self.last_touch = time.monotonic()
        except (OSError, procs.RegistryError, ValueError) as exc:
            self._error(f"cannot write the run registry ({exc}); `inv cleanup` will not know "
                        "this run")

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
            exited = self.ranks.exited(pid, status)
            if exited is None:
                self.code.reaped(pid, status)
                continue  # an adopted orphan (subreaper) or the watchdog
            self.send(wire.EXITED, exited)

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
            self.ranks.signal(first)
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
        self.ranks.signal(signal.SIGKILL)
        if self.spec is not None:
            procs.signal_pids(self._strays(), signal.SIGKILL)

    def _strays(self) -> List[int]:
        """Processes of the run on this host outside the live ranks' groups: those that
        carry its id, and those reparented to this agent (a subreaper), whatever their
        environment."""
        live = set(self.ranks.live_groups())
        return [pid for pid in self._run_processes() if pids.pgid(pid) not in live]

    def _run_processes(self) -> List[int]:
        spec = self.spec
        if spec is None or not self.started:
            return []
        found = set(procs.carriers(str(spec["run_id"]), str(spec["host"]), self.attempt))
        keep = set(self.ranks.pids()) | set(self.collectors.pids())
        if self.watchdog is not None:
            keep.add(self.watchdog.pid)
        found.update(procs.adopted(os.getpid(), keep))
        return sorted(found)

    def _on_stop_signal(self, signum: int) -> None:
        """HUP, TERM or INT: the leash (a second INT while stopping: KILL at once)."""
        if signum == signal.SIGINT:
            self.interrupts += 1
        # Said before the ranks' exits, which it causes: the launcher then knows the run
        # was stopped from outside (scancel, a time limit), not that it failed.
        if not self.stopping:
            told: Dict[str, Any] = {"signal": signal.Signals(signum).name[3:], "stopping": True}
            note = procs.take_stop_note(str(self.spec["run_id"]),
                                        str(self.spec["host"])) if self.spec else None
            if note:
                told["by"] = note
            self.send(wire.SIGNALED, told)
        if self.stopping and self.interrupts >= 2:
            self._kill_all()
        # Under Slurm the same TERM reached every process of the step (scancel, the time
        # limit): the ranks have it; a second one could cut their handler short.
        self._leash(signal_ranks=not _IN_SLURM_STEP)

    def _on_user_signal(self, signum: int) -> None:
        """USR1 or USR2: an operator's `kill -USR1 <agent>` is meant for the ranks. Slurm's
        `--signal=USR1@T` and `scancel --signal` reach every process of the step, the
        ranks included: forwarding it too would deliver it twice."""
        forward = not _IN_SLURM_STEP
        if forward:
            self.ranks.signal(signum)
        self.send(wire.SIGNALED, {"signal": signal.Signals(signum).name[3:],
                                  "stopping": False, "forwarded": forward})

    # -- the end ----------------------------------------------------------------------------
    def _maybe_finish(self) -> None:
        if self.finished:
            return
        if self.started:
            if self.ranks.any_running():
                return
            self.on_wake()  # a TERM that came with the ranks' end is still told
            self._verify()
            self.finished = True
            return
        if self.stopping or not self.input_open:
            # Nothing was started (pre-flight failed, or the launcher went away first).
            self.code.leash()  # the leash holds setup too
            self.fleet.close()
            self.send(wire.DONE)
            self.finished = True

    def _verify(self) -> None:
        """After the last rank: stop whatever of the run is left here, and say so."""
        spec = self.spec
        assert spec is not None
        run_id, host = str(spec["run_id"]), str(spec["host"])
        self.cohort.close()  # the ranks are gone: their socket goes before `done`
        left = self._run_processes()
        remaining: List[int] = []
        stopped = procs.describe(left)
        if left:
            grace = min(float(spec["kill_grace"]), procs.SWEEP_GRACE) if not self.killed else 0.0
            remaining = procs.stop(self._run_processes, grace, self._pump)
        self.record_written = False
        # A later attempt's agent on this host may own the record (and the folder) now.
        if not remaining and procs.remove_record(run_id, host, agent=os.getpid()):
            procs.remove_error_files(run_id, host)
        # Output that leftovers wrote before they were stopped still belongs to the run.
        self.ranks.drain_all()
        self.send(wire.VERIFIED, {"stopped": stopped, "remaining": procs.describe(remaining)})
        if self.watchdog is not None:
            self.watchdog.done()
        self.send(wire.DONE)


def main() -> int:
    """Entry point of the shipped agent (see `fdl_fabric.transport.bundle`)."""
    try:
        return Agent().run()
    except KeyboardInterrupt:  # pragma: no cover - signals are handled by the loop
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["EXIT_INTERNAL", "EXIT_OK", "EXIT_PROTOCOL", "Agent", "main"]
