"""The coordinator: membership, the ledger, and the wire protocol over real loopback sockets.

What a death means (tolerance, ``max_failure``, the verdict) is the policy's, in
test_policy.py.

Fake ranks here speak the protocol by hand (through the coordinator's own
framing helpers), so each test can break exactly one rule and check that only
that connection pays for it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fdl_fabric.causes import cause_data
from fdl_fabric.events import Event, EventBus, EventLog, Kind, Name, event
from fdl_fabric.rank import (
    MAX_FRAME,
    FrameError,
    decode_payload,
    encode_frame,
    frame_tag,
    take_frame,
)
from fdl_fabric.supervision.admission import (
    ACCEPT_PER_TURN,
    BUSY_REASON,
    HELLO_PROMPT,
    PENDING_PER_SOURCE,
    PRE_AUTH_FRAME,
    PendingPeers,
)
from fdl_fabric.supervision.cohort import DeadRanks
from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorError, CoordinatorSpec

SALT = bytes(range(16))
#: How the supervisor marks a rank that exited with status 1.
STATUS_1 = {"exit": {"code": 1, "signal": None, "lost": None}}
RUN = "20250101-000000-abcd1234"


def wait_for(predicate: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Poll ``predicate`` until true or ``timeout``; bounded so tests never hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class FakeRank:
    """A hand-driven rank connection: send frames (good or bad), read verified frames."""

    def __init__(self, port: int, *, salt: bytes = SALT, run_id: str = RUN) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=3.0)
        self.salt, self.run_id = salt, run_id
        self.tx = 0
        self.rx = 0
        self.buf = bytearray()
        self.sent: list[bytes] = []

    @property
    def local_port(self) -> int:
        return int(self.sock.getsockname()[1])

    def frame(self, message: dict[str, Any], seq: Optional[int] = None) -> bytes:
        data = encode_frame(self.salt, self.run_id, self.tx if seq is None else seq, message)
        if seq is None:
            self.tx += 1
        return data

    def send(self, message: dict[str, Any]) -> None:
        data = self.frame(message)
        self.sent.append(data)
        self.sock.sendall(data)

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, rank: int, host: str = "h0") -> dict[str, Any]:
        self.send({"type": "hello", "rank": rank, "host": host, "pid": 4242})
        return self.recv()

    def recv(self, timeout: float = 3.0) -> dict[str, Any]:
        self.sock.settimeout(timeout)
        while True:
            frame = take_frame(self.buf)
            if frame is not None:
                tag, payload = frame
                assert tag == frame_tag(self.salt, self.run_id, self.rx, payload)
                self.rx += 1
                return decode_payload(payload)
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("coordinator closed the connection")
            self.buf += data

    def recv_all(self, timeout: float = 0.3) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            while True:
                out.append(self.recv(timeout))
        except (socket.timeout, EOFError):
            return out

    def is_closed(self, timeout: float = 3.0) -> bool:
        """True when the coordinator closed our connection (EOF or reset) within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                return False
            except OSError:
                return True
            if not data:
                return True
            self.buf += data
        return False

    def close(self) -> None:
        self.sock.close()


class Harness:
    def __init__(self, coord: Coordinator, log: EventLog) -> None:
        self.coord, self.log = coord, log
        self.ranks: list[FakeRank] = []

    def rank(self, **kw: Any) -> FakeRank:
        fake = FakeRank(self.coord.port, **kw)
        self.ranks.append(fake)
        return fake

    def said(self, kind: Kind) -> list[tuple[Name, Optional[str], Optional[int], dict[str, Any]]]:
        """What the coordinator said of this kind: name, host, rank and data."""
        return [(e.name, e.host, e.rank, e.data) for e in self.log.of(kind)]


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def _make(world_size: int = 2, **kw: Any) -> Harness:
        spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=world_size,
                               bind_host="127.0.0.1", port=0, **kw)
        log = EventLog()
        coord = Coordinator(spec, EventBus(log))
        coord.start()
        harness = Harness(coord, log)
        made.append(harness)
        return harness

    yield _make
    for harness in made:
        for fake in harness.ranks:
            fake.close()
        harness.coord.stop()


def form(h: Harness, world_size: int) -> list[FakeRank]:
    fakes = [h.rank() for _ in range(world_size)]
    for r, fake in enumerate(fakes):
        assert fake.hello(r, host=f"h{r}")["type"] == "welcome"
    assert wait_for(lambda: h.coord.cohort_formed)
    for fake in fakes:
        assert fake.recv()["type"] == "formed"
    return fakes


