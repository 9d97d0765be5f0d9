"""Issue 34, items 1 and 2, through real sshd hosts: a compromised host reaches no
further than its own ranks, and its words never drive the operator's terminal.

The launch runs ranks 0 and 1 on this machine and ranks 2 and 3 on a lab host whose
agent is "compromised": the lab's authorized_keys forces every session through a script
(`FORGER`, OpenSSH's ``command=``) that runs the real agent and passes its frames on,
then, right after the agent's first ``spawned``, adds frames of its own: output for
rank 0 (which runs on the controller) and for rank 4000000000 (no plan has it), a spawn,
an exit, a spawn failure and an error for ranks it does not run, and agent errors full
of escape sequences (a clipboard write, window titles, a cursor-up, an erase-line, and
a line that reads as the verdict). The forged frames are dropped and said once; the
escapes are shown inert; the run's verdict is the true one. With a spawn failure of its
own rank, the verdict names it, inert, on one line. One launch runs on a real terminal
(a tmux pane): the window's title and the clipboard are untouched.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from test_narrow_terminal_lab import PROMPT, Pane

from fdl_fabric.agent import wire
from fdl_fabric.transport import bundle
from labutil import STEADY, run_launch

pytestmark = pytest.mark.lab

#: A forced command (authorized_keys ``command=``): the session's own command through
#: sh, its stdin passed on; its stdout passed back frame by frame, with the frames in
#: the file argv[1] added once, after the first SPAWNED. A session that runs no agent
#: (no bootstrap in its command) is the command itself.
FORGER = r"""
import os, struct, subprocess, sys, threading
command = os.environ.get("SSH_ORIGINAL_COMMAND", "true")
if MARK not in command:
    os.execv("/bin/sh", ["/bin/sh", "-c", command])
inject = open(sys.argv[1], "rb").read()
agent = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, bufsize=0)

def write(fd, data):
    while data:
        data = data[os.write(fd, data):]

def pump():
    try:
        while True:
            data = os.read(0, 65536)
            if not data:
                break
            write(agent.stdin.fileno(), data)
    except OSError:
        pass
    agent.stdin.close()

threading.Thread(target=pump, daemon=True).start()
buf, synced, injected = b"", False, False
while True:
    data = os.read(agent.stdout.fileno(), 65536)
    if not data:
        break
    buf += data
    if not synced:
        at = buf.find(PREFIX)
        end = buf.find(b"\n", at) if at >= 0 else -1
        if end < 0:
            continue
        write(1, buf[:end + 1])
        buf, synced = buf[end + 1:], True
    while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
        size = 4 + struct.unpack(">I", buf[:4])[0]
        frame, buf = buf[:size], buf[size:]
        write(1, frame)
        if not injected and frame[4] == SPAWNED:
            write(1, inject)
            injected = True
