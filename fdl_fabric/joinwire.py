"""The join handshake: how a worker that dials in (`fdl-fabric join`) and the launcher's
join window prove to each other that they hold the run's token, over TLS.

Shared by both ends, so it imports nothing of ours but the layer-0 vocabulary.

**Why TLS with a proof, and not the token as a password.** The launcher makes a fresh,
self-signed certificate for each window (`transport.joinport`); nobody can check it
against an authority, so TLS alone would only encrypt. Each side then proves it holds
the token by an HMAC over both sides' nonces *and the hash of the certificate this
connection was made with* (channel binding, as SCRAM-SHA-256-PLUS does with
``tls-server-end-point``). A man in the middle has to present a certificate of its own;
the launcher's proof covers the launcher's certificate, so the joiner sees the mismatch
and refuses before it sends anything secret. The token itself never crosses the wire,
and the launcher proves itself first: a joiner dialling a wrong address gives nothing
away but a nonce.

**Messages** before the agent starts are JSON objects, each behind a 4-byte big-endian
length (at most `MESSAGE_MAX` bytes): ``{"nonce"}`` (joiner), ``{"nonce", "proof"}``
(launcher), ``{"proof", "hello"}`` (joiner), then ``{"accept"}`` or ``{"refuse",
"permanent"}``, then, once the world forms, ``{"start"}`` (the joiner starts its agent and
the connection carries the agent's frames from then on) or ``{"abort"}``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import struct
from typing import Any, Callable, Mapping

#: The environment variable a joiner may read its token from (never argv: ``ps`` shows it).
ENV_TOKEN = "FDL_FABRIC_TOKEN"
#: The first bytes a joiner sends inside TLS: which protocol, which version.
MAGIC = b"FDLJOIN1"
#: Bytes of a token made by the launcher; a token file holds it as hex.
TOKEN_BYTES = 32
#: The fewest bytes a token may have (32 hex characters): shorter ones can be guessed.
TOKEN_MIN_BYTES = 16
#: The largest message of the handshake: a hello is a few hundred bytes.
MESSAGE_MAX = 64 * 1024
#: Bytes of each side's nonce.
NONCE_BYTES = 32
_LENGTH = struct.Struct(">I")


class JoinError(Exception):
    """A handshake that cannot go on; ``permanent``: dialling again will not help (a wrong
    token, a spec refused), the `--persist` loop stops (exit 2)."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


# -- the token -------------------------------------------------------------------------------

def new_token() -> str:
    """A fresh token, as a token file holds it."""
    return secrets.token_hex(TOKEN_BYTES)


def parse_token(text: str, where: str) -> bytes:
    """The token's bytes from its hex text (surrounding blanks ignored); a `JoinError`
    (permanent) naming ``where`` when it is not one."""
    value = text.strip()
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise JoinError(f"{where}: a token is hex digits (fdl-fabric makes one with "
                        f"`python3 -c 'import secrets; print(secrets.token_hex(32))'`)",
                        permanent=True) from None
    if len(raw) < TOKEN_MIN_BYTES:
        raise JoinError(f"{where}: a token has at least {TOKEN_MIN_BYTES * 2} hex digits, "
                        f"this one {len(value)}", permanent=True)
    return raw


def read_token_file(path: str) -> bytes:
    """The token a file holds. The file must be this user's, a regular file, and
    readable by nobody else (as ssh holds a private key): a token others can read is
    a token others hold."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise JoinError(f"{path}: cannot read the token file ({exc.strerror})",
                        permanent=True) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JoinError(f"{path}: the token file is not a regular file", permanent=True)
        if info.st_uid != os.geteuid():
            raise JoinError(f"{path}: the token file belongs to another user (uid "
                            f"{info.st_uid}); it must be yours", permanent=True)
        if info.st_mode & 0o077:
            raise JoinError(f"{path}: the token file is readable by others (mode "
                            f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it",
                            permanent=True)
        text = os.read(fd, 4096).decode("ascii", errors="replace")
    finally:
        os.close(fd)
    return parse_token(text, path)


def write_token_file(path: str, token: str) -> None:
    """A new token file, 0600 from its creation (never world-readable, even for an
    instant), failing if the path exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)


# -- the proofs ------------------------------------------------------------------------------

def cert_hash(der: bytes) -> bytes:
    """What both proofs bind: the SHA-256 of the launcher's certificate as this
    connection presented it (``tls-server-end-point``)."""
    return hashlib.sha256(der).digest()


def proof(token: bytes, role: str, binding: bytes, joiner_nonce: bytes,
          launcher_nonce: bytes) -> str:
    """One side's proof (``role``: ``launcher`` or ``joiner``), as hex. The role is in the
    MAC, so the launcher's proof can never be replayed as a joiner's."""
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in (MAGIC, role.encode(), binding, joiner_nonce, launcher_nonce):
        mac.update(_LENGTH.pack(len(part)) + part)
    return mac.hexdigest()


def proof_holds(token: bytes, role: str, binding: bytes, joiner_nonce: bytes,
                launcher_nonce: bytes, given: object) -> bool:
    """Does ``given`` prove ``role`` holds the token on this connection? (Constant time.)"""
    return isinstance(given, str) and hmac.compare_digest(
        proof(token, role, binding, joiner_nonce, launcher_nonce), given)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def nonce_bytes(value: object) -> bytes:
    """A nonce as sent; a `JoinError` when it is not one."""
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != NONCE_BYTES:
        raise JoinError("the peer's nonce is not one")
    return raw


# -- messages --------------------------------------------------------------------------------

def pack(message: Mapping[str, Any]) -> bytes:
    """One message on the wire."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MESSAGE_MAX:
        raise JoinError(f"a join message of {len(body)} bytes is over {MESSAGE_MAX}")
    return _LENGTH.pack(len(body)) + body


def unpack(read_exactly: Callable[[int], bytes]) -> dict[str, Any]:
    """The next message, read with ``read_exactly(n)`` (which raises on end of input or
    its deadline); a `JoinError` on anything that is not a bounded JSON object."""
    (size,) = _LENGTH.unpack(read_exactly(_LENGTH.size))
    if size > MESSAGE_MAX:
        raise JoinError(f"the peer announced a message of {size} bytes (over {MESSAGE_MAX})")
    try:
        message = json.loads(read_exactly(size))
    except ValueError:
        raise JoinError("the peer sent a message that is not JSON") from None
    if not isinstance(message, dict):
        raise JoinError("the peer sent a message that is not a JSON object")
    return message
