"""Hostile input: random flag values and hostile coordinator peers.

Every bad flag is a clear refusal (exit 2, the flag named), never a traceback and never
an unbounded allocation; 500 hostile peers on the coordinator's port cannot make the
launcher hoard memory or fail the run. Random YAML documents get the same treatment in
tests/test_config.py.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
import tracemalloc
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdl_fabric.commands.launch import LaunchOptions
from fdl_fabric.commands.options import launch_options
from fdl_fabric.errors import FdlError
from labutil import ROOT, LiveLaunch

TOY = str(ROOT / "examples" / "toy_train.py")
SETTINGS = {"cluster": "cluster.yml", "log_dir": ""}

text = st.one_of(st.none(), st.text(max_size=40),
                 st.sampled_from(["nan", "inf", "-1", "1e309", "0x10", "50%", "50%%", "   ",
                                  "", "/proc/x", "/dev/null", "3.5", "99999999999999"]))


@settings(deadline=None, max_examples=300)
@given(cluster=text, cmd=text, kill_grace=text, verbose=text, max_failure=text,
       max_restarts=text)
def test_any_flag_values_give_options_or_a_usage_error_naming_the_flag(
        cluster: str | None, cmd: str | None, kill_grace: str | None, verbose: str | None,
        max_failure: str | None, max_restarts: str | None) -> None:
    tracemalloc.start()
    try:
        opts = launch_options({"cluster": cluster, "cmd": cmd, "kill_grace": kill_grace,
                               "verbose": verbose, "max_failure": max_failure,
                               "max_restarts": max_restarts}, command="launch",
                              settings=SETTINGS)
        assert isinstance(opts, LaunchOptions)
    except FdlError as exc:
        assert exc.exit_code == 2
        assert str(exc).startswith(("--cluster:", "--cmd:", "--kill-grace:", "--verbose:",
                                    "--max-failure:", "--max-restarts:")), str(exc)
        assert "\n" not in str(exc).split(":")[0]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 5 * 2**20


def _hostile_peers(port: int, count: int) -> list[socket.socket]:
    """Each announces a frame just under the pre-hello limit and sends all of it but the
    last byte: the most a peer without the salt can make the coordinator hold."""
    from fdl_fabric.supervision.admission import PRE_AUTH_FRAME

    body = PRE_AUTH_FRAME - 1
    peers = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(struct.pack(">I", body) + os.urandom(body - 1))
        peers.append(s)
    return peers


@pytest.mark.timeout(120)
def test_500_hostile_peers_cannot_raise_the_launchers_memory_50_mb_and_the_run_succeeds(
        tmp_path: Path) -> None:
    port = 20000 + os.getpid() % 20000
    cluster = tmp_path / "c.yml"
    cluster.write_text(f"controller: {{host: 127.0.0.1, port: {port}}}\n"
                       f"workers:\n  - host: localhost\n    nproc: 2\n    path: {ROOT}\n")
    logs = tmp_path / "logs"
    launch = LiveLaunch(cluster, "--log-dir", str(logs), "--cmd",
                        f"python3 {TOY} --steps 60 --step-time 0.1 --checkpoint-dir {tmp_path}")
    peers: list[socket.socket] = []
    try:
        launch.wait_line("cohort formed", stderr=True, timeout=30)
        proc = psutil.Process(launch.proc.pid)
        before = proc.memory_info().rss
        peak = before
        for _ in range(5):
            peers += _hostile_peers(port, 100)
            peak = max(peak, proc.memory_info().rss)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.05)
        assert launch.finish(90) == 0, "\n".join(launch.stderr_lines[-20:])
    finally:
        for s in peers:
            s.close()
        launch.kill()
    grew = (peak - before) / 2**20
    print(f"\n500 hostile peers: launcher RSS {before / 2**20:.0f} MB -> peak "
          f"{peak / 2**20:.0f} MB (+{grew:.1f} MB)")
    assert grew < 50
    refused = [line for line in launch.stderr_lines if "cluster coordinator: " in line
               and ("refused" in line or "dropped connection" in line)]
    assert 1 <= len(refused) <= 10, refused
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    counted = sum(e["data"].get("refused", 0) for e in events)
    assert counted >= 244, counted  # every peer over the cap of 256 was dropped, and counted
