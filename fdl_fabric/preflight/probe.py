"""What to ask one host, as one POSIX sh script, and reading what it prints.

A check must not cost a round trip each, or checking 64 hosts over a slow link takes
minutes. Every host runs one script that prints ``__FDL_CHECK__ name=value`` sentinel
lines; the verdicts are made on the controller (`verdicts`). Sentinels are found anywhere
in a line, so a noisy rc file that prints banners cannot hide them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..clusterfile import WorkerSpec
from ..planning.envelope import PrebuiltBinary
from ..shell import quote

#: Prefix of every value line the host script prints.
SENTINEL = "__FDL_CHECK__"
#: Seconds a worker waits to reach the controller port before calling it unreachable.
DIAL_TIMEOUT = 3
#: Seconds nvidia-smi gets (when ``timeout`` exists on the host).
GPU_TIMEOUT = 10


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


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))




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
    """What to check on one worker, derived from the cluster file, argv and prebuilt binaries."""

    worker: WorkerSpec
    fast: bool
    argv: tuple[str, ...]
    prebuilt: Optional[PrebuiltBinary] = None
    dial: Optional[Dial] = None
    #: PATH as the rank will see it when cluster/host env sets it (exported literally,
    #: like the rank wrapper's env script does), else None.
    path_env: Optional[str] = None
    #: PYTHONPATH when cluster/host env sets it: where ``python -m`` looks for modules.
    python_path: Optional[str] = None
    #: ``MASTER_ADDR`` and ``MASTER_PORT`` of the launch: every host must resolve and
    #: reach rank 0's address before any rank starts (a launch's pre-flight only).
    master: Optional[tuple[str, int]] = None

    @property
    def host(self) -> str:
        return self.worker.host

    @property
    def cwd(self) -> str:
        """The rank's working directory: the prebuild cwd when the host has an entry."""
        return self.prebuilt.cwd(self.worker.path) if self.prebuilt else self.worker.path

    @property
    def program(self) -> Optional[str]:
        """The word the wrapper hands to ``setsid`` (a prebuilt binary replaces argv[0])."""
        if self.prebuilt:
            return self.prebuilt.program(self.worker.path)
        return self.argv[0] if self.argv else None

    @property
    def python_script(self) -> Optional[str]:
        """``train.py`` of ``python3 -u train.py``: the commonest missing file, cheap to
        check (`fdl-fabric run` always builds ``python -u script``)."""
        target = None if self.prebuilt else python_target(self.argv)
        return target[1] if target and target[0] == "script" else None

    @property
    def python_module(self) -> Optional[str]:
        """``pkg.train`` of ``python3 -m pkg.train``: checked with the same interpreter."""
        target = None if self.prebuilt else python_target(self.argv)
        return target[1] if target and target[0] == "module" else None


#: Interpreter options that take the next word as their value (``-W ignore``).
_PY_OPTIONS_WITH_VALUE = frozenset({"-W", "-X"})


def python_target(argv: Sequence[str]) -> Optional[tuple[str, str]]:
    """What a Python command line runs: ``("script", path)`` or ``("module", name)``, read
    past the interpreter's own options the way python does; None for ``-c``, ``-``, a
    bare interpreter, or a program that is not python."""
    if not argv or not re.fullmatch(r"python[0-9.]*", os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            module = word[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return ("module", module) if module else None
        if word in ("-", "-c") or word.startswith("-c"):
            return None
        if word in _PY_OPTIONS_WITH_VALUE:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return ("script", word)
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
    if plan.prebuilt and plan.prebuilt.cwd_subpath:
        s.append('e cwd "$(dir_state "$C")"\n')
    s.append(_program_section(plan))
    if not plan.fast:
        # Where the agent would find py-spy for stack dumps (agent/stacks.find_py_spy).
        s.append('e pyspy "$(if [ -n "${FLODL_PY_SPY:-}" ]; then echo "$FLODL_PY_SPY"; else '
                 'command -v py-spy 2>/dev/null || for f in "$HOME/.local/bin/py-spy" '
                 '/usr/local/bin/py-spy; do [ -x "$f" ] && { echo "$f"; break; }; done; fi)"\n')
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
                     '  if [ -f "$S" ]; then e pyscript ok; elif [ -d "$S" ]; then e pyscript dir;'
                     ' else e pyscript missing; fi\n')
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
