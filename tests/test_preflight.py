"""prebuild-check without SSH: sentinel parsing, every verdict, the report, local hosts.

The verdicts are pure functions of what a host's agent and its sh probe said, so each
rule is pinned here with a synthetic host; the local-worker tests start a real agent and
run the real probe with bash.
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest

from fdl_fabric.agent import checks, gpus
from fdl_fabric.clusterfile import WorkerSpec, load_cluster, parse_cluster
from fdl_fabric.events import Name, event
from fdl_fabric.planning.envelope import PrebuiltBinary
from fdl_fabric.preflight import (
    CONTROLLER,
    SENTINEL,
    Check,
    ControllerFacts,
    Dial,
    HostFacts,
    HostPlan,
    Report,
    Status,
    agent_checks,
    check_cluster,
    evaluate,
    parse_libc,
    parse_sentinels,
    probe_script,
    run_checks,
)
from fdl_fabric.presentation.output import Console, check_table, use_color
from fdl_fabric.presentation.words import render

ROOT = Path(__file__).resolve().parent.parent
GLIBC = "ldd (Debian GLIBC 2.36-9+deb12u4) 2.36"
CTL = ControllerFacts(arch="x86_64", libc=GLIBC, identity="net:[1] boot", port=1337)


def _worker(**fields: Any) -> WorkerSpec:
    body = {"host": "gpu1", "path": "/srv/proj", "nproc": 1, **fields}
    if "local_devices" in fields:
        body.pop("nproc")
    doc = {"workers": [body]}
    return parse_cluster(json.dumps(doc), file="c.yml", folder="/proj",
                         local_hostname="ctl").workers[0]


def _plan(worker: Optional[WorkerSpec] = None, *, fast: bool = False,
          argv: tuple[str, ...] = ("python3", "train.py"), **kw: Any) -> HostPlan:
    return HostPlan(worker=worker or _worker(), fast=fast, argv=argv, **kw)


def _values(**overrides: str) -> dict[str, str]:
    """What a healthy host prints."""
    v = {"clock": "1000.5", "python": "3.11", "path": "ok", "disk_kb": str(50 * 1024 * 1024),
         "prog": "/usr/bin/python3", "pyscript": "ok", "arch": "x86_64", "libc": GLIBC,
         "pyspy": "/usr/local/bin/py-spy", "end": "1"}
    v.update(overrides)
    return {k: val for k, val in v.items() if val is not None}


def _row(rows: list[Check], name: str) -> Check:
    matches = [r for r in rows if r.name == name]
    assert len(matches) == 1, rows
    return matches[0]


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def test_sentinels_are_found_among_rc_file_noise_and_the_first_value_wins() -> None:
    text = (f"Welcome to gpu1!\nnoise without newline{SENTINEL} path=ok\n"
            f"{SENTINEL} libc=ldd (GNU libc) 2.39\r\n{SENTINEL} path=missing\n"
            f"{SENTINEL} empty=\nnot a {SENTINEL}line\n")
    assert parse_sentinels(text) == {"path": "ok", "libc": "ldd (GNU libc) 2.39", "empty": ""}


@pytest.mark.parametrize(("line", "want"), [
    (GLIBC, ("glibc", "2.36")),
    ("ldd (GNU libc) 2.39", ("glibc", "2.39")),
    ("ldd (Ubuntu GLIBC 2.35-0ubuntu3.1) 2.35", ("glibc", "2.35")),
    ("musl libc (x86_64)", ("musl", "")),
    ("sh: 1: ldd: not found", ("unknown", "")),
    ("", ("unknown", "")),
])
def test_libc_is_told_from_the_first_line_of_ldd_version(line: str, want: tuple[str, str]) -> None:
    assert parse_libc(line) == want


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------


def test_a_healthy_host_is_all_ok_and_fast_mode_keeps_only_the_launch_checks() -> None:
    dial = Dial("10.0.0.1", 1337, "tok", False, "10.0.0.1", 1337, 1337)
    facts = HostFacts(_values(dial="ok"), shell_ms=12, clock_ref=1000.4,
                      clock_error=0.001)
    rows = evaluate(_plan(dial=dial), facts, CTL)
    assert [r.name for r in rows] == ["shell", "paths", "program", "platform", "stacks", "clock",
                                     "port"]
    assert all(r.status is Status.OK for r in rows), rows
    fast = evaluate(_plan(fast=True, dial=dial), facts, CTL)
    assert [r.name for r in fast] == ["paths", "program", "port"]


def test_a_script_that_did_not_finish_is_one_probe_failure() -> None:
    rows = evaluate(_plan(), HostFacts({"path": "ok"}, exit_status=2,
                                       stderr="sh: 1: Syntax error\n"), CTL)
    assert rows == [Check("gpu1", "probe", Status.FAIL,
                          "the check script did not finish (exit 2): sh: 1: Syntax error")]


def test_shell_without_a_python_for_the_agent_fails_and_a_slow_start_warns() -> None:
    row = _row(evaluate(_plan(), HostFacts(_values(python=""), shell_ms=5), CTL), "shell")
    assert row.status is Status.FAIL and "needs python3 3.8 or newer" in row.reason
    row = _row(evaluate(_plan(), HostFacts(_values(python="3.6"), shell_ms=5), CTL), "shell")
    assert row.status is Status.FAIL and "found 3.6" in row.reason
    row = _row(evaluate(_plan(), HostFacts(_values(), shell_ms=5), CTL), "shell")
    assert row.status is Status.OK and "python3 3.11 for the agent" in row.reason
    row = _row(evaluate(_plan(), HostFacts(_values(), shell_ms=340), CTL), "shell")
    assert row.status is Status.WARN and "shell start-up 340 ms" in row.reason


def test_paths_missing_fails_and_a_tilde_path_is_looked_up_in_the_home_there() -> None:
    row = _row(evaluate(_plan(), HostFacts(_values(path="missing", prog="!nocwd")), CTL), "paths")
    assert row == Check("gpu1", "paths", Status.FAIL, "path /srv/proj does not exist")
    tilde = _plan(_worker(path="~/proj"))
    assert agent_checks(tilde)["path"] == "~/proj"  # the agent expands it (test_agent_checks)
    row = _row(evaluate(_plan(), HostFacts(_values(path="unreadable")), CTL), "paths")
    assert "not readable" in row.reason


def test_low_disk_space_warns_with_the_figure() -> None:
    row = _row(evaluate(_plan(), HostFacts(_values(disk_kb=str(300 * 1024))), CTL), "paths")
    assert row.status is Status.WARN and "only 300.0 MiB free" in row.reason


def test_program_verdicts() -> None:
    def program(argv: tuple[str, ...] = ("python3", "train.py"), **v: str) -> Check:
        return _row(evaluate(_plan(argv=argv), HostFacts(_values(**v)), CTL), "program")

    assert program().reason == "python3 -> /usr/bin/python3, train.py exists"
    missing = program(("nosuchprog-xyz",), prog="")
    assert missing.status is Status.FAIL and "`nosuchprog-xyz` not found" in missing.reason
    script = program(pyscript="missing")
    assert script.status is Status.FAIL and "train.py does not exist" in script.reason
    rel = program(("./run.sh",), prog="!missing")
    assert rel.status is Status.FAIL and "does not exist from /srv/proj" in rel.reason
    noexec = program(("./run.sh",), prog="!noexec")
    assert noexec.status is Status.FAIL and "not executable" in noexec.reason
    nocwd = program(("./run.sh",), prog="!nocwd")
    assert nocwd.status is Status.WARN  # the paths row carries the failure
    script_nocwd = program(pyscript="nocwd")
    assert script_nocwd.status is Status.WARN and "train.py not checked" in script_nocwd.reason


def test_prebuild_program_and_cwd_are_checked_under_the_worker_path() -> None:
    entry = PrebuiltBinary(bin="target/release/train", ld_library_path="", cwd_subpath="run")
    plan = _plan(prebuilt=entry)
    assert plan.program == "/srv/proj/target/release/train" and plan.cwd == "/srv/proj/run"
    rows = evaluate(plan, HostFacts(_values(prog="!missing", cwd="missing")), CTL)
    assert _row(rows, "program").status is Status.FAIL
    assert "prebuilt binary /srv/proj/target/release/train" in _row(rows, "program").reason
    paths = _row(rows, "paths")
    assert paths.status is Status.FAIL and "prebuild cwd /srv/proj/run does not exist" in \
        paths.reason


def test_platform_mismatches() -> None:
    def platform(plan: Optional[HostPlan] = None, **v: str) -> Check:
        return _row(evaluate(plan or _plan(), HostFacts(_values(**v)), CTL), "platform")

    assert platform().status is Status.OK
    arm = platform(arch="aarch64")
    assert arm.status is Status.FAIL and "aarch64 here, x86_64 on the controller" in arm.reason
    musl = platform(libc="musl libc (x86_64)")
    assert musl.status is Status.FAIL and "musl here, glibc on the controller" in musl.reason
    assert platform(libc="sh: ldd: not found").status is Status.WARN
    old = PrebuiltBinary(bin="train", ld_library_path="")
    assert platform(_plan(prebuilt=old), libc="ldd (GNU libc) 2.31").status is Status.WARN
    assert platform(libc="ldd (GNU libc) 2.31").status is Status.OK  # no native binary shipped


def _gpus(devices: Any, **v: str) -> Check:
    return _row(evaluate(_plan(_worker(local_devices=devices)), HostFacts(_values(**v)), CTL),
                "gpus")


def test_gpus_missing_indices_fail_naming_them() -> None:
    row = _gpus([0, 1, 2], gpu_rc="0", gpus="0, GPU-a;1, GPU-b;", gpu_apps="")
    assert row == Check("gpu1", "gpus", Status.FAIL, "GPU 2 not found (nvidia-smi lists 0, 1)")


def test_gpus_without_nvidia_smi_fail_and_all_needs_one_gpu() -> None:
    row = _gpus([0], gpu_rc="missing")
    assert row.status is Status.FAIL and "nvidia-smi is not on this host's PATH" in row.reason
    row = _gpus("all", gpu_rc="0", gpus="", gpu_apps="")
    assert row.status is Status.FAIL and "lists no GPU" in row.reason
    row = _gpus("all", gpu_rc="9", gpus="NVIDIA-SMI has failed;", gpu_apps="")
    assert row.status is Status.FAIL and "status 9" in row.reason


def test_a_busy_gpu_warns_only_when_the_worker_uses_it() -> None:
    listing = {"gpu_rc": "0", "gpus": "0, GPU-a;1, GPU-b;", "gpu_apps": "GPU-b, 4242;"}
    row = _gpus([1], **listing)
    assert row.status is Status.WARN and "GPU 1: pid 4242" in row.reason
    assert _gpus([0], **listing) == Check("gpu1", "gpus", Status.OK,
                                          "GPU 0 present, no compute process")
    assert _gpus("all", **listing).status is Status.WARN


def test_data_path_must_exist() -> None:
    plan = _plan(_worker(data_path="/data/imagenet"))
    row = _row(evaluate(plan, HostFacts(_values(data="missing")), CTL), "data_path")
    assert row == Check("gpu1", "data_path", Status.FAIL, "data_path /data/imagenet does not exist")
    assert _row(evaluate(plan, HostFacts(_values(data="ok")), CTL), "data_path").status is \
        Status.OK


def test_clock_skew_above_two_seconds_warns() -> None:
    def clock(remote: str, ref: float) -> Check:
        facts = HostFacts(_values(clock=remote), clock_ref=ref, clock_error=0.002)
        return _row(evaluate(_plan(), facts, CTL), "clock")

    assert clock("1000.250", 1000.0).reason == "+0.250 s vs the controller (±0.002 s)"
    late = clock("997.0", 1000.0)
    assert late.status is Status.WARN and late.reason.startswith("-3.000 s")
    assert clock("1000.%N", 1000.0).status is Status.WARN  # busybox date


def _port(dial: Dial, worker: Optional[WorkerSpec] = None, **facts: Any) -> Check:
    values = _values(**facts.pop("values", {}))
    return _row(evaluate(_plan(worker, dial=dial), HostFacts(values, **facts), CTL), "port")


def test_port_reached_only_with_this_controllers_token_and_unreached_only_warns() -> None:
    # The launcher's ranks reach the coordinator through their agent: only a rank run by
    # hand dials the port, so prebuild-check warns and never fails on it.
    dial = Dial("127.0.0.1", 5000, "tok", False, "127.0.0.1", 5000, 5000)
    assert _port(dial, values={"dial": "ok"}).status is Status.OK
    other = _port(dial, values={"dial": "?bad tag"})
    assert other.status is Status.WARN and "not this controller" in other.reason
    refused = _port(dial, values={"dial": "!Connection refused"})
    assert refused.status is Status.WARN and "Connection refused" in refused.reason
    assert "controller.host is a loopback address" in refused.reason
    assert "only a rank run by hand on this host dials it" in refused.reason
    facts = HostFacts(_values(dial="!Connection refused"))
    fast = _row(evaluate(_plan(fast=True, dial=dial), facts, CTL), "port")
    assert fast.status is Status.WARN and "run by hand" in fast.reason
    bind_all = Dial("0.0.0.0", 5000, "tok", False, "0.0.0.0", 5000, 5000)
    row = _port(bind_all, values={"dial": "ok"})
    assert row.status is Status.WARN and "means \"every address\"" in row.reason
    stand_in = Dial("10.0.0.1", 6000, "tok", False, "10.0.0.1", 6000, 5000)
    row = _port(stand_in, values={"dial": "ok"})
    assert row.status is Status.OK and "stand-in port 6000" in row.reason


def test_a_tunnel_to_a_host_sharing_the_controllers_loopback_is_explained() -> None:
    dial = Dial("127.0.0.1", 5000, "tok", True, "127.0.0.1", 5000, 5000)
    same = _port(dial, values={"netns": CTL.identity}, tunnel_error="TCP forwarding request denied")
    assert same.status is Status.FAIL and "shares the controller's machine" in same.reason
    other = _port(dial, values={"netns": "net:[2] boot"}, tunnel_error="denied")
    assert other.status is Status.FAIL and "something listening there already" in other.reason
    ok = _port(dial, values={"dial": "ok"})
    assert ok.status is Status.OK and "through the SSH tunnel" in ok.reason


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------

ROWS = [
    Check(CONTROLLER, "port", Status.OK, "127.0.0.1:1337 is free"),
    Check("gpu-a", "paths", Status.FAIL, "path /srv does not exist"),
    Check("gpu-a", "shell", Status.WARN, "shell start-up 340 ms [bold]not markup[/bold]"),
]


def test_exit_code_and_failed_rows() -> None:
    assert Report(ROWS).exit_code() == 1 and Report(ROWS).failed() == [ROWS[1]]
    assert Report([ROWS[0], ROWS[2]]).exit_code() == 0  # warnings do not block


def test_json_shape() -> None:
    data = Report(ROWS).to_json()
    assert data["ok"] is False and set(data) == {"checks", "ok"}
    assert data["checks"][1] == {"host": "gpu-a", "check": "paths", "status": "FAIL",
                                 "reason": "path /srv does not exist"}
    assert Report(ROWS[:1]).to_json()["ok"] is True


def test_plain_table_is_aligned_one_line_per_check() -> None:
    lines = render(event(Name.CHECK_REPORT, **Report(ROWS).to_json())).splitlines()
    assert lines[0].split() == ["host", "check", "status", "detail"]
    assert len(lines) == 2 + len(ROWS) and "\x1b" not in "".join(lines)
    assert lines[3].startswith("gpu-a         paths  FAIL    path /srv does not exist")
    columns = {line.index(status) for line, status in zip(lines[2:], ("ok", "FAIL", "warn"))}
    assert len(columns) == 1


def test_color_table_is_rich_and_does_not_interpret_markup_in_reasons() -> None:
    text = check_table(Report(ROWS).to_json()["checks"])
    assert "\x1b[" in text and "[bold]not markup[/bold]" in text


def test_colors_only_on_a_tty_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty()) and not use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())


# --------------------------------------------------------------------------------------------
# The host script, run for real on local workers
# --------------------------------------------------------------------------------------------


def test_the_agent_takes_hostile_paths_as_data(tmp_path: Path) -> None:
    weird = tmp_path / "it's a $(touch pwned) `dir` \"x\""
    weird.mkdir()
    plan = _plan(_worker(path=str(weird), data_path=str(weird / "nope")), argv=("./run.sh",))
    (weird / "run.sh").write_text("#!/bin/sh\n")
    (weird / "run.sh").chmod(0o755)
    values = checks.gather(agent_checks(plan), b"k" * 16, "run", "gpu1")
    assert values["path"] == "ok" and values["prog"] == os.path.join(weird, "./run.sh")
    assert values["data"] == "missing"
    assert values["end"] == "1" and not (tmp_path / "pwned").exists()


def test_the_sh_probe_measures_only_what_the_agent_cannot_say(tmp_path: Path) -> None:
    out = subprocess.run(["bash", "-c", probe_script(_plan())], capture_output=True,
                         text=True, cwd=tmp_path, check=True).stdout
    values = parse_sentinels(out)
    assert set(values) == {"clock", "python", "end"} and values["end"] == "1"
    assert set(parse_sentinels(subprocess.run(
        ["bash", "-c", probe_script(_plan(fast=True))], capture_output=True, text=True,
        check=True).stdout)) == {"end"}


def _local_cluster(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.yml"
    path.write_text(textwrap.dedent(body))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_healthy_local_worker(tmp_path: Path) -> None:
    cluster = load_cluster(_local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers:
          - host: localhost
            nproc: 1
            path: {ROOT}
            data_path: {tmp_path}
        """))
    report = run_checks(cluster, argv=["python3", "tests/progs/rankprobe.py"])
    assert report.exit_code() == 0, report.to_json()
    names = [(c.host, c.name) for c in report.checks]
    assert names == [(CONTROLLER, "port"), *(("localhost", n) for n in (
        "shell", "paths", "program", "platform", "stacks", "data_path", "port"))]


