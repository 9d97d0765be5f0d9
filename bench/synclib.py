"""Helpers of bench/sync.py (issue 31): the generated project, one timed launch with its
``--json`` records, one timed ``parallel-rsync``, the kernel's count of the bytes a
process sent, and small formatting helpers.

Nothing here imports ``tests/``; the lab comes from ``fdl_fabric.testing`` (through
`benchlib.start_lab`). Every process is started through `benchlib.start` (a process
group of its own, stopped by group and by nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib

#: The folder of the project every host receives a copy of, beside the ignored one.
IGNORED = "checkpoints"
#: The one file the incremental rounds rewrite (a small source file, as an edit is).
EDITED = "src/trainer/loop.py"


# -- the project ------------------------------------------------------------------------------
@dataclass
class Project:
    root: Path
    files: int
    bytes: int
    ignored_files: int
    ignored_bytes: int
    git_seconds: float


def _sizes(rng: random.Random, files: int, total: int) -> list[int]:
    """Mixed sizes summing to ``total``: 90 % small source-like files (1-16 KiB), 9.5 %
    medium (16-256 KiB: configs, data samples, assets) and 1 in 200 large, sharing what
    is left (weights, archives). A total below what the small and medium files take
    scales every size down alike."""
    n_large = max(1, files // 200)
    n_medium = max(1, files * 95 // 1000)
    n_small = files - n_large - n_medium
    small = [rng.randint(1024, 16 * 1024) for _ in range(n_small)]
    medium = [rng.randint(16 * 1024, 256 * 1024) for _ in range(n_medium)]
    rest = total - sum(small) - sum(medium)
    if rest < n_large * 256 * 1024:
        scale = total / (sum(small) + sum(medium) + n_large * 256 * 1024)
        small = [max(1, int(x * scale)) for x in small]
        medium = [max(1, int(x * scale)) for x in medium]
        rest = total - sum(small) - sum(medium)
    weights = [rng.uniform(0.5, 1.5) for _ in range(n_large)]
    large = [int(rest * w / sum(weights)) for w in weights]
    large[-1] += rest - sum(large)
    sizes = small + medium + large
    rng.shuffle(sizes)
    return sizes


def _folders() -> list[str]:
    return ["src", "src/trainer", "src/models", "src/models/blocks", "src/data",
            "src/data/loaders", "src/utils", "configs", "configs/experiments", "scripts",
            "assets", "assets/vocab", "tests", "tests/unit", "docs"]


def make_project(root: Path, files: int, total: int, *, seed: int = 31,
                 ignored_files: int = 20, ignored_bytes: int = 20 << 20,
                 commit: bool = True) -> Project:
    """A git work tree of ``files`` files (random bytes: nothing compresses) summing to
    ``total`` bytes in nested folders, one executable script and one relative symlink,
    plus ``checkpoints/`` (``ignored_files`` files, ``ignored_bytes``), which
    ``.gitignore`` names: neither tool sends it. Committed (``commit``), so the code id is
    a commit, as in a real project."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    folders = _folders()
    for f in folders:
        (root / f).mkdir(parents=True, exist_ok=True)
    fixed = {".gitignore": f"/{IGNORED}/\n*.log\n".encode(), EDITED: b"# edited\n" * 512,
             "scripts/run.sh": b"#!/bin/sh\nexec python3 -m trainer \"$@\"\n"}
    sizes = _sizes(rng, files - len(fixed) - 1, total - sum(len(v) for v in fixed.values()))
    for rel, data in fixed.items():
        (root / rel).write_bytes(data)
    (root / "scripts/run.sh").chmod(0o755)
    os.symlink("trainer/loop.py", root / "src/main.py")  # a link, kept as a link
    for i, size in enumerate(sizes):
        folder = folders[i % len(folders)]
        ext = ".py" if size <= 16 * 1024 else ".bin"  # the bytes are random either way
        (root / folder / f"f{i:05d}{ext}").write_bytes(rng.randbytes(size))
    (root / IGNORED).mkdir()
    for i in range(ignored_files):
        (root / IGNORED / f"step{i:04d}.pt").write_bytes(
            rng.randbytes(ignored_bytes // ignored_files))
    (root / "debug.log").write_bytes(b"ignored\n")
    t0 = time.perf_counter()
    git = ["git", "-C", str(root), "-c", "user.name=bench", "-c", "user.email=bench@x.invalid",
           "-c", "core.compression=0", "-c", "gc.auto=0"]
    subprocess.run([*git, "init", "-q"], check=True)
    if commit:
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "the project"], check=True)
    git_s = time.perf_counter() - t0
    n_files, n_bytes = 0, 0
    for dirpath, _dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split("/")[0] in (".git", IGNORED):
            continue
        for name in filenames:
            if name.endswith(".log"):
                continue
            path = os.path.join(dirpath, name)
            n_files += 1
            n_bytes += os.lstat(path).st_size if not os.path.islink(path) else 0
    return Project(root, n_files, n_bytes, ignored_files, ignored_bytes, git_s)


