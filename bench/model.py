#!/usr/bin/env python3
"""Issue 23's discrete-event model: what launching H hosts x R ranks costs the controller,
flat (one paramiko session per host) against a gateway tree, at sizes the lab cannot reach.

Why a model: the lab has 2 cores and a few dozen sshd hosts on loopback, so 1,024 or
4,096 hosts cannot be launched here. The model replays one launch event by event, in the
order the code runs it (`fdl_fabric.transport.fanout`, `transport.gateway`, `agent.relay`,
`supervision`), with every CPU cost taken from a measurement (``--costs FILE``, written
by ``bench/fanout.py --write-costs``; without it the built-in `Costs` below, each with
where it was measured). ``--check FILE`` compares it with real launches.

**The controller** is ``--cores`` cores (2, as here) and one GIL. Every piece of work
(a connect, a packet read, a frame handled, a spec written) asks for CPU when its event
happens and is served first come, first served: its `Costs.gil_fraction` holds the GIL
(Python: paramiko, the session, the supervisor), the rest (system calls, OpenSSL) only a
core, so with 2 cores one piece's system time overlaps the next one's Python. Idle
polling (paramiko's transport threads) takes a share of the GIL that grows with every
connected host, which stretches all other work (processor sharing), and its CPU is
counted from the moment each host is connected.

**The network** is a round-trip time (RTT) per exchange; bandwidth is ignored (the
360 KB agent payload takes 0.3 ms at 10 Gb/s). Round trips counted per step:

- a paramiko connect and auth, 6 (`Costs.connect_round_trips`): TCP handshake, banner
  exchange, KEXINIT, ECDH init/reply, NEWKEYS + service request, the publickey auth
  request; plus the auth step's wait for a delayed ACK while Nagle is on (51-53 ms,
  ~10 ms with ``TCP_NODELAY`` set before the handshake; ``--cuts``);
- an agent session, 2 (`Costs.session_round_trips`): channel open, exec;
- the pre-flight's dial of the coordinator, 2: TCP handshake, ``probe``/``probe_ok``;
- a frame, half a round trip each way; through a gateway, half one more for the
  gateway-leaf hop (the leaf's agent dials the coordinator directly).

**The launch, in the code's order** (each step's barrier is the code's): the fixed cost
(interpreter, imports, plan, coordinator); ``connect_all`` with 32 workers
(`fanout.CONNECT_WORKERS`), in roster order (gateways first): each flat host or gateway
is a paramiko connect, and a gateway's worker then starts its relay (`GatewayHost.connect`
since 420d9cf: a second session, the payload, the relay's hello, under the gateway's
lock); each leaf's ``connect`` waits on that lock for the relay (`ensure_relay`), so the
relays start side by side with their gateways' connects (``--relay-start parallel``,
the default). ``--relay-start pool`` replays the code before 420d9cf: a relay started by
the first of its leaves the pool reached, the gateway's other leaves waiting in the pool,
so the relays started about two at a time. Then ``start_agents`` (32 workers): an agent
session per flat host and gateway, an ``OPEN`` and ``PAYLOAD`` frame per leaf; then a spec
per host; each host boots its agent, runs its pre-flight and reports; once every host
reported, ``START`` to each, ranks spawn and print ``up``. **All running** is when the
controller has handled the last ``up``.

**On a gateway** the relay spawns each leaf's ``ssh`` one after another
(`Costs.leaf_ssh_spawn_ms`), each ``ssh`` does its key exchange on one of the gateway's
cores (`Costs.leaf_ssh_cpu_ms`, curve25519; the default sntrup761 would cost 101-124 ms);
what leaves write goes up in one ``BATCH`` 50 ms after its oldest byte (`relay.Batcher`;
exits and failures go at once, but none is on the path to all running), or, for
``tree-unbatched``, every frame as its own packet. A gateway costs the controller what a
flat host costs plus one SSH packet per batch; a leaf costs its frames, its spec and its
share of the batches, never a connect or a thread.

**Per packet and per frame.** An SSH packet the controller receives costs 141 us (one
session over paramiko to a lab host, 2,000 packets of 60 bytes, process CPU less its
idle; 141-152 us in two runs, ``--measure ssh``, before the channel reader): paramiko's
transport thread reads, decrypts and queues it, a reading thread wakes and feeds the
session (invoke's, one per stream, before 420d9cf; now the one `transport.channels`
selector thread for every session, which the measurement's single reading thread is
closer to; not re-measured since). Cutting it into frames costs 3 us a frame
(`session._Stdout.feed`), a relay batch 11 us plus 0.4 us an entry (`relay.Reader` +
`parse_batch`; both ``--measure``); the supervisor's handling of each report and the
console's line for each ``up`` are estimated (30 us each), and so is the per-host
protocol work every host costs whatever its transport (its `AgentSession`, its spec, its
writes: 0.3 ms), chosen so that the tree's 1,024 x 8 costs about the issue's 2.3 s of
CPU. What the measured 21 ms per flat host leaves after all
these is the transport's own (Fabric's Connection and config, host keys, thread starts,
keepalives: `Costs.transport_extra_cpu_ms`, derived, 8.3 ms), paid by flat hosts and
gateways, never by leaves.

**The coordinator** (ranks that call ``rank.join()``; bench/launch.py's ranks do not, so
the table's time and CPU leave it out and it has columns of its own): each join costs an
accept, a keyed hello and a ``welcome``, then ``formed`` goes to every rank. Since 8e6963f
both carry the ``dead`` list (empty while nobody died), not the members: a welcome costs
6 us and a ``formed`` 5 us a rank plus its send, measured by ``--measure`` running
`Coordinator._send` and `_broadcast` in-process at 8,192 ranks, so formation is O(W):
0.7 s of coordinator CPU (under the GIL) at 8,192 ranks, 2.6 s at 32,768. Afterwards
each heartbeat (1 s a rank) costs ~10 us, and the silence walk over every rank
(`Coordinator._tick` with a scan due: 0.42 us a rank, measured the same way) runs every
min(0.5 s, heartbeat_timeout/20) (`SILENCE_SCAN_MAX`; 0.5 s at the default 30 s), not on
every 50 ms tick: 8.9 % of a core at 8,192 ranks, 8.2 of it the heartbeats' (a tick
without a walk: under 1 us). *Before* 8e6963f: the welcome and ``formed`` listed every
live rank (0.286 us and 0.056 us a rank listed), formation was O(W^2), 23.5 s at 8,192
ranks and 370 s at 32,768, and the 50 ms walk (0.45 us a rank) made the idle 15.6 % of a
core at 8,192 ranks (62 % at 32,768; now 35.7 %).

**Calibration, and where the model differs from the issue's table** (1,024 x 8, 1 ms):

- flat: 20.4 s to all running (issue 20.4) with `gil_fraction` 0.73, the one constant
  fitted to it, on the issue's 21 ms a host (old code, bench/launch.py, 8 ranks a host);
  26.2 s of CPU (issue 27.6); 32 % idle, as the issue. Threads: 1,029 (5 + 1 a host since
  the channel reader), not the issue's 3,075 (3 a host before it). bench/fanout.py's
  launches after 420d9cf measure 9.3-9.6 ms a host (1 rank a host, 8 and 32 hosts, a
  loaded machine), less than the model's own parts of a host (connect 7, session 3,
  protocol and frames ~1: 11.1 ms), so with ``--costs`` that file the transport's extra
  is 0 and the model still charges ~1.5 ms a host more than measured (it says so); flat
  at 1,024 x 8 is then 12.0 s and 15.5 s of CPU. The built-in 21 ms is kept: it is the
  figure the calibration was made on, and not re-measured at 8 ranks with the new code.
- tree: 2.3 s (issue 2.1 s), relays up by 1.2 s, CPU 2.5 s (issue 2.3). Before 420d9cf
  (``--relay-start pool``) it was 4.8 s: `fanout.connect_each` handed hosts to its 32
  workers in roster order and each leaf's ``connect`` started or waited for its gateway's
  relay, so the leaves of one gateway filled the pool and relays started about two at a
  time (relays up: 3.7 s).
- tree threads: 37 (5 + 1 a gateway; the relay's session is read by the channel reader),
  fewer than the issue's 99 (3 a gateway). Before 420d9cf the model gave 163 (5 a
  gateway: paramiko's, invoke's 2 readers of the agent's session, 2 of the relay's).
- tree idle: 2.6 % (2.0 % with the 1 s read timeout), not 1.6 % (0.7 %): the model adds
  the leaves' pings and heartbeats (7.5 us a second a leaf: 0.74 % at 992 leaves) and one
  batch a gateway per ping round, which the issue's figure seems to leave out.
- tree-unbatched: 4.2 s (6.7 s with the old relay start), not 17.4 s. At 141 us a packet
  (measured) the 19 packets of a leaf cost ~2.7 ms, 2.7 s in all; the issue's 17.4 s
  implies ~0.75 ms a forwarded frame, 5x this machine's measured cost of a packet read by
  a paramiko session. Batching still halves the CPU (2.5 vs 5.2 s) and cuts the packets
  in 35-fold (544 vs 19,232) and the idle from 9.3 % to 2.6 %.
- tree at 4,096 x 8 (64 gateways): 5.8 s, 7.2 s of CPU, 69 threads (16.5 s with the old
  relay start, when 64 relays started about two at a time).
- flat at 4,096 hosts: the 0.1 s polls alone want 125 % of a core of GIL; the model caps
  their share at 90 % and marks the time with '>' (a lower bound of a launch that crawls).
- against bench/fanout.py's launches (2026-12-04, 4-32 lab hosts, 1-4 ranks a host, a
  loaded machine; ``--costs`` and ``--check`` its files): CPU within -0.003..+0.06 s on 8
  of 9 launches, +0.11 s on the 4 x 2 flat launch with the cuts undone (0.27 s measured,
  under that file's own 0.34 s intercept). Times come out 0.3-3.3 s short: the lab's
  hosts share the controller's 2 cores (91 ms a host to all running, measured), the
  model's have their own. That file's idle slopes (0.042 % a host with the 0.1 s poll,
  0.024 % with the 1 s timeout: 1.8x, not the issue's 10x) make flat 1,024 x 8 idle
  44 % (25 % with the timeout) and the tree's 2.8 % (2.2 %).

Standard library only; ``python3 bench/model.py --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import json
import math
import sys
import textwrap
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

DESIGNS = ("flat", "tree", "tree-unbatched")
#: The issue's target: 1,024 hosts x 8 ranks, all running within 15 s at a 1 ms RTT.
TARGET = {"hosts": 1024, "ranks_per_host": 8, "rtt_ms": 1.0, "all_running_s": 15.0}
#: Seconds between two silence walks over every rank: `coordinator.SILENCE_SCAN_MAX`
#: (0.5 s) or a twentieth of the heartbeat timeout (30 s by default), whichever is less.
#: Before 8e6963f the walk ran on every tick (`TICK_INTERVAL`, 50 ms).
SILENCE_SCAN_S = min(0.5, 30.0 / 20)
#: The launcher pings every agent every 2 s (`wire.PING_INTERVAL`).
PING_INTERVAL_S = 2.0
#: The largest share of the GIL idle polling is given. Beyond it the launch crawls (every
#: other thread waits behind thousands of polls); the model's time is then a lower bound.
MAX_POLL_SHARE = 0.9


@dataclass
class Costs:
    """Every cost the model uses, flat keys with their unit in the name.

    Defaults: the issue 23 figures (measured on this machine's sshd lab, 1-64 hosts) or,
    where the issue gives none, what was measured for this model on 2026-12-04 on this
    machine with this checkout ("measured here"; ``--measure`` repeats the pure-Python
    ones, ``--measure ssh`` the SSH ones against one sshd lab host), or an estimate, said
    as such. ``--print-costs`` prints them as the JSON ``--costs`` reads.
    """

    # -- the controller, fixed ------------------------------------------------------------
    #: Launcher CPU with no host (interpreter, imports, parse, plan, coordinator): the
    #: intercept of launch CPU against hosts, issue 23 (~0.5 s).
    fixed_launch_cpu_s: float = 0.5
    #: main, fdl-coordinator, fdl-keepalive, the channel reader (`transport.channels`)
    #: and one more: the intercept of bench/fanout.py at 8 and 32 lab hosts, 2026-12-04
    #: (5.0). Before the channel reader (420d9cf): 3 (bench/README.md, idle.py, py-spy).
    fixed_threads: float = 5.0
    #: Idle CPU with no host, % of a core (supervisor and coordinator 50 ms waits): the
    #: intercept of 1.6 % at 32 hosts, 3.0 % at 64 and 4.6 % at 128 (issue 23, idle.py).
    fixed_idle_pct: float = 0.6
    #: Memory with no host: not measured for the model (bench/fanout.py's intercept).
    fixed_rss_mb: float = 0.0
    # -- the controller, per directly connected host (flat hosts and gateways) --------------
    #: Launch CPU per flat host, issue 23 (slope over 1-64 lab hosts, 0.1 s poll, Nagle).
    per_host_launch_cpu_ms: float = 21.0
    #: Ranks per host of the launches that slope came from (bench/launch.py: 8).
    per_host_launch_ranks: float = 8.0
    #: paramiko connect + auth, issue 23 (5-9 ms; 2.6-3.5 ms of bare SSHClient.connect
    #: measured here, Fabric's Connection and host keys on top).
    connect_cpu_ms: float = 7.0
    #: Agent session: open_session + exec 0.5 ms, the 360 KB payload 2.3 ms (measured here).
    session_start_cpu_ms: float = 3.0
    #: Threads per host: paramiko's transport thread only; every SSH session is read by
    #: the one channel reader (bench/fanout.py's slope: 1.0). Before 420d9cf: 3 (invoke's
    #: stdout and stderr readers besides, idle.py).
    threads_per_host: float = 1.0
    #: Memory per host, issue 23.
    rss_mb_per_host: float = 0.43
    #: Idle CPU per host with paramiko's 0.1 s poll, % of a core: slope of issue 23's
    #: 3.0 % at 64 and 4.6 % at 128 hosts, and of its table's 32 % at 1,024 (0.07-0.11 %
    #: a host at 8 hosts; 0.083 % for one transport alone, measured here).
    idle_pct_per_host: float = 0.0305
    #: The same with a 1 s read timeout on each transport, issue 23 (0.011-0.014 %).
    idle_pct_per_host_read_timeout_1s: float = 0.0125
    #: Share of the controller's CPU that holds the GIL; calibrated (flat 1,024 x 8 at
    #: 1 ms: the issue's 20.4 s to all running).
    gil_fraction: float = 0.73
    #: Hosts connected, or agents started, at once (`fanout.CONNECT_WORKERS`).
    connect_workers: float = 32.0
    # -- the network ------------------------------------------------------------------------
    #: Round trips of a paramiko connect and auth (see the module's docstring).
    connect_round_trips: float = 6.0
    #: Round trips of an agent session: channel open, exec.
    session_round_trips: float = 2.0
    #: Round trips of the pre-flight's dial: TCP, probe/probe_ok.
    preflight_round_trips: float = 2.0
    #: The auth step's wait with Nagle on (TCP_NODELAY only after the handshake), issue 23.
    auth_nagle_wait_ms: float = 52.0
    #: The same with TCP_NODELAY set before the handshake, issue 23 (~10 ms).
    auth_nodelay_wait_ms: float = 10.0
    # -- frames -------------------------------------------------------------------------------
    #: One SSH packet received by the controller: 141 and 152 us in two runs (measured
    #: here, ``--measure ssh``: the process's CPU per packet read, less its idle).
    packet_cpu_us: float = 141.0
    #: One agent frame: 3.4 us to cut and decode (measured here) + the supervisor's
    #: handling of its report (estimated).
    frame_cpu_us: float = 30.0
    #: The console and log line of one rank output frame (estimated).
    output_line_cpu_us: float = 30.0
    #: One small write to an agent or relay (a paramiko packet sent: 8 us measured here).
    send_cpu_us: float = 10.0
    #: One relay BATCH frame cut and parsed, fixed part (11.4 us for 31 entries, measured).
    batch_cpu_us: float = 11.0
    #: One entry of a BATCH (0.37 us, measured here).
    batch_entry_cpu_us: float = 0.4
    #: Per host, whatever its transport: its AgentSession, its spec, START (estimated,
    #: so that the tree's 1,024 x 8 costs ~2.3 s as in the issue's table).
    host_protocol_cpu_ms: float = 0.3
    #: Per leaf: its OPEN and PAYLOAD frames (two sends and a RelayedAgent).
    leaf_start_cpu_us: float = 40.0
    # -- the hosts -----------------------------------------------------------------------------
    #: sshd session + login shell + the agent's start to its hello: 124 ms of ~/.bashrc
    #: (pyenv) and 37 ms of agent on this machine (bench/README.md, launch.py).
    agent_start_ms: float = 170.0
    #: The pre-flight's checks on a host, besides its dial (estimated).
    preflight_ms: float = 20.0
    #: A rank's interpreter start to its ``up`` line (34 ms, one rank alone, launch.py).
    rank_start_ms: float = 50.0
    #: The agent's fork and exec of one rank.
    rank_spawn_ms: float = 2.0
    # -- a gateway -------------------------------------------------------------------------------
    #: A leaf's ssh key exchange on the gateway, curve25519 (issue 23: ~15 ms; the
    #: default sntrup761 costs 101-124 ms).
    leaf_ssh_cpu_ms: float = 15.0
    #: The relay's fork and exec of one leaf's ssh (serial in the relay; estimated).
    leaf_ssh_spawn_ms: float = 3.0
    #: Cores of a gateway host for its leaves' ssh clients (assumed).
    gateway_cores: float = 8.0
    #: `relay.BATCH_INTERVAL`.
    batch_interval_ms: float = 50.0
    #: Threads of the relay's session (`gateway.Relay`): none, the channel reader reads it.
    #: Before 420d9cf: 2 (invoke's stdout and stderr readers).
    threads_per_relay: float = 0.0
    #: A leaf idle: its ping written every 2 s (10 us) and its heartbeat read (5 us),
    #: per second (estimated from the sends and frames measured here).
    leaf_idle_cpu_us_per_s: float = 7.5
    # -- the coordinator (ranks that join) ---------------------------------------------------------
    #: Accept, peek, keyed hello, RANK_JOINED event, reply (accept ~20 us: issue 22's
    #: flood figures; the rest estimated). Also an agent's pre-flight probe.
    join_cpu_us: float = 60.0
    #: One ``welcome``, built and encoded by `Coordinator._send` (its ``dead`` list, empty
    #: while nobody died: O(deaths); 5.5-5.9 us at 8,192 ranks in 3 runs, ``--measure``;
    #: the send's system call is in `join_cpu_us`). Before 8e6963f it listed every live
    #: rank: 0.286 us a rank of the world (2.34 ms a welcome at 8,192).
    welcome_cpu_us: float = 6.0
    #: ``formed`` to one rank, by `Coordinator._broadcast` (4.7-4.8 us a rank, ``--measure``;
    #: its send is `send_cpu_us`). Before 8e6963f: 0.056 us a rank listed, to each rank
    #: (0.46 ms a rank at 8,192).
    formed_cpu_us: float = 5.0
    #: One heartbeat: recv, tag, JSON, bookkeeping (5.6 us bare, measured here).
    heartbeat_cpu_us: float = 10.0
    #: The silence walk, per rank (`Coordinator._tick` when a scan is due: sorted(), the
    #: exited set, `DeadRanks.is_dead`'s lock; ``--measure`` at 8,192 ranks: 0.42 us in
    #: 3 runs, 0.39-0.54 us in 5 runs of the old walk).
    #: It runs every `SILENCE_SCAN_S` now; before 8e6963f on every 50 ms tick.
    silence_scan_cpu_us_per_rank: float = 0.45

    def modelled_host_cpu_ms(self) -> float:
        """The parts of a flat host's launch CPU the model charges one by one (its connect,
        session, protocol, packets and frames, at `per_host_launch_ranks` ranks)."""
        r = self.per_host_launch_ranks
        packets = 3 + r  # hello; preflight + swept; spawned; one per up line
        frames = 3 + 2 * r
        return (self.connect_cpu_ms + self.session_start_cpu_ms + self.host_protocol_cpu_ms
                + self.join_cpu_us / 1000
                + (packets * self.packet_cpu_us + frames * self.frame_cpu_us
                   + r * self.output_line_cpu_us + 2 * self.send_cpu_us) / 1000)

    def transport_extra_cpu_ms(self) -> float:
        """What the measured flat per-host CPU leaves after the parts modelled one by one:
        Fabric's Connection, config and host keys, thread starts, keepalives. Charged per
        directly connected host, never per leaf; 0 (not less) when those parts already
        exceed the measurement (`main` says so)."""
        return max(0.0, self.per_host_launch_cpu_ms - self.modelled_host_cpu_ms())


#: Keys a costs file may hold that are not costs (bench/fanout.py's metadata).
META_KEYS = {"source", "commit", "measured_utc", "rounds", "ranks_per_host", "hosts", "rtt_ms",
             "note", "points", "before", "tree", "all_running_ms_per_host", "fixed_rss_mb"}


def load_costs(path: Optional[str]) -> tuple[Costs, list[str]]:
    """`Costs` from a JSON file of flat keys (``--print-costs`` shows them all); missing or
    null keys keep their default. bench/fanout.py's file is read as it is: its top-level
    figures are the flat design after the quick cuts (1 s read timeout), its ``before``
    object the flat design today, so ``before`` gives the 0.1 s-poll figures."""
    costs = Costs()
    notes: list[str] = []
    if path is None:
        return costs, notes
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict):
        raise SystemExit(f"{path}: expected a JSON object of costs")
    names = {f.name for f in dataclasses.fields(Costs)}
    values: dict[str, Any] = {}
    before = doc.get("before")
    if isinstance(before, dict):  # bench/fanout.py: top level = after the cuts
        if doc.get("idle_pct_per_host") is not None:
            values["idle_pct_per_host_read_timeout_1s"] = doc["idle_pct_per_host"]
        for key, value in before.items():
            if key in names and value is not None:
                values[key] = value
        notes.append(f"{path}: 'before' gives the 0.1 s-poll flat costs, the top-level "
                     "idle_pct_per_host the 1 s read timeout's")
        for key, value in doc.items():
            if key in names and key not in values and key != "idle_pct_per_host" \
                    and value is not None:
                values[key] = value
        if isinstance(doc.get("ranks_per_host"), (int, float)):
            values["per_host_launch_ranks"] = doc["ranks_per_host"]
    else:
        values = {k: v for k, v in doc.items() if k in names and v is not None}
    unknown = sorted(k for k in doc if k not in names and k not in META_KEYS)
    if unknown:
        notes.append(f"{path}: ignored keys {', '.join(unknown)}")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SystemExit(f"{path}: {key} must be a number, got {value!r}")
        setattr(costs, key, float(value))
    notes.append(f"{path}: {len(values)} costs read, {len(names) - len(values)} defaults")
    return costs, notes


# -- the simulation ------------------------------------------------------------------------------
class Cpu:
    """The controller: ``cores`` cores and one GIL, first come first served, each piece
    of work not preempted. ``load`` is the share of the GIL idle polling takes now."""

    def __init__(self, cores: int, gil_fraction: float) -> None:
        self.gil_free = 0.0
        self.core_free = [0.0] * cores
        self.gil_fraction = gil_fraction
        self.busy = 0.0
        self.load = 0.0
        #: Idle polling wanted more than `MAX_POLL_SHARE` of the GIL at some point.
        self.saturated = False

    def run(self, now: float, cpu_s: float) -> float:
        """Serve ``cpu_s`` of work asked for at ``now``; when it ends."""
        if cpu_s <= 0:
            return now
        if self.load > MAX_POLL_SHARE:
            self.saturated = True
        gil = cpu_s * self.gil_fraction / (1.0 - min(self.load, MAX_POLL_SHARE))
        free = cpu_s * (1.0 - self.gil_fraction)
        core = min(range(len(self.core_free)), key=self.core_free.__getitem__)
        start = max(now, self.gil_free, self.core_free[core])
        self.gil_free = start + gil
        end = start + gil + free
        self.core_free[core] = end
        self.busy += cpu_s
        return end


class Pool:
    """``workers`` threads taking jobs in order (a ThreadPoolExecutor's map)."""

    def __init__(self, sim: Sim, workers: int, on_empty: Callable[[], None]) -> None:
        self.sim = sim
        self.free = workers
        self.jobs: deque[Callable[[Callable[[], None]], None]] = deque()
        self.running = 0
        self.on_empty = on_empty

    def submit_all(self, jobs: list[Callable[[Callable[[], None]], None]]) -> None:
        self.jobs.extend(jobs)
        self._next()
        if not self.jobs and not self.running:
            self.on_empty()

    def _next(self) -> None:
        while self.free and self.jobs:
            job = self.jobs.popleft()
            self.free -= 1
            self.running += 1
            job(self._done)

    def _done(self) -> None:
        self.free += 1
        self.running -= 1
        self._next()
        if not self.jobs and not self.running:
            self.on_empty()


class Sim:
    """Events in time order; the idle polling's CPU integrated between them."""

    def __init__(self, cpu: Cpu) -> None:
        self.queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.now = 0.0
        self.cpu = cpu
        self.idle_cpu = 0.0
        self.stop_at: Optional[float] = None

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.queue, (t, self.seq, fn, args))
        self.seq += 1

    def run(self) -> None:
        while self.queue:
            t, _, fn, args = heapq.heappop(self.queue)
            self.idle_cpu += min(self.cpu.load, MAX_POLL_SHARE) * (t - self.now)
            self.now = t
            fn(*args)


