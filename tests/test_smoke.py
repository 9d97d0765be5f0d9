"""The collective smoke test (issue 33, item 3): what each host is asked
(`preflight.smoke.requests`), how the answers read (`judge`), what a host's agent does
with its slots (`agent.smokerun.run`: real interpreters, the real torch, stand-in torch
modules for the faults), and the whole of it over real sshd lab hosts.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from venvutil import make_venv

from fdl_fabric import reports
from fdl_fabric.agent import smokerun
from fdl_fabric.clusterfile import load_cluster, parse_cluster
from fdl_fabric.planning.plan import LaunchPlan, build_plan
from fdl_fabric.preflight import smoke
from fdl_fabric.preflight.report import CONTROLLER, Check, Status
from fdl_fabric.testing.processes import free_port

SALT = bytes(range(16))

CPU_CLUSTER = textwrap.dedent("""\
    controller: {host: 10.0.0.1, port: 1337}
    master_port: 29650
    env: {SHARED: cluster}
    workers:
      - host: a
        path: /srv/a
        nproc: 2
        env: {ONLY_A: "only a"}
        ssh: {target: 10.0.0.2}
      - host: b
        path: /srv/b
        nproc: 2
        nccl_socket_ifname: eth0
        ssh: {target: 10.0.0.3}
""")

GPU_CLUSTER = textwrap.dedent("""\
    controller: {host: 10.0.0.1, port: 1337}
    workers:
      - host: g
        path: /srv/g
        local_devices: [0, 1]
        ssh: {target: 10.0.0.2}