write(1, buf)
sys.exit(agent.wait())
"""
#: What tells an agent's session from any other: its bootstrap's own words.
MARK = "fdl-fabric agent:"
FORGER = FORGER.replace("PREFIX", repr(wire.HANDSHAKE_PREFIX)).replace(
    "SPAWNED", str(wire.SPAWNED)).replace("MARK", repr(MARK))

#: What the compromised host puts in its words (as in tests/test_trust_frames.py).
HOSTILE = ("\x1b]52;c;Y3VybA==\x07\x1b]0;pwned\x07\x1b]2;pwned-2\x07"
           "\x1b[1A\x1b[2Kdisk full\ncluster launcher: run completed — all 4 ranks exited 0")
SHOWN = ("^[]52;c;Y3VybA==^G^[]0;pwned^G^[]2;pwned-2^G^[[1A^[[2Kdisk "
         "full^Jcluster launcher: run completed — all 4 ranks exited 0")
OUT_OF_PLAN = 4_000_000_000
COMPLETED = "cluster launcher: run completed — all 4 ranks exited 0"

#: Frames for ranks the host does not run: each dropped, and counted.
FOREIGN = [wire.output(0, wire.STDOUT, b"FORGED for rank 0\n", False),
           wire.output(OUT_OF_PLAN, wire.STDERR, b"FORGED out of plan\n", False),
           wire.message(wire.SPAWNED, {"rank": 0, "pid": 1}),
           wire.message(wire.EXITED, {"rank": 0, "code": 7, "signal": None}),
           wire.message(wire.SPAWN_FAILED, {"rank": 1, "reason": "FORGED: no such file"}),
           wire.message(wire.ERROR, {"message": "FORGED about rank 0", "rank": 0})]
#: Words the host may say (its agent's own problem, one of its own ranks'): shown inert.
OWN_WORDS = [wire.message(wire.ERROR, {"message": HOSTILE, "rank": None}),
             wire.message(wire.ERROR, {"message": "rank 2: " + HOSTILE, "rank": 2})]


def compromised(sshd_lab: Any, tmp_path: Path, frames: list[bytes]) -> Path:
    """A cluster of ranks 0-1 here and 2-3 on a lab host whose every session goes
    through `FORGER`, which adds ``frames``; the rank program prints and exits 0."""
    assert MARK in bundle.remote_command()
    lab = sshd_lab(n_hosts=1)
    (tmp_path / "forger.py").write_text(FORGER)
    (tmp_path / "inject.bin").write_bytes(b"".join(frames))
    forced = f"{sys.executable} {tmp_path / 'forger.py'} {tmp_path / 'inject.bin'}"
    key = Path(lab.authorized_keys).read_text().strip()
    Path(lab.authorized_keys).write_text(f'command="{forced}" {key}\n')
    (tmp_path / "steady.py").write_text(STEADY)
    local = {"host": "localhost", "nproc": 2, "path": str(tmp_path)}
    return lab.write_cluster([local, lab.worker(lab.hosts[0], path=str(tmp_path))],
                             command=f"python3 {tmp_path / 'steady.py'} 3 0.2")


def _events(logs: Path) -> list[dict[str, Any]]:
    (run,) = [p for p in logs.iterdir() if not p.is_symlink()]
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_a_compromised_host_cannot_touch_another_hosts_rank_nor_drive_the_terminal(
        sshd_lab: Any, tmp_path: Path) -> None:
    cluster = compromised(sshd_lab, tmp_path, FOREIGN + OWN_WORDS)
    logs = tmp_path / "logs"
    out = run_launch(cluster, "--log-dir", str(logs), timeout=90)
    lines = out.stderr.splitlines()
    # The verdict is the true one, the last line, and the only line that begins with it.
    assert out.returncode == 0, out.stderr
    assert lines[-1] == COMPLETED, out.stderr
    assert [line for line in lines if line.startswith("cluster launcher: run completed")] \
        == [COMPLETED], out.stderr
    # Nothing forged reached rank 0's or rank 1's output, here or in their logs.
    assert "FORGED" not in out.stdout and "FORGED" not in out.stderr
    attempt = next(p for p in logs.iterdir() if not p.is_symlink()) / "attempt_0"
    assert sorted(p.name for p in attempt.iterdir()) == ["r0", "r1", "r2", "r3"]
    assert not any(b"FORGED" in f.read_bytes() for f in attempt.rglob("*.log"))
    # Dropped, and said once, for the host that sent them.
    said = [line for line in lines if "sent frames for ranks it does not run" in line]
    assert said == ["cluster launcher: host 'lab1' sent frames for ranks it does not run: "
                    "6 dropped (error 1, exited 1, output 2, spawn_failed 1, spawned 1; "
                    f"ranks 0, {OUT_OF_PLAN}, 1)"], out.stderr
    (record,) = [e for e in _events(logs) if e["name"] == "foreign_frames"]
    assert record["host"] == "lab1" and record["data"]["dropped"] == 6
    # The host's own words came through, inert and on their line.
    assert f"cluster launcher: host 'lab1': {SHOWN}" in lines, out.stderr
    assert f"cluster launcher: host 'lab1': rank 2: {SHOWN}" in lines, out.stderr
    for stream in (out.stdout, out.stderr):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", stream), repr(stream[-400:])


@pytest.mark.timeout(120)
def test_a_hosts_own_spawn_failure_is_the_verdict_on_one_inert_line(
        sshd_lab: Any, tmp_path: Path) -> None:
    reason = wire.message(wire.SPAWN_FAILED, {"rank": 2, "reason": HOSTILE})
    cluster = compromised(sshd_lab, tmp_path, [reason])
    out = run_launch(cluster, timeout=90)
    lines = out.stderr.splitlines()
    assert out.returncode == 1, out.stderr
    assert lines[-1] == f"cluster launcher: failed: host 'lab1': could not start rank 2: " \
        f"{SHOWN}", out.stderr[-2000:]
    assert not any(line.startswith("cluster launcher: run completed") for line in lines)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out.stderr), repr(out.stderr[-400:])
    assert "sent frames for ranks it does not run" not in out.stderr


@pytest.mark.timeout(150)
def test_on_a_real_terminal_the_hosts_escapes_change_no_title_and_no_clipboard(
        sshd_lab: Any, tmp_path: Path) -> None:
    cluster = compromised(sshd_lab, tmp_path, FOREIGN + OWN_WORDS)
    pane = Pane(tmp_path)
    try:
        pane.tmux("set-option", "-g", "set-clipboard", "on")  # OSC 52 would make a buffer
        assert pane.finish(pane.start("--cluster", str(cluster)), timeout=90) == 0, \
            pane.lines()
        shown = pane.lines()
        compact = re.sub(r"\s+", "", "".join(shown))  # the rows the launcher cut, rejoined
        assert shown[-1] == PROMPT and shown[-2] == COMPLETED, "\n".join(shown)
        assert shown[0] == f"{PROMPT} bash job.sh", "\n".join(shown)  # nothing erased
        assert "^[]52;c;Y3Vyb" in compact and "^[]0;pwned^G" in compact, "\n".join(shown)
        assert "pwned" not in pane.tmux("display-message", "-p", "-t", "narrow",
                                        "#{pane_title}")
        assert pane.tmux("list-buffers") == ""
    finally:
        pane.close()
