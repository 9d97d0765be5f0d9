"""A rank program for the tests: reports what it received and does what it is told.

Usage: rankprobe.py [--dump DIR] [--sleep S] [--exit-rank R --exit-code C]
  [--fork] [--ignore-term] [--argv-file DIR]

- --dump DIR: write DIR/env-r<RANK>.json with its environment, argv and cwd.
- --exit-rank/--exit-code: that rank exits with that code after --exit-after s.
- --sleep: every other rank sleeps that long (it is stopped by the launcher).
- --fork: start a grandchild `sleep` in the same process group.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dump")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit-rank", type=int, default=-1)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--exit-after", type=float, default=0.5)
    p.add_argument("--fork", action="store_true")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--no-newline", action="store_true")
    p.add_argument("rest", nargs="*")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "-1"))
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        with open(os.path.join(a.dump, f"env-r{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(),
                       "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0)}, fh)
    child = None
    if a.fork:
        child = subprocess.Popen(["sleep", "300"])
        print(f"forked {child.pid}", flush=True)
    print(f"hello from rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    if a.no_newline:
        sys.stdout.write(f"tail of rank {rank}")
        sys.stdout.flush()
    if rank == a.exit_rank:
        time.sleep(a.exit_after)
        return a.exit_code
    time.sleep(a.sleep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
