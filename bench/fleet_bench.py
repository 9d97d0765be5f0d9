#!/usr/bin/env python3
"""Issue 33: what the fleet pre-flight (host-to-host reachability and the interfaces)
costs ``prebuild-check``, and how it grows with the hosts.

A script, not a test: it prints medians and ratios against peers measured in the same
run (interleaved round-robin, the order reversed every other round, after a discarded
warm-up round), never asserts a timing. Run ``python3 bench/fleet_bench.py --help``.

Every run is one fresh process doing what ``inv prebuild-check`` does
(``fdl_fabric.preflight.run_checks(load_cluster(f), argv=["true"])``, not ``--fast``), on
sshd lab hosts (real OpenSSH ``sshd`` per host on loopback addresses of this machine,
``fdl_fabric.testing.SshdLab``; ``nproc: 1`` a host, ``master_port`` a port free at the
start, ``nccl_socket_ifname: lo`` on every host (``--ifname``), so the interface check
runs too: its per-host row, and every peer dialing each host's listener at that
interface's address as well, which stays on loopback). The package comes from a git
worktree of each commit, made in the scratch folder and imported through ``PYTHONPATH``
(the run checks ``fdl_fabric.__file__`` is in it); the worktrees are removed at the end.
The interpreter start and imports are outside the figures.

Sections (``--only``, repeatable):

* ``total``: prebuild-check at ``--total-hosts`` (8) hosts, three variants: **before**
  (``--before``, aaab625: no fleet check), **after** (``--after``, HEAD), and **after,
  no fleet step** (the same tree, ``preflight.run.prebuild_fleet`` replaced by a no-op in
  that process: the agents are still kept and dismissed). Wall time from the call to its
  return, the process's CPU (``time.process_time``: every thread of the launcher), for
  the after tree the fleet step's own time and the kept agents' dismissal
  (``dismiss_all``, which the before tree does not have), and the ratio after/before
  (target: the added rows must not double it).
* ``fleet``: the after tree at ``--hosts`` (8 and 32). Around ``fleetcheck.check_reach``
  (wrapped in that process; the fleet step without the smoke test is it and the plan):
  its wall time, the launcher's CPU during it (``process_time``), the CPU of every
  process under the lab's sshd listeners during it (the agents, their sshd sessions:
  on this machine they share the launcher's 2 cores), and how many dials the matrix
  made (``matrix.dials``, wrapped). Then the per-host slope and the extrapolation to 64
  hosts (target: <= 10 s), linear in hosts and, since up to ``fanout`` (64) every pair is
  dialed, linear in dials too.

Every process started here runs in a process group of its own and only those groups are
signalled; the lab, the worktrees and the scratch folder are removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

ROOT = Path(__file__).resolve().parent.parent
if "--child" not in sys.argv and str(ROOT) not in sys.path:  # the checkout's, not a tree's
    sys.path.insert(1, str(ROOT))

import benchlib  # noqa: E402
from benchlib import fmt, med, ratio, spread  # noqa: E402

SECTIONS = ("total", "fleet")
BEFORE, AFTER, NO_FLEET = "before", "after", "after, no fleet step"
VARIANTS = (BEFORE, AFTER, NO_FLEET)
#: The rank command every pre-flight checks (resolved on every host).
RANK_ARGV = ["true"]
#: Seconds one run may take before it is stopped and counted as failed.
RUN_TIMEOUT = 300.0
TARGET_HOSTS = 64
TARGET_S = 10.0

_LAB: Any = None
_TREES: list[Path] = []


# -- the child: one prebuild-check in a fresh process ---------------------------------------
def _host_procs(sshd_pids: Sequence[int]) -> list[Any]:
    """Every process under the lab's sshd listeners now (sessions, shells, agents)."""
    import psutil

    found: list[Any] = []
    for pid in sshd_pids:
        with contextlib.suppress(psutil.Error):
            found += psutil.Process(pid).children(recursive=True)
    return found


