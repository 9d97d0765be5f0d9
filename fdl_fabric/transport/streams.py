"""An agent the launcher did not start: its stream is a connection it made to us.

A kind whose agents dial in (`Transport.dials_in`: a worker behind NAT, a pod, a VM
that boots and joins) waits, bounded, in `Transport.start_agent` for its host's
connection, then hands it here. From then on the agent is like any other to the layers
above: frames down, frames up, and the leash is the same stream (end of input here is
end of input there, so the agent stops its ranks exactly as when its SSH session ends).

What such a stream cannot give is an exit status: the process is not ours. `exit_status`
is None, and the loss is said as the connection's (`lost_reason`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Optional

from .base import AgentProcess, ByteSink

#: Bytes read from the connection at a time.
READ_CHUNK = 65536


class SocketAgentProcess(AgentProcess):
    """An agent at the other end of a connected socket: one reader thread feeds its bytes
    to ``stdout``; its stderr stays on its own host (``stderr`` gets only the close)."""

    lost_reason = "the agent's connection was closed"

    def __init__(self, sock: socket.socket, stdout: ByteSink, stderr: ByteSink) -> None:
        self.sock = sock
        self._write_lock = threading.Lock()
        self._stdout = stdout
        self._stderr = stderr
        self._reader = threading.Thread(target=self._read, name="dial-in agent",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                try:
                    data = self.sock.recv(READ_CHUNK)
                except OSError:
                    break
                if not data:
                    break
                self._stdout.feed(data)
        finally:
            self._stdout.close()
            self._stderr.close()

    def write(self, data: bytes) -> None:
        with self._write_lock:
            self.sock.sendall(data)

    def close_input(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        """Cut the connection: the agent reads end of input, which is its leash."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()

    def exit_status(self, timeout: float) -> Optional[int]:
        self.join(timeout)
        return None

    def join(self, timeout: Optional[float] = None) -> None:
        if threading.current_thread() is not self._reader:  # asked from its own close
            self._reader.join(timeout)