# -- spec validation --------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "words"), [
    ("salt", b"short", "salt must be 16 bytes"),
    ("world_size", 0, "world_size must be an int >= 1"),
    ("run_id", "", "run_id must be a non-empty"),
    ("port", 70000, "port must be in 0..65535"),
    ("heartbeat_timeout", 0, "heartbeat_timeout must be a positive"),
    ("formation_timeout", -1.0, "formation_timeout must be a positive"),
])
def test_spec_rejects_bad_values_with_a_clear_message(field: str, value: Any, words: str) -> None:
    kw: dict[str, Any] = {"run_id": RUN, "salt": SALT, "world_size": 2,
                          "bind_host": "127.0.0.1", "port": 0, field: value}
    with pytest.raises(ValueError, match=words):
        CoordinatorSpec(**kw)


# -- the ledger -------------------------------------------------------------------------------
def test_dead_ranks_ledger_is_idempotent_and_ignores_out_of_range() -> None:
    ledger = DeadRanks(4)
    assert ledger.world_size == 4
    assert ledger.declare_dead(2) is True
    assert ledger.declare_dead(2) is False
    assert ledger.declare_dead(4) is False and ledger.declare_dead(-1) is False
    assert ledger.is_dead(2) and not ledger.is_dead(1) and not ledger.is_dead(9)
    assert ledger.dead_count() == 1 and ledger.ranks() == [2]


# -- framing ----------------------------------------------------------------------------------
@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=5),
       st.integers(min_value=0, max_value=2**64 - 1))
def test_a_frame_round_trips_and_is_bound_to_its_sequence(body: dict[str, Any], seq: int) -> None:
    message = {**body, "type": "heartbeat"}
    buf = bytearray(encode_frame(SALT, RUN, seq, message))
    frame = take_frame(buf)
    assert frame is not None and not buf
    tag, payload = frame
    assert tag == frame_tag(SALT, RUN, seq, payload)
    assert tag != frame_tag(SALT, RUN, (seq + 1) % 2**64, payload)
    assert tag != frame_tag(SALT, RUN + "x", seq, payload)
    assert decode_payload(payload) == message


def test_an_oversize_length_is_refused_before_its_body_arrives() -> None:
    with pytest.raises(FrameError, match="too large"):
        take_frame(bytearray(struct.pack(">I", MAX_FRAME + 1)))


# -- formation --------------------------------------------------------------------------------
def test_cohort_forms_when_every_rank_says_hello(make: Callable[..., Harness]) -> None:
    h = make(3)
    fakes = [h.rank() for _ in range(3)]
    first = fakes[0].hello(0, host="alpha")
    assert first == {"type": "welcome", "rank": 0, "world_size": 3, "dead": [],
                     "formed": False}
    assert fakes[1].hello(1, host="alpha")["formed"] is False
    assert not h.coord.cohort_formed
    assert fakes[2].hello(2, host="beta")["formed"] is True
    assert wait_for(lambda: h.coord.cohort_formed)
    for fake in fakes:
        assert fake.recv() == {"type": "formed", "dead": []}
    assert [(name, host, rank) for name, host, rank, _ in h.said(Kind.JOIN)] == [
        (Name.RANK_JOINED, "alpha", 0), (Name.RANK_JOINED, "alpha", 1),
        (Name.RANK_JOINED, "beta", 2)]
    assert h.said(Kind.FORMED) == [(Name.COHORT_FORMED, None, None, {"world_size": 3})]
    assert h.coord.joined == {0, 1, 2}
    assert h.coord.abort_reason() is None


def test_a_duplicate_rank_is_rejected_and_the_first_keeps_its_place(
        make: Callable[..., Harness]) -> None:
    h = make(2)
    first = h.rank()
    assert first.hello(0)["type"] == "welcome"
    dup = h.rank()
    assert dup.hello(0) == {"type": "reject", "reason": "rank 0 already joined"}
    assert dup.is_closed()
    assert h.said(Kind.WARNING) == [(Name.PEER_REJECTED, None, None, {
        "peer": f"127.0.0.1:{dup.local_port}", "reason": "rank 0 already joined", "refused": 1})]
    assert h.rank().hello(1)["type"] == "welcome"
    assert wait_for(lambda: h.coord.cohort_formed)