""")


def _plan(text: str = CPU_CLUSTER, argv: tuple[str, ...] = ("python3", "train.py"),
          ) -> LaunchPlan:
    cluster = parse_cluster(text, file="cluster.yml", folder="/proj", local_hostname="ctl")
    return build_plan(cluster, argv=list(argv), run_id="run1", salt=SALT, launcher_env={})


def _ok(rank: int, seconds: float = 1.0, collective: float = 0.2) -> dict[str, Any]:
    return {"rank": rank, "ok": True, "seconds": seconds, "collective": collective,
            "error": None, "skipped": None}


def _bad(rank: int, error: str) -> dict[str, Any]:
    return {"rank": rank, "ok": False, "seconds": 5.0, "collective": None, "error": error,
            "skipped": None}


def _skipped(rank: int, python: str = "/usr/bin/python3") -> dict[str, Any]:
    return {"rank": rank, "ok": False, "seconds": 0.1, "collective": None, "error": None,
            "skipped": f"{python}: ModuleNotFoundError: No module named 'torch'"}


def _answer(*slots: dict[str, Any], python: str = "/usr/bin/python3") -> dict[str, Any]:
    return {"python": python, "backend": "gloo", "timeout": 25.0, "slots": list(slots)}


# --------------------------------------------------------------------------------------------
# What each host is asked
# --------------------------------------------------------------------------------------------


def test_each_slot_is_asked_to_run_with_exactly_its_ranks_environment() -> None:
    plan = _plan()
    asked = smoke.requests(plan)
    assert list(asked) == ["a", "b"]
    for host, request in asked.items():
        assert [s["rank"] for s in request["slots"]] == [r.rank for r in plan.host_ranks(host)]
        for slot, rank in zip(request["slots"], plan.host_ranks(host)):
            assert {**request["env"], **slot["env"]} == rank.env
        assert request["cwd"] == plan.host_ranks(host)[0].cwd
        assert request["defaults"] == plan.defaults(host) == {"OMP_NUM_THREADS": "1"}
    b = asked["b"]
    assert b["env"]["GLOO_SOCKET_IFNAME"] == "eth0" and b["env"]["MASTER_PORT"] == "29650"
    assert b["slots"][1]["env"]["RANK"] == "3" and b["env"]["WORLD_SIZE"] == "4"
    assert asked["a"]["env"]["ONLY_A"] == "only a"


def test_the_envelope_secret_is_not_sent_to_the_smoke_test() -> None:
    plan = _plan()
    text = json.dumps(smoke.requests(plan))
    assert plan.envelope_hex("a") not in text and "FDL_CLUSTER_JSON" not in text


def test_the_agents_bound_leaves_the_answers_time_to_come_back_within_the_total() -> None:
    asked = smoke.requests(_plan(), timeout=40)
    assert {r["timeout"] for r in asked.values()} == {40 - smoke.ANSWER_MARGIN}
    assert {r["timeout"] for r in smoke.requests(_plan()).values()} == \
        {smoke.SMOKE_TIMEOUT - smoke.ANSWER_MARGIN}


def test_a_timeout_that_leaves_the_agents_no_time_is_refused() -> None:
    with pytest.raises(ValueError, match="must exceed"):
        smoke.requests(_plan(), timeout=smoke.ANSWER_MARGIN)


def test_the_backend_is_gloo_on_cpu_ranks_and_nccl_where_every_rank_has_a_gpu() -> None:
    assert {r["backend"] for r in smoke.requests(_plan()).values()} == {"gloo"}
    assert {r["backend"] for r in smoke.requests(_plan(GPU_CLUSTER)).values()} == {"nccl"}
    gpu = smoke.requests(_plan(GPU_CLUSTER))["g"]
    assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in gpu["slots"]] == ["0", "1"]


def test_the_interpreter_is_the_ranks_own_else_the_python_key_else_python3() -> None:
    assert smoke.requests(_plan())["a"]["python"] == "python3"
    venv = CPU_CLUSTER.replace("env: {SHARED: cluster}",
                               "env: {SHARED: cluster}\npython: .venv/bin/python")
    assert smoke.requests(_plan(venv))["a"]["python"] == ".venv/bin/python"
    assert smoke.requests(_plan(venv, argv=("./train",)))["a"]["python"] == ".venv/bin/python"
    assert smoke.requests(_plan(argv=("./train",)))["a"]["python"] == "python3"
    assert smoke.requests(_plan(argv=("/opt/py/bin/python3.11", "t.py")))["a"]["python"] == \
        "/opt/py/bin/python3.11"


# --------------------------------------------------------------------------------------------
# How the answers read
# --------------------------------------------------------------------------------------------


def test_a_passing_host_gets_one_ok_row_with_its_time_and_backend() -> None:
    rows = smoke.judge(_plan(), {"a": _answer(_ok(0, 1.4, 0.3), _ok(1, 1.2, 0.25)),
                                 "b": _answer(_ok(2), _ok(3))})
    assert rows[0] == Check("a", "smoke", Status.OK,
                            "ranks 0, 1 all-reduced and passed the barrier in 1.4 s (gloo; "
                            "init, all-reduce and barrier 0.3 s)")
    assert [(r.host, r.status) for r in rows] == [("a", Status.OK), ("b", Status.OK)]


def test_each_failing_slot_is_a_fail_row_naming_its_rank_and_error() -> None:
    rows = smoke.judge(_plan(), {
        "a": _answer(_ok(0), _ok(1)),
        "b": _answer(_bad(2, "RuntimeError: Connection refused"),
                     _bad(3, "did not finish within 25 s (killed)"))})
    assert rows == [
        rows[0],
        Check("b", "smoke", Status.FAIL, "rank 2: RuntimeError: Connection refused"),
        Check("b", "smoke", Status.FAIL, "rank 3: did not finish within 25 s (killed)"),
    ]
    assert rows[0].status is Status.OK


def test_a_host_that_did_not_answer_is_a_fail_row_naming_its_ranks() -> None:
    rows = smoke.judge(_plan(), {"a": _answer(_ok(0), _ok(1)),
                                 "b": {"error": "no answer within 30 s"}})
    assert rows[1] == Check("b", "smoke", Status.FAIL, "ranks 2, 3: no answer within 30 s")
    assert smoke.judge(_plan(), {"a": _answer(_ok(0), _ok(1))})[1].status is Status.FAIL


def test_a_host_with_many_ranks_names_them_as_a_range() -> None:
    eight = CPU_CLUSTER.replace("nproc: 2", "nproc: 8")
    rows = smoke.judge(_plan(eight), {"a": _answer(*[_ok(r) for r in range(8)]),
                                      "b": {"error": "no answer within 30 s"}})
    assert rows[0].reason.startswith("ranks 0-7 all-reduced and passed the barrier in ")
    assert rows[1].reason == "ranks 8-15: no answer within 30 s"


def test_a_rank_the_answer_leaves_out_is_a_fail_row() -> None:
    rows = smoke.judge(_plan(), {"a": _answer(_ok(0)), "b": _answer(_ok(2), _ok(3))})
    assert rows[0] == Check("a", "smoke", Status.FAIL,
                            "rank 1: the agent's answer has no entry for it")


def test_torch_missing_everywhere_is_one_warning_line_for_the_fleet() -> None:
    rows = smoke.judge(_plan(), {"a": _answer(_skipped(0), _skipped(1)),
                                 "b": _answer(_skipped(2), _skipped(3))})
    assert rows == [Check(CONTROLLER, "smoke", Status.WARN,
                          "smoke test skipped: torch is not importable by the ranks' "
                          "interpreter (/usr/bin/python3 on every host: No module named "
                          "'torch')")]


def test_torch_missing_everywhere_with_different_interpreters_names_each() -> None:
    rows = smoke.judge(_plan(), {
        "a": _answer(_skipped(0, "/a/py"), _skipped(1, "/a/py"), python="/a/py"),
        "b": _answer(_skipped(2, "/b/py"), _skipped(3, "/b/py"), python="/b/py")})
    assert len(rows) == 1 and rows[0].status is Status.WARN
    assert "(/a/py on a; /b/py on b: No module named 'torch')" in rows[0].reason


def test_torch_missing_on_some_hosts_only_fails_their_slots_by_name() -> None:
    rows = smoke.judge(_plan(), {
        "a": _answer(_bad(0, "DistStoreError: Timed out after 17 seconds waiting for "
                             "clients. 2/4 clients joined."),
                     _bad(1, "DistStoreError: wait timeout after 17000ms")),
        "b": _answer(_skipped(2, "/venv/bin/python"), _skipped(3, "/venv/bin/python"))})
    assert [(r.host, r.status) for r in rows] == [("a", Status.FAIL)] * 2 + \
        [("b", Status.FAIL)] * 2
    assert rows[2].reason == ("rank 2: torch is not importable by the ranks' interpreter "
                              "(/venv/bin/python: ModuleNotFoundError: No module named "
                              "'torch'), where other ranks' is: the job would wait for this "
                              "rank")
    assert rows[0].reason == ("rank 0: DistStoreError: Timed out after 17 seconds waiting "
                              "for clients. 2/4 clients joined. (likely waiting for ranks 2, "
                              "3, which cannot import torch)")


def test_torch_missing_where_another_host_did_not_answer_is_not_a_skip() -> None:
    rows = smoke.judge(_plan(), {"a": _answer(_skipped(0), _skipped(1)),
                                 "b": {"error": "no answer within 30 s"}})
    assert [r.status for r in rows] == [Status.FAIL] * 3


class _FakeSession:
    """Stands in for an `AgentSession`: what it is sent, it answers on the inbox as the
    host's agent would (or not at all)."""

    def __init__(self, host: str, inbox: queue.SimpleQueue[reports.Report],
                 answer: Callable[[dict[str, Any]], list[reports.Report]]) -> None:
        self.host, self.inbox, self.answer = host, inbox, answer
        self.sent: list[dict[str, Any]] = []

    def send_probe(self, request: dict[str, Any]) -> None:
        self.sent.append(request)
        for report in self.answer(request["smoke"]):
            self.inbox.put(report)


