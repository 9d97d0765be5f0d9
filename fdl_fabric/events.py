"""Run events: what happened, as data; the words are the renderer's.

Nothing outside `fdl_fabric.presentation` prints or composes a sentence for the
operator. Code that has something to say emits an `Event`: a `Name` (what happened,
one of a closed set, each with its `Kind`) and its data. `presentation.words.render`
is the one place that turns an event into words; the console shows them, the run log
(``--log-dir``) keeps each event as JSON with its name, its data and those words, and
a caller of the Python API gets the events themselves. A new output format (JSON
lines, a web view) is one sink; a new message is one `Name` here and one entry in
`presentation.words`.

This module is the shared vocabulary of every layer, so it imports nothing of ours.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Protocol


class Kind(str, Enum):
    """The family of an event: what the console filters on (``-v``, ``-q``) and the
    ``event`` field of events.jsonl."""

    LAUNCH = "launch"
    CONNECT = "connect"
    SPAWN = "spawn"
    OUTPUT = "output"
    JOIN = "join"
    FORMED = "formed"
    EXIT = "exit"
    DEATH = "death"
    TOLERATED = "tolerated"
    STOPPING = "stopping"
    RESTART = "restart"
    SHUTDOWN = "shutdown"
    HANG = "hang"
    STACKS = "stacks"
    #: The end-of-run tables: summary, attempts, root cause.
    SUMMARY = "summary"
    VERDICT = "verdict"
    #: What a command was asked for (a dry run, a check report, stacks): on stdout.
    RESULT = "result"
    WARNING = "warning"
    INFO = "info"
    DEBUG = "debug"


class Name(str, Enum):
    """What happened. Each name has one kind and one wording (`presentation.words`)."""

    kind: Kind

    def __new__(cls, value: str, kind: Kind) -> Name:
        member = str.__new__(cls, value)
        member._value_ = value
        member.kind = kind
        return member

    # -- the launch ------------------------------------------------------------------------
    LAUNCH = ("launch", Kind.LAUNCH)
    CONNECTED = ("connected", Kind.CONNECT)
    TUNNEL_OPENED = ("tunnel_opened", Kind.CONNECT)
    #: A tunnel turned a forwarded connection away for the first time (said once).
    TUNNEL_TURNING_AWAY = ("tunnel_turning_away", Kind.WARNING)
    #: How many forwarded connections a tunnel turned away in all, when it closed.
    TUNNEL_TURNED_AWAY = ("tunnel_turned_away", Kind.WARNING)
    #: sshd listens on a tunnel's port beyond loopback (GatewayPorts).
    TUNNEL_EXPOSED = ("tunnel_exposed", Kind.WARNING)
    #: The launcher raised its soft RLIMIT_NOFILE to what the run needs.
    OPEN_FILES_RAISED = ("open_files_raised", Kind.INFO)
    PLAN_LOOPBACK_MASTER = ("plan_loopback_master", Kind.WARNING)
    OMP_DEFAULTED = ("omp_defaulted", Kind.INFO)
    BATCHMODE_OFF = ("batchmode_off", Kind.WARNING)
    KEEPALIVE_LOST = ("keepalive_lost", Kind.WARNING)
    LOG_FAILED = ("log_failed", Kind.WARNING)
    #: ``--log-dir``: where this run's logs go, said as it starts (and its ``latest`` link).
    LOG_FOLDER = ("log_folder", Kind.LAUNCH)
    #: ``sync``: the code this run runs (its code id), said before any host is contacted.
    CODE = ("code", Kind.LAUNCH)
    #: One host's tree is in place (what it was sent).
    CODE_SYNCED = ("code_synced", Kind.CONNECT)
    #: Every host's tree is in place.
    CODE_IN_PLACE = ("code_in_place", Kind.LAUNCH)
    #: Lines a host's ``setup:`` wrote.
    SETUP_OUTPUT = ("setup_output", Kind.INFO)
    #: A host's ``setup:`` succeeded, or was skipped (done before for this key).
    SETUP_DONE = ("setup_done", Kind.LAUNCH)
    #: A host's ``setup:`` failed: its last lines (the verdict follows).
    SETUP_FAILED = ("setup_failed", Kind.WARNING)
    #: Every host runs the same Python, packages and NCCL (`preflight.fleet`).
    VERSIONS_AGREE = ("versions_agree", Kind.LAUNCH)
    FLEET_CHECK_PASSED = ("fleet_check_passed", Kind.LAUNCH)
    #: ``setup:`` is not run: ``--no-sync`` (it runs in the synced folder).
    SETUP_NOT_RUN = ("setup_not_run", Kind.WARNING)
    FAILURE_DETAIL = ("failure_detail", Kind.WARNING)
    RESTARTING = ("restarting", Kind.RESTART)
    #: The membership of an attempt: its hosts, world size, who is left out and why.
    ATTEMPT_HOSTS = ("attempt_hosts", Kind.DEBUG)
    #: A gateway was lost: the next attempt's tree is planned without it.
    TREE_REPLANNED = ("tree_replanned", Kind.RESTART)
    HOSTS_LEFT_OUT = ("hosts_left_out", Kind.WARNING)
    SWEEP_UNREACHABLE = ("sweep_unreachable", Kind.WARNING)
    SWEEP_INCOMPLETE = ("sweep_incomplete", Kind.WARNING)
    SWEEP_STOPPED = ("sweep_stopped", Kind.WARNING)
    #: A host lost to a partition answered a fresh connection: what its lost attempt
    #: left running there was stopped (`commands.healwatch`).
    HOST_ANSWERED_AGAIN = ("host_answered_again", Kind.WARNING)
    OUTPUT_DROPPED = ("output_dropped", Kind.INFO)
    CONSOLE_STALLED = ("console_stalled", Kind.WARNING)
    STDOUT_CLOSED = ("stdout_closed", Kind.WARNING)
    MAX_FAILURE_UNUSED = ("max_failure_unused", Kind.WARNING)
    LIBRARY_LOG = ("library_log", Kind.DEBUG)
    THREAD_CRASHED = ("thread_crashed", Kind.WARNING)
    TRACEBACK = ("traceback", Kind.DEBUG)
    # -- hosts and their agents --------------------------------------------------------------
    AGENT_WARNING = ("agent_warning", Kind.WARNING)
    PREFLIGHT_WARNING = ("preflight_warning", Kind.WARNING)
    PREFLIGHT_FAILED_CHECK = ("preflight_failed_check", Kind.WARNING)
    PREFLIGHT_PASSED = ("preflight_passed", Kind.DEBUG)
    LEFTOVER_ERROR = ("leftover_error", Kind.WARNING)
    LEFTOVERS_STOPPED = ("leftovers_stopped", Kind.WARNING)
    LEFTOVER_KEPT = ("leftover_kept", Kind.WARNING)
    LIVE_RUN_LEFT = ("live_run_left", Kind.INFO)
    AFTER_RUN_STOPPED = ("after_run_stopped", Kind.WARNING)
    AFTER_RUN_REMAINS = ("after_run_remains", Kind.WARNING)
    HOST_LOST = ("host_lost", Kind.WARNING)
    HOST_UNRESPONSIVE = ("host_unresponsive", Kind.DEATH)
    HOST_ABANDONED = ("host_abandoned", Kind.WARNING)
    OUTSIDE_SIGNAL = ("outside_signal", Kind.INFO)
    AGENT_SIGNALED = ("agent_signaled", Kind.STOPPING)
    #: A host's agent sent frames (output, spawns, exits, spawn failures, errors) for
    #: ranks it does not run in this attempt: dropped, and counted once, when it ends.
    FOREIGN_FRAMES = ("foreign_frames", Kind.WARNING)
    # -- ranks -------------------------------------------------------------------------------
    RANK_STARTED = ("rank_started", Kind.SPAWN)
    RANK_OUTPUT = ("rank_output", Kind.OUTPUT)
    #: Every rank of an attempt has a pid: what ``--detach`` waits for.
    ALL_RANKS_RUNNING = ("all_ranks_running", Kind.SPAWN)
    RANK_START_FAILED = ("rank_start_failed", Kind.DEATH)
    RANK_EXITED = ("rank_exited", Kind.EXIT)
    RANK_FAILED = ("rank_failed", Kind.DEATH)
    RANK_TOLERATED = ("rank_tolerated", Kind.TOLERATED)
    RANK_DEAD_STOPPED = ("rank_dead_stopped", Kind.TOLERATED)
    RANK_FORWARD_STOPPED = ("rank_forward_stopped", Kind.EXIT)
    # -- the coordinator -----------------------------------------------------------------------
    RANK_JOINED = ("rank_joined", Kind.JOIN)
    COHORT_FORMED = ("cohort_formed", Kind.FORMED)
    RANK_DECLARED_DEAD = ("rank_declared_dead", Kind.DEATH)
    RANK_EXITING = ("rank_exiting", Kind.DEBUG)
    RANK_DISCONNECTED = ("rank_disconnected", Kind.DEBUG)
    RANK_CONNECTION_LOST = ("rank_connection_lost", Kind.INFO)
    SHUTDOWN_BROADCAST = ("shutdown_broadcast", Kind.SHUTDOWN)
    PROBE_RECEIVED = ("probe_received", Kind.DEBUG)
    PEER_CLOSED = ("peer_closed", Kind.DEBUG)
    PEER_DROPPED = ("peer_dropped", Kind.WARNING)
    PEER_REJECTED = ("peer_rejected", Kind.WARNING)
    PEERS_REFUSED = ("peers_refused", Kind.WARNING)
    ACCEPT_FAILED = ("accept_failed", Kind.WARNING)
    COORDINATOR_FAILED = ("coordinator_failed", Kind.WARNING)
    # -- stopping, hangs, signals ------------------------------------------------------------
    STOPPING_ON_SIGNAL = ("stopping_on_signal", Kind.STOPPING)
    KILLING_NOW = ("killing_now", Kind.STOPPING)
    STOPPING_ON_FAILURE = ("stopping_on_failure", Kind.STOPPING)
    STOPPING_AFTER_SHUTDOWN = ("stopping_after_shutdown", Kind.STOPPING)
    FAILURE_ANNOUNCED = ("failure_announced", Kind.STOPPING)
    HANG_DETECTED = ("hang_detected", Kind.HANG)
    STACKS_ASKED = ("stacks_asked", Kind.INFO)
    STACKS = ("stacks", Kind.STACKS)
    SUSPENDED = ("suspended", Kind.INFO)
    # -- why a run ended (the cause of a verdict) --------------------------------------------
    COMPLETED = ("completed", Kind.VERDICT)
    COMPLETED_TEARDOWN = ("completed_teardown", Kind.VERDICT)
    DEGRADED = ("degraded", Kind.VERDICT)
    COMPLETED_ON_FEWER_HOSTS = ("completed_on_fewer_hosts", Kind.VERDICT)
    NOT_ENOUGH_HOSTS = ("not_enough_hosts", Kind.VERDICT)
    EVERY_RANK_LOST = ("every_rank_lost", Kind.VERDICT)
    MAX_FAILURE_EXCEEDED = ("max_failure_exceeded", Kind.VERDICT)
    MAX_FAILURE_REACHED = ("max_failure_reached", Kind.SHUTDOWN)
    ALL_RANKS_DEAD = ("all_ranks_dead", Kind.SHUTDOWN)
    PREFLIGHT_FAILED = ("preflight_failed", Kind.VERDICT)
    HOST_ENDED_EARLY = ("host_ended_early", Kind.VERDICT)
    LAUNCHER_SUSPENDED = ("launcher_suspended", Kind.VERDICT)
    AGENT_KILLED = ("agent_killed", Kind.VERDICT)
    COHORT_NOT_FORMED = ("cohort_not_formed", Kind.VERDICT)
    HUNG = ("hung", Kind.VERDICT)
    INTERRUPTED = ("interrupted", Kind.VERDICT)
    STOPPED_BY_CLEANUP = ("stopped_by_cleanup", Kind.VERDICT)
    STOPPED_BY_COMMAND = ("stopped_by_command", Kind.VERDICT)
    INTERRUPTED_BY_FORWARD = ("interrupted_by_forward", Kind.VERDICT)
    INTERRUPTED_OUTSIDE_RUN = ("interrupted_outside_run", Kind.VERDICT)
    LAUNCH_FAILED = ("launch_failed", Kind.VERDICT)
    # -- the end of a launch -----------------------------------------------------------------
    SUMMARY = ("summary", Kind.SUMMARY)
    ATTEMPTS = ("attempts", Kind.SUMMARY)
    ROOT_CAUSE = ("root_cause", Kind.SUMMARY)
    #: ``--log-dir``: where this run's logs are, said again just before the verdict.
    LOGS_KEPT = ("logs_kept", Kind.SUMMARY)
    #: ``--on-exit``: the hook ran, or failed (neither changes the verdict).
    ON_EXIT_RAN = ("on_exit_ran", Kind.INFO)
    ON_EXIT_FAILED = ("on_exit_failed", Kind.WARNING)
    VERDICT = ("verdict", Kind.VERDICT)
    DRY_RUN = ("dry_run", Kind.RESULT)
    # -- runs that outlive the terminal (`fdl_fabric.runs`) ------------------------------------
    DETACHED = ("detached", Kind.RESULT)
    HANGUP_IGNORED = ("hangup_ignored", Kind.INFO)
    RECORD_FAILED = ("record_failed", Kind.WARNING)
    RECORDS_PRUNED = ("records_pruned", Kind.DEBUG)
    SUPERVISOR_LOST = ("supervisor_lost", Kind.VERDICT)
    ATTACHED = ("attached", Kind.INFO)
    ATTACH_LEFT = ("attach_left", Kind.INFO)
    RUN_ENDED = ("run_ended", Kind.VERDICT)
    RUN_NOT_FOUND = ("run_not_found", Kind.VERDICT)
    STOP_SENT = ("stop_sent", Kind.INFO)
    WAIT_TIMED_OUT = ("wait_timed_out", Kind.VERDICT)
    RUNS_VIEW = ("runs_view", Kind.RESULT)
    # -- the other commands ------------------------------------------------------------------
    REFUSED = ("refused", Kind.WARNING)
    # the join window (workers that dial in)
    JOIN_WINDOW_OPEN = ("join_window_open", Kind.INFO)
    JOIN_ADMITTED = ("join_admitted", Kind.INFO)
    JOIN_REFUSED = ("join_refused", Kind.WARNING)
    JOIN_REFUSALS = ("join_refusals", Kind.WARNING)
    JOIN_LEFT = ("join_left", Kind.WARNING)
    JOIN_REJOINED = ("join_rejoined", Kind.INFO)
    JOIN_START_ARMED = ("join_start_armed", Kind.INFO)
    JOIN_WORLD_FORMED = ("join_world_formed", Kind.FORMED)
    JOIN_WINDOW_FAILED = ("join_window_failed", Kind.VERDICT)
    JOIN_WINDOW_VIEW = ("join_window_view", Kind.RESULT)
    JOIN_WINDOW_PLANNED = ("join_window_planned", Kind.RESULT)
    CLEANUP_HOST = ("cleanup_host", Kind.INFO)
    STEPS_CANCELLED = ("steps_cancelled", Kind.INFO)
    STEPS_NOT_CANCELLED = ("steps_not_cancelled", Kind.WARNING)
    CLEANUP_FAILED = ("cleanup_failed", Kind.VERDICT)
    CLEANUP_VERIFIED = ("cleanup_verified", Kind.VERDICT)
    CHECK_REPORT = ("check_report", Kind.RESULT)
    CHECK_VERDICT = ("check_verdict", Kind.RESULT)
    STACKS_PROBLEM = ("stacks_problem", Kind.WARNING)
    STACKS_NO_LIVE_RUN = ("stacks_no_live_run", Kind.VERDICT)
    STACKS_RUN_UNKNOWN = ("stacks_run_unknown", Kind.VERDICT)
    STACKS_VIEW = ("stacks_view", Kind.RESULT)
    STATUS_VIEW = ("status_view", Kind.RESULT)
    PLOT_FAILED = ("plot_failed", Kind.VERDICT)
    PLOT_DRAWN = ("plot_drawn", Kind.RESULT)


@dataclass(frozen=True)
class Event:
    """One thing that happened: its name, where, and its data (JSON-able values)."""

    name: Name
    host: Optional[str] = None
    rank: Optional[int] = None
    data: dict[str, Any] = field(default_factory=dict)
    #: When it happened (not part of what happened: equal events may differ in time).
    time: float = field(default_factory=time.time, compare=False)

    @property
    def kind(self) -> Kind:
        return self.name.kind


def event(name: Name, /, *, host: Optional[str] = None, rank: Optional[int] = None,
          **data: Any) -> Event:
    """An event built the way `EventBus.__call__` builds one (for a verdict's cause)."""
    return Event(name, host=host, rank=rank, data=data)


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...


class EventBus:
    """Fans one event out to every handler; handlers must not raise."""

    def __init__(self, *handlers: EventSink) -> None:
        self._handlers = list(handlers)
        self._lock = threading.Lock()

    def add(self, handler: EventSink, *, first: bool = False) -> None:
        """A sink; ``first``: before the others (a record that callers read as soon as
        they hear of an event, such as the run's state when ``--detach`` returns)."""
        with self._lock:
            if first:
                self._handlers.insert(0, handler)
            else:
                self._handlers.append(handler)

    def emit(self, event: Event) -> None:
        with self._lock:
            handlers = list(self._handlers)
        for handler in handlers:
            handler.emit(event)

    def __call__(self, name: Name, /, *, host: Optional[str] = None, rank: Optional[int] = None,
                 **data: Any) -> None:
        self.emit(Event(name, host=host, rank=rank, data=data))


class EventLog:
    """Keeps every event in memory, so a caller can look back at what happened."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: Kind) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.kind is kind]

    def named(self, name: Name) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.name is name]