@pytest.mark.parametrize(("rank", "reason"), [
    (2, "rank 2 is out of range 0..1 (world size 2)"),
    (-1, "rank -1 is out of range 0..1 (world size 2)"),
    ("0", "rank must be an integer, got '0'"),
    (True, "rank must be an integer, got True"),
])
def test_a_rank_outside_the_world_is_rejected(
        make: Callable[..., Harness], rank: Any, reason: str) -> None:
    h = make(2)
    bad = h.rank()
    bad.send({"type": "hello", "rank": rank, "host": "h0", "pid": 1})
    assert bad.recv() == {"type": "reject", "reason": reason}
    assert bad.is_closed()
    assert len(h.log.of(Kind.WARNING)) == 1
    assert h.coord.joined == set()


def test_a_rank_declared_dead_cannot_join_again(make: Callable[..., Harness]) -> None:
    h = make(2)
    h.coord.mark_dead([1], STATUS_1)
    assert wait_for(lambda: h.coord.dead.is_dead(1))
    assert h.rank().hello(1) == {"type": "reject", "reason": "rank 1 was declared dead"}


# -- one bad connection never hurts the run ---------------------------------------------------
def _bad_tag(f: FakeRank) -> None:
    data = bytearray(f.frame({"type": "hello", "rank": 1, "host": "h", "pid": 1}))
    data[10] ^= 0xFF
    f.raw(bytes(data))


def _other_salt(f: FakeRank) -> None:
    f.salt = bytes(16)
    f.send({"type": "hello", "rank": 1, "host": "h", "pid": 1})


def _other_run(f: FakeRank) -> None:
    f.run_id = "another-run"
    f.send({"type": "hello", "rank": 1, "host": "h", "pid": 1})


def _replay(f: FakeRank) -> None:
    f.hello(1)
    f.raw(f.sent[0])


def _out_of_order(f: FakeRank) -> None:
    f.hello(1)
    f.raw(f.frame({"type": "heartbeat"}, seq=5))


def _oversize(f: FakeRank) -> None:
    f.raw(struct.pack(">I", 2 * MAX_FRAME))


def _short(f: FakeRank) -> None:
    f.raw(struct.pack(">I", 3) + b"abc")


def _frame_of(payload: bytes) -> Callable[[FakeRank], None]:
    def send(f: FakeRank) -> None:
        body = frame_tag(f.salt, f.run_id, 0, payload) + payload
        f.raw(struct.pack(">I", len(body)) + body)
    return send


def _unknown_type(f: FakeRank) -> None:
    f.hello(1)
    f.send({"type": "gossip"})


def _heartbeat_first(f: FakeRank) -> None:
    f.send({"type": "heartbeat"})


def _second_hello(f: FakeRank) -> None:
    f.hello(1)
    f.send({"type": "hello", "rank": 1, "host": "h", "pid": 1})


@pytest.mark.parametrize(("attack", "reason"), [
    (_bad_tag, "bad tag"),
    (_other_salt, "bad tag"),
    (_other_run, "bad tag"),
    (_replay, "replayed frame (sequence 0, expected 1)"),
    (_out_of_order, "out-of-order frame (sequence 5, expected 1)"),
    (_oversize, f"frame too large ({2 * MAX_FRAME} bytes, limit {PRE_AUTH_FRAME})"),
    (_short, "frame too short (3 bytes)"),
    (_frame_of(b"{not json"), "payload is not UTF-8 JSON"),
    (_frame_of(b"\xff\xfe"), "payload is not UTF-8 JSON"),
    (_frame_of(b"[1, 2]"), "payload is not a JSON object"),
    (_frame_of(b'{"rank": 1}'), "payload has no string 'type'"),
    (_unknown_type, "unknown message type 'gossip'"),
    (_heartbeat_first, "first frame must be hello, got 'heartbeat'"),
    (_second_hello, "second hello on one connection"),
], ids=lambda v: v.__name__.strip("_") if callable(v) else None)
def test_a_bad_connection_is_dropped_with_one_line_and_the_run_carries_on(
        make: Callable[..., Harness], attack: Callable[[FakeRank], None], reason: str) -> None:
    h = make(3)
    good = h.rank()
    assert good.hello(0)["type"] == "welcome"
    bad = h.rank()
    attack(bad)
    assert bad.is_closed()
    assert wait_for(lambda: len(h.log.of(Kind.WARNING)) >= 1)
    time.sleep(0.1)
    assert h.said(Kind.WARNING) == [(Name.PEER_DROPPED, None, None, {
        "peer": f"127.0.0.1:{bad.local_port}", "reason": reason, "refused": 1})]
    good.send({"type": "heartbeat"})
    for r in (1, 2):
        if r not in h.coord.joined:
            assert h.rank().hello(r)["type"] == "welcome"
    assert wait_for(lambda: h.coord.cohort_formed)
    assert good.recv()["type"] == "formed"
    assert h.coord.abort_reason() is None and h.coord.dead.dead_count() == 0


