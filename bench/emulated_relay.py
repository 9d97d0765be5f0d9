#!/usr/bin/env python3
"""An emulated gateway relay for `bench/emulator.py`: the real relay's upward protocol,
with every leaf's agent and ranks emulated in this one process (no ssh, no leaf host).

The launcher starts it instead of the real relay (`emulator.py` swaps the command that
`fdl_fabric.transport.gateway.Relay.start` runs, nothing else), on a real gateway, over a
real SSH session. It reads the agent payload the launcher writes first (its length is on
the command line), then speaks the mux of `fdl_fabric.agent.relay` (docs/protocol.md,
"Relay"): handshake and HELLO, then ``OPEN``/``DATA``/``EOF``/``KILL``/``BLOB``/``PAYLOAD``
down and ``BATCH``/``CLOSED`` up. What goes up is batched by the real relay's own
`relay.Batcher` (every 50 ms, at once after an exit), so the launcher reads exactly the
kind of frames a real relay sends.

Each ``OPEN`` leaf is an emulated agent that never runs ssh: once its payload arrived it
writes the agent handshake and HELLO (`fdl_fabric.agent.wire`), and answers what the
launcher sends it as `fdl_fabric.agent.main` does: SPEC (the pre-flight's values, with
a real ``dial`` of the coordinator; SWEPT), START (SPAWNED for each rank), STOP / KILL /
SIGNAL (the ranks "die" of the signal, as ``sleep`` does), PING (a HEARTBEAT when it sent
nothing else for a second), the lease, SUSPEND/RESUME, STACKS, LIST, SWEEP, and EOF on
its stdin (the leash); after its last rank VERIFIED and DONE, then its "ssh" ends
(CLOSED, status 0).

Each synthetic rank (no process) writes ``up <RANK>`` (one OUTPUT frame), then, unless
``--no-join``, joins the launcher's coordinator for real: a TCP connection, ``hello`` with
the frames of `fdl_fabric.rank` (its config read by `rank._read_config` from the
environment the spec gives the rank, as the agent would build it), ``welcome``, then a
``heartbeat`` every `rank.HEARTBEAT_INTERVAL`; a ``retry`` reject or a refused connect is
dialled again with rank.py's pauses. Its "work" ends after ``--work`` seconds (exit 0,
after ``exiting``), or when it is stopped.

Single-threaded, on the real relay's loop (`fdl_fabric.agent.relayloop.RelayLoop`, itself
on the agent's `hostloop`): one selector over stdin, stdout, every rank's socket and a
signal wake-up pipe, plus a timer heap; the mux's HELLO, the launcher's frames by type,
the batching, EOF/EPIPE/TERM and the last flush are the real relay's code, not a copy.
Standard library and fdl_fabric's standalone modules only (the agent's, which a host
has), so it runs under ``python3 -I -S``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import hashlib
import heapq
import hmac
import json
import os
import random
import selectors
import signal
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fdl_fabric import rank as rk  # noqa: E402
from fdl_fabric.agent import checks, mux, relay, wire  # noqa: E402
from fdl_fabric.agent.relayloop import RelayLoop  # noqa: E402

#: Pids given to synthetic processes: above any real pid of this machine (pid_max).
FAKE_PID_BASE = 5_000_000
#: How often each leaf's lease is looked at.
LEASE_CHECK = 0.5
SIGNUMS = {name: int(getattr(signal, "SIG" + name)) for name in wire.SIGNALS}


class Skip:
    """Consumes exactly ``n`` bytes (the agent payload), then passes the rest on."""

    def __init__(self, n: int) -> None:
        self.left = n

    def feed(self, data: bytes) -> Optional[bytes]:
        """None while bytes are still to skip; else what followed them."""
        if self.left >= len(data):
            self.left -= len(data)
            return None if self.left or not data else b""
        rest = data[self.left:]
        self.left = 0
        return rest


class SynRank:
    """One synthetic rank: its coordinator connection and its life."""

    def __init__(self, leaf: Leaf, rank: int, pid: int, env: Dict[str, str]) -> None:
        self.leaf = leaf
        self.rank = rank
        self.pid = pid
        self.env = env
        self.running = True
        self.sock: Optional[socket.socket] = None
        self.buf = bytearray()
        self.out = bytearray()
        self.tx = 0
        self.rx = 0
        self.joined = False
        self.connecting = False
        self.attempt = 0
        self.config: Any = None
        self.deadline = 0.0
        self.join_t0: Optional[float] = None
        #: What the loop calls when its socket is ready (set by the emulator).
        self.ready: Optional[Callable[[int, int], None]] = None


class Leaf:
    """One emulated leaf agent (what a leaf's ssh would carry)."""

    def __init__(self, lid: int, payload_bytes: int) -> None:
        self.id = lid
        self.skip: Optional[Skip] = Skip(payload_bytes)
        self.reader = wire.Reader(wire.DOWN_TYPES)
        self.pending_in = b""  # DATA that came before the payload was complete
        self.spec: Optional[Dict[str, Any]] = None
        self.ranks: Dict[int, SynRank] = {}
        self.started = False
        self.stopping = False
        self.input_open = True
        self.finished = False  # DONE sent: the agent (and its ssh) exit
        self.status: Optional[int] = None  # the "ssh"'s exit status, once ended
        self.killed = False  # KILL'ed from the launcher: CLOSED at once, nothing more
        self.lease: Optional[float] = None
        self.last_input = time.monotonic()
        self.last_sent = 0.0
        self.suspended = False
        self.hello_sent = False
        #: The address this leaf's ranks dial from (a host of its own, on loopback).
        self.source: Optional[str] = None


class Emulator(RelayLoop):
    """The emulated relay: the real relay's loop, with emulated leaves."""

    INPUT_ERRORS = RelayLoop.INPUT_ERRORS + (wire.ProtocolError,)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(0, 1)
        self.args = args
        self.skip: Optional[Skip] = Skip(args.payload_bytes)
        self.leaves: Dict[int, Leaf] = {}
        self.timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._pids = FAKE_PID_BASE + (os.getpid() % 1000) * 1000
        self._checks_cache: Dict[str, Dict[str, str]] = {}
        self.give_up_at: Optional[float] = None
        self.blob: Optional[bytes] = None
        #: For the benchmark (``--stats``): each rank's join time (first dial to welcome),
        #: dials, ``retry`` rejects, welcome bytes, ranks that gave up.
        self.stats: Dict[str, Any] = {"join_s": [], "dials": 0, "retry_rejects": 0,
                                      "welcome_bytes": 0, "failed": 0, "lost_before_welcome": 0}
        self.whole({mux.BLOB: self._on_blob, mux.OPEN: self._on_open})
        self.per_leaf({mux.DATA: self._to_leaf, mux.PAYLOAD: self._on_payload,
                       mux.EOF: lambda leaf, rest: self._leaf_eof(leaf),
                       mux.KILL: lambda leaf, rest: self._leaf_killed(leaf)})
        #: What an emulated leaf agent does with each frame from the launcher.
        self.agent_handlers: Dict[int, Callable[[Leaf, bytes], None]] = {
            wire.SPEC: lambda leaf, body: self._on_spec(leaf, wire.parse_json(body)),
            wire.PROBE: lambda leaf, body: self.send(
                leaf, wire.FACTS, {"gpus": None, "gpu_error": "emulated leaf"}),
            wire.START: lambda leaf, body: self._spawn_all(leaf),
            wire.SIGNAL: self._on_agent_signal, wire.STOP: self._on_agent_stop,
            wire.KILL: self._on_agent_kill, wire.SWEEP: self._on_agent_sweep,
            wire.PING: lambda leaf, body: self._agent_beat(leaf),
            wire.SUSPEND: lambda leaf, body: setattr(leaf, "suspended", True),
            wire.RESUME: lambda leaf, body: setattr(leaf, "suspended", False),
            wire.STACKS: self._on_agent_stacks,
            wire.LIST: lambda leaf, body: self.send(leaf, wire.RUNS, {"runs": [], "errors": []}),
        }

    # -- timers ----------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (when, self._seq, fn))

    def _run_timers(self, now: float) -> None:
        while self.timers and self.timers[0][0] <= now:
            _, _, fn = heapq.heappop(self.timers)
            fn()

    def new_pid(self) -> int:
        self._pids += 1
        return self._pids

    # -- the relay loop's hooks --------------------------------------------------------------
    def run(self) -> int:
        code = super().run()
        if self.args.stats:
            with contextlib.suppress(OSError), \
                    open(f"{self.args.stats}-{os.getpid()}.json", "w") as f:
                json.dump(self.stats, f)
        return code

    def hello(self) -> None:
        super().hello()
        self.at(time.monotonic() + LEASE_CHECK, self._check_leases)

    def prepare(self) -> None:
        self.want_output()

    def deadlines(self) -> List[float]:
        return [t for t in (self.timers[0][0] if self.timers else None, self.flush_due(),
                            self.give_up_at) if t is not None]

    def after(self, now: float) -> None:
        self._run_timers(now)
        if self.give_up_at is not None and now >= self.give_up_at:
            for leaf in list(self.leaves.values()):
                self._drop(leaf)
        self.flush(now)
        self._close_finished()

    def frames(self, data: bytes) -> List[Tuple[int, bytes]]:
        """The agent payload the launcher writes first is skipped, then the mux."""
        if self.skip is not None:
            rest = self.skip.feed(data)
            if rest is None:
                return []
            self.skip = None
            data = rest
        return self.reader.feed(data)

    def open_leaf(self, lid: int) -> Optional[Leaf]:
        leaf = self.leaves.get(lid)
        return None if leaf is None or leaf.status is not None else leaf

    def let_go(self, now: float) -> None:
        for leaf in list(self.leaves.values()):
            self._leaf_eof(leaf)
        self.give_up_at = now + relay.DRAIN_BOUND

    # -- from the launcher -----------------------------------------------------------------
    def _on_blob(self, body: bytes) -> None:
        self.blob = body

    def _on_open(self, body: bytes) -> None:
        lid, rest = mux.parse_leaf(body)
        if lid in self.leaves:
            raise mux.MuxError(f"leaf {lid} is already open")
        mux.parse_json(rest)["argv"]  # never run: the leaf is emulated
        if not self.upstream:
            return
        self.leaves[lid] = Leaf(lid, self.args.payload_bytes)
        self.batch.open(lid)

    def _on_payload(self, leaf: Leaf, rest: bytes) -> None:
        if self.blob is None:
            raise mux.MuxError("PAYLOAD before any BLOB")
        self._to_leaf(leaf, self.blob)

    # -- to the launcher -------------------------------------------------------------------
    def _close_finished(self) -> None:
        for leaf in [x for x in self.leaves.values()
                     if x.status is not None and not self.batch.backlog(x.id)]:
            self._drop(leaf)

    def _drop(self, leaf: Leaf) -> None:
        self.forget(leaf.id)
        for r in leaf.ranks.values():
            self._close_rank(r)
        self.report_closed(leaf.id,
                           leaf.status if leaf.status is not None else -int(signal.SIGKILL))

    # -- one leaf agent --------------------------------------------------------------------
    def send(self, leaf: Leaf, kind: int, obj: Optional[Dict[str, Any]] = None,
             raw: Optional[bytes] = None) -> None:
        if leaf.status is not None or not self.output_open:
            return
        now = time.monotonic()
        self.batch.add(leaf.id, mux.STDOUT, raw if raw is not None else wire.message(kind, obj),
                       now)
        leaf.last_sent = now

    def _to_leaf(self, leaf: Leaf, data: bytes) -> None:
        if not leaf.input_open:
            return
        leaf.last_input = time.monotonic()
        if leaf.skip is not None:
            rest = leaf.skip.feed(data)
            if rest is None:
                return
            leaf.skip = None
            self._agent_hello(leaf)
            data = rest
        try:
            for kind, body in leaf.reader.feed(data):
                handler = self.agent_handlers.get(kind)
                if handler is not None:
                    handler(leaf, body)
        except wire.ProtocolError as exc:
            self.send(leaf, wire.ERROR, {"message": f"protocol error from the launcher: {exc}",
                                         "rank": None})
            leaf.input_open = False
            self._leash(leaf, signal.SIGTERM)

    def _agent_hello(self, leaf: Leaf) -> None:
        uname = os.uname()
        self.send(leaf, 0, raw=wire.HANDSHAKE + wire.message(wire.HELLO, {
            "version": wire.VERSION, "pid": self.new_pid(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "system": uname.sysname, "machine": uname.machine}))
        leaf.hello_sent = True


    def _on_agent_signal(self, leaf: Leaf, body: bytes) -> None:
        obj = wire.parse_json(body)
        name = obj.get("signal")
        if name not in wire.SIGNALS:
            raise wire.ProtocolError(f"cannot forward signal {name!r}")
        self._signal(leaf, SIGNUMS[str(name)], obj.get("rank"))

    def _on_agent_stop(self, leaf: Leaf, body: bytes) -> None:
        obj = wire.parse_json(body) if body else {}
        name = obj.get("signal") or "TERM"
        if name not in ("TERM", "INT"):
            raise wire.ProtocolError(f"cannot stop with signal {name!r}")
        if obj.get("rank") is None:
            self._leash(leaf, SIGNUMS[str(name)])
        else:
            self._signal(leaf, int(signal.SIGTERM), obj.get("rank"))

    def _on_agent_kill(self, leaf: Leaf, body: bytes) -> None:
        leaf.stopping = True
        self._signal(leaf, int(signal.SIGKILL), None)

    def _on_agent_sweep(self, leaf: Leaf, body: bytes) -> None:
        self.send(leaf, wire.SWEPT, _empty_sweep())
        self._finish(leaf)

    def _agent_beat(self, leaf: Leaf) -> None:
        if time.monotonic() - leaf.last_sent >= wire.HEARTBEAT_INTERVAL:
            self.send(leaf, wire.HEARTBEAT)

    def _on_agent_stacks(self, leaf: Leaf, body: bytes) -> None:
        req = wire.parse_json(body)
        self.send(leaf, wire.STACKS_REPORT, {"id": req.get("id"), "run": req.get("run"),
                                             "ranks": {}, "error": "emulated leaf"})


    def _on_spec(self, leaf: Leaf, spec: Dict[str, Any]) -> None:
        if leaf.spec is not None:
            raise wire.ProtocolError("a second spec")
        if spec.get("version") != wire.VERSION:
            raise wire.ProtocolError(f"spec version {spec.get('version')!r}")
        for key in ("run_id", "cluster", "host", "cwd", "argv", "env", "ranks", "kill_grace"):
            if key not in spec:
                raise wire.ProtocolError(f"spec lacks {key!r}")
        leaf.spec = spec
        leaf.source = _source_address(str(spec["host"]))
        if spec.get("lease"):
            leaf.lease = max(float(spec["lease"]), wire.LEASE_MIN)
        if spec.get("checks"):
            self.send(leaf, wire.PREFLIGHT, {"values": self._preflight(spec)})
        if spec.get("cluster"):
            self.send(leaf, wire.SWEPT, _empty_sweep())
        if spec.get("start_now"):
            self._spawn_all(leaf)

    def _preflight(self, spec: Dict[str, Any]) -> Dict[str, str]:
        """The agent's pre-flight values: the host facts gathered once per kind of spec
        (every emulated leaf is this machine), the coordinator dialled for each leaf."""
        wanted = dict(spec["checks"])
        dial = wanted.pop("dial", None)
        key = json.dumps(wanted, sort_keys=True)
        if key not in self._checks_cache:
            self._checks_cache[key] = checks.gather(wanted, b"\0" * 16, str(spec["run_id"]),
                                                    str(spec["host"]))
        values = dict(self._checks_cache[key])
        if dial:
            envelope = json.loads(bytes.fromhex(str(spec.get("envelope") or "7b7d")))
            salt = bytes.fromhex(str(envelope.get("salt", "00" * 16)))
            values["dial"] = checks.dial(str(dial["host"]), int(dial["port"]), salt,
                                         str(spec["run_id"]), str(spec["host"]))
        return values

    def _spawn_all(self, leaf: Leaf) -> None:
        spec = leaf.spec
        if spec is None:
            raise wire.ProtocolError("start before spec")
        if leaf.started or leaf.stopping:
            return
        leaf.started = True
        base = {str(k): str(v) for k, v in (spec.get("defaults") or {}).items()}
        base.update(spec["env"])
        if spec.get("envelope"):
            base[rk.ENV_CLUSTER_JSON] = str(spec["envelope"])
        now = time.monotonic()
        for entry in spec["ranks"]:
            env = dict(base)
            env.update(entry.get("env") or {})
            r = SynRank(leaf, int(entry["rank"]), self.new_pid(), env)
            leaf.ranks[r.rank] = r
            self.send(leaf, wire.SPAWNED, {"rank": r.rank, "pid": r.pid})
            self.send(leaf, 0, raw=wire.output(r.rank, wire.STDOUT,
                                               f"up {r.rank}\n".encode(), False))
            if self.args.join:
                self._start_join(r)
            self.at(now + self.args.work, functools.partial(self._rank_exit, r, 0, None))

    def _signal(self, leaf: Leaf, sig: int, rank: Optional[Any]) -> None:
        """A signal reaches the ranks' groups: a sleeping synthetic rank dies of it (the
        default action of every signal the launcher forwards)."""
        for r in list(leaf.ranks.values()):
            if r.running and (rank is None or rank == r.rank):
                self._rank_exit(r, None, sig)

    def _leash(self, leaf: Leaf, first: int) -> None:
        if leaf.stopping:
            return
        leaf.stopping = True
        self._signal(leaf, first, None)
        self._maybe_finish(leaf)

    def _leaf_eof(self, leaf: Leaf) -> None:
        """EOF on the leaf agent's stdin: its leash."""
        if not leaf.input_open or leaf.status is not None:
            return
        leaf.input_open = False
        self._leash(leaf, int(signal.SIGTERM))
        self._maybe_finish(leaf)

    def _leaf_killed(self, leaf: Leaf) -> None:
        """KILL: the leaf's ssh is SIGKILLed; its agent stops its ranks unheard."""
        for r in leaf.ranks.values():
            r.running = False
            self._close_rank(r)
        leaf.status = -int(signal.SIGKILL)
        self.batch.hurry()

    def _check_leases(self) -> None:
        now = time.monotonic()
        for leaf in list(self.leaves.values()):
            if leaf.lease is None or leaf.stopping or not leaf.input_open or leaf.suspended:
                continue
            if now >= leaf.last_input + leaf.lease:
                self.send(leaf, wire.ERROR, {"message": f"no word from the launcher for "
                                             f"{leaf.lease:g}s: stopping every rank",
                                             "rank": None})
                self._leash(leaf, int(signal.SIGTERM))
        self.at(now + LEASE_CHECK, self._check_leases)

    def _rank_exit(self, r: SynRank, code: Optional[int], sig: Optional[int]) -> None:
        if not r.running:
            return
        r.running = False
        if code == 0 and r.joined and r.sock is not None:
            self._rank_send(r, {"type": "exiting"})  # rank.py's atexit hook
        self._close_rank(r)
        leaf = r.leaf
        self.send(leaf, wire.EXITED, {"rank": r.rank, "code": code, "signal": sig})
        self._maybe_finish(leaf)

    def _maybe_finish(self, leaf: Leaf) -> None:
        if leaf.finished or leaf.status is not None:
            return
        if leaf.started:
            if any(r.running for r in leaf.ranks.values()):
                return
            self.send(leaf, wire.VERIFIED, {"stopped": [], "remaining": []})
            self._finish(leaf)
        elif leaf.stopping or not leaf.input_open:
            self._finish(leaf)

    def _finish(self, leaf: Leaf) -> None:
        """DONE, and the agent exits 0: its ssh ends (CLOSED after its last bytes)."""
        if leaf.finished:
            return
        self.send(leaf, wire.DONE)
        leaf.finished = True
        leaf.status = 0
        self.batch.hurry()

    # -- a synthetic rank and the coordinator ----------------------------------------------
    def _start_join(self, r: SynRank) -> None:
        try:
            r.config = _rank_config(r.env)
        except RuntimeError as exc:
            self.send(r.leaf, 0, raw=wire.output(r.rank, wire.STDERR,
                                                 f"{exc}\n".encode(), False))
            self._rank_exit(r, 1, None)
            return
        r.join_t0 = time.monotonic()
        r.deadline = r.join_t0 + 30.0 * r.config.scale  # rank.join's default
        self._dial(r)

    def _dial(self, r: SynRank) -> None:
        if not r.running:
            return
        if time.monotonic() > r.deadline:
            self.send(r.leaf, 0, raw=wire.output(
                r.rank, wire.STDERR, b"cluster rank: could not join the coordinator\n", False))
            self.stats["failed"] += 1
            self._rank_exit(r, 1, None)
            return
        cfg = r.config
        self.stats["dials"] += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if r.leaf.source and cfg.controller_host.startswith("127."):
            with contextlib.suppress(OSError):
                sock.bind((r.leaf.source, 0))
        err = sock.connect_ex((cfg.controller_host, cfg.controller_port))
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._redial_later(r)
            return
        r.sock, r.buf, r.out, r.tx, r.rx = sock, bytearray(), bytearray(), 0, 0
        r.connecting = True
        r.ready = r.ready or functools.partial(self._rank_ready, r)
        self.sel.register(sock, selectors.EVENT_WRITE, r.ready)

    def _redial_later(self, r: SynRank) -> None:
        delay = min(rk.CONNECT_RETRY, rk.RETRY_FIRST * 2 ** min(r.attempt, 16)) * \
            random.uniform(0.5, 1.0)
        r.attempt += 1
        self.at(time.monotonic() + delay, lambda: self._dial(r))

    def _close_rank(self, r: SynRank) -> None:
        sock, r.sock = r.sock, None
        r.joined = r.connecting = False
        if sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(sock)
            sock.close()

    def _rank_send(self, r: SynRank, message: Dict[str, Any]) -> None:
        assert r.sock is not None
        r.out += rk.encode_frame(r.config.salt, r.config.run_id, r.tx, message)
        r.tx += 1
        self._rank_flush(r)

    def _rank_flush(self, r: SynRank) -> None:
        sock = r.sock
        if sock is None:
            return
        while r.out:
            try:
                n = sock.send(r.out)
            except BlockingIOError:
                break
            except OSError:
                r.out.clear()
                self._rank_lost(r)
                return
            del r.out[:n]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if r.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            if self.sel.get_key(sock).events != events:
                self.sel.modify(sock, events, r.ready)

    def _rank_ready(self, r: SynRank, fd: int, events: int) -> None:
        self._rank_io(r, events)

    def _rank_io(self, r: SynRank, events: int) -> None:
        sock = r.sock
        if sock is None:
            return
        if r.connecting and events & selectors.EVENT_WRITE:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close_rank(r)
                self._redial_later(r)
                return
            r.connecting = False
            me = r.config.membership
            self._rank_send(r, {"type": "hello", "rank": me.rank, "host": me.host,
                                "pid": r.pid})
            return
        if events & selectors.EVENT_WRITE:
            self._rank_flush(r)
        if not events & selectors.EVENT_READ or r.sock is None:
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._rank_lost(r)
            return
        r.buf += data
        cfg = r.config
        try:
            while True:
                got = rk.take_frame(r.buf)
                if got is None:
                    break
                tag, payload = got
                if not r.joined:
                    self.stats["welcome_bytes"] += len(payload) + 36
                if not hmac.compare_digest(tag, rk.frame_tag(cfg.salt, cfg.run_id, r.rx, payload)):
                    raise rk.FrameError("bad tag")
                r.rx += 1
                self._rank_message(r, rk.decode_payload(payload))
                if r.sock is None:
                    return
        except rk.FrameError:
            self._rank_lost(r)

    def _rank_message(self, r: SynRank, msg: Dict[str, Any]) -> None:
        kind = msg["type"]
        if not r.joined:
            if kind == "welcome":
                r.joined = True
                if r.join_t0 is not None:
                    self.stats["join_s"].append(round(time.monotonic() - r.join_t0, 4))
                self.at(time.monotonic() + rk.HEARTBEAT_INTERVAL, lambda: self._beat(r))
            elif kind == "reject" and msg.get("retry") is True:
                self.stats["retry_rejects"] += 1
                self._close_rank(r)
                self._redial_later(r)
            else:
                self.send(r.leaf, 0, raw=wire.output(
                    r.rank, wire.STDERR, f"cluster rank: the coordinator rejected rank "
                    f"{r.rank}: {msg.get('reason')}\n".encode(), False))
                self.stats["failed"] += 1
                self._close_rank(r)
                self._rank_exit(r, 1, None)
            return
        if kind == "shutdown":
            self._rank_send(r, {"type": "ack_shutdown"})

    def _rank_lost(self, r: SynRank) -> None:
        """The connection broke: before the welcome (a reset under a flood) dial again;
        after it, the rank has lost its coordinator (and sleeps on)."""
        was_joined = r.joined
        self._close_rank(r)
        if not was_joined and r.running:
            self.stats["lost_before_welcome"] += 1
            self._redial_later(r)

    def _beat(self, r: SynRank) -> None:
        if not r.running or not r.joined or r.sock is None:
            return
        self._rank_send(r, {"type": "heartbeat", "progress": 0})
        self.at(time.monotonic() + rk.HEARTBEAT_INTERVAL, lambda: self._beat(r))


def _source_address(host: str) -> str:
    """A loopback address of the leaf's own (127.240.0.1-127.255.255.254, from its name):
    its ranks reach the coordinator from one address per host, as real leaves do, so the
    coordinator's per-address limits see what they would see."""
    h = int.from_bytes(hashlib.sha256(host.encode()).digest()[:4], "big")
    return f"127.{240 + (h >> 28)}.{(h >> 16) & 255}.{1 + (h & 0xffff) % 254}"


def _empty_sweep() -> Dict[str, Any]:
    return {"stopped": [], "leftovers": [], "stale": 0, "errors": [], "live": []}


_RANK_VARS = (rk.ENV_CLUSTER_JSON, rk.ENV_RANK, rk.ENV_LOCAL_RANK, rk.ENV_NET_TIMEOUT_SCALE)


def _rank_config(env: Dict[str, str]) -> Any:
    """`rank._read_config` on the environment a rank would get (set here for the call)."""
    saved = {k: os.environ.get(k) for k in _RANK_VARS}
    try:
        for k in _RANK_VARS:
            if k in env:
                os.environ[k] = env[k]
            else:
                os.environ.pop(k, None)
        return rk._read_config()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--payload-bytes", type=int, required=True,
                    help="length of the agent payload the launcher writes first")
    ap.add_argument("--work", type=float, default=40.0,
                    help="seconds each synthetic rank runs before it exits 0 (40)")
    ap.add_argument("--no-join", dest="join", action="store_false",
                    help="synthetic ranks do not join the coordinator")
    ap.add_argument("--stats", metavar="PREFIX",
                    help="write the join figures to PREFIX-<pid>.json at exit")
    args = ap.parse_args(argv)
    return Emulator(args).run()


if __name__ == "__main__":
    sys.exit(main())
