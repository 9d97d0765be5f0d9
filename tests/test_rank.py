"""The rank client in real subprocesses against a real coordinator on loopback.

Each rank is ``python -c`` importing fdl_fabric.rank with the environment the
launcher would give it (the slim envelope from `SlimEnvelope.to_hex`, RANK,
FLODL_INTERNAL_LOCAL_RANK). The scripts print one JSON object per line, which
the tests read with a deadline, so nothing here can hang.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fdl_fabric.rank as rank_mod
from fdl_fabric.events import EventBus, EventLog, Kind, Name, event
from fdl_fabric.planning.envelope import ENV_CLUSTER_JSON, ENV_LOCAL_RANK, SlimEnvelope
from fdl_fabric.rank import encode_frame
from fdl_fabric.supervision.admission import BUSY_REASON
from fdl_fabric.supervision.coordinator import Coordinator, CoordinatorSpec

ROOT = Path(__file__).resolve().parent.parent
RANK_PY = ROOT / "fdl_fabric" / "rank.py"
SALT = bytes(range(16, 32))
RUN = "20250101-000000-feedbeef"

PRELUDE = """\
import json, os, sys, threading, time
import fdl_fabric.rank as rank
_said = threading.Lock()
def say(**kw):  # one write per line, under a lock: callbacks say things from their thread
    with _said:
        sys.stdout.write(json.dumps(kw) + "\\n")
        sys.stdout.flush()
def wait_stop(limit=4.0):
    deadline = time.monotonic() + limit
    while not rank.should_stop() and time.monotonic() < deadline:
        time.sleep(0.02)
"""


def envelope(port: int, world_size: int, ranks: tuple[int, ...], *, salt: bytes = SALT,
             run_id: str = RUN, devices: Optional[tuple[int, ...]] = None) -> str:
    return SlimEnvelope(run_id=run_id, controller_host="127.0.0.1", controller_port=port,
                        world_size=world_size, num_workers=1, host="localhost", ranks=ranks,
                        local_devices=devices, nccl_socket_ifname=None, path="/tmp",
                        salt=salt).to_hex()


class Proc:
    """A rank subprocess whose stdout lines are parsed as JSON and read with deadlines."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(argv, env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[Optional[str]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def said(self, timeout: float = 4.0) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the rank printed nothing in time") from None
        if line is None:
            raise AssertionError(f"the rank exited without output: {self.stderr()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def wait(self, timeout: float = 4.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stderr(self) -> str:
        if self.popen.poll() is None or self.popen.stderr is None:
            return ""
        return self.popen.stderr.read()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=4.0)


class Lab:
    """One coordinator and the rank processes started against it."""

    def __init__(self, coord: Coordinator, log: EventLog) -> None:
        self.coord, self.log = coord, log
        self.procs: list[Proc] = []

    def spawn(self, rank: int, body: str, *, world_size: int, ranks: tuple[int, ...],
              python: str = sys.executable, devices: Optional[tuple[int, ...]] = None,
              salt: bytes = SALT, prelude: str = PRELUDE) -> Proc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
        env.update({ENV_CLUSTER_JSON: envelope(self.coord.port, world_size, ranks, salt=salt,
                                               devices=devices),
                    "RANK": str(rank), ENV_LOCAL_RANK: str(ranks.index(rank)),
                    "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"})
        proc = Proc([python, "-c", prelude + textwrap.dedent(body)], env)
        self.procs.append(proc)
        return proc


def wait_for(predicate: Callable[[], bool], timeout: float = 4.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def lab() -> Iterator[Callable[..., Lab]]:
    made: list[Lab] = []

    def _make(world_size: int, **kw: Any) -> Lab:
        log = EventLog()
        spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=world_size,
                               bind_host="127.0.0.1", port=0, **kw)
        coord = Coordinator(spec, EventBus(log))
        coord.start()
        made.append(Lab(coord, log))
        return made[-1]

    yield _make
    for one in made:
        for proc in one.procs:
            proc.kill()
        one.coord.stop()