@dataclass
class Result:
    design: str
    hosts: int
    ranks_per_host: int
    rtt_ms: float
    cuts: bool
    gateways: int
    all_running_s: float
    cpu_s: float
    threads: int
    idle_pct: float
    idle_pct_read_timeout_1s: float
    rss_mb: float
    packets: int
    gil_saturated: bool = False
    relays_up_s: float = 0.0
    join_cpu_s: float = 0.0
    coord_idle_pct: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)


class Launch:
    """One launch of ``hosts`` x ``ranks`` by one design, replayed event by event."""

    def __init__(self, design: str, hosts: int, ranks: int, rtt_ms: float, costs: Costs,
                 cores: int, fanout: int, cuts: bool, gateways: Optional[int] = None,
                 relay_start: str = "parallel") -> None:
        self.design, self.hosts, self.ranks, self.c = design, hosts, ranks, costs
        self.rtt = rtt_ms / 1000.0
        self.cuts = cuts
        self.relay_start = relay_start
        self.cpu = Cpu(cores, costs.gil_fraction)
        self.sim = Sim(self.cpu)
        if design == "flat" or hosts <= fanout:
            g = 0
        else:
            g = gateways if gateways else min(fanout, math.ceil(math.sqrt(hosts)))
        self.g = g
        # leaves[i]: the leaves of gateway i, as host indices; gateways are hosts 0..g-1
        self.leaves: list[list[int]] = []
        self.gateway_of: dict[int, int] = {}
        if g:
            rest = list(range(g, hosts))
            size, extra = divmod(len(rest), g)
            at = 0
            for i in range(g):
                n = size + (1 if i < extra else 0)
                block = rest[at:at + n]
                at += n
                self.leaves.append(block)
                for leaf in block:
                    self.gateway_of[leaf] = i
        self.direct = g if g else hosts
        self.batched = design != "tree-unbatched"
        # state
        self.relay_up: list[Optional[float]] = [None] * g
        self.relay_waiters: list[list[Callable[[], None]]] = [[] for _ in range(g)]
        self.relay_spawn_free = [0.0] * g
        self.gw_cores: list[list[float]] = [[0.0] * int(costs.gateway_cores) for _ in range(g)]
        self.batch_due: list[Optional[float]] = [None] * g
        self.batch_frames: list[list[tuple[int, str, int]]] = [[] for _ in range(g)]
        self.booted = [0.0] * hosts
        self.spec_at = [0.0] * hosts
        self.reported = 0
        self.up = 0
        self.packets = 0
        self.all_running = 0.0
        self.idle_cpu_until_running = 0.0
        self.phases: dict[str, float] = {}
        self.idle_per_host = (costs.idle_pct_per_host_read_timeout_1s if cuts
                              else costs.idle_pct_per_host) / 100.0

    # -- helpers ------------------------------------------------------------------------------
    def work(self, cpu_s: float, then: Optional[Callable[..., None]] = None, *args: Any) -> None:
        end = self.cpu.run(self.sim.now, cpu_s)
        if then is not None:
            self.sim.at(end, then, *args)

    def run(self) -> Result:
        c = self.c
        self.sim.at(0.0, self.work, c.fixed_launch_cpu_s, self.connect_all)
        self.sim.run()
        rpn, h = self.ranks, self.hosts
        leaves = h - self.direct
        gw = self.g
        idle = c.fixed_idle_pct + self.direct * c.idle_pct_per_host
        idle_1s = c.fixed_idle_pct + self.direct * c.idle_pct_per_host_read_timeout_1s
        if gw:
            leaf_idle = leaves * c.leaf_idle_cpu_us_per_s / 1e4
            if self.batched:  # the leaves' heartbeats come back together: a batch a ping
                up = gw * (c.packet_cpu_us + c.batch_cpu_us) / PING_INTERVAL_S / 1e4
            else:  # every heartbeat a packet of its own
                up = leaves * c.packet_cpu_us / PING_INTERVAL_S / 1e4
            idle += leaf_idle + up
            idle_1s += leaf_idle + up
        threads = c.fixed_threads + self.direct * c.threads_per_host + gw * c.threads_per_relay
        w = h * rpn
        # formation: an accept, hello and welcome per rank, then ``formed`` to each: O(W)
        join = w * (c.join_cpu_us + c.welcome_cpu_us) + w * (c.send_cpu_us + c.formed_cpu_us)
        coord_idle = w * (c.heartbeat_cpu_us
                          + c.silence_scan_cpu_us_per_rank / SILENCE_SCAN_S) / 1e4
        relays = max((t for t in self.relay_up if t is not None), default=0.0)
        return Result(self.design, h, rpn, self.rtt * 1000, self.cuts, gw,
                      round(self.all_running, 3),
                      round(self.cpu.busy + self.idle_cpu_until_running, 3),
                      int(round(threads)), round(idle, 2), round(idle_1s, 2),
                      round(c.fixed_rss_mb + self.direct * c.rss_mb_per_host, 1),
                      self.packets, self.cpu.saturated, round(relays, 3),
                      round(join / 1e6, 2),
                      round(coord_idle, 2), {k: round(v, 3) for k, v in self.phases.items()})

    # -- connect_all ----------------------------------------------------------------------------
    def connect_all(self) -> None:
        self.phases["fixed"] = self.sim.now
        pool = Pool(self.sim, int(self.c.connect_workers), self.connected_all)
        jobs: list[Callable[[Callable[[], None]], None]] = []
        for host in range(self.direct):
            jobs.append(functools.partial(self.connect, host))
        if self.g:
            for host in range(self.g, self.hosts):
                jobs.append(functools.partial(self.leaf_connect, host))
        self.pool = pool
        pool.submit_all(jobs)

    def connect(self, host: int, done: Callable[[], None]) -> None:
        c = self.c
        wait = c.connect_round_trips * self.rtt + (
            c.auth_nodelay_wait_ms if self.cuts else c.auth_nagle_wait_ms) / 1000

        if self.g and self.relay_start == "parallel":
            # `GatewayHost.connect` holds the gateway's lock from the connect to the relay's
            # hello: a leaf taken meanwhile waits for it (`ensure_relay`)
            self.relay_up[host] = -1.0

        def handshake_done() -> None:
            self.work(c.connect_cpu_ms / 1000 + c.transport_extra_cpu_ms() / 1000,
                      connected)

        def connected() -> None:
            self.cpu.load += self.idle_per_host
            if self.g and self.relay_start == "parallel":
                self.start_relay(host, done)
            else:
                done()

        self.sim.at(self.sim.now + wait, handshake_done)

    def start_relay(self, gw: int, done: Callable[[], None]) -> None:
        """`Relay.start`: a second session, the payload, then its hello."""
        c = self.c
        self.relay_up[gw] = -1.0  # starting

        def session() -> None:
            self.work(c.session_start_cpu_ms / 1000, booting)

        def booting() -> None:
            self.sim.at(self.sim.now + c.agent_start_ms / 1000 + self.rtt / 2, hello)

        def hello() -> None:
            self.packets += 1
            self.work((c.packet_cpu_us + c.frame_cpu_us) / 1e6, up)

        def up() -> None:
            self.relay_up[gw] = self.sim.now
            waiters, self.relay_waiters[gw] = self.relay_waiters[gw], []
            done()
            for fn in waiters:
                fn()

        self.sim.at(self.sim.now + c.session_round_trips * self.rtt, session)

    def leaf_connect(self, host: int, done: Callable[[], None]) -> None:
        """`GatewayTransport.connect`: its gateway's relay, started if need be, under the
        gateway's lock (the other leaves of that gateway wait for it, holding a worker)."""
        gw = self.gateway_of[host]
        state = self.relay_up[gw]
        if state is None:
            self.start_relay(gw, done)
        elif state < 0:
            self.relay_waiters[gw].append(done)
        else:
            self.work(self.c.send_cpu_us / 1e6, done)

    def connected_all(self) -> None:
        self.phases["connected"] = self.sim.now
        pool = Pool(self.sim, int(self.c.connect_workers), self.started_all)
        jobs: list[Callable[[Callable[[], None]], None]] = []
        for host in range(self.direct):
            jobs.append(functools.partial(self.start_session, host))
        for host in range(self.direct, self.hosts):
            jobs.append(functools.partial(self.start_leaf, host))
        pool.submit_all(jobs)

    # -- start_agents ---------------------------------------------------------------------------
    def start_session(self, host: int, done: Callable[[], None]) -> None:
        c = self.c

        def opened() -> None:
            self.work(c.session_start_cpu_ms / 1000, started)

        def started() -> None:
            self.booted[host] = self.sim.now + c.agent_start_ms / 1000
            # the handshake and hello arrive once the agent runs
            self.sim.at(self.booted[host] + self.rtt / 2, self.packet_in, host, 1, "hello")
            done()

        self.sim.at(self.sim.now + c.session_round_trips * self.rtt, opened)

    def start_leaf(self, host: int, done: Callable[[], None]) -> None:
        self.work(self.c.leaf_start_cpu_us / 1e6, self.leaf_opened, host, done)

    def leaf_opened(self, host: int, done: Callable[[], None]) -> None:
        """The OPEN frame reaches the relay, which spawns the leaf's ssh."""
        c = self.c
        gw = self.gateway_of[host]
        arrive = self.sim.now + self.rtt / 2
        spawned = max(arrive, self.relay_spawn_free[gw]) + c.leaf_ssh_spawn_ms / 1000
        self.relay_spawn_free[gw] = spawned
        cores = self.gw_cores[gw]
        core = min(range(len(cores)), key=cores.__getitem__)
        kex_start = max(spawned + 3 * self.rtt, cores[core])  # TCP, banner, KEXINIT
        cores[core] = kex_start + c.leaf_ssh_cpu_ms / 1000
        # ECDH reply, service request, auth, then the session's open and exec
        reached = cores[core] + (c.connect_round_trips - 3 + c.session_round_trips) * self.rtt
        self.booted[host] = reached + c.agent_start_ms / 1000
        self.frame_up(host, self.booted[host], 1, "hello")
        done()

    # -- the plan, specs, pre-flight --------------------------------------------------------------
    def started_all(self) -> None:
        self.phases["agents started"] = self.sim.now
        for host in range(self.hosts):
            self.work(self.c.host_protocol_cpu_ms / 1000 + self.c.send_cpu_us / 1e6,
                      self.spec_sent, host)

    def down(self, host: int) -> float:
        """One-way time from the controller to ``host``'s agent."""
        return self.rtt / 2 + (self.rtt / 2 if host in self.gateway_of else 0.0)

    def spec_sent(self, host: int) -> None:
        c = self.c
        begin = max(self.sim.now + self.down(host), self.booted[host])
        dial = begin + c.preflight_ms / 1000 + c.preflight_round_trips * self.rtt
        # the coordinator answers the probe (its CPU, on the same GIL)
        self.sim.at(dial - self.rtt / 2, self.work, c.join_cpu_us / 1e6)
        self.frame_up(host, dial, 2, "preflight")

    # -- frames coming up --------------------------------------------------------------------------
    def frame_up(self, host: int, at: float, frames: int, kind: str, packets: int = 1) -> None:
        """An agent wrote ``frames`` frames at ``at``, in ``packets`` writes (one event)."""
        gw = self.gateway_of.get(host)
        if gw is None:
            self.sim.at(at + self.rtt / 2, self.packet_in, host, frames, kind, packets)
            return
        at += self.rtt / 2  # the leaf's ssh to its gateway's relay
        if not self.batched:  # each frame forwarded as a packet of its own
            self.sim.at(at + self.rtt / 2, self.packet_in, host, frames, kind, frames)
            return
        self.sim.at(at, self.batch_add, gw, host, frames, kind)

    def batch_add(self, gw: int, host: int, frames: int, kind: str) -> None:
        self.batch_frames[gw].append((host, kind, frames))
        if self.batch_due[gw] is None:
            due = self.sim.now + self.c.batch_interval_ms / 1000
            self.batch_due[gw] = due
            self.sim.at(due, self.batch_flush, gw)

    def batch_flush(self, gw: int) -> None:
        entries, self.batch_frames[gw] = self.batch_frames[gw], []
        self.batch_due[gw] = None
        self.sim.at(self.sim.now + self.rtt / 2, self.batch_in, entries)

    def batch_in(self, entries: list[tuple[int, str, int]]) -> None:
        c = self.c
        self.packets += 1
        leaves = len({host for host, _, _ in entries})
        frames = sum(n for _, _, n in entries)
        lines = sum(n for _, kind, n in entries if kind == "up")
        cost = (c.packet_cpu_us + c.batch_cpu_us + leaves * c.batch_entry_cpu_us
                + frames * c.frame_cpu_us + lines * c.output_line_cpu_us) / 1e6
        self.work(cost, self.handled, entries)

    def packet_in(self, host: int, frames: int, kind: str, packets: int = 1) -> None:
        c = self.c
        self.packets += packets
        cost = packets * c.packet_cpu_us + frames * c.frame_cpu_us
        if kind == "up":
            cost += frames * c.output_line_cpu_us
        self.work(cost / 1e6, self.handled, [(host, kind, frames)])

    def handled(self, entries: list[tuple[int, str, int]]) -> None:
        for _host, kind, frames in entries:
            if kind == "preflight":
                self.reported += frames
                if self.reported == 2 * self.hosts:
                    self.all_reported()
            elif kind == "up":
                self.up += frames
                if self.up == self.hosts * self.ranks:
                    self.all_running = self.sim.now
                    self.idle_cpu_until_running = self.sim.idle_cpu
                    self.phases["all running"] = self.sim.now

    # -- START, ranks ------------------------------------------------------------------------------
    def all_reported(self) -> None:
        self.phases["pre-flight done"] = self.sim.now
        for host in range(self.hosts):
            self.work(self.c.send_cpu_us / 1e6, self.start_sent, host)

    def start_sent(self, host: int) -> None:
        c = self.c
        at = self.sim.now + self.down(host)
        spawned = at + self.ranks * c.rank_spawn_ms / 1000
        self.frame_up(host, spawned, self.ranks, "spawned")
        if host in self.gateway_of and self.batched:
            for r in range(self.ranks):  # each line joins the batch open when it comes
                self.frame_up(host, at + (r + 1) * c.rank_spawn_ms / 1000
                              + c.rank_start_ms / 1000, 1, "up")
        else:  # a packet a line; one event at the last line's time (ranks start together)
            self.frame_up(host, spawned + c.rank_start_ms / 1000, self.ranks, "up", self.ranks)


