"""A hook at the end (issue 30, item 8): ``--on-exit CMD`` and ``on_exit:`` in a cluster
file run once when the run ends, detached or not, told the run id, its verdict, its exit
code and its record's folder; bounded in time, their failure said, and never a change to
the run's verdict, its exit code, or the verdict being the last line. Through real
launches on this machine."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

from fdl_fabric.api import launch
from fdl_fabric.runs import place
from fdl_fabric.runs.hook import ENV_TIMEOUT
from fdl_fabric.runs.record import CONSOLE, ON_EXIT_LOG, RESULT, STATE
from fdl_fabric.testing.launches import wait_for

FDL = (sys.executable, "-m", "fdl_fabric")

#: A rank that says one line and exits with its first argument (or sleeps that long when
#: it is "sleep", for a run that is stopped).
RANK = textwrap.dedent("""\
    import sys, time
    print("rank says hi", flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
    """)


@pytest.fixture
def root(runs: Path) -> Path:
    """This test's records folder (`conftest.runs`)."""
    return runs


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The launch's folder (a space in its name: every path is quoted), with the rank."""
    folder = tmp_path / "the work"
    folder.mkdir()
    (folder / "rank.py").write_text(RANK)
    return folder



def hook(calls: Path, then: str = "") -> str:
    """A hook that appends what it was told, and its folder, to ``calls`` (one line a
    call), says a line of its own, then does ``then``."""
    return ('printf "%s|%s|%s|%s|%s\\n" "$FDL_FABRIC_RUN_ID" "$FDL_FABRIC_VERDICT" '
            f'"$FDL_FABRIC_EXIT_CODE" "$FDL_FABRIC_RUN_DIR" "$PWD" >> {shlex.quote(str(calls))}'
            f'; echo "the hook speaks"{"; " + then if then else ""}')


def calls_of(path: Path) -> list[list[str]]:
    return [line.split("|") for line in path.read_text().splitlines()] if path.exists() else []


def fdl(cwd: Path, *args: str, env: Optional[dict[str, str]] = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FDL, *args], capture_output=True, text=True, cwd=cwd, timeout=60,
                          env={**os.environ, **(env or {})})


def only_record(root: Path) -> Path:
    records = place.records(root)
    assert len(records) == 1, records
    return records[0]


def result_of(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / RESULT).read_text())
    assert isinstance(data, dict)
    return data


def cluster_file(work: Path, on_exit_line: str, nproc: int = 1, command: str = "") -> Path:
    path = work / "cluster.yml"
    path.write_text(f"command: {json.dumps(command or f'{sys.executable} rank.py 0')}\n"
                    f"{on_exit_line}\n"
                    f"workers:\n  - host: localhost\n    nproc: {nproc}\n"
                    f"    path: {json.dumps(str(work))}\n")
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- once, told the outcome ----------------------------------------------------------------

@pytest.mark.parametrize("code,verdict", [(0, "ok"), (1, "failed")])
def test_on_exit_runs_once_told_the_run_id_verdict_exit_code_and_record_folder(
        code: int, verdict: str, root: Path, work: Path, tmp_path: Path,
        umask_0: None) -> None:
    calls = tmp_path / "calls"
    out = fdl(work, "run", "--nproc-per-node", "2", "--on-exit", hook(calls), "rank.py",
              str(code))
    assert out.returncode == code, out.stderr
    folder = only_record(root)
    assert calls_of(calls) == [[folder.name, verdict, str(code), str(folder), str(work)]]
    result = result_of(folder)
    assert (result["verdict"], result["exit_code"]) == (verdict, code)
    lines = out.stderr.splitlines()
    assert lines[-1] == result["message"], "the verdict stays the last line"
    assert lines[-2].startswith("cluster launcher: the --on-exit hook ran (exit 0, ")
    assert (folder / CONSOLE).read_text().splitlines()[-1] == lines[-1]
    assert (folder / ON_EXIT_LOG).read_text() == "the hook speaks\n"
    assert oct(os.stat(folder / ON_EXIT_LOG).st_mode & 0o777) == oct(0o600)


