"""The worker agent over a pipe, without SSH: it is started exactly as a local launch
starts it (the bundle's bootstrap on its command line, its source on stdin), then
spoken to in frames. Real processes, real signals."""

from __future__ import annotations

import ast
import json
import os
import secrets
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

from fdl_fabric.agent import lines, procs, wire
from fdl_fabric.transport import bundle

RUN_ENV = "FLODL_INTERNAL_RUN_ID"


class AgentPipe:
    """One agent process and the launcher's end of its protocol."""

    def __init__(self, payload: Optional[bytes] = None) -> None:
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", bundle.local_command(sys.executable)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.reader = wire.Reader(wire.UP_TYPES, handshake=True)
        self.pending: list[tuple[int, bytes]] = []
        self.write(payload or bundle.payload())

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, kind: int, obj: Optional[dict[str, Any]] = None) -> None:
        self.write(wire.message(kind, obj))

    def close_input(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def frames(self, timeout: float = 20.0) -> Iterator[tuple[int, bytes]]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            while self.pending:
                yield self.pending.pop(0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError("timed out waiting for agent frames")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            data = os.read(fd, 1 << 20)
            if not data:
                return
            self.pending.extend(self.reader.feed(data))

    def until(self, kind: int, timeout: float = 20.0) -> list[tuple[int, bytes]]:
        """Every frame up to and including the first of ``kind``."""
        seen = []
        for frame in self.frames(timeout):
            seen.append(frame)
            if frame[0] == kind:
                return seen
        raise AssertionError(f"the agent ended before frame {kind}: {seen[-5:]}")

    def exits(self, frames: list[tuple[int, bytes]]) -> dict[int, dict[str, Any]]:
        return {wire.parse_json(b)["rank"]: wire.parse_json(b)
                for k, b in frames if k == wire.EXITED}

    def output(self, frames: list[tuple[int, bytes]], rank: int, stream: int = wire.STDOUT,
               ) -> bytes:
        out = b""
        for k, b in frames:
            if k == wire.OUTPUT:
                r, s, _, data = wire.parse_output(b)
                if r == rank and s == stream:
                    out += data
        return out

    def wait(self, timeout: float = 20.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def agent() -> Iterator[AgentPipe]:
    pipe = AgentPipe()
    yield pipe
    pipe.stop()


def spec(argv: list[str], ranks: int = 1, *, grace: float = 1.0, cwd: str = "/tmp",
         host: str = "localhost", env: Optional[dict[str, str]] = None, start: bool = True,
         run_id: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    run = run_id or f"test-{secrets.token_hex(4)}"
    return {"version": wire.VERSION, "mode": "run", "run_id": run, "cluster": "",
            "host": host, "kill_grace": grace, "cwd": cwd, "argv": argv,
            "env": {RUN_ENV: run, "FLODL_HOST_NAME": host, **(env or {})},
            "ranks": [{"rank": r, "env": {"RANK": str(r)}} for r in range(ranks)],
            "start_now": start, **extra}


def carriers(run_id: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(RUN_ENV) == run_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_every_rank_runs_in_its_own_session_and_each_exit_is_reported_when_it_happens(
        agent: AgentPipe) -> None:
    s = spec(["bash", "-c", 'if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; sleep 0.1'], 2)
    agent.send(wire.SPEC, s)
    frames = agent.until(wire.SPAWNED) + agent.until(wire.SPAWNED)
    pids = [wire.parse_json(b)["pid"] for k, b in frames if k == wire.SPAWNED]
    for pid in pids:
        assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    times: dict[int, float] = {}
    rest = []
    for frame in agent.frames():
        rest.append(frame)
        if frame[0] == wire.EXITED:
            times[wire.parse_json(frame[1])["rank"]] = time.monotonic()
        if frame[0] == wire.DONE:
            break
    exits = agent.exits(rest)
    assert exits[0]["code"] == 0 and exits[1]["code"] == 3
    assert times[1] - times[0] > 0.2  # reported as it happened, not at the end
    assert agent.wait() == 0


def test_a_rank_killed_by_a_signal_is_reported_as_that_signal(agent: AgentPipe) -> None:
    agent.send(wire.SPEC, spec(["bash", "-c", "kill -9 $$"]))
    exits = agent.exits(agent.until(wire.DONE))
    assert exits[0] == {"rank": 0, "code": None, "signal": 9}


def test_eof_on_its_input_stops_every_rank_term_then_kill_after_the_grace(
        agent: AgentPipe) -> None:
    s = spec(["bash", "-c", 'if [ "$RANK" = 1 ]; then trap "" TERM; fi; echo up; '
              "while :; do sleep 0.05; done"], 2, grace=1.0)
    agent.send(wire.SPEC, s)
    frames: list[tuple[int, bytes]] = []
    while sum(1 for k, b in frames if k == wire.OUTPUT) < 2:
        frames.append(next(agent.frames()))
    cut = time.monotonic()
    agent.close_input()
    rest = agent.until(wire.DONE)
    took = time.monotonic() - cut
    exits = agent.exits(rest)
    assert exits[0]["signal"] == signal.SIGTERM
    assert exits[1]["signal"] == signal.SIGKILL
    assert 0.9 < took < 3.0
    assert agent.wait() == 0
    assert carriers(s["run_id"]) == []


def test_sigterm_to_the_agent_stops_its_ranks_like_eof_and_says_it_came_from_outside(
        agent: AgentPipe) -> None:
    s = spec(["sleep", "30"], 2)
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    agent.until(wire.SPAWNED)
    os.kill(agent.proc.pid, signal.SIGTERM)
    frames = agent.until(wire.DONE)
    exits = agent.exits(frames)
    assert {e["signal"] for e in exits.values()} == {signal.SIGTERM}
    kinds = [k for k, _ in frames]
    said = kinds.index(wire.SIGNALED)
    assert said < kinds.index(wire.EXITED), "the cause is told before its effects"
    assert wire.parse_json(frames[said][1]) == {"signal": "TERM", "stopping": True}


def test_a_usr1_sent_to_the_agent_is_passed_on_to_its_ranks_and_reported(
        agent: AgentPipe, tmp_path: Path) -> None:
    mark = tmp_path / "usr1"
    agent.send(wire.SPEC, spec(["bash", "-c", f"trap 'echo got >> {mark}' USR1; echo up; "
                                "while :; do sleep 0.05; done"]))
    agent.until(wire.OUTPUT)
    os.kill(agent.proc.pid, signal.SIGUSR1)
    said = agent.until(wire.SIGNALED)[-1]
    assert wire.parse_json(said[1]) == {"signal": "USR1", "stopping": False, "forwarded": True}
    deadline = time.monotonic() + 5  # `>>` creates the file before echo writes to it
    while not (mark.exists() and mark.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mark.read_text() == "got\n"
    agent.close_input()
    agent.until(wire.DONE)


def test_an_agent_that_stops_hearing_from_the_launcher_stops_its_ranks_after_its_lease(
        agent: AgentPipe) -> None:
    s = spec(["sleep", "60"], 1, lease=wire.LEASE_MIN)
    agent.send(wire.SPEC, s)
    agent.until(wire.SPAWNED)
    pinged_until = time.monotonic() + wire.LEASE_MIN + 1
    while time.monotonic() < pinged_until:  # pings renew the lease: the rank runs on
        agent.send(wire.PING)
        time.sleep(0.5)
    assert len(carriers(s["run_id"])) == 1
    silent = time.monotonic()  # then silence, without an EOF (a stalled srun or link)
    frames = agent.until(wire.DONE, timeout=wire.LEASE_MIN + 10)
    took = time.monotonic() - silent
    errors = [wire.parse_json(b)["message"] for k, b in frames if k == wire.ERROR]
    assert any(f"no word from the launcher for {wire.LEASE_MIN:g}s" in e for e in errors)
    assert agent.exits(frames)[0]["signal"] == signal.SIGTERM
    # the last ping went up to 0.5 s before the silence began: the lease counts from it
    assert wire.LEASE_MIN - 1.0 < took < wire.LEASE_MIN + 3
    assert carriers(s["run_id"]) == []


def test_a_forwarded_signal_reaches_the_rank_and_its_children(agent: AgentPipe,
                                                               tmp_path: Path) -> None:
    mark = tmp_path / "usr1"
    script = (f"trap 'echo got >> {mark}' USR1; bash -c \"trap 'echo child >> {mark}' USR1; "
              "echo ready; while :; do sleep 0.05; done\" & wait $!; wait $!")
    agent.send(wire.SPEC, spec(["bash", "-c", script]))
    agent.until(wire.OUTPUT)
    agent.send(wire.SIGNAL, {"signal": "USR1", "rank": None})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (mark.exists() and
                                               len(mark.read_text().split()) == 2):
        time.sleep(0.02)
    assert sorted(mark.read_text().split()) == ["child", "got"]
    agent.send(wire.STOP)
    agent.until(wire.DONE)


def test_every_signal_frame_is_acted_on(agent: AgentPipe, tmp_path: Path) -> None:
    """The bash wrapper once lost control lines that arrived at a read timeout; frames
    cannot be split that way, and the agent acts on each one."""
    mark = tmp_path / "usr1"
    agent.send(wire.SPEC, spec(["bash", "-c", f"trap 'echo x >> {mark}' USR1; echo ready; "
                                "while :; do sleep 0.01; done"]))
    agent.until(wire.OUTPUT)

    def trapped() -> int:
        return len(mark.read_text().split()) if mark.exists() else 0

    # One at a time: two USR1 that reach bash before it runs its trap are one signal
    # (standard signals do not queue), which says nothing about the agent.
    for sent in range(1, 21):
        agent.send(wire.SIGNAL, {"signal": "USR1", "rank": 0})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and trapped() < sent:
            time.sleep(0.01)
        assert trapped() == sent, f"signal frame {sent} was not acted on"
    agent.send(wire.STOP)
    agent.until(wire.DONE)


def test_an_oversized_frame_ends_the_agent_with_a_clear_error_and_no_hang(
        agent: AgentPipe) -> None:
    agent.write((wire.MAX_FRAME + 1).to_bytes(4, "big") + bytes([wire.SPEC]))
    frames = agent.until(wire.ERROR)
    error = wire.parse_json(frames[-1][1])["message"]
    assert "protocol error" in error and str(wire.MAX_FRAME) in error
    assert agent.wait() == 3


def test_a_spec_of_another_protocol_version_is_refused(agent: AgentPipe) -> None:
    agent.send(wire.SPEC, {**spec(["true"]), "version": 99})
    error = wire.parse_json(agent.until(wire.ERROR)[-1][1])["message"]
    assert "spec version 99" in error
    assert agent.wait() == 3


def test_the_registry_record_is_json_0600_in_a_0700_folder_and_goes_with_the_run(
        agent: AgentPipe) -> None:
    s = spec(["bash", "-c", "echo up; sleep 30"], 2, host="h1 pgid=22602 start=1677925",
             env={"IFS": "x"})
    agent.send(wire.SPEC, s)
    agent.until(wire.OUTPUT)
    agent.until(wire.OUTPUT)
    path = Path(procs.record_path(s["run_id"], s["host"]))
    record = json.loads(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert record["host"] == "h1 pgid=22602 start=1677925"  # a value, never a field
    assert sorted(r["rank"] for r in record["ranks"]) == [0, 1]
    for r in record["ranks"]:
        assert procs.start_time(r["pid"]) == r["start"] > 0
    agent.send(wire.STOP)
    agent.until(wire.DONE)
    assert not path.exists()


def test_a_double_forked_setsid_daemon_is_stopped_when_the_run_ends(agent: AgentPipe,
                                                                      tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    script = f"(setsid bash -c 'echo $$ > {pidfile}; exec sleep 300' &) ; sleep 0.3; exit 0"
    s = spec(["bash", "-c", script])
    agent.send(wire.SPEC, s)
    verified = wire.parse_json(agent.until(wire.VERIFIED)[-1][1])
    daemon = int(pidfile.read_text())
    assert [p["pid"] for p in verified["stopped"]] == [daemon]
    assert verified["remaining"] == []
    assert not psutil.pid_exists(daemon) or \
        psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE
    assert carriers(s["run_id"]) == []


def test_a_200_kb_argv_reaches_the_rank_exactly(agent: AgentPipe) -> None:
    words = [f"w{i:05d}-" + "x" * 90 for i in range(2000)]
    code = "import sys,hashlib;print(len(sys.argv)-1, hashlib.sha256('\\0'.join(sys.argv[1:])" \
           ".encode()).hexdigest())"
    agent.send(wire.SPEC, spec([sys.executable, "-c", code, *words]))
    frames = agent.until(wire.DONE)
    import hashlib

    expected = f"{len(words)} {hashlib.sha256(chr(0).join(words).encode()).hexdigest()}\n"
    assert agent.output(frames, 0).decode() == expected
    assert agent.exits(frames)[0]["code"] == 0


def test_output_arrives_as_whole_lines_and_a_last_line_without_newline_is_flushed(
        agent: AgentPipe) -> None:
    code = ("import os,time\n"
            "os.write(1, b'par'); time.sleep(0.2); os.write(1, b'tial\\nbad \\xff\\xfe\\n')\n"
            "os.write(2, b'no newline at the end')")
    agent.send(wire.SPEC, spec([sys.executable, "-c", code]))
    frames = agent.until(wire.DONE)
    chunks = [wire.parse_output(b) for k, b in frames if k == wire.OUTPUT]
    stdout = [(partial, data) for r, s, partial, data in chunks if s == wire.STDOUT]
    assert stdout == [(False, b"partial\n"), (False, b"bad \xff\xfe\n")] or \
        stdout == [(False, b"partial\nbad \xff\xfe\n")]
    assert agent.output(frames, 0, wire.STDERR) == b"no newline at the end"


@pytest.mark.timeout(60)
def test_a_50_mb_line_is_forwarded_in_bounded_pieces(agent: AgentPipe) -> None:
    size = 50 * 1024 * 1024
    code = f"import os\nb=b'y'*(1<<20)\nfor _ in range({size >> 20}): os.write(1, b)\n" \
           "os.write(1, b'\\n')"
    agent.send(wire.SPEC, spec([sys.executable, "-c", code]))
    total = 0
    biggest = 0
    for kind, body in agent.frames(55):
        if kind == wire.OUTPUT:
            _, _, _, data = wire.parse_output(body)
            total += len(data)
            biggest = max(biggest, len(data))
        if kind == wire.DONE:
            break
    assert total == size + 1
    assert biggest <= wire.MAX_LINE_PIECE + 64 * 1024


def test_a_program_that_cannot_start_is_a_spawn_failure_and_nothing_else_runs(
        agent: AgentPipe) -> None:
    agent.send(wire.SPEC, spec(["no-such-program-fdl"], 3))
    frames = agent.until(wire.DONE)
    failed = [wire.parse_json(b) for k, b in frames if k == wire.SPAWN_FAILED]
    assert failed == [{"rank": 0, "reason": "no-such-program-fdl: not found on PATH"}]
    assert not [k for k, _ in frames if k == wire.SPAWNED]


def test_sigkill_of_the_agent_leaves_its_watchdog_to_stop_every_rank(agent: AgentPipe) -> None:
    s = spec(["bash", "-c", 'trap "" TERM; echo up; sleep 300 & wait'], 2, grace=1.0)
    agent.send(wire.SPEC, s)
    agent.until(wire.OUTPUT)
    agent.until(wire.OUTPUT)
    started = time.monotonic()  # a rank's ``sleep`` forks after its ``up``: not at once
    while len(carriers(s["run_id"])) < 4 and time.monotonic() < started + 5.0:
        time.sleep(0.02)
    assert len(carriers(s["run_id"])) == 4  # two ranks, two sleeps
    killed = time.monotonic()
    os.kill(agent.proc.pid, signal.SIGKILL)
    deadline = killed + 1.0 + 2.0
    while carriers(s["run_id"]) and time.monotonic() < deadline + 1:
        time.sleep(0.05)
    assert carriers(s["run_id"]) == []
    assert time.monotonic() - killed < 1.0 + 2.0
    record = Path(procs.record_path(s["run_id"], s["host"]))
    while record.exists() and time.monotonic() < deadline + 2:  # removed once all are gone
        time.sleep(0.02)
    assert not record.exists()


def test_without_start_now_the_agent_waits_for_start_after_its_preflight(
        agent: AgentPipe, tmp_path: Path) -> None:
    checks = {"path": str(tmp_path / "missing"), "program": "bash", "pyscript": None,
              "path_env": None, "cwd": None, "dial": None}
    agent.send(wire.SPEC, spec(["true"], start=False, checks=checks))
    frames = agent.until(wire.PREFLIGHT)
    values = wire.parse_json(frames[-1][1])["values"]
    assert values["path"] == "missing" and values["prog"].endswith("/bash")
    agent.send(wire.STOP)
    frames = agent.until(wire.DONE)
    assert not [k for k, _ in frames if k == wire.SPAWNED]


# -- pure parts -------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", [sys.implementation.cache_tag, "cpython-00"])
def test_the_agent_runs_from_shipped_code_on_the_same_python_and_from_source_on_another(
        tag: str) -> None:
    agent = AgentPipe(bundle.payload(tag))
    try:
        agent.send(wire.SPEC, spec(["sh", "-c", "echo ran"]))
        frames = agent.until(wire.DONE)
        assert agent.output(frames, 0) == b"ran\n"
        assert agent.exits(frames)[0]["code"] == 0
    finally:
        agent.stop()


def test_login_shell_noise_before_the_handshake_is_skipped_and_kept() -> None:
    reader = wire.Reader(wire.UP_TYPES, handshake=True)
    data = b"Welcome to gpu-a!\n" + wire.HANDSHAKE + wire.message(wire.DONE)
    frames = reader.feed(data[:7]) + reader.feed(data[7:30]) + reader.feed(data[30:])
    assert frames == [(wire.DONE, b"{}")]
    assert reader.noise == b"Welcome to gpu-a!\n"


def test_a_handshake_of_another_version_is_refused_naming_both() -> None:
    reader = wire.Reader(wire.UP_TYPES, handshake=True)
    with pytest.raises(wire.ProtocolError, match=f"version '7'.*speaks {wire.VERSION}"):
        reader.feed(wire.HANDSHAKE_PREFIX + b"7\n")


def test_a_frame_type_that_direction_never_carries_is_a_protocol_error() -> None:
    with pytest.raises(wire.ProtocolError, match="unexpected frame type"):
        wire.Reader(wire.DOWN_TYPES).feed(wire.message(wire.HELLO))


def test_lines_are_cut_at_the_last_newline_and_long_lines_come_in_pieces() -> None:
    splitter = lines.LineSplitter(max_piece=10)
    assert splitter.feed(b"ab\ncd") == [(b"ab\n", False)]
    assert splitter.feed(b"ef\n") == [(b"cdef\n", False)]
    assert splitter.feed(b"x" * 25) == [(b"x" * 10, True), (b"x" * 10, True)]
    assert splitter.feed(b"yy\nz") == [(b"xxxxxyy\n", False)]
    assert splitter.flush() == [(b"z", True)]
    assert splitter.flush() == []


@pytest.mark.timeout(30)
def test_a_line_of_50_mb_in_small_reads_is_cut_in_linear_time() -> None:
    splitter = lines.LineSplitter(max_piece=1 << 20)
    total = 0
    for _ in range(50 * 1024):
        for chunk, _partial in splitter.feed(b"z" * 1024):
            total += len(chunk)
    total += sum(len(c) for c, _ in splitter.feed(b"\n"))
    assert total == 50 * 1024 * 1024 + 1


def test_the_shipped_modules_are_standard_library_only_and_python_3_8() -> None:
    allowed_local = {"fdl_fabric", "fdl_fabric.agent", "fdl_fabric.rank"}
    for path in bundle.source_paths():
        tree = ast.parse(Path(path).read_text(), feature_version=(3, 8))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name in allowed_local or \
                    name.startswith("fdl_fabric.agent"), f"{path} imports {name}"