def test_a_connection_that_never_says_hello_is_dropped(make: Callable[..., Harness]) -> None:
    h = make(2, hello_timeout=0.2)
    idle = h.rank()
    assert idle.is_closed()
    assert h.said(Kind.WARNING) == [(Name.PEER_DROPPED, None, None, {
        "peer": f"127.0.0.1:{idle.local_port}", "reason": "no hello within 0.2s",
        "refused": 1})]


def test_connections_that_close_before_a_hello_are_said_once_then_counted(
        make: Callable[..., Harness]) -> None:
    """A flood that the coordinator keeps up with (none refused for the bound) still
    writes one record, not one per connection."""
    h = make(2)
    for _ in range(300):
        socket.create_connection(("127.0.0.1", h.coord.port)).close()
        time.sleep(0.001)
    h.rank().hello(0, host="h0")  # a frame after them all: every close was handled
    assert wait_for(lambda: 0 in h.coord.joined)
    closed = h.log.named(Name.PEER_CLOSED)
    assert len(closed) == 1 and closed[0].data["reason"] == "closed before its hello"
    h.coord.stop()
    counted = sum(e.data["refused"] for e in h.log.named(Name.PEERS_REFUSED))
    assert len(closed) + counted == 300


# -- formation timeout ------------------------------------------------------------------------
def test_formation_timeout_names_the_ranks_that_never_joined(
        make: Callable[..., Harness]) -> None:
    h = make(4, formation_timeout=0.3)
    h.rank().hello(0)
    h.rank().hello(1)
    assert wait_for(lambda: h.coord.abort_reason() is not None)
    assert h.coord.abort_reason() == event(Name.COHORT_NOT_FORMED, missing=[2, 3],
                                           formation_timeout=0.3)
    assert not h.coord.cohort_formed
    late = h.rank().hello(2)
    assert late == {"type": "reject",
                    "reason": "the cohort did not form in time; the run is being aborted"}
    assert not h.coord.cohort_formed


def test_without_any_hello_the_coordinator_stays_passive(make: Callable[..., Harness]) -> None:
    h = make(2, formation_timeout=0.1)
    time.sleep(0.4)
    assert h.coord.abort_reason() is None
    assert not h.coord.cohort_formed


# -- deaths -----------------------------------------------------------------------------------
def test_a_silent_rank_is_declared_dead_after_the_heartbeat_timeout(
        make: Callable[..., Harness]) -> None:
    h = make(2, heartbeat_timeout=0.5)
    alive, silent = form(h, 2)
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        alive.send({"type": "heartbeat", "step": 1})
        time.sleep(0.1)
    assert h.coord.dead.ranks() == [1]
    assert alive.recv() == {"type": "membership", "dead": [1]}
    assert silent.is_closed()
    [(name, _, rank, data)] = h.said(Kind.DEATH)
    assert (name, rank, data["alive"], data["world_size"]) == (Name.RANK_DECLARED_DEAD, 1, 1, 2)
    assert data["reason"]["heartbeat_timeout"] == 0.5 and data["reason"]["silent"] > 0.5


def test_a_rank_that_announced_exiting_is_never_declared_dead(
        make: Callable[..., Harness]) -> None:
    h = make(2, heartbeat_timeout=0.3)
    keeper, leaver = form(h, 2)
    leaver.send({"type": "exiting"})
    leaver.close()
    assert wait_for(lambda: h.coord.exited == {1})
    h.coord.mark_dead([1], STATUS_1)
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        keeper.send({"type": "heartbeat"})
        time.sleep(0.1)
    assert h.coord.dead.dead_count() == 0


