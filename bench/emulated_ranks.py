"""The synthetic ranks of `emulated_relay`. By default (``--join agent``) each joins
through its emulated agent, as a rank started by a real agent does (issue 35,
docs/protocol.md "Which path a rank takes"): its hello goes up as a `wire.COHORT_UP`
frame on its leaf's stream with the fields the real relay forwards (type, rank, host,
pid, lib), the launcher's `wire.COHORT_DOWN` welcome comes back (the join time is from
the hello sent to the welcome read), broadcasts are answered as
`fdl_fabric.agent.cohortrelay` answers them (``ack_shutdown`` up), and one `wire.BEATS`
a leaf per its spec's ``beats_every`` carries every joined rank's ``[age, progress]``.
With ``--join tcp`` each joins the launcher's coordinator directly (the path of a rank
started by hand): a TCP connection from its leaf's own loopback address, ``hello``
with `fdl_fabric.rank`'s frames, ``welcome``, a heartbeat every
`rank.HEARTBEAT_INTERVAL`, ``exiting``, with rank.py's pauses between dials. A mixin of
the emulator's `RelayLoop`, on its selector and timers; standard library and
fdl_fabric's standalone modules only (``python3 -I -S``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import os
import random
import selectors
import socket
import time
from typing import Any, Dict

from fdl_fabric import rank as rk
from fdl_fabric.agent import cohortrelay, wire

SynRank = Any  # emulated_relay.SynRank (a synthetic rank's state), kept untyped here
Leaf = Any  # emulated_agents.Leaf


class SyntheticRanks:
    """Joining, heartbeats and the coordinator's messages, for every synthetic rank."""

    sel: Any
    args: Any
    stats: Dict[str, Any]
    #: Synthetic ranks welcomed so far (the benchmark waits for all of them).
    joined: int

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
        if self.args.join == "tcp":
            self._dial(r)
            return
        self._relay_hello(r)
        self.at(r.deadline, lambda: self._relay_overdue(r))

    # -- through the emulated agent (the default; a real launch's path) ----------------------
    def _relay_hello(self, r: SynRank) -> None:
        """The rank's hello, verified by its agent, goes up as the real relay sends it."""
        if not r.running or r.joined:
            return
        me = r.config.membership
        r.relayed, r.join_t0 = True, time.monotonic()
        self.stats["dials"] += 1
        self.stats["last_hello"] = max(self.stats["last_hello"] or 0.0, time.time())
        self.stats["first_hello"] = self.stats["first_hello"] or time.time()
        self.stats["hello_at"][r.rank] = round(time.time(), 4)
        self.send(r.leaf, wire.COHORT_UP, {"rank": r.rank, "msg": {
            "type": "hello", "rank": me.rank, "host": me.host, "pid": r.pid,
            "lib": rk.PROTOCOL}})

    def _relay_overdue(self, r: SynRank) -> None:
        if r.running and not r.joined:
            self.send(r.leaf, 0, raw=wire.output(
                r.rank, wire.STDERR, b"cluster rank: could not join the coordinator\n", False))
            self.stats["failed"] += 1
            self._rank_exit(r, 1, None)

    def _on_cohort_down(self, leaf: Leaf, body: bytes) -> None:
        """A `wire.COHORT_DOWN` frame, as `cohortrelay.CohortRelay.on_down` takes it."""
        rank, msg = wire.parse_cohort_down(wire.parse_json(body), leaf.ranks)
        if msg is None:
            assert rank is not None
            self._cohort_close(leaf, leaf.ranks[rank])
            return
        if rank is None:
            self._cohort_broadcast(leaf, msg["type"])
            return
        r = leaf.ranks[rank]
        if not r.relayed or not r.running:
            return
        if msg["type"] == "welcome" and not r.joined:
            self._cohort_welcome(leaf, r, len(body))
        elif msg["type"] == "reject" and not r.joined:
            self._cohort_reject(leaf, r, msg)
        elif msg["type"] == "shutdown":
            self._relay_ack(r)

    def _cohort_close(self, leaf: Leaf, r: SynRank) -> None:
        if r.refused:  # the close that follows a reject
            r.refused -= 1
        elif r.relayed:
            r.relayed = r.joined = False
            self.send(leaf, wire.COHORT_UP, {"rank": r.rank, "closed": "closed by the coordinator"})

    def _cohort_broadcast(self, leaf: Leaf, kind: str) -> None:
        if kind == "formed" and self.stats["formed_at"] is None:
            self.stats["formed_at"] = time.time()
            if self.args.stats:  # the benchmark's idle window waits for it
                with contextlib.suppress(OSError), \
                        open(f"{self.args.stats}-{os.getpid()}.formed", "w") as f:
                    f.write(repr(self.stats["formed_at"]))
        if kind == "shutdown":
            for r in leaf.ranks.values():
                self._relay_ack(r)

    def _cohort_welcome(self, leaf: Leaf, r: SynRank, size: int) -> None:
        r.joined, r.joined_at = True, time.monotonic()
        self.stats["welcome_bytes"] += size
        self.stats["join_s"].append(round(r.joined_at - (r.join_t0 or r.joined_at), 4))
        self.stats["last_welcome"] = time.time()
        self.stats["welcome_at"][r.rank] = round(self.stats["last_welcome"], 4)
        self.joined += 1
        if not leaf.beating:
            leaf.beating = True
            self.at(cohortrelay.next_beat_at(r.joined_at, _beat_every(leaf)),
                    lambda: self._leaf_beats(leaf))

    def _cohort_reject(self, leaf: Leaf, r: SynRank, msg: Dict[str, Any]) -> None:
        r.refused += 1
        r.relayed = False
        if msg.get("retry") is True:
            self.stats["retry_rejects"] += 1
            delay = min(rk.CONNECT_RETRY, rk.RETRY_FIRST * 2 ** min(r.attempt, 16)) * \
                random.uniform(0.5, 1.0)
            r.attempt += 1
            self.at(time.monotonic() + delay, lambda: self._relay_hello(r))
            return
        self.send(leaf, 0, raw=wire.output(
            r.rank, wire.STDERR, f"cluster rank: the coordinator rejected rank "
            f"{r.rank}: {msg.get('reason')}\n".encode(), False))
        self.stats["failed"] += 1
        self._rank_exit(r, 1, None)

    def _relay_ack(self, r: SynRank) -> None:
        if r.joined and r.running and not r.acked:
            r.acked = True
            self.send(r.leaf, wire.COHORT_UP, {"rank": r.rank, "msg": {"type": "ack_shutdown"}})

    def _leaf_beats(self, leaf: Leaf) -> None:
        """One `wire.BEATS` for the leaf every spec's ``beats_every``, as the real agent
        sends it: each joined rank's seconds since its last heartbeat (one a second from
        its welcome on) and its progress (0)."""
        now = time.monotonic()
        joined = [r for r in leaf.ranks.values() if r.joined and r.running]
        if not joined or leaf.status is not None:
            leaf.beating = False
            return
        self.send(leaf, wire.BEATS, {"ranks": {
            str(r.rank): [round((now - r.joined_at) % rk.HEARTBEAT_INTERVAL, 3), 0]
            for r in joined}})
        self.at(cohortrelay.next_beat_at(now, _beat_every(leaf)), lambda: self._leaf_beats(leaf))

    def _relay_exit(self, r: SynRank, code: Any) -> None:
        """The rank ends: ``exiting`` (rank.py's atexit hook) when it ends well, then its
        connection to the agent closes."""
        if not r.relayed:
            return
        if code == 0 and r.joined:
            self.send(r.leaf, wire.COHORT_UP, {"rank": r.rank, "msg": {"type": "exiting"}})
        self.send(r.leaf, wire.COHORT_UP, {"rank": r.rank,
                                           "closed": "the rank closed its connection"})
        r.relayed = r.joined = False

    # -- straight to the coordinator (``--join tcp``) ----------------------------------------

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
                self.joined += 1
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


def _beat_every(leaf: Leaf) -> float:
    """The seconds between a leaf's BEATS: its spec's, as `cohortrelay` reads it."""
    return cohortrelay.beats_every_of((leaf.spec or {}).get("beats_every"))
