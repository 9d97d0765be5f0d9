#!/usr/bin/env python3
"""Launch-overhead benchmark: `inv launch` beside torchrun, OpenSSH fan-out and parallel-ssh.

Prints medians and ratios (it is a script, not a test: nothing here asserts a timing).

Every tool starts the same trivial rank program, which prints ``up <RANK>`` (one
``os.write``) as its first act and then exits 0.  For each run two times are taken, both
measured from just before the first ``Popen`` of the tool:

* **all running**: when the last of the N ``up`` lines was read from the tool's stdout
  (so it includes the tool's own output forwarding);
* **completion**: when the last process the benchmark started exited;
* **client CPU**: user+system CPU seconds of what the benchmark started, from ``wait4``
  (the launcher process; pssh with the ssh clients it reaped; the sum of the ssh
  clients of a fan-out). The hosts' side (sshd, shells, agents, ranks) is not in it.

Scenarios (``--only``, repeatable):

* ``local``: 4 ranks on this machine: ``inv launch`` (one worker ``localhost, nproc: 4``,
  i.e. one local agent) beside ``torchrun --standalone --nproc-per-node 4``;
* ``remote``: 8 ranks on 4 sshd-lab hosts (``fdl_fabric.testing.SshdLab``, real OpenSSH
  servers on loopback addresses), 2 per host: ``inv launch`` (one agent per host, one
  SSH session each) beside 8 parallel ``ssh`` clients and ``parallel-ssh -P -p 8``;
* ``scale64``: 64 ranks on 8 lab hosts (8 per host), the same three tools
  (64 ``ssh`` clients, ``parallel-ssh -P -p 64``);
* ``scale256``: 256 ranks on 32 lab hosts (8 per host), likewise (``-p 256``);
* every remote scenario also runs ``inv launch --no-preflight`` (``--no-variants`` skips
  it): the same launch without the pre-flight barrier, to show what the barrier costs;
* ``scale``: both scale scenarios.  They are slow on a small machine, so they use
  ``--scale-repeat`` (default 3) instead of ``--repeat``.

Plus reference floors (one rank with no launcher, N ranks started at once with no
launcher and no SSH, one rank over one ssh session, the import-and-parse cost of ``inv
launch --help``), fdl-fabric's phases read from the timestamps of its ``-v`` event lines,
and a table of the issue's targets (fdl-fabric / peer ratios, met or not).

Run ``python3 bench/launch.py`` (``--help`` for options); see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib
from launchlib import (
    FDL_TOOL,
    RANK_SCRIPT,
    ROOT,
    RUN_TIMEOUT,
    RUN_TOOL,
    Row,
    Sample,
    Target,
    free_port,
    machine_notes,
    measure,
    print_report,
    pssh_dedups,
    stop_all,
    torch_installed,
    torchrun_argv,
)

# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


#: ``--only`` values; ``scale`` means both scale scenarios.
SCENARIOS = ("local", "remote", "scale64", "scale256")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--repeat", type=int, default=5,
                    help="measured runs per tool, after one discarded warm-up run (default 5)")
    ap.add_argument("--scale-repeat", type=int, default=3,
                    help="measured runs per tool in the scale scenarios (default 3)")
    ap.add_argument("--only", action="append", choices=(*SCENARIOS, "scale"),
                    help="run this scenario only (repeatable; default: local and remote)")
    ap.add_argument("--sleep", type=float, default=0.0,
                    help="seconds each rank sleeps after its `up` line (default 0)")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    ap.add_argument("--no-phases", action="store_true",
                    help="skip the extra `inv launch -v` runs that time fdl-fabric's phases")
    ap.add_argument("--no-floors", action="store_true", help="skip the reference floors")
    ap.add_argument("--no-variants", action="store_true",
                    help="skip the `inv launch --no-preflight` rows of the remote scenarios")
    ap.add_argument("--no-fanout", action="store_true",
                    help="skip the plain OpenSSH fan-out in the scale scenarios")
    ap.add_argument("--json", metavar="FILE",
                    help="also write raw samples as JSON to FILE ('-': JSON on stdout, "
                         "the report on stderr)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.scale_repeat < 1:
        ap.error("--repeat and --scale-repeat must be at least 1")
    chosen = set(args.only or ("local", "remote"))
    if "scale" in chosen:
        chosen |= {"scale64", "scale256"}
    args.scenarios = [s for s in SCENARIOS if s in chosen]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    report = sys.stderr if args.json == "-" else sys.stdout
    return benchlib.run_in_scratch("fdl-bench-", args, _bench, stop_all, report)


def _progress(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()


@dataclass
class Job:
    """One tool in one scenario, run once per round for ``reps`` measured rounds."""

    scenario: str
    tool: str
    argvs: list[list[str]]
    expect_up: int
    phases: bool = False
    reps: int = 5
    timeout: float = RUN_TIMEOUT


#: scenario key -> (label, hosts, ranks per host, run timeout in s)
REMOTE_SHAPES = {
    "remote": ("remote 8 ranks / 4 hosts", 4, 2, RUN_TIMEOUT),
    "scale64": ("scale 64 ranks / 8 hosts", 8, 8, 120.0),
    "scale256": ("scale 256 ranks / 32 hosts", 32, 8, 300.0),
}


@dataclass
class Plan:
    """What one benchmark run measures: the report's rows, the jobs (run round-robin),
    the reference floors (what, argvs, expected ``up`` lines) and the targets."""

    args: argparse.Namespace
    tmp: Path
    rank_words: list[str]
    pssh: Optional[str]
    rows: list[Row] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    floor_jobs: list[tuple[str, list[list[str]], int]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    remarks: list[str] = field(default_factory=list)

    @property
    def rank_cmd(self) -> str:
        return " ".join(shlex.quote(w) for w in self.rank_words)

    def add(self, scenario: str, tool: str, argvs: list[list[str]], expect_up: int,
            note: str = "", **job: Any) -> None:
        self.rows.append(Row(scenario, tool, note))
        self.jobs.append(Job(scenario, tool, argvs, expect_up, **job))


def _plan_local(plan: Plan, report: TextIO) -> None:
    args, tmp, py, rank_cmd = plan.args, plan.tmp, sys.executable, plan.rank_cmd
    scen = "local 4 ranks"
    cluster = tmp / "local.yml"
    cluster.write_text(
        "controller:\n  host: 127.0.0.1\n"
        f"  port: {free_port()}\n"
        "kill_grace: 2\n"
        "workers:\n"
        f"  - host: localhost\n    nproc: 4\n    path: {json.dumps(str(tmp))}\n"
    )
    plan.add(scen, FDL_TOOL, [benchlib.inv_launch_argv(cluster, rank_cmd)], 4,
             reps=args.repeat)
    # The torchrun drop-in: torchrun's command line, the same script (issue 12).
    plan.add(scen, RUN_TOOL, [[py, "-m", "fdl_fabric", "run", "--nproc-per-node", "4",
                               *plan.rank_words[1:]]], 4, reps=args.repeat)
    if torch_installed() and not args.no_torchrun:
        plan.add(scen, "torchrun --standalone",
                 [[*torchrun_argv(), "--standalone", "--nproc-per-node", "4",
                   *plan.rank_words[1:]]], 4, reps=args.repeat)
        plan.targets.append(Target(scen, "done", "torchrun --standalone", 0.3, tool=RUN_TOOL))
    else:
        why = ("--no-torchrun" if args.no_torchrun else "torch not installed")
        plan.rows.append(Row(scen, "torchrun --standalone", f"skipped ({why})"))
        _progress(report, f"torchrun: skipped ({why})\n")
    if not args.no_phases:
        plan.jobs.append(Job(scen, "fdl-fabric -v (phases)",
                             [benchlib.inv_launch_argv(cluster, rank_cmd, "-v")], 4, True,
                             reps=args.repeat))
    plan.floor_jobs.append(("1 rank, no launcher (<python> rank.py)", [plan.rank_words], 1))
    plan.floor_jobs.append(("fdl-fabric import + parse (inv launch --help)",
                            [[py, "-m", "invoke", "--search-root", str(ROOT), "launch",
                              "--help"]], 0))
    bashrc = Path.home() / ".bashrc"
    if bashrc.is_file() and shutil.which("bash"):
        plan.floor_jobs.append(("bash -c true", [["bash", "-c", "true"]], 0))
        plan.floor_jobs.append(("bash -c '. ~/.bashrc' (what each SSH session sources)",
                                [["bash", "-c", f". {shlex.quote(str(bashrc))}"]], 0))


def _start_remote_lab(plan: Plan, remote: list[str], report: TextIO) -> Any:
    """The sshd lab for the remote scenarios (None if sshd is missing: a remark)."""
    from fdl_fabric.testing import sshd_available

    if not sshd_available():
        plan.remarks.append("remote scenarios skipped: sshd/ssh-keygen not found "
                            "(install openssh-server)")
        return None
    # MaxStartups: 256 clients at once are 8 unauthenticated connections per listener,
    # under the default 10:30:100, but give every tool headroom.
    lab = benchlib.start_lab(plan.tmp / "lab", max(REMOTE_SHAPES[k][1] for k in remote),
                             report)
    if plan.pssh and pssh_dedups(plan.tmp):
        plan.remarks.append("parallel-ssh collapses identical host lines here: its "
                            "figures cover one session per host only")
    elif plan.pssh:
        plan.remarks.append("parallel-ssh keeps identical host-file lines (checked "
                            "with its own parser): one invocation, each host listed "
                            "once per rank")
    return lab


def _plan_remote(plan: Plan, key: str, lab: Any) -> None:
    args, rank_cmd = plan.args, plan.rank_cmd
    label, n_hosts, per_host, timeout = REMOTE_SHAPES[key]
    hosts = lab.hosts[:n_hosts]
    world = n_hosts * per_host
    each = {"reps": args.repeat if key == "remote" else args.scale_repeat,
            "timeout": timeout}
    cluster = lab.write_cluster([lab.worker(h, nproc=per_host) for h in hosts],
                                filename=f"{key}.yml")
    plan.add(label, FDL_TOOL, [benchlib.inv_launch_argv(cluster, rank_cmd)], world, **each)
    if not args.no_variants:
        plan.add(label, "fdl-fabric --no-preflight",
                 [benchlib.inv_launch_argv(cluster, rank_cmd, "--no-preflight")], world,
                 **each)
    fanout = f"OpenSSH fan-out ({world} x ssh)"
    if key == "remote" or not args.no_fanout:
        plan.add(label, fanout, [lab.ssh_argv(hosts[r // per_host], f"RANK={r} {rank_cmd}")
                                 for r in range(world)], world, **each)
    peer = f"parallel-ssh -P -p {world}"
    if plan.pssh:
        hosts_file = plan.tmp / f"pssh_hosts_{key}"
        hosts_file.write_text("".join(f"{lab.user}@{h.addr}:{h.port}\n"
                                      for h in hosts for _ in range(per_host)))
        plan.add(label, peer, [benchlib.pssh_argv(lab, hosts_file, world, rank_cmd, 300)],
                 world, "ranks print `up ?`: pssh cannot pass RANK per session "
                 "(PSSH_NODENUM needs SendEnv)", **each)
    else:
        plan.rows.append(Row(label, peer, "skipped (parallel-ssh not installed)"))
    if not args.no_phases:
        plan.jobs.append(Job(label, "fdl-fabric -v (phases)",
                             [benchlib.inv_launch_argv(cluster, rank_cmd, "-v")], world,
                             True, **each))
    if key == "remote":
        _remote_targets(plan, label, peer, fanout, lab.ssh_argv, hosts[0])
    else:
        _scale_targets(plan, label, peer, fanout, world)


def _remote_targets(plan: Plan, label: str, peer: str, fanout: str,
                    ssh_argv: Any, host: Any) -> None:
    plan.targets.append(Target(label, "done", peer, 0.8))
    plan.targets.append(Target(label, "running", fanout, 1.0))
    plan.floor_jobs.append(("1 rank over 1 ssh session (ssh host <python> rank.py)",
                            [ssh_argv(host, f"RANK=0 {plan.rank_cmd}")], 1))
    plan.floor_jobs.append(("1 ssh session, nothing (ssh host true)",
                            [ssh_argv(host, "true")], 0))
    plan.floor_jobs.append(("1 ssh session, the agent's python (/usr/bin/python3 -I -S "
                            "-c '')", [ssh_argv(host, "/usr/bin/python3 -I -S -c ''")], 0))


def _scale_targets(plan: Plan, label: str, peer: str, fanout: str, world: int) -> None:
    plan.targets.append(Target(label, "done", peer, 0.3 if world == 64 else 0.25))
    if not plan.args.no_fanout:
        plan.targets.append(Target(label, "running", fanout, 1.0))
    if world == 256:
        plan.targets.append(Target(label, "running", None, 3.0))
    plan.floor_jobs.append((f"{world} ranks at once, no launcher, no SSH "
                            f"({world} x <python> rank.py)",
                            [list(plan.rank_words) for _ in range(world)], world))


def _rounds(plan: Plan, report: TextIO) -> tuple[list[Sample], list[Sample]]:
    """Every job once per round, round-robin (round 0 a warm-up), the floors after them;
    the samples and the floors' samples."""
    args, env = plan.args, dict(os.environ)
    samples: list[Sample] = []
    floors: list[Sample] = []
    total = max([j.reps for j in plan.jobs], default=args.repeat) + 1
    for rep in range(total):
        _progress(report, f"run {rep + 1}/{total}{' (warm-up)' if rep == 0 else ''}:")
        for job in plan.jobs:
            if rep > job.reps:
                continue
            s = measure(job.scenario, job.tool, rep, job.argvs, expect_up=job.expect_up,
                        env=env, cwd=str(ROOT), phases=job.phases, timeout=job.timeout)
            samples.append(s)
            _progress(report, " ." if s.ok else " x")
        if not args.no_floors and rep <= args.repeat:
            for name, argvs, ups in plan.floor_jobs:
                s = measure("floor", name, rep, argvs, expect_up=ups, env=env, cwd=str(ROOT))
                floors.append(s)
                _progress(report, " ." if s.ok else " x")
        _progress(report, f"  (load {benchlib.loadavg()})\n")
    return samples, floors


