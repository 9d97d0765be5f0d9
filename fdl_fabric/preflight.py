"""Pre-flight checks: find every misconfiguration before a single rank starts.

A launch that fails half-way costs more than the failure itself: some ranks
already started (and must be stopped), GPUs were grabbed, logs are noisy and
the one line that matters ("path does not exist on gpu-b") is buried. So
``inv prebuild-check`` asks every host, in parallel, everything the launch
will rely on (SSH and host keys, shell tools, paths, the program, platform,
GPUs, the data folder, the clock and the controller port) and answers with one
table: one row per host and check, ``ok`` / ``warn`` / ``FAIL`` and a one-line
reason. ``inv launch`` runs the cheap subset (``fast=True``: ssh, paths,
program, port) before it spawns anything.

Why one script per host: a check must not cost a round trip each, or checking
64 hosts over a slow link takes minutes. Every host runs one POSIX ``sh``
script that prints ``__FDL_CHECK__ name=value`` sentinel lines; the verdicts
are computed here, on the controller, from those values (so they are unit
tested without any host). Sentinels are found anywhere in a line, so a noisy
rc file that prints banners cannot hide them. Two measurements cannot live in
the script and cost one short round trip each: the shell start-up time (a
``true`` run, which is what every rank start pays) and the network round trip
that bounds the clock-skew estimate.

Reading order: `Status`, `Check`, `Report`; `run_checks` (the orchestration);
`HostPlan` and `probe_script` (what is asked); `evaluate` (the verdicts);
`main` (the command line).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from .config import ClusterSpec, ConfigError, WorkerSpec, load_cluster
from .envelope import ENV_PREBUILD, EnvelopeError, PrebuildEntry, parse_prebuild
from .plan import bind_loopback, controller_dial_host
from .shell import quote
from .sshopts import SshSettings, batchmode_warning, resolve_all_settings

__all__ = [
    "CONTROLLER",
    "FAST_CHECKS",
    "SENTINEL",
    "Check",
    "ControllerFacts",
    "Dial",
    "HostFacts",
    "HostPlan",
    "Report",
    "Status",
    "evaluate",
    "main",
    "parse_libc",
    "parse_sentinels",
    "probe_script",
    "run_checks",
]

#: Prefix of every value line the host script prints.
SENTINEL = "__FDL_CHECK__"
#: The oldest Python the worker agent runs on.
AGENT_PYTHON = (3, 8)
#: What an agent reports for ``dial`` when this run's coordinator answered with its key
#: (`fdl_fabric.agent.checks.DIAL_OK`).
AGENT_DIAL_OK = "ok"
#: The host column of checks that concern the controller itself (not a worker name:
#: a worker may well be called "controller").
CONTROLLER = "(controller)"
#: What ``inv launch`` checks before spawning: cheap, and each one would otherwise
#: fail the launch after some ranks already started.
FAST_CHECKS = frozenset({"ssh", "paths", "program", "port", "prebuild", "command", "probe"})

#: A shell start-up above this is paid by every rank start (and every helper command).
SHELL_WARN_MS = 200.0
#: Checkpoints and logs fill a disk fast; below this, warn.
DISK_WARN_BYTES = 1 << 30
#: Above this, log timestamps across hosts stop lining up and timeouts misfire.
SKEW_WARN_S = 2.0
#: Seconds a worker waits to reach the controller port before calling it unreachable.
DIAL_TIMEOUT = 3
#: Seconds the whole host script may take (nvidia-smi can hang on a broken driver).
PROBE_TIMEOUT = 60.0
#: Seconds nvidia-smi gets (when ``timeout`` exists on the host).
GPU_TIMEOUT = 10

_ROW_ORDER = ("command", "prebuild", "ssh", "probe", "shell", "paths", "program", "platform",
              "gpus", "data_path", "clock", "port")


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


class Status(str, Enum):
    """A check's verdict. FAIL is upper case so it stands out in a column of ``ok``."""

    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"


_SEVERITY = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}
_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red"}


def _worst(statuses: Sequence[Status]) -> Status:
    return max(statuses, key=lambda s: _SEVERITY[s], default=Status.OK)


@dataclass(frozen=True)
class Check:
    """One row of the report: a verdict about one thing on one host, with a one-line why."""

    host: str
    name: str
    status: Status
    reason: str


