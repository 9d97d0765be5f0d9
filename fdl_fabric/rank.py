"""The rank side of the coordinator protocol: join the cohort, heartbeat, hear verdicts.

A training program launched by fdl-fabric calls `join()` once. From then on the
launcher's coordinator knows the rank is alive (a heartbeat every second), tells it
which ranks survive (`survivors()`), and can ask it to save and stop (`should_stop()`,
`on_shutdown()`). A program that never calls `join()` keeps kill-all, the safe default.
A rank started by an agent reaches the coordinator through that agent's Unix socket;
one started by hand, through the coordinator's TCP port (docs/protocol.md).

Standalone on purpose: standard library only (and light to import), Python 3.8+, no
imports from fdl_fabric: it can be copied next to a training script, and the agent ships
it. It is the one implementation of the coordinator's framing (docs/protocol.md), which
the coordinator and the agent import from here.

One client per process, in module state: a reader thread and a heartbeat thread. On a
clean interpreter exit an atexit hook announces ``exiting``, so the rank is never
counted dead; an uncaught exception or ``sys.exit(n)`` with n != 0 skips it, but a bare
``raise SystemExit(n)`` cannot be seen from atexit: call `exiting()` when that matters.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
import threading
import time
from collections import namedtuple

# Each rank's start pays for these: `typing`, `dataclasses` and `traceback` were 30 of 55 ms
# (issue 35). Types are for mypy only; `random` is `os.urandom`.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

# -- environment variable names: the one list (the launcher and the agent import it) -------
#: The envelope (hex JSON, with the salt): the coordinator's address, run id, world.
ENV_CLUSTER_JSON = "FLODL_INTERNAL_CLUSTER_JSON"
ENV_LOCAL_RANK = "FLODL_INTERNAL_LOCAL_RANK"
ENV_RANK = "RANK"
ENV_NET_TIMEOUT_SCALE = "FLODL_NET_TIMEOUT_SCALE"
#: The run's id: what makes a process part of the run for the agent and cleanup.
ENV_RUN_ID = "FLODL_INTERNAL_RUN_ID"
#: A stable id of the cluster file, so a launch finds its predecessors' leftovers.
ENV_CLUSTER_KEY = "FLODL_INTERNAL_CLUSTER_KEY"
#: The host's name in the cluster file (overridable, as flodl's).
ENV_HOST_NAME = "FLODL_HOST_NAME"
ENV_VERBOSITY = "FLODL_VERBOSITY"
#: torchrun's per-rank error file, which torch's ``@record`` writes.
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: The Unix socket of the agent that started this rank: `join` dials it, not the TCP port.
ENV_AGENT_SOCKET = "FLODL_INTERNAL_AGENT_SOCKET"

#: The rank protocol's version, in every hello (``lib``): an agent of another refuses it.
PROTOCOL = 1

#: Seconds between heartbeats. Not scaled: the coordinator's timeout is what scales.
HEARTBEAT_INTERVAL = 1.0
#: Pauses between dials (not up yet, or a flood) start at the first (with jitter:
#: 50-100 %) and double up to the second.
RETRY_FIRST, CONNECT_RETRY = 0.05, 0.5
#: Socket timeout after the handshake: bounds a stalled write, paces the reader loop.
SOCKET_TIMEOUT = 5.0
#: The `on_shutdown` reason when the connection to the coordinator is gone.
LOST_REASON = "lost the coordinator"
TAG_BYTES = 32
MAX_FRAME = 1 << 20
#: Largest frame before a verified hello (a hello is ~100 bytes): a stranger holds little.
PRE_AUTH_FRAME = 4096
_LENGTH = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


if TYPE_CHECKING:
    class Membership(NamedTuple):
        rank: int
        world_size: int
        local_rank: int
        device: Optional[int]
        host: str
else:  # the same record, from `collections` (which `json` imports already)
    Membership = namedtuple("Membership", "rank world_size local_rank device host")
    Membership.__doc__ = "Who this process is in the cohort: a named tuple (``me.rank``)."


# -- framing: the one implementation (fdl_fabric.coordinator imports it) ---------------------
class FrameError(Exception):
    """A frame broke the protocol; the connection that carried it cannot be trusted."""


def frame_tag(salt: bytes, run_id: str, seq: int, payload: bytes) -> bytes:
    """HMAC-SHA256 over run id, NUL, 8-byte sequence number and payload.

    The run id and salt make frames of another run fail; the sequence number
    makes a replayed or reordered frame fail on the same connection.
    """
    msg = run_id.encode("utf-8") + b"\0" + _SEQ.pack(seq) + payload
    return hmac.new(salt, msg, hashlib.sha256).digest()


def encode_frame(salt: bytes, run_id: str, seq: int, message: Dict[str, Any]) -> bytes:
    """One complete frame: length prefix, tag, compact UTF-8 JSON payload."""
    payload = json.dumps(dict(message), separators=(",", ":"),
                         ensure_ascii=False).encode("utf-8")
    body = frame_tag(salt, run_id, seq, payload) + payload
    if len(body) > MAX_FRAME:
        raise ValueError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LENGTH.pack(len(body)) + body


def take_frame(buf: bytearray, limit: int = MAX_FRAME) -> Optional[Tuple[bytes, bytes]]:
    """Pop one ``(tag, payload)`` off the front of ``buf``; None while incomplete. The
    length is checked as soon as its 4 bytes are in: an oversize frame is refused unread."""
    if len(buf) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(buf)
    if length > limit:
        raise FrameError(f"frame too large ({length} bytes, limit {limit})")
    if length < TAG_BYTES:
        raise FrameError(f"frame too short ({length} bytes)")
    end = _LENGTH.size + length
    if len(buf) < end:
        return None
    tag = bytes(buf[_LENGTH.size:_LENGTH.size + TAG_BYTES])
    payload = bytes(buf[_LENGTH.size + TAG_BYTES:end])
    del buf[:end]
    return tag, payload


def decode_payload(payload: bytes) -> Dict[str, Any]:
    """A payload must be a JSON object with a string ``type``."""
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("payload is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise FrameError("payload is not a JSON object")
    if not isinstance(obj.get("type"), str):
        raise FrameError("payload has no string 'type'")
    return obj


def receive(sock: socket.socket, buf: bytearray, salt: bytes, run_id: str,
            seq: int) -> Optional[Dict[str, Any]]:
    """Block for one verified frame; None at end of stream. ``buf`` keeps partial frames."""
    while True:
        frame = take_frame(buf)
        if frame is not None:
            tag, payload = frame
            if not hmac.compare_digest(tag, frame_tag(salt, run_id, seq, payload)):
                raise FrameError("bad tag")
            return decode_payload(payload)
        data = sock.recv(65536)
        if not data:
            return None
        buf += data


# -- environment -------------------------------------------------------------------------------
class _Config:
    def __init__(self, run_id: str, salt: bytes, controller_host: str, controller_port: int,
                 membership: Membership, scale: float) -> None:
        self.run_id, self.salt, self.membership, self.scale = run_id, salt, membership, scale
        self.controller_host, self.controller_port = controller_host, controller_port


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"cluster rank: {name}={raw!r} is not an integer") from None


def _read_config() -> _Config:
    """Parse the slim envelope and the rank variables; every error names its variable."""
    raw = os.environ.get(ENV_CLUSTER_JSON, "").strip()
    if not raw:
        raise RuntimeError(f"cluster rank: {ENV_CLUSTER_JSON} is not set — was this program "
                           "started by the cluster launcher?")
    try:
        env = json.loads(bytes.fromhex(raw).decode("utf-8"))
        controller, worker = env["controller"], env["worker"]
        run_id = str(env.get("run_id", ""))
        salt = bytes.fromhex(str(env.get("salt", "00" * 16)))
        host, port = str(controller["host"]), int(controller["port"])
        world_size = int(env["world_size"])
        worker_host = str(worker["host"])
        ranks = [int(r) for r in worker["ranks"]]
        devices = worker.get("local_devices")
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise RuntimeError(f"cluster rank: {ENV_CLUSTER_JSON} is not a valid envelope: "
                           f"{exc!r}") from None
    rank, local_rank = _rank_of(ranks, world_size, worker_host)
    device: Optional[int] = None
    if isinstance(devices, list) and local_rank < len(devices):
        device = int(devices[local_rank])
    scale = _net_timeout_scale()
    member = Membership(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                        host=worker_host)
    return _Config(run_id, salt, host, port, member, scale)


def _rank_of(ranks: List[int], world_size: int, worker_host: str) -> Tuple[int, int]:
    """This rank and local rank, from `ENV_RANK` and `ENV_LOCAL_RANK` (either one found
    from the other through the worker's ``ranks``), each checked against its range."""
    rank, local_rank = _env_int(ENV_RANK), _env_int(ENV_LOCAL_RANK)
    if local_rank is None and rank is not None and rank in ranks:
        local_rank = ranks.index(rank)
    if local_rank is None:
        raise RuntimeError(f"cluster rank: {ENV_LOCAL_RANK} is not set")
    if not 0 <= local_rank < len(ranks):
        raise RuntimeError(f"cluster rank: {ENV_LOCAL_RANK}={local_rank} is out of range "
                           f"0..{len(ranks) - 1} for worker {worker_host!r}")
    if rank is None:
        rank = ranks[local_rank]
    if not 0 <= rank < world_size:
        raise RuntimeError(f"cluster rank: {ENV_RANK}={rank} is out of range "
                           f"0..{world_size - 1}")
    return rank, local_rank


def _net_timeout_scale() -> float:
    raw_scale = os.environ.get(ENV_NET_TIMEOUT_SCALE, "").strip() or "1"
    try:
        scale = float(raw_scale)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise RuntimeError(f"cluster rank: {ENV_NET_TIMEOUT_SCALE}={raw_scale!r} must be a "
                           "positive number")
    return scale


# -- the client --------------------------------------------------------------------------------
class _Client:
    """A joined rank's connection: reader and heartbeat threads, stop state, callbacks."""

    def __init__(self, sock: socket.socket, buf: bytearray, config: _Config,
                 members: List[int]) -> None:
        self.sock = sock
        self.buf = buf
        self.config = config
        self.membership = config.membership
        self.members = members
        self.tx_seq = self.rx_seq = 1  # the hello and the welcome were 0
        self.send_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.closed = threading.Event()
        self.stop_reason: Optional[str] = None
        self.callbacks: List[Callable[[str], None]] = []
        #: Calls of `progress()` so far, and the last step it was given.
        self.progress = 0
        self.step: Optional[int] = None

    def start(self) -> None:
        self.sock.settimeout(SOCKET_TIMEOUT)
        for target, name in ((self._read_loop, "fdl-rank-reader"),
                             (self._heartbeat_loop, "fdl-rank-heartbeat")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def send(self, message: Dict[str, Any], *, last: bool = False) -> bool:
        """Send one frame; a failure wakes the reader, which reports the loss. ``last``:
        then close, without reporting a loss (a clean exit)."""
        with self.send_lock:
            if self.closed.is_set():
                return False
            frame = encode_frame(self.config.salt, self.config.run_id, self.tx_seq, message)
            self.tx_seq += 1
            try:
                self.sock.sendall(frame)
                sent = True
            except OSError:
                sent = False
            if last:
                self.closed.set()
            if last or not sent:
                self._wake_reader()
            return sent

    def exiting(self) -> None:
        """Announce a clean exit, then close without reporting a loss."""
        self.send({"type": "exiting"}, last=True)

    def on_shutdown(self, callback: Callable[[str], None]) -> None:
        with self.state_lock:
            reason = self.stop_reason
            if reason is None:
                self.callbacks.append(callback)
                return
        _call(callback, reason)  # registered after the fact: call it now, once

    def _stop(self, reason: str) -> None:
        with self.state_lock:
            if self.stop_reason is not None:
                return
            self.stop_reason = reason
            callbacks = list(self.callbacks)
        for callback in callbacks:
            _call(callback, reason)

    def _wake_reader(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _heartbeat_loop(self) -> None:
        while not self.closed.wait(HEARTBEAT_INTERVAL):
            beat: Dict[str, Any] = {"type": "heartbeat", "progress": self.progress}
            if self.step is not None:
                beat["step"] = self.step
            self.send(beat)

    def _read_loop(self) -> None:
        try:
            while not self.closed.is_set():
                try:
                    message = receive(self.sock, self.buf, self.config.salt, self.config.run_id,
                                    self.rx_seq)
                except socket.timeout:
                    continue
                except (OSError, FrameError):
                    return
                if message is None:
                    return
                self.rx_seq += 1
                self._on_message(message)
        finally:
            lost = not self.closed.is_set()
            self.closed.set()
            with contextlib.suppress(OSError):
                self.sock.close()
            if lost:
                self._stop(LOST_REASON)

    def _on_message(self, message: Dict[str, Any]) -> None:
        kind = message["type"]
        members = _members(self.membership.world_size, message)
        if members is not None:
            with self.state_lock:
                self.members = members
        if kind == "membership" and members is not None and self.membership.rank not in members:
            self._stop("declared dead by the coordinator")
        elif kind == "shutdown":
            self.send({"type": "ack_shutdown"})
            self._stop(str(message.get("reason", "shutdown")))


def _call(callback: Callable[[str], None], reason: str) -> None:
    """Run a user callback; its exception is printed, never allowed to kill our thread."""
    try:
        callback(reason)
    except Exception:  # noqa: BLE001 - anything a user's callback raises
        import traceback

        traceback.print_exc()


_lock = threading.Lock()
_client: Optional[_Client] = None
_exit_failed = False


def _pause(attempt: int, deadline: float) -> None:
    """Wait before dialing again: `RETRY_FIRST` doubling up to `CONNECT_RETRY`, with jitter
    (ranks turned away together do not come back together), never past the deadline."""
    jitter = 0.5 + os.urandom(1)[0] / 510  # 0.5-1.0, without importing `random`
    delay = min(CONNECT_RETRY, RETRY_FIRST * 2 ** min(attempt, 16)) * jitter
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))


def _connect(config: _Config, deadline: float, budget: float) -> socket.socket:
    """Dial until the coordinator answers (pausing as `_pause` says), until the deadline:
    through the rank's agent when it started this process (`ENV_AGENT_SOCKET`), else the
    coordinator's TCP port (a script started by hand with the rank environment)."""
    agent = os.environ.get(ENV_AGENT_SOCKET, "")
    where = agent or f"{config.controller_host}:{config.controller_port}"
    last: Optional[OSError] = None
    attempt = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"cluster rank: could not reach the coordinator at {where} "
                               f"within {budget:g}s: {last}")
        try:
            if agent:
                return _dial_agent(agent, min(remaining, SOCKET_TIMEOUT))
            return socket.create_connection((config.controller_host, config.controller_port),
                                            timeout=min(remaining, SOCKET_TIMEOUT))
        except OSError as exc:
            last = exc
        _pause(attempt, deadline)
        attempt += 1


