"""The agent's cohort relay (issue 35): a rank started by an agent reaches the coordinator
through its agent's Unix socket, and the agent speaks for its ranks on its session.

Real rank processes (each in its own process group, as the agent starts them) on a real
socket: the real rank library (`rank.join`, copied next to the script as a user may) or a
scripted client that writes chosen frames. The relay is driven through its class on a
real selector, with its frames to the launcher collected; the last test goes through a
real agent over pipes (`test_agent.AgentPipe`)."""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from test_agent import AgentPipe, spec

from fdl_fabric import rank
from fdl_fabric.agent import cohortrelay, registry, wire

HOST = "h1"
WORLD = 3
#: Seconds any one wait of these tests may take: a bound against hanging, never a timing.
BOUND = 30.0

#: A rank program on the real library: join, report progress argv[1] times, then wait for
#: its stdin to close (or a shutdown) and exit cleanly (the library says `exiting`).
RANK_PROGRAM = r"""
import json, os, select, sys
import rank
me = rank.join(timeout=30)
print(json.dumps({"joined": me.rank, "world": me.world_size,
                  "socket": os.environ.get(rank.ENV_AGENT_SOCKET)}), flush=True)
for _ in range(int(sys.argv[1])):
    rank.progress()
while not rank.should_stop():
    if select.select([sys.stdin], [], [], 0.05)[0]:
        break
print(json.dumps({"stop": rank.should_stop(), "survivors": rank.survivors()}), flush=True)
"""

#: A scripted peer: ``steps`` of ["send", message, {"seq", "salt"}], ["recv"] (one frame,
#: printed with the sequence it verified with) and ["dial", wait] (open another connection
#: and keep it, or, with ``wait``, wait for its end), ["second", hello] (say it on a second
#: connection, print what that one receives until its end); it ends by printing what
#: closes its connection, or the error that stopped it.
CLIENT = r"""
import json, socket, sys
import rank
plan = json.loads(sys.argv[1])
salt, run = bytes.fromhex(plan["salt"]), plan["run_id"]

def dial():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(plan["path"])
    return s

def say(obj):
    print(json.dumps(obj), flush=True)

s, buf, tx, rx, kept = dial(), bytearray(), 0, 0, []
try:
    for step in plan["steps"]:
        if step[0] == "send":
            over = step[2] if len(step) > 2 else {}
            key = bytes.fromhex(over.get("salt", plan["salt"]))
            s.sendall(rank.encode_frame(key, run, over.get("seq", tx), step[1]))
            tx += 1
        elif step[0] == "recv":
            say({"seq": rx, "msg": rank.receive(s, buf, salt, run, rx)})
            rx += 1
        elif step[0] == "second":  # a hello on a second connection, read to its end
            other, got, more = dial(), [], bytearray()
            other.sendall(rank.encode_frame(salt, run, 0, step[1]))
            while True:
                message = rank.receive(other, more, salt, run, len(got))
                if message is None:
                    break
                got.append({"seq": len(got), "msg": message})
            say({"second": got})
        elif step[0] == "dial":
            kept.append(dial())
            say({"dialed": "closed" if step[1] and kept[-1].recv(1) == b"" else "open"})
    while True:
        message = rank.receive(s, buf, salt, run, rx)
        if message is None:
            say({"eof": True})
            break
        say({"seq": rx, "msg": message})
        rx += 1
except Exception as exc:
    say({"error": repr(exc)})
"""


def hello(r: int, **extra: Any) -> dict[str, Any]:
    return {"type": "hello", "rank": r, "host": HOST, "pid": 0, "lib": rank.PROTOCOL, **extra}


def welcome(r: int) -> dict[str, Any]:
    return {"type": "welcome", "rank": r, "world_size": WORLD, "dead": [], "formed": False}