def test_a_closed_connection_alone_is_not_a_death(make: Callable[..., Harness]) -> None:
    h = make(2, heartbeat_timeout=5.0)
    _, gone = form(h, 2)
    gone.close()
    assert wait_for(lambda: len(h.log.of(Kind.INFO)) == 1)
    time.sleep(0.2)
    assert h.coord.dead.dead_count() == 0
    [(name, host, rank, _)] = h.said(Kind.INFO)
    assert (name, host, rank) == (Name.RANK_CONNECTION_LOST, "h1", 1)


def test_mark_dead_is_idempotent(make: Callable[..., Harness]) -> None:
    h = make(3)
    fakes = form(h, 3)
    h.coord.mark_dead([2], STATUS_1)
    h.coord.mark_dead([2], STATUS_1)
    h.coord.mark_dead([2, 7], {"exit": {"code": None, "signal": 9, "lost": None}})
    assert wait_for(lambda: h.coord.dead.is_dead(2))
    time.sleep(0.2)
    assert h.said(Kind.DEATH) == [(Name.RANK_DECLARED_DEAD, "h2", 2, {
        "reason": STATUS_1, "alive": 2, "world_size": 3})]
    assert fakes[0].recv_all() == [{"type": "membership", "dead": [2]}]
    assert h.coord.shutdown_sent is None


def test_a_shutdown_is_broadcast_once_with_the_policy_reason(
        make: Callable[..., Harness]) -> None:
    h = make(4)
    fakes = form(h, 4)
    h.coord.mark_dead([1, 3], STATUS_1)
    assert wait_for(lambda: h.coord.dead.dead_count() == 2)
    assert h.coord.shutdown_sent is None
    reached = event(Name.MAX_FAILURE_REACHED, dead=2, world_size=4, limit=2)
    h.coord.broadcast_shutdown(reached)
    assert wait_for(lambda: h.coord.shutdown_sent is not None)
    h.coord.broadcast_shutdown(event(Name.ALL_RANKS_DEAD, dead=4, world_size=4))
    h.coord.mark_dead([2], STATUS_1)
    assert wait_for(lambda: h.coord.dead.dead_count() == 3)
    time.sleep(0.2)
    assert h.coord.shutdown_sent == "max_failure reached (2/4 dead, threshold 2)"
    assert h.said(Kind.SHUTDOWN) == [(Name.SHUTDOWN_BROADCAST, None, None, {
        "cause": cause_data(reached), "reason": "max_failure reached (2/4 dead, threshold 2)"})]
    received = fakes[0].recv_all()
    assert [m for m in received if m["type"] == "shutdown"] == [
        {"type": "shutdown", "reason": "max_failure reached (2/4 dead, threshold 2)",
         "save": True}]
    assert received[-1] == {"type": "membership", "dead": [1, 2, 3]}


def test_the_supervisor_is_told_once_when_the_cohort_cannot_form() -> None:
    told: list[Event] = []
    spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=2, bind_host="127.0.0.1",
                           port=0, formation_timeout=0.3)
    coord = Coordinator(spec, EventBus(), on_abort=told.append)
    coord.start()
    try:
        fake = FakeRank(coord.port)
        fake.hello(0)
        assert wait_for(lambda: bool(told))
        time.sleep(0.3)
        assert told == [event(Name.COHORT_NOT_FORMED, missing=[1], formation_timeout=0.3)]
        fake.close()
    finally:
        coord.stop()


# -- lifecycle --------------------------------------------------------------------------------
def test_a_bind_failure_names_the_address() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=1, bind_host="127.0.0.1",
                               port=port)
        with pytest.raises(CoordinatorError) as info:
            Coordinator(spec, EventBus()).start()
        assert str(info.value) == (f"cluster launcher: coordinator could not bind "
                                   f"127.0.0.1:{port}: [Errno 98] Address already in use")
    finally:
        taken.close()


def test_stop_closes_every_rank_and_is_idempotent(make: Callable[..., Harness]) -> None:
    h = make(1)
    [fake] = form(h, 1)
    h.coord.stop()
    assert fake.is_closed()
    h.coord.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", h.coord.port), timeout=1.0)


# -- hostile peers before authentication ---------------------------------------------------
def test_before_its_hello_a_peer_may_send_a_small_frame_only_after_it_the_full_size(
        make: Callable[..., Harness]) -> None:
    h = make()
    stranger = h.rank()
    stranger.raw(struct.pack(">I", PRE_AUTH_FRAME + 1))
    assert stranger.is_closed()
    assert f"limit {PRE_AUTH_FRAME}" in h.log.of(Kind.WARNING)[0].data["reason"]
    member = h.rank()
    assert member.hello(0)["type"] == "welcome"
    member.send({"type": "heartbeat", "note": "x" * (4 * PRE_AUTH_FRAME)})
    assert not member.is_closed(0.3)


