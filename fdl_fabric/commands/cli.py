"""The ``fdl-fabric`` console script: an invoke Program over the task collection, plus
``fdl-fabric run``, the torchrun drop-in, which takes torchrun's command line as is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Container, Sequence
from typing import Optional

from invoke.exceptions import Exit, ParseError
from invoke.parser.argument import Argument
from invoke.parser.context import ParserContext
from invoke.program import Program

from .. import __version__
from ..errors import EXIT_USAGE, FdlError
from . import prestart
from .usage import usage_line as usage_line
from .vocabulary import COMMANDS as COMMANDS
from .vocabulary import write_page

#: invoke's core flags that mean something to ``fdl-fabric``; the others (``--echo``,
#: ``--dry``, ``--list``, ``-T``, ...) drive invoke's own runner and listing, nothing of
#: ours, and are refused as the unknown flags they are to a user of this tool.
CORE_FLAGS = frozenset({"help", "version"})


class FdlProgram(Program):
    """invoke's Program, with every usage error one line naming the flag, exit 2."""

    def core_args(self) -> list[Argument]:
        args: list[Argument] = super().core_args()
        for arg in args:  # refused as given, not cast first (`-T abc` was int()'s traceback)
            if arg.name not in CORE_FLAGS and arg.kind is int:
                arg.kind = str
        return args

    def parse_core_args(self) -> None:
        super().parse_core_args()
        self._refuse_core_flags(self.core[0], CORE_FLAGS, None)

    def parse_core(self, argv: Optional[list[str]]) -> None:
        try:
            super().parse_core(argv)
        except ParseError as exc:
            raise Exit(usage_line(exc, self.argv), code=EXIT_USAGE) from None

    def parse_tasks(self) -> None:
        try:
            super().parse_tasks()
        except (ParseError, Exit) as exc:
            # An Exit: the tasks' own wrapper (`tasks._usage_errors_exit_2`) said it first.
            error = exc if isinstance(exc, ParseError) else exc.__context__
            if not isinstance(error, ParseError):
                raise
            said = _given_twice(error.context, self.argv) or _flag_taken_for_positional(
                error.context) or usage_line(error, self.argv)
            raise Exit(said, code=EXIT_USAGE) from None
        task = self.tasks[0].name if self.tasks else None
        if len(self.tasks) > 1:  # invoke runs `a b` as two tasks; this tool is one command
            raise Exit(f"{self.tasks[1].name}: a second command after {task}; fdl-fabric runs "
                       "one command at a time", code=EXIT_USAGE)
        self._refuse_core_flags(self.core_via_tasks, {"help"}, task,
                                taken={*self.tasks[0].flags, *self.tasks[0].flags.aliases}
                                if self.tasks else set())
        twice = _given_twice(self.tasks[0], self.argv) if self.tasks else None
        if twice:
            raise Exit(twice, code=EXIT_USAGE)

    def execute(self) -> None:
        try:
            super().execute()
        except FdlError as exc:  # a bad value a task checked outside its own catch
            raise Exit(str(exc), code=exc.exit_code) from None

    def _refuse_core_flags(self, context: ParserContext, allowed: Container[str],
                           task: Optional[str], taken: Container[str] = ()) -> None:
        for arg in context.args.values():
            if arg.got_value and arg.name not in allowed:
                where = f"fdl-fabric {task}" if task else "fdl-fabric"
                raise Exit(f"{_typed(arg, self.argv, taken)}: no such flag ({where} --help "
                           "lists the flags)", code=EXIT_USAGE)


def _given_twice(context: Optional[ParserContext], argv: Sequence[str]) -> Optional[str]:
    """A flag with a value given twice: invoke keeps the first value and then takes the
    second for a stray word, or, with no second value, says nothing at all."""
    if context is None or not context.name:
        return None
    words = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    for long, arg in context.flags.items():
        if not arg.takes_value or arg.optional:
            continue
        spellings = {long, *(a for a, to in context.flags.aliases.items() if to == long)}
        given = [w for w in words if w.split("=", 1)[0] in spellings]
        if len(given) > 1:
            return f"{long}: given {len(given)} times; give it once"
    return None


def _flag_taken_for_positional(context: Optional[ParserContext]) -> Optional[str]:
    """invoke fills a missing positional (plot-run's RUN_DIR) with the next word, an unknown
    flag too, and then stumbles on the real one: name the flag, not the folder."""
    if context is None:
        return None
    for arg in context.positional_args:
        value = arg.value
        if isinstance(value, str) and value.startswith("-") and value not in ("-h", "--help"):
            return f"{value}: no such flag (fdl-fabric {context.name} --help lists the flags)"
    return None


def _typed(arg: Argument, argv: Sequence[str], taken: Container[str] = ()) -> str:
    """The flag as the user wrote it (``-l`` or ``--list``), for one invoke Argument; not
    a spelling the task has for a flag of its own (``launch -d`` is its dry run)."""
    spellings = {s for s in (f"-{n}" if len(n) == 1 else f"--{n}" for n in arg.names)
                 if s not in taken}
    for word in argv[1:]:
        if word.split("=", 1)[0] in spellings:
            return word.split("=", 1)[0]
    return f"--{arg.name}"


def program() -> FdlProgram:
    from ..tasks import ns

    return FdlProgram(namespace=ns, version=__version__, name="fdl-fabric", binary="fdl-fabric")


#: ``fdl-fabric --help``: the commands, one line each (invoke's core options are no
#: business of a user of this tool; ``fdl-fabric COMMAND --help`` details each).
HELP = f"""\
usage: fdl-fabric COMMAND [options]     (fdl-fabric {__version__})

Launch and supervise multi-host training jobs over SSH or Slurm.

commands:
  run             torchrun's command line: fdl-fabric run --nproc-per-node 2 train.py
  launch          launch the job of a cluster file (or --hosts) and supervise it to a verdict
  attach          follow a run of this machine live (Ctrl-C leaves it running)
  logs            print a run's output; -f follows it to its verdict
  stop            stop a run: TERM to every rank, KILL after the kill grace
  wait            wait for a run to end; exit with its exit code
  cleanup         stop leftover ranks on every host, then verify none remains
  prebuild-check  check every host before launching: ssh, paths, program, GPUs, port
  stacks          show where each rank of a live run is (Python stacks), untouched
  status          this machine's runs, then the live runs on the hosts
  plot-run        draw a run's timeline from its events.jsonl

--detach on run or launch: the run outlives this terminal (docs/long-runs.md).
fdl-fabric COMMAND --help shows a command's options. Exit codes: 0 ok, 1 the run or a
host failed, 2 bad input (nothing started), 128+N interrupted by signal N.
Shell completion: eval "$(fdl-fabric --completion bash)" (or zsh).
"""


def main(argv: Optional[list[str]] = None) -> None:
    """``fdl-fabric run ...`` is torchrun's command line; everything else is a task."""
    args = list(sys.argv if argv is None else argv)
    rest = args[1:]
    if prestart.asked(rest):
        prestart.prestart()  # its imports beside ours (`prestart`)
    try:
        _main(args, rest)
        code = 0
    except SystemExit as exc:
        if not prestart.Started.handed_over:
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if prestart.Started.handed_over:
        # Detached: the run is its supervisor's; nothing here is left to tear down, and
        # the interpreter's own teardown would only hold the prompt back.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(args: list[str], rest: list[str]) -> None:
    if rest in (["-h"], ["--help"], ["help"]):
        write_page(HELP)
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