def _cpu_of(procs: Sequence[Any]) -> dict[int, float]:
    import psutil

    got: dict[int, float] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            got[p.pid] = t.user + t.system
    return got


def _instrument(spec: dict[str, Any], got: dict[str, Any]) -> None:
    """Wrap the fleet step, `check_reach`, `matrix.dials` and `dismiss_all` of the
    imported tree so their time, CPU and dial count land in ``got``."""
    from fdl_fabric.preflight import run as run_mod

    if not hasattr(run_mod, "prebuild_fleet"):  # a tree from before the fleet check
        return
    from fdl_fabric.preflight import fleetcheck, matrix

    # patched by name: run_checks and prebuild_fleet look these up as module globals
    real_fleet = getattr(run_mod, "prebuild_fleet")  # noqa: B009
    real_dismiss = getattr(run_mod, "dismiss_all")  # noqa: B009
    real_reach, real_dials = fleetcheck.check_reach, matrix.dials
    procs: list[Any] = []

    def fleet(*args: Any, **kwargs: Any) -> Any:
        procs[:] = _host_procs(spec["sshd_pids"])  # listed before the clock starts
        wall, cpu = time.monotonic(), time.process_time()
        try:
            return real_fleet(*args, **kwargs)
        finally:
            got["fleet_wall"] = time.monotonic() - wall
            got["fleet_cpu"] = time.process_time() - cpu

    def dismiss(*args: Any, **kwargs: Any) -> Any:
        wall = time.monotonic()
        try:
            return real_dismiss(*args, **kwargs)
        finally:
            got["dismiss_wall"] = time.monotonic() - wall

    def reach(*args: Any, **kwargs: Any) -> Any:
        hosts_before = _cpu_of(procs)
        wall, cpu = time.monotonic(), time.process_time()
        try:
            return real_reach(*args, **kwargs)
        finally:
            got["reach_wall"] = time.monotonic() - wall
            got["reach_cpu"] = time.process_time() - cpu
            after = _cpu_of(procs)
            got["hosts_cpu"] = (sum(after.get(p, v) - v for p, v in hosts_before.items())
                                if procs else None)

    def dials(*args: Any, **kwargs: Any) -> Any:
        out = real_dials(*args, **kwargs)
        got["dials"] = sum(len(t) for t in out.values())
        return out

    setattr(run_mod, "prebuild_fleet", fleet)  # noqa: B010
    setattr(run_mod, "dismiss_all", dismiss)  # noqa: B010
    setattr(fleetcheck, "check_reach", reach)  # noqa: B010
    setattr(matrix, "dials", dials)  # noqa: B010


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One prebuild-check of ``spec["cluster"]`` with the package of ``spec["root"]``."""
    import fdl_fabric

    package = Path(fdl_fabric.__file__).resolve()
    if Path(spec["root"]).resolve() not in package.parents:
        return {"error": f"imported {package}, not the tree {spec['root']}"}
    from fdl_fabric.clusterfile import load_cluster
    from fdl_fabric.preflight import run as run_mod

    got: dict[str, Any] = {"package": str(package)}
    if spec["instrument"]:
        _instrument(spec, got)
    if spec["skip_fleet"]:
        setattr(run_mod, "prebuild_fleet", lambda *a, **k: [])  # noqa: B010
    cluster = load_cluster(spec["cluster"])
    wall, cpu = time.monotonic(), time.process_time()
    report = run_mod.run_checks(cluster, argv=spec["argv"])
    got["total_wall"] = time.monotonic() - wall
    got["total_cpu"] = time.process_time() - cpu
    got["rows"] = [[c.host, c.name, c.status.value, c.reason] for c in report.checks]
    return got


# -- the parent ------------------------------------------------------------------------------
@dataclass
class Tree:
    """A checkout whose package a run imports (through PYTHONPATH)."""

    label: str
    path: Path
    commit: str


@dataclass
class Sample:
    """One run's figures (None where that tree or run has no such figure)."""

    ok: bool
    error: str = ""
    values: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> Optional[float]:
        value = self.values.get(key)
        return float(value) if self.ok and value is not None else None


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()


