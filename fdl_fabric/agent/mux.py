"""The relay's mux: the framing a gateway's relay (`relay`) and the launcher
(`fdl_fabric.transport.gateway`) speak over the relay's stdin and stdout
(docs/protocol.md, "Relay").

A frame is a length, a type byte and a body, like the agent's (`wire`); a frame
addressed to a leaf begins with the leaf's id. Standard library only, like the rest of
the agent, so both ends import it: the launcher, and the relay shipped to a gateway.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from fdl_fabric.agent import wire

#: Version of the mux protocol, carried by the handshake.
VERSION = 1
#: What the relay writes first (after any login-shell noise); the NULs never match text.
HANDSHAKE_PREFIX = b"\x00\x00FDL-RELAY/"
HANDSHAKE = HANDSHAKE_PREFIX + str(VERSION).encode() + b"\n"
#: Largest mux frame (type + body) in either direction: an agent payload or an agent
#: frame fits with room to spare.
MAX_FRAME = 2 * wire.MAX_FRAME
#: What the launcher puts in one DATA frame at most.
DATA_CHUNK = 1024 * 1024

# -- frame types, launcher -> relay ----------------------------------------------------------
OPEN = 1  #: leaf u32 | {"argv": [...]}: spawn the leaf's ssh with pipes
DATA = 2  #: leaf u32 | bytes: to the leaf's stdin
EOF = 3  #: leaf u32: close the leaf's stdin once what came before it is written (the leash)
KILL = 4  #: leaf u32: SIGKILL the leaf's ssh (and its process group)
BLOB = 5  #: bytes: the agent payload, kept for PAYLOAD (sent once per relay)
PAYLOAD = 6  #: leaf u32: write the kept payload to the leaf's stdin
#: leaf u32 | {"root", "need": [entry, ...]}: feed the leaf a sync's objects (entries of
#: the kept manifest) from this host's store at root (`fdl_fabric.agent.feeder`)
SERVE = 7
KEEP = 8  #: bytes: an agent frame many leaves get the same (a sync's manifest), kept
REPLAY = 9  #: leaf u32: write the kept agent frame to the leaf's stdin

# -- frame types, relay -> launcher ----------------------------------------------------------
HELLO = 64  #: {"version", "pid", "python"}: the relay runs
BATCH = 65  #: entries, each leaf u32 | stream u8 (1 stdout, 2 stderr) | length u32 | bytes
CLOSED = 66  #: leaf u32 | {"code": int|null, "signal": int|null, "error": str}
ERROR = 67  #: {"message"}: what the relay has to say before it exits (a protocol error)

DOWN_TYPES: FrozenSet[int] = frozenset({OPEN, DATA, EOF, KILL, BLOB, PAYLOAD, SERVE, KEEP,
                                        REPLAY})
UP_TYPES: FrozenSet[int] = frozenset({HELLO, BATCH, CLOSED, ERROR})

STDOUT = 1
STDERR = 2

#: Seconds a leaf's bytes may wait to be batched with the others'.
BATCH_INTERVAL = 0.05

_LENGTH = struct.Struct(">I")
_LEAF = struct.Struct(">I")
_ENTRY = struct.Struct(">IBI")
#: Bytes of a BATCH entry's head (leaf, stream, length).
ENTRY_HEAD = _ENTRY.size


class MuxError(Exception):
    """The peer broke the mux protocol."""


# -- framing (both ends) -----------------------------------------------------------------------
def frame(kind: int, body: bytes = b"") -> bytes:
    size = len(body) + 1
    if size > MAX_FRAME:
        raise MuxError(f"mux frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LENGTH.pack(size) + bytes((kind,)) + body


def leaf_frame(kind: int, leaf: int, body: bytes = b"") -> bytes:
    return frame(kind, _LEAF.pack(leaf) + body)


def json_body(obj: Dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def open_frame(leaf: int, argv: List[str]) -> bytes:
    return leaf_frame(OPEN, leaf, json_body({"argv": list(argv)}))


def data_frames(leaf: int, data: bytes) -> List[bytes]:
    """DATA frames for ``data``, at most `DATA_CHUNK` bytes each."""
    view = memoryview(data)
    return [leaf_frame(DATA, leaf, bytes(view[i:i + DATA_CHUNK]))
            for i in range(0, len(data), DATA_CHUNK)]


def closed_frame(leaf: int, code: Optional[int], sig: Optional[int], error: str = "") -> bytes:
    return leaf_frame(CLOSED, leaf, json_body({"code": code, "signal": sig, "error": error}))


def batch_frame(entries: List[Tuple[int, int, bytes]]) -> bytes:
    parts = []
    for leaf, stream, data in entries:
        parts.append(_ENTRY.pack(leaf, stream, len(data)))
        parts.append(data)
    return frame(BATCH, b"".join(parts))


def parse_leaf(body: bytes) -> Tuple[int, bytes]:
    """(leaf, the rest) of a frame addressed to a leaf."""
    if len(body) < _LEAF.size:
        raise MuxError("frame too short for a leaf id")
    return _LEAF.unpack_from(body)[0], body[_LEAF.size:]


def parse_batch(body: bytes) -> List[Tuple[int, int, bytes]]:
    """The (leaf, stream, bytes) entries of a BATCH body, in order."""
    out: List[Tuple[int, int, bytes]] = []
    at, end = 0, len(body)
    while at < end:
        if end - at < _ENTRY.size:
            raise MuxError("batch entry cut short")
        leaf, stream, size = _ENTRY.unpack_from(body, at)
        at += _ENTRY.size
        if stream not in (STDOUT, STDERR) or at + size > end:
            raise MuxError(f"bad batch entry (stream {stream}, {size} bytes)")
        out.append((leaf, stream, body[at:at + size]))
        at += size
    return out


def parse_json(body: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise MuxError("frame body is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise MuxError("frame body is not a JSON object")
    return obj


class Reader(wire.Reader):
    """Mux frames from a byte stream, with `wire.Reader`'s rules and limits. With
    ``handshake`` (the launcher's side), bytes before `HANDSHAKE` are noise, up to
    `wire.MAX_NOISE`, kept in ``noise``."""

    ERROR = MuxError
    PREFIX = HANDSHAKE_PREFIX
    LINE = HANDSHAKE
    LIMIT = MAX_FRAME
    WHAT = "relay handshake"
    SPEAKS = "relay speaks mux"
