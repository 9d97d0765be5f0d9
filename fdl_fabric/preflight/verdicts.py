"""The verdicts: what a host's values mean, as rows; pure, so every rule is unit tested.

The same functions judge prebuild-check's answers and a launch's: the values of the
host's agent (`fdl_fabric.agent.checks`), with, for prebuild-check, what the transport's
``sh`` probe measured around it (`probe.probe_script`). One row function per check, in
`_ROWS`: adding a row is one function and its line there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional, Union

from ..planning.envelope import ENV_PREBUILD
from .facts import ControllerFacts, HostFacts
from .gpus import gpus_row, health_rows
from .nic import iface_row
from .probe import BIND_ALL, HostPlan, parse_libc, version_tuple
from .report import Check, Status, worst

#: The oldest Python the worker agent runs on.
AGENT_PYTHON = (3, 8)
#: What an agent reports for ``dial`` when this run's coordinator answered with its key
#: (`fdl_fabric.agent.checks.DIAL_OK`).
AGENT_DIAL_OK = "ok"
#: A shell start-up above this is paid by every rank start (and every helper command).
SHELL_WARN_MS = 200.0
#: Checkpoints and logs fill a disk fast; below this, warn.
DISK_WARN_BYTES = 1 << 30
#: Above this, log timestamps across hosts stop lining up and timeouts misfire.
SKEW_WARN_S = 2.0



def evaluate(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> list[Check]:
    """Turn one host's measurements into rows; pure, so every verdict is unit tested."""
    v = facts.values
    if v.get("end") != "1":
        detail = (facts.stderr.strip().splitlines() or ["no output"])[-1][:200]
        status = "killed" if facts.exit_status is None else f"exit {facts.exit_status}"
        return [Check(plan.host, "probe", Status.FAIL,
                      f"the check script did not finish ({status}): {detail}")]
    if facts.agent_error is not None:
        shell = [] if plan.fast else [_shell_row(plan, facts)]
        return [*shell, Check(plan.host, "probe", Status.FAIL,
                              f"the host's agent gave no facts: {facts.agent_error}")]
    rows: list[Check] = []
    for row in _ROWS:
        got = row(plan, facts, ctl)
        if isinstance(got, Check):
            rows.append(got)
        elif got is not None:
            rows.extend(got)
    return rows


#: A row function: one row, several (GPU health: one per GPU and field), or none.
Row = Callable[[HostPlan, HostFacts, ControllerFacts], Union[Check, list[Check], None]]


def _full(row: Row) -> Row:
    """A row of the full pre-flight only (prebuild-check without ``--fast``)."""
    def only_full(plan: HostPlan, facts: HostFacts,
                  ctl: ControllerFacts) -> Union[Check, list[Check], None]:
        return None if plan.fast else row(plan, facts, ctl)

    only_full.__doc__ = row.__doc__
    return only_full


def _master_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Optional[Check]:
    """``MASTER_ADDR`` as this host's ranks will dial it, before rank 0 listens: a name
    that does not resolve here, or a host that does not answer, would leave them retrying
    for torch's 30-minute default with no verdict. Only where a launch asked."""
    got = facts.values.get("master")
    if plan.master is None or got is None:
        return None
    addr, port = plan.master
    target = f"MASTER_ADDR {addr}" + (f" (port {port})" if got.startswith("busy") else "")
    if got.startswith("ok"):
        return Check(plan.host, "master", Status.OK,
                     f"MASTER_ADDR {addr} resolves to {got.split()[-1]} and answers")
    if got.startswith("busy"):
        return Check(plan.host, "master", Status.WARN,
                     f"{target}: something already listens on {addr}:{port}; rank 0's "
                     "store cannot bind it (give --master-port, or master_port:)")
    return Check(plan.host, "master", Status.FAIL,
                 f"MASTER_ADDR {addr} {got[1:]}: this host's ranks cannot reach rank 0 "
                 "(give --master-addr, or addr: of the first worker, an address every host "
                 "resolves and reaches)")


