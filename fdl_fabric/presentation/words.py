"""The words: every event (`fdl_fabric.events.Event`) rendered as what the operator reads.

This is the one place that composes a sentence for a person. Emitters say what
happened (`events.Name`) and give the facts (`Event.data`); a message changes here and
nowhere else, and a test of wording is a test of this module. Every `Name` has an
entry in `_WORDS`, which a test checks.

The launcher's lines begin ``cluster launcher:`` and the coordinator's ``cluster
coordinator:``, as in flodl, so a log can be grepped by speaker. A verdict line is the
rendering of the event that caused it (`_verdict`).

It imports only vocabulary (`events`, `causes`) and its own wording modules, so any
layer above presentation that must put words somewhere other than a console (a
result's message for a caller of the Python API) renders through it too. Supervision,
below, never does: a save-and-shutdown's reason on the wire is the protocol's sentence
(`fdl_fabric.shutdown`), which the table here gives its two names as well.

The words are one line per message, whatever its length: pipes, logs and greps get them
whole. Only a terminal gets them laid out for its width (``render(event, width)``,
`layout.fit`); the end-of-run tables wrap their cause column in place (`layout.table`).

Words from a host are data, never terminal control: `render` makes every string of an
event inert before any wording sees it (`hostwords.inert_data`), so whoever renders (the
console, the record's ``message``, a Python caller's verdict line) gets no escape, and
the fields a host sent that are quoted inside one line (`hostwords.FROM_HOSTS`) no
newline either. The wording functions below quote them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from ..causes import cause_data as cause_data  # a verdict's cause, as callers build it
from ..causes import cause_event as cause_event  # and back, for what reads a record
from ..events import Event, Kind, Name
from ..inert import one_line
from ..masking import mask_data
from ..shutdown import SHUTDOWN_REASONS
from ..states import STOPPED_BY_LEASE
from .codewords import CODE_WORDS
from .commandwords import COMMAND_WORDS
from .dryrunwords import dry_run_text
from .hostwords import inert_data
from .joinwords import JOIN_WORDS
from .layout import HANG as HANG  # the continuation indent, as tests measure it
from .layout import fit, table
from .runwords import RUN_WORDS
from .setupwords import SETUP_WORDS
from .speakers import C, L
from .stacks import rank_list, stacks_text


def render(event: Event, width: Optional[int] = None) -> str:
    """The event in words (one line, or a block for tables and views); with ``width``,
    laid out for a terminal that many columns wide (what fits is left as it is). Its
    strings are masked (`masking`: a secret by name, ``secret_env`` or value, except in
    a rank's own output) and made inert (`inert_data`) first."""
    if event.kind is not Kind.OUTPUT:
        shown = mask_data(event.data)
        if shown is not event.data:
            event = Event(event.name, host=event.host, rank=event.rank, data=shown,
                          time=event.time)
    event = inert_data(event)
    if width is None:
        return _WORDS[event.name](event, event.data)
    fitted = _FITTED.get(event.name)
    if fitted is not None:
        return fitted(event, event.data, width)
    return fit(_WORDS[event.name](event, event.data), width)


def has_words(name: Name) -> bool:
    return name in _WORDS


# -- facts shared by many messages ------------------------------------------------------------
def label(e: Event) -> str:
    """``rank 3 of node2``: how a rank is named in a sentence."""
    return f"rank {e.rank} of {e.host}"


def exit_words(exit_: Mapping[str, Any]) -> str:
    """How a rank ended: ``status 3``, ``signal 9``, ``no exit status (agent lost: …)``."""
    if exit_.get("lost") is not None:
        return f"no exit status ({exit_['lost']})"
    if exit_.get("signal") is not None:
        return f"signal {exit_['signal']}"
    return f"status {exit_.get('code')}"


def exit_cell(exit_: Mapping[str, Any] | None) -> str:
    """The summary's exit column: the code, ``signal N``, or ``-`` (none came)."""
    if not exit_ or exit_.get("lost") is not None:
        return "-"
    if exit_.get("signal") is not None:
        return f"signal {exit_['signal']}"
    return str(exit_.get("code"))


#: The summary's cause column, by the rank's final state.
_CAUSES = {
    "pending": "pending", "running": "running", "joined": "joined",
    "succeeded": "ok", "failed": "failed", "stopped": "stopped by the launcher",
    "tolerated": "tolerated", "lost": "lost", "not started": "never started",
}


def cause_cell(row: Mapping[str, Any]) -> str:
    """Why a rank ended, in the words of the run summary."""
    if row.get("stopped_by") == STOPPED_BY_LEASE:
        return "stopped by its agent's lease"
    if row.get("stopped_by"):
        return f"stopped by {row['stopped_by']} (forwarded)"
    if row.get("host_fault"):
        return f"host {row['host_fault']}"
    if row.get("declared_dead") and row.get("state") == "tolerated":
        return "declared dead"
    state = str(row.get("state"))
    return _CAUSES.get(state, state)


def unreachable(why: str) -> str:
    """``unreachable: <reason>`` for a failed connect, whatever its wording."""
    return why if why.startswith("unreachable") else f"unreachable: {why}"


def _s(seconds: float) -> str:
    return f"{seconds:g}s"


# -- the launch -------------------------------------------------------------------------------
def _agent_killed(e: Event, d: Mapping[str, Any]) -> str:
    one = len(d["ranks"]) == 1
    ranks = f"rank {d['ranks'][0]} was" if one else f"ranks {rank_list(d['ranks'])} were"
    return (f"{L}the agent of {e.host} was killed by signal {d['signal']} (sender unknown): "
            f"{ranks} lost with it, and what {'it' if one else 'they'} wrote after its last "
            "frame is lost too")


def _answered_again(e: Event, d: Mapping[str, Any]) -> str:
    said = f"{L}host {e.host!r} reached again {d['after']:g}s after it was lost"
    if d.get("problem"):
        return f"{said}, but what attempt {d['attempt']} left there could not be cleared: " \
            f"{d['problem']}"
    if d["pids"]:
        return f"{said}: stopped what attempt {d['attempt']} still ran there (pids {d['pids']})"
    return f"{said}: nothing of attempt {d['attempt']} was left there"


def _tree_replanned(e: Event, d: Mapping[str, Any]) -> str:
    lost = ", ".join(d["lost"])
    gateways = d["tree"].get("gateways") or {}
    now = (f"gateways now {', '.join(gateways)}" if gateways
           else "every host connected directly")
    return (f"{L}attempt {d['attempt']}: the tree is planned again without the lost "
            f"gateway(s) {lost} (connected directly, if they answer); {now}")


def _restarting(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}attempt {d['attempt'] - 1} failed ({attempt_cause(d['cause'])}); restarting "
            f"every rank (restart {d['attempt']} of {d['max_restarts']})"
            + (f" {_membership(d)}" if "hosts" in d else ""))


