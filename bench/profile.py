#!/usr/bin/env python3
"""Where one `inv launch` spends its time and CPU: py-spy over a launch on the sshd lab.

Not a benchmark (nothing is compared); a helper to explain the figures of launch.py,
idle.py and output.py. It starts an sshd lab of ``--hosts`` hosts, then runs
``py-spy record`` around one ``inv launch`` of ``--per-host`` ranks per host and prints
the hottest functions from py-spy's raw (collapsed-stack) output:

* ``--mode cpu`` (default): on-CPU samples only, every thread: **self** = the function
  was running, **total** = it was on the stack;
* ``--mode wall``: every sample, idle ones included (``--idle``), per thread: where
  each thread *waits*, e.g. the main thread's critical path to the verdict.

The rank program is ``--rank trivial`` (print ``up`` and exit, as launch.py),
``sleep:S`` (print ``up``, sleep S seconds: the idle phase, as idle.py; py-spy is
attached to the launcher 2 s after the last ``up`` line for ``--duration`` seconds, then
the launch is stopped with SIGTERM), or ``lines:N`` (print N short lines, as output.py).

``--timeline N`` replaces py-spy with N in-process launches (after one warm-up) whose
steps are timed (connect, agent start, plan, coordinator, the supervisor's loop, the
first and last report of each kind, teardown): the launch's critical path, in ms.

Also prints ``python -X importtime`` of ``inv launch --help`` (``--importtime``), and
with ``--agent`` the time an agent takes to come up over one SSH session (handshake
read after the payload was sent), which no launcher-side profile can show.

Needs ``py-spy`` (``pip install py-spy``) and root or ptrace rights for it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import benchlib

TRIVIAL = 'import os\nos.write(1, ("up " + os.environ.get("RANK", "?") + "\\n").encode())\n'
SLEEPER = ('import os, sys, time\nos.write(1, ("up " + os.environ.get("RANK", "?") + "\\n")'
           '.encode())\ntime.sleep(float(sys.argv[1]))\n')
LINES = ('import os, sys\nn = int(sys.argv[1]); r = int(os.environ.get("RANK", "0"))\n'
         'for a in range(0, n, 8192):\n'
         '    buf = b"".join([b"r%d %d\\n" % (r, i) for i in range(a, min(n, a + 8192))])\n'
         '    v = memoryview(buf)\n'
         '    while v:\n'
         '        v = v[os.write(1, v):]\n')

#: One frame of py-spy's raw output: ``function (file:line)``.
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def short(frame: str) -> str:
    """``func (path/to/module.py:12)`` -> ``func (module.py)``: lines merged per function."""
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    parts = Path(path).parts
    where = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{m.group('func')} ({where})"


def parse_raw(path: Path, per_thread: bool) -> dict[str, list[tuple[list[str], int]]]:
    """Collapsed stacks per thread name (or '' for all): [(frames root->leaf, count)]."""
    out: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = ""
        if frames and frames[0].startswith(("thread (", "process ")):
            while frames and frames[0].startswith(("thread (", "process ")):
                head = frames.pop(0)
                if head.startswith("thread ("):
                    thread = head
        out[thread if per_thread else ""].append(([short(f) for f in frames], int(count)))
    return out


def top(stacks: list[tuple[list[str], int]], n: int) -> str:
    total = sum(c for _, c in stacks) or 1
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        for f in set(frames):
            inclusive[f] += count
        if frames:
            leaf[frames[-1]] += count
    rows = [["total %", "self %", "function (module)"]]
    for func, count in inclusive.most_common(n):
        rows.append([f"{100 * count / total:.1f}", f"{100 * leaf[func] / total:.1f}", func])
    rows.append(["", "", ""])
    rows.append(["self %", "", "hottest leaves"])
    for func, count in leaf.most_common(max(5, n // 2)):
        rows.append([f"{100 * count / total:.1f}", "", func])
    return benchlib.table(rows, [True, True, False]) + f"\n({total} samples)\n"


def importtime(n: int) -> str:
    """The largest cumulative imports of `inv launch --help`."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "invoke", "--search-root",
                           str(benchlib.ROOT), "launch", "--help"], capture_output=True,
                          text=True, env=env, cwd=str(benchlib.ROOT), timeout=60)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), int(m.group(1)), len(m.group(3)), m.group(4)))
    top_level = sorted((r for r in rows if r[2] <= 3), reverse=True)[:n]
    out = [["cumulative ms", "self ms", "module (top-level imports)"]]
    out += [[f"{c / 1000:.1f}", f"{s / 1000:.1f}", name] for c, s, _, name in top_level]
    ours = sorted((r for r in rows if r[3].startswith("fdl_fabric")), reverse=True)[:n]
    out += [["", "", ""], ["cumulative ms", "self ms", "fdl_fabric modules"]]
    out += [[f"{c / 1000:.1f}", f"{s / 1000:.1f}", name] for c, s, _, name in ours]
    return benchlib.table(out, [True, True, False]) + "\n"


