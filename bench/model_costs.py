"""model.py's costs: every CPU cost of the model with where it was measured (`Costs`),
read from a ``--costs`` file (`load_costs`) or re-measured on this machine (`measure`,
`measure_ssh`). Standard library only, but for the measurements (this checkout's code)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO


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


def _fanout_values(doc: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The costs in bench/fanout.py's file: its ``before`` object (the 0.1 s poll), the
    top-level idle slope as the 1 s read timeout's, then the other top-level keys."""
    values: dict[str, Any] = {}
    if doc.get("idle_pct_per_host") is not None:
        values["idle_pct_per_host_read_timeout_1s"] = doc["idle_pct_per_host"]
    for key, value in doc["before"].items():
        if key in names and value is not None:
            values[key] = value
    for key, value in doc.items():
        if key in names and key not in values and key != "idle_pct_per_host" \
                and value is not None:
            values[key] = value
    if isinstance(doc.get("ranks_per_host"), (int, float)):
        values["per_host_launch_ranks"] = doc["ranks_per_host"]
    return values


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
    if isinstance(doc.get("before"), dict):  # bench/fanout.py: top level = after the cuts
        values = _fanout_values(doc, names)
        notes.append(f"{path}: 'before' gives the 0.1 s-poll flat costs, the top-level "
                     "idle_pct_per_host the 1 s read timeout's")
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
    from fdl_fabric.supervision.connections import Conn
    from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorSpec
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
        coord._rank_conn[r] = Conn(Sink(), "peer", now, rank=r)  # type: ignore[arg-type]
        coord._beats.last_frame[r] = now
    coord._formed, coord._beats.formed_at = True, now
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
        coord._beats.next_scan = 0.0
        coord._tick(time.monotonic())
    scan_us = (cpu() - t) / 10 / w * 1e6
    t = cpu()
    for _ in range(n):  # and the ticks between walks
        coord._beats.next_scan = math.inf
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