def _membership(d: Mapping[str, Any]) -> str:
    """An attempt's hosts: how many of the roster, which, the world size, and what changed."""
    hosts = d["hosts"]
    text = (f"on {len(hosts)} of {d['roster']} hosts ({', '.join(hosts)}), world size "
            f"{d['world_size']}")
    if d.get("readmitted"):
        text += f"; re-admitted: {', '.join(d['readmitted'])}"
    if d.get("spares"):
        text += f"; spares in: {', '.join(d['spares'])}"
    if d.get("left_out"):
        text += f"; left out: {_left_out(d['left_out'])}"
    return text


def _left_out(left_out: Mapping[str, str]) -> str:
    return ", ".join(f"{h} {why}" for h, why in left_out.items())


def attempt_cause(cause: Mapping[str, Any]) -> str:
    """What ended an attempt, in one line: the verdict's words and the root cause's
    exception (as the attempts table and a restart line give it)."""
    text = render(cause_event(cause)).removeprefix(L)
    error = one_line(str(cause["error"])) if cause.get("error") else None
    return f"{text}: {error}" if error and error not in text else text


def _sweep_unreachable(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}host {e.host!r} {unreachable(d['reason'])}: left its registry record of run "
            f"{d['run_id']}; `fdl-fabric cleanup --run-id {d['run_id']}` with the same hosts "
            "removes it (and anything left) once the host is back")


