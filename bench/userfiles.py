#!/usr/bin/env python3
"""What a user's own SSH files cost a launch at 1,024 hosts (issue 35, twelfth round).

A user who launches on 1,024 hosts has them in ~/.ssh/known_hosts, and often in an
ssh_config too. Every connection the launcher makes reads the first (paramiko), and
every worker's settings read the second. The sshd lab's files hold a few lines, so the
other benchmarks never show these costs. This script, on files of ``--hosts`` entries:

* ``--dry-run`` of a 1,024-worker cluster file (32 gateways x 31 leaves; nothing is
  contacted), as is and with every worker naming an ssh_config of ``--hosts`` blocks
  (``ssh.config_file``): the launcher's CPU, beside OpenSSH's own lookup of the same
  hosts in the same file (``ssh -G``, one process a host, as a launcher that ran
  ``ssh`` per host would);
* a known_hosts of ``--hosts`` entries, read for one connection: paramiko's
  ``load_host_keys`` (what a Fabric program pays per connection), the launcher's
  (`transport.hostkeys`, read once a process), and OpenSSH's ``ssh-keygen -F``.

A script, not a test: it prints medians of ``--repeat`` runs, interleaved, and asserts
nothing. ``python3 bench/userfiles.py --help``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


def _cluster(folder: Path, hosts: int, config: Path | None) -> Path:
    """32 gateways x 31 leaves (1,024 workers x 8 ranks) whose names never resolve."""
    import yaml

    workers = []
    for i in range(hosts):
        name = f"node{i:04d}"
        ssh = {"target": f"{name}.invalid", "user": "nobody"}
        if config is not None:
            ssh["config_file"] = str(config)
        workers.append({"host": name, "addr": "127.0.0.1", "path": str(folder), "nproc": 8,
                        "ssh": ssh})
    doc = {"controller": {"host": "127.0.0.1", "port": 29999}, "fanout": 32,
           "command": "python3 train.py", "workers": workers}
    path = folder / ("with-config.yml" if config is not None else "plain.yml")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path


def _ssh_config(folder: Path, hosts: int) -> Path:
    path = folder / "ssh_config"
    path.write_text("".join(f"Host node{i:04d}\n    HostName node{i:04d}.invalid\n"
                            f"    User someone\n    Port 22\n" for i in range(hosts))
                    + "Host *\n    ServerAliveInterval 30\n")
    return path


def _child_cpu(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one child process run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   cwd=ROOT, timeout=600)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=1024, help="entries in each file (1024)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, interleaved (3)")
    ap.add_argument("--lookups", type=int, default=64,
                    help="hosts `ssh -G` looks up (each a process; 64)")
    args = ap.parse_args(argv)
    import benchlib

    folder = Path(tempfile.mkdtemp(prefix="fdl-userfiles-"))
    try:
        config = _ssh_config(folder, args.hosts)
        known = folder / "known_hosts"
        benchlib.seed_known_hosts(known, args.hosts)
        plain, named = _cluster(folder, args.hosts, None), _cluster(folder, args.hosts, config)
        dry = [sys.executable, "-m", "fdl_fabric", "launch", "--dry-run", "--json",
               "--cluster"]
        rows: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, path in (("plain", plain), ("named", named)):
                rows.setdefault(name, []).append(_child_cpu([*dry, str(path)])[1])
            ssh = shutil.which("ssh")
            if ssh:
                cpu = sum(_child_cpu([ssh, "-G", "-F", str(config), f"node{i:04d}"])[1]
                          for i in range(args.lookups))
                rows.setdefault("ssh -G", []).append(cpu / args.lookups)
        print(f"1,024 workers x 8 ranks, --dry-run (the launcher's CPU, s; medians of "
              f"{args.repeat}); ssh_config of {args.hosts} Host blocks:")
        plain_s, named_s = statistics.median(rows["plain"]), statistics.median(rows["named"])
        print(f"  no ssh_config named                         {plain_s:7.2f}")
        print(f"  every worker names the ssh_config           {named_s:7.2f}"
              f"   (+{named_s - plain_s:.2f} s: {1000 * (named_s - plain_s) / args.hosts:.2f}"
              f" ms a worker)")
        if "ssh -G" in rows:
            one = statistics.median(rows["ssh -G"])
            print(f"  OpenSSH: ssh -G, one process a host         {one * args.hosts:7.2f}"
                  f"   ({1000 * one:.2f} ms a host, {args.lookups} hosts measured)")

        import paramiko

        from fdl_fabric.transport.hostkeys import apply_host_key_policy

        def paramiko_load() -> float:
            started = time.process_time()
            paramiko.SSHClient().load_host_keys(str(known))
            return time.process_time() - started

        def launcher_load() -> float:
            started = time.process_time()
            apply_host_key_policy(paramiko.SSHClient(), "yes", str(known))
            return time.process_time() - started

        launcher_load()  # the process's one read
        keygen = shutil.which("ssh-keygen")
        times = {"paramiko": [], "launcher": [], "keygen": []}  # type: dict[str, list[float]]
        for _ in range(args.repeat):
            times["paramiko"].append(paramiko_load())
            times["launcher"].append(launcher_load())
            if keygen:
                times["keygen"].append(_child_cpu(
                    [keygen, "-F", f"node{args.hosts - 1:04d}.invalid", "-f", str(known)])[1])
        print(f"\nknown_hosts of {args.hosts} entries, read for one connection (CPU ms, "
              f"medians of {args.repeat}):")
        print(f"  paramiko load_host_keys (a Fabric program)  "
              f"{1000 * statistics.median(times['paramiko']):7.1f}")
        print(f"  fdl-fabric (read once a process)            "
              f"{1000 * statistics.median(times['launcher']):7.1f}")
        if times["keygen"]:
            print(f"  OpenSSH ssh-keygen -F (a process)           "
                  f"{1000 * statistics.median(times['keygen']):7.1f}")
        print(f"\nmachine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
              f"paramiko {paramiko.__version__}")
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