def simulate(design: str, hosts: int, ranks: int, rtt_ms: float, costs: Costs, *,
             cores: int = 2, fanout: int = 64, cuts: bool = False,
             gateways: Optional[int] = None, relay_start: str = "parallel") -> Result:
    launch = Launch(design, hosts, ranks, rtt_ms, costs, cores, fanout, cuts, gateways,
                    relay_start)
    return launch.run()


# -- micro-measurements -----------------------------------------------------------------------
def measure(out: TextIO, ssh: bool = False) -> dict[str, float]:
    """Re-measure on this machine, with this checkout's code, the pure-Python costs the
    defaults took from it (no host, no SSH; about a second of CPU): frames and batches cut
    by the session's and relay's readers, and the coordinator's costs by its own code in
    this process (`Coordinator._send`, `_broadcast`, `_tick`, with 8,192 ranks joined over
    sockets that send nowhere). The per-packet cost of a paramiko session needs an sshd:
    ``--measure ssh``, or bench/fanout.py's launches."""
    import hmac
    import os
    import queue
    import socket
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fdl_fabric import rank as rk
    from fdl_fabric.agent import relay as mux
    from fdl_fabric.agent import wire
    from fdl_fabric.events import EventBus
    from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorSpec, _Conn
    from fdl_fabric.transport import session as ses

    cpu = time.process_time
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    class Host:  # what `session._Stdout` asks of its session
        broken, host = False, "h1"

        def heard(self) -> None:
            return None

        def post(self, report: Any) -> None:
            inbox.put(report)

        def output(self, report: Any) -> None:
            return None

        def handle(self, kind: int, obj: dict[str, Any]) -> None:
            inbox.put(ses._DECODERS[kind](self.host, obj))

        def protocol_error(self, message: str) -> None:
            raise RuntimeError(message)

    frames = [wire.message(wire.HELLO, {"version": 2, "pid": 1, "python": "3.11.2"}),
              wire.message(wire.PREFLIGHT, {"values": {"path": "ok", "dial": "ok"}}),
              wire.message(wire.SWEPT, {"stopped": [], "leftovers": [], "errors": []})]
    frames += [wire.message(wire.SPAWNED, {"rank": r, "pid": 4000 + r}) for r in range(8)]
    frames += [wire.output(r, wire.STDOUT, b"up %d\n" % r, False) for r in range(8)]
    n = 1000
    feed = ses._Stdout(Host())  # type: ignore[arg-type]
    feed.reader.feed(wire.HANDSHAKE)
    t = cpu()
    for _ in range(n):
        for f in frames:
            feed.feed(f)
    decode_us = (cpu() - t) / (n * len(frames)) * 1e6
    body = mux.batch_frame([(lid, 1, frames[12]) for lid in range(31)])
    reader = mux.Reader(mux.UP_TYPES, handshake=True)
    reader.feed(mux.HANDSHAKE)
    t = cpu()
    for _ in range(n):
        for _kind, b in reader.feed(body):
            mux.parse_batch(b)
    batch_us = (cpu() - t) / n * 1e6
    left, right = socket.socketpair()
    salt, run = os.urandom(16), "run"
    buf = bytearray()
    sent = [rk.encode_frame(salt, run, i, {"type": "heartbeat", "progress": 0}) for i in range(n)]
    t = cpu()
    for i in range(n):
        left.send(sent[i])
        buf += right.recv(65536)
        got = rk.take_frame(buf)
        assert got is not None
        tag, payload = got
        hmac.compare_digest(tag, rk.frame_tag(salt, run, i, payload))
        rk.decode_payload(payload)
    beat_us = (cpu() - t) / n * 1e6
    w = 8192
    coord = Coordinator(CoordinatorSpec(run, salt, w, "127.0.0.1", 0), EventBus())

    class Sink:  # a connection's socket: sends go nowhere
        def sendall(self, data: bytes) -> None:
            return None

    now = time.monotonic()
    for r in range(w):  # every rank joined, nobody dead: what formation leaves behind
        coord._rank_conn[r] = _Conn(Sink(), "peer", now, rank=r)  # type: ignore[arg-type]
        coord._last_frame[r] = now
    coord._formed, coord._formed_at = True, now
    one = coord._rank_conn[1]
    t = cpu()
    for _ in range(n):  # `Coordinator._hello`'s welcome, as written
        coord._send(one, {"type": "welcome", "rank": 1, "world_size": w,
                          "dead": coord._dead.ranks(), "formed": False})
    welcome_us = (cpu() - t) / n * 1e6
    t = cpu()
    for _ in range(3):
        coord._broadcast({"type": "formed", "dead": coord._dead.ranks()})
    formed_us = (cpu() - t) / 3 / w * 1e6
    t = cpu()
    for _ in range(10):  # `Coordinator._tick` with a silence walk due
        coord._next_scan = 0.0
        coord._tick(time.monotonic())
    scan_us = (cpu() - t) / 10 / w * 1e6
    t = cpu()
    for _ in range(n):  # and the ticks between walks
        coord._next_scan = math.inf
        coord._tick(time.monotonic())
    tick_us = (cpu() - t) / n * 1e6
    coord._wake_r.close()
    coord._wake_w.close()
    left.close()
    right.close()
    result = {"frame_decode_us (in frame_cpu_us)": round(decode_us, 2),
              "batch_cpu_us + 31 x batch_entry_cpu_us": round(batch_us, 2),
              "heartbeat_bare_us (in heartbeat_cpu_us)": round(beat_us, 2),
              "welcome_cpu_us": round(welcome_us, 2),
              "formed_cpu_us": round(formed_us, 2),
              "silence_scan_cpu_us_per_rank": round(scan_us, 4),
              "tick_without_scan_us (in fixed_idle_pct)": round(tick_us, 2)}
    if ssh:
        result.update(measure_ssh())
    out.write(json.dumps(result, indent=2) + "\n")
    return result