def edit(project: Project, n: int) -> None:
    """Rewrite `EDITED` with new content of the same size (round ``n``): a content never
    seen before, so no host has it yet."""
    path = project.root / EDITED
    size = path.stat().st_size
    head = f"# edit {n} {time.time_ns()}\n".encode()
    path.write_bytes(head + b"x" * (size - len(head)))


def files_under(folder: Path) -> dict[str, int]:
    """Every file and link under ``folder``, relative, with its size (a link: -1)."""
    found: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            found[rel] = -1 if os.path.islink(path) else os.lstat(path).st_size
    return found


# -- one launch ---------------------------------------------------------------------------------
@dataclass
class Launch:
    """One ``fdl-fabric launch --json`` from Popen to its exit."""

    ok: bool = False
    error: str = ""
    wall: Optional[float] = None
    #: The sync step's own time (``code_in_place``'s ``seconds``).
    in_place: Optional[float] = None
    #: Bytes the hosts' agents received (``code_in_place``'s ``bytes``).
    received: int = 0
    had: int = 0
    files: int = 0
    code_id: str = ""
    #: Popen -> the ``code`` record read (the manifest built: listing and hashing).
    code_at: Optional[float] = None
    #: Popen -> the ``code_in_place`` record read.
    in_place_at: Optional[float] = None
    #: Popen -> the ``all_ranks_running`` record read: comparable between a launch with
    #: sync and one without (the ``launch`` record is not: without sync it comes before
    #: the agents answered, with sync after every tree is in place).
    arr_at: Optional[float] = None
    #: Each host's tree folder (``code_synced``'s ``dir``).
    dirs: dict[str, str] = field(default_factory=dict)
    #: What ``on_record`` returned, by record name.
    seen: dict[str, Any] = field(default_factory=dict)
    #: CPU seconds (user+system) on the controller (the launcher) and on the hosts (every
    #: lab session: sshd, login shell, agent, relay, ranks), from `cpu_used`.
    ctl_cpu: Optional[float] = None
    host_cpu: Optional[float] = None


def fdl_argv(*words: str) -> list[str]:
    """fdl-fabric from this checkout (``python -m``, the repository first on the path)."""
    return [sys.executable, "-m", "fdl_fabric", *words]


def bench_env(tmp: Path) -> dict[str, str]:
    """The launcher's environment: this checkout first, records and the hash cache in the
    scratch folder (the user's own are never touched)."""
    return dict(os.environ, PYTHONPATH=str(benchlib.ROOT), FDL_FABRIC_RUNS_DIR=str(tmp / "runs"),
                XDG_CACHE_HOME=str(tmp / "cache"))


def hash_cache(tmp: Path) -> Path:
    return tmp / "cache" / "fdl-fabric" / "hashes"


