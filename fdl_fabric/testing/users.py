"""Two unprivileged users on one machine, for the shared-machine tests (issue 22).

A victim runs fdl-fabric while another user tries to stop, block or mislead the run.
Both need a Python with fdl-fabric's requirements that they can read: root's own
interpreter usually lives under a 0700 home, so the lab makes a venv of the system's
``python3`` in a world-readable folder and puts this checkout on its path.

Needs root (``useradd``, ``runuser``); everything made is removed by `close`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .processes import LabError

ROOT = Path(__file__).resolve().parent.parent.parent
#: The system interpreter the venv is made from (root's may be unreadable to others).
SYSTEM_PYTHON = "/usr/bin/python3"


def users_available() -> Optional[str]:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (useradd, runuser)"
    for tool in ("useradd", "userdel", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"{SYSTEM_PYTHON} is missing"
    return None


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    home: Path


class UsersLab:
    """Users made for a test, and a venv both can run fdl-fabric from."""

    def __init__(self, names: Sequence[str]) -> None:
        why = users_available()
        if why is not None:
            raise LabError(f"the users lab {why}")
        self.folder = Path(tempfile.mkdtemp(prefix="fdl-users-"))
        os.chmod(self.folder, 0o755)
        self.users: dict[str, User] = {}
        try:
            self._make_venv()
            for name in names:
                self._add(name)
        except BaseException:
            self.close()
            raise

    @property
    def python(self) -> str:
        return str(self.folder / "venv" / "bin" / "python")

    def _make_venv(self) -> None:
        venv = self.folder / "venv"
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True,
                       capture_output=True, timeout=120)
        done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                               "--disable-pip-version-check", "-r",
                               str(ROOT / "requirements.txt")],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise LabError(f"pip install into the users' venv failed: {done.stderr[-2000:]}")
        site = next((venv / "lib").glob("python3*/site-packages"))
        (site / "fdl_fabric_checkout.pth").write_text(str(ROOT) + "\n")

    def _add(self, name: str) -> None:
        with_pid = f"{name}{os.getpid() % 100000}"[:30]
        subprocess.run(["userdel", "-r", with_pid], capture_output=True, timeout=30)
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", with_pid], check=True,
                       capture_output=True, timeout=30)
        entry = pwd.getpwnam(with_pid)
        self.users[name] = User(with_pid, entry.pw_uid, Path(entry.pw_dir))

    def run(self, name: str, argv: Sequence[str], *, cwd: Optional[Path] = None,
            env: Optional[dict[str, str]] = None, timeout: float = 120,
            ) -> subprocess.CompletedProcess[str]:
        """``argv`` as user ``name``, with a clean login-like environment."""
        return subprocess.run(self.argv(name, argv, env=env), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)

    def popen(self, name: str, argv: Sequence[str], *, cwd: Optional[Path] = None,
              env: Optional[dict[str, str]] = None) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(name, argv, env=env), cwd=cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)

    def argv(self, name: str, argv: Sequence[str], *,
             env: Optional[dict[str, str]] = None) -> list[str]:
        user = self.users[name]
        base = {"HOME": str(user.home), "USER": user.name, "LOGNAME": user.name,
                "PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
                "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        base.update(env or {})
        return ["runuser", "-u", user.name, "--", "env", "-i",
                *(f"{k}={v}" for k, v in base.items()), *argv]

    def inv(self, *args: str) -> list[str]:
        """``inv`` of this checkout, run with the users' venv."""
        return [self.python, "-m", "invoke", "--search-root", str(ROOT), *args]

    def close(self) -> None:
        """Stop the users' processes (by uid: only this lab's users have it), remove the
        users, their homes and what they left in /tmp, and the venv."""
        for user in self.users.values():
            _kill_user(user.uid)
            subprocess.run(["userdel", "-r", user.name], capture_output=True, timeout=30)
            for path in (Path(f"/tmp/fdl-fabric-{user.uid}"),):
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
        self.users.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> UsersLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_user(uid: int) -> None:
    """Stop what a lab user left running: by owner uid, which only this lab's users have."""
    import psutil

    procs = [p for p in psutil.process_iter(["uids"]) if p.info["uids"]
             and p.info["uids"].real == uid]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


__all__ = ["User", "UsersLab", "users_available"]