def measure_ssh() -> dict[str, float]:
    """The SSH costs, against one sshd lab host (`fdl_fabric.testing.SshdLab`, stopped
    after): a bare paramiko connect + auth (with and without TCP_NODELAY before it), a
    session's open + exec, the 360 KB payload, a small write, the idle of one transport,
    and a packet received (2,000 writes of 60 bytes, 4 ms apart, each its own packet; the
    process's CPU less its idle). About 20 s, mostly waiting."""
    import os
    import socket
    import statistics
    import tempfile
    import threading
    import time

    import paramiko

    from fdl_fabric.testing import SshdLab

    cpu = time.process_time
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fdl-model-") as tmp:
        lab = SshdLab(tmp, 1).start()
        try:
            host = lab.hosts[0]
            key = paramiko.Ed25519Key.from_private_key_file(lab.identity_file)

            def connect(nodelay: bool) -> paramiko.SSHClient:
                sock = socket.create_connection((host.addr, host.port))
                if nodelay:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client = paramiko.SSHClient()
                client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
                client.connect(host.addr, host.port, username=lab.user, pkey=key, sock=sock,
                               allow_agent=False, look_for_keys=False)
                return client

            for nodelay in (False, True):
                cpus, walls = [], []
                for _ in range(7):
                    t, w = cpu(), time.monotonic()
                    connect(nodelay).close()
                    cpus.append(cpu() - t)
                    walls.append(time.monotonic() - w)
                name = "nodelay" if nodelay else "nagle"
                res[f"bare_connect_cpu_ms ({name})"] = round(statistics.median(cpus) * 1e3, 2)
                res[f"bare_connect_wall_ms ({name})"] = round(statistics.median(walls) * 1e3, 1)
            client = connect(True)
            transport = client.get_transport()
            assert transport is not None
            t = cpu()
            for _ in range(5):
                chan = transport.open_session()
                chan.exec_command("true")
                chan.recv_exit_status()
                chan.close()
            res["open_exec_cpu_ms"] = round((cpu() - t) / 5 * 1e3, 2)
            t, w = cpu(), time.monotonic()
            time.sleep(3.0)
            idle = (cpu() - t) / (time.monotonic() - w)
            res["idle_pct_one_transport"] = round(idle * 100, 4)
            chan = transport.open_session()
            chan.exec_command("cat > /dev/null")
            t = cpu()
            chan.sendall(os.urandom(360 * 1024))
            res["payload_360k_cpu_ms"] = round((cpu() - t) * 1e3, 2)
            t = cpu()
            for _ in range(1000):
                chan.sendall(b"y" * 40)
            res["send_cpu_us"] = round((cpu() - t) / 1000 * 1e6, 1)
            chan.shutdown_write()
            chan.recv_exit_status()
            writes = 2000
            prog = (f"import os,time\nfor i in range({writes}):\n os.write(1, b'x'*60)\n"
                    f" time.sleep(0.004)\n")
            chan = transport.open_session()
            chan.exec_command(f'python3 -c "{prog}"')
            reads = [0]

            def reader() -> None:
                while chan.recv(32768):
                    reads[0] += 1

            thread = threading.Thread(target=reader)
            t, w = cpu(), time.monotonic()
            thread.start()
            thread.join()
            spent, took = cpu() - t, time.monotonic() - w
            res["packet_cpu_us"] = round((spent - idle * took) / max(reads[0], 1) * 1e6, 1)
            res["packets_read"] = float(reads[0])
            client.close()
        finally:
            lab.stop()
    return res