def make_tree(label: str, ref: str, scratch: Path) -> Tree:
    """``ref`` as a detached worktree under ``scratch``; ``.`` is this checkout as it is."""
    if ref == ".":
        commit, dirty = benchlib.checkout_commit()
        return Tree(label, ROOT, commit + (" + uncommitted changes" if dirty else ""))
    path = scratch / f"tree-{label}"
    _git("worktree", "add", "--detach", str(path), ref)
    _TREES.append(path)
    return Tree(label, path, _git("-C", str(path), "rev-parse", "--short", "HEAD"))


def run_one(tree: Tree, cluster: Path, *, skip_fleet: bool = False,
            sshd_pids: Sequence[int] = ()) -> Sample:
    """One prebuild-check in a fresh process importing ``tree``'s package."""
    spec = {"root": str(tree.path), "cluster": str(cluster), "argv": RANK_ARGV,
            "skip_fleet": skip_fleet, "instrument": tree.label != BEFORE,
            "sshd_pids": list(sshd_pids)}
    env = {**os.environ, "PYTHONPATH": str(tree.path)}
    proc = benchlib.start([sys.executable, str(Path(__file__).resolve()), "--child",
                           json.dumps(spec)], env=env, cwd=str(tree.path))
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        benchlib.stop(proc)
        return Sample(False, f"no result within {RUN_TIMEOUT:g} s")
    benchlib.forget(proc)
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        values = json.loads(lines[-1])
    except (IndexError, ValueError):
        return Sample(False, f"exit {proc.returncode}: {err.decode(errors='replace')[-400:]}")
    if "error" in values:
        return Sample(False, values["error"])
    failed = [f"{r[0]} {r[1]}: {r[3]}" for r in values["rows"] if r[2] == "FAIL"]
    return Sample(not failed, "; ".join(failed), values)


def rounds(n: int, variants: Sequence[str], once: Callable[[str], Sample],
           out: TextIO) -> dict[str, list[Sample]]:
    """A discarded warm-up round, then ``n`` rounds, the order reversed every other one."""
    got: dict[str, list[Sample]] = {v: [] for v in variants}
    for rep in range(n + 1):
        order = variants if rep % 2 == 0 else variants[::-1]
        out.write("warm-up:" if rep == 0 else f"round {rep}:")
        for v in order:
            s = once(v)
            out.write(f" {v} {fmt(s.values.get('total_wall'))}" + ("" if s.ok else " FAILED"))
            if not s.ok:
                out.write(f"\n  ({s.error[:300]})\n ")
            if rep > 0:
                got[v].append(s)
        out.write(f"  [load {benchlib.loadavg()}]\n")
        out.flush()
    return got


def _good(samples: Sequence[Sample]) -> int:
    return sum(s.ok for s in samples)


def _m(samples: Sequence[Sample], key: str) -> Optional[float]:
    return med(s.get(key) for s in samples)


