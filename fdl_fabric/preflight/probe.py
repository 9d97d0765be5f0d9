"""What to ask one host, and reading what it says.

Each fact about a host is gathered once, by one gatherer. The host's agent gathers every
fact of the host itself (`fdl_fabric.agent.checks`, asked with `agent_checks`), for
prebuild-check as for a launch. What the agent cannot say is measured around it, by one
POSIX ``sh`` script run through the host's transport (`probe_script`): the Python the
agent would start under (an agent that cannot start cannot say so), and the host's clock,
whose line's arrival the transport times (a measurement of the path to the host, not a
fact on it). The script prints ``__FDL_CHECK__ name=value`` sentinel lines, found anywhere
in a line, so a noisy rc file that prints banners cannot hide them. Every verdict is made
on the controller (`verdicts`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..clusterfile import ClusterSpec, WorkerSpec
from ..planning.envelope import PrebuiltBinary

#: Prefix of every value line the host script prints.
SENTINEL = "__FDL_CHECK__"
#: ``controller.host`` values that mean "every address" to a listener.
BIND_ALL = ("0.0.0.0", "::", "")


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




#: The variables that pick the collectives' interface, and who reads each.
NCCL_VAR, GLOO_VAR = "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class IfnameSetting:
    """One variable that names the interface on a host, and where it was set."""

    var: str
    value: str
    source: str

    def matches(self, name: str) -> bool:
        """Whether ``name`` is an interface this setting selects."""
        for item in (p.strip() for p in self.value.split(",") if p.strip()):
            if self.var == GLOO_VAR or item.startswith("="):
                if name == item.lstrip("="):
                    return True
            elif not item.startswith("^") and name.startswith(item):
                return True
        return False

    @property
    def excludes_only(self) -> bool:
        """``^docker,lo``: NCCL picks any other interface, so there is nothing to find."""
        return self.var == NCCL_VAR and self.value.strip().startswith("^")


def settings_of(cluster: ClusterSpec, worker: WorkerSpec) -> tuple[IfnameSetting, ...]:
    """The interface settings a worker's ranks get: ``nccl_socket_ifname`` (exported as
    both variables), else the host's or the cluster's ``env``."""
    if worker.nccl_socket_ifname:
        return (IfnameSetting(NCCL_VAR, worker.nccl_socket_ifname, "nccl_socket_ifname"),)
    found = []
    for var in (NCCL_VAR, GLOO_VAR):
        value = worker.env.get(var, cluster.env.get(var))
        if value:
            where = "the host's env" if var in worker.env else "env"
            found.append(IfnameSetting(var, value, f"{var} ({where})"))
    return tuple(found)



@dataclass(frozen=True)
class Dial:
    """How a worker proves it can reach the coordinator port.

    The controller listens on ``listen_host:listen_port`` and answers a ``probe`` frame
    keyed with ``token`` (a salt, hex) as the coordinator answers a launch's agents; the
    worker's agent dials ``host:port`` (``127.0.0.1:<controller.port>`` through a remote
    forward for tunneled workers). The keyed reply proves the worker reached *this*
    controller, not some other service that happens to listen on that port on its side.
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
    #: ``--smoke``: the costly checks too (a matmul on each GPU), as prebuild-check does.
    smoke: bool = False
    #: What names the collectives' interface on this host (`settings_of`).
    ifnames: tuple[IfnameSetting, ...] = ()

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


def probe_script(plan: HostPlan) -> str:
    """The POSIX sh script run on one host: what only the shell can tell, one sentinel
    line per value, ending ``end=1``.

    In full mode: the clock, first, so it is printed as early as possible (its arrival
    time is the reference), and the Python the worker agent will start under (the host's
    /usr/bin/python3, else python3 on PATH, as `transport.bundle` starts it). In fast mode
    only the end: the run itself proves the transport reaches the host.
    """
    s = [f"e() {{ printf '{SENTINEL} %s=%s\\n' \"$1\" \"$2\"; }}\n"]
    if not plan.fast:
        s.append('e clock "$(date +%s.%N 2>/dev/null)"\n')
        s.append("e python \"$( (p=/usr/bin/python3; [ -x \"$p\" ] || p=python3; \"$p\" -c "
                 "'import sys; print(\"%d.%d\" % sys.version_info[:2])') 2>/dev/null)\"\n")
    s.append("e end 1\n")
    return "".join(s)


def _dial_target(plan: HostPlan) -> Optional[dict[str, Any]]:
    """Where the agent dials the controller; None with nothing to dial, or where the
    address means "every address" to a remote worker (its row says so without a dial)."""
    dial = plan.dial
    if dial is None or not dial.host:
        return None
    if dial.host in BIND_ALL and not plan.worker.is_local:
        return None
    return {"host": dial.host, "port": dial.port}


def _gpu_checks(plan: HostPlan) -> Optional[dict[str, Any]]:
    """What the agent asks of the GPUs (only with ``local_devices``): their listing (the
    full pre-flight), their health (always: cheap), a matmul on each with the ranks'
    interpreter (the full pre-flight, or ``--smoke``)."""
    w = plan.worker
    if w.local_devices is None:
        return None
    argv = plan.argv
    python = argv[0] if argv and re.fullmatch(r"python[0-9.]*", os.path.basename(argv[0])) \
        else None
    return {"listing": not plan.fast, "health": True, "matmul": not plan.fast or plan.smoke,
            "python": python, "python_path": plan.python_path, "path_env": plan.path_env,
            "devices": list(w.local_devices) if isinstance(w.local_devices, tuple) else "all"}


def agent_checks(plan: HostPlan) -> dict[str, Any]:
    """The ``checks`` part of an agent's spec: what to look at (the agent only reports,
    `fdl_fabric.agent.checks.gather`). Fast (a launch, ``--fast``): the working folders,
    the program, the controller dial and MASTER_ADDR; full: also the platform, py-spy,
    the GPUs, the data folder. A tunneled worker also says which loopback it has."""
    w = plan.worker
    full = not plan.fast
    return {
        "path": w.path,
        "cwd": plan.cwd if plan.prebuilt and plan.prebuilt.cwd_subpath else None,
        "program": plan.program,
        "pyscript": plan.python_script,
        "pymodule": plan.python_module,
        "pythonpath": plan.python_path,
        "path_env": plan.path_env,
        "dial": _dial_target(plan),
        "master": {"host": plan.master[0], "port": plan.master[1]} if plan.master else None,
        "platform": full,
        "pyspy": full,
        "gpus": _gpu_checks(plan),
        "data": w.data_path if full else None,
        "netns": plan.dial is not None and plan.dial.tunnel,
        "ifaces": bool(plan.ifnames),
    }
