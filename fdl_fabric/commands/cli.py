"""The ``fdl-fabric`` console script: an invoke Program over the task collection, plus
``fdl-fabric run``, the torchrun drop-in, which takes torchrun's command line as is.
"""

from __future__ import annotations

import sys
from typing import Optional

from invoke.exceptions import Exit, ParseError
from invoke.program import Program

from .. import __version__


class FdlProgram(Program):
    """invoke's Program, with usage errors exiting 2 instead of 1."""

    def parse_core(self, argv: Optional[list[str]]) -> None:
        try:
            super().parse_core(argv)
        except ParseError as exc:
            raise Exit(str(exc), code=2) from None

    def parse_tasks(self) -> None:
        try:
            super().parse_tasks()
        except ParseError as exc:
            raise Exit(str(exc), code=2) from None


def program() -> FdlProgram:
    from ..tasks import ns

    return FdlProgram(namespace=ns, version=__version__, name="fdl-fabric", binary="fdl-fabric")


#: The commands, in the order help lists them.
COMMANDS = ("run", "launch", "cleanup", "prebuild-check", "stacks", "status", "plot-run")

#: ``fdl-fabric --help``: the commands, one line each (invoke's core options are no
#: business of a user of this tool; ``fdl-fabric COMMAND --help`` details each).
HELP = f"""\
usage: fdl-fabric COMMAND [options]     (fdl-fabric {__version__})

Launch and supervise multi-host training jobs over SSH or Slurm.

commands:
  run             torchrun's command line: fdl-fabric run --nproc-per-node 2 train.py
  launch          launch the job of a cluster file (or --hosts) and supervise it to a verdict
  cleanup         stop leftover ranks on every host, then verify none remains
  prebuild-check  check every host before launching: ssh, paths, program, GPUs, port
  stacks          show where each rank of a live run is (Python stacks), untouched
  status          list the live runs on the hosts: run id, launcher, uptime, ranks
  plot-run        draw a run's timeline from its events.jsonl

fdl-fabric COMMAND --help shows a command's options. Exit codes: 0 ok, 1 the run or a
host failed, 2 bad input (nothing started), 128+N interrupted by signal N.
Shell completion: eval "$(fdl-fabric --completion bash)" (or zsh).
"""


def main(argv: Optional[list[str]] = None) -> None:
    """``fdl-fabric run ...`` is torchrun's command line; everything else is a task."""
    args = list(sys.argv if argv is None else argv)
    rest = args[1:]
    if rest in (["-h"], ["--help"], ["help"]):
        sys.stdout.write(HELP)
        sys.exit(0)
    if not rest:
        sys.stderr.write(HELP)
        sys.exit(2)
    if rest[0] == "--completion":
        from .completion import SHELLS, script

        if len(rest) != 2 or rest[1] not in SHELLS:
            sys.stderr.write(f"fdl-fabric: --completion: expected one of "
                             f"{', '.join(SHELLS)}\n")
            sys.exit(2)
        sys.stdout.write(script(rest[1]))
        sys.exit(0)
    if rest in (["--help", "run"], ["-h", "run"], ["help", "run"]):
        rest = ["run", "--help"]
    if rest[0] == "help" and len(rest) == 2:
        rest = ["--help", rest[1]]
    if rest[0] == "run":
        from .run import main as run_main

        sys.exit(run_main(rest[1:]))
    program().run([args[0], *rest])