def test_a_busy_controller_port_fails_and_workers_dial_a_stand_in(tmp_path: Path) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    try:
        cluster = load_cluster(_local_cluster(tmp_path, f"""\
            controller: {{port: {port}}}
            workers: [{{host: localhost, nproc: 1, path: {tmp_path}}}]
            """))
        report = run_checks(cluster, argv=["true"], fast=True)
    finally:
        blocker.close()
    ctl = _row([c for c in report.checks if c.host == CONTROLLER], "port")
    assert ctl.status is Status.FAIL and f"pid {os.getpid()}" in ctl.reason
    worker = _row([c for c in report.checks if c.host == "localhost"], "port")
    assert worker.status is Status.OK and "stand-in port" in worker.reason
    assert report.exit_code() == 1


def test_prebuild_envelope_rows(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    binary = tmp_path / "bin" / "train"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    cluster = load_cluster(_local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, nproc: 1, path: {tmp_path}}}]
        """))

    def check(raw: str) -> Report:
        return run_checks(cluster, argv=["python3", "x.py"], fast=True,
                          environ={"FLODL_INTERNAL_PREBUILD_PER_HOST": raw})

    bad = check("{not json")
    assert bad.checks[0].name == "prebuild" and bad.checks[0].status is Status.FAIL
    stray = check('{"localhost": {"bin": "bin/train"}, "gpu-z": {"bin": "x"}}')
    assert stray.checks[0].status is Status.FAIL and "gpu-z" in stray.checks[0].reason
    good = check('{"localhost": {"bin": "bin/train", "cwd_subpath": "work"}}')
    rows = [c for c in good.checks if c.host == "localhost"]
    assert _row(rows, "program").status is Status.OK
    assert "prebuild cwd" in _row(rows, "paths").reason
    assert _row(rows, "paths").status is Status.FAIL  # work/ does not exist
    (tmp_path / "work").mkdir()
    assert check('{"localhost": {"bin": "bin/train", "cwd_subpath": "work"}}').exit_code() == 0


def test_no_command_is_one_controller_failure(tmp_path: Path) -> None:
    cluster = load_cluster(_local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, nproc: 1, path: {tmp_path}}}]
        """))
    report = run_checks(cluster, argv=[], fast=True)
    assert report.checks[0] == Check(CONTROLLER, "command", Status.FAIL, report.checks[0].reason)
    assert [c.name for c in report.checks if c.host == "localhost"] == ["paths", "port"]