def test_on_exit_in_a_cluster_file_runs_once(root: Path, work: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    path = cluster_file(work, f"on_exit: {json.dumps(hook(calls))}", nproc=2)
    out = fdl(work, "launch", "--cluster", str(path))
    assert out.returncode == 0, out.stderr
    folder = only_record(root)
    assert calls_of(calls) == [[folder.name, "ok", "0", str(folder), str(work)]]
    assert out.stderr.splitlines()[-1] == result_of(folder)["message"]


def test_the_on_exit_flag_wins_over_the_cluster_files(
        root: Path, work: Path, tmp_path: Path) -> None:
    path = cluster_file(work, f"on_exit: {json.dumps(hook(tmp_path / 'file-hook'))}")
    out = fdl(work, "launch", "--cluster", str(path), "--on-exit", hook(tmp_path / "flag-hook"))
    assert out.returncode == 0, out.stderr
    assert len(calls_of(tmp_path / "flag-hook")) == 1
    assert not (tmp_path / "file-hook").exists()


def test_on_exit_from_the_api_runs_once(root: Path, work: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(work)
    calls = tmp_path / "calls"
    result = launch(None, [sys.executable, "rank.py", "1"], hosts="localhost",
                    quiet=True, on_exit=hook(calls))
    assert result.exit_code == 1
    folder = place.record_folder(str(result.run_id), root)
    assert calls_of(calls) == [[result.run_id, "failed", "1", str(folder), str(work)]]


@pytest.mark.parametrize("code,verdict", [(0, "ok"), (1, "failed")])
def test_on_exit_of_a_detached_run_runs_once_when_it_ends(
        code: int, verdict: str, root: Path, work: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    out = fdl(work, "run", "--detach", "--on-exit", hook(calls), "rank.py", str(code))
    assert out.returncode == 0, out.stderr
    folder = only_record(root)
    waited = fdl(work, "wait", folder.name)
    assert waited.returncode == code, waited.stderr
    assert calls_of(calls) == [[folder.name, verdict, str(code), str(folder), str(work)]]
    assert result_of(folder)["exit_code"] == code
    assert (folder / CONSOLE).read_text().splitlines()[-1] == result_of(folder)["message"]


def test_on_exit_of_a_stopped_run_is_told_it_was_interrupted(
        root: Path, work: Path, tmp_path: Path,
        spawned: list[subprocess.Popen[Any]]) -> None:
    calls = tmp_path / "calls"
    proc = subprocess.Popen([*FDL, "run", "--on-exit", hook(calls), "rank.py", "sleep"],
                            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    spawned.append(proc)

    def running() -> bool:
        records = place.records(root)
        if not records:
            return False
        try:
            return bool(json.loads((records[0] / STATE).read_text())["state"] == "running")
        except (OSError, ValueError):
            return False

    wait_for(running, 30, "every rank running")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    folder = only_record(root)
    assert calls_of(calls) == [[folder.name, "interrupted", "143", str(folder), str(work)]]
    assert stderr.splitlines()[-1] == result_of(folder)["message"]


# -- bounded, and its failure never the run's ----------------------------------------------

@pytest.mark.parametrize("code,verdict", [(0, "ok"), (1, "failed")])
def test_a_hook_that_hangs_is_stopped_at_its_bound_and_the_verdict_is_unchanged(
        code: int, verdict: str, root: Path, work: Path, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    quoted = shlex.quote(str(pids))
    hang = f"echo $$ > {quoted}; sleep 60 & echo $! >> {quoted}; wait"
    out = fdl(work, "run", "--on-exit", hook(tmp_path / "calls", hang), "rank.py", str(code),
              env={ENV_TIMEOUT: "1"})
    assert out.returncode == code, out.stderr
    folder = only_record(root)
    result = result_of(folder)
    assert (result["verdict"], result["exit_code"]) == (verdict, code)
    lines = out.stderr.splitlines()
    assert lines[-1] == result["message"], "the verdict stays the last line"
    assert lines[-2] == (f"cluster launcher: the --on-exit hook was stopped after 1s (its "
                         f"output: {folder / ON_EXIT_LOG}); the run's verdict and exit code "
                         "are unchanged")
    assert len(calls_of(tmp_path / "calls")) == 1
    assert (folder / ON_EXIT_LOG).read_text() == "the hook speaks\n"
    shell, sleeper = (int(p) for p in pids.read_text().split())
    assert gone(shell), "the hook is stopped"
    wait_for(lambda: gone(sleeper), 10, "the hook's own child to be stopped with it")


def test_a_hook_that_fails_is_reported_and_the_verdict_and_exit_code_are_unchanged(
        root: Path, work: Path, tmp_path: Path) -> None:
    out = fdl(work, "run", "--on-exit", hook(tmp_path / "calls", "exit 3"), "rank.py", "0")
    assert out.returncode == 0, out.stderr
    folder = only_record(root)
    result = result_of(folder)
    assert (result["verdict"], result["exit_code"]) == ("ok", 0)
    lines = out.stderr.splitlines()
    assert lines[-1] == result["message"] == \
        "cluster launcher: run completed — all 1 ranks exited 0"
    assert lines[-2] == (f"cluster launcher: the --on-exit hook exited with 3 (its output: "
                         f"{folder / ON_EXIT_LOG}); the run's verdict and exit code are "
                         "unchanged")
    assert len(calls_of(tmp_path / "calls")) == 1
    assert (folder / ON_EXIT_LOG).read_text() == "the hook speaks\n"


def test_a_hook_that_is_no_program_is_reported_and_the_run_is_unchanged(
        root: Path, work: Path) -> None:
    out = fdl(work, "run", "--on-exit", "no-such-program-fdl-fabric --notify", "rank.py", "0")
    assert out.returncode == 0, out.stderr
    folder = only_record(root)
    lines = out.stderr.splitlines()
    assert lines[-1] == result_of(folder)["message"]
    assert "the --on-exit hook exited with 127" in lines[-2]
    assert "no-such-program-fdl-fabric" in (folder / ON_EXIT_LOG).read_text()


# -- bad values are refused, nothing started -----------------------------------------------

@pytest.mark.parametrize("value,words", [
    ("\"echo 'unbalanced\"", "on_exit: cannot be split into shell words: No closing quotation"),
    ("5", "on_exit: expected a string, got integer 5"),
    ("[mail, me]", "on_exit: expected a string, got a list"),
])
def test_a_bad_on_exit_in_a_cluster_file_is_refused_naming_the_key_and_line(
        value: str, words: str, root: Path, work: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    path = cluster_file(work, f"on_exit: {value}", command=f"touch {marker}")
    out = fdl(work, "launch", "--cluster", str(path))
    assert out.returncode == 2, out.stderr
    assert f"{path}:2: {words}" in out.stderr
    assert not marker.exists(), "nothing started"
    assert place.records(root) == [], "no run, no record"


@pytest.mark.parametrize("command", ["run", "launch"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_on_exit_flag_is_refused_naming_it(
        command: str, value: str, root: Path, work: Path, tmp_path: Path) -> None:
    marker = tmp_path / "started"
    if command == "run":
        args = ["run", "--on-exit", value, "rank.py", "0"]
    else:
        path = cluster_file(work, "", command=f"touch {marker}")
        args = ["launch", "--cluster", str(path), "--on-exit", value]
    out = fdl(work, *args)
    assert out.returncode == 2, out.stderr
    assert "--on-exit" in out.stderr and "empty" in out.stderr
    assert "rank says hi" not in out.stdout and not marker.exists(), "nothing started"
    assert place.records(root) == []
