#!/usr/bin/env python3
"""The controller's cost for 1,024 hosts x 8 ranks: 32 real gateways, emulated leaves.

A script, not a test: it prints figures, never asserts them (issue 23, "a gateway
emulator"). Run ``python3 bench/emulator.py --help``.

What is real: the launcher process (``inv launch`` from this repository, unchanged but
for one swapped command, below), its Fabric/paramiko connections to ``--gateways`` sshd
lab hosts, each gateway's own agent session and its ``--ranks`` real ranks, the relay
session on each gateway's connection (a second SSH session, fed the agent payload as
always), `GatewayTransport`/`RelayedAgent` for every leaf, the sessions, the supervisor,
the coordinator, and the output path (every rank's ``up`` line is read on the launcher's
stdout). The cluster file lists ``G x (1 + L)`` SSH workers with ``fanout: G``, so the
tree (`fdl_fabric.planning.tree`) makes the G lab hosts the gateways and gives each L
leaves named ``leafNNNN`` whose ssh target ``leafNNNN.invalid`` never resolves: nothing
ever dials them.

What is emulated: the relay. The launcher runs under a small wrapper (this script with
``--as-launcher``) that replaces ``bundle.remote_command("relay")`` (what
`fdl_fabric.transport.gateway.Relay.start` runs on the gateway) by
``bench/emulated_relay.py``, which speaks the real relay's mux upward and emulates every
leaf's agent and ranks in one process: agent handshake, HELLO, PREFLIGHT (with a real
dial of the coordinator), SWEPT, SPAWNED, each rank's ``up`` line, heartbeats on pings,
exits on stop/kill/EOF or when the synthetic work ends, VERIFIED, DONE, CLOSED; batched
by the real relay's `Batcher`. In mode ``join`` (the default) each synthetic rank joins
the launcher's coordinator through its emulated agent, as a real launch does since issue
35: its hello up as a COHORT_UP frame on its leaf's stream (type, rank, host, pid, lib),
the coordinator's welcome down as COHORT_DOWN, broadcasts answered as the real agent
answers them, one BEATS frame a leaf a second with every joined rank's [age, progress];
and the gateways' real ranks run a real ``rank.join()`` through their real agents, so
the cohort forms (its formation is timed, and the coordinator's liveness rules run over
the folded beats). In mode ``join-tcp`` each synthetic rank joins over TCP directly (the
path of a rank started by hand; a loopback address of its leaf's own, `fdl_fabric.rank`
frames, a heartbeat a second), the issue-23 measurement; in mode ``no-join`` it does not
join, which isolates the transport's cost. In those two modes the gateways' real ranks
run ``sh -c 'echo up $RANK; exec sleep W'`` and do not join, so the cohort never forms.

Measured on the launcher process (``/proc/<pid>``, all threads; ``wait4`` at its exit):
CPU seconds from its start to the last ``up`` line read (**CPU to all running**), time
to all running; in the join modes also time and CPU to every rank joined (in mode
``join`` the relays' notes of their synthetic ranks, then a relay's note that the cohort
formed, so the gateways' real ranks too; the launcher's sockets in ``join-tcp``); thread
count (the most seen, sampled every 0.1 s); CPU % of one core over ``--window`` s
starting ``--settle`` s after all running (and all joined): **idle**; its open files then
(``/proc/<pid>/fd``); in mode ``join`` the **formation** time (the last hello of any
rank, synthetic or real, to the first ``formed`` broadcast an emulated agent reads;
wall clock, one machine); peak RSS (VmHWM); total CPU at its exit (after every rank
ended by itself and the verdict), its exit status and verdict. Beside it, for context:
the emulated relays' and the gateways' agents' CPU, and the synthetic ranks' join times
(hello sent, or first dial in ``join-tcp``, to ``welcome``) against `rank.join`'s 30 s
default deadline.
Targets (issue 23): <= 3 s of controller CPU, <= 100 threads, idle <= 2 % of a core.

The launcher counts its open files per host since issue 35 (about 600 at 1,024 x 8,
`fdl_fabric.transport.open_files_needed`): the output says what it asks for against this
machine's hard limit, and the launcher's own check runs unchanged (no wrapper; the old
``--lenient-nofile`` is gone). Mode ``join-tcp`` may need more than that count (a file
per rank's connection), which the launcher no longer provisions for.

**Where the run records go** is said in the output, with what a rank's folder and two
files cost there just before the run (`fsprobe`): the launcher makes 8,192 of each, and
on ext4 without a journal (this machine's root) that cost grows tenfold for a few
minutes after a big folder is deleted. ``--runs-dir /dev/shm/...`` (a tmpfs) takes the
disk out of the figures. By default the records go to a folder of the bench's own.

**The controller has a core of its own** (``--pin``, the default on a machine of two
or more cores): the launcher runs on CPU 0 alone, and the 32 lab hosts' sshd (so
everything started under them: the gateways' agents, relays and real ranks, and the
emulated relays) and this script on the others. On a real cluster those processes run on
their own hosts' CPUs, never on the controller's. Without it (``--no-pin``, the method of
issue 35's first six rounds) the 256 real ranks' Python starts (about 18 s of CPU between
them) take most of the two cores while the synthetic hellos arrive, and the launcher's
join figures measure that contention. ``nice`` cannot do this here: every SSH session is
an autogroup of its own, and the scheduler shares the CPU between groups first.

Every process started here runs in a process group of its own and only those groups are
signalled; the lab and the temporary folder are removed on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from emulatorlib import Sample, measure

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RELAY_SCRIPT = os.path.join(HERE, "emulated_relay.py")
#: The CPUs the launcher keeps to itself (``--pin``), passed to ``--as-launcher``.
CONTROLLER_CPUS = "FDL_BENCH_CONTROLLER_CPUS"
MODES = ("join", "join-tcp", "no-join")


# -- the launcher, with the relay's command swapped ---------------------------------------------
def as_launcher(argv: list[str]) -> int:
    """``--as-launcher RELAY_ARGS -- <invoke args>``: run ``inv`` in this process with
    ``bundle.remote_command("relay")`` replaced by the emulated relay's command (with
    RELAY_ARGS, one shell-quoted string). Nothing else of the launcher is touched.
    ``FDL_BENCH_YAPPI=FILE`` (``pip install yappi``): the launcher's CPU per function,
    every thread, saved as a pstats file, and each busy thread's in ``FILE.<name>-<tid>``
    (15x slower: for where, not how much)."""
    # bench/ (this script's folder) off the path: its profile.py shadows the stdlib's.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    sys.path.insert(0, ROOT)
    mine = argv[:argv.index("--")]
    relay_args = mine[-1]
    inv_args = argv[argv.index("--") + 1:]
    from fdl_fabric.shell import quote
    from fdl_fabric.transport import bundle

    real = bundle.remote_command
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    relay_cmd = (f"exec {quote(python)} -I -S {quote(RELAY_SCRIPT)} --payload-bytes "
                 f"{len(bundle.payload())} {relay_args}")

    def remote_command(mode: str = "agent") -> str:
        return relay_cmd if mode == "relay" else real(mode)

    bundle.remote_command = remote_command  # type: ignore[assignment]
    from invoke.main import program

    sys.argv = ["inv", *inv_args]  # the launch reads ``-- prog args`` from sys.argv
    pinned = os.environ.pop(CONTROLLER_CPUS, "")
    if pinned:  # before any thread starts: each inherits its creator's CPUs
        os.sched_setaffinity(0, {int(c) for c in pinned.split(",")})
    prof = os.environ.get("FDL_BENCH_YAPPI")
    if prof:
        import yappi
        yappi.set_clock_type("cpu")
        yappi.start()
        try:
            program.run(sys.argv, exit=False)
        finally:
            yappi.stop()
            yappi.get_func_stats().save(prof, type="pstat")
            names = {t.ident: t.name for t in threading.enumerate()}  # those still alive
            for thread in yappi.get_thread_stats():  # and each busy thread's own
                if thread.ttot >= 0.05:
                    name = re.sub(r"[^\w-]", "_", names.get(thread.tid, thread.name))
                    yappi.get_func_stats(filter={"ctx_id": thread.id}).save(
                        f"{prof}.{name}-{thread.tid}", type="pstat")
        return 0
    program.run(sys.argv)
    return 0


# -- the benchmark --------------------------------------------------------------------------------
def check_shape(gateways: int, leaves: int) -> Optional[str]:
    """None when ``gateways x (1 + leaves)`` hosts with ``fanout: gateways`` plan exactly
    that tree; else why not."""
    from fdl_fabric.planning.tree import plan_tree

    hosts = [f"gw{i}" for i in range(gateways)] + [f"leaf{i}" for i in range(gateways * leaves)]
    tree = plan_tree(hosts, gateways)
    got = [len(g.leaves) for g in tree.gateways]
    if len(got) == gateways and set(got) == {leaves}:
        return None
    least = next(n for n in range(1, gateways * gateways)
                 if len(plan_tree(hosts[:gateways] + [f"x{i}" for i in range(gateways * n)],
                                  gateways).gateways) == gateways)
    return (f"{gateways} gateways x {leaves} leaves is not a tree the launcher plans "
            f"(ceil(sqrt(hosts)) must reach the fanout): it gives {len(got)} gateways; "
            f"use at least {least} leaves per gateway, or fewer gateways")


def report(samples: list[Sample], args: argparse.Namespace, out: TextIO) -> None:
    import benchlib

    hosts = args.gateways * (1 + args.leaves_per_gateway)
    world = hosts * args.ranks
    out.write(f"\nThe controller for {hosts} hosts x {args.ranks} ranks ({world} ranks): "
              f"{args.gateways} real gateways (sshd lab) with {args.ranks} real ranks each, "
              f"{args.gateways * args.leaves_per_gateway} emulated leaves; ranks run "
              f"{args.work:g} s; idle = {args.window:g} s window, {args.settle:g} s after "
              f"all running (and, in mode join, all joined)\n")
    if getattr(args, "nofile_note", ""):
        out.write(f"note: {args.nofile_note}\n")
    if getattr(args, "records_note", ""):
        out.write(f"note: {args.records_note}\n")
    for mode in args.mode_list:
        got = [s for s in samples if s.mode == mode]
        if not got:
            continue
        good = [s for s in got if s.up_s is not None]

        def med(attr: str, good: list[Sample] = good) -> Optional[float]:
            return benchlib.med(getattr(s, attr) for s in good)

        label = {"join": "synthetic ranks join the coordinator through their emulated "
                         "agent (COHORT_UP/COHORT_DOWN/BEATS), the gateways' real ranks "
                         "through their real agent",
                 "join-tcp": "synthetic ranks join the coordinator over TCP directly",
                 "no-join": "synthetic ranks do not join the coordinator (the transport "
                            "alone)"}[mode]
        out.write(f"\nmode {mode}: {label}; medians of {len(good)} run(s)\n\n")
        rows = [["the launcher process", *[f"run {s.rep + 1}" for s in got], "median",
                 "target", "met"]]

        def row(label: str, attr: str, digits: int, target: Optional[float] = None,
                unit: str = "", got: list[Sample] = got, rows: list[list[str]] = rows
                ) -> None:
            cells = [benchlib.fmt(getattr(s, attr), digits) for s in got]
            m = med(attr)
            met = "" if target is None else ("n/a" if m is None else
                                             ("met" if m <= target else "MISSED"))
            rows.append([label, *cells, benchlib.fmt(m, digits),
                         "" if target is None else f"<= {target:g}{unit}", met])

        row("time to all running, s", "up_s", 2)
        row("CPU to all running, s", "cpu_up", 2, 3.0, " s")
        if mode != "no-join":
            row("time to every rank joined, s", "joined_s", 2)
            row("CPU to every rank joined, s", "cpu_joined", 2)
        row("CPU in all (to its exit), s", "cpu_total", 2)
        row("threads (most seen)", "threads_max", 0, 100.0)
        row("threads at all running", "threads_up", 0)
        row("idle CPU, % of a core", "idle_pct", 2, 2.0, " %")
        row("largest 1 s slice of the window, %", "max_slice", 1)
        row("peak RSS, MB", "rss_mb", 0)
        row("sockets held in the window", "sockets", 0)
        row("open files in the window", "fds", 0, float(args.nofile_hard or 0) or None)
        row("emulated relays' CPU, s (sum)", "relays_cpu", 2)
        row("gateways' real agents' CPU, s (sum)", "agents_cpu", 2)
        if mode == "join":
            row("formation (last hello -> formed), s", "formation_s", 3, 1.0, " s")
            row("synthetic hellos, first -> last, s", "hellos_s", 3)
            row("last synthetic hello -> last welcome, s", "welcomes_after_s", 3)
            row("last synthetic hello -> last real one, s", "real_hello_late_s", 3)
        if mode != "no-join":
            row("join time per rank, p50 s", "join_p50", 3)
            row("join time per rank, max s", "join_max", 2)
            row("  hello sent -> launcher's rank_started, p50 s", "spawn_p50", 3)
            row("  hello sent -> launcher's rank_joined, p50 s", "up_p50", 3)
            row("  hello sent -> launcher's rank_joined, max s", "up_max", 2)
            row("  launcher's rank_joined -> welcome read, p50 s", "down_p50", 3)
            row("  launcher's rank_joined -> welcome read, max s", "down_max", 2)
            row("joins over rank.join's 30 s", "join_late", 0)
            row("welcome bytes received, MB", "welcome_mb", 1)
            rows.append(["joins / dials / retry rejects",
                         *[f"{s.joins}/{s.dials}/{s.retry_rejects}" for s in got], "", "", ""])
        rows.append(["up lines read", *[str(s.lines) for s in got], "", f"{world}", ""])
        rows.append(["exit status", *[str(s.exit_code) for s in got], "", "0", ""])
        out.write(benchlib.table(rows, [False] + [True] * (len(got) + 1) + [False, False])
                  + "\n")
        for s in got:
            out.write(f"  run {s.rep + 1} verdict: {s.verdict}\n")
            if s.error:
                out.write(f"  ! run {s.rep + 1}: {s.error}\n")
            for line in s.profile:
                out.write(f"  {line}\n")


def bench(args: argparse.Namespace, tmp: Path, out: TextIO) -> int:
    import benchlib

    started = time.monotonic()
    load_start = benchlib.wait_for_quiet(args.wait_load, out)
    global _LAB
    lab = _LAB = benchlib.start_lab(tmp / "lab", args.gateways, out)
    benchlib.seed_known_hosts(lab.known_hosts, args.known_hosts)
    if args.controller_cpus:
        remote = os.sched_getaffinity(0) - args.controller_cpus
        os.sched_setaffinity(0, remote)  # this script, and so its later children
        for host in lab.hosts:  # inherited by every session, agent, relay and rank
            os.sched_setaffinity(host.sshd.pid, remote)
        os.environ[CONTROLLER_CPUS] = ",".join(map(str, sorted(args.controller_cpus)))
    leaf_path = tmp / "leaf-path"
    leaf_path.mkdir()
    workers = [lab.worker(h, nproc=args.ranks) for h in lab.hosts]
    for i in range(args.gateways * args.leaves_per_gateway):
        name = f"leaf{i + 1:04d}"
        # A literal addr: nothing looks a leaf's name up (this machine's network is
        # loopback only: no query may reach its resolver).
        workers.append({"host": name, "addr": "127.0.0.1", "path": str(leaf_path),
                        "nproc": args.ranks,
                        "ssh": {"target": f"{name}.invalid", "user": lab.user,
                                "identity_file": lab.identity_file,
                                "options": lab.ssh_options()}})
    # Pinned, the 32 gateways' agents share one core with their 256 ranks' starts: a
    # gateway's agent may wait its turn for longer than the default agent_timeout.
    lease = {"agent_timeout": 30} if args.controller_cpus else {}
    cluster = lab.write_cluster(workers, filename="emulator.yml", fanout=args.gateways,
                                kill_grace=2, **lease)
    _raise_nofile(args, out, cluster)
    args.records_note = _records(args, tmp)
    out.write(f"{args.records_note}\n")
    samples = []
    for rep in range(args.repeat):
        for mode in args.mode_list:
            out.write(f"run {rep + 1}, {mode}: {args.gateways} gateways x "
                      f"{args.leaves_per_gateway} leaves x {args.ranks} ranks (load "
                      f"{benchlib.loadavg()})... ")
            out.flush()
            s = measure(args, lab, cluster, tmp, mode, rep, out)
            samples.append(s)
            out.write(f"all running in {benchlib.fmt(s.up_s)} s, CPU "
                      f"{benchlib.fmt(s.cpu_up)} s, idle {benchlib.fmt(s.idle_pct)} %\n"
                      if s.ok else f"FAILED: {s.error}\n")
            out.flush()
    report(samples, args, out)
    benchlib.write_machine_notes(out, load_start, started, **{
        "the launcher's CPUs (the rest: the lab hosts, this script)":
            os.environ.get(CONTROLLER_CPUS, "shared with everything (--no-pin)"),
        "known_hosts": f"the gateways' keys and {args.known_hosts} other hosts' (--known-hosts)"})
    return 0 if all(s.ok for s in samples) else 1


def _records(args: argparse.Namespace, tmp: Path) -> str:
    """Where the launcher keeps its run records (``--runs-dir``, else
    ``$FDL_FABRIC_RUNS_DIR``, else a folder of this run's own, removed with it: never the
    user's own records, which it would prune), and what the file system there costs a
    rank now (`fsprobe`)."""
    import fsprobe

    chosen = args.runs_dir or os.environ.get("FDL_FABRIC_RUNS_DIR") or str(tmp / "runs")
    runs = Path(chosen).absolute()
    runs.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["FDL_FABRIC_RUNS_DIR"] = str(runs)  # the launcher's, and `_joined_records`
    return fsprobe.describe(runs)


def _raise_nofile(args: argparse.Namespace, out: TextIO, cluster: Path) -> None:
    """What the launcher asks for (`fdl_fabric.transport.open_files_needed`, per host
    since issue 35) against this machine's hard RLIMIT_NOFILE, said in the output; the
    hard limit is raised for the launcher we start (it inherits ours) only where it is
    too low and that is allowed. The launcher's own check is never bypassed."""
    import resource

    from fdl_fabric.clusterfile import load_cluster
    from fdl_fabric.transport import open_files_needed

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = open_files_needed(load_cluster(str(cluster)))
    hosts = args.gateways * (1 + args.leaves_per_gateway)
    args.nofile_hard = None if hard == resource.RLIM_INFINITY else hard
    args.nofile_note = (f"the launcher asks for {want} open files (open_files_needed, "
                        f"{want / hosts:.2f} a host for {hosts} hosts); hard limit here "
                        f"{'unlimited' if args.nofile_hard is None else hard}, soft {soft}")
    if args.nofile_hard is not None and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, want))
            args.nofile_note += f": hard limit raised to {want} for the launcher"
            args.nofile_hard = want
        except (ValueError, OSError) as exc:
            args.nofile_note += f": above it, and it cannot be raised ({exc})"
    else:
        args.nofile_note += ": within it, no wrapper (the launcher's own check runs)"
    out.write(args.nofile_note + "\n")