def _shell_row(plan: HostPlan, facts: HostFacts) -> Check:
    """The shell's start-up and the Python the agent starts under (the ``sh`` probe's)."""
    v = facts.values
    statuses: list[Status] = []
    parts: list[str] = []
    python = v.get("python", "")
    python_ok = bool(python) and version_tuple(python) >= AGENT_PYTHON
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
    return Check(plan.host, "shell", worst(statuses), "; ".join(parts))


def _stacks_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    """py-spy, for the stacks of a hung run and of ``fdl-fabric stacks`` (optional)."""
    found = facts.values.get("pyspy", "").strip()
    if found and found.lower() != "none":
        return Check(plan.host, "stacks", Status.OK,
                     f"py-spy {found}: a hung run shows every rank's Python stack")
    return Check(plan.host, "stacks", Status.WARN,
                 "py-spy not found: a hung run shows only what /proc says of each rank; "
                 "`pip install fdl-fabric[stacks]` (or py-spy) on this host")


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


def _paths_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    v = facts.values
    path = plan.worker.path
    if v.get("path") != "ok":
        return Check(plan.host, "paths", Status.FAIL, _dir_problem("path", path, v.get("path", "")))
    statuses: list[Status] = []
    parts = [f"{path} exists"]
    if plan.prebuilt and plan.prebuilt.cwd_subpath:
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
    return Check(plan.host, "paths", worst(statuses), "; ".join(parts))


def _program_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Optional[Check]:
    """The program the rank will exec, resolved as ``setsid`` will (a prebuilt binary,
    a path, a PATH lookup), then the script or module a Python command runs."""
    program = plan.program
    if program is None:
        return None  # no command at all: one controller row says so
    got = facts.values.get("prog", "")
    if plan.prebuilt:
        return _prebuilt_row(plan, program, got)
    return _unresolved_row(plan, program, got) or \
        _python_target_row(plan, program, got, facts.values)


def _prebuilt_row(plan: HostPlan, program: str, got: str) -> Check:
    label = f"prebuilt binary {program} ({ENV_PREBUILD})"
    if got.startswith("/"):
        return Check(plan.host, "program", Status.OK, f"{program} is executable")
    if got == "!noexec":
        return Check(plan.host, "program", Status.FAIL, f"{label} is not executable")
    if got == "!nocwd":
        return Check(plan.host, "program", Status.WARN,
                     f"{label} not checked: the working directory is missing")
    return Check(plan.host, "program", Status.FAIL, f"{label} does not exist")


def _unresolved_row(plan: HostPlan, program: str, got: str) -> Optional[Check]:
    """The row of a program that did not resolve to a file the rank can exec, else None."""
    where = f"from {plan.cwd}"
    if got == "!nocwd":
        return Check(plan.host, "program", Status.WARN,
                     f"`{program}` not checked: the working directory {plan.cwd} is missing")
    if got == "!noexec":
        return Check(plan.host, "program", Status.FAIL,
                     f"`{program}` exists {where} but is not executable")
    if got and not got.startswith("!"):
        return None
    if "/" in program:
        why = f"`{program}` does not exist {where}"
    else:
        why = f"`{program}` not found on this host's PATH"
        if plan.path_env is not None:
            why += " (as set by the cluster/host env)"
    return Check(plan.host, "program", Status.FAIL, why)


def _python_target_row(plan: HostPlan, program: str, got: str,
                       v: Mapping[str, str]) -> Check:
    """The resolved program's row, with its Python script or module when it has one."""
    where = f"from {plan.cwd}"
    script, module = plan.python_script, plan.python_module
    if script is not None:
        state = v.get("pyscript")
        if state == "nocwd":
            return Check(plan.host, "program", Status.WARN,
                         f"{program} resolves to {got}; {script} not checked: the working "
                         f"directory {plan.cwd} is missing")
        if state != "ok":
            what = "is a folder, not a script" if state == "dir" else "does not exist"
            return Check(plan.host, "program", Status.FAIL,
                         f"{_resolved(program, got)}: {script} {what} {where}")
    if module is not None and v.get("pymodule") == "missing":
        return Check(plan.host, "program", Status.FAIL,
                     f"{_resolved(program, got)}: no module {module} {where}")
    extra = f", {script} exists" if script is not None else ""
    if module is not None and v.get("pymodule") == "ok":
        extra = f", module {module} found"
    resolved = got if got == program else f"{program} -> {got}"
    return Check(plan.host, "program", Status.OK, f"{resolved}{extra}")