def launch(argv: list[str], env: dict[str, str], *, timeout: float = 300.0,
           on_record: Optional[Callable[[str, int], Any]] = None,
           watch: Sequence[str] = ()) -> Launch:
    """Run one launch, reading its ``--json`` records as they come; ``on_record(name,
    pid)`` is called, on the reading thread, the moment a record named in ``watch`` is
    read (while the launcher still runs), and its answer kept in ``seen``."""
    r = Launch()
    t0 = time.perf_counter()
    proc = benchlib.start(argv, env=env)
    err: list[bytes] = []
    records: list[dict[str, Any]] = []

    def read_err() -> None:
        assert proc.stderr is not None
        err.append(proc.stderr.read())

    eth = threading.Thread(target=read_err, daemon=True)
    eth.start()
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            now = time.perf_counter() - t0
            if not raw.startswith(b"{"):
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            records.append(rec)
            name = rec.get("name")
            if name == "code":
                r.code_at = now
            elif name == "code_in_place":
                r.in_place_at = now
            elif name == "all_ranks_running":
                r.arr_at = now
            if on_record is not None and name in watch:
                r.seen[name] = on_record(name, proc.pid)
            if time.perf_counter() - t0 > timeout:
                raise benchlib.BenchError(f"no exit within {timeout:g} s")
        code = proc.wait(timeout)
        r.wall = time.perf_counter() - t0
        eth.join(10)
        if code != 0:
            tail = b"".join(err).decode(errors="replace").strip().splitlines()[-3:]
            raise benchlib.BenchError(f"exit {code}: {' | '.join(tail)}")
        for rec in records:
            data = rec.get("data") or {}
            if rec.get("name") == "code":
                r.code_id, r.files = data.get("code_id", ""), int(data.get("files", 0))
            elif rec.get("name") == "code_in_place":
                r.in_place = float(data["seconds"])
                r.received, r.had = int(data["bytes"]), int(data["had"])
            elif rec.get("name") == "code_synced":
                r.dirs[rec["host"]] = data["dir"]
        r.ok = True
    except (benchlib.BenchError, subprocess.TimeoutExpired, KeyError, ValueError) as exc:
        r.error = str(exc)
    finally:
        benchlib.stop(proc, grace=5)
    return r


# -- parallel-rsync ----------------------------------------------------------------------------
def prsync_path() -> Optional[str]:
    return shutil.which("parallel-rsync") or shutil.which("prsync")


#: Where rsync writes on each lab host: ``<host path>/rsync-copy``.
RSYNC_DIR = "rsync-copy"


def prsync_argv(lab: Any, hosts: Sequence[Any], hosts_file: Path, src: Path) -> list[str]:
    """``parallel-rsync -a`` of ``src``'s contents to every host's ``<path>/rsync-copy``,
    every host at once, with the lab's OpenSSH client options (`SshdLab.ssh_argv`'s) and
    the excludes fdl-fabric applies here (the project's ``.gitignore``, ``.git/``).

    The lab hosts share this machine's file system and parallel-rsync names one remote
    folder for all; each host's own ``path`` is reached by ``--rsync-path`` changing to
    the folder the lab's sshd names in the session (``FDL_FABRIC_LAB_HOST``), a ``cd``
    in the remote shell that starts rsync anyway."""
    prsync = prsync_path()
    assert prsync is not None
    hosts_file.write_text("".join(f"{lab.user}@{h.addr}:{h.port}\n" for h in hosts))
    hosts_root = Path(hosts[0].path).parent
    options = [f"IdentityFile={lab.identity_file}", "IdentitiesOnly=yes", "BatchMode=yes",
               f"UserKnownHostsFile={lab.known_hosts}", "StrictHostKeyChecking=no",
               "ConnectTimeout=10", "LogLevel=ERROR"]
    argv = [prsync, "-h", str(hosts_file), "-p", str(len(hosts)), "-t", "0", "-a",
            "-S", "-F /dev/null -T"]
    for o in options:
        argv += ["-O", o]
    for x in (f"--rsync-path=cd {hosts_root}/${{FDL_FABRIC_LAB_HOST#*:}} && rsync",
              "--filter=:- .gitignore", "--exclude=/.git/"):
        argv += ["-X", x]
    return [*argv, f"{src}/", f"{RSYNC_DIR}/"]


@dataclass
class Timed:
    ok: bool = False
    error: str = ""
    wall: Optional[float] = None
    ctl_cpu: Optional[float] = None
    host_cpu: Optional[float] = None


