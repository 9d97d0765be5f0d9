#!/usr/bin/env python3
"""What-if runs for bench/detach.py (issue 30): fdl-fabric's own command line, with one
proposed change applied in this process only, to measure what the change would buy
before anyone makes it. Nothing in the package is edited; the bench labels every such
row "what-if" and never counts it against a target.

``python3 bench/detach_whatif.py MODE -- <fdl-fabric args>``, MODE one of:

* ``exit``: the command as it is, then ``os._exit`` once stdout and stderr are flushed:
  no interpreter teardown (the front of ``--detach`` spends ~100 ms of CPU in the
  final garbage collection of everything the launcher imported, after its last line).
* ``early``: ``exit``, and the detached supervisor started first thing, before this
  process imports the command line (invoke, paramiko, the launcher), so both
  interpreters import at once; `fdl_fabric.commands.detach.detach` is then handed that
  process instead of starting one (its ready pipe and its stdin, as it would have made
  them). A refusal before ``detach`` closes the supervisor's stdin: it ends at once.
* ``poll=S``: ``exit``, with `fdl_fabric.runs.reading.follow` polling every S seconds
  instead of its 50 ms (``logs -f`` and ``attach``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _once(owner: Any, name: str, value: Any) -> None:
    """``owner.name()`` returns ``value`` once, then is itself again."""
    real = getattr(owner, name)

    def stub(*_args: Any, **_kwargs: Any) -> Any:
        setattr(owner, name, real)
        return value

    setattr(owner, name, stub)


def main(argv: list[str]) -> None:
    # bench/ off the path: its profile.py shadows the standard library's
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    mode, words = argv[0], argv[argv.index("--") + 1:]
    pre = None
    if mode == "early":
        ready_r, ready_w = os.pipe()
        env = dict(os.environ, FDL_FABRIC_READY_FD=str(ready_w))
        pre = subprocess.Popen([sys.executable, "-m", "fdl_fabric.commands.supervise"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, pass_fds=(ready_w,),
                               start_new_session=True, env=env)
        from fdl_fabric.commands import detach

        real_detach = detach.detach

        def early_detach(opts: Any) -> Any:
            _once(os, "pipe", (ready_r, ready_w))
            _once(subprocess, "Popen", pre)
            return real_detach(opts)

        detach.detach = early_detach  # type: ignore[assignment]
    elif mode.startswith("poll="):
        from fdl_fabric.runs import reading

        assert reading.follow.__kwdefaults__ is not None
        reading.follow.__kwdefaults__["poll"] = float(mode[5:])
    from fdl_fabric.commands.cli import main as cli

    sys.argv = ["fdl-fabric", *words]  # a launch reads ``-- PROG ARGS`` from sys.argv
    code = 0
    try:
        cli(sys.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
