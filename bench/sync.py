#!/usr/bin/env python3
"""Issue 31: the code reaches every host as part of the launch (``sync:``), beside
``parallel-rsync``.

A script, not a test: it prints medians and ratios against a peer measured in the same
run (interleaved round-robin, the order reversed every other round), never asserts a
timing. Run ``python3 bench/sync.py --help``.

The project is generated: ``--files`` (2,000) files of random bytes (nothing
compresses) summing to ``--mb`` (100) MB, mixed sizes (~90 % 1-16 KiB, ~9.5 % 16-256
KiB, 1 in 200 sharing the rest), in nested folders, one executable script and one
relative symlink, a committed git work tree, plus a ``checkpoints/`` folder (20 files, 20 MiB) and a
``*.log`` that ``.gitignore`` names. fdl-fabric reads ``.gitignore`` itself (``sync:
{src: <project>}``; ``.git/`` is never sent); parallel-rsync gets ``--filter=':-
.gitignore' --exclude=/.git/``. The first round checks both tools put the same files
(paths, sizes, links) on a host.

Sections (``--only``, repeatable), on sshd lab hosts (real OpenSSH ``sshd`` per host on
loopback addresses of this machine, ``fdl_fabric.testing.SshdLab``), every rank ``true``:

* ``first``: 8 hosts with empty stores. ``fdl-fabric launch --json`` with ``sync:``
  (nothing known anywhere: no ``<path>/.fdl-code`` on any host, no hash cache on the
  controller), the same launch with ``--no-sync``, and ``parallel-rsync -a -p 8`` into
  each host's empty ``<path>/rsync-copy``. Each tool's copies are written out and
  removed right after it ran (`_round` says why), before the next tool starts.
* ``incremental``: the same three after one small file (`synclib.EDITED`, 4.5 KiB) got
  new content; every host has the previous version (both tools).
* ``noop``: a launch with ``sync:`` when nothing changed beside the same launch with
  ``--no-sync`` (8 hosts).
* ``bytes``: ``--bytes-hosts`` (32) hosts, a project of the same ``--files`` files
  summing to ``--bytes-mb`` (8) MB, flat (``--fanout 64``: the launcher reaches every
  host) and through the gateway tree (``--fanout 4``): a first sync, the same launch
  again (nothing changed), and a ``--no-sync`` launch. Bytes the launcher
  sent on its TCP connections to the lab hosts (``ss -tinpH`` bytes_sent for its pid,
  read the moment its ``launch`` record, which follows ``code_in_place``, is read; ranks
  sleep 3 s so every session is still up), minus the same reading in the ``--no-sync``
  launch (agents' source, plan, pings).

For fdl-fabric, two figures: **sync step** = ``code_in_place``'s ``seconds`` (the
manifest to every agent until every tree is in place; the manifest was built before;
it starts right after the agents were started, so it includes waiting for them),
and **added to the launch** = a launch with sync minus the launch without, paired in
the same round (it includes listing and hashing the project, the code id's ``git``
calls, and the sync step). parallel-rsync's figure is its whole command, Popen to exit:
its ssh connects and logins (one per host, every host at once) included, which a
launch pays anyway. Each lab host is this machine: every byte is encrypted by the
sender and decrypted by the receiver on the same 2 cores, and written to the same disk.

Every process started here runs in a process group of its own and only those groups are
signalled; the lab and the scratch folder are removed on exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's fdl_fabric, whatever is installed
    sys.path.insert(1, str(ROOT))

import benchlib  # noqa: E402
from benchlib import fmt, med, spread  # noqa: E402
from sync_bytes import bytes_section, report_bytes  # noqa: E402
from synclib import (  # noqa: E402
    RSYNC_DIR,
    Bench,
    Launch,
    cpu_used,
    edit,
    files_under,
    make_project,
    mib,
    prsync_argv,
    prsync_path,
    run_timed,
)

SECTIONS = ("first", "incremental", "noop", "bytes")
TOOLS = ("fdl-fabric sync", "fdl-fabric --no-sync", "parallel-rsync")


# -- first and incremental ----------------------------------------------------------------------
def _round(b: Bench, rep: int, cluster: Path, prsync: list[str], hosts: Sequence[Any],
           fresh: bool) -> dict[str, Any]:
    """One round of the three tools, in an order that flips every round.

    ``fresh`` (a first sync): each tool's copies are removed right after it ran (and
    written out first: ``sync``), so every tool starts from the same state whatever ran
    before it. On this VM the state matters: a tool that follows a large write that was
    flushed ran up to 2x faster (in CPU too) than one that follows a removal; removing
    each tool's output before its own next run billed that to whichever tool came
    first in a round. The warm-up round keeps both copies until they are compared."""
    got: dict[str, Any] = {}
    order = TOOLS if rep % 2 == 0 else TOOLS[::-1]
    for tool in order:
        os.sync()
        if tool == "fdl-fabric sync":
            got[tool] = r = cpu_used(b.lab, lambda: b.launch(cluster))
            b.say(f" sync {fmt(r.wall)} (step {fmt(r.in_place)})" if r.ok else " sync x")
        elif tool == "fdl-fabric --no-sync":
            got[tool] = r = cpu_used(b.lab, lambda: b.launch(cluster, "--no-sync"))
            b.say(f" no-sync {fmt(r.wall)}" if r.ok else " no-sync x")
        else:
            got[tool] = r = cpu_used(b.lab, lambda: run_timed(prsync, timeout=600))
            b.say(f" prsync {fmt(r.wall)}" if r.ok else " prsync x")
        if fresh and rep > 0:
            _clear_after(b, hosts, tool)
    return got


def _clear_after(b: Bench, hosts: Sequence[Any], tool: str) -> None:
    os.sync()
    if tool == "fdl-fabric sync":
        b.clear_stores(hosts, hashes=True)
    elif tool == "parallel-rsync":
        b.clear_rsync(hosts)
    os.sync()


def _check_same(b: Bench, hosts: Sequence[Any], launched: Launch) -> str:
    """Both tools put the same files on the first host (paths, sizes, links)?"""
    host = hosts[0]
    tree = launched.dirs.get(host.name)
    if tree is None:
        return "not checked (no tree reported)"
    ours, theirs = files_under(Path(tree)), files_under(Path(host.path) / RSYNC_DIR)
    if ours == theirs:
        return f"same {len(ours)} paths on {host.name} (sizes and links checked)"
    only_ours = sorted(set(ours) - set(theirs))[:3]
    only_theirs = sorted(set(theirs) - set(ours))[:3]
    sized = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])[:3]
    return (f"DIFFER on {host.name}: {len(ours)} vs {len(theirs)} paths; only fdl-fabric "
            f"{only_ours}, only rsync {only_theirs}, sizes differ {sized}")


def transfer_section(b: Bench, which: str) -> dict[str, Any]:
    hosts = b.lab.hosts[:b.args.hosts]
    cluster = b.cluster(hosts, b.project.root, f"sync-{len(hosts)}")
    prsync = prsync_argv(b.lab, hosts, b.tmp / "prsync-hosts", b.project.root)
    fresh = which == "first"
    reps = b.args.first_repeat if fresh else b.args.incr_repeat
    rounds: list[dict[str, Any]] = []
    check = ""
    if not fresh:  # both tools hold the current version first
        b.say(f"{which}: both tools sync the project once first...")
        r = b.launch(cluster)
        t = run_timed(prsync, timeout=600)
        b.say(f" {'ok' if r.ok and t.ok else 'FAILED: ' + (r.error or t.error)}\n")
    for rep in range(reps + 1):
        b.say(f"{which} round {rep + 1}/{reps + 1}{' (warm-up)' if rep == 0 else ''}:")
        if not fresh:
            edit(b.project, rep)
        got = _round(b, rep, cluster, prsync, hosts, fresh)
        if rep == 0:
            check = _check_same(b, hosts, got["fdl-fabric sync"])
            for tool in TOOLS if fresh else ():
                _clear_after(b, hosts, tool)
        b.say(f"  (load {benchlib.loadavg()})\n")
        if rep > 0:
            rounds.append(got)
    return {"rounds": rounds, "hosts": len(hosts), "check": check}


def _paired(a: Sequence[Any], b: Sequence[Any], attr: str) -> list[float]:
    """``a[i].attr - b[i].attr`` for the rounds where both ran and both have it."""
    return [getattr(x, attr) - getattr(y, attr) for x, y in zip(a, b)
            if x.ok and y.ok and getattr(x, attr) is not None and getattr(y, attr) is not None]


def _ok(samples: Sequence[Any], attr: str) -> list[float]:
    return [getattr(s, attr) for s in samples if s.ok and getattr(s, attr) is not None]


def report_transfer(res: dict[str, Any], which: str, title: str, target: float,
                    b: Bench, targets: list[list[str]]) -> None:
    rounds = res["rounds"]
    sync = [r["fdl-fabric sync"] for r in rounds]
    nosync = [r["fdl-fabric --no-sync"] for r in rounds]
    prs = [r["parallel-rsync"] for r in rounds]
    added = _paired(sync, nosync, "wall")
    to_running = _paired(sync, nosync, "arr_at")
    step = _ok(sync, "in_place")
    p = med(_ok(prs, "wall"))

    def ratio(values: list[float]) -> str:
        m = med(values)
        return fmt(m / p if p and m is not None else None)

    rows = [["tool", "median s", "min-max", "x parallel-rsync", "controller CPU s",
             "hosts CPU s", "runs"],
            ["fdl-fabric: added to the launch", fmt(med(added)), spread(added), ratio(added),
             fmt(med(_paired(sync, nosync, "ctl_cpu"))),
             fmt(med(_paired(sync, nosync, "host_cpu"))), str(len(added))],
            ["fdl-fabric: added to all ranks running", fmt(med(to_running)),
             spread(to_running), ratio(to_running), "", "", str(len(to_running))],
            ["fdl-fabric: sync step (code_in_place)", fmt(med(step)), spread(step),
             ratio(step), "", "", str(len(step))],
            ["parallel-rsync -a (whole command)", fmt(p), spread(_ok(prs, "wall")),
             "1.00" if p else "n/a", fmt(med(_ok(prs, "ctl_cpu"))),
             fmt(med(_ok(prs, "host_cpu"))), str(len(_ok(prs, "wall")))]]
    for name, samples in (("fdl-fabric launch with sync (whole)", sync),
                          ("fdl-fabric launch --no-sync (whole)", nosync)):
        rows.append([name, fmt(med(_ok(samples, "wall"))), spread(_ok(samples, "wall")), "",
                     fmt(med(_ok(samples, "ctl_cpu"))), fmt(med(_ok(samples, "host_cpu"))),
                     str(len(_ok(samples, "wall")))])
    b.say(f"\n{title} ({res['hosts']} hosts, {len(rounds)} rounds after a warm-up)\n\n")
    b.say(benchlib.table(rows, [False] + [True] * 6) + "\n")
    received = med([float(s.received) for s in sync if s.ok])
    b.say("added = the launch with sync minus the launch --no-sync of the same round (wall, "
          "CPU); to all ranks running: Popen -> the `all_ranks_running` record, the same "
          "difference (the teardown left out).\n"
          "fdl-fabric: Popen -> `code` record (manifest built) "
          f"{fmt(med(_ok(sync, 'code_at')))} s; "
          f"the hosts received {mib(received)} in all (median); {res['check']}\n")
    for name, samples in (("sync", sync), ("no-sync", nosync), ("parallel-rsync", prs)):
        for i, s in enumerate(samples):
            if not s.ok:
                b.say(f"  ! {name} round {i + 1}: {s.error[:300]}\n")
    if p and added:
        for what, value in (("added to the launch", med(added)), ("sync step", med(step))):
            if value is None:
                continue
            r = value / p
            targets.append([f"{which} sync, {res['hosts']} hosts, {what} / parallel-rsync",
                            f"{r:.2f}x", f"<= {target:g}x", "met" if r <= target else "MISSED"])


# -- noop ---------------------------------------------------------------------------------------
def noop_section(b: Bench) -> dict[str, Any]:
    hosts = b.lab.hosts[:b.args.hosts]
    cluster = b.cluster(hosts, b.project.root, f"noop-{len(hosts)}")
    b.say("noop: one sync first...")
    first = b.launch(cluster)
    b.say(f" {'ok' if first.ok else 'FAILED: ' + first.error}\n")
    tools = ("fdl-fabric sync", "fdl-fabric --no-sync")
    rounds: list[dict[str, Launch]] = []
    for rep in range(b.args.noop_repeat + 1):
        b.say(f"noop round {rep + 1}/{b.args.noop_repeat + 1}"
              f"{' (warm-up)' if rep == 0 else ''}:")
        got: dict[str, Launch] = {}
        for tool in (tools if rep % 2 == 0 else tools[::-1]):
            extra: tuple[str, ...] = () if tool == "fdl-fabric sync" else ("--no-sync",)

            def run(extra: tuple[str, ...] = extra) -> Launch:
                return b.launch(cluster, *extra)

            got[tool] = r = cpu_used(b.lab, run)
            b.say(f" {tool.split()[-1]} {fmt(r.wall)}" +
                  (f" (step {fmt(r.in_place, 3)})" if r.in_place is not None else "")
                  if r.ok else f" {tool} x")
        b.say(f"  (load {benchlib.loadavg()})\n")
        if rep > 0:
            rounds.append(got)
    return {"rounds": rounds, "hosts": len(hosts)}


def report_noop(res: dict[str, Any], b: Bench, targets: list[list[str]]) -> None:
    rounds = res["rounds"]
    sync = [r["fdl-fabric sync"] for r in rounds]
    nosync = [r["fdl-fabric --no-sync"] for r in rounds]
    added = _paired(sync, nosync, "wall")
    to_running = _paired(sync, nosync, "arr_at")
    ctl, host = _paired(sync, nosync, "ctl_cpu"), _paired(sync, nosync, "host_cpu")
    step = _ok(sync, "in_place")
    had = all(s.had == res["hosts"] and s.received == 0 for s in sync if s.ok)
    rows = [["measure", "median s", "min-max", "mean +- s.e.", "runs"]]
    for name, values in (("launch with sync (nothing changed)", _ok(sync, "wall")),
                         ("launch --no-sync", _ok(nosync, "wall")),
                         ("added (paired per round)", added),
                         ("added to all ranks running (paired)", to_running),
                         ("controller CPU added (paired)", ctl),
                         ("hosts' CPU added (paired)", host),
                         ("sync step (code_in_place)", step),
                         ("Popen -> `code` record (manifest)", _ok(sync, "code_at"))):
        rows.append([name, fmt(med(values), 3), spread(values, 3), benchlib.mean_se(values),
                     str(len(values))])
    b.say(f"\n3. no-change sync added to a launch ({res['hosts']} hosts, rank `true`, "
          f"{len(rounds)} rounds after a warm-up)\n\n")
    b.say(benchlib.table(rows, [False, True, True, True, True]) + "\n")
    b.say(f"every host had the tree and received 0 bytes: {'yes' if had else 'NO'}\n")
    for name, samples in (("sync", sync), ("no-sync", nosync)):
        for i, s in enumerate(samples):
            if not s.ok:
                b.say(f"  ! {name} round {i + 1}: {s.error[:300]}\n")
    if added:
        value = med(added)
        assert value is not None
        targets.append([f"no-change sync added to a launch, {res['hosts']} hosts",
                        f"{value:.3f} s", "<= 0.2 s", "met" if value <= 0.2 else "MISSED"])


# -- the whole ----------------------------------------------------------------------------------
_LAB: Any = None


def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    global _LAB
    started = time.monotonic()
    if prsync_path() is None and ({"first", "incremental"} & set(args.only)):
        out.write("parallel-rsync not found: install rsync and pssh (Debian: apt-get install "
                  "rsync pssh)\n")
        return 2
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    n_hosts = max(args.hosts if set(args.only) - {"bytes"} else 0,
                  args.bytes_hosts if "bytes" in args.only else 0)
    lab = _LAB = benchlib.start_lab(tmp / "lab", n_hosts, out)
    b = Bench(args, tmp, lab, out)
    if set(args.only) - {"bytes"}:
        b.say(f"generating {args.files} files, {args.mb} MB... ")
        b.project = make_project(tmp / "project", args.files, args.mb * 1_000_000)
        b.say(f"{b.project.files} files, {mib(b.project.bytes)} to send, "
              f"{mib(b.project.ignored_bytes)} ignored; git add+commit "
              f"{b.project.git_seconds:.1f} s\n")
    if "bytes" in args.only:
        b.small_project = make_project(tmp / "small", args.files, args.bytes_mb * 1_000_000,
                                       ignored_bytes=1 << 20)
    time.sleep(2.5)  # past the hash cache's racy window (files this recent are re-hashed)
    targets: list[list[str]] = []
    reports: list[Callable[[], None]] = []
    if "first" in args.only:
        fres = transfer_section(b, "first")
        reports.append(lambda: report_transfer(fres, "first", "1. first sync", 1.0, b,
                                               targets))
    if "incremental" in args.only:
        ires = transfer_section(b, "incremental")
        reports.append(lambda: report_transfer(ires, "incremental",
                                               "2. incremental sync, one file changed", 0.5,
                                               b, targets))
    if "noop" in args.only:
        nres = noop_section(b)
        reports.append(lambda: report_noop(nres, b, targets))
    if "bytes" in args.only:
        bres = bytes_section(b)
        reports.append(lambda: report_bytes(bres, b, targets))
    for write in reports:
        write()
    out.write("\nTargets (issue 31)\n\n")
    out.write(benchlib.table([["measure", "got", "target", ""], *targets],
                             [False, True, False, False]) + "\n")
    notes_extra = {"rsync": benchlib.tool_version(["rsync", "--version"])}
    benchlib.write_machine_notes(out, load_start, started)
    for k, v in notes_extra.items():
        out.write(f"  {k}: {v}\n")
    return 0


def _cleanup() -> None:
    benchlib.stop_all()
    if _LAB is not None:
        _LAB.stop()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = benchlib.arg_parser(doc, epilog=True)
    ap.add_argument("--only", action="append", choices=SECTIONS,
                    help="run only this section (repeatable; default all)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--hosts", type=int, default=8, help="first, incremental, noop: hosts (8)")
    ap.add_argument("--files", type=int, default=2000, help="files in the project (2,000)")
    ap.add_argument("--mb", type=int, default=100, help="project size, MB (100)")
    ap.add_argument("--first-repeat", type=int, help="first: measured rounds (6; quick 2)")
    ap.add_argument("--incr-repeat", type=int, help="incremental: measured rounds (8; quick 4)")
    ap.add_argument("--noop-repeat", type=int, help="noop: measured rounds (16; quick 8)")
    ap.add_argument("--bytes-hosts", type=int, default=32, help="bytes: hosts (32)")
    ap.add_argument("--bytes-mb", type=int, default=8, help="bytes: project size, MB (8)")
    ap.add_argument("--tree-fanout", type=int, default=4, help="bytes: the tree's fanout (4)")
    ap.add_argument("--bytes-repeat", type=int, help="bytes: rounds (1)")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)
    args.only = args.only or list(SECTIONS)
    quick = {"first_repeat": 2, "incr_repeat": 4, "noop_repeat": 8, "bytes_repeat": 1}
    full = {"first_repeat": 6, "incr_repeat": 8, "noop_repeat": 16, "bytes_repeat": 1}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return benchlib.run_in_scratch("fdl-sync-", args, bench, _cleanup)


if __name__ == "__main__":
    sys.exit(main())
