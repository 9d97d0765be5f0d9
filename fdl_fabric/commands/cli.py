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


def main(argv: Optional[list[str]] = None) -> None:
    """``fdl-fabric run ...`` is torchrun's command line; everything else is a task."""
    args = list(sys.argv if argv is None else argv)
    if len(args) > 1 and args[1] == "run":
        from .run import main as run_main

        sys.exit(run_main(args[2:]))
    program().run(args)