def _resolved(program: str, got: str) -> str:
    """The program as the rank will run it: its path, once, when it was given as one."""
    return got if got == program else f"{program} (-> {got})"


def _platform_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    v = facts.values
    arch, libc_line = v.get("arch", ""), v.get("libc", "")
    kind, version = parse_libc(libc_line)
    ctl_kind, ctl_version = parse_libc(ctl.libc)
    here = f"{arch or '?'}, {kind}{(' ' + version) if version else ''}"
    mismatch = _platform_mismatch(plan, arch, kind, ctl, ctl_kind)
    if mismatch is not None:
        return mismatch
    if kind == "unknown" or not arch:
        return Check(plan.host, "platform", Status.WARN,
                     f"{here}: cannot tell the C library (ldd --version: "
                     f"{libc_line[:60] or 'no output'!r})")
    if (kind == ctl_kind == "glibc" and version and ctl_version
            and version_tuple(version) < version_tuple(ctl_version) and plan.prebuilt):
        return Check(plan.host, "platform", Status.WARN,
                     f"{here}, older than the controller's glibc {ctl_version}: the prebuilt "
                     "binary may need symbols this host lacks")
    return Check(plan.host, "platform", Status.OK, f"{here} (same as the controller)"
                 if (arch, kind, version) == (ctl.arch, ctl_kind, ctl_version) else here)


def _platform_mismatch(plan: HostPlan, arch: str, kind: str, ctl: ControllerFacts,
                       ctl_kind: str) -> Optional[Check]:
    """The FAIL row when what is built on the controller cannot run here, else None."""
    if ctl.arch and arch and arch != ctl.arch:
        return Check(plan.host, "platform", Status.FAIL,
                     f"{arch} here, {ctl.arch} on the controller: binaries and wheels built "
                     "there will not run here")
    if {kind, ctl_kind} == {"glibc", "musl"}:
        return Check(plan.host, "platform", Status.FAIL,
                     f"{kind} here, {ctl_kind} on the controller: native builds are not "
                     "interchangeable")
    return None


def _data_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Optional[Check]:
    path = plan.worker.data_path
    if path is None:
        return None
    state = facts.values.get("data", "")
    if state == "ok":
        return Check(plan.host, "data_path", Status.OK, f"{path} exists and is readable")
    what = {"missing": "does not exist", "unreadable": "is not readable by this user"}.get(
        state, "cannot be checked")
    return Check(plan.host, "data_path", Status.FAIL, f"data_path {path} {what}")


def _clock_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Optional[Check]:
    """The host's clock against ours, when the transport timed its line (not a local host)."""
    if facts.clock_ref is None:
        return None
    raw = facts.values.get("clock", "")
    try:
        remote = float(raw)
    except ValueError:
        return Check(plan.host, "clock", Status.WARN,
                     f"cannot read the clock (`date +%s.%N` printed {raw[:40]!r})")
    skew = remote - facts.clock_ref
    text = f"{skew:+.3f} s vs the controller (±{facts.clock_error:.3f} s)"
    if abs(skew) > SKEW_WARN_S:
        return Check(plan.host, "clock", Status.WARN,
                     f"{text}: > {SKEW_WARN_S:g} s skew scrambles cross-host logs and "
                     "deadlines; run NTP/chrony")
    return Check(plan.host, "clock", Status.OK, text)


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _port_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Optional[Check]:
    """Whether this host reaches the controller's port, as its ranks will dial it."""
    dial = plan.dial
    if dial is None:
        return None
    if facts.tunnel_error is not None:
        return _tunnel_failed_row(plan, facts, ctl)
    unreachable, only_join = _unreachable(plan)
    if dial.host in BIND_ALL and not dial.tunnel and not plan.worker.is_local:
        return Check(plan.host, "port", unreachable,
                     f"controller.host {dial.host} means \"every address\" to the coordinator, "
                     "but workers dial it too: set an address of the controller this host "
                     f"reaches, or tunnel: true{only_join}")
    return _dial_row(plan, facts.values.get("dial", ""))