def _output_dropped(e: Event, d: Mapping[str, Any]) -> str:
    hint = "--log-dir kept every line" if d["log_kept"] else "use --log-dir to keep every line"
    return f"{L}{d['dropped']:,} line(s) of rank output were not shown on the console ({hint})"


def _hinted(d: Mapping[str, Any]) -> str:
    return f" ({d['hint']})" if d.get("hint") else ""


def _console_stalled(e: Event, d: Mapping[str, Any]) -> str:
    return f"{L}… {d['dropped']:,} lines of rank output not shown: the console stalled{_hinted(d)}"


def _stdout_closed(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}stdout is closed ({d['error']}): rank output is no longer shown; the run goes "
            f"on{_hinted(d)}")


# -- hosts ------------------------------------------------------------------------------------
def _host_unresponsive(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}host {e.host!r} unresponsive: no word from its agent for {d['silent']:.1f}s "
            f"(agent_timeout {_s(d['agent_timeout'])}: a frozen agent or sshd, or a cut link)")


def _outside_signal(e: Event, d: Mapping[str, Any]) -> str:
    how = "forwarded to its ranks" if d["forwarded"] else \
        "which Slurm delivered to its ranks too"
    return f"{L}host {e.host!r}: SIG{d['signal']} from outside, {how}"


def _agent_signaled(e: Event, d: Mapping[str, Any]) -> str:
    who = stopper_words(d["by"], str(e.host)) if d.get("by") else \
        "from outside (scancel, a time limit, kill)"
    return f"{L}host {e.host!r}: its agent received SIG{d['signal']} {who} — stopping every rank"


def stopper_words(note: Mapping[str, Any], host: str) -> str:
    """Who stopped a live run, from the note a cleanup left for its agent."""
    what = str(note.get("command") or "a cleanup")
    where = note.get("host")
    pid = note.get("pid")
    by = f" (pid {pid} on {where})" if pid and where else ""
    return f"{what}{by} on {host}"


def _foreign_frames(e: Event, d: Mapping[str, Any]) -> str:
    """A host that sent frames for ranks it does not run: how many were dropped, of what
    kinds, for which ranks (said once, when its agent ended)."""
    kinds = ", ".join(f"{kind} {n:,}" for kind, n in sorted(d["frames"].items()))
    ranks = ", ".join(str(r) for r in d["ranks"])
    more = " and more" if d.get("more_ranks") else ""
    return (f"{L}host {e.host!r} sent frames for ranks it does not run: {d['dropped']:,} "
            f"dropped ({kinds}; ranks {ranks}{more})")


