"""Why a connection failed, in the user's words: one pure translation, exception -> line.

paramiko says ``[Errno None] Unable to connect to port 6392``, ``Error reading SSH
protocol banner`` or ``No existing session``, and shows host keys as MD5 hex. What a
user needs is what failed, where, and what to do: "connection refused by
root@10.0.0.7:6392", "no SSH banner within 10 s", "authentication refused for
root@10.0.0.7:6392 with key ~/.ssh/id_ed25519", a changed host key as OpenSSH shows it
(SHA256), with the known_hosts file and the ``ssh-keygen -R`` line to run. Every path
that connects (launch, status, stacks, cleanup, the pre-flight, ``fab -H … cleanup``)
gets its reason from `describe`, through `fdl_fabric.transport.ssh`.

`describe` reads only its arguments (the exception, a `Destination`, and what the SSH
handshake had reached, `Handshake`), so every case is tested on real paramiko exception
objects without a network (tests/test_connerrors.py).

Where the worker came from (`Origin`) is added when it helps: ``cluster.yml:12`` for a
worker of a cluster file; for hosts named on the command line (``--hosts``, ``fab -H``)
a failure on port 22, the port they reach unless told, points to ``--port`` and ``-F``.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shlex
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import paramiko


@dataclass(frozen=True)
class Origin:
    """Where a host was named: a cluster file's line, or a command-line flag."""

    #: The cluster file and the line of the worker (None: not from a file).
    file: Optional[str] = None
    line: int = 0
    #: The flag that named the host (``--hosts``, ``--hostfile``, ``-H``), or None.
    flag: Optional[str] = None

    @property
    def place(self) -> Optional[str]:
        """``cluster.yml:12``, or None."""
        if self.file and self.line > 0:
            return f"{self.file}:{self.line}"
        return None


