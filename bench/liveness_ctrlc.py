"""liveness.py's ``idle`` scenario (the launcher's CPU while every rank sleeps, beside an
older commit) and ``ctrlc`` (Ctrl-C on a real pty, beside torchrun)."""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import select
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, TextIO

import benchlib
import psutil
from livenesslib import (
    FDL,
    FLOOD,
    PTYS,
    ROOT,
    RUN_IDS,
    TORCHRUN,
    BenchError,
    Sample,
    environ_of,
    exit_times,
    fmt,
    inv_argv,
    kill_alive,
    max_of,
    median_of,
    print_table,
    run_leftovers,
    settle,
    stats_rows,
    torchrun_argv,
    wait_until,
    write_verdicts,
)

from fdl_fabric.testing import processes_of_run


# ==========================================================================================
# idle
# ==========================================================================================
def _idle_cells(got: list[Sample], hosts: int) -> list[str]:
    """An idle row's figures: launcher CPU (median, min-max), largest slice, threads,
    agents (all and per host), sshd sessions, all up."""

    def med(key: str) -> Optional[float]:
        return benchlib.med(s.s.get(key) for s in got)

    cpus = [s.s["cpu"] for s in got if s.s.get("cpu") is not None]
    agents = med("agents")
    return [fmt(med("cpu")), f"{fmt(min(cpus))}-{fmt(max(cpus))}" if cpus else "-",
            fmt(max((s.s["slice"] for s in got if s.s.get("slice") is not None),
                     default=None)),
            str(max((int(s.s["threads"] or 0) for s in got), default=0) or "-"),
            fmt(agents), fmt(None if agents is None else agents / hosts, 3),
            fmt(med("sshd")), fmt(med("up"), 1)]


class Idle:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any) -> None:
        import idle  # bench/idle.py: its measure() is what this scenario runs

        self.idle = idle
        self.args = args
        self.lab = lab
        script = tmp / "rank_idle.py"  # idle._host_side finds the ranks by this name
        script.write_text(idle.RANK_SCRIPT)
        sleep = args.timeout + 2 + args.window + 120
        cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))} {sleep:g}"
        #: tool -> the command that starts `inv launch` (the baseline: an older tree of
        #: this repository, imported first through PYTHONPATH; its agents come from it too)
        launchers = {FDL: [sys.executable, "-m", "invoke", "--search-root", str(ROOT),
                           "launch"]}
        self.remark = ""
        if args.baseline and args.baseline != "none":
            tree = tmp / "baseline"
            tree.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline],
                                     capture_output=True, timeout=60)
            if archive.returncode == 0:
                subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout,
                               check=True, timeout=60)
                # From the old tree's folder: ``python -m`` puts the working directory
                # first on sys.path, so from this repository's root the current fdl_fabric
                # would be imported instead.
                head = ["env", "-C", str(tree), f"PYTHONPATH={tree}", sys.executable]
                where = subprocess.run([*head, "-c", "import fdl_fabric; "
                                        "print(fdl_fabric.__file__)"], capture_output=True,
                                       text=True, timeout=60).stdout.strip()
                if where.startswith(str(tree)):
                    launchers[f"{FDL} @{args.baseline}"] = [
                        *head, "-m", "invoke", "--search-root", str(tree), "launch"]
                else:
                    self.remark = (f"  baseline {args.baseline} skipped: it imports "
                                   f"fdl_fabric from {where or '?'}, not {tree}\n")
            else:
                self.remark = (f"  baseline {args.baseline} skipped: git archive: "
                               f"{archive.stderr.decode(errors='replace').strip()[:200]}\n")
        self.tools = list(launchers)
        self.plans: dict[tuple[str, str], tuple[list[str], int, int]] = {}
        for hosts, per in args.idle_shape_list:
            shape = f"{hosts}x{per}"
            cluster = lab.write_cluster([lab.worker(h, nproc=per) for h in lab.hosts[:hosts]],
                                        filename=f"idle-{shape}.yml")
            for tool, head in launchers.items():
                self.plans[shape, tool] = ([*head, "--cluster", str(cluster), "--cmd", cmd],
                                           hosts * per, hosts)

    def cases(self) -> list[tuple[str, str]]:
        return list(self.plans)

    def run(self, case: str, tool: str, rep: int) -> Sample:
        argv, world, _hosts = self.plans[case, tool]
        ns = argparse.Namespace(timeout=self.args.timeout, settle=2.0, window=self.args.window)
        got = self.idle.measure(self.lab, case, FDL, rep, argv, world, ns)
        sample = Sample("idle", case, tool, rep, ok=got.ok, error=got.error)
        sample.s = {"cpu": got.cpu_pct, "threads": got.threads,
                    "slice": max(got.slices) if got.slices else None,
                    "agents": got.agents_pct, "sshd": got.sshd_pct, "up": got.up_after}
        return sample

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        rows = [["shape (hosts x ranks)", "tool", "launcher CPU %", "min-max",
                 "max 1 s slice %", "threads", "agents % (all)", "agents % per host",
                 "sshd sessions %", "all up s", "runs"]]
        for (shape, tool), (_argv, _world, hosts) in self.plans.items():
            got = [s for s in samples if s.case == shape and s.tool == tool and s.ok]
            bad = [s for s in samples if s.case == shape and s.tool == tool and not s.ok]
            rows.append([shape, tool, *_idle_cells(got, hosts),
                         benchlib.runs_cell(len(got), len(bad))])
        out.write(f"\nidle: every rank asleep; CPU over a {self.args.window:g} s window, % of "
                  "one core (medians); idle agents answer the launcher's pings (every 2 s) "
                  "with a heartbeat\n\n")
        out.write(benchlib.table(rows, [False, False] + [True] * 9) + "\n")
        for tool in self.tools:
            cpu = benchlib.med(s.s.get("cpu") for s in samples
                               if s.case == "32x8" and s.tool == tool and s.ok)
            if cpu is not None:
                out.write(f"\ntarget: launcher CPU <= 2 % of one core at 32x8, {tool}: "
                          f"{cpu:.2f} % -> {'met' if cpu <= 2.0 else 'NOT met'} (1.60 % "
                          "before heartbeats, bench/README.md)\n")
        out.write(self.remark)
        for s in samples:
            if not s.ok:
                out.write(f"  ! {s.case} {s.tool} run {s.rep + 1}: {s.error}\n")