def total_section(args: argparse.Namespace, lab: Any, trees: dict[str, Tree],
                  out: TextIO) -> None:
    n = args.total_hosts
    out.write(f"\n== total: prebuild-check at {n} hosts ==\n")
    cluster = write_cluster(lab, n, args.ifname)
    tree_of = {BEFORE: trees[BEFORE], AFTER: trees[AFTER], NO_FLEET: trees[AFTER]}
    got = rounds(args.repeat, VARIANTS,
                 lambda v: run_one(tree_of[v], cluster, skip_fleet=v == NO_FLEET), out)
    base = _m(got[BEFORE], "total_wall")
    rows = [["variant", "commit", "runs", "total s", "spread", "launcher CPU s",
             "fleet step s", "dismiss s", "x before"]]
    for v in VARIANTS:
        s = got[v]
        rows.append([v, tree_of[v].commit, benchlib.runs_cell(_good(s), len(s) - _good(s)),
                     fmt(_m(s, "total_wall")), spread(x.get("total_wall") for x in s),
                     fmt(_m(s, "total_cpu")), fmt(_m(s, "fleet_wall"), 3),
                     fmt(_m(s, "dismiss_wall"), 3),
                     ratio(_m(s, "total_wall"), base)])
    benchlib.write_table(out, rows, [False, False] + [True] * 7,
                         f"prebuild-check, {n} lab hosts (medians of {args.repeat} runs)")
    added, skipped = _m(got[AFTER], "total_wall"), _m(got[NO_FLEET], "total_wall")
    out.write(f"\nafter / before: {ratio(added, base)} (target: < 2.00); after - before: "
              f"{fmt(None if added is None or base is None else added - base, 3)} s; "
              f"after - no fleet step: "
              f"{fmt(None if added is None or skipped is None else added - skipped, 3)} s\n")
    _say_rows(got[AFTER], out)


def _say_rows(samples: Sequence[Sample], out: TextIO) -> None:
    """The fleet rows of the first good run (what the check said): every ``reach``
    row, and the first ``nic`` row with how many there were."""
    for s in samples:
        if s.ok:
            rows = s.values["rows"]
            nic = [r for r in rows if r[1] == "nic"]
            for host, name, status, reason in [r for r in rows if r[1] == "reach"] + nic[:1]:
                out.write(f"  {host} {name} {status}: {reason}\n")
            if len(nic) > 1:
                out.write(f"  ... {len(nic)} nic rows, "
                          f"{sum(r[2] == 'ok' for r in nic)} ok\n")
            return


def fleet_section(args: argparse.Namespace, lab: Any, trees: dict[str, Tree],
                  out: TextIO) -> None:
    out.write(f"\n== fleet: the matrix and interface checks at {args.hosts} hosts ==\n")
    tree = trees[AFTER]
    pids = [h.sshd.pid for h in lab.hosts]
    clusters = {f"{n} hosts": (n, write_cluster(lab, n, args.ifname)) for n in args.hosts}
    got = rounds(args.repeat, list(clusters),
                 lambda v: run_one(tree, clusters[v][1], sshd_pids=pids), out)
    rows = [["hosts", "runs", "dials", "check_reach s", "spread", "launcher CPU s",
             "hosts' CPU s", "fleet step s", "total s"]]
    points: list[tuple[float, float, float]] = []
    for label, (n, _) in clusters.items():
        s = got[label]
        wall, dials = _m(s, "reach_wall"), _m(s, "dials")
        if wall is not None and dials is not None:
            points.append((n, dials, wall))
        rows.append([str(n), benchlib.runs_cell(_good(s), len(s) - _good(s)), fmt(dials, 0),
                     fmt(wall), spread(x.get("reach_wall") for x in s),
                     fmt(_m(s, "reach_cpu")), fmt(_m(s, "hosts_cpu")),
                     fmt(_m(s, "fleet_wall")), fmt(_m(s, "total_wall"))])
    benchlib.write_table(out, rows, [True] * 9,
                         f"fleet check (check_reach), medians of {args.repeat} runs")
    _extrapolate(points, out)
    _say_rows(got[list(clusters)[-1]], out)


