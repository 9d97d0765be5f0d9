"""A worker host that dials in (tests/test_launch_fake.py): nobody starts its agent.

It dials the launcher's rendezvous port until it answers (bounded), says its host name,
then runs the agent of the fdl-fabric installed here with the connection as its stdin
and stdout, and exits with the agent's status. The end of the connection is the agent's
leash, as an SSH session's end is.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

port, host = int(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 30
while True:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("dial-in worker: the launcher never answered")
        time.sleep(0.1)
sock.settimeout(None)
sock.sendall(f"{host}\n".encode())
agent = subprocess.run([sys.executable, "-m", "fdl_fabric.agent.main"],
                       stdin=sock.fileno(), stdout=sock.fileno(), check=False)
sys.exit(agent.returncode)
