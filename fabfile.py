"""`fab -H host1,host2 cleanup`: ad hoc cleanup from the repo root, no cluster.yml.

Each host's registry (records written by fdl-fabric's rank wrappers) says
what to stop; nothing else is touched unless `--pattern` is given.

fab calls a task once per host, in order, and stops at the first host that
raises. A cleanup must reach every host whatever happens on one of them, so
the first call sweeps all the hosts given with -H at once (in parallel), and
the later calls have nothing left to do.
"""

from __future__ import annotations

import sys
from typing import Optional

from fabric import Connection, task

from fdl_fabric.commands.cleanup import adhoc_cleanup_hosts

_done = False


def _hosts_from_argv(argv: list[str]) -> list[str]:
    hosts: list[str] = []
    for i, word in enumerate(argv):
        if word in ("-H", "--hosts") and i + 1 < len(argv):
            hosts += argv[i + 1].split(",")
        elif word.startswith("--hosts="):
            hosts += word.split("=", 1)[1].split(",")
        elif word.startswith("-H") and len(word) > 2:
            hosts += word[2:].split(",")
    return [h for h in hosts if h]


@task(help={"run-id": "stop only this run (even if its launcher is alive)",
            "pattern": "also `pkill -f` this regex",
            "force": "also stop runs whose launcher is alive (otherwise left alone)"})
def cleanup(c: Connection, run_id: Optional[str] = None, pattern: Optional[str] = None,
            force: bool = False) -> None:
    """Stop every fdl-fabric run on the hosts whose launcher is gone (or one run), then
    verify. Live runs are left alone, and said so."""
    global _done
    if _done:
        return
    _done = True
    hosts = _hosts_from_argv(sys.argv) or [c.original_host]
    conns = [c if h == c.original_host else Connection(h, config=c.config.clone()) for h in hosts]
    code = adhoc_cleanup_hosts(conns, run_id=run_id, pattern=pattern, force=force)
    if code:
        raise SystemExit(code)
