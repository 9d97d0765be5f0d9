"""Words from a host are data, never terminal control: which fields of each event a host
sent, and the one function that makes an event's strings inert before it is worded.

A host (its agent, its sshd, a rank's error file, a peer of the coordinator) can put
anything in the strings the launcher quotes: an OSC 52 clipboard write, a window title,
a cursor-up and an erase-line that would paint a fake verdict over the real one, or a
newline followed by ``cluster launcher: run completed``. `inert_data` is applied by the
one renderer (`words.render`) to every event, whoever renders it (the console, the
record's ``message``, the verdict line a Python caller gets), so no wording function
has to remember it:

* every string of the event becomes inert for a terminal (`inert.clean`: ``ESC`` reads
  ``^[``), keeping its newlines and tabs (a traceback, a report of several lines);
* the fields `FROM_HOSTS` names for its name, quoted by the words inside one line, keep
  no newline either (`inert.one_line`: ``^J``), nor does any string inside them (a
  list's, a mapping's).

A new event that quotes a host's words inside a line gets its row here.
"""

from __future__ import annotations

from ..events import Event, Name
from ..inert import clean


def inert_data(event: Event) -> Event:
    """``event`` with every string of its data inert for a terminal (`inert.clean`), and
    the fields `FROM_HOSTS` names for it each on one line (`inert.one_line`)."""
    fields = FROM_HOSTS.get(event.name, ())
    data = event.data
    if fields and any(k in data for k in fields):
        data = {k: clean(v, lines=True) if k in fields else v for k, v in data.items()}
    host, shown = clean(event.host), clean(data)
    if host is event.host and shown is event.data:
        return event  # nothing to make inert: the event as it is
    return Event(event.name, host=host, rank=event.rank, data=shown, time=event.time)


#: The data fields of each event whose text came from a host (its agent, its sshd, a
#: rank's error file, a coordinator's peer) and that its words quote inside one line:
#: shown with no newline (``^J``), every string inside them (a list's, a mapping's).
#: Every other string keeps its newlines (a traceback, a report of several lines) but
#: no other control (`inert_data`).
FROM_HOSTS: dict[Name, tuple[str, ...]] = {
    # an agent's words and its host's reports
    Name.AGENT_WARNING: ("text",),
    Name.RANK_START_FAILED: ("reason",),
    Name.HOST_LOST: ("reason",),
    Name.HOST_ENDED_EARLY: ("reason",),
    Name.PREFLIGHT_WARNING: ("reason",),
    Name.PREFLIGHT_FAILED_CHECK: ("reason",),
    Name.LEFTOVER_ERROR: ("error",),
    Name.LEFTOVERS_STOPPED: ("run", "pids"),
    Name.LEFTOVER_KEPT: ("item",),
    Name.LIVE_RUN_LEFT: ("live_run", "launcher"),
    Name.AFTER_RUN_STOPPED: ("stopped",),
    Name.AFTER_RUN_REMAINS: ("remaining",),
    Name.OUTSIDE_SIGNAL: ("signal",),
    Name.AGENT_SIGNALED: ("signal", "by"),
    Name.STOPPED_BY_CLEANUP: ("by",),
    Name.SWEEP_UNREACHABLE: ("reason",),
    Name.HOST_ANSWERED_AGAIN: ("problem",),
    Name.SWEEP_INCOMPLETE: ("problem",),
    Name.LIBRARY_LOG: ("text",),
    # how a rank ended: a lost host's reason, an exception's text and its lines
    Name.RANK_EXITED: ("exit",),
    Name.RANK_FAILED: ("exit",),
    Name.RANK_TOLERATED: ("exit",),
    Name.RANK_DEAD_STOPPED: ("exit", "declared_dead"),
    Name.RANK_FORWARD_STOPPED: ("exit",),
    Name.ROOT_CAUSE: ("exit", "error", "tail", "stderr_tail"),
    Name.STACKS: ("ranks", "problems"),
    # hosts left out of an attempt, and why
    Name.RESTARTING: ("left_out",),
    Name.ATTEMPT_HOSTS: ("left_out",),
    Name.HOSTS_LEFT_OUT: ("left_out",),
    Name.COMPLETED_ON_FEWER_HOSTS: ("left_out",),
    Name.NOT_ENOUGH_HOSTS: ("left_out",),
    # the coordinator's peers
    Name.PROBE_RECEIVED: ("from",),
    Name.PEER_CLOSED: ("detail",),
    Name.PEER_DROPPED: ("reason",),
    Name.PEER_REJECTED: ("reason",),
    Name.RANK_CONNECTION_LOST: ("detail",),
    # code, setup and versions
    Name.SETUP_OUTPUT: ("text",),
    Name.SETUP_FAILED: ("why", "tail"),
    Name.SETUP_DONE: ("made",),
    Name.CODE_SYNCED: ("dir",),
    Name.VERSIONS_AGREE: ("reason",),
    Name.FLEET_CHECK_PASSED: ("reason",),
    Name.TUNNEL_EXPOSED: ("addresses",),
    # the other commands
    Name.CLEANUP_HOST: ("error", "stopped", "live", "leftovers"),
    Name.STEPS_NOT_CANCELLED: ("error",),
    Name.STACKS_PROBLEM: ("problem",),
    Name.STACKS_VIEW: ("ranks", "problems"),
    Name.CHECK_REPORT: ("checks",),
    Name.STATUS_VIEW: ("runs", "problems"),
    Name.JOIN_WINDOW_VIEW: ("window", "error"),
}