def _pids(items: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{p.get('pid')} ({str(p.get('cmdline', ''))[:60]})" for p in items)


# -- ranks ------------------------------------------------------------------------------------
def _rank_exited(e: Event, d: Mapping[str, Any]) -> str:
    text = f"{L}{label(e)} exited with {exit_words(d['exit'])}"
    if d.get("stopped_by") == STOPPED_BY_LEASE:
        return f"{text} (stopped by its agent's lease)"
    return f"{text} (stopped by the launcher)" if d.get("stopped") else text


# -- the coordinator --------------------------------------------------------------------------
def _declared_dead(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{C}rank {e.rank} declared dead ({reason_words(d['reason'])}); {d['alive']} of "
            f"{d['world_size']} alive")


def reason_words(reason: Mapping[str, Any]) -> str:
    """Why the coordinator counts a rank dead: the supervisor's word, or silence."""
    if reason.get("silent") is not None:
        return (f"no frame for {reason['silent']:.1f}s, heartbeat timeout "
                f"{_s(reason['heartbeat_timeout'])}")
    return exit_words(reason.get("exit") or {})


def _peers_refused(e: Event, d: Mapping[str, Any]) -> str:
    reasons = ", ".join(f"{why}: {n}" for why, n in sorted(d["reasons"].items()))
    return (f"{C}refused {d['refused']} more connection(s) in {d['seconds']:.0f}s ({reasons}; "
            f"last from {d['last_peer']})")


def _connection_lost(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{C}lost the connection to {label(e)} without an exiting message ({d['detail']}); "
            "left to the supervisor and the heartbeat timeout")


# -- stopping ---------------------------------------------------------------------------------
def _stopping_on_signal(e: Event, d: Mapping[str, Any]) -> str:
    how = f"INT, TERM after {d['int_grace']:g}s, " if d["signal"] == "SIGINT" else "TERM, "
    by = d.get("by")
    if by:  # `fdl-fabric stop`: nobody here to press Ctrl-C
        return (f"{L}{by.get('command')} ({by.get('user')}@{by.get('host')}, pid "
                f"{by.get('pid')}) — stopping {d['live']} running rank(s) ({how}KILL after "
                f"{_s(d['kill_grace'])})")
    return (f"{L}{d['signal']} received — stopping {d['live']} running rank(s) ({how}KILL after "
            f"{_s(d['kill_grace'])}); press Ctrl-C again to kill now")


def _hung(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}run hung — no rank wrote a line or reported progress for {d['silent']:.0f}s "
            f"(hang_timeout {_s(d['hang_timeout'])})")


def _hung_announce(e: Event, d: Mapping[str, Any]) -> str:
    return f"{_hung(e, d)}; collecting every rank's stack"


def _stacks(e: Event, d: Mapping[str, Any]) -> str:
    return stacks_text(dict(d))


# -- verdicts ---------------------------------------------------------------------------------
def _max_failure_exceeded(e: Event, d: Mapping[str, Any]) -> str:
    return (f"{L}max_failure exceeded ({d['dead']}/{d['world_size']} ranks dead, threshold "
            f"{d['limit']}); coordinator dispatched save-and-shutdown — consensus checkpoint "
            "saved if a save path was armed")


def _interrupted(e: Event, d: Mapping[str, Any]) -> str:
    where = f" on {e.host}" if e.host else ""
    return f"{L}interrupted by {d['signal']}{where} — every rank was stopped"


#: The verdicts of a failed run: their line says ``failed:`` after the speaker.
FAILED_VERDICTS = ("failed", "hung")


def _verdict(e: Event, d: Mapping[str, Any]) -> str:
    """The last line: what ended the run, said by the launcher, with ``failed:`` in front
    of a failure's cause (as ``run completed`` says a success), so a grep for
    ``cluster launcher: failed:`` finds every failed run."""
    text = render(cause_event(d["cause"]))
    if d.get("verdict") not in FAILED_VERDICTS:
        return text
    return f"{L}failed: {text.removeprefix(L)}"


# -- the end of a launch ----------------------------------------------------------------------
def _summary(e: Event, d: Mapping[str, Any], width: Optional[int] = None) -> str:
    """The end-of-run table: rank, host, exit, cause, duration; plain aligned text."""
    rows = [(str(r["rank"]), r["host"], exit_cell(r.get("exit")), cause_cell(r),
             f"{r['duration']:.1f}s") for r in d["ranks"]]
    return table(("rank", "host", "exit", "cause", "duration"), rows, width)


def _attempts(e: Event, d: Mapping[str, Any], width: Optional[int] = None) -> str:
    """One row per attempt: what ended it."""
    rows = [(str(i), _hosts_cell(a.get("hosts") or ()), a["verdict"],
             attempt_cause(a["cause"])) for i, a in enumerate(d["attempts"])]
    return table(("attempt", "hosts", "verdict", "cause"), rows, width)


def _hosts_cell(hosts: Sequence[str]) -> str:
    """An attempt's hosts in a table cell: their names while they fit, else how many."""
    names = ",".join(hosts)
    return names if len(names) <= 30 else f"{len(hosts)} hosts" if hosts else "-"