JOIN_AND_REPORT = """
m = rank.join(timeout=4)
say(rank=m.rank, world_size=m.world_size, local_rank=m.local_rank, device=m.device,
    host=m.host, survivors=rank.survivors(), launched=rank.is_launched())
"""


# -- joining ----------------------------------------------------------------------------------
def test_join_returns_the_membership_the_envelope_describes(lab: Callable[..., Lab]) -> None:
    one = lab(2)
    procs = [one.spawn(r, JOIN_AND_REPORT, world_size=2, ranks=(0, 1), devices=(3, 5))
             for r in (0, 1)]
    said = [p.said() for p in procs]
    assert said[1] == {"rank": 1, "world_size": 2, "local_rank": 1, "device": 5,
                       "host": "localhost", "survivors": [0, 1], "launched": True}
    assert said[0]["device"] == 3 and said[0]["local_rank"] == 0
    assert wait_for(lambda: one.coord.cohort_formed)
    assert [p.wait() for p in procs] == [0, 0]
    assert {e.host for e in one.log.of(Kind.JOIN)} == {"localhost"}


def test_a_rank_started_before_the_coordinator_retries_until_it_is_up() -> None:
    log = EventLog()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = CoordinatorSpec(run_id=RUN, salt=SALT, world_size=1, bind_host="127.0.0.1", port=port)
    coord = Coordinator(spec, EventBus(log))
    one = Lab(coord, log)
    proc = one.spawn(0, JOIN_AND_REPORT, world_size=1, ranks=(0,))
    try:
        time.sleep(0.8)
        coord.start()
        assert proc.said()["rank"] == 0
        assert proc.wait() == 0
    finally:
        proc.kill()
        coord.stop()


def test_a_duplicate_rank_gets_the_reject_reason_as_runtime_error(
        lab: Callable[..., Lab]) -> None:
    one = lab(2)
    holder = one.spawn(0, "rank.join(timeout=4); say(ok=True); time.sleep(10)", world_size=2,
                       ranks=(0, 1))
    assert holder.said() == {"ok": True}
    dup = one.spawn(0, """
        try:
            rank.join(timeout=4)
        except RuntimeError as exc:
            say(error=str(exc), launched=rank.is_launched(), stop=rank.should_stop())
        """, world_size=2, ranks=(0, 1))
    assert dup.said() == {"error": "cluster rank: the coordinator rejected rank 0: rank 0 "
                                   "already joined", "launched": True, "stop": False}


class Scripted:
    """A stand-in coordinator: connection n gets ``answers[n]`` (the last one repeats).

    ``busy`` reads the hello and answers the coordinator's keyed ``reject`` with ``retry``
    (what a flooded coordinator says); ``reset`` closes with a reset without reading
    anything; ``welcome`` welcomes rank 0 of 1 and keeps the connection open.
    """

    def __init__(self, *answers: str) -> None:
        self.answers = answers
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.seen: list[str] = []
        self.kept: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            answer = self.answers[min(len(self.seen), len(self.answers) - 1)]
            self.seen.append(answer)
            if answer == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                continue
            conn.settimeout(4.0)
            hello = rank_mod.receive(conn, bytearray(), SALT, RUN, 0)
            assert hello is not None and hello["type"] == "hello"
            if answer == "busy":
                conn.sendall(encode_frame(SALT, RUN, 0, {
                    "type": "reject", "reason": BUSY_REASON, "retry": True}))
                conn.close()
            else:
                conn.sendall(encode_frame(SALT, RUN, 0, {
                    "type": "welcome", "rank": 0, "world_size": 1, "dead": [],
                    "formed": True}))
                self.kept.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.kept:
            conn.close()