#: Why an unreachable coordinator port only warns (docs/protocol.md, "Which path a rank takes").
ONLY_BY_HAND = (" (only a rank run by hand on this host dials it: the launcher's ranks reach "
                "the coordinator through their agent)")


def _unreachable(plan: HostPlan) -> tuple[Status, str]:
    """The status of an unreachable coordinator, and the words that explain it.

    The ranks the launcher starts reach the coordinator through their host's agent, on
    its session (issue 35); only a rank run by hand with the rank environment dials the
    port. So an unreachable port warns, in prebuild-check too: failing would stop runs
    that work."""
    return Status.WARN, ONLY_BY_HAND


def _dial_row(plan: HostPlan, got: str) -> Check:
    """The row of the agent's dial: ``ok`` (this controller answered with its key),
    ``!why`` (not reached), anything else (something else answers there)."""
    dial = plan.dial
    assert dial is not None
    unreachable, only_join = _unreachable(plan)
    target = f"{dial.host}:{dial.port}"
    note = (f" (tested on stand-in port {dial.listen_port}: {dial.configured_port} is busy on "
            "the controller)") if dial.stand_in else ""
    if got == AGENT_DIAL_OK:
        via = f" through the SSH tunnel to controller 127.0.0.1:{dial.listen_port}" \
            if dial.tunnel else ""
        return Check(plan.host, "port", Status.OK, f"reached the controller at {target}{via}{note}")
    if got.startswith("!") or not got:
        hint = ""
        if not dial.tunnel and not plan.worker.is_local and _is_loopback(dial.host):
            hint = ("; controller.host is a loopback address, which other machines cannot "
                    "dial: set controller.host to an address of the controller they reach, or "
                    "tunnel: true")
        return Check(plan.host, "port", unreachable, f"cannot reach the controller at {target}: "
                     f"{got[1:] or 'no answer'}{note}{hint}{only_join}")
    return Check(plan.host, "port", unreachable,
                 f"{target} answers, but it is not this controller (got {got[:60]!r}): "
                 f"controller.host {dial.host} points elsewhere from this host{note}{only_join}")


def _tunnel_failed_row(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    """The remote forward could not listen on the host: why, when the host says so (its
    loopback is the controller's own)."""
    assert plan.dial is not None
    reason = (f"tunnel: sshd could not listen on 127.0.0.1:{plan.dial.configured_port} here "
              f"({facts.tunnel_error})")
    if ctl.identity and facts.values.get("netns", "") == ctl.identity:
        reason += ("; this host shares the controller's machine and network namespace, so "
                   "its 127.0.0.1 port is the coordinator's own: use tunnel: false")
    else:
        reason += "; is something listening there already?"
    return Check(plan.host, "port", Status.FAIL, reason)


def _shell(plan: HostPlan, facts: HostFacts, ctl: ControllerFacts) -> Check:
    return _shell_row(plan, facts)


#: Every row, in display order: each says None where it does not apply (a fast
#: pre-flight, no ``local_devices``, no ``data_path``, a clock not timed...).
_ROWS: tuple[Row, ...] = (
    _full(_shell), _paths_row, _program_row, _full(_platform_row), _full(_stacks_row),
    _full(gpus_row), health_rows, _full(_data_row), _full(_clock_row), _port_row, _master_row,
    iface_row,
)
