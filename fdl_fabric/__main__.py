"""The ``fdl-fabric`` console script, and ``python -m fdl_fabric``.

Standard library only until it knows the command line: the supervisor of a
``--detach`` is started before the command's own imports (`commands.prestart`), then
the program runs (`commands.cli`). This is the top of the import graph: nothing imports
it, so the program may import anything below.
"""

from __future__ import annotations

import sys


def main() -> None:
    """Start a ``--detach``'s supervisor early when one is asked for, then the command."""
    from .commands import prestart

    if prestart.asked(sys.argv[1:]):
        prestart.prestart()
    from .commands.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