def _root_cause(e: Event, d: Mapping[str, Any]) -> str:
    """The first failed rank, with what its error file says (as torchrun's summary), or
    else its last stderr lines and where its whole log is (`supervision.rootcause`); the
    ``@record`` hint only where it would have helped (``record_hint``)."""
    who = f"root cause: {label(e)} ({d['label']})"
    exit_ = d["exit"]
    if d.get("host_fault") is not None:
        head = f"{who} has no exit status: {exit_.get('lost')}"
    elif d.get("error") is not None:
        return "\n".join([f"{who} exited with {exit_words(exit_)}: {d['error']}",
                          *("  " + line for line in d.get("tail", [])), *_log_line(d)])
    else:
        head = f"{who} exited with {exit_words(exit_)}"
        if d.get("record_hint"):
            head += (" (no error file: decorate the entry point with torch's @record to see "
                     "the exception here)")
    quoted = d.get("stderr_tail") or []
    where = f"all of it in {d['log']}" if d.get("log") else \
        "add --log-dir to keep every rank's output"
    if not quoted:
        return head + (f"\n  it wrote nothing on stderr ({where})" if "log" in d else "")
    return "\n".join([head, f"  its last {len(quoted)} stderr line(s) ({where}):",
                      *(f"  | {line}" for line in quoted)])


def _log_folder(e: Event, d: Mapping[str, Any]) -> str:
    latest = f"; {d['latest']} points at it" if d.get("latest") else \
        f"; no latest link: {d['latest_error']}" if d.get("latest_error") else ""
    return f"{L}run {d['run_id']}: every rank's output is kept in {d['folder']}{latest}"


def _logs_kept(e: Event, d: Mapping[str, Any]) -> str:
    also = f" (also {d['latest']})" if d.get("latest") else ""
    # The write error itself was said once, when it happened.
    cut = "; incomplete: writing them failed (above)" if d.get("failed") else ""
    return f"{L}logs of run {d['run_id']}: {d['folder']}{also}{cut}"


def _log_line(d: Mapping[str, Any]) -> list[str]:
    return [f"  its stderr: {d['log']}"] if d.get("log") else []


Words = Callable[[Event, Mapping[str, Any]], str]

#: The words that lay themselves out for a terminal's width (the others are `fit`).
_FITTED: dict[Name, Callable[[Event, Mapping[str, Any], int], str]] = {
    Name.SUMMARY: _summary,
    Name.ATTEMPTS: _attempts,
}

