"""The sweep that runs on each host: stop leftover ranks, and only ours.

Every rank wrapper records, on its own host, its process group, its start
time as the kernel reports it and the run id (`commands.REGISTER_SNIPPET`).
A sweep stops a recorded group only while the recorded start time still
matches the group leader, or, when the leader is gone, only the group members
that carry the run's id in their environment. So a recycled pid, or someone
else's process with the same command line, is never signalled; DeepSpeed's
`pkill -f` cleanup killed other users' jobs (DeepSpeed#6807). The old
pattern behaviour exists only behind an explicit ``--pattern``.

This module is standard library only: `cleanup` runs it on remote hosts as
``python3 -c <this source> <args>`` (no secrets are involved), and calls
`sweep` directly for the local host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

#: Seconds between TERM and KILL in a sweep (the seed's `sleep 1`).
SWEEP_GRACE = 1.0
RUN_ENV = b"FLODL_INTERNAL_RUN_ID="


def registry_dir() -> str:
    """The per-user registry folder; the wrapper uses the same path."""
    return f"/tmp/fdl-fabric-{os.getuid()}"


@dataclass
class Record:
    path: str
    pgid: int
    start: int
    run: str
    cluster: str
    host: str
    rank: str


@dataclass
class SweepReport:
    """What one sweep did on one host; printed as JSON for the launcher."""

    host: str
    stopped: list[dict[str, object]] = field(default_factory=list)
    leftovers: list[dict[str, object]] = field(default_factory=list)
    stale_records: int = 0
    errors: list[str] = field(default_factory=list)


def read_records(folder: Optional[str] = None) -> list[Record]:
    folder = folder or registry_dir()
    records = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    if os.stat(folder).st_uid != os.getuid() or os.path.islink(folder):
        raise PermissionError(f"{folder} is not owned by this user; refusing to use it")
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as fh:
                fields = dict(part.split("=", 1) for part in fh.read().split() if "=" in part)
            records.append(Record(path, int(fields["pgid"]), int(fields["start"]), fields["run"],
                                  fields.get("cluster", ""), fields.get("host", ""),
                                  fields.get("rank", "")))
        except (OSError, KeyError, ValueError):
            continue
    return records


def _stat(pid: int) -> Optional[tuple[int, int, str]]:
    """(pgid, start time, state) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[2]), int(fields[19]), fields[0]


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return needle in fh.read().split(b"\0")
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def members_of(record: Record) -> list[int]:
    """Live processes of a recorded rank group that provably belong to its run.

    The leader's start time must match the record exactly; without a leader,
    a member needs the run id in its environment and must have started no
    earlier than the leader did.
    """
    leader = _stat(record.pgid)
    leader_ok = leader is not None and leader[1] == record.start and leader[2] != "Z"
    needle = RUN_ENV + record.run.encode()
    found = []
    for pid in _pids():
        st = _stat(pid)
        if st is None or st[0] != record.pgid or st[2] == "Z":
            continue
        if leader_ok or (st[1] >= record.start and _environ_has(pid, needle)):
            found.append(pid)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _stop(current: Callable[[], list[int]], grace: float) -> None:
    """TERM every target, wait up to ``grace``, KILL what is left.

    ``current`` is asked again at every step: a leftover may start processes
    while it is being stopped (a TERM handler that uploads a checkpoint), and
    those belong to the same group and run.
    """
    termed: set[int] = set()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        pids = [p for p in current() if _alive(p)]
        if not pids:
            return
        fresh = [p for p in pids if p not in termed]
        _signal_all(fresh, signal.SIGTERM)
        termed.update(fresh)
        time.sleep(0.05)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        pids = [p for p in current() if _alive(p)]
        if not pids:
            return
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] != "Z"


def sweep(
    *,
    host: str = "",
    runs: Optional[set[str]] = None,
    cluster: Optional[str] = None,
    all_runs: bool = False,
    pattern: Optional[str] = None,
    grace: float = SWEEP_GRACE,
    folder: Optional[str] = None,
) -> SweepReport:
    """Stop the recorded ranks selected by run ids, cluster key or ``all_runs``.

    Records whose processes are gone are removed (stale ones too). With
    ``pattern``, processes whose command line matches the regex are stopped
    as well, like ``pkill -f`` (TERM, ``grace``, KILL): an explicit opt-in,
    since it can hit processes that are not ours.
    """
    report = SweepReport(host=host)
    try:
        records = read_records(folder)
    except PermissionError as exc:
        report.errors.append(str(exc))
        records = []
    selected = [r for r in records
                if all_runs or (runs and r.run in runs) or (cluster and r.cluster == cluster)]
    targets: dict[str, list[int]] = {}
    for rec in selected:
        pids = members_of(rec)
        if pids:
            targets[rec.path] = pids
            report.stopped.append({"run": rec.run, "rank": rec.rank, "host": rec.host,
                                   "pgid": rec.pgid, "pids": pids})
    if pattern:
        regex = re.compile(pattern)
        me = {os.getpid(), os.getppid()}
        hits = [p for p in _pids() if p not in me and regex.search(_cmdline(p))]
        hits = [p for p in hits if _alive(p)]
        if hits:
            targets["pattern"] = hits
            report.stopped.append({"pattern": pattern, "pids": hits,
                                   "cmdlines": [_cmdline(p) for p in hits]})
    stopping = [rec for rec in selected if rec.path in targets]
    pattern_hits = targets.get("pattern", [])

    def current() -> list[int]:
        return [p for rec in stopping for p in members_of(rec)] + pattern_hits

    _stop(current, grace)
    for rec in selected:
        left = members_of(rec)
        if left:
            report.leftovers.append({"run": rec.run, "rank": rec.rank, "pgid": rec.pgid,
                                     "pids": left, "cmdlines": [_cmdline(p) for p in left]})
            continue
        if rec.path not in targets:
            report.stale_records += 1
        with contextlib.suppress(OSError):
            os.unlink(rec.path)
    if pattern:
        left = [p for p in targets.get("pattern", []) if _alive(p)]
        if left:
            report.leftovers.append({"pattern": pattern, "pids": left})
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="fdl-fabric-sweep")
    parser.add_argument("--host", default="")
    parser.add_argument("--run", action="append", default=[])
    parser.add_argument("--cluster")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--pattern")
    parser.add_argument("--grace", type=float, default=SWEEP_GRACE)
    args = parser.parse_args(argv)
    report = sweep(host=args.host, runs=set(args.run), cluster=args.cluster,
                   all_runs=args.all, pattern=args.pattern, grace=args.grace)
    print("FDL-SWEEP " + json.dumps(asdict(report)))
    return 0


def module_source() -> str:
    """This file's text: what `cleanup` runs remotely with ``python3 -c``."""
    with open(__file__, encoding="utf-8") as fh:
        return fh.read()


def parse_report(output: str) -> Optional[dict[str, object]]:
    for line in output.splitlines():
        if line.startswith("FDL-SWEEP "):
            data: dict[str, object] = json.loads(line[len("FDL-SWEEP "):])
            return data
    return None


if __name__ == "__main__":
    sys.exit(main())