def test_run_smoke_asks_each_host_and_keeps_what_is_not_its_answer() -> None:
    plan = _plan()
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    other = reports.Facts("a", None, versions={"python": "3.11"})
    gone = reports.AgentGone("b", False, "connection lost")

    def answer_a(request: dict[str, Any]) -> list[reports.Report]:
        return [other, reports.Facts("a", None, smoke=_answer(
            *[_ok(s["rank"]) for s in request["slots"]]))]

    sessions = {"a": _FakeSession("a", inbox, answer_a),
                "b": _FakeSession("b", inbox, lambda request: [gone])}
    rows = smoke.run_smoke(plan, sessions, inbox)  # type: ignore[arg-type]
    assert [r.status for r in rows] == [Status.OK, Status.FAIL]
    assert rows[1].reason == ("ranks 2, 3: its agent ended before answering "
                              "(connection lost)")
    assert sessions["b"].sent == [{"smoke": smoke.requests(plan)["b"]}]
    assert [inbox.get_nowait(), inbox.get_nowait()] == [other, gone]
    assert inbox.empty()


def test_a_host_without_an_agent_session_is_a_fail_row() -> None:
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    sessions = {"a": _FakeSession("a", inbox, lambda r: [reports.Facts("a", None, smoke=_answer(
        _ok(0), _ok(1)))])}
    rows = smoke.run_smoke(_plan(), sessions, inbox)  # type: ignore[arg-type]
    assert rows[1] == Check("b", "smoke", Status.FAIL, "ranks 2, 3: no agent to run it")