_LAB: Any = None


def _cleanup() -> None:
    import benchlib

    benchlib.stop_all()
    if _LAB is not None:
        _LAB.stop()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    import benchlib

    ap = benchlib.arg_parser(__doc__, epilog=True)
    ap.add_argument("--gateways", type=int, default=32, help="real gateway hosts (32)")
    ap.add_argument("--leaves-per-gateway", type=int, default=31,
                    help="emulated leaves per gateway (31: 32 x 32 = 1,024 hosts)")
    ap.add_argument("--ranks", type=int, default=8, help="ranks per host (8)")
    ap.add_argument("--quick", action="store_true",
                    help="a small shape for quick checks: 8 gateways x 8 leaves x 8 ranks "
                    "(72 hosts, 576 ranks), --work 30, --window 5")
    ap.add_argument("--modes", default="join,no-join",
                    help="comma-separated: join (synthetic ranks join the coordinator "
                    "through their emulated agent, as a launch does), join-tcp (over TCP "
                    "directly, the issue-23 path), no-join (they do not); run "
                    "round-robin (default join,no-join)")
    ap.add_argument("--work", type=float, default=None,
                    help="seconds every rank runs (sleeps) before exiting 0 (120: every "
                    "synthetic rank must have joined and the window ended before)")
    ap.add_argument("--window", type=float, default=None, help="idle sampling window, s (10)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between all running (all joined) and the window (2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (1)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="longest wait for every up line and every join, s (300)")
    ap.add_argument("--py-spy", action="store_true",
                    help="also record the launcher with py-spy from its start to all running "
                    "(all joined), and print its busiest functions; perturbs the figures")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="first wait (up to 20 min) until the 1-minute load is <= L")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--runs-dir", metavar="DIR",
                    help="where the launcher keeps its run records (default: "
                    "$FDL_FABRIC_RUNS_DIR, else a folder in the temporary one); a "
                    "tmpfs such as /dev/shm/x takes the disk's cost out of the figures, "
                    "which the output states either way (bench/fsprobe.py)")
    ap.add_argument("--real-ranks", choices=("join", "sleep"), default="join",
                    help="in mode join, what the gateways' real ranks run: a Python that "
                         "joins (the default: the cohort forms), or `echo up; sleep` (it "
                         "never forms, and the lab's cores are spared 256 Python starts "
                         "beside the synthetic joins)")
    ap.add_argument("--known-hosts", type=int, default=1024, metavar="N",
                    help="other hosts' keys the launcher's known_hosts holds besides the "
                    "gateways', as a user's does at this scale (1024; 0: the gateways' "
                    "only, as before the twelfth round)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="let the launcher share every CPU with the lab hosts, the stand-ins "
                    "for other hosts' CPUs (the first six rounds' method); by default it "
                    "has CPU 0 alone")
    args = ap.parse_args(argv)
    cpus = os.sched_getaffinity(0)
    args.controller_cpus = {min(cpus)} if args.pin and len(cpus) >= 2 else set()
    if args.quick:
        args.gateways, args.leaves_per_gateway = 8, 8
        args.work = 30.0 if args.work is None else args.work
        args.window = 5.0 if args.window is None else args.window
    args.work = 120.0 if args.work is None else args.work
    args.window = 10.0 if args.window is None else args.window
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    if min(args.gateways, args.leaves_per_gateway, args.ranks, args.repeat) < 1:
        ap.error("--gateways, --leaves-per-gateway, --ranks and --repeat must be >= 1")
    problem = check_shape(args.gateways, args.leaves_per_gateway)
    if problem:
        ap.error(problem)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["--as-launcher"]:
        return as_launcher(raw[1:])
    sys.path.insert(0, ROOT)
    args = parse_args(raw)
    import benchlib

    return benchlib.run_in_scratch("fdl-emulator-", args, bench, _cleanup)


if __name__ == "__main__":
    sys.exit(main())