@dataclass(frozen=True)
class Destination:
    """What the connection was asked to reach, as the user wrote it."""

    target: str
    user: Optional[str] = None
    port: Optional[int] = None
    #: The identity files offered (empty: ssh-agent and the default keys).
    keys: tuple[str, ...] = ()
    known_hosts: str = "~/.ssh/known_hosts"
    config_file: Optional[str] = None
    #: Seconds each of the TCP connect, the banner and the authentication may take.
    timeout: float = 10.0
    origin: Optional[Origin] = None

    @property
    def address(self) -> str:
        """``user@target:port`` (the port only when one is set)."""
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{self.target}{port}"

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts files this host under: ``[addr]:port`` off port 22."""
        port = self.port or 22
        return self.target if port == 22 else f"[{self.target}]:{port}"


@dataclass(frozen=True)
class Handshake:
    """How far the SSH handshake got before the failure (None: not known)."""

    #: The server's ``SSH-2.0-…`` line arrived.
    banner: bool = False
    #: The key exchange completed (the host key was checked).
    kex: bool = False


def describe(exc: BaseException, dest: Optional[Destination] = None,
             handshake: Optional[Handshake] = None) -> str:
    """One line: what failed, for which destination, and what to do about it."""
    dest = dest or Destination(target="the host")
    text = _what(exc, dest, handshake)
    origin = dest.origin
    if origin is not None and origin.place:
        text += f"; worker at {origin.place}"
    return text


#: How one kind of failure reads: the line, or None when this case does not apply to
#: ``exc`` after all (the next case of `_CASES` is asked).
_Say = Callable[[Any, Destination, Optional[Handshake]], Optional[str]]


def _what(exc: BaseException, dest: Destination, handshake: Optional[Handshake]) -> str:
    for kinds, say in _CASES:
        if isinstance(exc, kinds):
            text = say(exc, dest, handshake)
            if text is not None:
                return text
    return f"{dest.address}: {type(exc).__name__}: {exc}"


def _missing_key(exc: FileNotFoundError, dest: Destination, _h: Optional[Handshake]
                 ) -> Optional[str]:
    if exc.filename not in dest.keys:
        return None
    return f"identity file {exc.filename} does not exist ({dest.address} with " \
           f"{_keys(dest)})"


def _bad_host_key(exc: paramiko.BadHostKeyException, dest: Destination,
                  _h: Optional[Handshake]) -> str:
    return changed_host_key(dest, exc.key, exc.expected_key, exc.hostname)


def _unknown_host_key(exc: paramiko.SSHException, dest: Destination,
                      _h: Optional[Handshake]) -> Optional[str]:
    if "not found in known_hosts" not in str(exc):
        return None
    return (f"host key of {dest.known_hosts_name} is unknown and StrictHostKeyChecking=yes"
            f": add it to {dest.known_hosts} (ssh-keyscan -p {dest.port or 22} "
            f"{dest.target} prints it; check it before you add it)")


def _encrypted_key(_exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    keys = ", ".join(dest.keys) or "offered"
    return (f"the key {keys} is encrypted and nothing may ask for its passphrase "
            f"(BatchMode): load it into ssh-agent with ssh-add ({dest.address})")


def _auth_type(exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    allowed = ", ".join(getattr(exc, "allowed_types", []) or []) or "none"
    return (f"authentication refused for {dest.address}: the server accepts only "
            f"{allowed}, and a launcher can only use keys")


def _auth_refused(_exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    return (f"authentication refused for {dest.address} with {_keys(dest)}: is its "
            f"public key in ~{dest.user or ''}/.ssh/authorized_keys there?")


def _no_valid(exc: Any, dest: Destination, h: Optional[Handshake]) -> str:
    inner = list(exc.errors.values())
    codes = {getattr(e, "errno", None) for e in inner}
    if codes <= {errno.ECONNREFUSED}:
        return _refused(exc, dest, h)
    return f"unreachable: no route to {dest.address} ({_strerror(inner[0])})"


def _unresolved(exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    return f"unreachable: the name {dest.target} does not resolve ({_strerror(exc)})"


def _timed_out(_exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    return (f"unreachable: no answer from {dest.address} within {dest.timeout:g} s (the "
            f"host is down, or a firewall drops the packets{_port_hint(dest)})")


def _refused(_exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    return f"unreachable: connection refused by {dest.address}" \
           f" (no SSH server listens on that port{_port_hint(dest)})"


def _os_error(exc: BaseException, dest: Destination, _h: Optional[Handshake]) -> str:
    return f"unreachable: {dest.address}: {_strerror(exc)}"


def _ssh_failure(exc: paramiko.SSHException, dest: Destination,
                 handshake: Optional[Handshake]) -> str:
    """A failure inside the SSH protocol: the banner, the key exchange, a lost session."""
    t = f"{dest.timeout:g} s"
    said = str(exc)
    cause = exc.__cause__ or exc.__context__
    if said.startswith("Error reading SSH protocol banner") or (
            handshake is not None and not handshake.banner):
        if cause is None or isinstance(cause, (socket.timeout, TimeoutError)) or \
                "Error reading" not in said:
            return (f"no SSH banner within {t} from {dest.address} (an sshd that is frozen "
                    f"or overloaded, or a port that is not SSH{_port_hint(dest)})")
        return (f"{dest.address} closed the connection before its SSH banner (sshd's "
                "MaxStartups turned it away, or the port is not SSH)")
    if said.startswith("Indecipherable protocol version"):
        return f"{dest.address} does not speak SSH: it answered {said.partition(' ')[2][:80]}"
    if handshake is not None and not handshake.kex:
        return f"no SSH key exchange within {t} with {dest.address} (sshd is overloaded " \
               "or frozen)"
    if said in ("No existing session", "SSH session not active"):
        return f"the SSH connection to {dest.address} was lost during the login"
    return f"SSH failed with {dest.address}: {said or type(exc).__name__}"


#: The cases, in order: the first whose type matches and whose line is not None wins
#: (subclasses before their bases: paramiko's auth errors are SSHExceptions, and the
#: socket errors are OSErrors).
_CASES: tuple[tuple[Any, _Say], ...] = (
    (FileNotFoundError, _missing_key),
    (paramiko.BadHostKeyException, _bad_host_key),
    (paramiko.SSHException, _unknown_host_key),
    (paramiko.PasswordRequiredException, _encrypted_key),
    (paramiko.BadAuthenticationType, _auth_type),
    (paramiko.AuthenticationException, _auth_refused),
    (paramiko.ssh_exception.NoValidConnectionsError, _no_valid),
    (socket.gaierror, _unresolved),
    (paramiko.SSHException, _ssh_failure),
    ((socket.timeout, TimeoutError), _timed_out),
    (ConnectionRefusedError, _refused),
    (OSError, _os_error),
)


def changed_host_key(dest: Destination, got: Any, expected: Any,
                     name: Optional[str] = None) -> str:
    """A changed host key as OpenSSH says it: both SHA256 fingerprints, the file, the fix.
    ``name``: the one paramiko looked up (after ssh_config aliases), else the target's."""
    port = dest.port or 22
    if name and not name.startswith("[") and port != 22:  # paramiko gives the bare name
        name = f"[{name}]:{port}"
    name = name or dest.known_hosts_name
    known = dest.known_hosts
    return (f"host key has CHANGED for {name}: it now presents {got.get_name()} "
            f"{fingerprint(got)}, {known} has {expected.get_name()} {fingerprint(expected)}; "
            "refusing to connect (someone may be intercepting the connection). If the host "
            f"was reinstalled, run: ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(known)}")


