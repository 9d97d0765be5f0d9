"""`fab -H host1,host2 cleanup`: ad hoc cleanup from the repo root, no cluster.yml.

Each host's registry (records written by fdl-fabric's rank wrappers) says
what to stop; nothing else is touched unless `--pattern` is given.
"""

from __future__ import annotations

from typing import Optional

from fabric import Connection, task

from fdl_fabric.cleanup import HostReport, adhoc_cleanup


@task(help={"run-id": "stop only this run", "pattern": "also `pkill -f` this regex"})
def cleanup(c: Connection, run_id: Optional[str] = None, pattern: Optional[str] = None) -> None:
    """Stop every fdl-fabric rank recorded on this host (or one run), then verify."""
    report: HostReport = adhoc_cleanup(c, run_id=run_id, pattern=pattern)
    print(f"cleanup: {report.summary()}")
    if not report.clean:
        raise SystemExit(1)
