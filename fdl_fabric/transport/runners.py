"""invoke and Fabric runners that hand raw bytes to a sink instead of decoding them.

An agent's stdout is a binary protocol, so invoke's usual output path (decode every
1000-byte chunk, keep all of it in memory for watchers, write it to a text stream)
is wrong for it twice over. These runners read 64 KiB at a time and pass the bytes
on, keeping nothing. Everything else (how a local process or an SSH session is
started, its exit status) is invoke's and Fabric's own.
"""

from __future__ import annotations

from typing import IO, Any, Callable, Protocol

from invoke.runners import Local


class ByteSink(Protocol):
    """Where a runner's output goes: every chunk, then one close at end of stream."""

    def feed(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class RawOutput:
    read_chunk_size = 64 * 1024

    def _handle_output(
        self, buffer_: list[str], hide: bool, output: IO[Any], reader: Callable[[int], bytes]
    ) -> None:
        sink: ByteSink = output  # type: ignore[assignment]
        try:
            while True:
                data = reader(self.read_chunk_size)
                if not data:
                    break
                sink.feed(data)
        finally:
            sink.close()


class RawLocal(RawOutput, Local):  # type: ignore[misc]
    """A local process whose stdout and stderr go to `ByteSink`s.

    Its remote twin, `fdl_fabric.transport.ssh.RawRemote`, lives with the other Fabric classes, so
    that a launch with only local workers never imports Fabric's SSH stack.
    """