# --------------------------------------------------------------------------------------------
# On the host: the agent's side, with real interpreters
# --------------------------------------------------------------------------------------------


class _Beats:
    """The agent's ``beat``: sleeps what it is asked, counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, seconds: float) -> None:
        self.calls += 1
        time.sleep(seconds)


def _request(world: int, ranks: list[int], *, python: str = sys.executable,
             cwd: str = "/", timeout: float = 60.0, env: Optional[dict[str, str]] = None,
             **extra: Any) -> dict[str, Any]:
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
              "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1", **(env or {})}
    return {"python": python, "cwd": cwd, "env": common, "defaults": {},
            "slots": [{"rank": r, "env": {"RANK": str(r), "LOCAL_RANK": str(r)}}
                      for r in ranks], "backend": "gloo", "timeout": timeout, **extra}


def _stub_torch(folder: Path, body: str) -> dict[str, str]:
    """A stand-in ``torch`` package whose import runs ``body``; the env that finds it."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": str(folder)}


def _gone(pid: int) -> bool:
    """Whether ``pid`` is gone (or a zombie nobody will run again)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pids: list[int], bound: float = 20.0) -> list[int]:
    """The pids still alive after waiting up to ``bound`` seconds for them to go."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def test_two_slots_with_the_real_torch_all_reduce_and_pass_the_barrier() -> None:
    beats = _Beats()
    answer = smokerun.run(_request(2, [0, 1]), beats)
    assert [s["rank"] for s in answer["slots"]] == [0, 1]
    assert all(s["ok"] and s["error"] is None and s["skipped"] is None
               for s in answer["slots"]), answer
    assert all(s["seconds"] >= s["collective"] > 0 for s in answer["slots"])
    assert answer["backend"] == "gloo" and answer["python"] == sys.executable
    assert beats.calls > 0  # the agent stayed heard while it waited


def test_the_job_finds_master_port_free_right_after_the_smoke_test() -> None:
    request = _request(2, [0, 1])
    first = smokerun.run(request, _Beats())
    again = smokerun.run(request, _Beats())  # the same MASTER_PORT, at once
    assert all(s["ok"] for s in first["slots"] + again["slots"]), (first, again)


