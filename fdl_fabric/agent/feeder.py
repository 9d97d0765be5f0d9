"""A gateway's relay serving a sync to its leaves from the gateway's own store.

The launcher sends each gateway one copy of the code (to the gateway's agent, which
puts it in its store); then, for each leaf, one ``SERVE`` naming the objects that leaf
lacks and where they lie in that store. The relay reads them as the leaf's ssh takes its
stdin (`FEED_LOW`: never more than that waits), as the same SYNC_DATA frames the
launcher would have sent, so a leaf's agent cannot tell who sent them.

The relay's other writes to a leaf (the launcher's DATA: pings, stops) are whole agent
frames that may arrive in several DATA pieces; `FrameCut` follows them so the feeder only
slips its frames in between two of them. Standard library only: it runs in the relay.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, List, Optional, Tuple

from fdl_fabric.agent import wire
from fdl_fabric.agent.codestore import DATA_HEAD, LAST, object_name

#: Below this many bytes waiting for a leaf, the feeder adds its next frame.
FEED_LOW = 1024 * 1024
#: Bytes of an object in one frame, as the launcher sends them.
CHUNK = 256 * 1024

_LENGTH = struct.Struct(">I")


class FrameCut:
    """Where the launcher's agent frames end in the bytes written to one leaf."""

    def __init__(self) -> None:
        self.left = 0
        self.head = b""

    def advance(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.left:
                take = min(self.left, n - i)
                self.left -= take
                i += take
                continue
            need = _LENGTH.size - len(self.head)
            self.head += data[i:i + need]
            i += need
            if len(self.head) == _LENGTH.size:
                (self.left,) = _LENGTH.unpack(self.head)
                self.head = b""

    @property
    def between(self) -> bool:
        """No frame of the launcher's is half written."""
        return not self.left and not self.head


def objects_of(manifest_frame: Optional[bytes], root: str,
               need: List[int]) -> List[Tuple[int, str]]:
    """Where each needed entry's object lies in the store at ``root``, read from the kept
    manifest frame (the one the launcher sent every leaf): SERVE names only indices."""
    if manifest_frame is None:
        raise ValueError("SERVE before the manifest was kept")
    entries = wire.parse_json(manifest_frame[_LENGTH.size + 1:])["entries"]
    found = []
    for index in need:
        entry = entries[index]
        found.append((index, os.path.join(root, "objects",
                                          object_name(str(entry[4]), int(entry[2])))))
    return found


class Feeder:
    """The objects one leaf lacks, read from the gateway's store a frame at a time."""

    def __init__(self, items: List[Tuple[int, str]]) -> None:
        self.items = list(reversed(items))
        self.current: Optional[Tuple[int, BinaryIO, int]] = None

    @property
    def done(self) -> bool:
        return not self.items and self.current is None

    def next_frame(self) -> bytes:
        """The next SYNC_DATA frame. An object that cannot be read goes as an empty last
        piece: the leaf's hash check then refuses it, naming the file."""
        if self.current is None:
            index, path = self.items.pop()
            try:
                f: BinaryIO = open(path, "rb")  # noqa: SIM115 - read across frames
                size = os.fstat(f.fileno()).st_size
            except OSError:
                return wire.frame(wire.SYNC_DATA, DATA_HEAD.pack(index, LAST))
            self.current = (index, f, size)
        index, f, left = self.current
        try:
            chunk = f.read(min(CHUNK, left)) if left > 0 else b""
        except OSError:
            chunk = b""
        left -= len(chunk)
        last = left <= 0 or not chunk
        if last:
            f.close()
            self.current = None
        else:
            self.current = (index, f, left)
        return wire.frame(wire.SYNC_DATA, DATA_HEAD.pack(index, LAST if last else 0) + chunk)