def test_a_rank_turned_away_or_reset_dials_again_and_joins() -> None:
    """Issue 22: under a flood the coordinator turns connections away; a rank dials again
    (after 25-50 ms, then 50-100 ms...) instead of failing its join."""
    server = Scripted("busy", "reset", "busy", "welcome")
    one = Lab(Coordinator(CoordinatorSpec(run_id=RUN, salt=SALT, world_size=1,
                                          bind_host="127.0.0.1", port=server.port),
                          EventBus()), EventLog())
    proc = one.spawn(0, """
        started = time.monotonic()
        m = rank.join(timeout=4)
        say(rank=m.rank, took=time.monotonic() - started)
        """, world_size=1, ranks=(0,))
    try:
        said = proc.said()
        assert said["rank"] == 0 and said["took"] < 1.5, said
        assert server.seen == ["busy", "reset", "busy", "welcome"]
        assert proc.wait() == 0
    finally:
        proc.kill()
        server.close()


def test_a_rank_turned_away_until_its_deadline_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    server = Scripted("busy")
    monkeypatch.setenv(ENV_CLUSTER_JSON, envelope(server.port, 1, (0,)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV_LOCAL_RANK, "0")
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"rank 0: the coordinator turned every "
                                               r"connection away for 0\.5s: .*dial again"):
            rank_mod.join(timeout=0.5)
    finally:
        server.close()
    assert 0.4 < time.monotonic() - started < 1.5
    assert 3 <= len(server.seen) <= 12  # redialed, with pauses between
    assert rank_mod._client is None


# -- liveness and shutdown --------------------------------------------------------------------
def test_heartbeats_keep_a_rank_alive_past_the_heartbeat_timeout(
        lab: Callable[..., Lab]) -> None:
    one = lab(1, heartbeat_timeout=0.6)
    proc = one.spawn(0, """
        rank.HEARTBEAT_INTERVAL = 0.15
        rank.join(timeout=4)
        say(joined=True)
        time.sleep(1.5)
        say(stop=rank.should_stop())
        """, world_size=1, ranks=(0,))
    assert proc.said() == {"joined": True}
    assert proc.said() == {"stop": False}
    assert one.coord.dead.dead_count() == 0
    assert proc.wait() == 0


def test_a_shutdown_broadcast_runs_the_callback_and_sets_should_stop(
        lab: Callable[..., Lab]) -> None:
    one = lab(2)
    survivor = one.spawn(0, """
        rank.join(timeout=4)
        rank.on_shutdown(lambda reason: say(callback=reason))
        say(joined=True)
        wait_stop()
        say(stop=rank.should_stop(), survivors=rank.survivors())
        """, world_size=2, ranks=(0, 1))
    victim = one.spawn(1, "rank.join(timeout=4); time.sleep(10)", world_size=2, ranks=(0, 1))
    assert survivor.said() == {"joined": True}
    assert wait_for(lambda: one.coord.cohort_formed)
    victim.kill()
    one.coord.mark_dead([1], {"exit": {"code": None, "signal": 9, "lost": None}})
    one.coord.broadcast_shutdown(event(Name.MAX_FAILURE_REACHED, dead=1, world_size=2, limit=1))
    assert survivor.said() == {"callback": "max_failure reached (1/2 dead, threshold 1)"}
    assert survivor.said() == {"stop": True, "survivors": [0]}
    assert survivor.wait() == 0
    assert wait_for(lambda: one.coord.exited == {0})


def test_a_rank_declared_dead_is_told_so(lab: Callable[..., Lab]) -> None:
    one = lab(1, heartbeat_timeout=0.3)
    proc = one.spawn(0, """
        rank.HEARTBEAT_INTERVAL = 60.0
        rank.join(timeout=4)
        rank.on_shutdown(lambda reason: say(callback=reason))
        wait_stop()
        say(survivors=rank.survivors())
        """, world_size=1, ranks=(0,))
    assert proc.said() == {"callback": "declared dead by the coordinator"}
    assert proc.said() == {"survivors": []}
    assert one.coord.dead.ranks() == [0]