def test_slots_whose_peer_never_comes_fail_with_torchs_own_words_before_the_bound() -> None:
    answer = smokerun.run(_request(3, [0, 1], timeout=10), _Beats())
    errors = [s["error"] for s in answer["slots"]]
    assert not any(s["ok"] for s in answer["slots"])
    assert "2/3 clients joined" in errors[0], errors
    # torch's own errors (its store's, or its network's once rank 0 gave up), not the kill
    assert all(e.startswith("Dist") and "killed" not in e for e in errors), errors


def test_nccl_on_a_slot_that_sees_no_gpu_is_named_before_any_collective() -> None:
    request = _request(1, [0], backend="nccl")
    request["slots"][0]["env"]["CUDA_VISIBLE_DEVICES"] = "3"
    slot = smokerun.run(request, _Beats())["slots"][0]  # torch here is a CPU build
    assert slot["error"] == "RuntimeError: no CUDA device visible (CUDA_VISIBLE_DEVICES=3)"


def test_an_interpreter_without_torch_is_answered_skipped_with_its_path(tmp_path: Path) -> None:
    python = make_venv(tmp_path / "venv")
    answer = smokerun.run(_request(2, [0, 1], python=str(python)), _Beats())
    assert [s["skipped"] for s in answer["slots"]] == \
        [f"{python}: ModuleNotFoundError: No module named 'torch'"] * 2
    assert not any(s["ok"] or s["error"] for s in answer["slots"])


def test_a_relative_interpreter_is_found_in_the_ranks_folder(tmp_path: Path) -> None:
    make_venv(tmp_path / ".venv")
    answer = smokerun.run(_request(1, [0], python=".venv/bin/python", cwd=str(tmp_path)),
                          _Beats())
    assert answer["python"] == str(tmp_path / ".venv" / "bin" / "python")
    assert answer["slots"][0]["skipped"]


def test_a_missing_interpreter_fails_every_slot_naming_it() -> None:
    answer = smokerun.run(_request(2, [0, 1], python="no-such-python-here"), _Beats())
    assert [s["error"] for s in answer["slots"]] == \
        ["interpreter no-such-python-here not found on PATH"] * 2


def test_a_torch_that_is_there_but_broken_is_a_failure_not_a_skip(tmp_path: Path) -> None:
    env = _stub_torch(tmp_path, "raise OSError('libtorch_cpu.so: cannot open shared "
                                "object file')\n")
    answer = smokerun.run(_request(1, [0], env=env), _Beats())
    slot = answer["slots"][0]
    assert slot["skipped"] is None and not slot["ok"]
    assert slot["error"].endswith("OSError: libtorch_cpu.so: cannot open shared object file")


def test_a_torch_missing_one_of_its_own_modules_is_a_failure_not_a_skip(
        tmp_path: Path) -> None:
    env = _stub_torch(tmp_path, "import numpy_that_is_not_installed\n")
    slot = smokerun.run(_request(1, [0], env=env), _Beats())["slots"][0]
    assert slot["skipped"] is None
    assert "No module named 'numpy_that_is_not_installed'" in slot["error"]