_WORDS: dict[Name, Words] = {
    # the launch
    Name.OMP_DEFAULTED: lambda e, d: (
        f"{L}setting OMP_NUM_THREADS=1 for each rank of a host that runs more than one, where "
        "it is not set already, to avoid overloading the system; tune it for your program "
        "(env: OMP_NUM_THREADS: \"N\")"),
    Name.BATCHMODE_OFF: lambda e, d: (
        f"fdl-fabric: host {e.host!r} ssh.options set `{d['option']}` — the ssh dispatch is "
        "non-interactive and will hang on any prompt (passphrase, host-key). Proceeding as "
        "requested."),
    Name.KEEPALIVE_LOST: lambda e, d: (f"{L}host {e.host!r} stopped answering keepalives for "
                                       f"{d['silent']:.0f}s; treating its connection as lost"),
    Name.LOG_FOLDER: _log_folder,
    Name.LOG_FAILED: lambda e, d: (f"{L}--log-dir: {d['error']}; rank logs stop here "
                                   f"({d['folder']})"),
    Name.FAILURE_DETAIL: lambda e, d: str(d["text"]),
    Name.RESTARTING: _restarting,
    Name.ATTEMPT_HOSTS: lambda e, d: f"{L}attempt {d['attempt']}: {_membership(d)}",
    Name.TREE_REPLANNED: _tree_replanned,
    Name.HOSTS_LEFT_OUT: lambda e, d: (
        f"{L}left out of the first attempt: {_left_out(d['left_out'])}"
        + (f"; spares in: {', '.join(d['spares'])}" if d["spares"] else "")),
    Name.SWEEP_UNREACHABLE: _sweep_unreachable,
    Name.SWEEP_INCOMPLETE: lambda e, d: (f"{L}host {e.host!r}: could not clear what run "
                                         f"{d['run_id']} left: {d['problem']}"),
    Name.SWEEP_STOPPED: lambda e, d: (f"{L}host {e.host!r}: stopped what run {d['run_id']} "
                                      f"left there (pids {d['pids']})"),
    Name.HOST_ANSWERED_AGAIN: _answered_again,
    Name.OUTPUT_DROPPED: _output_dropped,
    Name.CONSOLE_STALLED: _console_stalled,
    Name.STDOUT_CLOSED: _stdout_closed,
    Name.MAX_FAILURE_UNUSED: lambda e, d: (
        f"{L}max_failure had no effect: no rank joined the cohort, so every failure was fatal "
        "(ranks join with fdl_fabric.rank.join())"),
    Name.LIBRARY_LOG: lambda e, d: f"ssh: {d['logger']}: {d['text']}",
    Name.THREAD_CRASHED: lambda e, d: f"{L}thread {d['thread']}: {d['error_type']}: {d['error']}",
    Name.TRACEBACK: lambda e, d: str(d["traceback"]),
    # hosts and their agents
    Name.AGENT_WARNING: lambda e, d: f"{L}host {e.host!r}: {d['text']}",
    Name.PREFLIGHT_WARNING: lambda e, d: (f"{L}pre-flight: {e.host}: {d['check']}: "
                                          f"{d['reason']}"),
    Name.PREFLIGHT_FAILED_CHECK: lambda e, d: (f"{L}pre-flight: {e.host}: {d['check']}: FAIL: "
                                               f"{d['reason']}"),
    Name.PREFLIGHT_PASSED: lambda e, d: f"{L}pre-flight passed on {d['hosts']} host(s)",
    Name.LEFTOVER_ERROR: lambda e, d: f"{L}{e.host}: {d['error']}",
    Name.LEFTOVERS_STOPPED: lambda e, d: (f"{L}stopped leftovers of an earlier run of this "
                                          f"cluster on {e.host}: run {d['run']} "
                                          f"(pids {d['pids']})"),
    Name.LEFTOVER_KEPT: lambda e, d: f"{L}could not stop a leftover on {e.host}: {d['item']}",
    Name.LIVE_RUN_LEFT: lambda e, d: (f"{L}run {d['live_run']} of this cluster is live on "
                                      f"{e.host} ({d['launcher']}): left alone"),
    Name.AFTER_RUN_STOPPED: lambda e, d: (f"{L}{e.host}: stopped what the run left behind "
                                          f"after its last rank: {_pids(d['stopped'])}"),
    Name.AFTER_RUN_REMAINS: lambda e, d: (
        f"{L}{e.host}: could NOT stop what the run left behind: pids "
        f"{', '.join(str(p.get('pid')) for p in d['remaining'])} (see `fdl-fabric "
        "cleanup`)"),
    Name.HOST_LOST: lambda e, d: f"{L}host {e.host!r}: {d['reason']}",
    Name.HOST_UNRESPONSIVE: _host_unresponsive,
    Name.HOST_ABANDONED: lambda e, d: (f"{L}host {e.host!r} did not report its ranks' exits "
                                       "after the kill grace; abandoning its agent"),
    Name.OUTSIDE_SIGNAL: _outside_signal,
    Name.AGENT_SIGNALED: _agent_signaled,
    Name.FOREIGN_FRAMES: _foreign_frames,
    # ranks
    Name.RANK_STARTED: lambda e, d: f"{L}started {d['label']} (pid {d['pid']})",
    Name.RANK_OUTPUT: lambda e, d: str(d["text"]),
    Name.RANK_START_FAILED: lambda e, d: (f"{L}host {e.host!r}: could not start rank {e.rank}: "
                                          f"{d['reason']}"),
    Name.RANK_EXITED: _rank_exited,
    Name.RANK_FAILED: lambda e, d: f"{L}{label(e)} exited with {exit_words(d['exit'])}",
    Name.RANK_TOLERATED: lambda e, d: (f"{L}{label(e)} exited with {exit_words(d['exit'])} — "
                                       f"tolerating (elastic membership): reporting rank(s) "
                                       f"[{e.rank}] dead"),
    Name.RANK_DEAD_STOPPED: lambda e, d: (f"{L}{label(e)}, declared dead by the coordinator "
                                          f"({reason_words(d['declared_dead'])}), was stopped "
                                          f"({exit_words(d['exit'])})"),
    Name.RANK_FORWARD_STOPPED: lambda e, d: (f"{L}{label(e)} was stopped by {d['forwarded']}, "
                                             "which the launcher forwarded (the program has no "
                                             "handler for it)"),
    # the coordinator
    Name.RANK_JOINED: lambda e, d: f"{C}rank {e.rank} of {e.host} joined",
    Name.COHORT_FORMED: lambda e, d: f"{C}cohort formed — {d['world_size']} ranks",
    Name.RANK_DECLARED_DEAD: _declared_dead,
    Name.RANK_EXITING: lambda e, d: f"{C}rank {e.rank} of {e.host} announced a clean exit",
    Name.RANK_DISCONNECTED: lambda e, d: f"{C}rank {e.rank} of {e.host} disconnected",
    Name.RANK_CONNECTION_LOST: _connection_lost,
    Name.SHUTDOWN_BROADCAST: lambda e, d: (f"{C}{render(cause_event(d['cause']))} — "
                                           "broadcasting save-and-shutdown"),
    Name.PROBE_RECEIVED: lambda e, d: f"{C}pre-flight probe from {d['from']!r} ({d['peer']})",
    Name.PEER_CLOSED: lambda e, d: f"{C}{d['peer']} closed before hello ({d['detail']})",
    Name.PEER_DROPPED: lambda e, d: f"{C}dropped connection from {d['peer']}: {d['reason']}",
    Name.PEER_REJECTED: lambda e, d: f"{C}rejected hello from {d['peer']}: {d['reason']}",
    Name.PEERS_REFUSED: _peers_refused,
    Name.ACCEPT_FAILED: lambda e, d: f"{C}accept failed: {d['error']}",
    Name.COORDINATOR_FAILED: lambda e, d: f"{L}coordinator failed: {d['error']}",
    # stopping, hangs, signals
    Name.STOPPING_ON_SIGNAL: _stopping_on_signal,
    Name.KILLING_NOW: lambda e, d: (f"{L}{'second interrupt' if not d.get('asked') else d['asked']}"
                                    " — killing every rank's process group now"),
    Name.STOPPING_ON_FAILURE: lambda e, d: (f"{L}{'hung run' if d['hung'] else 'peer failure'} "
                                            "— terminating all still-running ranks"),
    Name.STOPPING_AFTER_SHUTDOWN: lambda e, d: (f"{L}{d['live']} rank(s) did not exit within "
                                                f"{_s(d['grace'])} of save-and-shutdown; "
                                                "stopping them"),
    Name.FAILURE_ANNOUNCED: lambda e, d: render(cause_event(d["cause"])),
    Name.HANG_DETECTED: _hung_announce,
    Name.HUNG: _hung,
    Name.STACKS_ASKED: lambda e, d: (f"{L}SIGQUIT — collecting every rank's stack (the run goes "
                                     "on)"),
    Name.STACKS: _stacks,
    Name.SUSPENDED: lambda e, d: (f"{L}suspended (Ctrl-Z); the ranks keep running — `fg` "
                                  "resumes supervision"),
    # why a run ended
    Name.COMPLETED: lambda e, d: f"{L}run completed — all {d['world_size']} ranks exited 0",
    Name.COMPLETED_TEARDOWN: lambda e, d: (
        f"{L}run completed; {d['tolerated']} child exit(s) in the teardown window were "
        "tolerated (never registered as rank deaths) — full workload delivered, nothing "
        "redistributed"),
    Name.DEGRADED: lambda e, d: (f"{L}run completed DEGRADED — {d['dead']} of {d['world_size']} "
                                 "ranks lost along the way (tolerated by elastic membership); "
                                 "survivors carried the full workload"),
    Name.COMPLETED_ON_FEWER_HOSTS: lambda e, d: (
        f"{L}run completed on {d['hosts']} of {d['roster']} hosts"
        + (f" ({_left_out(d['left_out'])})" if d["left_out"] else "")
        + f" — DEGRADED: {d['world_size']} ranks in the last attempt"),
    Name.NOT_ENOUGH_HOSTS: lambda e, d: (
        f"{L}not enough hosts: {len(d['hosts'])} of min {d['min_hosts']}"
        + (f" ({_left_out(d['left_out'])})" if d["left_out"] else "")),
    Name.EVERY_RANK_LOST: lambda e, d: (f"{L}every rank was lost; consensus checkpoint saved if "
                                        "a save path was armed"),
    Name.MAX_FAILURE_EXCEEDED: _max_failure_exceeded,
    Name.MAX_FAILURE_REACHED: lambda e, d: SHUTDOWN_REASONS[e.name](d),
    Name.ALL_RANKS_DEAD: lambda e, d: SHUTDOWN_REASONS[e.name](d),
    Name.PREFLIGHT_FAILED: lambda e, d: (
        f"{L}pre-flight failed on {d['failures']} check(s), nothing was started "
        "(`fdl-fabric prebuild-check` with the same hosts checks more; --no-preflight "
        "skips this)"),
    Name.HOST_ENDED_EARLY: lambda e, d: (f"{L}host {e.host!r}: {d['reason']} before its ranks "
                                         "started"),
    Name.LAUNCHER_SUSPENDED: lambda e, d: (
        f"{L}the launcher was suspended for {d['suspended']:g} s, longer than the agents' "
        f"lease ({d['lease']:g} s): every host stopped its ranks"),
    Name.AGENT_KILLED: _agent_killed,
    Name.COHORT_NOT_FORMED: lambda e, d: (f"{L}cohort did not form within "
                                          f"{_s(d['formation_timeout'])}: rank(s) "
                                          f"{d['missing']} never joined"),
    Name.INTERRUPTED: _interrupted,
    Name.STOPPED_BY_CLEANUP: lambda e, d: (f"{L}stopped by {stopper_words(d['by'], str(e.host))} "
                                           "— every rank was stopped"),
    Name.STOPPED_BY_COMMAND: lambda e, d: (f"{L}stopped by {d['by'].get('command')} "
                                           f"({d['by'].get('user')}@{d['by'].get('host')}, "
                                           f"pid {d['by'].get('pid')}) — every rank was "
                                           "stopped"),
    Name.INTERRUPTED_BY_FORWARD: lambda e, d: (
        f"{L}interrupted by {d['signal']}, which the launcher forwarded: {label(e)} has no "
        "handler for it — every rank was stopped"),
    Name.INTERRUPTED_OUTSIDE_RUN: lambda e, d: (
        f"{L}interrupted by {d['signal']} "
        f"{'between attempts' if d['between_attempts'] else 'before any rank started'} — "
        "nothing is left running"),
    Name.LAUNCH_FAILED: lambda e, d: str(d["error"]),
    # the end of a launch
    Name.SUMMARY: _summary,
    Name.ATTEMPTS: _attempts,
    Name.ROOT_CAUSE: _root_cause,
    Name.LOGS_KEPT: _logs_kept,
    Name.VERDICT: _verdict,
    Name.DRY_RUN: lambda e, d: dry_run_text(d),
    **SETUP_WORDS,
    **JOIN_WORDS,
    **COMMAND_WORDS,
    **RUN_WORDS,
    **CODE_WORDS,
}