# -- output ---------------------------------------------------------------------------------------
def _table(rows: list[list[str]], right: list[bool]) -> str:
    try:
        import benchlib  # the repo's tables; bench/ is on sys.path

        return str(benchlib.table(rows, right))
    except ImportError:  # a copy of this file alone
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) if right[i] else c.ljust(w)
                           for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                 for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def report(results: list[Result], costs: Costs, args: argparse.Namespace, out: TextIO) -> None:
    cores = f"{args.cores} core{'s' if args.cores != 1 else ''}"
    out.write(textwrap.fill(
        f"bench/model.py: controller on {cores}, fanout {args.fanout}, "
        f"{'with' if args.cuts else 'without'} the quick cuts (TCP_NODELAY before the "
        f"handshake, 1 s read timeout), relays started {args.relay_start}; costs: "
        f"{args.costs or 'built-in (this machine)'}", 100) + "\n\n")
    head = ["hosts x ranks", "RTT ms", "design", "gw", "all running s", "CPU s", "threads",
            "idle %", "idle % 1s timeout", "host MB", "packets in", "relays up s",
            "join CPU s", "coord idle %"]
    rows = [head]
    for r in results:
        rows.append([f"{r.hosts} x {r.ranks_per_host}", f"{r.rtt_ms:g}", r.design,
                     str(r.gateways or "-"),
                     f"{'>' if r.gil_saturated else ''}{r.all_running_s:.1f}", f"{r.cpu_s:.1f}",
                     f"{r.threads:,}", f"{r.idle_pct:.1f}",
                     f"{r.idle_pct_read_timeout_1s:.1f}", f"{r.rss_mb:.0f}",
                     f"{r.packets:,}", f"{r.relays_up_s:.2f}" if r.gateways else "-",
                     f"{r.join_cpu_s:.1f}", f"{r.coord_idle_pct:.1f}"])
    out.write(_table(rows, [False, True, False] + [True] * (len(head) - 3)) + "\n\n")
    notes = ("all running: the controller handled the last 'up' line; CPU: the controller's "
             "CPU until then; idle: % of one core once every rank runs (paramiko's 0.1 s poll, "
             "then with a 1 s read timeout); relays up: the last relay's hello; join CPU and "
             "coord idle: the coordinator's cost when every rank calls rank.join() (formation "
             "and heartbeats; in no other column).")
    if any(r.gil_saturated for r in results):
        notes += (f" '>': the hosts' idle polling alone wants more than "
                  f"{MAX_POLL_SHARE:.0%} of the GIL, so the launch crawls; the model gives the "
                  "polls that much and the launch the rest: a lower bound.")
    out.write(textwrap.fill(notes, 100) + "\n")
    h, rpn, rtt = TARGET["hosts"], TARGET["ranks_per_host"], TARGET["rtt_ms"]
    tree = simulate("tree", int(h), int(rpn), rtt, costs, cores=args.cores, fanout=args.fanout,
                    cuts=args.cuts, relay_start=args.relay_start)
    other = "parallel" if args.relay_start == "pool" else "pool"
    alt = simulate("tree", int(h), int(rpn), rtt, costs, cores=args.cores, fanout=args.fanout,
                   cuts=args.cuts, relay_start=other)
    met = tree.all_running_s <= TARGET["all_running_s"]
    out.write(f"\ntarget: 1,024 x 8 all running in <= 15 s at a 1 ms RTT, tree "
              f"({tree.gateways} gateways): {tree.all_running_s:.1f} s: "
              f"{'met' if met else 'NOT met'} (relays started {other}"
              f"{', the code before 420d9cf' if other == 'pool' else ''}: "
              f"{alt.all_running_s:.1f} s)\n")