def test_losing_the_coordinator_stops_the_rank(lab: Callable[..., Lab]) -> None:
    one = lab(1)
    proc = one.spawn(0, """
        rank.join(timeout=4)
        rank.on_shutdown(lambda reason: say(callback=reason))
        say(joined=True, stop=rank.should_stop())
        wait_stop()
        say(stop=rank.should_stop())
        late = []
        rank.on_shutdown(late.append)
        say(late=late)
        """, world_size=1, ranks=(0,))
    assert proc.said() == {"joined": True, "stop": False}
    one.coord.stop()
    assert proc.said() == {"callback": "lost the coordinator"}
    assert proc.said() == {"stop": True}
    assert proc.said() == {"late": ["lost the coordinator"]}
    assert proc.wait() == 0


# -- exits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ending", ["pass", "sys.exit(0)", "raise SystemExit(None)",
                                    "rank.exiting(); time.sleep(0.2)"])
def test_a_clean_exit_announces_exiting(lab: Callable[..., Lab], ending: str) -> None:
    one = lab(2, heartbeat_timeout=0.4)
    keeper = one.spawn(0, "rank.HEARTBEAT_INTERVAL = 0.1; rank.join(timeout=4); say(ok=1); "
                       "time.sleep(10)", world_size=2, ranks=(0, 1))
    leaver = one.spawn(1, f"rank.join(timeout=4)\n{ending}\n", world_size=2, ranks=(0, 1))
    assert keeper.said() == {"ok": 1}
    assert leaver.wait() == 0
    assert wait_for(lambda: one.coord.exited == {1})
    one.coord.mark_dead([1], {"exit": {"code": 0, "signal": None, "lost": None}})
    time.sleep(0.6)  # past the heartbeat timeout too
    assert one.coord.dead.dead_count() == 0


@pytest.mark.parametrize(("ending", "code"), [("sys.exit(3)", 3),
                                              ("raise ValueError('boom')", 1),
                                              ("sys.exit('fatal: no data')", 1)])
def test_a_failing_exit_does_not_announce_exiting(
        lab: Callable[..., Lab], ending: str, code: int) -> None:
    one = lab(2)
    keeper = one.spawn(0, "rank.join(timeout=4); say(ok=1); time.sleep(10)", world_size=2,
                       ranks=(0, 1))
    leaver = one.spawn(1, f"rank.join(timeout=4)\n{ending}\n", world_size=2, ranks=(0, 1))
    assert keeper.said() == {"ok": 1}
    assert leaver.wait() == code
    assert wait_for(lambda: len(one.log.of(Kind.INFO)) >= 1)
    assert one.coord.exited == set()
    one.coord.mark_dead([1], {"exit": {"code": code, "signal": None, "lost": None}})
    assert wait_for(lambda: one.coord.dead.is_dead(1))


# -- in-process error paths (no client is left behind) ----------------------------------------
def test_join_without_an_envelope_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CLUSTER_JSON, raising=False)
    assert not rank_mod.is_launched()
    assert not rank_mod.should_stop() and rank_mod.survivors() == []
    with pytest.raises(RuntimeError, match="FLODL_INTERNAL_CLUSTER_JSON is not set"):
        rank_mod.join(timeout=0.1)


def test_join_times_out_scaled_when_no_coordinator_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(ENV_CLUSTER_JSON, envelope(port, 1, (0,)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV_LOCAL_RANK, "0")
    monkeypatch.setenv("FLODL_NET_TIMEOUT_SCALE", "2")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"could not reach the coordinator at "
                                           rf"127\.0\.0\.1:{port} within 0\.6s"):
        rank_mod.join(timeout=0.3)
    assert 0.5 < time.monotonic() - started < 2.0
    assert rank_mod._client is None