def _extrapolate(points: Sequence[tuple[float, float, float]], out: TextIO) -> None:
    """Per-host slope and the 64-host figure, linear in hosts and linear in dials (every
    pair is dialed up to fanout, so dials grow as hosts squared)."""
    slope, icpt = benchlib.fit([(n, w) for n, _, w in points])
    if slope is None or icpt is None:
        out.write("\n(one host count only: no slope)\n")
        return
    at64 = icpt + slope * TARGET_HOSTS
    out.write(f"\nper-host slope: {slope * 1000:.1f} ms/host, intercept {icpt:.2f} s -> "
              f"{at64:.2f} s at {TARGET_HOSTS} hosts (target <= {TARGET_S:g} s)\n")
    per_dial, d_icpt = benchlib.fit([(d, w) for _, d, w in points])
    n_big, d_big, w_big = max(points)
    if n_big >= TARGET_HOSTS:
        out.write(f"measured at {n_big:.0f} hosts: {w_big:.2f} s ({d_big:.0f} dials)\n")
    if per_dial is not None and d_icpt is not None:
        d64 = d_big * TARGET_HOSTS * (TARGET_HOSTS - 1) / (n_big * (n_big - 1))
        out.write(f"per-dial slope: {per_dial * 1000:.3f} ms/dial -> ~{d64:.0f} dials, "
                  f"{d_icpt + per_dial * d64:.2f} s at {TARGET_HOSTS} hosts (every pair, "
                  f"as {n_big} hosts had {d_big:.0f})\n")


def write_cluster(lab: Any, n: int, ifname: str) -> Path:
    """The first ``n`` lab hosts, one rank each, ``nccl_socket_ifname: ifname`` on each
    (unless empty), ``master_port`` free on rank 0's host now."""
    from fdl_fabric.testing.processes import free_port

    hosts = lab.hosts[:n]
    extra = {"nccl_socket_ifname": ifname} if ifname else {}
    return Path(lab.write_cluster([lab.worker(h, nproc=1, **extra) for h in hosts],
                                  filename=f"cluster-{n}.yml",
                                  master_port=free_port(hosts[0].addr)))


def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    global _LAB
    started = time.monotonic()
    load = benchlib.wait_for_quiet(args.wait_load, out)
    trees: dict[str, Tree] = {AFTER: make_tree(AFTER, args.after, tmp)}
    if "total" in args.only:
        trees[BEFORE] = make_tree(BEFORE, args.before, tmp)
    for t in trees.values():
        out.write(f"{t.label}: {t.commit} ({t.path})\n")
    need = max([args.total_hosts] * ("total" in args.only)
               + list(args.hosts) * ("fleet" in args.only))
    _LAB = benchlib.start_lab(tmp / "lab", need, out)
    if "total" in args.only:
        total_section(args, _LAB, trees, out)
    if "fleet" in args.only:
        fleet_section(args, _LAB, trees, out)
    benchlib.write_machine_notes(
        out, load, started,
        **{"trees": ", ".join(f"{t.label} {t.commit}" for t in trees.values()),
           "rank command": " ".join(RANK_ARGV),
           "nccl_socket_ifname": args.ifname or "unset"})
    return 0


def _cleanup() -> None:
    benchlib.stop_all()
    if _LAB is not None:
        _LAB.stop()
    for path in _TREES:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _git("worktree", "remove", "--force", str(path))


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__, epilog=True)
    ap.add_argument("--only", action="append", choices=SECTIONS,
                    help="run only this section (repeatable; default both)")
    ap.add_argument("--quick", action="store_true",
                    help="2 measured rounds, fleet at 8 and 16 hosts (~1 min)")
    ap.add_argument("--repeat", type=int, help="measured rounds after a warm-up (5; quick 2)")
    ap.add_argument("--total-hosts", type=int, default=8, help="total: lab hosts (8)")
    ap.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")],
                    help="fleet: lab host counts, comma-separated (8,32; quick 8,16)")
    ap.add_argument("--ifname", default="lo",
                    help="nccl_socket_ifname of every host (lo: the interface check's dials "
                         "stay on loopback; '' leaves it unset, and no interface is dialed)")
    ap.add_argument("--before", default="aaab625",
                    help="total: the commit before the fleet check (aaab625)")
    ap.add_argument("--after", default="HEAD",
                    help="the commit measured as after (HEAD; '.' = this checkout as it is)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    if args.repeat is None:
        args.repeat = 2 if args.quick else 5
    if args.hosts is None:
        args.hosts = [8, 16] if args.quick else [8, 32]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    return benchlib.run_in_scratch("fdl-fleet-", args, bench, _cleanup)


if __name__ == "__main__":
    sys.exit(main())