def check(path: str, costs: Costs, args: argparse.Namespace, out: TextIO) -> list[dict[str, Any]]:
    """Model against measured launches, side by side."""
    doc = json.loads(Path(path).read_text())
    points = doc.get("points") if isinstance(doc, dict) else doc
    if not isinstance(points, list):
        raise SystemExit(f"{path}: expected a list of launches (or an object with 'points')")
    # bench/fanout.py measures the checkout, which has the quick cuts ("flat_before" has
    # them undone); a plain list follows --cuts unless a row says "cuts".
    checkout_cuts = isinstance(doc, dict) and doc.get("source") == "bench/fanout.py"
    default_cuts = True if checkout_cuts else bool(args.cuts)
    rows = [["design", "hosts x ranks", "RTT ms", "gw", "running s meas", "model", "diff",
             "CPU s meas", "model", "diff"]]
    done: list[dict[str, Any]] = []
    for p in points:
        design = str(p["design"])
        cuts = bool(p.get("cuts", default_cuts))
        if design == "flat_before":  # bench/fanout.py: flat with the quick cuts undone
            design, cuts = "flat", False
        if design not in DESIGNS:
            out.write(f"  skipped: design {design!r}\n")
            continue
        gateways = p.get("gateways")
        fanout = int(p.get("fanout", args.fanout if not gateways else 1))
        r = simulate(design, int(p["hosts"]), int(p["ranks_per_host"]), float(p["rtt_ms"]),
                     costs, cores=args.cores, fanout=fanout, cuts=cuts,
                     gateways=int(gateways) if gateways else None,
                     relay_start=args.relay_start)
        t, cpu = p.get("all_running_s"), p.get("cpu_s")

        def diff(meas: Any, model: float) -> str:
            return "-" if meas is None else f"{model - float(meas):+.3f}"

        rows.append([str(p["design"]), f"{r.hosts} x {r.ranks_per_host}", f"{r.rtt_ms:g}",
                     str(r.gateways or "-"), "-" if t is None else f"{float(t):.3f}",
                     f"{r.all_running_s:.3f}", diff(t, r.all_running_s),
                     "-" if cpu is None else f"{float(cpu):.3f}", f"{r.cpu_s:.3f}",
                     diff(cpu, r.cpu_s)])
        done.append({"measured": p, "model": dataclasses.asdict(r)})
    out.write(f"model vs measured ({path}); diff = model - measured\n\n")
    out.write(_table(rows, [False, False] + [True] * 8) + "\n")
    out.write("\nOn the lab the hosts share the controller's cores, so measured times include "
              "their work; the model's hosts have cores of their own: compare CPU first.\n")
    return done


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 epilog="See the module docstring (bench/model.py) for the "
                                        "model's assumptions and its calibration.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--costs", metavar="FILE",
                    help="JSON of measured costs (bench/fanout.py --write-costs); keys as "
                         "--print-costs shows, missing ones keep their defaults")
    ap.add_argument("--print-costs", action="store_true",
                    help="print the costs in use as JSON (the schema of --costs) and exit")
    ap.add_argument("--check", metavar="FILE",
                    help="JSON list of measured launches [{design, hosts, ranks_per_host, "
                         "rtt_ms, all_running_s, cpu_s}]: model vs measured")
    ap.add_argument("--hosts", default="1024,4096", help="host counts (1024,4096)")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="ranks per host (8)")
    ap.add_argument("--rtt", default="0.2,1,20", help="round-trip times in ms (0.2,1,20)")
    ap.add_argument("--designs", default=",".join(DESIGNS), help=f"({','.join(DESIGNS)})")
    ap.add_argument("--cores", type=int, default=2, help="controller cores (2, as here)")
    ap.add_argument("--fanout", type=int, default=64,
                    help="fanout: beyond it, ceil(sqrt(H)) gateways, at most fanout (64)")
    ap.add_argument("--cuts", action="store_true",
                    help="the quick cuts: TCP_NODELAY before the handshake (10 ms instead of "
                         "52 ms on auth) and a 1 s read timeout (idle)")
    ap.add_argument("--relay-start", choices=("pool", "parallel"), default="parallel",
                    help="parallel (the code since 420d9cf): each gateway's relay right "
                         "after its connect, in the same worker (`GatewayHost.connect`); "
                         "pool: the old behaviour, a relay started by the first leaf of its "
                         "gateway the connect pool reached, its other leaves waiting")
    ap.add_argument("--measure", nargs="?", const="python", choices=("python", "ssh"),
                    help="re-measure with this checkout the pure-Python costs (frames, "
                         "batches, the coordinator's; ~1 s), and with 'ssh' also the SSH ones "
                         "against one sshd lab host (~20 s); prints JSON")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if args.cores < 1 or args.fanout < 1 or args.ranks_per_host < 1:
        ap.error("--cores, --fanout and --ranks-per-host must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    costs, notes = load_costs(args.costs)
    out = sys.stdout
    if args.print_costs:
        out.write(json.dumps(dataclasses.asdict(costs), indent=2) + "\n")
        sys.stderr.write(f"note: derived from these, not read: transport_extra_cpu_ms = "
                         f"{costs.transport_extra_cpu_ms():.3f}\n")
        return 0
    known = costs.modelled_host_cpu_ms()
    if known > costs.per_host_launch_cpu_ms:
        notes.append(f"the measured per-host launch CPU ({costs.per_host_launch_cpu_ms:.2f} ms "
                     f"at {costs.per_host_launch_ranks:g} rank(s) a host) is less than the "
                     f"model's own parts of a host ({known:.2f} ms): a flat host or gateway is "
                     f"charged {known - costs.per_host_launch_cpu_ms:.2f} ms more than measured")
    for note in notes:
        sys.stderr.write(f"note: {note}\n")
    if args.measure:
        measure(out, ssh=args.measure == "ssh")
        return 0
    if args.check:
        done = check(args.check, costs, args, sys.stderr if args.json else out)
        if args.json:
            out.write(json.dumps(done, indent=2) + "\n")
        return 0
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    bad = [d for d in designs if d not in DESIGNS]
    if bad:
        raise SystemExit(f"unknown design(s) {', '.join(bad)}; known: {', '.join(DESIGNS)}")
    results = [simulate(d, int(h), args.ranks_per_host, float(rtt), costs, cores=args.cores,
                        fanout=args.fanout, cuts=args.cuts, relay_start=args.relay_start)
               for h in args.hosts.split(",") for rtt in args.rtt.split(",") for d in designs]
    if args.json:
        out.write(json.dumps({"costs": dataclasses.asdict(costs),
                              "cores": args.cores, "fanout": args.fanout, "cuts": args.cuts,
                              "relay_start": args.relay_start,
                              "results": [dataclasses.asdict(r) for r in results]},
                             indent=2) + "\n")
        return 0
    report(results, costs, args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
