"""The supervisor's clocks and bounds: how long it waits for what, in one place.

Every wait of the supervision loop is bounded by one of these. The modules of the
supervisor read them here when they act (``timing.FORCE_MARGIN``), not at import, so a
test can shorten one for a run.
"""

from __future__ import annotations

import time
from typing import Optional

from ..agent import wire

#: Longest the loop sleeps with nothing in its inbox while things happen; bounds the
#: elastic checks' delay.
TICK = 0.05
#: Once nothing came for a few turns, each sleep doubles, up to this many ticks: a
#: time-driven check (a silent agent, a ping, an escalation) is then late by at most
#: 0.25 s, and an idle launcher wakes 4 times a second instead of 20 (a wake-up costs
#: this machine about 0.1 ms of CPU: issue 35's idle). A report still wakes it at once.
QUIET_TICKS = 5


def next_wait(wait: float, tick: float, busy: bool) -> float:
    """The next wait of a loop that ticks every ``tick`` s while ``busy`` and, once quiet,
    doubles each wait up to `QUIET_TICKS` ticks (the supervisor's and the coordinator's)."""
    return tick if busy else min(wait * 2, tick * QUIET_TICKS)
#: The least seconds between two walks over every host for a silent agent (a twentieth
#: of ``agent_timeout`` when that is less: 0.3 s at its 6 s minimum).
HOST_CHECK_EVERY = 0.5
#: The longest gap between two such walks, as a share of ``agent_timeout`` (they are
#: due when the least recently heard agent could first be silent that long).
HOST_SILENCE_WALK = 0.25
#: Extra seconds past the kill grace before hosts that did not report are sent KILL.
FORCE_MARGIN = 3.0
#: Extra seconds past that before a host that still reports nothing is abandoned.
ABANDON_MARGIN = 3.0
#: Seconds an agent has to end its session after saying it is done.
GONE_MARGIN = 5.0
#: Seconds survivors get to save and exit after a save-and-shutdown broadcast,
#: before the launcher stops them (a checkpoint can take a while to write).
SHUTDOWN_GRACE = 120.0
#: Seconds every agent has to answer a request for stacks (its collector bounds py-spy
#: at 10 s per process, and they run in parallel).
STACKS_TIMEOUT = 15.0
#: A gap this long between two turns of the loop means this process was stopped
#: (Ctrl-Z, SIGSTOP): every silence clock starts again, nobody is blamed for it.
PAUSE_GAP = 2.0


def boottime() -> float:
    """Seconds on the clock that counts a suspended machine too (CLOCK_BOOTTIME, where
    there is one): a laptop lid closed for a minute is a minute of the agents' lease,
    though CLOCK_MONOTONIC stands still through it."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def ping_interval(agent_timeout: Optional[float], lease: Optional[float]) -> float:
    """Seconds between two pings of every agent: a third of the shorter of ``agent_timeout``
    (an agent answers a ping with a heartbeat when it had nothing else to say) and the
    agents' ``lease`` (they stop their ranks without a ping for that long), and never
    less than `wire.PING_INTERVAL`. At the defaults (10 s, 30 s) that is 3.3 s rather
    than 2 s: at 1,024 hosts each ping round is 1,024 frames down and as many up."""
    bounds = [t for t in (agent_timeout, lease) if t is not None]
    return max(wire.PING_INTERVAL, min(bounds) / 3) if bounds else wire.PING_INTERVAL


def lease_ping_interval(lease: Optional[float], ping_every: float) -> float:
    """Seconds between two pings of an agent whose ranks' beats flow: a third of the
    lease (the beats already keep it heard within ``agent_timeout``, so the ping only
    renews the lease, with two thirds of it to spare), never less than ``ping_every``.
    At the defaults (30 s) that is 10 s rather than 3.3 s: at 1,024 hosts, two thirds of
    the pings fewer (issue 35's idle)."""
    return max(ping_every, lease / 3) if lease is not None else ping_every
