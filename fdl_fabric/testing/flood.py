"""The flooder of issue 22: idle TCP connections to a port, as fast as it can, the last
``hold`` kept open. One source for the flood lab test and the flood benchmark.

Run it as ``python3 -I -S -c FLOODER HOST PORT HOLD THREADS``: standard library only, so
any user's interpreter can run it; it prints ``flooding`` once it started, and on
SIGTERM how many connections it opened (JSON), then exits.
"""

from __future__ import annotations

#: How many connections the flooder holds (it closes the oldest past this).
HOLD = 300

FLOODER = r"""
import collections, json, signal, socket, sys, threading
host, port, hold, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
counts = {"connected": 0, "failed": 0}
def report(*_):
    sys.stdout.write(json.dumps(counts) + "\n")
    sys.stdout.flush()
    raise SystemExit(0)
def flood():
    held = collections.deque()
    while True:
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            counts["failed"] += 1
            continue
        counts["connected"] += 1
        held.append(s)
        if len(held) > hold // threads:
            held.popleft().close()
signal.signal(signal.SIGTERM, report)
for _ in range(threads):
    threading.Thread(target=flood, daemon=True).start()
sys.stdout.write("flooding\n")
sys.stdout.flush()
signal.pause()
"""
