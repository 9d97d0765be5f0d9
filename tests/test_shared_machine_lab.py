"""Shared machines (issue 22): another user on the same machine can neither lock a user
out of the run registry, nor make the launcher follow a link of theirs, nor read what a
run leaves behind. Real users made for the test (`fdl_fabric.testing.users`): the
victim launches as an unprivileged user, the other user squats, swaps and snoops."""

from __future__ import annotations

import os
import stat
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from fdl_fabric.testing.processes import free_port
from fdl_fabric.testing.users import User, UsersLab, users_available

pytestmark = [pytest.mark.skipif(users_available() is not None,
                                 reason=users_available() or ""),
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def users() -> Iterator[UsersLab]:
    with UsersLab(["alice", "mallory"]) as lab:
        yield lab


def _write_as(lab: UsersLab, name: str, path: Path, text: str) -> None:
    subprocess.run(["runuser", "-u", lab.users[name].name, "--", "tee", str(path)],
                   input=text, text=True, capture_output=True, check=True, timeout=30)


def _job(lab: UsersLab, command: str, *, extra: str = "") -> Path:
    """A cluster file in a fresh folder of alice's: this machine, two ranks."""
    alice = lab.users["alice"]
    folder = alice.home / f"job-{time.monotonic_ns()}"
    lab.run("alice", ["mkdir", "-p", str(folder)])
    _write_as(lab, "alice", folder / "cluster.yml", textwrap.dedent(f"""
        controller: {{host: 127.0.0.1, port: {free_port("127.0.0.1")}}}
        command: {command}
        kill_grace: 2
        workers: [{{host: localhost, nproc: 2}}]
    """) + extra)
    return folder / "cluster.yml"


def _squat(lab: UsersLab, how: str) -> Path:
    """Mallory takes alice's /tmp/fdl-fabric-<uid> first: as a folder, a symlink to a
    folder of hers, or a file."""
    alice, mallory = lab.users["alice"], lab.users["mallory"]
    path = Path(f"/tmp/fdl-fabric-{alice.uid}")
    theirs = mallory.home / "trap"
    commands = {"folder": [["mkdir", "-m", "0777", str(path)]],
                "symlink": [["mkdir", "-p", "-m", "0777", str(theirs)],
                            ["ln", "-s", str(theirs), str(path)]],
                "file": [["touch", str(path)]]}[how]
    for argv in commands:
        assert lab.run("mallory", argv).returncode == 0
    return path


def _unsquat(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        os.rmdir(path)


def _recorded_run(records: Path, launcher: subprocess.Popen[str]) -> str:
    """The id of the run whose agent wrote its record in ``records`` (waits for it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and launcher.poll() is None:
        found = list(records.glob("*.json"))
        if found:
            return found[0].name.split("@")[0]
        time.sleep(0.2)
    launcher.kill()
    out, err = launcher.communicate(timeout=30)
    raise AssertionError(f"no record in {records}: {err[-2000:]}")


def _fallback(alice: User) -> Path:
    return alice.home / ".cache" / "fdl-fabric" / os.uname().nodename


@pytest.mark.parametrize("how", ["folder", "symlink", "file"])
def test_a_squatted_registry_moves_home_and_cleanup_still_finds_the_run(
        users: UsersLab, how: str) -> None:
    alice = users.users["alice"]
    squat = _squat(users, how)
    try:
        cluster = _job(users, 'python3 -c "import time; print(\'up\', flush=True); '
                              'time.sleep(60)"')
        launcher = users.popen("alice", users.inv("launch", "-c", str(cluster)),
                               cwd=cluster.parent)
        records = _fallback(alice)
        run_id = _recorded_run(records, launcher)

        status = users.run("alice", users.inv("status", "-c", str(cluster)), cwd=cluster.parent)
        assert run_id in status.stdout, status.stdout + status.stderr

        cleanup = users.run("alice", users.inv("cleanup", "-c", str(cluster), "--run-id", run_id),
                            cwd=cluster.parent)
        assert cleanup.returncode == 0, cleanup.stdout + cleanup.stderr
        out, err = launcher.communicate(timeout=60)
        lines = err.strip().splitlines()
        moved = [line for line in lines if "run registry moved to" in line]
        assert len(moved) == 1 and str(records) in moved[0]
        assert f"owned by uid {users.users['mallory'].uid} ({users.users['mallory'].name})" \
            in moved[0]
        assert "stopped" in lines[-1] and launcher.returncode != 0, err[-1500:]
        assert not list(records.glob("*.json"))  # cleanup removed the stopped run's record
        # Nothing of alice's went to mallory's folder.
        if how != "file":
            assert not any(squat.resolve().iterdir())
    finally:
        _unsquat(squat)


def test_a_foreign_state_dir_override_is_refused_naming_its_owner_with_a_verdict(
        users: UsersLab) -> None:
    mallory = users.users["mallory"]
    theirs = mallory.home / "state"
    users.run("mallory", ["mkdir", "-p", "-m", "0777", str(theirs)])
    cluster = _job(users, "python3 -c pass")
    done = users.run("alice", users.inv("launch", "-c", str(cluster)), cwd=cluster.parent,
                     env={"FDL_FABRIC_STATE_DIR": str(theirs)})
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    said = "\n".join(lines)
    assert f"owned by uid {mallory.uid} ({mallory.name})" in said
    assert "FDL_FABRIC_STATE_DIR" in said and "Traceback" not in said
    # The verdict, last: no rank could start, and why.
    assert "could not start rank" in lines[-1] and "FDL_FABRIC_STATE_DIR" in lines[-1]
    assert not any("cannot write the run registry" in line for line in lines)
    assert not any(theirs.iterdir())


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():  # <log-dir>/latest: a link's own mode means nothing
                continue
            out[str(path)] = stat.S_IMODE(path.lstat().st_mode)
    return out


def test_every_folder_the_run_makes_is_0700_and_every_file_0600(users: UsersLab) -> None:
    """Under alice's usual umask (022): the run log, the registry's run folders and a
    failed rank's error file (written by the rank itself, with the rank's umask)."""
    alice = users.users["alice"]
    program = alice.home / "fail.py"
    _write_as(users, "alice", program, textwrap.dedent("""
        import json, os, sys
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
            json.dump({"message": {"message": "boom"}}, fh)
        sys.exit(3)
    """))
    cluster = _job(users, f"python3 {program}")
    logs = alice.home / "logs"
    done = users.run("alice", ["sh", "-c", 'umask 022; exec "$@"', "sh",
                               *users.inv("launch", "-c", str(cluster), "--log-dir", str(logs))],
                     cwd=cluster.parent)
    assert done.returncode == 1, done.stderr[-1500:]
    assert "boom" in done.stderr  # the error file was read
    registry = Path(f"/tmp/fdl-fabric-{alice.uid}")
    made = {**_modes(logs), **_modes(registry)}
    assert made, "nothing was made"
    wrong = {path: oct(mode) for path, mode in made.items()
             if mode != (0o700 if Path(path).is_dir() else 0o600)}
    assert not wrong
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert stat.S_IMODE(registry.stat().st_mode) == 0o700


@pytest.mark.parametrize("how", ["inside", "link"])
def test_a_log_dir_another_user_can_change_is_refused_in_one_line(
        users: UsersLab, how: str) -> None:
    """Inside mallory's writable folder (she could swap alice's run folder for a link),
    or through a symlink of hers (she could repoint it): exit 2, one line, nothing
    written."""
    alice, mallory = users.users["alice"], users.users["mallory"]
    shared = mallory.home / "shared"
    users.run("mallory", ["mkdir", "-p", "-m", "0777", str(shared)])
    os.chmod(mallory.home, 0o755)  # reachable, as a home often is
    mine = alice.home / "mylogs"
    users.run("alice", ["mkdir", "-p", str(mine)])
    if how == "inside":
        log_dir = shared / "alice-logs"
    else:
        log_dir = Path(f"/tmp/fdl-link-{mallory.uid}")
        users.run("mallory", ["ln", "-sfn", str(mine), str(log_dir)])
    try:
        cluster = _job(users, "python3 -c pass")
        done = users.run("alice", users.inv("launch", "-c", str(cluster), "--log-dir",
                                            str(log_dir)), cwd=cluster.parent)
        assert done.returncode == 2
        (line,) = done.stderr.strip().splitlines()
        assert "--log-dir" in line and mallory.name in line and "Traceback" not in line
        assert not list(shared.iterdir()) and not list(mine.iterdir())
    finally:
        if log_dir.is_symlink():
            log_dir.unlink()


def test_a_port_in_use_says_whether_it_is_one_of_your_runs_or_another_users(
        users: UsersLab) -> None:
    cluster = _job(users, 'python3 -c "import time; time.sleep(30)"')
    first = users.popen("alice", users.inv("launch", "-c", str(cluster)), cwd=cluster.parent)
    try:
        run_id = _recorded_run(Path(f"/tmp/fdl-fabric-{users.users['alice'].uid}"), first)
        again = users.run("alice", users.inv("launch", "-c", str(cluster)), cwd=cluster.parent)
        assert again.returncode != 0
        assert f"held by your own live run {run_id} (launcher pid " \
            in again.stderr.strip().splitlines()[-1]  # the launcher under runuser
        theirs = users.users["mallory"].home / "cluster.yml"
        _write_as(users, "mallory", theirs, cluster.read_text())
        other = users.run("mallory", users.inv("launch", "-c", str(theirs)), cwd=theirs.parent)
        assert "held by a process of another user" in other.stderr.strip().splitlines()[-1]
    finally:
        os.killpg(first.pid, 15)
        first.communicate(timeout=30)


def test_the_state_dir_override_holds_the_records_and_cleanup_finds_them_there(
        users: UsersLab) -> None:
    alice = users.users["alice"]
    mine = alice.home / "state"
    cluster = _job(users, 'python3 -c "import time; time.sleep(60)"')
    env = {"FDL_FABRIC_STATE_DIR": str(mine)}
    launcher = users.popen("alice", users.inv("launch", "-c", str(cluster)),
                           cwd=cluster.parent, env=env)
    run_id = _recorded_run(mine, launcher)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert not list(Path(f"/tmp/fdl-fabric-{alice.uid}").glob("*.json"))
    cleanup = users.run("alice", users.inv("cleanup", "-c", str(cluster), "--run-id", run_id),
                        cwd=cluster.parent, env=env)
    assert cleanup.returncode == 0, cleanup.stdout + cleanup.stderr
    launcher.communicate(timeout=60)
    assert not list(mine.glob("*.json"))