@dataclass
class Report:
    """Every check of one pre-flight, in display order (controller first, then roster order)."""

    checks: list[Check]
    #: Wall-clock seconds the whole pre-flight took (all hosts in parallel).
    elapsed: float = 0.0

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.WARN]

    def exit_code(self) -> int:
        """0 when nothing FAILs (warnings do not block a launch), 1 otherwise."""
        return 1 if self.failed() else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": [
                {"host": c.host, "check": c.name, "status": c.status.value, "reason": c.reason}
                for c in self.checks
            ],
            "ok": not self.failed(),
        }

    def summary(self) -> str:
        hosts = len({c.host for c in self.checks if c.host != CONTROLLER})
        counts = ", ".join(
            f"{n} {s.value}"
            for s in (Status.FAIL, Status.WARN, Status.OK)
            if (n := sum(1 for c in self.checks if c.status is s))
        )
        verdict = "FAILED" if self.failed() else "passed"
        return (f"prebuild-check: {verdict}: {counts or 'no checks'} "
                f"({hosts} host(s) in {self.elapsed:.2f} s)")

    def table(self, color: bool) -> str:
        """The report as text: a rich table with colors, or plain aligned columns.

        Plain output (pipes, CI logs, NO_COLOR) keeps each check on one unwrapped line,
        so it can be grepped; the colored table is for a person at a terminal.
        """
        if not color:
            return self._plain()
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        table.add_column("host", style="bold", no_wrap=True)
        table.add_column("check", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for c in self.checks:
            # Text(), not str: a reason such as "[127.0.0.1]:22" is not rich markup.
            table.add_row(Text(c.host), Text(c.name), Text(c.status.value, style=_STYLE[c.status]),
                          Text(c.reason))
        out = io.StringIO()
        width = shutil.get_terminal_size((120, 24)).columns
        Console(file=out, force_terminal=True, color_system="standard", width=width,
                highlight=False).print(table)
        return out.getvalue()

    def _plain(self) -> str:
        rows = [("host", "check", "status", "detail")]
        rows += [(c.host, c.name, c.status.value, c.reason) for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = []
        for i, row in enumerate(rows):
            cells = [row[j].ljust(widths[j]) for j in range(3)]
            lines.append("  ".join([*cells, row[3]]).rstrip())
            if i == 0:
                lines.append("  ".join(["-" * w for w in widths] + ["-" * 6]))
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Parsing what hosts print
# --------------------------------------------------------------------------------------------

_SENTINEL_RE = re.compile(re.escape(SENTINEL) + r" ([A-Za-z0-9_.-]+)=(.*)")


def parse_sentinels(text: str) -> dict[str, str]:
    """``name -> value`` of every sentinel line; other output (rc-file noise) is ignored.

    The sentinel may start mid-line (an rc file that printed without a newline); the
    first occurrence of a name wins, so a later line cannot overwrite a measurement.
    """
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = _SENTINEL_RE.search(line)
        if match:
            values.setdefault(match.group(1), match.group(2).rstrip("\r"))
    return values


def parse_libc(line: str) -> tuple[str, str]:
    """``(kind, version)`` from the first line of ``ldd --version``.

    glibc prints ``ldd (Debian GLIBC 2.36-9) 2.36`` or ``ldd (GNU libc) 2.39``;
    musl's ldd prints ``musl libc (x86_64)``. Kind is ``glibc``, ``musl`` or
    ``unknown`` (no ldd: macOS, minimal containers).
    """
    low = line.lower()
    if "musl" in low:
        return "musl", ""
    if "glibc" in low or "gnu libc" in low or low.startswith("ldd ("):
        match = re.search(r"(\d+\.\d+)\s*$", line.strip())
        return "glibc", match.group(1) if match else ""
    return "unknown", ""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


# --------------------------------------------------------------------------------------------
# What to ask one host
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dial:
    """How a worker proves it can reach the coordinator port.

    The controller listens on ``listen_host:listen_port`` and answers every
    connection with ``fdl-preflight <token>``; the worker dials ``host:port``
    (``127.0.0.1:<controller.port>`` through a remote forward for tunneled
    workers). The token proves the worker reached *this* controller, not some
    other service that happens to listen on that port on its side.
    """

    host: str
    port: int
    token: str
    tunnel: bool
    listen_host: str
    listen_port: int
    configured_port: int

    @property
    def stand_in(self) -> bool:
        """True when the configured port is busy here and another port stands in for it."""
        return self.listen_port != self.configured_port


@dataclass(frozen=True)
class HostPlan:
    """What to check on one worker, derived from the cluster file, argv and prebuild map."""

    worker: WorkerSpec
    fast: bool
    argv: tuple[str, ...]
    prebuild: Optional[PrebuildEntry] = None
    dial: Optional[Dial] = None
    #: PATH as the rank will see it when cluster/host env sets it (exported literally,
    #: like the rank wrapper's env script does), else None.
    path_env: Optional[str] = None

    @property
    def host(self) -> str:
        return self.worker.host

    @property
    def cwd(self) -> str:
        """The rank's working directory: the prebuild cwd when the host has an entry."""
        return self.prebuild.cwd(self.worker.path) if self.prebuild else self.worker.path

    @property
    def program(self) -> Optional[str]:
        """The word the wrapper hands to ``setsid`` (a prebuilt binary replaces argv[0])."""
        if self.prebuild:
            return self.prebuild.program(self.worker.path)
        return self.argv[0] if self.argv else None

    @property
    def python_script(self) -> Optional[str]:
        """``train.py`` of ``python3 train.py``: the commonest missing file, cheap to check."""
        if self.prebuild or len(self.argv) < 2:
            return None
        interpreter, first = os.path.basename(self.argv[0]), self.argv[1]
        if re.fullmatch(r"python[0-9.]*", interpreter) and first.endswith(".py"):
            return first
        return None


def _q(value: str) -> str:
    return quote(value)


def _path_word(path: str) -> str:
    """A host path as one shell word; ``~`` and ``~/x`` mean the user's home there, as
    for the agent, which expands them."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + quote(path[2:])
    return quote(path)


# Dial the controller and print the first line it sends (or "!reason"). bash's /dev/tcp
# comes first: it starts in milliseconds, while python3 may be a slow pyenv shim.
_DIAL_PY = (
    "import socket,sys\n"
    "try:\n"
    f"    s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout={DIAL_TIMEOUT})\n"
    f"    s.settimeout({DIAL_TIMEOUT}); d=b''\n"
    "    while b'\\n' not in d:\n"
    "        c=s.recv(256)\n"
    "        if not c: break\n"
    "        d+=c\n"
    "    print(d.decode('utf-8','replace').strip() or '!connection closed without a reply')\n"
    "except Exception as x: print('!'+(getattr(x,'strerror',None) or str(x) or type(x).__name__))\n"
)
_DIAL_BASH = (
    'exec 3<>"/dev/tcp/$1/$2" || exit 1; IFS= read -r l <&3; '
    'printf "%s\\n" "${l:-!connection closed without a reply}"'
)


def probe_script(plan: HostPlan) -> str:
    """The POSIX sh script run on one host; it prints one sentinel line per value.

    It only *reports* (exists, missing, the output of a tool); every verdict is made
    on the controller by `evaluate`, so changing a threshold never touches a host.
    Every interpolated value is quoted once (`shell.quote`).
    """
    w = plan.worker
    s = [
        "set -f\n",  # no globbing: paths are data
        f"e() {{ printf '{SENTINEL} %s=%s\\n' \"$1\" \"$2\"; }}\n",
        # exists / kind of a folder, as the wrapper will need it (cd needs x, listing r)
        "dir_state() { if [ -d \"$1\" ]; then if [ -r \"$1\" ] && [ -x \"$1\" ]; then echo ok;"
        " else echo unreadable; fi; elif [ -e \"$1\" ]; then echo notdir;"
        " else echo missing; fi; }\n",
    ]
    if not plan.fast:
        # First, so it is printed as early as possible: its arrival time is the reference.
        s.append('e clock "$(date +%s.%N 2>/dev/null)"\n')
        # The worker agent runs under the host's /usr/bin/python3 (else python3 on PATH).
        s.append("e python \"$( (p=/usr/bin/python3; [ -x \"$p\" ] || p=python3; \"$p\" -c "
                 "'import sys; print(\"%d.%d\" % sys.version_info[:2])') 2>/dev/null)\"\n")
    s.append(f"P={_path_word(w.path)}\n")
    s.append('e path "$(dir_state "$P")"\n')
    s.append('e disk_kb "$(df -Pk -- "$P" 2>/dev/null | awk \'NR==2 {print $4}\')"\n')
    s.append(f"C={_path_word(plan.cwd)}\n")
    if plan.prebuild and plan.prebuild.cwd_subpath:
        s.append('e cwd "$(dir_state "$C")"\n')
    s.append(_program_section(plan))
    if not plan.fast:
        s.append('e arch "$(uname -m 2>/dev/null)"\n')
        s.append('e libc "$(ldd --version 2>&1 | head -n 1)"\n')
        if w.local_devices is not None:
            s.append(_gpu_section())
        if w.data_path is not None:
            s.append(f"D={_path_word(w.data_path)}\n")
            s.append('if [ -e "$D" ]; then if [ -r "$D" ]; then e data ok; else e data unreadable;'
                     ' fi; else e data missing; fi\n')
    if plan.dial is not None:
        s.append(_dial_section(plan.dial))
    s.append("e end 1\n")
    return "".join(s)


def _program_section(plan: HostPlan) -> str:
    """Resolve the program the way ``setsid`` will exec it, from the rank's cwd.

    ``command -v`` alone is not enough: it names builtins and functions (``echo``),
    and dash's prints a relative path even for a file that is not executable.
    """
    program = plan.program
    if program is None:
        return ""
    # The cd only matters for relative words (and relative PATH entries): an absolute
    # prebuilt binary or a PATH lookup is still checked when the cwd is missing.
    lines = ["(\n", '  N=; cd -- "$C" 2>/dev/null || N=1\n']
    if plan.path_env is not None:
        lines.append(f"  export PATH={_q(plan.path_env)}\n")
    lines.append(f"  W={_q(program)}\n")
    lines.append(
        "  isexe() { if [ -f \"$1\" ] && [ -x \"$1\" ]; then e prog \"$1\";"
        " elif [ -e \"$1\" ]; then e prog '!noexec'; else e prog '!missing'; fi; }\n"
        '  case "$W" in\n'
        '    /*) isexe "$W" ;;\n'
        '    */*) if [ -n "$N" ]; then e prog \'!nocwd\'; else isexe "$W"; fi ;;\n'
        '    *) R=$(command -v "$W" 2>/dev/null)\n'
        '       case "$R" in\n'
        "         /*) ;;\n"
        # Not a path (builtin, function, alias, nothing): search PATH like execvp does.
        "         *) R=; IFS=:; for d in $PATH; do d=${d:-.}\n"
        '              if [ -f "$d/$W" ] && [ -x "$d/$W" ]; then R="$d/$W"; break; fi; done ;;\n'
        "       esac\n"
        '       e prog "${R:-!missing}" ;;\n'
        "  esac\n"
    )
    script = plan.python_script
    if script is not None:
        lines.append(f"  S={_q(script)}\n")
        lines.append('  case "$S" in /*) ;; *) [ -z "$N" ] || { e pyscript nocwd; exit 0; } ;;'
                     ' esac\n'
                     '  if [ -f "$S" ]; then e pyscript ok; else e pyscript missing; fi\n')
    lines.append(")\n")
    return "".join(lines)


def _gpu_section() -> str:
    """GPU indices with their UUIDs, and the compute processes by GPU UUID (one line each)."""
    limit = f"timeout {GPU_TIMEOUT} " if GPU_TIMEOUT else ""
    return (
        "if command -v nvidia-smi >/dev/null 2>&1; then\n"
        f'  T=; command -v timeout >/dev/null 2>&1 && T="{limit}"\n'
        "  G=$($T nvidia-smi --query-gpu=index,uuid --format=csv,noheader 2>&1); e gpu_rc $?\n"
        "  e gpus \"$(printf '%s' \"$G\" | tr '\\n' ';')\"\n"
        "  A=$($T nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader 2>/dev/null)\n"
        "  e gpu_apps \"$(printf '%s' \"$A\" | tr '\\n' ';')\"\n"
        "else\n"
        "  e gpu_rc missing\n"
        "fi\n"
    )


def _dial_section(dial: Dial) -> str:
    lines = [] if not dial.host else [
        f"H={_q(dial.host)}; PT={dial.port}\n",
        "if command -v bash >/dev/null 2>&1 && command -v timeout >/dev/null 2>&1; then\n",
        f"  R=$(timeout {DIAL_TIMEOUT} bash -c {_q(_DIAL_BASH)} _ \"$H\" \"$PT\" 2>&1); RC=$?\n",
        f'  if [ "$RC" -eq 124 ]; then R="!no answer within {DIAL_TIMEOUT} s"\n',
        # bash says "bash: connect: Connection refused": keep the cause after the last colon
        """  elif [ "$RC" -ne 0 ]; then"""
        """ R="!$(printf '%s\\n' "$R" | tail -n 1 | sed 's/^.*: //')"\n""",
        """  else R=$(printf '%s\\n' "$R" | tail -n 1); fi\n""",
        "elif command -v python3 >/dev/null 2>&1; then\n",
        f"  R=$(python3 -c {_q(_DIAL_PY)} \"$H\" \"$PT\" 2>&1 | tail -n 1)\n",
        "else\n",
        "  R='?nodial'\n",
        "fi\n",
        'e dial "$R"\n',
    ]
    if dial.tunnel:
        # Which loopback is this? Equal to the controller's means a tunnel cannot work.
        lines.append('e netns "$(readlink /proc/self/ns/net 2>/dev/null)'
                     ' $(cat /proc/sys/kernel/random/boot_id 2>/dev/null)"\n')
    return "".join(lines)


# --------------------------------------------------------------------------------------------
# The verdicts
# --------------------------------------------------------------------------------------------


@dataclass
class HostFacts:
    """What was measured on one host: the script's values plus the timings around it."""

    values: dict[str, str]
    exit_status: Optional[int] = 0
    stderr: str = ""
    probe_ms: float = 0.0
    shell_ms: Optional[float] = None
    #: Controller wall time matching the moment the host printed its clock, and its
    #: uncertainty (half the network round trip); None when not measured (local host).
    clock_ref: Optional[float] = None
    clock_error: float = 0.0
    tunnel_error: Optional[str] = None


@dataclass(frozen=True)
class ControllerFacts:
    """What the verdicts compare hosts against."""

    arch: str = ""
    libc: str = ""
    #: Network namespace and boot id of the controller: equal on a host means the host's
    #: 127.0.0.1 is the controller's own (same machine, same namespace).
    identity: str = ""
    bind_host: str = "127.0.0.1"
    port: int = 1337


def evaluate(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> list[Check]:
    """Turn one host's measurements into rows; pure, so every verdict is unit tested."""
    v = facts.values
    if v.get("end") != "1":
        detail = (facts.stderr.strip().splitlines() or ["no output"])[-1][:200]
        status = "killed" if facts.exit_status is None else f"exit {facts.exit_status}"
        return [Check(plan.host, "probe", Status.FAIL,
                      f"the check script did not finish ({status}): {detail}")]
    rows: list[Check] = []
    if not plan.fast:
        rows.append(_shell_row(plan, facts))
    rows.append(_paths_row(plan, v))
    program = _program_row(plan, v)
    if program is not None:
        rows.append(program)
    if not plan.fast:
        rows.append(_platform_row(plan, v, ctl))
        if plan.worker.local_devices is not None:
            rows.append(_gpus_row(plan, v))
        if plan.worker.data_path is not None:
            rows.append(_data_row(plan, v))
        if facts.clock_ref is not None:
            rows.append(_clock_row(plan, v, facts))
    if plan.dial is not None:
        rows.append(_port_row(plan, facts, ctl))
    return rows


def _shell_row(plan: HostPlan, facts: HostFacts) -> Check:
    v = facts.values
    statuses: list[Status] = []
    parts: list[str] = []
    python = v.get("python", "")
    python_ok = bool(python) and _version_tuple(python) >= AGENT_PYTHON
    if not python_ok:
        statuses.append(Status.FAIL)
        found = f"found {python}" if python else "found none"
        parts.append(f"the worker agent needs python3 {'.'.join(map(str, AGENT_PYTHON))} or "
                     f"newer at /usr/bin/python3 or on PATH ({found})")
    if facts.shell_ms is not None:
        if facts.shell_ms > SHELL_WARN_MS:
            statuses.append(Status.WARN)
            parts.append(f"shell start-up {facts.shell_ms:.0f} ms (> {SHELL_WARN_MS:.0f} ms: a "
                         "slow rc file? every rank start and helper command pays it)")
        else:
            parts.append(f"shell start-up {facts.shell_ms:.0f} ms")
    if python_ok:
        parts.append(f"python3 {python} for the agent")
    return Check(plan.host, "shell", _worst(statuses), "; ".join(parts))


def _dir_problem(label: str, path: str, state: str) -> str:
    what = {
        "missing": "does not exist",
        "notdir": "is not a directory",
        "unreadable": "is not readable/enterable by this user",
    }.get(state, f"cannot be checked ({state or 'no answer'})")
    return f"{label} {path} {what}"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


def _paths_row(plan: HostPlan, v: Mapping[str, str]) -> Check:
    path = plan.worker.path
    if v.get("path") != "ok":
        return Check(plan.host, "paths", Status.FAIL, _dir_problem("path", path, v.get("path", "")))
    statuses: list[Status] = []
    parts = [f"{path} exists"]
    if plan.prebuild and plan.prebuild.cwd_subpath:
        if v.get("cwd") != "ok":
            statuses.append(Status.FAIL)
            parts.append(_dir_problem("prebuild cwd", plan.cwd, v.get("cwd", "")))
        else:
            parts.append(f"prebuild cwd {plan.cwd} exists")
    kb = v.get("disk_kb", "")
    if kb.isdigit():
        free = int(kb) * 1024
        if free < DISK_WARN_BYTES:
            statuses.append(Status.WARN)
            parts.append(f"only {_human_bytes(free)} free (< 1 GiB: checkpoints and logs will "
                         "fill it)")
        else:
            parts.append(f"{_human_bytes(free)} free")
    else:
        statuses.append(Status.WARN)
        parts.append("free space unknown (df gave no answer)")
    return Check(plan.host, "paths", _worst(statuses), "; ".join(parts))


def _program_row(plan: HostPlan, v: Mapping[str, str]) -> Optional[Check]:
    program = plan.program
    if program is None:
        return None  # no command at all: one controller row says so
    got = v.get("prog", "")
    where = f"from {plan.cwd}"
    if plan.prebuild:
        label = f"prebuilt binary {program} ({ENV_PREBUILD})"
        if got.startswith("/"):
            return Check(plan.host, "program", Status.OK, f"{program} is executable")
        if got == "!noexec":
            return Check(plan.host, "program", Status.FAIL, f"{label} is not executable")
        if got == "!nocwd":
            return Check(plan.host, "program", Status.WARN,
                         f"{label} not checked: the working directory is missing")
        return Check(plan.host, "program", Status.FAIL, f"{label} does not exist")
    if got == "!nocwd":
        return Check(plan.host, "program", Status.WARN,
                     f"`{program}` not checked: the working directory {plan.cwd} is missing")
    if got == "!noexec":
        return Check(plan.host, "program", Status.FAIL,
                     f"`{program}` exists {where} but is not executable")
    if not got or got.startswith("!"):
        if "/" in program:
            why = f"`{program}` does not exist {where}"
        else:
            why = f"`{program}` not found on this host's PATH"
            if plan.path_env is not None:
                why += " (as set by the cluster/host env)"
        return Check(plan.host, "program", Status.FAIL, why)
    script = plan.python_script
    if script is not None and v.get("pyscript") == "nocwd":
        return Check(plan.host, "program", Status.WARN,
                     f"{program} resolves to {got}; {script} not checked: the working directory "
                     f"{plan.cwd} is missing")
    if script is not None and v.get("pyscript") != "ok":
        return Check(plan.host, "program", Status.FAIL,
                     f"{program} resolves to {got}, but {script} does not exist {where}")
    extra = f", {script} exists" if script is not None else ""
    resolved = got if got == program else f"{program} -> {got}"
    return Check(plan.host, "program", Status.OK, f"{resolved}{extra}")


def _platform_row(plan: HostPlan, v: Mapping[str, str], ctl: ControllerFacts) -> Check:
    arch, libc_line = v.get("arch", ""), v.get("libc", "")
    kind, version = parse_libc(libc_line)
    ctl_kind, ctl_version = parse_libc(ctl.libc)
    here = f"{arch or '?'}, {kind}{(' ' + version) if version else ''}"
    if ctl.arch and arch and arch != ctl.arch:
        return Check(plan.host, "platform", Status.FAIL,
                     f"{arch} here, {ctl.arch} on the controller: binaries and wheels built "
                     "there will not run here")
    if {kind, ctl_kind} == {"glibc", "musl"}:
        return Check(plan.host, "platform", Status.FAIL,
                     f"{kind} here, {ctl_kind} on the controller: native builds are not "
                     "interchangeable")
    if kind == "unknown" or not arch:
        return Check(plan.host, "platform", Status.WARN,
                     f"{here}: cannot tell the C library (ldd --version: "
                     f"{libc_line[:60] or 'no output'!r})")
    if (kind == ctl_kind == "glibc" and version and ctl_version
            and _version_tuple(version) < _version_tuple(ctl_version) and plan.prebuild):
        return Check(plan.host, "platform", Status.WARN,
                     f"{here}, older than the controller's glibc {ctl_version}: the prebuilt "
                     "binary may need symbols this host lacks")
    return Check(plan.host, "platform", Status.OK, f"{here} (same as the controller)"
                 if (arch, kind, version) == (ctl.arch, ctl_kind, ctl_version) else here)


def _parse_csv_lines(text: str) -> list[list[str]]:
    return [[f.strip() for f in line.split(",")] for line in text.split(";") if line.strip()]


def _gpus_row(plan: HostPlan, v: Mapping[str, str]) -> Check:
    wanted = plan.worker.local_devices
    rc = v.get("gpu_rc", "")
    if rc == "missing":
        return Check(plan.host, "gpus", Status.FAIL,
                     "local_devices is set but nvidia-smi is not on this host's PATH")
    listing = v.get("gpus", "")
    if rc != "0":
        first = (listing.split(";")[0] or "no output")[:120]
        return Check(plan.host, "gpus", Status.FAIL, f"nvidia-smi failed (status {rc}): {first}")
    uuid_to_index: dict[str, int] = {}
    found: list[int] = []
    for fields in _parse_csv_lines(listing):
        if fields and fields[0].isdigit():
            found.append(int(fields[0]))
            if len(fields) > 1:
                uuid_to_index[fields[1]] = int(fields[0])
    listed = ", ".join(str(i) for i in found) or "none"
    if wanted == "all":
        if not found:
            return Check(plan.host, "gpus", Status.FAIL,
                         "local_devices: all, but nvidia-smi lists no GPU")
        used = found
    else:
        assert isinstance(wanted, tuple)
        missing = [d for d in wanted if d not in found]
        if missing:
            names = ", ".join(str(d) for d in missing)
            return Check(plan.host, "gpus", Status.FAIL,
                         f"GPU {names} not found (nvidia-smi lists {listed})")
        used = list(wanted)
    busy: dict[int, list[str]] = {}
    for fields in _parse_csv_lines(v.get("gpu_apps", "")):
        index = uuid_to_index.get(fields[0]) if fields else None
        if index is not None and index in used:
            busy.setdefault(index, []).append(fields[1] if len(fields) > 1 else "?")
    gpus = ", ".join(str(i) for i in used)
    if busy:
        detail = "; ".join(f"GPU {i}: pid {', '.join(p)}" for i, p in sorted(busy.items()))
        return Check(plan.host, "gpus", Status.WARN,
                     f"GPU {gpus} present, but busy with compute processes ({detail})")
    return Check(plan.host, "gpus", Status.OK, f"GPU {gpus} present, no compute process")


def _data_row(plan: HostPlan, v: Mapping[str, str]) -> Check:
    path = plan.worker.data_path or ""
    state = v.get("data", "")
    if state == "ok":
        return Check(plan.host, "data_path", Status.OK, f"{path} exists and is readable")
    what = {"missing": "does not exist", "unreadable": "is not readable by this user"}.get(
        state, "cannot be checked")
    return Check(plan.host, "data_path", Status.FAIL, f"data_path {path} {what}")


def _clock_row(plan: HostPlan, v: Mapping[str, str], facts: HostFacts) -> Check:
    raw = v.get("clock", "")
    try:
        remote = float(raw)
    except ValueError:
        return Check(plan.host, "clock", Status.WARN,
                     f"cannot read the clock (`date +%s.%N` printed {raw[:40]!r})")
    assert facts.clock_ref is not None
    skew = remote - facts.clock_ref
    text = f"{skew:+.3f} s vs the controller (±{facts.clock_error:.3f} s)"
    if abs(skew) > SKEW_WARN_S:
        return Check(plan.host, "clock", Status.WARN,
                     f"{text}: > {SKEW_WARN_S:g} s skew scrambles cross-host logs and "
                     "deadlines; run NTP/chrony")
    return Check(plan.host, "clock", Status.OK, text)


_BIND_ALL = ("0.0.0.0", "::", "")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _port_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    dial = plan.dial
    assert dial is not None
    target = f"{dial.host}:{dial.port}"
    note = (f" (tested on stand-in port {dial.listen_port}: {dial.configured_port} is busy on "
            "the controller)") if dial.stand_in else ""
    if facts.tunnel_error is not None:
        reason = (f"tunnel: sshd could not listen on 127.0.0.1:{dial.configured_port} here "
                  f"({facts.tunnel_error})")
        here = facts.values.get("netns", "")
        if ctl.identity and here == ctl.identity:
            reason += ("; this host shares the controller's machine and network namespace, so "
                       "its 127.0.0.1 port is the coordinator's own: use tunnel: false")
        else:
            reason += "; is something listening there already?"
        return Check(plan.host, "port", Status.FAIL, reason)
    # Only ranks that join the cohort (fdl_fabric.rank.join()) dial the coordinator; a plain
    # script never does. So before a launch, where blocking would stop runs that work, an
    # unreachable coordinator warns; prebuild-check, which is asked to be strict, fails.
    unreachable, only_join = (Status.WARN, " (only ranks that join the cohort dial it)") \
        if plan.fast else (Status.FAIL, "")
    remote_direct = not dial.tunnel and not plan.worker.is_local
    if remote_direct and dial.host in _BIND_ALL:
        return Check(plan.host, "port", unreachable,
                     f"controller.host {dial.host} means \"every address\" to the coordinator, "
                     "but workers dial it too: set an address of the controller this host "
                     f"reaches, or tunnel: true{only_join}")
    got = facts.values.get("dial", "")
    if got == f"fdl-preflight {dial.token}" or got == AGENT_DIAL_OK:
        via = f" through the SSH tunnel to controller 127.0.0.1:{dial.listen_port}" \
            if dial.tunnel else ""
        return Check(plan.host, "port", Status.OK, f"reached the controller at {target}{via}{note}")
    if got == "?nodial":
        return Check(plan.host, "port", Status.WARN,
                     f"cannot test {target}: neither bash+timeout nor python3 on this host")
    if got.startswith("!") or not got:
        why = got[1:] or "no answer"
        hint = ""
        if remote_direct and _is_loopback(dial.host):
            hint = ("; controller.host is a loopback address, which other machines cannot "
                    "dial: set controller.host to an address of the controller they reach, or "
                    "tunnel: true")
        return Check(plan.host, "port", unreachable,
                     f"cannot reach the controller at {target}: {why}{note}{hint}{only_join}")
    return Check(plan.host, "port", unreachable,
                 f"{target} answers, but it is not this controller (got {got[:60]!r}): "
                 f"controller.host {dial.host} points elsewhere from this host{note}{only_join}")


# --------------------------------------------------------------------------------------------
# The fast pre-flight of a launch, run by each host's agent
# --------------------------------------------------------------------------------------------


def launch_plan(cluster: ClusterSpec, worker: WorkerSpec, argv: Sequence[str],
                prebuild: Optional[PrebuildEntry]) -> HostPlan:
    """What a launch checks on one host before any rank starts (``fast``)."""
    dial_host = controller_dial_host(cluster, worker)
    bind_host = "127.0.0.1" if bind_loopback(cluster) else cluster.controller.host
    port = cluster.controller.port
    dial = Dial(host=dial_host, port=port, token="", tunnel=worker.tunnel,
                listen_host=bind_host, listen_port=port, configured_port=port)
    return HostPlan(worker=worker, fast=True, argv=tuple(argv), prebuild=prebuild, dial=dial,
                    path_env=worker.env.get("PATH", cluster.env.get("PATH")))


def agent_checks(plan: HostPlan) -> dict[str, Any]:
    """The ``checks`` part of an agent's spec: what to look at (the agent only reports)."""
    assert plan.dial is not None
    return {
        "path": plan.worker.path,
        "cwd": plan.cwd if plan.prebuild and plan.prebuild.cwd_subpath else None,
        "program": plan.program,
        "pyscript": plan.python_script,
        "path_env": plan.path_env,
        "dial": {"host": plan.dial.host, "port": plan.dial.port}
        if plan.dial.host not in _BIND_ALL else None,
    }


def judge(plan: HostPlan, values: Mapping[str, str]) -> list[Check]:
    """The verdict rows of an agent's facts (the same rules as `inv prebuild-check`)."""
    assert plan.dial is not None
    ctl = ControllerFacts(bind_host=plan.dial.listen_host, port=plan.dial.configured_port)
    return evaluate(plan, HostFacts(values=dict(values)), ctl)


# --------------------------------------------------------------------------------------------
# Running the checks
# --------------------------------------------------------------------------------------------


class _TokenListener:
    """The controller end of the port check: answer every connection with the token."""

    def __init__(self, sock: socket.socket, token: str) -> None:
        self.sock = sock
        self.token = token
        self.port = int(sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fdl-preflight-port",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        line = f"fdl-preflight {self.token}\n".encode()
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if not ready:
                continue
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError), conn:
                conn.settimeout(1.0)
                conn.sendall(line)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


def _bind(host: str, port: int) -> socket.socket:
    """Bind and listen like the coordinator does (SO_REUSEADDR), so "free" means the same."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def _port_owner(port: int) -> str:
    """``pid 123 (python3)`` for the local listener on ``port``, best effort."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return "another user's process"
                try:
                    name = psutil.Process(conn.pid).name()
                except psutil.Error:
                    name = "?"
                return f"pid {conn.pid} ({name})"
    except Exception:
        pass
    return "another process"


def _open_listener(cluster: ClusterSpec, token: str) -> tuple[Check, Optional[_TokenListener]]:
    """Check that the coordinator port is free and keep it open for the workers to dial."""
    host = "127.0.0.1" if bind_loopback(cluster) else cluster.controller.host
    port = cluster.controller.port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        return (Check(CONTROLLER, "port", Status.OK, f"{address} is free (the coordinator "
                      "binds it)"), _TokenListener(_bind(host, port), token))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            row = Check(CONTROLLER, "port", Status.FAIL,
                        f"{address} is in use by {_port_owner(port)}: the coordinator cannot "
                        "bind it (pick another controller.port, or stop that process)")
        elif exc.errno == errno.EADDRNOTAVAIL:
            return (Check(CONTROLLER, "port", Status.FAIL,
                          f"controller.host {host} is not an address of this machine, so the "
                          "coordinator cannot listen on it"), None)
        else:
            row = Check(CONTROLLER, "port", Status.FAIL, f"cannot bind {address}: {exc}")
    try:  # a stand-in port still tests routes and firewalls from every worker
        return row, _TokenListener(_bind(host, 0), token)
    except OSError:
        return row, None


def _known_host_state(settings: SshSettings, config: Any) -> tuple[str, str]:
    """(``known``/``unknown``/``unchecked``, key name) before connecting.

    Read from the known_hosts files the connection will use, under the name paramiko
    will look up (``[addr]:port`` unless the port is 22), after ~/.ssh/config aliases.
    """
    if settings.strict_host_key_checking == "no":
        return "unchecked", ""
    import paramiko

    from .ssh import make_connection

    scratch = make_connection(settings, config)  # resolves aliases; opens no socket
    name = scratch.host if int(scratch.port) == 22 else f"[{scratch.host}]:{scratch.port}"
    for path in (settings.known_hosts_file, "/etc/ssh/ssh_known_hosts"):
        if not os.path.exists(path):
            continue
        try:
            if paramiko.HostKeys(path).lookup(name):
                return "known", name
        except (OSError, paramiko.SSHException):
            continue
    return "unknown", name


class _TimedSink:
    """An invoke out_stream that records when the clock sentinel line arrived."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.clock_at: Optional[float] = None
        self._marker = f"{SENTINEL} clock="

    def write(self, text: str) -> int:
        now = time.time()
        self.parts.append(text)
        if self.clock_at is None:
            joined = "".join(self.parts)
            at = joined.find(self._marker)
            if at >= 0 and "\n" in joined[at:]:
                self.clock_at = now
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _ms(start: float) -> float:
    return (time.monotonic() - start) * 1000.0


def _check_remote(plan: HostPlan, settings: SshSettings, config: Any,
                  ctl: ControllerFacts) -> list[Check]:
    from .ssh import SshConnectError, open_connection

    host = plan.host
    state, key_name = _known_host_state(settings, config)
    start = time.monotonic()
    try:
        conn = open_connection(settings, config)
    except SshConnectError as exc:
        reason = exc.reason
        if "CHANGED" in reason:
            reason += f" (known_hosts: {settings.known_hosts_file}, entry {key_name})"
        elif reason.startswith("authentication refused") and settings.identity_files:
            reason += f" (identity: {', '.join(settings.identity_files)})"
        return [Check(host, "ssh", Status.FAIL, reason)]
    connect_ms = _ms(start)
    try:
        facts = HostFacts(values={})
        if not plan.fast:
            t = time.monotonic()
            conn.run("true", hide=True, warn=True, pty=False, in_stream=False,
                     timeout=PROBE_TIMEOUT)
            facts.shell_ms = _ms(t)
        with contextlib.ExitStack() as stack:
            dial = plan.dial
            if dial is not None and dial.tunnel:
                try:
                    stack.enter_context(conn.forward_remote(
                        dial.configured_port, local_port=dial.listen_port,
                        local_host="127.0.0.1"))
                except Exception as exc:
                    facts.tunnel_error = str(exc) or type(exc).__name__
                    plan = _without_dial_run(plan)
            rtt = 0.0
            if not plan.fast:
                # A pure network round trip (no shell): bounds the clock estimate.
                t = time.monotonic()
                conn.transport.global_request("keepalive@openssh.com", wait=True)
                rtt = time.monotonic() - t
            out, err = _TimedSink(), _TimedSink()
            t = time.monotonic()
            try:
                result = conn.run(f"exec sh -c {_q(probe_script(plan))}", hide=False, warn=True,
                                  pty=False, in_stream=False, echo=False, out_stream=out,
                                  err_stream=err, timeout=PROBE_TIMEOUT)
                facts.exit_status = result.exited
            except Exception as exc:  # CommandTimedOut, a dropped connection
                facts.exit_status = None
                err.write(f"\n{type(exc).__name__}: {exc}")
            facts.probe_ms = _ms(t)
        facts.values = parse_sentinels(out.text)
        facts.stderr = err.text
        if out.clock_at is not None:
            facts.clock_ref = out.clock_at - rtt / 2
            facts.clock_error = rtt / 2
    finally:
        with contextlib.suppress(Exception):
            conn.close()
    if state == "known":
        key = "host key known"
        key_status = Status.OK
    elif state == "unknown":
        key = "new host key recorded in known_hosts (accept-new)"
        key_status = Status.OK
    else:
        key = "host key NOT verified (StrictHostKeyChecking=no)"
        key_status = Status.WARN
    who = f"{settings.user + '@' if settings.user else ''}{key_name or settings.target}"
    ssh_row = Check(host, "ssh", key_status, f"connected to {who} in {connect_ms:.0f} ms; {key};"
                    f" checks took {facts.probe_ms:.0f} ms")
    return [ssh_row, *evaluate(plan, facts, ctl)]


def _without_dial_run(plan: HostPlan) -> HostPlan:
    """After a failed tunnel there is nothing to dial; keep asking for the netns identity."""
    import dataclasses

    assert plan.dial is not None
    return dataclasses.replace(plan, dial=dataclasses.replace(plan.dial, host="", port=0))


def _local_shell() -> str:
    return shutil.which("bash") or shutil.which("sh") or "/bin/sh"


def _check_local(plan: HostPlan, ctl: ControllerFacts) -> list[Check]:
    """A local worker runs the same script with bash, in the launcher's environment."""
    shell = _local_shell()
    facts = HostFacts(values={})
    if not plan.fast:
        t = time.monotonic()
        subprocess.run([shell, "-c", "true"], stdin=subprocess.DEVNULL, check=False)
        facts.shell_ms = _ms(t)
    t = time.monotonic()
    try:
        proc = subprocess.run([shell, "-c", probe_script(plan)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace",
                              timeout=PROBE_TIMEOUT, check=False)
        facts.values = parse_sentinels(proc.stdout)
        facts.exit_status, facts.stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        facts.exit_status, facts.stderr = None, f"timed out after {PROBE_TIMEOUT:.0f} s"
    facts.probe_ms = _ms(t)
    return evaluate(plan, facts, ctl)


def _guarded(host: str, fn: Callable[..., list[Check]], *args: Any) -> list[Check]:
    """Run one host's checks; a crash becomes that host's FAIL row, never the whole report's."""
    try:
        return fn(*args)
    except Exception as exc:
        return [Check(host, "probe", Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}")]


def _controller_facts(cluster: ClusterSpec, fast: bool) -> ControllerFacts:
    """The controller's own platform and loopback identity (what hosts are compared with)."""
    arch = libc = ""
    if not fast:
        out = subprocess.run(
            ["sh", "-c", "uname -m; ldd --version 2>&1 | head -n 1"], capture_output=True,
            text=True, errors="replace", stdin=subprocess.DEVNULL, check=False).stdout
        lines = out.splitlines() + ["", ""]
        arch, libc = lines[0].strip(), lines[1].strip()
    identity = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        identity = f"{os.readlink('/proc/self/ns/net')} {boot}"
    host = "127.0.0.1" if bind_loopback(cluster) else cluster.controller.host
    return ControllerFacts(arch=arch, libc=libc, identity=identity, bind_host=host,
                           port=cluster.controller.port)


def _prebuild_rows(cluster: ClusterSpec,
                   environ: Mapping[str, str]) -> tuple[list[Check], dict[str, PrebuildEntry]]:
    raw = environ.get(ENV_PREBUILD)
    if raw is None or not raw.strip():
        return [], {}
    try:
        entries = parse_prebuild(raw)
    except EnvelopeError as exc:
        return [Check(CONTROLLER, "prebuild", Status.FAIL, str(exc))], {}
    hosts = {w.host for w in cluster.workers}
    unknown = sorted(set(entries) - hosts)
    if unknown:
        row = Check(CONTROLLER, "prebuild", Status.FAIL,
                    f"{ENV_PREBUILD} names host(s) not in {cluster.file}: {', '.join(unknown)}")
    else:
        row = Check(CONTROLLER, "prebuild", Status.OK,
                    f"{ENV_PREBUILD}: {len(entries)} prebuilt binary(ies) for "
                    f"{', '.join(sorted(entries)) or 'no host'}")
    return [row], {h: e for h, e in entries.items() if h in hosts}


def run_checks(
    cluster: ClusterSpec,
    *,
    argv: Sequence[str],
    fast: bool = False,
    settings: Optional[dict[str, SshSettings]] = None,
    config: Any = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Report:
    """Check every host of ``cluster`` in parallel and return the report.

    ``argv`` is the rank command (its first word is resolved on every host);
    ``fast`` keeps only what ``inv launch`` checks before spawning (ssh, paths,
    program, port); ``settings`` and ``config`` default to what a launch would use;
    ``environ`` (default os.environ) supplies FLODL_INTERNAL_PREBUILD_PER_HOST.
    An unreachable host FAILs its own ssh row; every other host is still checked.
    """
    started = time.monotonic()
    env = os.environ if environ is None else environ
    if settings is None:
        settings = resolve_all_settings(cluster)
    rows: list[Check] = []
    if not argv:
        rows.append(Check(CONTROLLER, "command", Status.FAIL,
                          "no command to check: set `command:` in the cluster file or pass --cmd"))
    prebuild_rows, prebuild = _prebuild_rows(cluster, env)
    rows += prebuild_rows
    token = secrets.token_hex(8)
    port_row, listener = _open_listener(cluster, token)
    rows.append(port_row)
    try:
        ctl = _controller_facts(cluster, fast)
        jobs: list[tuple[str, Callable[..., list[Check]], tuple[Any, ...]]] = []
        for w in cluster.workers:
            dial = None
            if listener is not None:
                dial = Dial(
                    host="127.0.0.1" if w.tunnel else controller_dial_host(cluster, w),
                    port=cluster.controller.port if w.tunnel else listener.port,
                    token=token, tunnel=w.tunnel, listen_host=ctl.bind_host,
                    listen_port=listener.port, configured_port=cluster.controller.port)
            path_env = w.env.get("PATH", cluster.env.get("PATH"))
            plan = HostPlan(worker=w, fast=fast, argv=tuple(argv), prebuild=prebuild.get(w.host),
                            dial=dial, path_env=path_env)
            if w.tunnel and dial is not None and ctl.bind_host not in ("127.0.0.1", *_BIND_ALL):
                jobs.append((w.host, _tunnel_mismatch, (plan, ctl, settings[w.host], config)))
            elif w.is_local:
                jobs.append((w.host, _check_local, (plan, ctl)))
            else:
                jobs.append((w.host, _check_remote, (plan, settings[w.host], config, ctl)))
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(jobs)))) as pool:
            futures = [pool.submit(_guarded, h, fn, *args) for h, fn, args in jobs]
            for fut in futures:
                rows += fut.result()
    finally:
        if listener is not None:
            listener.close()
    return Report(_ordered(rows), elapsed=time.monotonic() - started)


def _tunnel_mismatch(plan: HostPlan, ctl: ControllerFacts, settings: SshSettings,
                     config: Any) -> list[Check]:
    """A tunneled worker in a cluster whose coordinator binds a non-loopback address.

    The launcher's remote forward delivers to 127.0.0.1:<port> on the controller, where
    nothing listens when the coordinator binds ``controller.host`` (some workers dial it
    directly). Reported without opening the forward: Fabric's forward handler raises in
    paramiko's transport thread when the local connect is refused.
    """
    assert plan.dial is not None
    plan_no_dial = HostPlan(plan.worker, plan.fast, plan.argv, plan.prebuild, None,
                            plan.path_env)
    rows = _check_remote(plan_no_dial, settings, config, ctl)
    if any(r.name == "ssh" and r.status is Status.FAIL for r in rows):
        return rows
    status, only_join = (Status.WARN, " (only ranks that join the cohort dial it)") \
        if plan.fast else (Status.FAIL, "")
    rows.append(Check(plan.host, "port", status,
                      f"tunnel: true, but the coordinator binds {ctl.bind_host}:{ctl.port} "
                      "(other workers dial it directly) while the tunnel delivers to "
                      f"127.0.0.1:{ctl.port} there: tunnel every remote worker, or "
                      f"none{only_join}"))
    return rows


def _ordered(rows: list[Check]) -> list[Check]:
    """Controller rows first, then hosts in roster order, checks in a fixed order."""
    hosts: list[str] = [CONTROLLER]
    for r in rows:
        if r.host not in hosts:
            hosts.append(r.host)
    rank = {name: i for i, name in enumerate(_ROW_ORDER)}
    return sorted(rows, key=lambda r: (hosts.index(r.host), rank.get(r.name, len(rank))))


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def use_color(stream: Any) -> bool:
    """Colors only for a person at a terminal, and never when NO_COLOR is set (no-color.org)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def command_words(cluster: ClusterSpec, cmd: Optional[str], rest: Sequence[str]) -> list[str]:
    """The rank argv a launch would use: ``--`` words, else ``--cmd``, else the file's."""
    if rest:
        return list(rest)
    text = cmd if cmd is not None else cluster.command
    if not text:
        return []
    from .shell import split_command

    return split_command(text)  # ValueError on unbalanced quotes: the caller exits 2


def main(argv: Optional[Sequence[str]] = None, *, out: Any = None, err: Any = None) -> int:
    """``python3 -m fdl_fabric.preflight --cluster F [--json] [--cmd C] [--fast] [-- prog ...]``.

    Exit 0 when nothing FAILs, 1 otherwise, 2 on a config or usage error.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    args = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in args:
        rest = args[args.index("--") + 1:]
        args = args[:args.index("--")]
    parser = argparse.ArgumentParser(
        prog="prebuild-check",
        description="Check every host of a cluster file before launching anything.")
    parser.add_argument("--cluster", default="cluster.yml", help="cluster file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--cmd", default=None, help="command to check (default: `command:`)")
    parser.add_argument("--fast", action="store_true",
                        help="only what `inv launch` checks: ssh, paths, program, port")
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # argparse printed the usage error
        return 2 if exc.code else 0
    try:
        cluster = load_cluster(ns.cluster)
        settings = resolve_all_settings(cluster)
    except ConfigError as exc:
        print(str(exc), file=err)
        return 2
    try:
        words = command_words(cluster, ns.cmd, rest)
    except ValueError as exc:
        print(f"{cluster.file}: command: {exc}", file=err)
        return 2
    for w in cluster.workers:
        warning = batchmode_warning(w.ssh.options, w.host)
        if warning:
            print(warning, file=err)
    report = run_checks(cluster, argv=words, fast=ns.fast, settings=settings)
    if ns.json:
        print(json.dumps(report.to_json(), indent=2), file=out)
    else:
        out.write(report.table(color=use_color(out)))
        print(report.summary(), file=out)
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