def run_timed(argv: list[str], env: Optional[dict[str, str]] = None,
              timeout: float = 300.0) -> Timed:
    """Popen -> exit of ``argv``, its output read and dropped (kept for an error)."""
    t = Timed()
    t0 = time.perf_counter()
    proc = benchlib.start(argv, env=env, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
        t.wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise benchlib.BenchError(f"exit {proc.returncode}: "
                                      + out.decode(errors="replace")[-400:])
        t.ok = True
    except (benchlib.BenchError, subprocess.TimeoutExpired) as exc:
        t.error = str(exc)
    finally:
        benchlib.stop(proc, grace=5)
    return t


# -- CPU ------------------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """CPU seconds of this process's reaped children (and theirs, once reaped)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _hosts_cpu(lab: Any) -> float:
    """CPU seconds of the lab's sshd listeners with every descendant they reaped: each
    session's sshd, its login shell and what ran in it (agents, relays, rsync, ranks),
    counted once the session ended."""
    from fdl_fabric.agent.procs import stat_fields

    total = 0.0
    for host in lab.hosts:
        fields = stat_fields(host.sshd.pid)
        if fields is not None:  # utime, stime, cutime, cstime
            total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK
    return total


def cpu_used(lab: Any, run: Callable[[], Any]) -> Any:
    """``run()``'s result with ``ctl_cpu`` (what this script's children used: the tool,
    and what it started and reaped) and ``host_cpu`` (the lab's sessions, once every one
    of them ended: waited for up to 10 s) set on it."""
    c0, h0 = _children_cpu(), _hosts_cpu(lab)
    result = run()
    deadline = time.monotonic() + 10.0
    while benchlib.lab_processes(lab) and time.monotonic() < deadline:
        time.sleep(0.05)
    result.ctl_cpu = _children_cpu() - c0
    result.host_cpu = _hosts_cpu(lab) - h0
    return result


# -- bytes a process sent ------------------------------------------------------------------------
def sent_by(pid: int, ports: set[int]) -> tuple[int, int]:
    """Bytes process ``pid`` has sent so far on its TCP connections to ``ports`` (the
    kernel's count, ``ss -ti``'s bytes_sent: SSH framing, MACs and TCP payload
    retransmits included, not TCP/IP headers), and how many such connections it has."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, conns, mine = 0, 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            fields = line.split()
            peer = fields[4] if len(fields) > 4 else ""
            mine = f"pid={pid}," in line and peer.rsplit(":", 1)[-1].isdigit() and \
                int(peer.rsplit(":", 1)[-1]) in ports
            conns += mine
        elif mine:
            m = re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total, conns


# -- formatting ---------------------------------------------------------------------------------
def mib(n: Optional[float]) -> str:
    """Bytes in MiB, or KiB / B below a MiB."""
    if n is None:
        return "n/a"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{n:.0f} B"


class Bench:
    """The lab, the project, the cluster files and the launcher's environment."""

    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any, out: TextIO) -> None:
        self.args, self.tmp, self.lab, self.out = args, tmp, lab, out
        self.env = bench_env(tmp)
        (tmp / "runs").mkdir(mode=0o700, exist_ok=True)
        self.project: Project
        self.small_project: Project

    def cluster(self, hosts: Sequence[Any], src: Path, name: str, **top: Any) -> Path:
        workers = [self.lab.worker(h, nproc=1) for h in hosts]
        path: Path = self.lab.write_cluster(workers, filename=f"clusters/{name}.yml",
                                            command="true", sync={"src": str(src)}, **top)
        return path

    def launch(self, cluster: Path, *extra: str, **kw: Any) -> Launch:
        return launch(fdl_argv("launch", "--json", "--cluster", str(cluster), *extra), self.env,
                      **kw)

    def clear_stores(self, hosts: Sequence[Any], *, hashes: bool = False) -> None:
        """Every host's ``.fdl-code`` and, with ``hashes``, the controller's hash cache."""
        for h in hosts:
            shutil.rmtree(Path(h.path) / ".fdl-code", ignore_errors=True)
        if hashes:
            shutil.rmtree(hash_cache(self.tmp), ignore_errors=True)

    def clear_rsync(self, hosts: Sequence[Any]) -> None:
        for h in hosts:
            shutil.rmtree(Path(h.path) / RSYNC_DIR, ignore_errors=True)

    def say(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