# --------------------------------------------------------------------------------------------
# main()
# --------------------------------------------------------------------------------------------


def test_check_cluster_exit_codes_and_json(tmp_path: Path) -> None:
    def console() -> tuple[Console, io.StringIO, io.StringIO]:
        out, err = io.StringIO(), io.StringIO()
        return Console(out, err, color=False), out, err

    c, out, err = console()
    assert check_cluster(str(tmp_path / "missing.yml"), console=c) == 2
    assert "file not found" in err.getvalue()
    cluster = _local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, nproc: 1, path: {tmp_path}}}]
        """)
    c, out, err = console()
    assert check_cluster(str(cluster), cmd="echo 'unbalanced", console=c) == 2
    c, out, err = console()
    assert check_cluster(str(cluster), cmd="true", as_json=True, console=c) == 0
    data = json.loads(out.getvalue())
    assert data["ok"] is True and {c["check"] for c in data["checks"]} >= {"paths", "port"}
    c, out, err = console()
    assert check_cluster(str(cluster), fast=True, words=["nosuchprog-xyz", "a b"],
                         console=c) == 1
    assert "`nosuchprog-xyz` not found" in out.getvalue()
    assert "prebuild-check: FAILED: 1 FAIL" in out.getvalue()


def test_a_host_without_py_spy_gets_a_warning_naming_the_extra_to_install() -> None:
    row = _row(evaluate(_plan(), HostFacts(_values(pyspy=""), shell_ms=5), CTL), "stacks")
    assert row.status is Status.WARN and "pip install fdl-fabric[stacks]" in row.reason
    ok = _row(evaluate(_plan(), HostFacts(_values(), shell_ms=5), CTL), "stacks")
    assert ok.status is Status.OK and "/usr/local/bin/py-spy" in ok.reason


@pytest.mark.parametrize(("argv", "target"), [
    (["python3", "train.py", "--lr", "1"], ("script", "train.py")),
    (["/venv/bin/python", "-u", "train.py"], ("script", "train.py")),
    (["python3.11", "-W", "ignore", "-X", "dev", "-OB", "run"], ("script", "run")),
    (["python", "-u", "-m", "pkg.train", "--x"], ("module", "pkg.train")),
    (["python3", "-mpkg.train"], ("module", "pkg.train")),
    (["python3", "-c", "print(1)"], None),
    (["python3", "-"], None),
    (["python3"], None),
    (["torchrun", "train.py"], None),
])
def test_the_script_or_module_of_a_python_command_is_read_past_its_options(
        argv: list[str], target: object) -> None:
    from fdl_fabric.preflight.probe import python_target

    assert python_target(argv) == target


# --------------------------------------------------------------------------------------------
# One gatherer: the host's agent answers both pre-flights
# --------------------------------------------------------------------------------------------


def test_prebuild_check_asks_the_agent_what_a_launch_asks_and_more_only_in_full_mode() -> None:
    dial = Dial("127.0.0.1", 5000, "tok", True, "127.0.0.1", 5000, 5000)
    worker = _worker(local_devices=[0], data_path="/data")
    fast, full = agent_checks(_plan(worker, fast=True, dial=dial)), \
        agent_checks(_plan(worker, dial=dial))
    assert {k for k, v in fast.items() if v} == {"path", "program", "pyscript", "dial", "netns",
                                                 "gpus"}
    assert {k for k, v in full.items() if v} == {
        "path", "program", "pyscript", "dial", "netns", "platform", "pyspy", "gpus", "data"}
    # a launch asks the GPUs' health (cheap), prebuild-check also their listing and a matmul
    assert fast["gpus"]["health"] and not fast["gpus"]["listing"] and not fast["gpus"]["matmul"]
    assert full["gpus"]["listing"] and full["gpus"]["matmul"]


def test_the_agent_gathers_every_host_fact_of_the_full_preflight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "proj").mkdir()
    plan = _plan(_worker(path="~/proj", local_devices=[0], data_path="~/proj"),
                 dial=Dial("127.0.0.1", 5000, "tok", True, "127.0.0.1", 5000, 5000))
    checks_ = {**agent_checks(plan), "dial": None}
    values = checks.gather(checks_, b"k" * 16, "run", "gpu1")
    assert values["path"] == "ok" and values["data"] == "ok"  # ~ is the home here
    assert values["arch"] == os.uname().machine and "libc" in values and "pyspy" in values
    assert values["gpu_rc"] in ("missing", "0") or values["gpu_rc"].isdigit()
    assert values["netns"] == checks.loopback_identity() != ""
    assert "dial" not in values and values["end"] == "1"


def test_the_controller_is_measured_by_the_agents_own_gatherer(tmp_path: Path) -> None:
    cluster = load_cluster(_local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, nproc: 1, path: {tmp_path}}}]
        """))
    report = run_checks(cluster, argv=["true"])
    platform = _row([c for c in report.checks if c.host == "localhost"], "platform")
    assert platform.status is Status.OK and "(same as the controller)" in platform.reason