BUSY = {"type": "reject", "reason": BUSY_REASON, "retry": True}


class Gate:
    """An event sink that holds the coordinator's I/O thread inside the first event
    ``hold`` accepts, until `release`: meanwhile the test lines up what it will find."""

    def __init__(self, hold: Callable[[Event], bool]) -> None:
        self.hold = hold
        self.held = threading.Event()
        self._open = threading.Event()

    def emit(self, e: Event) -> None:
        if not self.held.is_set() and self.hold(e):
            self.held.set()
            self._open.wait(10.0)

    def release(self) -> None:
        self._open.set()


def _pending(h: Harness) -> int:
    return len(h.coord._pending)


def test_past_the_per_source_limit_the_newest_is_asked_to_dial_again_and_the_oldest_kept(
        make: Callable[..., Harness]) -> None:
    h = make()
    idle = [h.rank() for _ in range(PENDING_PER_SOURCE)]
    assert wait_for(lambda: _pending(h) == PENDING_PER_SOURCE)
    newest = h.rank()
    assert newest.recv() == BUSY  # keyed with the run's salt: a rank knows to dial again
    assert newest.is_closed()
    assert not idle[0].is_closed(0.2) and not idle[-1].is_closed(0.01)
    assert h.said(Kind.WARNING) == [(Name.PEER_DROPPED, None, None, {
        "peer": f"127.0.0.1:{newest.local_port}", "refused": 1,
        "reason": f"too many connections without a hello from one address "
                  f"(limit {PENDING_PER_SOURCE}); refused the newest"})]
    assert h.rank().hello(0)["type"] == "welcome"  # a hello already in needs no place


def test_a_connection_whose_hello_is_in_is_judged_at_once_even_when_its_source_is_full(
        make: Callable[..., Harness]) -> None:
    h = make()
    gate = Gate(lambda e: e.name is Name.PEER_DROPPED)
    h.coord.events.add(gate)
    idle = [h.rank() for _ in range(PENDING_PER_SOURCE)]
    assert wait_for(lambda: _pending(h) == PENDING_PER_SOURCE)
    h.rank()  # refused: the I/O thread now waits in the gate
    assert gate.held.wait(3.0)
    rank = h.rank()
    rank.send({"type": "hello", "rank": 0, "host": "h0", "pid": 1})  # in before its accept
    late = h.rank()  # idle, behind it in the queue
    gate.release()
    assert rank.recv()["type"] == "welcome"
    assert late.recv() == BUSY and late.is_closed()
    assert not idle[0].is_closed(0.1)
    assert h.coord.joined == {0}


def test_under_refusals_a_silent_connection_loses_its_place_after_the_prompt_deadline(
        make: Callable[..., Harness]) -> None:
    h = make()
    idle = [h.rank() for _ in range(PENDING_PER_SOURCE)]
    assert wait_for(lambda: _pending(h) == PENDING_PER_SOURCE)
    time.sleep(HELLO_PROMPT * 1.2)
    assert not idle[0].is_closed(0.01)  # past the prompt deadline, but nobody was refused
    assert h.rank().recv() == BUSY  # now someone is: the source is pressed
    assert idle[0].recv() == BUSY and idle[-1].recv() == BUSY
    assert wait_for(lambda: _pending(h) == 0)
    assert h.rank().hello(1)["type"] == "welcome"
    reasons = [r for w in h.log.of(Kind.WARNING) for r in
               ([w.data["reason"]] if "reason" in w.data else list(w.data["reasons"]))]
    assert reasons[0].startswith("too many connections without a hello from one address")
    h.coord.stop()
    counted = h.log.named(Name.PEERS_REFUSED)[-1].data["reasons"]
    assert counted == {f"no hello within {HELLO_PROMPT:g}s while connections were being "
                       "refused": PENDING_PER_SOURCE}


