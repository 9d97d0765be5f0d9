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

Why one script per host: a check must not cost a round trip each, or checking
64 hosts over a slow link takes minutes. Every host runs one POSIX ``sh``
script that prints ``__FDL_CHECK__ name=value`` sentinel lines; the verdicts
are computed here, on the controller, from those values (so they are unit
tested without any host). Sentinels are found anywhere in a line, so a noisy
rc file that prints banners cannot hide them. Two measurements cannot live in
the script and cost one short round trip each: the shell start-up time (a
``true`` run, which is what every rank start pays) and the network round trip
that bounds the clock-skew estimate.

The package, one concern per module: `report` (the rows), `probe` (what is asked of a
host and how its answer is read), `verdicts` (what the answers mean), `run` (asking every
host), `launch` (the fast subset a launch's agents gather), `command` (the
prebuild-check command).
"""

from .command import check_cluster, main
from .launch import agent_checks, judge, launch_plan
from .probe import SENTINEL, Dial, HostPlan, parse_libc, parse_sentinels, probe_script
from .report import CONTROLLER, Check, Report, Status
from .run import run_checks
from .verdicts import ControllerFacts, HostFacts, evaluate

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
