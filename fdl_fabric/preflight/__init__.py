"""Pre-flight checks: find every misconfiguration before a single rank starts.

A launch that fails half-way costs more than the failure itself: some ranks
already started (and must be stopped), GPUs were grabbed, logs are noisy and
the one line that matters ("path does not exist on gpu-b") is buried. So
``inv prebuild-check`` asks every host, in parallel, everything the launch
will rely on (SSH and host keys, shell tools, paths, the program, platform,
GPUs, the data folder, the clock and the controller port) and answers with one
table: one row per host and check, ``ok`` / ``warn`` / ``FAIL`` and a one-line
reason. ``inv launch`` has each host's agent gather the cheap subset (paths, program,
the controller dial) before any rank starts (`launch`).

Each fact about a host is gathered once, by the host's agent (`fdl_fabric.agent.checks`):
prebuild-check starts one on every host and asks it what a launch's agents are asked
(`agents`), so both pre-flights judge the same values with the same `verdicts` (unit
tested without any host). Around the agent, each host's transport runs one short POSIX
``sh`` probe for what only it can measure: how the host was reached (the ``ssh`` row), the
shell's start-up time (a ``true`` run, which every rank start pays), the clock against a
network round trip, and the Python an agent would start under (`probe`).

The package, one concern per module: `report` (the rows), `probe` (what is asked of a
host: the agent's checks and the sh probe), `agents` (asking hosts' agents, and the
controller's end of the port check), `verdicts` (what the answers mean), `run` (asking
every host), `launch` (the fast subset a launch's agents gather), `command` (the
prebuild-check command), `fleet` and `versions` (the versions across hosts).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .command import check_cluster, main
    from .facts import ControllerFacts, HostFacts
    from .launch import agent_checks, judge, launch_plan
    from .probe import SENTINEL, Dial, HostPlan, parse_libc, parse_sentinels, probe_script
    from .report import CONTROLLER, Check, Report, Status
    from .run import run_checks
    from .verdicts import evaluate

#: Where each name of the package lives: imported when first asked for (PEP 562), so a
#: launch, which needs `launch`, `fleet` and `fleetcheck`, never loads the command's
#: modules (`command`, `run`: 10 ms of every launch's start).
_HOME = {
    "check_cluster": "command", "main": "command",
    "ControllerFacts": "facts", "HostFacts": "facts",
    "agent_checks": "launch", "judge": "launch", "launch_plan": "launch",
    "SENTINEL": "probe", "Dial": "probe", "HostPlan": "probe", "parse_libc": "probe",
    "parse_sentinels": "probe", "probe_script": "probe",
    "CONTROLLER": "report", "Check": "report", "Report": "report", "Status": "report",
    "run_checks": "run",
    "evaluate": "verdicts",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CONTROLLER",
    "SENTINEL",
    "Check",
    "ControllerFacts",
    "Dial",
    "HostFacts",
    "HostPlan",
    "Report",
    "Status",
    "agent_checks",
    "check_cluster",
    "evaluate",
    "judge",
    "launch_plan",
    "main",
    "parse_libc",
    "parse_sentinels",
    "probe_script",
    "run_checks",
]