def test_a_heartbeat_is_read_in_the_next_turn_however_many_connections_wait(
        make: Callable[..., Harness]) -> None:
    """Issue 22: accepting used to loop until the queue was empty, so a steady stream of
    connects kept the loop from ever reading a heartbeat."""
    h = make(2)
    member = h.rank()
    assert member.hello(0)["type"] == "welcome"
    gate = Gate(lambda e: e.name is Name.RANK_JOINED and e.rank == 1)
    h.coord.events.add(gate)
    admitted: list[int] = []
    heard: list[int] = []
    admit, handle = h.coord._admit, h.coord._handle

    def counting_admit(sock: socket.socket, addr: Any) -> None:
        admitted.append(1)
        admit(sock, addr)

    def noting_handle(conn: Any, message: dict[str, Any]) -> None:
        if message["type"] == "heartbeat":
            heard.append(len(admitted))
        handle(conn, message)

    h.coord._admit = counting_admit  # type: ignore[method-assign]
    h.coord._handle = noting_handle  # type: ignore[method-assign]
    other = h.rank()
    other.send({"type": "hello", "rank": 1, "host": "h1", "pid": 2})
    assert gate.held.wait(3.0)
    queued = [socket.create_connection(("127.0.0.1", h.coord.port), timeout=3.0)
              for _ in range(500)]
    try:
        member.send({"type": "heartbeat"})
        gate.release()
        assert wait_for(lambda: bool(heard))
        assert wait_for(lambda: len(admitted) >= 500), len(admitted)  # 500 + the hello of rank 1
        assert heard[0] <= 2 * ACCEPT_PER_TURN, heard
    finally:
        for s in queued:
            s.close()


# -- the admission policy, without sockets -----------------------------------------------
def test_pending_peers_refuse_the_newest_past_the_per_source_limit_never_an_older_one() -> None:
    peers: PendingPeers[str] = PendingPeers(per_source=2, cap=10, prompt=1.0, timeout=10.0)
    assert peers.refusal("a") is None
    peers.add("a1", "a", 0.0)
    peers.add("a2", "a", 0.1)
    assert peers.refusal("a") == ("too many connections without a hello from one address "
                                  "(limit 2); refused the newest")
    assert peers.refusal("b") is None  # another address has its own places
    peers.add("b1", "b", 0.2)
    assert peers.oldest_first() == ["a1", "a2", "b1"] and peers.from_source("a") == 2
    peers.remove("a1")
    peers.remove("a1")  # idempotent
    assert peers.refusal("a") is None and peers.from_source("a") == 1 and len(peers) == 2


def test_pending_peers_past_the_global_cap_refuse_every_source() -> None:
    peers: PendingPeers[str] = PendingPeers(per_source=5, cap=3, prompt=1.0, timeout=10.0)
    for n, source in enumerate("abc"):
        peers.add(source, source, float(n))
    assert peers.refusal("d") == \
        "too many connections without a hello (limit 3); refused the newest"
    # past the cap, every source is pressed: anyone's connection past the prompt deadline goes
    assert [c for c, _, again in peers.expired(2.5) if again] == ["a", "b"]


def test_pending_peers_expire_at_the_hello_timeout_and_under_refusals_at_the_prompt() -> None:
    peers: PendingPeers[str] = PendingPeers(per_source=2, cap=10, prompt=1.0, timeout=10.0)
    peers.add("a1", "a", 0.0)
    peers.add("b1", "b", 0.0)
    peers.add("a2", "a", 5.0)
    assert peers.expired(5.5) == []  # nobody was refused: 10 s to say hello
    assert peers.refusal("a") is not None
    # a2 is still within its prompt deadline, and b was not refused
    assert peers.expired(5.5) == [("a1", "no hello within 1s while connections were being "
                                         "refused", True)]
    peers.remove("a1")
    assert peers.expired(5.6) == []  # the pressure ended with that round
    assert peers.expired(10.5) == [("b1", "no hello within 10s", False)]
    short: PendingPeers[str] = PendingPeers(per_source=2, cap=10, prompt=1.0, timeout=0.2)
    short.add("x", "a", 0.0)
    assert short.prompt == 0.2 and short.expired(0.3) == [("x", "no hello within 0.2s", False)]


def test_refused_peers_make_one_line_at_once_then_one_count(make: Callable[..., Harness]) -> None:
    h = make()
    for _ in range(40):
        f = h.rank()
        f.raw(struct.pack(">I", 3))
        assert f.is_closed()
    h.coord.stop()
    warnings = h.log.of(Kind.WARNING)
    assert [w.name for w in warnings] == [Name.PEER_DROPPED, Name.PEERS_REFUSED]
    assert "frame too short" in warnings[0].data["reason"]
    assert warnings[1].data["refused"] == 39
