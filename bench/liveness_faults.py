"""liveness.py's fault scenarios: ``detect`` (a frozen agent, a black-holed host, a
frozen torchrun worker) and ``hang`` (grouped stacks after hang_timeout)."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib
import psutil
from livenesslib import (
    DOWN,
    FDL,
    ROOT,
    STUCK,
    TORCHRUN,
    UP_SLEEP,
    BenchError,
    Launch,
    Sample,
    environ_of,
    exit_time,
    fmt,
    freeze,
    inv_argv,
    kill_alive,
    max_of,
    median_of,
    print_table,
    run_leftovers,
    settle,
    stats_rows,
    thaw,
    torchrun_argv,
    wait_until,
    write_verdicts,
)

from fdl_fabric.testing import processes_of_run

# ==========================================================================================
# detect
# ==========================================================================================
FROZEN_AGENT, BLACK_HOLE, FROZEN_WORKER = "frozen agent", "black-holed host", "frozen worker"


class Detect:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any, netns: Any) -> None:
        self.args = args
        self.tmp = tmp
        self.lab = lab
        self.netns = netns
        self.prog = tmp / "up_sleep.py"
        self.prog.write_text(UP_SLEEP)
        self.cmd = f"{shlex.quote(sys.executable)} -u {shlex.quote(str(self.prog))} 300"
        self.cluster = lab.write_cluster([lab.worker(h, nproc=1) for h in lab.hosts[:2]],
                                         filename="detect-frozen.yml", kill_grace=1,
                                         agent_timeout=args.agent_timeout)
        self.ns_cluster: Optional[Path] = None
        if netns is not None:
            (host,) = netns.hosts
            opts = [*netns.ssh_options(), "ServerAliveInterval=0"]  # only the heartbeats
            self.ns_cluster = netns.write_cluster(
                [{"host": "localhost", "nproc": 1, "path": str(ROOT)},
                 netns.worker(host, nproc=1, ssh={"options": opts})],
                filename="detect-blackhole.yml", kill_grace=1, agent_timeout=args.agent_timeout)

    def cases(self) -> list[tuple[str, str]]:
        cases = [(FROZEN_AGENT, FDL)]
        if not self.args.no_torchrun:
            cases.append((FROZEN_WORKER, TORCHRUN))
        if self.netns is not None:
            cases.append((BLACK_HOLE, FDL))
        return cases

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("detect", case, tool, rep)
        try:
            if case == FROZEN_AGENT:
                self.frozen_agent(sample)
            elif case == BLACK_HOLE:
                self.black_hole(sample)
            else:
                self.frozen_worker(sample)
            sample.ok = not sample.error
        except BenchError as exc:
            sample.error = str(exc)
        if sample.leftovers:
            sample.notes.append(f"killed leftovers {sample.leftovers}")
        return sample

    def _verdict(self, sample: Sample, run: Launch, t0: float, host: str,
                 needle: str) -> None:
        """The launcher's unresponsive line, its verdict and exit, from t0."""
        cap = self.args.agent_timeout + 30
        try:
            said = run.wait_text(needle, t0, cap)
        except BenchError:
            said = None
            sample.error = f"no {needle!r} line within {cap:g}s"
        sample.s["unresponsive"] = None if said is None else said - t0
        ended = exit_time(run.proc, 30)
        if ended is None:
            sample.error = sample.error or "the launcher did not exit within 30 s of the line"
            return
        sample.s["exit"] = ended - t0
        for t in run._readers:
            t.join(5)
        sample.code = run.proc.returncode
        err = run._of("err")
        if err:
            sample.s["verdict"] = err[-1][0] - t0
            sample.last_line = err[-1][1]
            if host not in sample.last_line:
                sample.notes.append(f"the verdict does not name {host}")
        if sample.code != 1:
            sample.notes.append(f"exit {sample.code}, expected 1")

    def frozen_agent(self, sample: Sample) -> None:
        run = Launch(inv_argv(self.cluster, "--cmd", self.cmd))
        agent: Optional[psutil.Process] = None
        run_id = ""
        try:
            run.wait_ups(2, 60)
            run_id = run.remember_run()
            ranks = {int(p.environ().get("RANK", -1)): p for p in processes_of_run(run_id)
                     if os.getpgid(p.pid) == p.pid}
            if 1 not in ranks:
                raise BenchError(f"rank 1 not found among the run's processes: {ranks}")
            agent = psutil.Process(ranks[1].ppid())
            settle(0.5, 1.0)
            t0 = freeze(agent)
            self._verdict(sample, run, t0, self.lab.hosts[1].name, "unresponsive")
        finally:
            if agent is not None:
                thaw(agent)
            run.stop()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 10)
            if agent is not None:
                left = kill_alive([agent], 10)
                if left:
                    sample.notes.append(f"the thawed agent (pid {agent.pid}) did not exit "
                                        "within 10 s: killed")

    def black_hole(self, sample: Sample) -> None:
        assert self.ns_cluster is not None
        (host,) = self.netns.hosts
        run = Launch(inv_argv(self.ns_cluster, "--cmd", self.cmd))
        run_id = ""
        try:
            run.wait_ups(2, 60)
            run_id = run.remember_run()
            settle(0.5, 1.0)
            DOWN.append((self.netns, host))
            t0 = time.monotonic()
            self.netns.link_down(host)
            self._verdict(sample, run, t0, host.name, f"host '{host.name}' unresponsive")
        finally:
            if (self.netns, host) in DOWN:
                self.netns.link_up(host)
                DOWN.remove((self.netns, host))
            run.stop()
            if run_id:
                # Behind the cut, sshd's ClientAlive (1 s x 3) ends the session and the
                # agent stops its rank.
                sample.leftovers = run_leftovers(run_id, 15)

    def frozen_worker(self, sample: Sample) -> None:
        cap = self.args.torchrun_cap
        run = Launch(torchrun_argv(2, str(self.prog), "300"), cwd=self.tmp)
        worker: Optional[psutil.Process] = None
        workers: list[psutil.Process] = []
        try:
            try:
                wait_until(lambda: sum(line.count("up") for line in run.stdout_lines) >= 2
                           or run.proc.poll() is not None, "2 up lines from torchrun's workers",
                           60)
            except BenchError as exc:
                raise BenchError(f"{exc}; torchrun said: "
                                 + " | ".join(line for _, _, line in run.lines[-6:])) from None
            if run.proc.poll() is not None:
                raise BenchError(f"torchrun exited {run.proc.returncode} early: "
                                 + " | ".join(line for _, _, line in run.lines[-6:]))
            workers = [p for p in psutil.Process(run.pid).children(recursive=True)
                       if "LOCAL_RANK" in environ_of(p)]
            by_rank = {int(environ_of(p).get("RANK", -1)): p for p in workers}
            if 1 not in by_rank:
                raise BenchError(f"worker 1 not found among torchrun's children: {by_rank}")
            worker = by_rank[1]
            settle(0.5, 1.0)
            t0 = freeze(worker)
            ended = exit_time(run.proc, cap)
            said = [(t, line) for t, _, line in list(run.lines) if t >= t0]
            sample.s["first_line"] = said[0][0] - t0 if said else None
            sample.s["exit"] = None if ended is None else ended - t0
            if said:
                sample.last_line = said[0][1]
            sample.code = run.proc.returncode
            sample.info.append(f"watched {cap:g} s: " + (
                f"exited {sample.code}" if ended is not None else "still running") +
                f", {len(said)} line(s)")
        finally:
            if worker is not None:
                thaw(worker)
            run.stop()
            sample.leftovers = kill_alive(workers, 5)

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        a = self.args.agent_timeout
        measures = (("unresponsive", "fault -> 'unresponsive' line"),
                    ("verdict", "fault -> verdict (last line)"),
                    ("exit", "fault -> launcher exited"))
        rows = stats_rows(samples, FROZEN_AGENT, FDL, measures)
        if self.netns is not None:
            rows += stats_rows(samples, BLACK_HOLE, FDL, measures)
        if not self.args.no_torchrun:
            cap = self.args.torchrun_cap
            rows += stats_rows(samples, FROZEN_WORKER, TORCHRUN,
                               (("first_line", "SIGSTOP -> torchrun's first line"),
                                ("exit", "SIGSTOP -> torchrun exited")),
                               capped=("first_line", "exit"), cap=cap)
        print_table(out, f"detect: agent_timeout {a:g} s; seconds from the SIGSTOP (frozen "
                    "agent / worker) or the link going down (black hole)", rows)
        out.write("\ntargets\n\n")
        trows = [["target", "median", "max", f"bound (agent_timeout {a:g} + 1)", "met"]]
        cases = [FROZEN_AGENT] + ([BLACK_HOLE] if self.netns is not None else [])
        for case in cases:
            med = median_of(samples, case, FDL, "unresponsive")
            top = max_of(samples, case, FDL, "unresponsive")
            trows.append([f"{case} -> 'unresponsive' line", fmt(med), fmt(top),
                          f"{a + 1:g}", "n/a" if top is None else
                          ("yes" if top <= a + 1 else "NO (max)")])
        out.write(benchlib.table(trows, [False, True, True, True, False]) + "\n")
        if not self.args.no_torchrun:
            t = [s for s in samples if s.tool == TORCHRUN and s.ok]
            exited = [s for s in t if s.s.get("exit") is not None]
            out.write(f"  peer: torchrun, a SIGSTOPped worker: {len(exited)} of {len(t)} "
                      f"run(s) ended within {self.args.torchrun_cap:g} s "
                      "(torchrun has no liveness check)\n")
        write_verdicts(samples, "detect", out)