def _write_json(args: argparse.Namespace, notes: dict[str, Any], remarks: list[str],
                samples: list[Sample], floors: list[Sample], report: TextIO) -> None:
    doc = {
        "machine": notes,
        "repeat": args.repeat,
        "scale_repeat": args.scale_repeat,
        "remarks": remarks,
        "samples": [asdict(s) for s in samples],
        "floors": [asdict(s) for s in floors],
    }
    text = json.dumps(doc, indent=2) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        Path(args.json).write_text(text)
        report.write(f"\nraw samples: {args.json}\n")


def _bench(args: argparse.Namespace, tmp: Path, report: TextIO) -> int:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    rank_words = [sys.executable, str(script)] + ([f"{args.sleep:g}"] if args.sleep > 0
                                                  else [])
    plan = Plan(args, tmp, rank_words, benchlib.pssh_path())
    lab = None
    try:
        if "local" in args.scenarios:
            _plan_local(plan, report)
        remote = [k for k in args.scenarios if k in REMOTE_SHAPES]
        if remote:
            lab = _start_remote_lab(plan, remote, report)
        for key in remote if lab is not None else []:
            _plan_remote(plan, key, lab)
        load_before = benchlib.loadavg()
        samples, floors = _rounds(plan, report)
    finally:
        stop_all()
        if lab is not None:
            lab.stop()
    notes = machine_notes(plan.pssh, torch_installed())
    notes["load average (1/5/15 min) before / after"] = f"{load_before} / {benchlib.loadavg()}"
    notes["rank command"] = plan.rank_cmd
    print_report(plan.rows, samples, floors, notes, plan.remarks, report, plan.targets)
    if args.json:
        _write_json(args, notes, plan.remarks, samples, floors, report)
    return 0 if all(s.ok for s in samples if not s.warmup) else 1


if __name__ == "__main__":
    sys.exit(main())