def test_a_rank_with_another_runs_salt_is_turned_away(
        lab: Callable[..., Lab], monkeypatch: pytest.MonkeyPatch) -> None:
    one = lab(1)
    monkeypatch.setenv(ENV_CLUSTER_JSON, envelope(one.coord.port, 1, (0,), salt=bytes(16)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV_LOCAL_RANK, "0")
    with pytest.raises(RuntimeError, match="closed the connection during the handshake"):
        rank_mod.join(timeout=2)
    assert [e.data["reason"] for e in one.log.of(Kind.WARNING)] == ["bad tag"]
    assert rank_mod._client is None and one.coord.joined == set()


@pytest.mark.parametrize(("env", "words"), [
    ({ENV_CLUSTER_JSON: "zz"}, "is not a valid envelope"),
    ({"RANK": "", ENV_LOCAL_RANK: "7"}, "FLODL_INTERNAL_LOCAL_RANK=7 is out of range 0..0"),
    ({"RANK": "x"}, "RANK='x' is not an integer"),
    ({"FLODL_NET_TIMEOUT_SCALE": "0"}, "must be a positive number"),
])
def test_a_bad_environment_is_named(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], words: str) -> None:
    monkeypatch.setenv(ENV_CLUSTER_JSON, envelope(1, 1, (0,)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(ENV_LOCAL_RANK, "0")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match=words):
        rank_mod.join(timeout=0.1)


# -- the framing, one implementation for both ends -------------------------------------------
@given(st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=30) | st.none(),
                       max_size=6),
       st.integers(min_value=0, max_value=2**64 - 1), st.text(min_size=1, max_size=30))
def test_a_frame_round_trips_through_a_socket(
        body: dict[str, Any], seq: int, run_id: str) -> None:
    message = {**body, "type": "membership"}
    frame = encode_frame(SALT, run_id, seq, message)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(frame)
        assert rank_mod.receive(right, bytearray(), SALT, run_id, seq) == message


def test_the_coordinator_uses_the_rank_modules_framing() -> None:
    import fdl_fabric.supervision.coordinator as coordinator

    assert coordinator.encode_frame is rank_mod.encode_frame
    assert coordinator.take_frame is rank_mod.take_frame


def test_the_rank_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(RANK_PY.read_text(encoding="utf-8"))
    names = {alias.name.split(".")[0] for node in ast.walk(tree)
             if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert names - {"__future__"} <= set(sys.stdlib_module_names)
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))


def test_the_rank_module_is_light_to_import() -> None:
    """Every rank of every run imports it at its start: what it loads beyond what its
    framing and sockets need (`typing`, `dataclasses` with `inspect`, `traceback`,
    `random`) was 30 ms a rank, on the hosts' CPUs, before the rank did anything."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from fdl_fabric import rank; "
            "m = rank.Membership(rank=0, world_size=1, local_rank=0, device=None, host='h'); "
            "print(m.rank, m.host, ' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                         text=True, timeout=30, check=True).stdout.split()
    assert out[:2] == ["0", "h"]
    heavy = {"typing", "dataclasses", "inspect", "traceback", "random", "textwrap", "ast"}
    assert heavy.isdisjoint(out[2:]), heavy.intersection(out[2:])
    assert not [m for m in out[2:] if m.startswith("fdl_fabric.") and m != "fdl_fabric.rank"]


def _python39() -> Optional[str]:
    for candidate in [shutil.which("python3.9"),
                      *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))]:
        if not candidate:
            continue
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 9)":
            return candidate
    return None


def test_a_copy_of_rank_py_joins_under_python_3_9(
        lab: Callable[..., Lab], tmp_path: Path) -> None:
    python = _python39()
    if python is None:
        pytest.skip("no Python 3.9 interpreter here")
    shutil.copy(RANK_PY, tmp_path / "rank.py")
    prelude = PRELUDE.replace("import fdl_fabric.rank as rank",
                              f"sys.path.insert(0, {str(tmp_path)!r}); import rank")
    one = lab(1)
    proc = one.spawn(0, JOIN_AND_REPORT, world_size=1, ranks=(0,), python=python,
                     prelude=prelude)
    assert proc.said()["rank"] == 0
    assert proc.wait() == 0
    assert wait_for(lambda: one.coord.exited == {0})
