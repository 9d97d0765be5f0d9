"""model.py's discrete-event simulation of one launch (`simulate`): the controller's
cores and GIL (`Cpu`), the connect pool (`Pool`), the event queue (`Sim`) and the launch
itself (`Launch`), flat or through a gateway tree. Standard library only."""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from model_costs import Costs

DESIGNS = ("flat", "tree", "tree-unbatched")


#: The issue's target: 1,024 hosts x 8 ranks, all running within 15 s at a 1 ms RTT.
TARGET = {"hosts": 1024, "ranks_per_host": 8, "rtt_ms": 1.0, "all_running_s": 15.0}


#: Seconds between two silence walks over every rank: `heartbeats.SILENCE_SCAN_MAX`
#: (0.5 s) or a twentieth of the heartbeat timeout (30 s by default), whichever is less.
#: Before 8e6963f the walk ran on every tick (`TICK_INTERVAL`, 50 ms).
SILENCE_SCAN_S = min(0.5, 30.0 / 20)


#: The launcher pings every agent every 2 s (`wire.PING_INTERVAL`).
PING_INTERVAL_S = 2.0


#: The largest share of the GIL idle polling is given. Beyond it the launch crawls (every
#: other thread waits behind thousands of polls); the model's time is then a lower bound.
MAX_POLL_SHARE = 0.9


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