def test_each_slot_sees_the_merged_environment_and_the_ranks_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "seen"
    out.mkdir()
    env = _stub_torch(tmp_path / "stub", f"""\
        import json, os
        with open({str(out)!r} + "/" + os.environ["RANK"], "w") as fh:
            json.dump({{"env": dict(os.environ), "cwd": os.getcwd()}}, fh)
        raise SystemExit(0)
    """)
    monkeypatch.setenv("FROM_HOST", "host")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("FLODL_INTERNAL_AGENT_THING", "secret")
    request = _request(2, [0, 1], cwd=str(tmp_path),
                       env={**env, "FROM_HOST_TOO": "cluster"},
                       defaults={"OMP_NUM_THREADS": "1", "ONLY_DEFAULT": "d"})
    request["slots"][1]["env"]["CUDA_VISIBLE_DEVICES"] = "7"
    smokerun.run(request, _Beats())
    seen = [json.loads((out / r).read_text()) for r in ("0", "1")]
    for rank, got in enumerate(seen):
        env_seen = got["env"]
        assert got["cwd"] == str(tmp_path)
        assert env_seen["RANK"] == str(rank) and env_seen["WORLD_SIZE"] == "2"
        assert env_seen["FROM_HOST"] == "host" and env_seen["FROM_HOST_TOO"] == "cluster"
        assert env_seen["OMP_NUM_THREADS"] == "4"  # the host's own beats a default
        assert env_seen["ONLY_DEFAULT"] == "d"
        assert "FLODL_INTERNAL_AGENT_THING" not in env_seen
    assert "CUDA_VISIBLE_DEVICES" not in seen[0]["env"]
    assert seen[1]["env"]["CUDA_VISIBLE_DEVICES"] == "7"


_HANG = """\
    import os, subprocess, time
    child = subprocess.Popen(["sleep", "600"])
    with open({pids!r} + "/" + os.environ["RANK"], "w") as fh:
        fh.write("%d %d" % (os.getpid(), child.pid))
    time.sleep(600)
"""


def _pids(folder: Path, count: int, bound: float = 30.0) -> list[int]:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and len(list(folder.iterdir())) < count:
        time.sleep(0.05)
    return [int(p) for f in sorted(folder.iterdir()) for p in f.read_text().split()]


def test_a_slot_that_hangs_is_killed_at_the_bound_with_all_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _stub_torch(tmp_path / "stub", _HANG.format(pids=str(pids)))
    answer = smokerun.run(_request(2, [0, 1], env=env, timeout=3), _Beats())
    assert [s["error"] for s in answer["slots"]] == ["did not finish within 3 s (killed)"] * 2
    assert _wait_gone(_pids(pids, 2)) == []