def agent_boot(lab: object, repeat: int) -> str:
    """Seconds from ssh Popen to the agent's handshake, over one plain ssh session."""
    from fdl_fabric.transport import bundle

    host = lab.hosts[0]  # type: ignore[attr-defined]
    argv = lab.ssh_argv(host, bundle.remote_command())  # type: ignore[attr-defined]
    times = [benchlib.agent_up(argv) for _ in range(repeat)]
    floor = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(lab.ssh_argv(host, "true"), stdin=subprocess.DEVNULL,  # type: ignore
                       capture_output=True, timeout=30)
        floor.append(time.perf_counter() - t0)
    payload = len(bundle.payload())
    t0 = time.perf_counter()
    whole, digits = bundle.payload(), bundle._HEADER_DIGITS
    compile(whole[digits:digits + int(whole[:digits])], "<fdl-agent>", "exec")
    loader = time.perf_counter() - t0
    return (f"agent up over one ssh session (Popen -> handshake), median of {repeat}: "
            f"{sorted(times)[len(times) // 2] * 1000:.0f} ms; `ssh host true`: "
            f"{sorted(floor)[len(floor) // 2] * 1000:.0f} ms; payload {payload} bytes, "
            f"compiling its loader here {loader * 1000:.1f} ms (each module is compiled "
            "again when imported)\n")