# ==========================================================================================
# ctrlc
# ==========================================================================================
def _plain(data: bytes) -> bytes:
    """Terminal output without its escape sequences (colours, cursor moves, erases)."""
    return re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", data)


class Pty:
    """A command on a pty of 80x24 that is its controlling terminal (it leads the
    foreground process group, so ``\\x03`` on the master is a terminal's SIGINT to it);
    a thread drains the master as fast as it can, and notes when each of ``needles``
    first showed."""

    def __init__(self, argv: Sequence[str], cwd: Path, needles: Sequence[bytes],
                 rate: float = 0.0) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

        def own_terminal() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "24"}
        try:
            self.proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave,
                                         cwd=str(cwd), env=env, start_new_session=True,
                                         preexec_fn=own_terminal)
        finally:
            os.close(slave)
        benchlib.adopt(self.proc)
        PTYS.append(self)
        self.master = master
        self.head = bytearray()  # the first 64 KiB (the run id line)
        self.tail = bytearray()
        self.bytes = 0
        self.seen: dict[bytes, float] = {}
        self._needles = list(needles)
        self._closing = False
        self._rate = rate  # bytes/s the reader takes at most (0: as fast as it can)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Until the pty hangs up (every holder of the slave is gone) or `close`; this
        thread alone closes the master, so its fd number is never read after reuse."""
        try:
            self._drain()
        finally:
            os.close(self.master)

    def _drain(self) -> None:
        carry = b""
        while not self._closing:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self.master, 4096 if self._rate else 65536)
            except OSError:
                return
            if not data:
                return
            now = time.monotonic()
            if self._rate:
                time.sleep(len(data) / self._rate)
            self.bytes += len(data)
            if len(self.head) < 65536:
                self.head += data[:65536 - len(self.head)]
            self.tail += data
            del self.tail[:-65536]
            if len(self.seen) < len(self._needles):
                window = carry + data
                for n in self._needles:
                    if n not in self.seen and n in window:
                        self.seen[n] = now
                carry = data[-64:]

    def key(self, data: bytes) -> float:
        t = time.monotonic()
        os.write(self.master, data)
        return t

    def last_line(self) -> str:
        text = _plain(bytes(self.tail)).decode("utf-8", "replace")
        lines = [ln.strip("\r\x00 ") for ln in re.split(r"[\r\n]", text)]
        lines = [ln for ln in lines if ln]
        return lines[-1] if lines else ""

    def run_id(self) -> Optional[str]:
        m = re.search(rb"run (\d{8}-\d{6}-[0-9a-f]+):", _plain(bytes(self.head)))
        return m.group(1).decode() if m else None

    def close(self) -> None:
        benchlib.stop(self.proc, grace=5, sig=signal.SIGKILL)
        self._closing = True
        self._reader.join(5)
        if self in PTYS:
            PTYS.remove(self)


def _ctrlc_workers(term: Pty, tool: str, run_id: Optional[str]) -> list[psutil.Process]:
    """The rank processes of a run on the pty: torchrun's workers, or fdl-fabric's ranks
    (each the leader of its process group)."""
    if tool == TORCHRUN:
        return [p for p in psutil.Process(term.proc.pid).children(recursive=True)
                if "LOCAL_RANK" in environ_of(p)]
    if run_id:
        return [p for p in processes_of_run(run_id) if os.getpgid(p.pid) == p.pid]
    return []


def _check_interrupted(sample: Sample) -> None:
    """Notes if fdl-fabric's Ctrl-C did not end with exit 130 and its verdict last."""
    if sample.code != 130:
        sample.notes.append(f"exit {sample.code}, expected 130")
    if not sample.last_line.startswith("cluster launcher: interrupted"):
        sample.notes.append("the verdict is not the terminal's last line")