def test_nothing_a_slot_started_outlives_a_run_that_leaves_early(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _stub_torch(tmp_path / "stub", _HANG.format(pids=str(pids)))

    def beat(seconds: float) -> None:
        if len(list(pids.iterdir())) == 2:
            raise KeyboardInterrupt
        time.sleep(seconds)

    with pytest.raises(KeyboardInterrupt):
        smokerun.run(_request(2, [0, 1], env=env, timeout=60), beat)
    assert _wait_gone(_pids(pids, 2)) == []


def test_the_slots_die_with_a_killed_agent(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _stub_torch(tmp_path / "stub", _HANG.format(pids=str(pids)))
    request = json.dumps(_request(2, [0, 1], env=env, timeout=60))
    agent = subprocess.Popen(
        [sys.executable, "-c", "import json, sys, time\n"
         "from fdl_fabric.agent import smokerun\n"
         "smokerun.run(json.loads(sys.argv[1]), time.sleep)", request],
        start_new_session=True)
    try:
        slots = _pids(pids, 2)[0::2]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        assert _wait_gone(slots) == []  # PR_SET_PDEATHSIG, not the bound (60 s)
    finally:
        with_group = [p for f in pids.iterdir() for p in map(int, f.read_text().split())]
        for pid in with_group:  # only what this test started: its sleeps
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_slot_that_crashes_is_named_with_its_last_line_of_a_long_output(
        tmp_path: Path) -> None:
    env = _stub_torch(tmp_path, """\
        import os, sys
        for i in range(20000):
            sys.stderr.write("noise line %d of a chatty import\\n" % i)
        sys.stderr.write("Segmentation fault in libgloo\\n")
        sys.stderr.flush()
        os._exit(3)
    """)
    slot = smokerun.run(_request(1, [0], env=env), _Beats())["slots"][0]
    assert slot["error"] == "exited 3; it last said: Segmentation fault in libgloo"


# --------------------------------------------------------------------------------------------
# Over real sshd lab hosts, through their agents
# --------------------------------------------------------------------------------------------


@contextmanager
def _agents(cluster_file: Path) -> Iterator[tuple[Any, dict[str, Any],
                                                  queue.SimpleQueue[reports.Report]]]:
    """The cluster, one started agent per host and their inbox; every agent dismissed
    (the leash) and every connection closed at the end."""
    from fdl_fabric.transport import for_cluster, resolve_settings
    from fdl_fabric.transport.fanout import close_all
    from fdl_fabric.transport.session import AgentSession

    cluster = load_cluster(str(cluster_file))
    transports = for_cluster(cluster, resolve_settings(cluster))
    inbox: queue.SimpleQueue[reports.Report] = queue.SimpleQueue()
    sessions: dict[str, AgentSession] = {}
    try:
        for host, transport in transports.items():
            transport.connect()
            sessions[host] = AgentSession(transport, inbox.put)
            sessions[host].start()
        yield cluster, sessions, inbox
    finally:
        for session in sessions.values():
            session.close_input()
        gone: set[str] = set()
        deadline = time.monotonic() + 10
        while gone != set(sessions) and time.monotonic() < deadline:
            try:
                report = inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(report, reports.AgentGone):
                gone.add(report.host)
        for session in sessions.values():
            if session.host not in gone:
                session.abandon()
            session.join(5)
        close_all(transports.values())


def _lab_plan(cluster: Any) -> LaunchPlan:
    return build_plan(cluster, argv=["python3", "train.py"], run_id="smoke-lab", salt=SALT)


@pytest.mark.lab
def test_two_lab_hosts_with_two_ranks_each_pass_on_gloo(sshd_lab) -> None:
    lab = sshd_lab(n_hosts=2)
    cluster_file = lab.write_cluster([lab.worker(h) for h in lab.hosts],
                                     master_port=free_port("127.0.0.1"),
                                     python=sys.executable)
    with _agents(cluster_file) as (cluster, sessions, inbox):
        rows = smoke.run_smoke(_lab_plan(cluster), sessions, inbox, timeout=90)
    assert [(r.host, r.name, r.status) for r in rows] == \
        [("lab1", "smoke", Status.OK), ("lab2", "smoke", Status.OK)], rows
    assert rows[0].reason.startswith("ranks 0, 1 all-reduced and passed the barrier in ")
    assert rows[1].reason.startswith("ranks 2, 3 all-reduced and passed the barrier in ")
    assert rows[0].reason.endswith(" s)") and "(gloo; " in rows[0].reason


@pytest.mark.lab
def test_a_lab_host_whose_interpreter_lacks_torch_is_named_and_its_peers_do_not_hang(
        sshd_lab, tmp_path: Path) -> None:
    lab = sshd_lab(n_hosts=2)
    bare = make_venv(tmp_path / "no-torch")
    cluster_file = lab.write_cluster(
        [lab.worker(lab.hosts[0]), lab.worker(lab.hosts[1], python=str(bare))],
        master_port=free_port("127.0.0.1"), python=sys.executable)
    with _agents(cluster_file) as (cluster, sessions, inbox):
        rows = smoke.run_smoke(_lab_plan(cluster), sessions, inbox, timeout=20)
    assert [(r.host, r.status) for r in rows] == [("lab1", Status.FAIL)] * 2 + \
        [("lab2", Status.FAIL)] * 2, rows
    assert [r.reason for r in rows[2:]] == [
        f"rank {n}: torch is not importable by the ranks' interpreter ({bare}: "
        "ModuleNotFoundError: No module named 'torch'), where other ranks' is: the job "
        "would wait for this rank" for n in (2, 3)]
    assert rows[0].reason.startswith("rank 0: ") and rows[1].reason.startswith("rank 1: ")
    assert all(r.reason.endswith("(likely waiting for ranks 2, 3, which cannot import torch)")
               for r in rows[:2])
    assert "no answer" not in rows[0].reason + rows[1].reason  # they ended in the bound