def timeline(cluster: Path, cmd: str, repeat: int, extra: Sequence[str] = ()) -> str:
    """Run the launch in this process ``repeat`` times with timers around its steps.

    Steps are wrapped by name (whatever of them exists in the fdl_fabric being measured):
    connect, agent start, plan, coordinator start/stop, the supervisor's loop, teardown;
    and the supervisor's inbox: when the first and the last report of each kind was
    handled. Times are ms from the call of ``launcher.launch`` (add the import floor of
    launch.py, ``inv launch --help``, for a whole ``inv launch``). Medians of ``repeat``.
    """
    import contextlib
    import statistics

    from fdl_fabric.commands import launch as launcher
    from fdl_fabric.presentation.output import Console
    from fdl_fabric.supervision import supervisor
    from fdl_fabric.supervision.coordinator import Coordinator

    runs: list[dict[str, float]] = []
    current: dict[str, float] = {}
    t0 = [0.0]

    def stamp(key: str) -> None:
        current.setdefault(key, (time.perf_counter() - t0[0]) * 1000)
        current[key + " (last)"] = (time.perf_counter() - t0[0]) * 1000

    def wrap(owner: object, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*a: object, **kw: object) -> object:
            stamp(f"{label}: begin")
            try:
                return original(*a, **kw)
            finally:
                stamp(f"{label}: end")

        setattr(owner, name, wrapper)

    from fdl_fabric.commands import launch_hosts

    wrap(launcher.Launch, "_resolve", "resolve the cluster")
    wrap(launcher.Launch, "_open_run", "open the run's record")
    wrap(launch_hosts, "connect_all", "connect all hosts")
    wrap(launch_hosts, "start_agents", "start agents")
    wrap(launch_hosts.Hosts, "resolve_devices", "resolve devices") if hasattr(
        launch_hosts, "Hosts") else None
    wrap(launcher.Launch, "_check_versions", "versions")
    wrap(launcher.Launch, "_plan", "plan")
    wrap(Coordinator, "start", "coordinator start")
    wrap(Coordinator, "stop", "coordinator stop")
    wrap(supervisor.Supervisor, "run", "supervisor loop")
    wrap(launcher.Launch, "_teardown", "teardown")
    wrap(launch_hosts, "close_all", "close connections")
    handle = supervisor.Supervisor._handle

    def handled(self: object, report: object) -> None:
        stamp(f"report {type(report).__name__}")
        handle(self, report)  # type: ignore[arg-type]

    supervisor.Supervisor._handle = handled  # type: ignore[method-assign]
    from fdl_fabric.agent import wire as agent_wire
    from fdl_fabric.transport import session as agent_session
    frame_names = {agent_wire.HELLO: "HELLO", agent_wire.FACTS: "FACTS"}
    session_handle = agent_session.AgentSession.handle

    def session_handled(self: object, kind: int, obj: dict) -> None:  # type: ignore[type-arg]
        if kind in frame_names:
            stamp(f"agent frame {frame_names[kind]} read")
        session_handle(self, kind, obj)  # type: ignore[arg-type]

    agent_session.AgentSession.handle = session_handled  # type: ignore[method-assign]
    with open(os.devnull, "w") as devnull:
        for _ in range(repeat + 1):
            current = {}
            opts = launcher.LaunchOptions(cluster_file=str(cluster), command=cmd,
                                          preflight="--no-preflight" not in extra)
            t0[0] = time.perf_counter()
            with contextlib.redirect_stderr(devnull):
                code = launcher.launch(opts, console=Console(out=devnull, err=devnull,
                                                             verbosity=1))
            current["launch() returned"] = (time.perf_counter() - t0[0]) * 1000
            current["exit code"] = code
            runs.append(current)
    runs = runs[1:]  # the first one warms up
    def med(key: str) -> Optional[float]:
        vals = [r[key] for r in runs if key in r]
        return statistics.median(vals) if vals else None

    keys = [k for k in {k for r in runs for k in r}
            if not k.endswith(" (last)") and k != "exit code"]
    keys.sort(key=lambda k: med(k) or 0.0)
    rows = [["first ms", "last ms", "step (begin/end) or report handled by the supervisor"]]
    for key in keys:
        first, last = med(key), med(key + " (last)")
        rows.append([f"{first:.0f}" if first is not None else "-",
                     f"{last:.0f}" if last is not None
                     and key.startswith(("report", "agent frame")) else "",
                     key])
    return benchlib.table(rows, [True, True, False]) + \
        f"\n(median of {len(runs)} in-process runs after one warm-up)\n"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = benchlib.arg_parser(__doc__)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--rank", default="trivial", help="trivial | sleep:S | lines:N")
    ap.add_argument("--duration", type=float, default=10.0,
                    help="sleep:S ranks: profile this long after every rank is up (10)")
    ap.add_argument("--mode", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second (500)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-preflight", action="store_true", help="pass --no-preflight")
    ap.add_argument("--importtime", action="store_true", help="also -X importtime")
    ap.add_argument("--agent", action="store_true", help="also time an agent's start")
    ap.add_argument("--timeline", type=int, metavar="N", default=0,
                    help="instead of py-spy: N in-process launches with timers around "
                         "their steps")
    ap.add_argument("--keep", action="store_true")
    return ap.parse_args(argv)


def _record(args: argparse.Namespace, spy: list[str], launch_argv: list[str],
            kind: str) -> tuple[subprocess.Popen[bytes], bytes]:
    """py-spy over the whole launch, or (``--rank sleep``) over the launcher once every
    rank is up; py-spy's process (reaped) and its stderr."""
    if kind == "sleep":
        # The idle phase only: start the launch, wait for every `up` line, then
        # attach py-spy to the launcher for --duration seconds.
        launch = benchlib.start(launch_argv, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        ups = 0
        assert launch.stdout is not None
        for line in launch.stdout:
            ups += b"] up " in line
            if ups >= args.hosts * args.per_host:
                break
        time.sleep(2.0)
        proc = benchlib.start([*spy, "--duration", f"{args.duration:g}", "--pid",
                               str(launch.pid)])
        _, err = proc.communicate(timeout=args.duration + 60)
        benchlib.forget(proc)
        benchlib.stop(launch, grace=30)  # TERM: the launcher stops its ranks
    else:
        proc = benchlib.start([*spy, "--", *launch_argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=600)
        benchlib.forget(proc)
    return proc, err


def _write_profile(args: argparse.Namespace, raw: Path, lab: Any, out: TextIO) -> None:
    """The top frames of each thread, then what --importtime and --agent ask for."""
    stacks = parse_raw(raw, per_thread=args.mode == "wall")
    for thread, st in sorted(stacks.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        out.write(f"\n== {thread or 'all threads'} ==\n")
        out.write(top(st, args.top))
    if args.importtime:
        out.write("\n== python -X importtime, inv launch --help ==\n")
        out.write(importtime(args.top))
    if args.agent:
        out.write("\n== agent start ==\n")
        out.write(agent_boot(lab, 5))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        sys.stderr.write("py-spy not found: pip install py-spy\n")
        return 2
    out = sys.stdout
    with benchlib.terminate_gracefully():
        tmp = Path(tempfile.mkdtemp(prefix="fdl-profile-"))
        lab = None
        try:
            lab = benchlib.start_lab(tmp / "lab", args.hosts, out)
            kind, _, value = args.rank.partition(":")
            script = tmp / "rank.py"
            script.write_text({"trivial": TRIVIAL, "sleep": SLEEPER, "lines": LINES}[kind])
            cmd = f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"
            if value:
                cmd += f" {value}"
            cluster = lab.write_cluster([lab.worker(h, nproc=args.per_host)
                                         for h in lab.hosts])
            if args.timeline and kind == "sleep":
                out.write("--timeline needs ranks that exit (--rank trivial or lines:N)\n")
                return 2
            if args.timeline:
                out.write(f"\n{args.hosts} hosts x {args.per_host} ranks, rank {args.rank}\n")
                out.write(timeline(cluster, cmd, args.timeline,
                                   ["--no-preflight"] if args.no_preflight else []))
                return 0
            raw = tmp / "profile.txt"
            extra = ["--no-preflight"] if args.no_preflight else []
            spy = [pyspy, "record", "-r", str(args.rate), "--format", "raw", "-o", str(raw),
                   "--threads", "--nonblocking"]
            if args.mode == "wall":
                spy.append("--idle")
            launch_argv = benchlib.inv_launch_argv(cluster, cmd, *extra)
            t0 = time.perf_counter()
            proc, err = _record(args, spy, launch_argv, kind)
            wall = time.perf_counter() - t0
            out.write(f"\n{args.hosts} hosts x {args.per_host} ranks, rank {args.rank}, "
                      f"mode {args.mode}: launch took {wall:.2f} s under py-spy "
                      f"(exit {proc.returncode})\n")
            if not raw.exists():
                out.write(err.decode(errors="replace")[-2000:] + "\n")
                return 1
            _write_profile(args, raw, lab, out)
            if args.keep:
                out.write(f"raw profile: {raw}\n")
            return 0
        finally:
            benchlib.stop_all()
            if lab is not None:
                lab.stop()
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


if __name__ == "__main__":
    sys.exit(main())