class CtrlC:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Any) -> None:
        self.args = args
        self.tmp = tmp
        prog = tmp / "flood.py"
        prog.write_text(FLOOD)
        duration = args.ctrlc_cap + 120
        self.cluster = lab.write_cluster(
            [{"host": "localhost", "nproc": 1, "path": str(ROOT)}]
            + [lab.worker(h, nproc=1) for h in lab.hosts[:2]], filename="ctrlc.yml",
            kill_grace=args.kill_grace,
            command=f"{shlex.quote(sys.executable)} -u {shlex.quote(str(prog))} {duration:g}")
        self.argv = {FDL: inv_argv(self.cluster),
                     TORCHRUN: torchrun_argv(3, str(prog), f"{duration:g}")}

    def cases(self) -> list[tuple[str, str]]:
        tools = [FDL] + ([] if self.args.no_torchrun else [TORCHRUN])
        return [("Ctrl-C, 3 flooding ranks", t) for t in tools]

    def run(self, case: str, tool: str, rep: int) -> Sample:
        sample = Sample("ctrlc", case, tool, rep)
        needles = [f"r{r} line".encode() for r in range(3)]
        term = Pty(self.argv[tool], ROOT if tool == FDL else self.tmp, needles,
                   rate=self.args.pty_rate * 1e6)
        workers: list[psutil.Process] = []
        run_id: Optional[str] = None
        try:
            wait_until(lambda: len(term.seen) == 3 or term.proc.poll() is not None,
                       "every rank's lines on the terminal", 90)
            if term.proc.poll() is not None:
                raise BenchError(f"exited {term.proc.returncode} early: {term.last_line()}")
            run_id = term.run_id() if tool == FDL else None
            if run_id:
                RUN_IDS.add(run_id)
            workers = _ctrlc_workers(term, tool, run_id)
            if len(workers) != 3:
                sample.notes.append(f"{len(workers)} rank processes found, not 3")
            settle(0.5, 0.2)
            pressed = term.key(b"\x03")
            ended, gone = exit_times(term.proc, workers, self.args.ctrlc_cap)
            sample.s["exit"] = None if ended is None else ended - pressed
            if workers and len(gone) == len(workers):
                sample.s["ranks_gone"] = max(gone) - pressed
            sample.code = term.proc.returncode
            time.sleep(0.2)  # the last bytes through the pty
            sample.last_line = term.last_line()
            sample.info.append(f"{term.bytes / 1e6:.1f} MB on the terminal")
            if tool == FDL:
                _check_interrupted(sample)
            if ended is None:
                sample.notes.append(f"did not exit within {self.args.ctrlc_cap:g} s: killed")
            sample.ok = True
        except BenchError as exc:
            sample.error = str(exc)
        finally:
            term.close()
            if run_id:
                sample.leftovers = run_leftovers(run_id, 5)
            sample.leftovers += kill_alive(workers, 5)
        if sample.leftovers:
            sample.notes.append(f"left running (killed): pids {sample.leftovers}")
        return sample

    def report(self, samples: Sequence[Sample], out: TextIO) -> None:
        rows = []
        for case, tool in self.cases():
            rows += stats_rows(samples, case, tool, (("exit", "Ctrl-C -> exited"),
                                                     ("ranks_gone", "Ctrl-C -> every rank gone")),
                               capped=("exit", "ranks_gone"), cap=self.args.ctrlc_cap)
        rate = (f"{self.args.pty_rate:g} MB/s" if self.args.pty_rate else
                "as fast as it can")
        print_table(out, f"ctrlc: Ctrl-C on a pty (80x24, read {rate}), localhost + 2 lab "
                    f"hosts x 1 flooding rank (torchrun: 3 local workers); kill_grace "
                    f"{self.args.kill_grace:g} s; median = p50", rows)
        out.write("\n")
        trows = [["tool", "p50 s", "max s", "exit statuses", "not exited", "runs left "
                  "something", "MB/run"]]
        for case, tool in self.cases():
            got = [s for s in samples if s.case == case and s.tool == tool and s.ok
                   and not s.warmup]
            codes: dict[Optional[int], int] = {}
            for s in got:
                codes[s.code] = codes.get(s.code, 0) + 1
            mbs = [float(n.split()[0]) for s in got for n in s.info if n.endswith("terminal")]
            trows.append([tool, fmt(median_of(samples, case, tool, "exit")),
                          fmt(max_of(samples, case, tool, "exit")),
                          ", ".join(f"{c} x{n}" for c, n in sorted(
                              codes.items(), key=lambda kv: str(kv[0]))),
                          str(sum(1 for s in got if s.s.get("exit") is None)),
                          str(sum(1 for s in got if s.leftovers)),
                          fmt(statistics.median(mbs), 1) if mbs else "-"])
        out.write(benchlib.table(trows, [False, True, True, False, True, True, True]) + "\n")
        write_verdicts(samples, "ctrlc", out)