def _dial_agent(path: str, timeout: float) -> socket.socket:
    """The agent's Unix socket (in a folder of this user's; the agent checks the caller)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        return sock
    except OSError:
        sock.close()
        raise


class _TurnedAway(Exception):
    """Refused for now (a reset, or a ``reject`` with ``retry`` under a flood): dial again."""


#: What a connection turned away before its hello meets (a reset, or a close that crossed
#: the hello): dial again. A plain close without a reply is not one: a wrong salt gets it.
_RETRY_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _handshake(config: _Config, deadline: float, budget: float) -> _Client:
    """Dial and say hello until welcomed or the deadline; a refusal or a reset (a flood of
    other connections) means dial again, after a short pause. A reject, a timeout or any
    other failure is a RuntimeError."""
    attempt = 0
    while True:
        sock = _connect(config, deadline, budget)
        try:
            return _greet(sock, config, deadline, budget)
        except _TurnedAway as exc:
            sock.close()
            turned_away = str(exc)
        _pause(attempt, deadline)
        attempt += 1
        if deadline - time.monotonic() <= 0:
            raise RuntimeError(f"cluster rank: rank {config.membership.rank}: the coordinator "
                               f"turned every connection away for {budget:g}s: {turned_away}")


def _greet(sock: socket.socket, config: _Config, deadline: float, budget: float) -> _Client:
    """Send hello on ``sock``, wait for welcome; `_TurnedAway` means dial again."""
    me = config.membership
    buf = bytearray()
    try:
        sock.settimeout(max(deadline - time.monotonic(), 1.0))
        hello = {"type": "hello", "rank": me.rank, "host": me.host, "pid": os.getpid(),
                 "lib": PROTOCOL}
        sock.sendall(encode_frame(config.salt, config.run_id, 0, hello))
        reply = receive(sock, buf, config.salt, config.run_id, 0)
    except socket.timeout:
        sock.close()
        raise RuntimeError(f"cluster rank: rank {me.rank}: the coordinator did not answer "
                           f"hello within {budget:g}s") from None
    except _RETRY_ERRORS as exc:
        raise _TurnedAway(str(exc)) from None
    except (OSError, FrameError) as exc:
        sock.close()
        raise RuntimeError(f"cluster rank: rank {me.rank}: handshake with the coordinator "
                           f"failed: {exc}") from None
    try:
        welcome = _welcome(reply, me)
    except RuntimeError:
        sock.close()
        raise
    members = _members(me.world_size, welcome)
    return _Client(sock, buf, config, list(range(me.world_size)) if members is None else members)


def _welcome(reply: Optional[Dict[str, Any]], me: Membership) -> Dict[str, Any]:
    """``reply`` if it welcomes this rank; `_TurnedAway` for a retry, else RuntimeError."""
    if reply is None:
        raise RuntimeError(f"cluster rank: rank {me.rank}: the coordinator closed the "
                           "connection during the handshake (salt or run id mismatch?)")
    if reply["type"] == "reject" and reply.get("retry") is True:
        raise _TurnedAway(str(reply.get("reason", "busy")))
    if reply["type"] == "reject":
        raise RuntimeError(f"cluster rank: the coordinator rejected rank {me.rank}: "
                           f"{reply.get('reason', 'no reason given')}")
    if reply["type"] != "welcome":
        raise RuntimeError(f"cluster rank: rank {me.rank}: expected welcome, got "
                           f"{reply['type']!r}")
    if reply.get("rank") != me.rank or reply.get("world_size") != me.world_size:
        raise RuntimeError(f"cluster rank: the coordinator welcomed rank {reply.get('rank')} of "
                           f"{reply.get('world_size')}, expected rank {me.rank} of "
                           f"{me.world_size}")
    return reply


def _members(world_size: int, message: Dict[str, Any]) -> Optional[List[int]]:
    """The live ranks a coordinator message implies: every rank but its ``dead`` list (the
    message carries the deaths, not the members, so a welcome costs O(deaths), not
    O(world size): 8,192 welcomes of 8,192 members would be 330 MB). None without a valid
    ``dead`` list."""
    dead = message.get("dead")
    if not isinstance(dead, list) or not all(isinstance(r, int) for r in dead):
        return None
    gone = set(dead)
    return [r for r in range(world_size) if r not in gone]


def join(timeout: float = 30.0) -> Membership:
    """Join the cohort; returns who this process is. Idempotent within a process.

    ``timeout`` (scaled by FLODL_NET_TIMEOUT_SCALE) bounds dialing plus the handshake;
    a refused or reset connection (a flood on the port) is dialed again, after 25 ms
    doubling up to 0.5 s. RuntimeError on a reject, a timeout or a bad environment.
    """
    global _client
    with _lock:
        if _client is not None:
            return _client.membership
        config = _read_config()
        budget = timeout * config.scale
        client = _handshake(config, time.monotonic() + budget, budget)
        client.start()
        _client = client
        _install_exit_hooks()
        return client.membership


def should_stop() -> bool:
    """True after a save-and-shutdown broadcast, or once the coordinator is lost."""
    client = _client
    return client is not None and client.stop_reason is not None


def on_shutdown(callback: Callable[[str], None]) -> None:
    """Call ``callback(reason)`` once when the run must stop (from the reader thread);
    at once if it already did. Before `join()` it raises: nothing could ever call it."""
    client = _client
    if client is None:
        raise RuntimeError("cluster rank: on_shutdown() needs join() first")
    client.on_shutdown(callback)


def survivors() -> List[int]:
    """The live members of the cohort ([] before `join()`)."""
    client = _client
    if client is None:
        return []
    with client.state_lock:
        return list(client.members)


def progress(step: Optional[int] = None) -> None:
    """Say that this rank is making progress (and at which ``step``, if given).

    The launcher calls a run *hung* when, for ``hang_timeout`` seconds, no rank wrote a
    line and no joined rank reported progress; a script that is quiet for long stretches
    (no output per step) calls this once per step. The next heartbeat carries it (within
    a second): a call costs an integer increment. No-op before `join()`.
    """
    client = _client
    if client is None:
        return
    client.progress += 1
    if step is not None:
        client.step = int(step)


def exiting() -> None:
    """Announce a clean exit now and close the connection (no-op before `join()`)."""
    client = _client
    if client is not None:
        client.exiting()


def is_launched() -> bool:
    """True when this process was started by the cluster launcher."""
    return bool(os.environ.get(ENV_CLUSTER_JSON, "").strip())


# -- clean-exit detection ----------------------------------------------------------------------
def _install_exit_hooks() -> None:
    """Note failing exits so the atexit hook does not announce them as clean."""
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(kind: Any, value: Any, tb: Any) -> None:
        global _exit_failed
        _exit_failed = True
        previous_hook(kind, value, tb)

    def exit_(status: Any = None) -> None:
        global _exit_failed
        if not (status is None or (isinstance(status, int) and status == 0)):
            _exit_failed = True
        previous_exit(status)

    setattr(sys, "excepthook", excepthook)  # noqa: B010 - keeps mypy off typeshed's signature
    setattr(sys, "exit", exit_)  # noqa: B010
    atexit.register(_at_exit)


def _at_exit() -> None:
    if not _exit_failed and _client is not None:
        _client.exiting()