def test_an_agent_that_gave_no_facts_is_one_probe_failure_beside_the_shell_row() -> None:
    facts = HostFacts({"python": "3.6", "end": "1"}, shell_ms=5,
                      agent_error="the agent never started")
    rows = evaluate(_plan(), facts, CTL)
    assert [(r.name, r.status) for r in rows] == [("shell", Status.FAIL), ("probe", Status.FAIL)]
    assert rows[1].reason == "the host's agent gave no facts: the agent never started"
    fast = evaluate(_plan(fast=True), facts, CTL)
    assert [r.name for r in fast] == ["probe"]


def test_a_tunnel_is_tested_on_a_stand_in_port_too() -> None:
    dial = Dial("127.0.0.1", 5000, "tok", True, "127.0.0.1", 6000, 5000)
    row = _port(dial, values={"dial": "ok"})
    assert row.status is Status.OK, row
    assert "through the SSH tunnel to controller 127.0.0.1:6000" in row.reason
    assert "stand-in port 6000" in row.reason


def test_the_listener_answers_only_a_probe_keyed_with_this_checks_salt() -> None:
    from fdl_fabric.preflight.agents import CHECK_RUN, ProbeListener

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    listener = ProbeListener(sock, b"s" * 16)
    try:
        assert checks.dial("127.0.0.1", listener.port, b"s" * 16, CHECK_RUN, "h") == "ok"
        other = checks.dial("127.0.0.1", listener.port, b"x" * 16, CHECK_RUN, "h")
        assert other.startswith("?")  # another run's key: closed without a keyed reply
        row = _port(Dial("127.0.0.1", 1, "t", False, "127.0.0.1", 1, 1), values={"dial": other})
        assert row.status is Status.WARN and "not this controller" in row.reason
    finally:
        listener.close()


def test_a_local_workers_gpus_are_listed_by_its_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    (fakebin / "nvidia-smi").write_text(
        "#!/bin/sh\ncase \"$*\" in\n"
        "  *--query-gpu=index,uuid*) printf '0, GPU-a\\n1, GPU-b\\n' ;;\n"
        "  *--query-gpu=index*) printf '0\\n1\\n' ;;\n"
        "  *--query-compute-apps=*) printf 'GPU-b, 4242\\n' ;;\nesac\n")
    (fakebin / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ['PATH']}")
    cluster = load_cluster(_local_cluster(tmp_path, f"""\
        controller: {{port: {_free_port()}}}
        workers: [{{host: localhost, local_devices: [1, 2], path: {tmp_path}}}]
        """))
    row = _row([c for c in run_checks(cluster, argv=["true"]).checks], "gpus")
    assert row == Check("localhost", "gpus", Status.FAIL, "GPU 2 not found (nvidia-smi lists 0, 1)")
    assert gpus.gpu_listing() == {"gpu_rc": "0", "gpus": "0, GPU-a;1, GPU-b;",
                                    "gpu_apps": "GPU-b, 4242;"}
    assert gpus.gpu_indices() == {"gpus": [0, 1]}