def fingerprint(key: Any) -> str:
    """``SHA256:…``, as ``ssh-keygen -l`` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _keys(dest: Destination) -> str:
    if dest.keys:
        return "key " + ", ".join(dest.keys)
    return "ssh-agent and the default keys (~/.ssh/id_*)"


def _strerror(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or exc or type(exc).__name__)


def _port_hint(dest: Destination) -> str:
    """For hosts from the command line on port 22 (the one they reach unless told): the
    flags that set another."""
    origin = dest.origin
    if origin is None or not origin.flag or (dest.port or 22) != 22:
        return ""
    if origin.flag == "-H":
        return "; fab -H takes user@host:port"
    return f"; {origin.flag} reaches port 22 unless told: give --port, or -F ssh_config " \
           "with a Port for each host"


def from_settings(settings: Any, origin: Optional[Origin] = None) -> Destination:
    """The destination of resolved `sshconfig.SshSettings`."""
    return Destination(target=settings.target, user=settings.user, port=settings.port,
                       keys=tuple(settings.identity_files),
                       known_hosts=settings.known_hosts_file,
                       config_file=settings.config_file,
                       timeout=float(settings.connect_timeout or 10.0), origin=origin)


def from_connection(conn: Any, origin: Optional[Origin] = None) -> Destination:
    """The destination of a Fabric Connection built elsewhere (``fab -H``)."""
    keys = conn.connect_kwargs.get("key_filename") or ()
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    port = int(conn.port) if conn.port else None
    timeout = conn.connect_kwargs.get("timeout") or conn.connect_timeout or 10.0
    return Destination(target=str(conn.host), user=conn.user, port=port, keys=keys,
                       known_hosts=os.path.expanduser("~/.ssh/known_hosts"),
                       timeout=float(timeout), origin=origin)


def origins(workers: Iterable[Any], file: Optional[str], *,
            flag: Optional[str] = None) -> dict[str, Origin]:
    """Each worker's `Origin`, by host: its line of ``file`` (a cluster file), or the
    ``flag`` that named it (``--hosts``, ``--hostfile``: their line numbers are not the
    user's, so none is given)."""
    if flag is not None or not file:
        return {w.host: Origin(flag=flag) for w in workers}
    return {w.host: Origin(file=file, line=int(w.line)) for w in workers}


def mark(transports: Mapping[str, Any], found: Mapping[str, Origin]) -> None:
    """Tell each transport where its host was named (read when a connect fails)."""
    for host, transport in transports.items():
        if host in found:
            transport.origin = found[host]