# ==========================================================================================
# hang
# ==========================================================================================
class Hang:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any, mode_file: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.lab = lab
        self.mode_file = mode_file
        self.world = args.hosts * args.per_host
        prog = tmp / "stuck.py"
        prog.write_text(STUCK)
        self.cmd = f"{shlex.quote(sys.executable)} -u {shlex.quote(str(prog))} 300"
        self.cluster = lab.write_cluster(
            [lab.worker(h, nproc=args.per_host) for h in lab.hosts[:args.hosts]],
            filename="hang.yml", kill_grace=2, hang_timeout=args.hang_timeout)
        #: variant name -> the FLODL_PY_SPY value the agents get ("" = let them look)
        self.variants: dict[str, str] = {}
        self.found = self.host_py_spy("")
        self.variants["py-spy (as found)"] = ""
        binary = args.py_spy or _py_spy_binary()
        if args.py_spy or (binary and self.found and not _is_elf(self.found)):
            self.variants["py-spy (binary)"] = binary or ""
        self.variants["no py-spy"] = "none"
        self.views: dict[str, list[str]] = {}

    def host_py_spy(self, mode: str) -> str:
        """What the agents' login shell on the first host sees: py-spy on PATH, or
        FLODL_PY_SPY."""
        self.mode_file.write_text(mode + "\n")
        out = subprocess.run(self.lab.ssh_argv(
            self.lab.hosts[0], 'if [ -n "$FLODL_PY_SPY" ]; then echo "$FLODL_PY_SPY"; '
            'else command -v py-spy || echo none; fi'), capture_output=True, text=True,
            timeout=30, stdin=subprocess.DEVNULL)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"

    def cases(self) -> list[tuple[str, str]]:
        return [(v, FDL) for v in self.variants]

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("hang", case, tool, rep)
        self.mode_file.write_text(self.variants[case] + "\n")
        run = Launch(inv_argv(self.cluster, "--cmd", self.cmd))
        run_id = ""
        try:
            last_up = run.wait_ups(self.world, self.args.timeout)
            run_id = run.remember_run()
            cap = self.args.hang_timeout + 60
            hung = run.wait_text("run hung", last_up, cap)
            if "collecting every rank's stack" not in next(
                    line for t, line in run._of("err") if t == hung and "run hung" in line):
                sample.notes.append("the 'run hung' line does not say it collects stacks")
            sample.s["detected"] = hung - last_up
            head = run.wait_text("where each rank is (hang):", hung, 60)
            ended = exit_time(run.proc, 60)
            if ended is None:
                raise BenchError("the launcher did not exit within 60 s of the grouped view")
            for t in run._readers:
                t.join(5)
            err = run._of("err")
            view = _grouped_view(err)
            sample.s["header"] = head - hung
            sample.s["grouped"] = (view[-1][0] if view else head) - hung
            sample.s["exit"] = ended - hung
            sample.code = run.proc.returncode
            sample.last_line = err[-1][1] if err else ""
            self.views.setdefault(case, [line for _, line in view])
            self._check(sample, case, view)
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            run.stop()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 15)
        if sample.leftovers:
            sample.notes.append(f"killed leftovers {sample.leftovers}")
        return sample

    def _check(self, sample: Sample, case: str, view: list[tuple[float, str]]) -> None:
        """Notes on what a hung run should have shown and did not."""
        if sample.code != 1:
            sample.notes.append(f"exit {sample.code}, expected 1")
        if not sample.last_line.startswith("cluster launcher: run hung"):
            sample.notes.append("the last line is not the hung verdict")
        if self.variants[case] != "none" and not any("stuck_here" in line
                                                     for _, line in view):
            sample.notes.append("no stuck_here frame in the grouped view")

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        h = self.args.hang_timeout
        rows: list[list[str]] = []
        for case in self.variants:
            rows += stats_rows(samples, case, FDL, (
                ("detected", f"last up -> 'run hung' line (hang_timeout {h:g})"),
                ("header", "'run hung' -> 'where each rank is (hang):'"),
                ("grouped", "'run hung' -> last grouped line"),
                ("exit", "'run hung' -> launcher exited")))
        print_table(out, f"hang: {self.args.hosts} hosts x {self.args.per_host} ranks, "
                    f"hang_timeout {h:g} s; seconds from the 'run hung ...; collecting every "
                    "rank's stack' line unless said", rows)
        for case, view in self.views.items():
            out.write(f"\n  grouped view, {case} (FLODL_PY_SPY="
                      f"{self.variants[case] or '<unset>'}):\n")
            for line in view:
                out.write(f"  {line[:150]}\n")
        out.write(f"\n  py-spy the agents find with FLODL_PY_SPY unset: {self.found}"
                  f"{'' if _is_elf(self.found) else ' (a script, not the binary)'}\n")
        out.write("\ntargets\n\n")
        trows = [["target", "median", "max", "bound", "met"]]
        for case in self.variants:
            if self.variants[case] == "none":
                continue
            med = median_of(samples, case, FDL, "grouped")
            trows.append([f"hang timeout -> grouped view, {case}", fmt(med),
                          fmt(max_of(samples, case, FDL, "grouped")), "3",
                          "n/a" if med is None else ("yes" if med <= 3 else "NO")])
        out.write(benchlib.table(trows, [False, True, True, True, False]) + "\n")
        write_verdicts(samples, "hang", out)


def _grouped_view(err: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """The indented lines after the launcher's ``where each rank is (hang):`` line."""
    at = next(i for i, (t, line) in enumerate(err) if "where each rank is (hang):" in line)
    view = []
    for t, line in err[at + 1:]:
        if not line.startswith("  "):
            break
        view.append((t, line))
    return view


def _py_spy_binary() -> Optional[str]:
    """The py-spy executable next to this interpreter (pip puts it there), if any."""
    path = Path(sys.executable).with_name("py-spy")
    return str(path) if _is_elf(str(path)) else None


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False