class Relay:
    """A `CohortRelay` on a real selector, with its ranks (real processes, each leading its
    own process group) and what it sends up (``up``: type, body, when)."""

    def __init__(self, tmp_path: Path, registry: Optional[Path] = None) -> None:
        self.tmp = tmp_path
        self.salt = secrets.token_bytes(16)
        self.run_id = f"test-cohort-{secrets.token_hex(4)}"
        self.sel = selectors.DefaultSelector()
        self.up: list[tuple[int, dict[str, Any], float]] = []
        self.ranks: dict[int, subprocess.Popen[bytes]] = {}
        self.others: list[subprocess.Popen[bytes]] = []
        self.lines: dict[int, list[dict[str, Any]]] = {}
        self.partial: dict[int, bytes] = {}
        self.relay = cohortrelay.CohortRelay(self._send, self.sel, self._running)
        shutil.copy(rank.__file__, tmp_path / "rank.py")  # a copy next to the script
        (tmp_path / "client.py").write_text(CLIENT)
        (tmp_path / "program.py").write_text(RANK_PROGRAM)
        self.envelope = json.dumps({
            "controller": {"host": "127.0.0.1", "port": 9}, "run_id": self.run_id,
            "salt": self.salt.hex(), "world_size": WORLD,
            "worker": {"host": HOST, "ranks": list(range(WORLD))}}).encode().hex()
        spec = {"run_id": self.run_id, "host": HOST, "envelope": self.envelope,
                "ranks": [{"rank": r} for r in range(WORLD)]}
        path = self.relay.open(spec, 0, str(registry or tmp_path / "reg"))
        assert path is not None, self.up
        self.path = path

    def _send(self, kind: int, body: Optional[dict[str, Any]]) -> None:
        self.up.append((kind, body or {}, time.monotonic()))

    def _running(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.ranks.items() if p.poll() is None}

    # -- processes ------------------------------------------------------------------------
    def _start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=self.tmp,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True)
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self.lines[proc.pid], self.partial[proc.pid] = [], b""
        self.sel.register(proc.stdout.fileno(), selectors.EVENT_READ,
                          lambda fd, events, p=proc.pid: self._read_lines(fd, p))
        return proc

    def _read_lines(self, fd: int, pid: int) -> None:
        """What a process printed: one JSON object a line."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.sel.unregister(fd)
        *whole, self.partial[pid] = (self.partial[pid] + data).split(b"\n")
        self.lines[pid] += [json.loads(line) for line in whole]

    def rank_program(self, r: int, progress: int = 0) -> subprocess.Popen[bytes]:
        """Rank ``r`` on the real library, started as the agent starts it."""
        proc = self._start([sys.executable, "program.py", str(progress)], {
            rank.ENV_CLUSTER_JSON: self.envelope, rank.ENV_RANK: str(r),
            rank.ENV_AGENT_SOCKET: self.path})
        self.ranks[r] = proc
        return proc

    def client(self, steps: list[list[Any]], r: Optional[int] = None,
               salt: Optional[bytes] = None) -> subprocess.Popen[bytes]:
        """A scripted peer: rank ``r``'s process, or (``r`` None) another process of this
        user in a process group of its own."""
        plan = {"path": self.path, "salt": (salt or self.salt).hex(), "run_id": self.run_id,
                "steps": steps}
        proc = self._start([sys.executable, "client.py", json.dumps(plan)], {})
        if r is None:
            self.others.append(proc)
        else:
            self.ranks[r] = proc
        return proc

    def said(self, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
        return self.lines[proc.pid]

    # -- the loop -------------------------------------------------------------------------
    def pump(self, until: Callable[[], bool], what: str) -> None:
        """Run the agent's loop (select, then the relay's moments) until ``until()``."""
        deadline = time.monotonic() + BOUND
        while not until():
            now = time.monotonic()
            assert now < deadline, f"not within {BOUND:g}s: {what}; up: {self.up}"
            due = self.relay.deadlines()
            wait = min([0.2] + [max(0.0, d - now) for d in due])
            for key, events in self.sel.select(wait):
                key.data(key.fd, events)
            self.relay.on_time(time.monotonic())

    def ended(self, proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
        """``proc`` exited and everything it printed was read."""
        assert proc.stdout is not None
        return lambda: proc.poll() is not None and proc.stdout is not None and \
            proc.stdout.fileno() not in self.sel.get_map()

    def cohort(self, **match: Any) -> list[dict[str, Any]]:
        """The COHORT_UP bodies sent so far whose fields (or whose message's type) match."""
        found = []
        for kind, body, _ in self.up:
            if kind != wire.COHORT_UP:
                continue
            msg_type = match.get("type")
            if msg_type is not None and body.get("msg", {}).get("type") != msg_type:
                continue
            if all(body.get(k) == v for k, v in match.items() if k != "type"):
                found.append(body)
        return found

    def beats(self) -> list[tuple[dict[str, list[Any]], float]]:
        return [(body["ranks"], at) for kind, body, at in self.up if kind == wire.BEATS]

    def stop(self) -> None:
        for proc in [*self.ranks.values(), *self.others]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        self.relay.close()


@pytest.fixture
def relay(tmp_path: Path) -> Any:
    harness = Relay(tmp_path)
    yield harness
    harness.stop()


def test_a_ranks_hello_goes_up_as_cohort_and_the_welcome_reaches_it_with_sequence_0(
        relay: Relay) -> None:
    client = relay.client([["send", hello(1, pid=4242)], ["recv"]], r=1)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the hello goes up")
    assert relay.cohort(type="hello") == [{"rank": 1, "msg": hello(1, pid=4242)}]
    relay.relay.on_down({"rank": 1, "msg": welcome(1)})
    relay.pump(lambda: bool(relay.said(client)), "the welcome reaches the rank")
    assert relay.said(client)[0] == {"seq": 0, "msg": welcome(1)}
    relay.relay.on_down({"rank": None, "msg": {"type": "formed", "dead": []}})
    relay.pump(lambda: len(relay.said(client)) > 1, "a broadcast reaches the rank")
    assert relay.said(client)[1] == {"seq": 1, "msg": {"type": "formed", "dead": []}}


def test_the_real_rank_library_joins_through_the_socket_and_its_heartbeats_are_not_forwarded(
        relay: Relay) -> None:
    proc = relay.rank_program(2, progress=5)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the library's hello goes up")
    [up] = relay.cohort(type="hello")
    assert up["rank"] == 2 and up["msg"]["pid"] == proc.pid
    assert up["msg"]["lib"] == rank.PROTOCOL and up["msg"]["host"] == HOST
    relay.relay.on_down({"rank": 2, "msg": welcome(2)})
    relay.pump(lambda: bool(relay.said(proc)), "join() returns")
    assert relay.said(proc)[0] == {"joined": 2, "world": WORLD, "socket": relay.path}
    relay.pump(lambda: any(b.get("2", [0, 0])[1] == 5 for b, _ in relay.beats()),
               "its progress is folded into the beats")
    assert not relay.cohort(type="heartbeat")


def test_heartbeats_of_three_ranks_are_folded_into_one_beats_frame_per_interval(
        relay: Relay) -> None:
    procs = [relay.rank_program(r, progress=r + 1) for r in range(WORLD)]
    relay.pump(lambda: len(relay.cohort(type="hello")) == WORLD, "three hellos")
    for r in range(WORLD):
        relay.relay.on_down({"rank": r, "msg": welcome(r)})
    joined_at = time.monotonic()
    relay.pump(lambda: all(relay.said(p) for p in procs), "every rank joined")
    want = {str(r): r + 1 for r in range(WORLD)}
    relay.pump(lambda: sum({k: v[1] for k, v in b.items()} == want
                           for b, _ in relay.beats()) >= 2,
               "two beats frames with every rank's progress")
    beats = relay.beats()
    for ranks, _ in beats:
        assert sorted(ranks) == ["0", "1", "2"]  # one frame for the host, never one a rank
        for age, progress in ranks.values():
            assert isinstance(age, float) and age >= 0 and age == round(age, 3)
            assert isinstance(progress, int)
    # One frame per interval at most (each is due a whole interval after the one before).
    last = beats[-1][1]
    assert len(beats) <= (last - joined_at) / rank.HEARTBEAT_INTERVAL + 1
    assert not relay.cohort(type="heartbeat")
    assert relay.relay.beating  # the agent's pings go unanswered: the beats say it lives
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()  # a clean exit: the library says `exiting`
    relay.pump(lambda: all(relay.ended(p)() for p in procs), "the ranks exit")
    relay.pump(lambda: len([b for b in relay.cohort() if "closed" in b]) == WORLD,
               "each connection's end goes up")
    assert sorted(b["rank"] for b in relay.cohort(type="exiting")) == [0, 1, 2]
    closed = [b for b in relay.cohort() if "closed" in b]
    assert sorted(b["rank"] for b in closed) == [0, 1, 2]  # once each
    relay.pump(lambda: relay.relay.next_beat is None, "the beats stop with the last rank")
    assert not relay.relay.beating  # the agent answers the launcher's pings again


def test_a_process_that_is_not_one_of_the_agents_ranks_is_closed_at_once_unread(
        relay: Relay) -> None:
    relay.client([], r=0)  # a rank of the agent (silent), so the relay has a group to match
    stranger = relay.client([["send", hello(0)], ["recv"]])
    relay.pump(relay.ended(stranger), "the stranger is closed")
    said = relay.said(stranger)
    assert said and not [line for line in said if line.get("msg")]  # no answer, no frame
    assert not relay.cohort()
    assert all(c.rank == 0 for c in relay.relay.conns.values())


def test_a_process_in_a_ranks_process_group_speaks_for_that_rank(relay: Relay) -> None:
    leader = relay._start(["/bin/sh", "-c", " ".join([
        sys.executable, "client.py", "'" + json.dumps({
            "path": relay.path, "salt": relay.salt.hex(), "run_id": relay.run_id,
            "steps": [["send", hello(2)]]}) + "'"]) + "; exit 0"], {})
    relay.ranks[2] = leader  # the shell leads the rank's group; the client is its child
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the child's hello goes up")
    assert relay.cohort(type="hello")[0]["rank"] == 2


def test_a_hello_naming_another_rank_is_refused_with_the_reason(relay: Relay) -> None:
    client = relay.client([["send", hello(0)]], r=1)
    relay.pump(relay.ended(client), "the refusal")
    reason = "rank 0 is not the rank of this process (rank 1)"
    assert relay.said(client) == [{"seq": 0, "msg": {"type": "reject", "reason": reason}},
                                  {"eof": True}]
    assert not relay.cohort()


@pytest.mark.parametrize("lib, shown", [(rank.PROTOCOL + 1, str(rank.PROTOCOL + 1)),
                                        (None, "none")])
def test_a_hello_of_another_rank_library_is_refused_naming_both_versions(
        relay: Relay, lib: Optional[int], shown: str) -> None:
    message = hello(0)
    del message["lib"]
    if lib is not None:
        message["lib"] = lib
    client = relay.client([["send", message]], r=0)
    relay.pump(relay.ended(client), "the refusal")
    reason = (f"rank library protocol {shown}, agent speaks {rank.PROTOCOL}: the rank "
              "imported another fdl-fabric than the agent's (install the same version on "
              "every host)")
    assert relay.said(client)[0] == {"seq": 0, "msg": {"type": "reject", "reason": reason}}
    assert not relay.cohort()


def test_a_frame_with_a_bad_tag_closes_that_connection_only(relay: Relay) -> None:
    forged = {"salt": secrets.token_bytes(16).hex()}
    bad = relay.client([["send", hello(0)], ["recv"],
                        ["send", {"type": "heartbeat", "progress": 1}, forged]], r=0)
    good = relay.client([["send", hello(1)], ["recv"], ["recv"]], r=1)
    relay.pump(lambda: len(relay.cohort(type="hello")) == 2, "both hellos")
    relay.relay.on_down({"rank": 0, "msg": welcome(0)})
    relay.relay.on_down({"rank": 1, "msg": welcome(1)})
    relay.pump(relay.ended(bad), "the forged frame ends its connection")
    assert relay.cohort(rank=0, closed="bad tag") == [{"rank": 0, "closed": "bad tag"}]
    relay.relay.on_down({"rank": None, "msg": {"type": "membership", "dead": [0]}})
    relay.pump(lambda: len(relay.said(good)) >= 2, "the other rank still hears")
    assert relay.said(good)[1] == {"seq": 1, "msg": {"type": "membership", "dead": [0]}}
    assert not relay.cohort(rank=1, closed="bad tag")


def test_a_frame_replayed_with_an_earlier_sequence_closes_the_connection(
        relay: Relay) -> None:
    client = relay.client([["send", hello(0)], ["recv"],
                           ["send", {"type": "heartbeat", "progress": 1}, {"seq": 0}]], r=0)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the hello")
    relay.relay.on_down({"rank": 0, "msg": welcome(0)})
    relay.pump(relay.ended(client), "the replay ends the connection")
    assert relay.cohort(rank=0, closed="bad tag")


def test_an_unknown_message_or_a_first_frame_other_than_hello_closes_the_connection(
        relay: Relay) -> None:
    early = relay.client([["send", {"type": "heartbeat", "progress": 1}]], r=0)
    odd = relay.client([["send", hello(1)], ["send", {"type": "probe", "host": HOST}]], r=1)
    relay.pump(lambda: relay.ended(early)() and relay.ended(odd)(), "both closed")
    assert relay.said(early) == [{"eof": True}]
    assert relay.cohort(rank=1, closed="unknown message type 'probe'")


def test_a_first_frame_larger_than_the_pre_hello_bound_is_refused_unread(
        relay: Relay) -> None:
    client = relay.client([["send", hello(0, pad="x" * rank.PRE_AUTH_FRAME)]], r=0)
    relay.pump(relay.ended(client), "the oversized hello ends the connection")
    assert not relay.cohort()


def test_a_rank_gets_two_connections_and_a_third_is_closed_at_once(relay: Relay) -> None:
    client = relay.client([["dial", False], ["dial", True], ["send", hello(0)]], r=0)
    relay.pump(lambda: len(relay.said(client)) >= 2, "the two dials")
    assert relay.said(client)[:2] == [{"dialed": "open"}, {"dialed": "closed"}]
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the first connection's hello")
    assert len(relay.relay.conns) == 2


def test_a_connection_without_a_hello_is_closed_after_10_seconds(relay: Relay) -> None:
    client = relay.client([["recv"]], r=0)
    relay.pump(lambda: bool(relay.relay.conns), "the connection is accepted")
    assert relay.relay.deadlines()
    relay.relay.on_time(time.monotonic() + cohortrelay.HELLO_TIMEOUT)
    relay.pump(relay.ended(client), "the silent connection is closed")
    assert not relay.relay.conns and not relay.cohort()


def test_exiting_and_ack_shutdown_go_up_and_a_close_from_the_coordinator_is_reported_once(
        relay: Relay) -> None:
    client = relay.client([["send", hello(0)], ["recv"], ["recv"],
                           ["send", {"type": "ack_shutdown"}], ["send", {"type": "exiting"}],
                           ["send", {"type": "exiting"}]], r=0)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the hello")
    relay.relay.on_down({"rank": 0, "msg": welcome(0)})
    shutdown = {"type": "shutdown", "reason": "max_failure reached", "save": True}
    relay.relay.on_down({"rank": None, "msg": shutdown})
    relay.pump(lambda: bool(relay.cohort(type="exiting")), "the exit goes up")
    assert relay.said(client)[1] == {"seq": 1, "msg": shutdown}
    assert relay.cohort(type="ack_shutdown") == [{"rank": 0, "msg": {"type": "ack_shutdown"}}]
    relay.relay.on_down({"rank": 0, "close": True})
    relay.pump(relay.ended(client), "the coordinator's close reaches the rank")
    assert [b for b in relay.cohort() if "closed" in b] == [
        {"rank": 0, "closed": "closed by the coordinator"}]
    assert len(relay.cohort(type="exiting")) == 1  # said twice, forwarded once


def test_a_second_hello_of_a_joined_rank_is_refused_without_cutting_its_first_connection(
        relay: Relay) -> None:
    client = relay.client([["send", hello(0)], ["recv"], ["second", hello(0)], ["recv"]], r=0)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the first hello")
    relay.relay.on_down({"rank": 0, "msg": welcome(0)})
    relay.pump(lambda: len(relay.cohort(type="hello")) == 2, "the second hello goes up")
    # The coordinator's answer to it: a reject, then a close of that connection.
    refusal = {"type": "reject", "reason": "rank 0 already joined"}
    relay.relay.on_down({"rank": 0, "msg": refusal})
    relay.relay.on_down({"rank": 0, "close": True})
    relay.pump(lambda: len(relay.said(client)) >= 2, "the second connection's end")
    assert relay.said(client)[1] == {"second": [{"seq": 0, "msg": refusal}]}
    relay.relay.on_down({"rank": None, "msg": {"type": "membership", "dead": [2]}})
    relay.pump(lambda: len(relay.said(client)) >= 3, "the first connection still hears")
    assert relay.said(client)[2] == {"seq": 1, "msg": {"type": "membership", "dead": [2]}}
    assert not [b for b in relay.cohort() if "closed" in b]


def test_a_coordinator_reject_is_delivered_then_the_connection_closes_unreported(
        relay: Relay) -> None:
    client = relay.client([["send", hello(0)]], r=0)
    relay.pump(lambda: bool(relay.cohort(type="hello")), "the hello")
    relay.relay.on_down({"rank": 0, "msg": {"type": "reject", "reason": "rank 0 already joined"}})
    relay.relay.on_down({"rank": 0, "close": True})
    relay.pump(relay.ended(client), "the reject and the close")
    assert relay.said(client) == [
        {"seq": 0, "msg": {"type": "reject", "reason": "rank 0 already joined"}}, {"eof": True}]
    assert not [b for b in relay.cohort() if "closed" in b]


@pytest.mark.parametrize("body", [
    {"rank": 7, "msg": {"type": "welcome"}}, {"rank": True, "msg": {"type": "welcome"}},
    {"rank": "0", "msg": {"type": "welcome"}}, {"rank": 0}, {"rank": 0, "msg": "welcome"},
    {"rank": 0, "msg": {"kind": "welcome"}}, {"rank": None, "close": True},
    {"rank": 0, "close": 1}, {"rank": 0, "close": True, "msg": {"type": "formed"}}])
def test_a_malformed_cohort_frame_from_the_launcher_is_a_protocol_error(
        relay: Relay, body: dict[str, Any]) -> None:
    with pytest.raises(wire.ProtocolError):
        relay.relay.on_down(body)


def test_the_sockets_folder_is_0700_and_the_socket_goes_when_the_agent_ends(
        tmp_path: Path, umask_0: None) -> None:
    short = Path(tempfile.mkdtemp(prefix="reg-", dir="/tmp"))  # a registry path fit for a socket
    try:
        harness = Relay(tmp_path, registry=short / "reg")
        try:
            path = Path(harness.path)
            assert path.parent.parent.name == f"{harness.run_id}@{HOST}"
            assert stat.S_ISSOCK(path.lstat().st_mode)
            for folder in (path.parent, path.parent.parent, short / "reg"):
                assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        finally:
            harness.stop()
        assert not path.exists()
    finally:
        shutil.rmtree(short)


def test_a_registry_path_too_long_for_a_socket_gets_a_private_temp_folder_removed_at_the_end(
        tmp_path: Path, umask_0: None) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    harness = Relay(tmp_path, registry=deep)
    try:
        path = Path(harness.path)
        assert len(os.fsencode(str(path))) <= cohortrelay.SUN_PATH_MAX
        assert path.parent.name.startswith("fdlr-")
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        client = harness.client([["send", hello(0)]], r=0)
        harness.pump(lambda: bool(harness.cohort(type="hello")), "a rank dials it")
        assert client.poll() is None
    finally:
        harness.stop()
    assert not path.parent.exists()


# -- through the real agent ------------------------------------------------------------------
AGENT_RANK = r"""
import json, os, time
import rank
me = rank.join(timeout=30)
path = os.environ[rank.ENV_AGENT_SOCKET]
print(json.dumps({"joined": me.rank, "socket": path,
                  "mode": oct(os.stat(os.path.dirname(path)).st_mode & 0o777)}), flush=True)
rank.progress()
deadline = time.monotonic() + 60
while not rank.should_stop() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"stopped": rank.should_stop()}), flush=True)
"""


def test_an_agent_started_rank_joins_and_beats_through_its_agent_and_the_socket_goes_with_it(
        tmp_path: Path) -> None:
    shutil.copy(rank.__file__, tmp_path / "rank.py")
    (tmp_path / "program.py").write_text(AGENT_RANK)
    salt = secrets.token_bytes(16)
    s = spec([sys.executable, "program.py"], 2, cwd=str(tmp_path),
             env={"PYTHONPATH": str(tmp_path)})
    s["envelope"] = json.dumps({
        "controller": {"host": "127.0.0.1", "port": 9}, "run_id": s["run_id"],
        "salt": salt.hex(), "world_size": 2,
        "worker": {"host": "localhost", "ranks": [0, 1]}}).encode().hex()
    agent = AgentPipe()
    try:
        agent.send(wire.SPEC, s)
        hellos: dict[int, dict[str, Any]] = {}
        pids: dict[int, int] = {}
        for kind, body in agent.frames(BOUND):
            if kind == wire.SPAWNED:
                pids[wire.parse_json(body)["rank"]] = wire.parse_json(body)["pid"]
            if kind == wire.COHORT_UP:
                hellos[wire.parse_json(body)["rank"]] = wire.parse_json(body)["msg"]
            if len(hellos) == 2:
                break
        assert {r: m["pid"] for r, m in hellos.items()} == pids
        for r in (0, 1):
            agent.send(wire.COHORT_DOWN, {"rank": r, "msg": {
                "type": "welcome", "rank": r, "world_size": 2, "dead": [], "formed": r == 1}})
        seen: list[tuple[int, bytes]] = []
        beats: dict[str, list[Any]] = {}
        for frame in agent.frames(BOUND):
            seen.append(frame)
            if frame[0] == wire.BEATS:
                beats = wire.parse_json(frame[1])["ranks"]
            if agent.output(seen, 0) and len(beats) == 2 and \
                    all(p == 1 for _, p in beats.values()):
                break
        printed = json.loads(agent.output(seen, 0).splitlines()[0])
        assert printed["joined"] == 0 and printed["mode"] == "0o700"
        socket_path = Path(printed["socket"])
        assert socket_path.exists()
        agent.send(wire.COHORT_DOWN, {"rank": None, "msg": {
            "type": "shutdown", "reason": "max_failure reached", "save": True}})
        rest = agent.until(wire.DONE)
        ups = [wire.parse_json(b) for k, b in rest if k == wire.COHORT_UP]
        assert sorted(u["rank"] for u in ups if u.get("msg", {}).get("type") ==
                      "ack_shutdown") == [0, 1]
        assert sorted(u["rank"] for u in ups if u.get("msg", {}).get("type") ==
                      "exiting") == [0, 1]
        assert all(e["code"] == 0 for e in agent.exits(rest).values())
        assert not socket_path.exists()
        assert agent.wait() == 0
    finally:
        agent.stop()


def test_a_sigkilled_agents_socket_and_its_temp_folder_are_removed_by_its_watchdog(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A registry whose path is too long for a socket: the agent binds in an fdlr- folder.
    long = tmp_path / ("r" * 110)
    long.mkdir(mode=0o700)
    monkeypatch.setenv(registry.ENV_STATE_DIR, str(long))
    s = spec(["bash", "-c", f'echo "${rank.ENV_AGENT_SOCKET}"; exec sleep 300'], 1,
             grace=1.0)
    s["envelope"] = json.dumps({
        "controller": {"host": "127.0.0.1", "port": 9}, "run_id": s["run_id"],
        "salt": secrets.token_hex(16), "world_size": 1,
        "worker": {"host": "localhost", "ranks": [0]}}).encode().hex()
    agent = AgentPipe()
    try:
        agent.send(wire.SPEC, s)
        socket_path = Path(agent.output(agent.until(wire.OUTPUT), 0).decode().strip())
        assert socket_path.parent.name.startswith("fdlr-") and socket_path.exists()
        os.kill(agent.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0 + 5.0  # the kill grace, and room
        while socket_path.parent.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not socket_path.exists() and not socket_path.parent.exists()
    finally:
        agent.stop()


def test_the_folded_beats_go_as_often_as_the_spec_says_within_bounds(tmp_path: Path) -> None:
    for asked, used in ((3.0, 3.0), (0.01, 1.0), (None, 1.0), (True, 1.0), (99, 10.0)):
        relay = cohortrelay.CohortRelay(lambda kind, body: None, selectors.DefaultSelector(),
                                        dict)
        relay.open({"run_id": "r", "host": "h", "ranks": [{"rank": 0}], "beats_every": asked},
                   0, str(tmp_path / "reg"))
        assert relay.beat_every == used, asked
        relay.close()


@pytest.mark.parametrize("every", [1.0, 3.0, 2.5])
def test_agents_beat_on_the_wall_clocks_grid_so_a_gateway_batches_its_hosts_beats(
        every: float) -> None:
    for _ in range(50):
        mono, wall = time.monotonic(), time.time()
        due = cohortrelay.next_beat_at(mono, every)
        ahead = due - mono
        assert every / 10 <= ahead <= every * 1.1 + 1e-6
        on_grid = (wall + ahead) % every
        assert min(on_grid, every - on_grid) < 0.01, (wall, ahead)
        time.sleep(0.003)
